"""One training step, top to bottom: the schedule of transfers and device work.

The step's M micro-batches are stacked, (M, rows, ...), and every call on the device takes them
all: one jitted call per layer and pass (a lax.scan over the micro-batches inside it, each computed as it
would be alone, every sum over them in their order: engine/functions.py), so the dispatching
thread's work is O(layers), not O(layers x micro-batches).

    embed     fetch the first stage's weights (unit 0); x_0[m] = first(inputs[m]), one call
    forward   for layer i (weights prefetched, at most prefetch + 1 resident), one call:
                x_{i+1}[m] (, aux_i[m]) = block_i(x_i[m]) for every m; save x_i (on the device,
                or offloaded to host)
    loss      fetch the last stage's weights (the last unit; tied leaves from unit 0); one call:
              loss = sum(loss_sum[m]) / sum(weight[m]) (, stats summed), dx[m] = grad(last)(x_L[m])
              and its gradient, which stays on the device until the embed backward; with aux:
              aux loss and daux = grad(aux_loss) of the sum of every aux_i[m] (see functions.py)
    backward  for layer i in reverse (weights and saved inputs fetched ahead), one call:
                dW_i = 0; dx[m], dW_i += vjp(block_i)(x_i[m], (dx[m], daux)) for every m (the
                block recomputed); dW_i summed over the devices, its sum of squares, cast
              dW_i goes out to the host while the next layer computes (the layer retires on its
              sum of squares, not on the copy)
    embed     fetch the first stage's weights; one call: dW_first = sum of vjp(first)(inputs[m],
              dx[m]); one call: the stages' gradient (the two parts merged), its sum of squares,
              the global norm and the scale; the stages' gradient goes out
    update    on the host thread, one host update per unit (engine/update.py's: the fused AdamW
              kernel called directly on the gradient where the device left it, or a jitted
              update on the host CPU device), the gradient scaled and clipped by the global
              norm, leaving the unit's new bus copy (none for a layer in the bus ring: its
              fills make it); the next step's fetch of a unit waits for its update. In the
              order the next forward needs them: unit 0 (the first stage's variables: the
              embedding, tied or not), the layers, then the last unit (the last stage's own:
              final norm, untied head). The stages' gradient is split between the two units
              (engine/stage_units.py)

A layer unit travels flat (engine/packing.py): its bus copy, its fetch and its gradient are each
one array, its leaves end to end, split back into the block's tree by static slices inside the
layer's calls and the gradient made flat there, so a layer's call passes a handful of arrays, a
fetch is one copy and a retire frees a few arrays, whatever the block's leaves. The order of a
pass's fetches, dispatches and waits is engine/schedule.py's (LayerStream); every copy between
host and device memory is engine/transfer.py's. The dispatching thread waits only at the retires
the schedule names (and for a unit's host update not yet done when its fetch comes); the result's
scalars are read by the caller (a training loop reads them once the next step is dispatched).
`run` reads only its StepParts (what the engine built: the host state, as engine/step_host.py's
StepHost, transfers, device functions, placement, ...) and returns each unit's gradient's sum of
squares beside the result. With the host lookup (engine/lookup.py's HostFirst, else DeviceFirst:
the first stage's way, chosen once) the embed runs on the host, the last unit's gradient goes out
after the loss, and the embed backward and the global norm run on the host thread, which the
step's end waits for.

The copies' form (StepParts.copies, schedule.EAGER or JIT) is the pass's LayerStream's alone (its
`call` and `send`), so the loops below read the same in both. Eager: every fetch and every
gradient's copy out is a `device_put` of its own. Jit: a layer's fetch is made inside the call of
the layer `prefetch` before it in the pass, its bus copy, and in the backward its offloaded inputs
too, returned in device memory; a layer's gradient goes out inside the next layer's backward call,
returned in pinned host memory, and layer 0's inside the embedding backward's call (the host
lookup: eagerly, as no device function runs after it); the stages' gradient and the scalars the
update reads are made in pinned host memory by their call. Eager in both forms: the first
`prefetch` layers of each pass (no compute precedes them in the pass), the stages' fetches, the
activations' offload in the forward, the batch (one copy). A fetch made inside a call is an output
of it and an input of its own layer's call, which feeds that layer's gradient: it is done before
the gradient is ready, so a unit's bus copy is still written only after every fetch of it has been
read (engine/direct.py).

Each block weight crosses the bus twice per step whatever the number of micro-batches M is.
Data parallel over several devices (parallel.py): every fetch goes to each device, each
micro-batch's rows are split over them, and each gradient (dW_i, the stages' parts) is summed over
the devices on the devices (Placement.reduce, inside the call that makes it) before it crosses to
the host, once per process. With the sharded host layout (engine/shard.py) each device is sent
only its rows of a unit and the devices all-gather them; the sum is reduce-scattered instead, and
only this process's rows cross to the host; every sum of squares is taken on the devices over the
whole gradient.
"""

