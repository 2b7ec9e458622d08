"""Streaming a pass's layers through the compute device, with a bound on what is resident there.

JAX dispatch is asynchronous: a Python loop can enqueue every layer's `device_put` (and allocate
its memory) long before the device computes the layer. `LayerStream` runs the pass's schedule
(engine/schedule.py): it dispatches layer `pos`, then waits until the device has finished layer
`pos - 1` and deletes that layer's arrays, then fetches layer `pos + prefetch`, so at most
`prefetch + 1` layers' weights (and saved activations) are resident, and the device always has
the current layer's work queued while the host waits. It waits once per layer, never per
micro-batch.
"""

import dataclasses
import threading
import time
from typing import Any, Callable, Optional

import jax

from megatrain_jax.engine import schedule, transfer
from megatrain_jax.engine.schedule import FIRST_STAGE_WAIT, RETIRE_WAIT, UPDATE_WAIT


@dataclasses.dataclass
class Counters:
    """Running totals, for benchmarks and tests: bytes each way, seconds the host thread spent
    on updates (from taking a unit's update until its new bus copy is ready, so including any wait
    for that unit's gradient and the global norm to be computed), and seconds the step (main
    thread) waited for updates, i.e. the exposed part. The wait also holds each hand-off from
    the host thread (the future's wake-up, taking the GIL back: up to its 5 ms switch interval),
    so with units of a few milliseconds it can exceed the update time itself."""
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    host_update_s: float = 0.0
    host_wait_s: float = 0.0
    # Bytes the host update copied on its thread besides its own work: hops between jax's clients
    # and any gradient it could not read in place (the direct update's path: 0)
    host_copy_bytes: int = 0
    # Bytes of unit state copied because a reader (a checkpoint being written, a caller's view)
    # still held the old state (direct.py's copy-on-write)
    host_snapshot_bytes: int = 0
    # Seconds of the host thread's update work once its inputs were there: host_update_s less
    # the waits for the unit's gradient and the global norm to arrive from the device
    host_compute_s: float = 0.0
    # Seconds the step (main thread) waited at the schedule's retires for a layer's device work:
    # with host_wait_s, what of a step's time the main thread did not spend dispatching
    device_wait_s: float = 0.0
    # The dispatching thread's own work, counted at the engine's call sites (its device functions,
    # copies, deletes and waits), on the thread that runs the step alone (`dispatcher`, set as
    # each step starts): jitted calls and the array leaves passed to them, eager device_puts and
    # their leaves, arrays deleted, its waits by kind (schedule.SYNCS; a wait for a host update
    # or for the first stage's host backward only where that was not done yet), and the seconds
    # it waited for the first stage's host backward (the host lookup's, engine/lookup.py)
    calls: int = 0
    arg_leaves: int = 0
    device_puts: int = 0
    put_leaves: int = 0
    deleted: int = 0
    syncs: dict = dataclasses.field(default_factory=dict)  # replaced, never changed in place:
    # a snapshot (dataclasses.replace) keeps its own
    first_stage_wait_s: float = 0.0
    dispatcher: Optional[int] = None

    def dispatching(self) -> bool:
        return threading.get_ident() == self.dispatcher

    def counted(self, fn):
        """fn (a jitted function) with its calls on the dispatching thread counted."""
        return Counted(fn, self)

    def put(self, tree, sharding):
        """jax.device_put(tree, sharding), counted on the dispatching thread."""
        if self.dispatching():
            self.device_puts += 1
            self.put_leaves += len(jax.tree.leaves(tree))
        return jax.device_put(tree, sharding)

    def synced(self, kind: str, seconds: float = 0.0):
        """A wait of `kind` (schedule.SYNCS) that took `seconds`: added to its bucket of seconds (a
        retire's to device_wait_s, an update's to host_wait_s, the first stage's to
        first_stage_wait_s), and counted when the dispatching thread made it."""
        bucket = {RETIRE_WAIT: "device_wait_s", UPDATE_WAIT: "host_wait_s",
                  FIRST_STAGE_WAIT: "first_stage_wait_s"}.get(kind)
        if bucket:
            setattr(self, bucket, getattr(self, bucket) + seconds)
        if self.dispatching():
            self.syncs = {**self.syncs, kind: self.syncs.get(kind, 0) + 1}


