"""Every copy between host and device memory: weights in, batch in, activations out and back,
gradients out (a bus copy's own copies, made and refreshed, are bus.py's). Each returns what to wait on: the copied arrays themselves (a jax
array is ready when its copy is done), or for gradients a `Parcel`.

Copies made on the thread that dispatches device work stay inside the compute device's client:
its `device` memory and its `pinned_host` memory, which it reads and writes by DMA. The hop
between that client and the CPU client, where the host state and optax live, is made only on
the host-update thread (`arrive`, called by engine/update.py; bus.py's `refresh`), so it never blocks
dispatch. With no accelerator (state and compute on one device) nothing crosses.

A backend whose compute device has no `pinned_host` memory takes the documented fallback:
gradients go straight to the host device's memory and bus copies wait there (copies across
clients, on the dispatching thread); `Transfers` logs it once, naming the device.

Weights in and gradients out take one of two forms (`copies_form`): `eager`, a `device_put` of
their own issued between the jitted calls, or `jit`, made inside a jitted call that also computes
(`with_copies`, `Transfers.in_call`): a memory-kind `device_put` in the jit, which XLA makes an
asynchronous copy beside the call's compute. An eager copy issued behind queued compute waits for
it, while one inside the call runs during it (docs/benchmarks.md "Transfers": the GPU's overlap
figures), so on an accelerator the jit form is the default.
"""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine.schedule import EAGER, FORMS, HOST_READ, JIT

log = logging.getLogger(__name__)

PINNED = "pinned_host"
COPIES = ("auto",) + FORMS  # offload.copies: schedule.FORMS (EAGER, JIT) or auto


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def across_clients(x, sharding, counters=None):
    """x copied to `sharding`. Between two clients (the GPU's pinned host memory and the CPU
    backend) jax's own copy is slow; a numpy view of host-resident x (zero-copy for the CPU
    backend and pinned_host) put on `sharding` is one host memcpy, several times faster
    (docs/benchmarks.md, "Transfers": between jax's clients). Within one client: jax's copy.
    counters (stream.Counters): the copy and the view's wait counted there."""
    put = jax.device_put if counters is None else counters.put
    if not isinstance(x, jax.Array):  # numpy (the disk tier's views): one host copy already
        return put(x, sharding)
    if x.sharding == sharding:  # already there (state and compute on one device): device_put
        # would only commit x, at a cost of host-thread time for every leaf
        # (docs/results/2026-11-26-host-optimizer.md, the host thread's gaps); an uncommitted x
        # is on the default device, which is then `sharding`'s anyway
        return x
    device = next(iter(x.sharding.device_set))
    target = next(iter(sharding.device_set))
    host_resident = device.platform == "cpu" or x.sharding.memory_kind == PINNED
    if not crosses_clients(device, target) or not host_resident:
        return put(x, sharding)
    t0 = time.perf_counter()
    view = np.asarray(x)  # waits for x
    if counters is not None:
        counters.synced(HOST_READ, time.perf_counter() - t0)
    return put(view, sharding)


def crosses_clients(source, target) -> bool:
    """Whether a copy from device `source` to device `target` goes between two of jax's clients
    (an accelerator's and the CPU backend's), where across_clients takes the numpy view."""
    return source.platform != target.platform


def memory_kinds(device) -> set:
    return {m.kind for m in device.addressable_memories()}


def why_eager(*, accelerator: bool, pinned: bool, data_parallel: bool, prefetch: int):
    """Why the copies cannot be made inside the jitted calls (None: they can). accelerator: the
    compute device is not the host's CPU backend; pinned: it has pinned_host memory."""
    if not accelerator:
        return "no accelerator (nothing crosses a bus)"
    if not pinned:
        return "the compute device has no pinned_host memory"
    if data_parallel:
        return "data parallel over several devices"
    if prefetch < 1:
        return "prefetch 0 (the next layer's copy would be resident beside the computing one)"
    return None


def copies_form(setting: str, *, accelerator: bool, platform: str, pinned: bool,
                data_parallel: bool, prefetch: int) -> str:
    """The form (EAGER or JIT) of weights in and gradients out for `setting` (COPIES), where
    accelerator: the compute device is not the host device; platform: the compute device's
    ("cpu" also where a CPU device stands in for an accelerator, as in tests); and what else
    decides (why_eager). auto: JIT on an accelerator that is not a CPU, with pinned_host memory
    (a GPU measured such copies overlapping compute where eager ones did not: docs/benchmarks.md
    "Transfers"), else EAGER. A setting that cannot run is a one-line ValueError."""
    if setting not in COPIES:
        raise ValueError(f"copies must be one of {', '.join(COPIES)}, got {setting!r}")
    why = why_eager(accelerator=accelerator, pinned=pinned, data_parallel=data_parallel,
                    prefetch=prefetch)
    if setting == JIT and why is not None:
        raise ValueError(f"copies='jit' cannot run: {why}")
    if setting == "auto":
        return JIT if why is None and platform != "cpu" else EAGER
    return setting


