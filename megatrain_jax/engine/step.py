"""One training step, top to bottom: the schedule of transfers and device work.

    embed     fetch the first stage's weights (unit 0); x_0[m] = first(inputs[m])
    forward   for layer i (weights prefetched, at most prefetch + 1 resident):
                x_{i+1}[m] (, aux_i[m]) = block_i(x_i[m]); save x_i[m] (on the device, or
                offloaded to host)
    loss      fetch the last stage's weights (the last unit; tied leaves from unit 0); loss_sum[m], weight[m] (, stats[m]),
              dx[m] = grad(last)(x_L[m]); its gradient stays on the device until the embed
              backward; with aux: aux loss and daux = grad(aux_loss) of the sum of every
              aux_i[m] (see functions.py)
    backward  for layer i in reverse (weights and saved inputs fetched ahead):
                dx[m], dW_i += vjp(block_i)(x_i[m], (dx[m], daux))   (the block is recomputed)
              dW_i and its sum of squares; dW_i goes out to the host while the next layer
              computes (the layer retires on its sum of squares, not on the copy)
    embed     fetch the first stage's weights; dW_first += vjp(first)(inputs[m], dx[m]);
              the stages' gradient (the two parts merged, on the device) and its sum of squares;
              the global norm and the scale, on the device; the stages' gradient goes out
    update    on the host thread: each unit's gradient and the norm cross to the host CPU
              device there, then clip, one optax update per unit, its bus copy refreshed (the
              next step's fetch of a unit waits for its update), in the order the next forward
              needs them: unit 0 (the first stage's variables: the embedding, tied or not), the
              layers, then the last unit (the last stage's own: final norm, untied head). The
              stages' gradient is split between the two units (engine/stage_units.py)

The order of a pass's fetches, dispatches and waits is engine/schedule.py's (LayerStream); every
copy is engine/transfer.py's. `run` reads only its StepParts (what the engine built: host state,
transfers, device functions, placement, ...) and returns each unit's gradient's sum of squares
beside the result. With the host lookup (engine/lookup.py's HostFirst, else DeviceFirst: the
first stage's way, chosen once) the embed runs on the host, the last unit's gradient goes out
after the loss, and the embed backward and the global norm run on the host thread.

The copies' form (StepParts.copies, schedule.EAGER or JIT). Eager: every fetch and every gradient's
copy out is a `device_put` of its own. Jit: a layer's fetch is made inside the first call
(micro-batch 0) of the layer `prefetch` before it in the pass, its bus copy, and in the backward
its offloaded inputs too, returned in device memory; a layer's gradient (reduced, cast) goes out
inside the next layer's first backward call, returned in pinned host memory, and layer 0's inside
the embedding backward's first call (the host lookup: eagerly, as no device function runs after
it). Eager in both forms: the first `prefetch` layers of each pass (no compute precedes them in
the pass), the stages' fetches and gradient, the activations' offload in the forward, the
scalars. A fetch made inside a call is an output of it and an input of its own layer's calls,
which feed that layer's gradient: it is done before the gradient is ready, so a unit's bus copy
is still written only after every fetch of it has been read (engine/direct.py).

Each block weight crosses the bus twice per step whatever the number of micro-batches M is.
Data parallel over several devices (parallel.py): every fetch goes to each device, each
micro-batch's rows are split over them, and each gradient (dW_i, the stages' parts) is summed over
the devices on the devices (f.reduce) before it crosses to the host, once per process. With the
sharded host layout (engine/shard.py) each device is sent only its rows of a unit and the devices
all-gather them; f.reduce reduce-scatters each gradient instead, and only this process's rows
cross to the host; every sum of squares is taken on the devices over the whole gradient.
"""

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from megatrain_jax.engine import schedule
from megatrain_jax.engine.stream import LayerStream, delete


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step (and an evaluation, engine/evaluate.py) reads: the host state, the transfers,
    the jitted device functions, the placement, the stage parts (functions.StageParts), the saved
    activations, the prefetch depth, the copies' form (schedule.EAGER or JIT), the first stage's
    way (engine/lookup.py: DeviceFirst or HostFirst), each layer's Constants on the compute
    device (stage_units.Constant) and the hooks (StreamedEngine's on_phase, on_event; None:
    none)."""
    host: object
    transfers: object
    functions: object
    placement: object
    parts: object
    activations: object
    num_layers: int
    prefetch: int
    copies: str
    first: object
    constants: list
    on_phase: Optional[Callable] = None
    on_event: Optional[Callable] = None

    def hook(self, phase, layer=None):
        if self.on_phase is not None:
            self.on_phase(phase, layer)

    def events(self, phase):
        """A pass's LayerStream on_event (None: no hook)."""
        if self.on_event is None:
            return None
        return lambda kind, layer: self.on_event(kind, phase, layer)

    def fetch_unit(self, u):
        """Unit u's bus copy put on the compute device, once u's pending host update has
        finished."""
        shapes = None if self.placement.shards is None else self.host.shapes[1]
        w = self.transfers.weights_in(self.host.bus(u), shapes)
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

    def read(self):
        """A pass's LayerStream on_retire: each layer unit's fetch has been read (it frees its
        bus ring slot, HostState.read); None without the ring."""
        if self.host.ring is None:
            return None
        return lambda layer, token: self.host.read(1 + layer, token)

    def fetched(self, w):
        """What a step may delete of a fetch: with state and compute on one device (no
        accelerator), a fetch is the bus copy itself, which must live on; in debug mode the host
        state keeps every fetch until the unit's update (HostState.fetched)."""
        if self.placement.weights == self.host.bus_sharding or self.host.fetches is not None:
            return ()
        return w

    def carried_call(self, fn, args, carry=None, grads=None) -> tuple:
        """The jit form: fn (a DeviceFunctions `*_carry`) on args, with `carry` = (unit, its bus
        copy, offloaded inputs or None) fetched and `grads` (a gradient on the device) sent out
        inside the call. Returns (fn's result, (the unit's weights, its inputs) on the device,
        the gradient's Parcel or None)."""
        u, bus, saved = carry or (None, None, None)
        result, (w, xs), parcel = self.transfers.in_call(fn, args, weights=bus, activations=saved,
                                                         grads=grads)
        if u is not None:
            self.host.fetched(u, w)
        return result, (w, xs), parcel

    def cast(self, grads):
        """(`grads` in the host's gradient dtype, every device array of both). `grads` is reduced
        over the devices already (f.reduce)."""
        device = jax.tree.leaves(grads)
        if device and device[0].dtype != self.host.grad_dtype:
            grads = self.functions.cast_grads(grads)  # on the device: fewer bytes cross and wait
            device += jax.tree.leaves(grads)
        return grads, device

    def out(self, grads):
        """(the gradient on its way to the host, a Parcel; the device arrays to free once the
        layer retires)."""
        grads, device = self.cast(grads)
        parcel = self.transfers.grads_out(grads)
        kept = {id(x) for x in parcel.token()}  # no copy when they share a device
        return parcel, [x for x in device if id(x) not in kept]


