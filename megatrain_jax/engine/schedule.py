"""The schedule of a streamed pass, written once: the engine executes it (stream.LayerStream),
the step-time model simulates it (megatrain_jax.step_time), both through its one interpreter
(`walk`), and the memory plan reads its residency from it (megatrain_jax.memory_model).

A pass runs a unit of work per layer over `n` positions (the forward: layers 0..L-1; the
backward: L-1..0), with these operations, in the order `layer_ops` gives:

    fetch     put the layer's weights (and, offloaded, its saved inputs) on the device: waits for
              the unit's pending host update, then enqueues the copy
    dispatch  enqueue the layer's device work (and behind it its activations' offload and its
              gradient's transfer out: they wait on nothing on the host)
    retire    wait until the layer's work is done on the device (on a token nothing donates:
              its outputs, or a scalar computed from them), then free its arrays
    release   free the last layer's arrays without waiting (the runtime frees them once done)

With prefetch p >= 1, position i is dispatched *before* position i - 1 is retired, so the device
always has work queued while the host waits, and the fetch of position i + p comes after the
retire: at most p + 1 layers are resident. With p = 0 one layer is resident and the queue drains
at every layer (retire i - 1, fetch i, dispatch i).

Two forms of the copies (`copies`), the same order of work:

    eager     each fetch is its own `device_put`, issued between dispatches (as above)
    jit       the fetch of position i + p is made inside dispatch i: its first call takes the
              bus copy (pinned host memory) and returns it in device memory (`carry`), so the
              copy runs beside that call's compute (engine/transfer.py). Only positions
              0..p-1 are fetched eagerly, before the pass. A position's fetched arrays are
              dropped (`drop`: freed without waiting, the runtime frees them once the work is
              done) right after its dispatch, since nothing later reads them; its retire frees
              the rest. At most p + 1 layers are resident, as in the eager form. Needs p >= 1:
              with p = 0 no layer may be resident beside the computing one.

Around the passes, a training step (engine/step.py) runs: the embedding (fetch, dispatch), the
forward pass, the loss head (fetch, dispatch, its gradient kept on the device), the backward pass
(each layer's gradient goes out as it is made), the embedding's backward, the stages' gradient
out, then on the host thread one update per unit (engine/update.py's), each leaving the unit's
new bus copy (written in place by the direct update, refreshed into pinned memory by a jitted one;
none for a layer in the bus ring, whose fills make it), in the order the next forward needs them:
the first stage's unit (embedding), layer 0, 1, ..., then the last stage's unit (final norm,
head), which the next step fetches only after every layer.
"""

import dataclasses

# The waits the dispatching thread may make, by kind (stream.Counters counts them): a retire's
# wait for a layer's device work; a host read of a device array's values (a copy to the host
# waited for); a fetch's wait for its unit's pending host update; the wait for the first stage's
# host backward (the host lookup, engine/lookup.py)
RETIRE_WAIT, HOST_READ, UPDATE_WAIT, FIRST_STAGE_WAIT = (
    "block_until_ready", "np.asarray", "update wait", "first stage wait")
SYNCS = (RETIRE_WAIT, HOST_READ, UPDATE_WAIT, FIRST_STAGE_WAIT)

FETCH, DISPATCH, RETIRE, RELEASE = "fetch", "dispatch", "retire", "release"
CARRY, DROP = "carry", "drop"  # the jit form's: a fetch made by the next dispatch; a free after it
EAGER, JIT = "eager", "jit"
FORMS = (EAGER, JIT)