class Counted:
    """A jitted function whose calls on the dispatching thread a Counters counts (calls, array
    leaves passed); anything else (lower, eval_shape, ...) is the function's own."""

    def __init__(self, fn, counters: Counters):
        self.fn, self.counters = fn, counters

    def __call__(self, *args, **kwargs):
        counters = self.counters
        if counters.dispatching():
            counters.calls += 1
            counters.arg_leaves += len(jax.tree.leaves((args, kwargs)))
        return self.fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def delete(tree, counters: Optional[Counters] = None):
    """Frees device arrays now (the runtime frees them once their pending work is done), instead
    of whenever Python drops its last reference; counted in `counters` when given."""
    n = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()
            n += 1
    if counters is not None and counters.dispatching():
        counters.deleted += n


@dataclasses.dataclass(frozen=True)
class Carry:
    """How a layer's fetch is made inside a call (the jit form): `source(layer)` gives what the
    call copies to the device, (its bus copy, its saved inputs in pinned host memory or None), and
    `arrived(layer, (weights, inputs) copied)` makes the layer's payload of that copy."""
    source: Callable
    arrived: Callable


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """A gradient still to go out when its pass ended (the jit form's last layer): `key` what
    LayerStream.send was given with it, `grads` on the device, `free` its device arrays to delete
    once it is out. Made inside the next call that runs (the embedding backward's), or eagerly."""
    key: Any
    grads: Any
    free: list


class LayerStream:
    """Iterates `(layer, payload)` over `order`, `payload = fetch(layer)` fetched `prefetch` layers
    ahead (schedule.layer_ops). The caller dispatches a layer's work by `call(fn, args)`, may send
    the layer's gradient out by `send(key, grads)`, then calls `done(token, free, drop)`: `token`
    is what to wait on before the layer is retired, arrays that no later work donates (its
    outputs, or a scalar computed from them), `drop` the arrays of its fetch that the step may
    delete (the fetched weights, unless fetching made no copy because they already lived on the
    device) and `free` the other arrays deleted then. The order is schedule.walk's, which tells
    on_event(kind, layer), when given, of each dispatch and wait.

        stream = LayerStream(order, fetch, prefetch, transfers=transfers)
        for i, w in stream:
            ys = stream.call(block, (w, xs))
            stream.done(ys, drop=w)

    The copies' form (`copies`, schedule.EAGER or JIT) is the stream's alone, so a loop reads the
    same in both. Eager: every fetch is `fetch`'s, every gradient goes out at its `send`. Jit
    (`carry` a Carry): only the first `prefetch` layers are fetched by `fetch`; every other
    layer's fetch is made inside the `call` of the layer `prefetch` before it, beside its compute
    (transfers.in_call), and a layer's gradient goes out inside the next layer's `call`; the last
    layer's is left in `leaving` (an Outgoing) for the caller. `drop` is deleted right after the
    dispatch, `free` at the retire. `sent` holds each gradient's Parcel by its key.

    on_retire(layer, token), when given, is told as each layer's fetch has been read: token None
    once the retire waited for the layer's work, else (the pass's last layer, released without a
    wait) its token, still being computed (the bus ring's: engine/bus.py). `counters`
    (Counters), when given, counts the retires' waits (and their seconds in device_wait_s) and
    the deletes."""

    def __init__(self, order, fetch, prefetch: int, on_event=None, on_retire=None, counters=None,
                 *, copies: str = schedule.EAGER, carry: Optional[Carry] = None, transfers=None):
        if copies == schedule.JIT and carry is None:
            raise ValueError("the jit form's stream needs a Carry (how a call makes a fetch)")
        self.order, self.fetch, self.prefetch = list(order), fetch, prefetch
        self.counters = counters
        self.on_event = on_event
        self.on_retire = on_retire
        self.copies, self.carry, self.transfers = copies, carry, transfers
        self.sent, self.leaving = {}, None
        self._done = None
        self._ahead = self._carried = self._outgoing = None
        self._free, self._last = [], False

    def __iter__(self):
        source = None if self.copies == schedule.EAGER else (
            lambda layer: (layer, self.carry.source(layer)))
        for op, work in schedule.walk(self.order, self.prefetch, self.copies, self.fetch, source,
                                      self.on_event):
            if op == schedule.DISPATCH:
                self._ahead, self._carried, self._free = work.ahead, None, []
                self._last = work.layer == self.order[-1]
                waiting = self._outgoing  # the layer before's gradient, for this call to send
                yield work.layer, work.payload
                if waiting is not None and self._outgoing is waiting:
                    raise RuntimeError(f"layer {work.layer}'s dispatch made no call to send the "
                                       f"gradient of {waiting.key} out")
                token, free, drop = self._done or ((), (), ())
                work.carried, self._done, self._ahead = self._carried, None, None
                work.done = [token, (free, self._free), drop]
            elif op == schedule.DROP:  # the runtime frees them once the layer's work is done
                delete(work.done[2], self.counters)
                work.done[2] = ()
            else:  # retire (wait, then free) or release (the rest of the step goes on)
                token, free, drop = work.done
                if op == schedule.RETIRE:
                    t0 = time.perf_counter()
                    jax.block_until_ready(token)
                    if self.counters is not None:
                        self.counters.synced(RETIRE_WAIT, time.perf_counter() - t0)
                if self.on_retire is not None:
                    self.on_retire(work.layer, None if op == schedule.RETIRE else token)
                delete((drop, free), self.counters)

    def call(self, fn, args):
        """fn(*args) (a with_copies function: transfer.in_call) for the layer being dispatched,
        with the copies its call makes in the jit form: the fetch of the layer `prefetch` ahead,
        and the gradient sent by the layer before. Returns fn's result."""
        (layer, (weights, inputs)) = self._ahead or (None, (None, None))
        outgoing, self._ahead, self._outgoing = self._outgoing, None, None
        result, copied, parcel = self.transfers.in_call(
            fn, args, weights=weights, activations=inputs,
            grads=None if outgoing is None else outgoing.grads)
        if layer is not None:
            self._carried = self.carry.arrived(layer, copied)
        if outgoing is not None:
            self.sent[outgoing.key] = parcel
        return result

    def send(self, key, grads):
        """The dispatched layer's gradient (reduced, in the host's dtype) on its way to the host,
        its Parcel kept in sent[key]: now (eager), or inside the next layer's call (jit; the
        pass's last layer's: left in `leaving`). Its device arrays are freed at the layer's
        retire, once it is out."""
        if self.copies == schedule.EAGER:
            parcel = self.sent[key] = self.transfers.grads_out(grads, layer=True)
            kept = {id(x) for x in parcel.token()}  # no copy when they share a device
            self._free += [x for x in jax.tree.leaves(grads) if id(x) not in kept]
            return
        outgoing = Outgoing(key, grads, jax.tree.leaves(grads))
        if self._last:  # its arrays freed by whoever sends it
            self.leaving = outgoing
        else:  # freed at this layer's retire, which comes after the next layer's call
            self._outgoing = outgoing
            self._free += outgoing.free

    def done(self, token, free=(), drop=()):
        """The dispatched layer's arrays: what its retire waits on, frees and drops."""
        self._done = (token, free, drop)


