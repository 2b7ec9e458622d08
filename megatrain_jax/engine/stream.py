"""Transfers to and from the compute device, with a bound on what is resident there.

JAX dispatch is asynchronous: a Python loop can enqueue every layer's `device_put` (and allocate
its memory) long before the device computes the layer. `LayerStream` bounds that: before it fetches
layer `pos + prefetch` it waits until the device has finished with layer `pos - 1` and deletes that
layer's arrays, so at most `prefetch + 1` layers' weights (and saved activations) are resident.
It waits once per layer, never per micro-batch, and the device always has the current layer's work
queued while the host waits.
"""

import collections
import dataclasses

import jax


@dataclasses.dataclass
class Counters:
    """Running totals, for benchmarks and tests: bytes each way, seconds the host thread spent
    on updates (from taking a unit's update until its new bus copy is ready, so including any wait
    for that unit's gradient and the global norm to be computed), and seconds the step (main
    thread) waited for updates, i.e. the exposed part."""
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    host_update_s: float = 0.0
    host_wait_s: float = 0.0


def delete(tree):
    """Frees device arrays now (the runtime frees them once their pending work is done), instead
    of whenever Python drops its last reference."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class LayerStream:
    """Iterates `(layer, payload)` over `order`, `payload = fetch(layer)` fetched `prefetch` layers
    ahead. After dispatching a layer's work the caller calls `done(outputs, free)`: `outputs` is what
    that work produces, waited for before the layer is retired, and `free` the arrays deleted then
    (the fetched weights, unless fetching made no copy because they already lived on the device).

        stream = LayerStream(order, fetch, prefetch)
        for i, w in stream:
            ys = [block(w, x) for x in xs]
            stream.done(ys, free=w)
    """

    def __init__(self, order, fetch, prefetch: int):
        self.order, self.fetch, self.prefetch = list(order), fetch, prefetch
        self._finished = None  # (outputs, free) of the layer before the current one

    def __iter__(self):
        n = len(self.order)
        in_flight = collections.deque(self.fetch(i) for i in self.order[:self.prefetch])
        for pos, layer in enumerate(self.order):
            self._retire()
            if pos + self.prefetch < n:
                in_flight.append(self.fetch(self.order[pos + self.prefetch]))
            yield layer, in_flight.popleft()
        self._retire(wait=False)  # the rest of the step may go on while it computes

    def done(self, outputs, free=()):
        self._finished = (outputs, free)

    def _retire(self, wait: bool = True):
        if self._finished is None:
            return
        outputs, free = self._finished
        self._finished = None
        if wait:
            jax.block_until_ready(outputs)
        delete(free)


class Activations:
    """The input of every layer for every micro-batch, saved in the forward for the backward.

    Kept on the compute device, or (`offload`) copied to its pinned host memory as soon as the
    layer has run and fetched back, with the layer's weights, for the layer's backward."""

    def __init__(self, compute_device, offload: bool, sharding=None):
        """sharding: where saved inputs live on the devices (default: on compute_device); with
        offload, the same in pinned host memory."""
        self.offload = offload
        self.device = sharding or jax.sharding.SingleDeviceSharding(compute_device)
        if offload:
            kinds = {m.kind for m in compute_device.addressable_memories()}
            if "pinned_host" not in kinds:
                raise ValueError(f"train.offload_activations=true: the compute device "
                                 f"{compute_device} has no pinned_host memory (it has "
                                 f"{', '.join(sorted(kinds))})")
            self.host = self.device.with_memory_kind("pinned_host")
        self._saved = {}

    def save(self, layer: int, xs: list):
        """Saves layer's inputs; returns (the transfers to wait for, the device arrays to free
        once they are done)."""
        if not self.offload:
            self._saved[layer] = xs
            return (), ()
        self._saved[layer] = [jax.device_put(x, self.host) for x in xs]
        return self._saved[layer], xs

    def load(self, layer: int) -> list:
        xs = self._saved.pop(layer)
        return [jax.device_put(x, self.device) for x in xs] if self.offload else xs

    def clear(self):
        self._saved.clear()