def layer_ops(n: int, prefetch: int, copies: str = EAGER) -> list:
    """[(operation, position)] of a pass over n positions with `prefetch` layers fetched ahead,
    its copies in form `copies`. A (CARRY, q) comes right before the dispatch that fetches q."""
    if copies not in FORMS:
        raise ValueError(f"copies must be one of {', '.join(FORMS)}, got {copies!r}")
    if copies == JIT and prefetch < 1:
        raise ValueError("copies='jit' needs prefetch >= 1 (the next layer's copy is made "
                         "during this layer's compute)")
    ops = [(FETCH, pos) for pos in range(min(prefetch, n))]
    for pos in range(n):
        if copies == JIT:
            ops += [(CARRY, pos + prefetch)] if pos + prefetch < n else []
            ops += [(DISPATCH, pos), (DROP, pos)]
            ops += [(RETIRE, pos - 1)] if pos else []
            continue
        if prefetch == 0:  # one layer resident: the previous one goes before the next comes
            ops += [(RETIRE, pos - 1)] if pos else []
            ops += [(FETCH, pos), (DISPATCH, pos)]
            continue
        ops.append((DISPATCH, pos))
        if pos:
            ops.append((RETIRE, pos - 1))
        if pos + prefetch < n:
            ops.append((FETCH, pos + prefetch))
    if n:
        ops.append((RELEASE, n - 1))
    return ops


def resident(n: int, prefetch: int, copies: str = EAGER) -> list:
    """For each position, the most layers resident on the device (fetched, not yet dropped,
    retired or released) from its dispatch until the next position's; a carried fetch counts
    from the dispatch that makes it."""
    out, live, current = [0] * n, set(), None
    for op, pos in layer_ops(n, prefetch, copies):
        if op in (FETCH, CARRY):
            live.add(pos)
        elif op in (DROP, RETIRE, RELEASE):
            live.discard(pos)
        else:
            current = pos
        if current is not None and op != CARRY:  # (a carry belongs to the dispatch after it)
            out[current] = max(out[current], len(live))
    return out


def overlapped(n: int, prefetch: int, copies: str = EAGER) -> list:
    """For each position, whether the one before it is still to be retired when it is dispatched
    (its arrays, e.g. a gradient on its way out, still alive while this one computes)."""
    at = {op: k for k, op in enumerate(layer_ops(n, prefetch, copies))}
    return [pos > 0 and at[(RETIRE, pos - 1)] > at[(DISPATCH, pos)] for pos in range(n)]


@dataclasses.dataclass
class Work:
    """One position of a pass, as `walk` hands it over: its layer, what its fetch gave
    (`payload`), what `carry` gave for the layer whose fetch its dispatch makes (`ahead`; None:
    none), and what the caller leaves for the rest of the pass: `done`, read back at the
    position's drop, retire or release, and `carried`, the fetch its dispatch made (the payload
    of that layer's dispatch)."""
    layer: object
    payload: object
    ahead: object = None
    done: object = None
    carried: object = None


def walk(order, prefetch: int, copies: str, fetch, carry=None, on_event=None):
    """Runs a pass over the layers `order` to layer_ops: the one interpreter of a pass's order.
    Calls fetch(layer) at each FETCH and carry(layer) at each CARRY, and yields (op, Work) at each
    DISPATCH (the caller dispatches the layer's work on Work.payload, sets Work.done and, when
    Work.ahead is not None, Work.carried), DROP, RETIRE and RELEASE (the same Work, read back).
    on_event(kind, layer), when given, is told of each "dispatch" once the caller is done with it
    and of each retire's "wait" before it (StreamedEngine.on_event's order)."""
    order, fetched, works, ahead = list(order), {}, {}, None
    tell = on_event or (lambda kind, layer: None)
    for op, pos in layer_ops(len(order), prefetch, copies):
        layer = order[pos]
        if op == FETCH:
            fetched[pos] = fetch(layer)
        elif op == CARRY:
            ahead = (pos, carry(layer))
        elif op == DISPATCH:
            work = works[pos] = Work(layer, fetched.pop(pos), ahead and ahead[1])
            yield op, work
            tell("dispatch", layer)
            if ahead is not None:
                if work.carried is None:
                    raise RuntimeError(f"layer {layer}'s dispatch did not hand over its copy of "
                                       f"layer {order[ahead[0]]}")
                fetched[ahead[0]], ahead = work.carried, None
        else:
            if op == RETIRE:
                tell("wait", layer)
            yield op, works[pos] if op == DROP else works.pop(pos)