def with_copies(fn, device):
    """fn(*args) as a function of (fetch, out, *args) returning (fn(*args), fetch copied to
    `device`'s memory, out copied to its pinned host memory), all in one computation: the copies
    run beside fn's compute. fetch: pinned host arrays (a bus copy, saved activations) or None;
    out: device arrays (a gradient) or None. To be jitted; each structure compiles once."""
    to_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    to_pinned = jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED)

    def carried(fetch, out, *args):
        return fn(*args), jax.device_put(fetch, to_device), jax.device_put(out, to_pinned)
    return carried


class Parcel:
    """A gradient on its way out: this process's pieces of every array of it (a layer unit's
    flat gradient is one: engine/packing.py) in the compute device's pinned host memory (or, in
    the fallback, already in the host device's)."""

    def __init__(self, treedef, pieces: list):
        self.treedef, self.pieces = treedef, pieces  # per array: its pieces, in row order

    def token(self) -> list:
        """What to wait on for the copy out to be done."""
        return [p for leaf in self.pieces for p in leaf]

    def arrive(self, sharding):
        """The gradient as arrays on `sharding` (the host device): on the host-update thread."""
        leaves = []
        for leaf in self.pieces:
            moved = [across_clients(p, sharding) for p in leaf]
            leaves.append(moved[0] if len(moved) == 1 else jnp.concatenate(moved))
        return jax.tree.unflatten(self.treedef, leaves)


def arrive(tree, sharding):
    """A gradient (a Parcel) or host scalars (device arrays in pinned host memory) moved to
    `sharding`, the host device: the hop to the CPU client, made on the host-update thread."""
    parcel = lambda x: isinstance(x, Parcel)
    move = lambda x: x.arrive(sharding) if parcel(x) else across_clients(x, sharding)
    return jax.tree.map(move, tree, is_leaf=parcel)


