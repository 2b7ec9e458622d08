"""Placement: data parallel over the compute devices of one or several processes.

One compute device: arrays live on it (SingleDeviceSharding) and the device functions run as
written. Several (local devices, or processes started with `jax.distributed`): a 1-D mesh with one
axis, `data`, over every compute device of every process, and

    weights     each unit's bus copy is put on every device (replicated, P()): it crosses each
                device's own link once
    batch       a step's micro-batches stacked (M, rows, ...), the rows split over `data`
                (P(None, "data")); a process gives only its own rows (`put_batch`)
    gradients   each device accumulates its own partial sum over its rows and micro-batches inside
                the call that makes a unit's gradient, which ends by summing them over the devices
                (`reduce`: an XLA all-reduce, NCCL on GPUs, gloo between CPU processes) once per
                unit and step; the sum crosses to the host once per process
    scalars     loss sums, loss weights and a block's aux statistics are summed over the devices
                inside the function that makes them (psum)

Sharded host state (`shard=True`, the layout in shard.py): each process holds only its rows of
every unit, so

    weights     each device gets its own row-piece of the bus copy (1/N of the unit's bytes per
                link); one jitted function per unit structure all-gathers the pieces over `data`
                and cuts the padding off (`put_shards`)
    gradients   the partial sums are reduce-scattered instead (psum_scatter over `data`): each
                device keeps the total of its own rows, and only this process's pieces cross to
                the host (`own_pieces`, engine/transfer.py): its gradient shard

The device functions are the single-device ones under `jax.shard_map` (functions.py): each device
computes on its rows exactly as one device would on the whole batch, so the sum of the partial
gradients is the gradient of the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from megatrain_jax.engine.shard import Shards, unpad

AXIS = "data"


def sum_squares(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


class Placement:
    """Where a step's arrays live, for `devices`: the compute devices of every process, in mesh
    order (one device and one process: no mesh). shard: the sharded host layout (`shards`, a
    shard.Shards; None when the host state is replicated, always on one device). put: what
    makes its copies (jax.device_put's signature)."""

    def __init__(self, devices, shard: bool = False, put=jax.device_put):
        self.devices = tuple(devices)
        self.put = put  # every copy it makes (the engine's counts them: stream.Counters.put)
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
            self.batch = NamedSharding(self.mesh, P(None, AXIS))  # (micro-batch, rows, ...)
        else:
            self.mesh = None
            self.weights = self.batch = SingleDeviceSharding(self.devices[0])
        self.shards = None
        if shard and self.data_parallel:
            first = self.devices.index(self.local_devices[0])
            if self.devices[first:first + len(self.local_devices)] != tuple(self.local_devices):
                raise ValueError(f"shard_host_state: process {me}'s compute devices are not "
                                 f"consecutive in the mesh")
            self.shards = Shards(len(self.devices), first, len(self.local_devices))
            self.pieces = NamedSharding(self.mesh, P(AXIS))  # a padded leaf, split by rows
            # Compiled once per unit structure (the rows are static): XLA inserts the all-gather.
            self._gather = jax.jit(unpad, static_argnums=1, out_shardings=self.weights)
            self._sum = jax.jit(jnp.sum, out_shardings=self.weights)

    @property
    def size(self) -> int:
        """Devices the batch is split over."""
        return len(self.devices)

    # ----------------------------------------------------------------- putting arrays
    def put_weights(self, tree):
        """`tree` (host or pinned-host arrays) copied to every compute device: replicated."""
        if not self.data_parallel:
            return self.put(tree, self.weights)

        def replicate(x):
            copies = [self.put(x, SingleDeviceSharding(d)) for d in self.local_devices]
            return jax.make_array_from_single_device_arrays(x.shape, self.weights, copies)

        return jax.tree.map(replicate, tree)

    def put_shards(self, tree, shapes):
        """This process's rows of every leaf (the sharded layout: host or pinned-host arrays) ->
        the whole leaves, shaped `shapes` (a matching list of logical shapes), on every device."""
        leaves, treedef = jax.tree.flatten(tree)
        shards = self.shards

        def assemble(x, shape):
            pieces = [self.put(piece, SingleDeviceSharding(d))
                      for piece, d in zip(shards.pieces(x), self.local_devices)]
            return jax.make_array_from_single_device_arrays(shards.padded_shape(shape),
                                                            self.pieces, pieces)

        padded = [assemble(x, shape) for x, shape in zip(leaves, shapes)]
        return jax.tree.unflatten(treedef, self._gather(padded, tuple(s[0] for s in shapes)))

    def put_batch(self, tree):
        """This process's rows of a step's micro-batches (numpy arrays shaped (M, rows, ...); or a
        pytree of them) as global arrays, the rows split over `data`. One process: all the
        rows."""
        if not self.data_parallel or jax.process_count() == 1:
            return self.put(tree, self.batch)

        def put(x):
            x = np.asarray(x)
            global_shape = (x.shape[0], x.shape[1] * jax.process_count()) + x.shape[2:]
            return jax.make_array_from_process_local_data(self.batch, x, global_shape)

        return jax.tree.map(put, tree)

    def local(self, tree):
        """A replicated (or single-device) result as one array on this process's first compute
        device: what crosses to the host, or is read as a Python number."""
        if not self.data_parallel:
            return tree
        return jax.tree.map(lambda x: x.addressable_data(0), tree)

    def own_pieces(self, x) -> list:
        """A reduced gradient leaf (`reduce`'s) as the arrays of it this process sends to its
        host: the whole sum (on its first device), or in the sharded layout this process's
        pieces, in row order (concatenated on the host)."""
        if self.shards is None:
            return [self.local(x)]
        pieces = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
        return [s.data for s in pieces]

    # ----------------------------------------------------------------- device functions
    def sum_over_devices(self, tree):
        """Inside a device function: the sum over every device (identity on one device)."""
        return jax.lax.psum(tree, AXIS) if self.data_parallel else tree

    def spread(self, fn, in_specs, out_specs, **jit_kwargs):
        """fn (written for one device) jitted to run on every device of the mesh over its rows.
        Specs per argument/result: "w" replicated, "b" stacked micro-batches (their rows split
        over `data`), "r" a gradient `reduce` made (replicated, or split by rows in the sharded
        layout); a pytree argument takes one spec for all its leaves."""
        if not self.data_parallel:
            return jax.jit(fn, **jit_kwargs)
        spec = {"w": P(), "b": P(None, AXIS), "r": P() if self.shards is None else P(AXIS)}
        to_spec = lambda s: None if s is None else spec[s]  # None: an argument that is None
        ins = tuple(to_spec(s) for s in in_specs)
        outs = tuple(to_spec(s) for s in out_specs) if isinstance(out_specs, tuple) else \
            to_spec(out_specs)
        # check_vma=False: a weight's gradient on a device is its partial sum over that device's
        # rows (with it on, the transpose of the replicated weights would psum every micro-batch).
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=ins, out_specs=outs,
                                     check_vma=False), **jit_kwargs)

    def reduce(self, acc) -> tuple:
        """Inside a device function (spread's): (the sum over the devices of their partial sums
        `acc`, its sum of squares). The sum is replicated, or in the sharded layout
        reduce-scattered: leaves padded to N c rows, split over `data` (device k holds rows
        [k c, (k + 1) c) of the total); the sum of squares is the whole gradient's either way, on
        every device. One device: acc itself."""
        if not self.data_parallel:
            return acc, sum_squares(acc)
        if self.shards is None:
            g = jax.tree.map(lambda a: jax.lax.psum(a, AXIS), acc)
            return g, sum_squares(g)

        def one(g):
            padded = self.shards.padded_shape(g.shape)[0]
            g = jnp.pad(g, [(0, padded - g.shape[0])] + [(0, 0)] * (g.ndim - 1))
            return jax.lax.psum_scatter(g, AXIS, scatter_dimension=0, tiled=True)
        g = jax.tree.map(one, acc)
        return g, jax.lax.psum(sum_squares(g), AXIS)