class Activations:
    """The input of every layer (the micro-batches' stacked), saved in the forward for the
    backward.

    Kept on the compute device, or (`offload`) copied to its pinned host memory as soon as the
    layer has run and fetched back, with the layer's weights, for the layer's backward."""

    def __init__(self, compute_device, offload: bool, transfers, sharding=None):
        """sharding: where saved inputs live on the devices (default: on compute_device); with
        offload, the same in pinned host memory. transfers: the engine's transfer.Transfers."""
        self.offload, self.transfers = offload, transfers
        self.device = sharding or jax.sharding.SingleDeviceSharding(compute_device)
        if offload:
            kinds = transfer.memory_kinds(compute_device)
            if transfer.PINNED not in kinds:
                raise ValueError(f"train.offload_activations=true: the compute device "
                                 f"{compute_device} ({compute_device.platform} backend) has no "
                                 f"pinned_host memory (it has {', '.join(sorted(kinds))})")
            self.pinned_sharding = self.device.with_memory_kind("pinned_host")
        self._saved = {}

    def save(self, layer: int, xs):
        """Saves layer's inputs; returns the device arrays to free when the layer retires (the
        runtime frees them once their copy out is done)."""
        if not self.offload:
            self._saved[layer] = xs
            return ()
        self._saved[layer] = self.transfers.activations(xs, self.pinned_sharding,
                                                        "activations out")
        return xs

    def pinned(self, layer: int):
        """Offloaded: layer's saved inputs as they wait in pinned host memory, taken for a copy
        made inside a jitted call (the jit form); else None (load gives them)."""
        return self._saved.pop(layer) if self.offload else None

    def load(self, layer: int):
        xs = self._saved.pop(layer)
        if not self.offload:
            return xs
        return self.transfers.activations(xs, self.device, "activations in")

    def clear(self):
        self._saved.clear()