import dataclasses
from typing import Any, Callable, Optional

import jax

from megatrain_jax.engine import lookup
from megatrain_jax.engine.functions import DeviceFunctions, StageParts
from megatrain_jax.engine.parallel import Placement
from megatrain_jax.engine.step_host import StepHost
from megatrain_jax.engine.stream import Activations, Carry, LayerStream, delete
from megatrain_jax.engine.transfer import Transfers


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step (and an evaluation, engine/evaluate.py) reads: the host state (as a step sees
    it: step_host.StepHost), the transfers, the jitted device functions, the placement, the stage
    parts, the saved activations, the prefetch depth, the copies' form (schedule.EAGER or JIT),
    the first stage's way (engine/lookup.py), each layer's Constants on the compute device
    (stage_units.Constant) and the hooks (StreamedEngine's on_phase, on_event; None: none)."""
    host: StepHost
    transfers: Transfers
    functions: DeviceFunctions
    placement: Placement
    parts: StageParts
    activations: Activations
    num_layers: int
    prefetch: int
    copies: str
    first: lookup.FirstStage
    constants: list
    on_phase: Optional[Callable] = None
    on_event: Optional[Callable] = None

    def hook(self, phase, layer=None):
        if self.on_phase is not None:
            self.on_phase(phase, layer)

    def delete(self, tree):
        """stream.delete, counted."""
        delete(tree, self.host.counters)

    def fetch_unit(self, u):
        """Layer unit u's bus copy put on the compute device, once u's pending host update has
        finished."""
        shapes = None if self.placement.shards is None else self.host.shapes[1]
        w = self.transfers.weights_in(self.host.bus(u), shapes, layer=True)
        self.host.fetched(u, w)
        return w

    def fetch_stage(self, part):
        """One stage part's leaves ("first" or "last", a flat list) put on the compute device,
        each once the pending update of the stage unit holding it has finished."""
        indices = getattr(self.parts, part)
        shapes = None
        if self.placement.shards is not None:  # each device gets its piece, then they all-gather
            shapes = self.parts.take(part, self.host.shapes[0])
        w = self.transfers.weights_in(self.host.stage_bus(indices), shapes)
        for u in (0, self.host.last):
            self.host.fetched(u, w)
        return w

    def stream(self, order, phase=None, inputs: bool = False, copies=None) -> LayerStream:
        """A pass's LayerStream over the layers `order`, in the copies' form `copies` (default
        the step's): each layer's payload its unit's weights on the compute device (`inputs`:
        with the layer's saved inputs, (weights, inputs)); on_event told as `phase` (None: not
        told); each fetch's reading told to the host (HostState.read: it frees a bus ring
        slot)."""
        host, acts = self.host, self.activations

        def fetch(i):
            w = self.fetch_unit(1 + i)
            return (w, acts.load(i)) if inputs else w

        def arrived(i, copied):  # made inside a call: inputs kept on the device are not copied
            w, xs = copied
            host.fetched(1 + i, w)
            return (w, xs if acts.offload else acts.load(i)) if inputs else w
        carry = Carry(lambda i: (host.bus(1 + i), acts.pinned(i) if inputs else None), arrived)
        on_event = None
        if phase is not None and self.on_event is not None:
            on_event = lambda kind, layer: self.on_event(kind, phase, layer)
        return LayerStream(order, fetch, self.prefetch, on_event,
                           lambda layer, token: host.read(1 + layer, token), host.counters,
                           copies=copies or self.copies, carry=carry, transfers=self.transfers)

    def fetched(self, w):
        """What a step may delete of a fetch: with state and compute on one device (no
        accelerator), a fetch is the bus copy itself, which must live on; in debug mode the host
        state keeps every fetch until the unit's update (bus.Buses.fetched)."""
        if self.placement.weights == self.host.bus_sharding or self.host.fetches is not None:
            return ()
        return w


@dataclasses.dataclass
class Head:
    """The loss phase's results: the loss (with the aux loss), the total loss weight, the
    statistics summed over the micro-batches (None: none), dx[m] at the last block's output
    (stacked), the last unit's gradient as the first stage's way keeps it (`last`), the aux loss
    and its cotangent (None: no aux)."""
    loss: jax.Array
    weight: jax.Array
    stats: Any
    dxs: jax.Array
    last: Any
    aux_loss: Optional[jax.Array] = None
    daux: Optional[jax.Array] = None


def _forward(sp: StepParts, xs, contexts) -> tuple:
    """(x_L[m] stacked, each layer's aux[m] stacked): each layer streamed in, one call over the
    micro-batches, its inputs saved (sp.activations)."""
    f, acts = sp.functions, sp.activations
    auxs = []
    stream = sp.stream(range(sp.num_layers), "forward")
    for i, w in stream:
        ys, aux = stream.call(f.layer_fwd, ((w, sp.constants[i]), xs, contexts))
        if aux is not None:
            auxs.append(aux)
        # nothing donates a block's outputs
        stream.done(ys, acts.save(i, xs), drop=sp.fetched(w))
        xs = ys
        sp.hook("forward", i)
    if bool(auxs) != (f.aux_loss is not None):
        raise ValueError("the blocks return (x, aux) but the engine has no aux_loss" if auxs
                         else "the engine has an aux_loss but the blocks return no (x, aux)")
    return xs, auxs


def _loss(sp: StepParts, xs, targets, auxs: list) -> Head:
    """The last stage's loss and dx for every micro-batch, its gradient summed on the device
    (one call); the aux loss and its cotangent."""
    f, host = sp.functions, sp.host
    w = sp.fetch_stage("last")
    loss, weight, stats, dxs, last_grads = f.head(w, xs, targets)
    sp.delete((sp.fetched(w), xs))
    host.release_bus(host.last)
    head = Head(loss, weight, stats, dxs, sp.first.last_gradient(sp, last_grads))
    if auxs:  # every layer's gets the same cotangent: the gradient at the total
        head.loss, head.aux_loss, head.daux = f.aux_grad(auxs, weight, loss)
    return head


def _backward(sp: StepParts, contexts, head: Head) -> tuple:
    """Every layer's backward in reverse, one call each over the micro-batches, head.dxs updated:
    (each layer unit's gradient Parcel by unit, the layers' sums of squares in the pass's order,
    layer 0's gradient still to go out (the jit form's stream.Outgoing, else None))."""
    f, host, acts = sp.functions, sp.host, sp.activations
    layer_sq = []
    stream = sp.stream(reversed(range(sp.num_layers)), "backward", inputs=True)
    for i, (w, xs) in stream:
        head.dxs, grads, sq = stream.call(
            f.layer_bwd, ((w, sp.constants[i]), xs, contexts, head.dxs, head.daux))
        layer_sq.append(sq)
        stream.send(1 + i, grads)  # (in the jit form inside the next call)
        host.release_bus(1 + i)
        # retired on its sum of squares: made at the end of the call, never donated; the
        # gradient's copy out goes on while the next layer computes (the jit form drops its
        # fetch right after the dispatch: the weights, and the inputs when they were offloaded;
        # inputs kept on the device since the forward go with the rest at its retire)
        stream.done(sq, () if acts.offload else xs,
                    drop=(sp.fetched(w), xs if acts.offload else ()))
        sp.hook("backward", i)
    return stream.sent, layer_sq, stream.leaving


def _result(sp: StepParts, head: Head, grad_norm) -> dict:
    """The step's loss (with the aux loss), the global norm and the statistics, local to this
    process."""
    local = sp.placement.local
    result = {"loss": local(head.loss), "grad_norm": local(grad_norm)}
    if head.stats is not None:  # the last stage's statistics, summed over the micro-batches
        result["stats"] = local(head.stats)
    if head.aux_loss is not None:
        result["aux_loss"] = local(head.aux_loss)
    return result


def run(sp: StepParts, inputs, targets, contexts) -> tuple:
    """One step over M micro-batches stacked on the device (with the host lookup, their inputs on
    the host device): (the result dict: loss, grad_norm (, stats, aux_loss), each unit's
    gradient's sum of squares by unit, for StreamedEngine.nonfinite_units)."""
    host, L = sp.host, sp.num_layers
    sp.activations.clear()
    # ---- embed
    xs = sp.first.forward(sp, inputs)
    sp.hook("embed")

    # ---- forward
    xs, auxs = _forward(sp, xs, contexts)

    # ---- loss
    head = _loss(sp, xs, targets, auxs)
    sp.hook("loss")

    # ---- backward
    layer_grads, layer_sq, leaving = _backward(sp, contexts, head)

    # ---- embed backward (the stages' gradient, the global norm and the scale)
    embed = sp.first.backward(sp, inputs, head, layer_sq, leaving)
    if leaving is not None:
        layer_grads[leaving.key] = embed.layer0
    host.release_bus(0)
    sp.hook("embed backward")

    # ---- update, on the host thread, in the order the next forward needs them: unit 0 (the
    # first stage's), the layers, the last stage's; queued as one job, so an exception here
    # (Ctrl-C) leaves none of them queued, never some
    host.submit_all([(0, embed.first_out), *((u, layer_grads.pop(u)) for u in range(1, L + 1)),
                     (host.last, embed.last_out)], embed.norm, embed.scale)
    grad_norm, stages_sq = embed.totals()
    unit_sq = sp.placement.local([stages_sq] + layer_sq[::-1] + [stages_sq])
    return _result(sp, head, grad_norm), unit_sq