class Transfers:
    """The copies the dispatching thread makes, for a Placement (parallel.py), counted in
    `counters` (stream.Counters). on_event(kind, what), when set, is told of each."""

    def __init__(self, placement, host_device, counters):
        self.placement, self.counters, self.on_event = placement, counters, None
        self.put = counters.put
        # bytes of a layer's bus copy (per link) and gradient (this process's), each counted at
        # its first copy: every layer has one structure
        self._layer_bytes = {}
        compute = placement.local_devices[0]
        self.accelerator = compute != host_device
        self.out_kind = None  # where gradients go: the compute device's pinned host memory
        if self.accelerator and PINNED in memory_kinds(compute):
            self.out_kind = PINNED
        elif self.accelerator:
            log.warning("%s (%s backend) has no %s memory: gradients and bus copies cross "
                        "directly to the host device %s (copies across clients, on the "
                        "dispatching thread)", compute, compute.platform, PINNED, host_device)
        self.host_sharding = jax.sharding.SingleDeviceSharding(host_device)

    def _event(self, what):
        if self.on_event is not None:
            self.on_event("transfer", what)

    def _bytes(self, kind: str, tree, layer: bool) -> int:
        """nbytes(tree), a layer's computed once (`kind` "weights" or "gradient")."""
        if not layer:
            return nbytes(tree)
        if kind not in self._layer_bytes:
            self._layer_bytes[kind] = nbytes(tree)
        return self._layer_bytes[kind]

    def weights_in(self, bus, shapes=None, layer: bool = False):
        """A unit's bus copy (or a part of it) on every compute device; shapes: the logical leaf
        shapes, in the sharded layout (each device gets its piece, then they all-gather); layer:
        it is a layer unit's."""
        placement = self.placement
        # per link: each device gets its own copy, or its piece
        self.counters.bytes_h2d += self._bytes("weights", bus, layer) // (
            1 if placement.shards is None else placement.shards.local)
        out = (placement.put_weights(bus) if placement.shards is None else
               placement.put_shards(bus, shapes))
        self._event("weights in")
        return out

    def in_call(self, fn, args, weights=None, activations=None, grads=None):
        """fn(fetch, out, *args) (a jitted with_copies function) with its copies made inside the
        call: `weights` (a layer unit's bus copy) and `activations` (saved inputs in pinned host
        memory) to the compute device, `grads` (a layer's reduced gradient on the device) to its
        pinned host memory. Returns (fn's result, (weights, activations) on the device, the
        gradient on its way out as a Parcel, or None). Counted and announced as the eager
        copies are, as "... in the call"."""
        fetch = None if weights is None and activations is None else (weights, activations)
        result, fetched, sent = fn(fetch, grads, *args)
        if weights is not None:
            self.counters.bytes_h2d += self._bytes("weights", weights, layer=True)
            self._event("weights in, in the call")
        if activations is not None:
            self._event("activations in, in the call")
        parcel = None if grads is None else self.made_out(sent, layer=True)
        return result, (None, None) if fetched is None else fetched, parcel

    def rows_in(self, rows):
        """The first stage's output rows (the micro-batches' stacked), computed on the host
        device (the host lookup, engine/lookup.py), put on the compute device: they cross instead
        of its weights. On an accelerator a hop between clients made on the dispatching thread,
        at the step's start, where the device has nothing queued that these rows would not be
        waited for by."""
        target = jax.sharding.SingleDeviceSharding(self.placement.local_devices[0])
        out = across_clients(rows, target, self.counters)
        self.counters.bytes_h2d += nbytes(rows)
        self._event("rows in")
        return out

    def batch_to_host(self, x):
        """A step's inputs for the host lookup: to the host device, not across the bus."""
        return self.put(x, self.host_sharding)

    def batch_in(self, tree):
        """This process's rows of a step's micro-batches (stacked) on the compute devices."""
        out = self.placement.put_batch(tree)
        self._event("batch in")
        return out

    def activations(self, xs, sharding, what):
        """A layer's saved inputs (the micro-batches' stacked) to or from the compute device's
        pinned host memory (`sharding`)."""
        out = self.put(xs, sharding)
        self._event(what)
        return out

    def grads_out(self, tree, layer: bool = False) -> Parcel:
        """A gradient reduced over the devices (Placement.reduce) to this process's host side:
        its pieces copied to the compute devices' pinned host memory (the fallback: to the host
        device). With no accelerator the arrays stay where they are. layer: a layer's."""
        leaves, treedef = jax.tree.flatten(tree)
        pieces = [self.placement.own_pieces(leaf) for leaf in leaves]
        if self.accelerator:  # one copy of them all
            flat = [p for parts in pieces for p in parts]
            moved = iter(self.put(flat, [self._out(p) for p in flat]))
            pieces = [[next(moved) for _ in parts] for parts in pieces]
        parcel = Parcel(treedef, pieces)
        self.counters.bytes_d2h += self._bytes("gradient", parcel.token(), layer)  # per process
        self._event("gradient out")
        return parcel

    def made_out(self, tree, layer: bool = False) -> Parcel:
        """A gradient a call made in the compute device's pinned host memory (a layer's, sent by
        the next layer's call; the jit form's stages' gradient, DeviceFunctions.stages): on its
        way out already, as grads_out's. layer: a layer's."""
        leaves, treedef = jax.tree.flatten(tree)
        self.counters.bytes_d2h += self._bytes("gradient", leaves, layer)
        self._event("gradient out, in the call")
        return Parcel(treedef, [[x] for x in leaves])

    def scalars_out(self, tree):
        """Scalars the host update reads (the global norm, the scale), as grads_out."""
        tree = self.placement.local(tree)
        if not self.accelerator:
            return tree
        return self.put(tree, jax.tree.map(self._out, tree))  # one copy of them all

    def _out(self, x):
        if self.out_kind is None:
            return self.host_sharding
        return jax.sharding.SingleDeviceSharding(next(iter(x.sharding.device_set)),
                                                 memory_kind=self.out_kind)

    def check(self, bus, bus_kind):
        """At engine start: bus copies and gradients live in the memory kind the plan counts
        (bus_kind for bus copies, None: the host device's default; the compute device's pinned
        host memory for gradients). Raises a one-line ValueError naming the kind and the backend
        otherwise (an XLA that puts them in device memory instead, which the plan never counts)."""
        compute = self.placement.local_devices[0]
        found = [("bus copies", x, bus_kind) for x in jax.tree.leaves(bus)[:1]]
        if self.out_kind is not None:
            probe = jax.device_put(jnp.zeros((), jnp.float32), compute)
            found.append(("gradients", jax.device_put(probe, self._out(probe)), self.out_kind))
        for what, x, kind in found:
            got = x.sharding.memory_kind
            if kind is not None and got != kind:
                raise ValueError(f"{what} land in memory kind {got!r}, not {kind!r}, on the "
                                 f"{compute.platform} backend ({compute}): the plan counts "
                                 f"them in {kind!r}")
