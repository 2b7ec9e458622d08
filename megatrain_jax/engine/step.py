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
copy is engine/transfer.py's.

The copies' form (engine.copies, schedule.EAGER or JIT). Eager: every fetch and every gradient's
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

import functools

import jax
import jax.numpy as jnp

from megatrain_jax.engine import lookup, schedule, stage_units
from megatrain_jax.engine.functions import norm_and_scale
from megatrain_jax.engine.stream import LayerStream, delete


def fetch_unit(engine, u):
    """Unit u's bus copy put on the compute device, once u's pending host update has finished."""
    shapes = None if engine.placement.shards is None else engine.host.shapes[1]
    w = engine.transfers.weights_in(engine.host.bus(u), shapes)
    engine.host.fetched(u, w)
    return w


def fetch_stage(engine, part):
    """One stage part's leaves ("first" or "last", a flat list) put on the compute device, each
    once the pending update of the stage unit holding it has finished."""
    indices = getattr(engine.parts, part)
    shapes = None
    if engine.placement.shards is not None:  # each device gets its piece, then they all-gather
        shapes = engine.parts.take(part, engine.host.shapes[0])
    w = engine.transfers.weights_in(engine.host.stage_bus(indices), shapes)
    for u in (0, engine.host.last):
        engine.host.fetched(u, w)
    return w


def first_stage(engine, inputs) -> list:
    """x_0[m] = first(inputs[m]) on the compute device, for every micro-batch: with the host
    lookup (engine/lookup.py) computed on the host and its rows put on the device, else on the
    device from its fetched weights."""
    f = engine.functions
    if engine.host_lookup:
        w = engine.host.stage_bus(engine.parts.first)
        return engine.transfers.rows_in([f.host_embed(w, x) for x in inputs])
    w = fetch_stage(engine, "first")
    xs = [f.embed(w, x) for x in inputs]
    delete(fetched_copy(engine, w))
    return xs


def fetched_copy(engine, w):
    """What a step may delete of a fetch: with state and compute on one device (no accelerator),
    a fetch is the bus copy itself, which must live on; in debug mode the host state keeps every
    fetch until the unit's update (HostState.fetched)."""
    if engine.compute == engine.host.bus_sharding or engine.host.fetches is not None:
        return ()
    return w


def carried_call(engine, fn, args, carry=None, grads=None) -> tuple:
    """The jit form: fn (a DeviceFunctions `*_carry`) on args, with `carry` = (unit, its bus copy,
    offloaded inputs or None) fetched and `grads` (a gradient on the device) sent out inside the
    call. Returns (fn's result, (the unit's weights, its inputs) on the device, the gradient's
    Parcel or None)."""
    u, bus, saved = carry or (None, None, None)
    result, (w, xs), parcel = engine.transfers.in_call(fn, args, weights=bus, activations=saved,
                                                       grads=grads)
    if u is not None:
        engine.host.fetched(u, w)
    return result, (w, xs), parcel


def reduced_away(partial, reduced) -> list:
    """The per-device partial sums that f.reduce replaced (none on one device, where it returns
    its input)."""
    kept = {id(x) for x in jax.tree.leaves(reduced)}
    return [x for x in jax.tree.leaves(partial) if id(x) not in kept]


def _stage_shapes(engine) -> tuple:
    """(index, shape) of every stages' gradient leaf on the device (the sharded layout: padded to
    split over the devices) and where the merge leaves them (None: where jit puts them)."""
    shapes, shards = engine.host.shapes[0], engine.placement.shards
    if shards is None:
        return tuple(enumerate(map(tuple, shapes))), None
    return tuple(enumerate(shards.padded_shape(s) for s in shapes)), engine.placement.pieces