def reduced_away(partial, reduced) -> list:
    """The per-device partial sums that f.reduce replaced (none on one device, where it returns
    its input)."""
    kept = {id(x) for x in jax.tree.leaves(reduced)}
    return [x for x in jax.tree.leaves(partial) if id(x) not in kept]


@dataclasses.dataclass
class Head:
    """The loss phase's results: per micro-batch loss sums, weights, statistics and dx at the
    last block's output; the last unit's gradient as the first stage's way keeps it (`last`);
    the per-device partial sums to free at the backward's first retire; the aux loss and its
    cotangent (None: no aux)."""
    loss_sums: list
    weights: list
    stats: list
    dxs: list
    last: object
    head_device: list
    aux_loss: object = None
    daux: object = None


def _forward(sp: StepParts, xs: list, contexts: list) -> tuple:
    """(x_L[m] for every micro-batch, every layer's and micro-batch's aux statistics): each layer
    streamed in, its inputs saved (sp.activations)."""
    f, acts = sp.functions, sp.activations
    auxs = []
    carry = ((lambda i: (1 + i, sp.host.bus(1 + i), None)) if sp.copies == schedule.JIT
             else None)
    stream = LayerStream(range(sp.num_layers), lambda i: sp.fetch_unit(1 + i), sp.prefetch,
                         sp.events("forward"), carry, sp.read(), sp.host.counters)
    for i, w in stream:
        outs, ahead, layer = [], None, (w, sp.constants[i])
        for m, (x, c) in enumerate(zip(xs, contexts)):
            if m == 0 and stream.carry is not None:  # the layer ahead's copy beside this compute
                made, (ahead, _), _ = sp.carried_call(f.block_fwd_carry, (layer, x, c),
                                                      stream.carry)
            else:
                made = f.block_fwd(layer, x, c)
            outs.append(made)
        ys = [y for y, _ in outs]
        auxs += [aux for _, aux in outs if aux is not None]
        # nothing donates a block's outputs
        stream.done(ys, acts.save(i, xs), drop=sp.fetched(w), carried=ahead)
        xs = ys
        sp.hook("forward", i)
    if bool(auxs) != (f.aux_loss is not None):
        raise ValueError("the blocks return (x, aux) but the engine has no aux_loss" if auxs
                         else "the engine has an aux_loss but the blocks return no (x, aux)")
    return xs, auxs


