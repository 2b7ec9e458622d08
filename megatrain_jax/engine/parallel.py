"""Placement: data parallel over the compute devices of one or several processes.

One compute device: arrays live on it (SingleDeviceSharding) and the device functions run as
written. Several (local devices, or processes started with `jax.distributed`): a 1-D mesh with one
axis, `data`, over every compute device of every process, and

    weights     each unit's bus copy is put on every device (replicated, P()): it crosses each
                device's own link once
    batch       each micro-batch's batch dimension is split over `data` (P("data")); a process
                gives only its own rows (`put_batch`)
    gradients   each device accumulates its own partial sum over its rows and micro-batches, a
                (devices, ...) array split over `data`; `reduce` sums them over the devices on the
                device side (an XLA all-reduce: NCCL on GPUs, gloo between CPU processes) once per
                unit and step, and the sum crosses to the host once per process
    scalars     loss sums, loss weights and a block's aux statistics are summed over the devices
                inside the function that makes them (psum)

The device functions are the single-device ones under `jax.shard_map` (functions.py): each device
computes on its rows exactly as one device would on the whole batch, so the sum of the partial
gradients is the gradient of the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

AXIS = "data"


class Placement:
    """Where a step's arrays live, for `devices`: the compute devices of every process, in mesh
    order (one device and one process: no mesh)."""

    def __init__(self, devices):
        self.devices = tuple(devices)
        if not self.devices:
            raise ValueError("no compute device")
        self.data_parallel = len(self.devices) > 1
        me = jax.process_index()
        self.local_devices = [d for d in self.devices if d.process_index == me]
        if not self.local_devices:
            raise ValueError(f"process {me} has no compute device in the mesh")
        if self.data_parallel:
            self.mesh = Mesh(np.array(self.devices), (AXIS,))
            self.weights = NamedSharding(self.mesh, P())
            self.batch = NamedSharding(self.mesh, P(AXIS))
        else:
            self.mesh = None
            self.weights = self.batch = SingleDeviceSharding(self.devices[0])

    @property
    def size(self) -> int:
        """Devices the batch is split over."""
        return len(self.devices)

    # ----------------------------------------------------------------- putting arrays
    def put_weights(self, tree):
        """`tree` (host or pinned-host arrays) copied to every compute device: replicated."""
        if not self.data_parallel:
            return jax.device_put(tree, self.weights)

        def replicate(x):
            copies = [jax.device_put(x, SingleDeviceSharding(d)) for d in self.local_devices]
            return jax.make_array_from_single_device_arrays(x.shape, self.weights, copies)

        return jax.tree.map(replicate, tree)

    def put_batch(self, tree):
        """This process's rows of a micro-batch (numpy arrays, batch first; or a pytree of them)
        as global arrays split over `data`. One process: all the rows."""
        if not self.data_parallel or jax.process_count() == 1:
            return jax.device_put(tree, self.batch)

        def put(x):
            x = np.asarray(x)
            global_shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
            return jax.make_array_from_process_local_data(self.batch, x, global_shape)

        return jax.tree.map(put, tree)

    def local(self, tree):
        """A replicated (or single-device) result as one array on this process's first compute
        device: what crosses to the host, or is read as a Python number."""
        if not self.data_parallel:
            return tree
        return jax.tree.map(lambda x: x.addressable_data(0), tree)

    # ----------------------------------------------------------------- device functions
    def sum_over_devices(self, tree):
        """Inside a device function: the sum over every device (identity on one device)."""
        return jax.lax.psum(tree, AXIS) if self.data_parallel else tree

    def acc_shape(self, shape) -> tuple:
        """A device's gradient accumulator of a weight shaped `shape`: one partial sum per device
        along a leading axis split over `data`."""
        return (1,) + tuple(shape) if self.data_parallel else tuple(shape)

    def spread(self, fn, in_specs, out_specs, **jit_kwargs):
        """fn (written for one device) jitted to run on every device of the mesh over its rows.
        Specs per argument/result: "w" replicated, "b" split over `data` (batch rows, or the
        accumulators' device axis); a pytree argument takes one spec for all its leaves."""
        if not self.data_parallel:
            return jax.jit(fn, **jit_kwargs)
        spec = {"w": P(), "b": P(AXIS)}
        to_spec = lambda s: None if s is None else spec[s]  # None: an argument that is None
        ins = tuple(to_spec(s) for s in in_specs)
        outs = tuple(to_spec(s) for s in out_specs) if isinstance(out_specs, tuple) else \
            to_spec(out_specs)
        # check_vma=False: a weight's gradient on a device is its partial sum over that device's
        # rows (with it on, the transpose of the replicated weights would psum every micro-batch).
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=ins, out_specs=outs,
                                     check_vma=False), **jit_kwargs)

    def reducer(self):
        """acc -> the sum over the devices of their partial sums, replicated (jitted)."""
        if not self.data_parallel:
            return lambda acc: acc
        total = lambda acc: jax.tree.map(lambda a: jax.lax.psum(a[0], AXIS), acc)
        return jax.jit(jax.shard_map(total, mesh=self.mesh, in_specs=P(AXIS), out_specs=P(),
                                     check_vma=False))


def zeros_like_acc(placement: Placement):
    """w -> fp32 zero accumulators (see Placement.acc_shape), jitted."""
    def zeros(w):
        return jax.tree.map(lambda p: jnp.zeros(placement.acc_shape(p.shape), jnp.float32), w)
    return placement.spread(zeros, ("w",), "b")