def run(engine, inputs, targets, contexts) -> dict:
    """One step of `engine` (a StreamedEngine) over M micro-batches already on the device (with
    the host lookup, their inputs on the host device)."""
    f, host, acts = engine.functions, engine.host, engine.activations
    M, L = len(inputs), engine.num_layers
    hook = engine.on_phase or (lambda phase, layer=None: None)

    fetch = functools.partial(fetch_unit, engine)
    stage = functools.partial(fetch_stage, engine)
    fetched = functools.partial(fetched_copy, engine)  # what the step may delete of a fetch

    def events(phase):
        if engine.on_event is None:
            return None
        return lambda kind, layer: engine.on_event(kind, phase, layer)

    def cast(grads):
        """(`grads` in the host's gradient dtype, every device array of both). `grads` is reduced
        over the devices already (f.reduce)."""
        device = jax.tree.leaves(grads)
        if device and device[0].dtype != host.grad_dtype:
            grads = f.cast_grads(grads)  # cast on the device: fewer bytes cross and wait
            device += jax.tree.leaves(grads)
        return grads, device

    def out(grads):
        """(the gradient on its way to the host, a Parcel; the device arrays to free once the
        layer retires)."""
        grads, device = cast(grads)
        parcel = engine.transfers.grads_out(grads)
        kept = {id(x) for x in parcel.token()}  # no copy when they share a device
        return parcel, [x for x in device if id(x) not in kept]

    acts.clear()
    # ---- embed
    xs = first_stage(engine, inputs)
    hook("embed")

    # ---- forward
    auxs = []  # every layer's and micro-batch's aux statistics (blocks that return them)
    jit = engine.copies == schedule.JIT
    carry = (lambda i: (1 + i, host.bus(1 + i), None)) if jit else None
    stream = LayerStream(range(L), lambda i: fetch(1 + i), engine.prefetch, events("forward"),
                         carry)
    for i, w in stream:
        outs, ahead = [], None
        for m, (x, c) in enumerate(zip(xs, contexts)):
            if m == 0 and stream.carry is not None:  # the layer ahead's copy beside this compute
                made, (ahead, _), _ = carried_call(engine, f.block_fwd_carry, (w, x, c),
                                                   stream.carry)
            else:
                made = f.block_fwd(w, x, c)
            outs.append(made)
        ys = [y for y, _ in outs]
        auxs += [aux for _, aux in outs if aux is not None]
        # nothing donates a block's outputs
        stream.done(ys, acts.save(i, xs), drop=fetched(w), carried=ahead)
        xs = ys
        hook("forward", i)

    if bool(auxs) != (f.aux_loss is not None):
        raise ValueError("the blocks return (x, aux) but the engine has no aux_loss" if auxs
                         else "the engine has an aux_loss but the blocks return no (x, aux)")

    # ---- loss
    w = stage("last")
    acc = f.zeros(w)
    loss_sums, weights, stats, dxs = [], [], [], []
    for x, t in zip(xs, targets):
        loss_sum, weight, stat, dx, acc = f.head(w, x, t, acc)
        loss_sums.append(loss_sum)
        weights.append(weight)
        stats.append(stat)
        dxs.append(dx)
    delete((fetched(w), xs))
    host.release_bus(host.last)
    last_grads, head_partial = f.reduce(acc), acc  # kept on the device for the stages' merge
    head_device = reduced_away(head_partial, last_grads)  # freed at the first retire
    if engine.host_lookup:  # nothing to merge it with: the last unit's gradient goes out now
        leaves = stage_units.gradient([], last_grads, (), engine.parts.last,
                                      lookup.held(host, host.last), host.grad_dtype, None)
        last_squares = f.leaf_squares(leaves)
        last_out = out(stage_units.fill(host.stage_units[host.last][0], leaves))[0]
        delete(last_grads)  # its fp32 sum; the cast leaves are freed once they are out
        del leaves
    aux_loss, daux = None, None
    if auxs:  # every layer's gets the same cotangent: the gradient at the total
        aux_loss, daux = f.aux_grad(f.tree_total(auxs), f.total(weights))
    hook("loss")

    # ---- backward
    layer_grads, layer_sq = {}, []
    carry = (lambda i: (1 + i, host.bus(1 + i), acts.pinned(i))) if jit else None
    stream = LayerStream(reversed(range(L)), lambda i: (fetch(1 + i), acts.load(i)),
                         engine.prefetch, events("backward"), carry)
    leaving = None  # the jit form: (unit, gradient) of the layer before, to go out in this call
    for i, (w, xs) in stream:
        dw, ahead = f.zeros(w), None
        for m in range(M):
            args = (w, xs[m], contexts[m], dxs[m], dw, daux)
            if m == 0 and (stream.carry is not None or leaving is not None):
                (dxs[m], dw), (w_ahead, xs_ahead), parcel = carried_call(
                    engine, f.block_bwd_carry, args, stream.carry,
                    leaving and leaving[1])
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
            grads, device_grads = cast(dw)
            leaving = (1 + i, grads)
        else:
            layer_grads[1 + i], device_grads = out(dw)
        device_grads += reduced_away(partial, dw)
        host.release_bus(1 + i)
        if leaving is not None and i == 0:  # freed once it is out, after the loop
            last_device, device_grads = device_grads, []
        # retired on its sum of squares: made after every micro-batch's work, never donated;
        # the gradient's copy out goes on while the next layer computes
        # (the jit form drops its fetch right after the dispatch: the weights, and the inputs
        # when they were loaded back; inputs kept on the device since the forward go with the
        # rest at its retire)
        fetched_inputs = acts.offload or not jit
        stream.done(sq, (device_grads, head_device, () if fetched_inputs else xs),
                    drop=(fetched(w), xs if fetched_inputs else ()), carried=ahead)
        head_device = ()
        hook("backward", i)

    # ---- embed backward
    local = engine.placement.local
    if engine.host_lookup:  # on the host thread, from the rows' gradient (engine/lookup.py)
        total_weight = f.total(weights)
        scalars = (f.total(layer_sq), last_squares, total_weight)
        if leaving is not None:  # no device function runs after it: layer 0's gradient goes out now
            layer_grads[leaving[0]] = engine.transfers.grads_out(leaving[1])
            delete(last_device)
        backward = lookup.HostBackward(engine, host.stage_bus(engine.parts.first), inputs,
                                       engine.transfers.grads_out(dxs),
                                       engine.transfers.scalars_out(scalars))
        first_out, norm_scale = backward.grads, (backward.norm, backward.scale)
    else:
        w = stage("first")
        acc = f.zeros(w)
        for m, (x, dx) in enumerate(zip(inputs, dxs)):
            if m == 0 and leaving is not None:  # layer 0's gradient out beside this compute
                acc, _, layer_grads[leaving[0]] = carried_call(
                    engine, f.embed_bwd_carry, (w, x, dx, acc), grads=leaving[1])
                delete(last_device)
            else:
                acc = f.embed_bwd(w, x, dx, acc)
        delete(fetched(w))
        total_weight = f.total(weights)
        held, sharding = _stage_shapes(engine)
        stage_grads = stage_units.gradient(f.reduce(acc), last_grads, engine.parts.first,
                                           engine.parts.last, held, host.grad_dtype, sharding)
        stages_sq = f.sum_squares(stage_grads)  # the whole gradient's, on the devices
        grad_norm, scale = norm_and_scale(layer_sq, stages_sq, total_weight)
        norm_scale = engine.transfers.scalars_out((grad_norm, scale))
        first_out, last_out = (out(stage_units.like(stage_grads, host.stage_units[u][0]))[0]
                               for u in (0, host.last))
    host.release_bus(0)
    hook("embed backward")

    # ---- update, on the host thread, in the order the next forward needs them: unit 0 (the
    # first stage's), the layers, the last stage's; queued as one job, so an exception here
    # (Ctrl-C) leaves none of them queued, never some
    host.submit_all([(0, first_out), *((u, layer_grads.pop(u)) for u in range(1, L + 1)),
                     (host.last, last_out)], *norm_scale)
    if engine.host_lookup:
        grad_norm, stages_sq = backward.result()  # made on the host thread
    engine.unit_sq = local([stages_sq] + layer_sq[::-1] + [stages_sq])  # for nonfinite_units()
    loss = local(f.total(loss_sums) / jnp.where(total_weight > 0, total_weight, 1.0))
    aux_loss = None if aux_loss is None else local(aux_loss)
    result = {"loss": loss, "grad_norm": local(grad_norm)}
    if stats[0] is not None:  # the last stage's statistics, summed over the micro-batches
        result["stats"] = local(f.tree_total(stats))
    if aux_loss is not None:
        result.update(loss=loss + aux_loss, aux_loss=aux_loss)
    return result