def _loss(sp: StepParts, xs: list, targets: list, auxs: list) -> Head:
    """The last stage's loss and dx for every micro-batch, its gradient accumulated on the
    device; the aux loss's cotangent."""
    f, host = sp.functions, sp.host
    w = sp.fetch_stage("last")
    acc = f.zeros(w)
    loss_sums, weights, stats, dxs = [], [], [], []
    for x, t in zip(xs, targets):
        loss_sum, weight, stat, dx, acc = f.head(w, x, t, acc)
        loss_sums.append(loss_sum)
        weights.append(weight)
        stats.append(stat)
        dxs.append(dx)
    delete((sp.fetched(w), xs))
    host.release_bus(host.last)
    last_grads, head_partial = f.reduce(acc), acc
    head = Head(loss_sums, weights, stats, dxs, None, reduced_away(head_partial, last_grads))
    head.last = sp.first.last_gradient(sp, last_grads)
    if auxs:  # every layer's gets the same cotangent: the gradient at the total
        head.aux_loss, head.daux = f.aux_grad(f.tree_total(auxs), f.total(weights))
    return head


def _backward(sp: StepParts, dxs: list, contexts: list, head: Head) -> tuple:
    """Every layer's backward in reverse, dx[m] updated in place: (each layer unit's gradient
    Parcel, the layers' sums of squares in the pass's order, layer 0's gradient still to go out
    in the jit form as (unit, gradient, device arrays to free once it is out), else None)."""
    f, host, acts = sp.functions, sp.host, sp.activations
    jit = sp.copies == schedule.JIT
    layer_grads, layer_sq = {}, []
    carry = (lambda i: (1 + i, host.bus(1 + i), acts.pinned(i))) if jit else None
    stream = LayerStream(reversed(range(sp.num_layers)),
                         lambda i: (sp.fetch_unit(1 + i), acts.load(i)), sp.prefetch,
                         sp.events("backward"), carry, sp.read(), sp.host.counters)
    head_device, leaving = head.head_device, None  # leaving: the jit form's gradient before
    for i, (w, xs) in stream:
        dw, ahead = f.zeros(w), None
        for m in range(len(dxs)):
            args = ((w, sp.constants[i]), xs[m], contexts[m], dxs[m], dw, head.daux)
            if m == 0 and (stream.carry is not None or leaving is not None):
                (dxs[m], dw), (w_ahead, xs_ahead), parcel = sp.carried_call(
                    f.block_bwd_carry, args, stream.carry, leaving and leaving[1])
                if stream.carry is not None:  # its inputs: copied here, or kept on the device
                    ahead = (w_ahead, xs_ahead if acts.offload else
                             acts.load(stream.carry[0] - 1))
                if leaving is not None:
                    layer_grads[leaving[0]], leaving = parcel, None
            else:
                dxs[m], dw = f.block_bwd(*args)
        (dw, sq), partial = f.reduce_squares(dw), dw  # summed over the devices, on them
        layer_sq.append(sq)
        if jit:  # goes out inside the next call (layer 0's: the embedding backward's)
            grads, device_grads = sp.cast(dw)
            leaving = (1 + i, grads, ())
        else:
            layer_grads[1 + i], device_grads = sp.out(dw)
        device_grads += reduced_away(partial, dw)
        host.release_bus(1 + i)
        if leaving is not None and i == 0:  # freed once it is out, after the loop
            leaving, device_grads = (*leaving[:2], device_grads), []
        # retired on its sum of squares: made after every micro-batch's work, never donated;
        # the gradient's copy out goes on while the next layer computes
        # (the jit form drops its fetch right after the dispatch: the weights, and the inputs
        # when they were loaded back; inputs kept on the device since the forward go with the
        # rest at its retire)
        fetched_inputs = acts.offload or not jit
        stream.done(sq, (device_grads, head_device, () if fetched_inputs else xs),
                    drop=(sp.fetched(w), xs if fetched_inputs else ()), carried=ahead)
        head_device = ()
        sp.hook("backward", i)
    return layer_grads, layer_sq, leaving


def _result(sp: StepParts, head: Head, grad_norm, total_weight) -> dict:
    """The step's loss (with the aux loss), the global norm and the statistics, local to this
    process."""
    f, local = sp.functions, sp.placement.local
    loss = local(f.total(head.loss_sums) / jnp.where(total_weight > 0, total_weight, 1.0))
    aux_loss = None if head.aux_loss is None else local(head.aux_loss)
    result = {"loss": loss, "grad_norm": local(grad_norm)}
    if head.stats[0] is not None:  # the last stage's statistics, summed over the micro-batches
        result["stats"] = local(f.tree_total(head.stats))
    if aux_loss is not None:
        result.update(loss=loss + aux_loss, aux_loss=aux_loss)
    return result


def run(sp: StepParts, inputs, targets, contexts) -> tuple:
    """One step over M micro-batches already on the device (with the host lookup, their inputs
    on the host device): (the result dict: loss, grad_norm (, stats, aux_loss), each unit's
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
    layer_grads, layer_sq, leaving = _backward(sp, head.dxs, contexts, head)

    # ---- embed backward (the stages' gradient, the global norm and the scale)
    embed = sp.first.backward(sp, inputs, head, layer_sq, leaving)
    if leaving is not None:
        layer_grads[leaving[0]] = embed.layer0
    host.release_bus(0)
    sp.hook("embed backward")

    # ---- update, on the host thread, in the order the next forward needs them: unit 0 (the
    # first stage's), the layers, the last stage's; queued as one job, so an exception here
    # (Ctrl-C) leaves none of them queued, never some
    host.submit_all([(0, embed.first_out), *((u, layer_grads.pop(u)) for u in range(1, L + 1)),
                     (host.last, embed.last_out)], embed.norm, embed.scale)
    grad_norm, stages_sq = embed.totals()
    unit_sq = sp.placement.local([stages_sq] + layer_sq[::-1] + [stages_sq])
    return _result(sp, head, grad_norm, embed.total_weight), unit_sq
