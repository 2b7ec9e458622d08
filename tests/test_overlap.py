"""The order of one streamed step's events (dispatch, wait, transfer): the device never waits for
the host at a layer boundary. Recorded by wrapping the engine's device functions and
jax.block_until_ready (its wait point), which works on any version of the engine."""

import threading

import jax
import jax.numpy as jnp
import optax
import pytest

from megatrain_jax import StreamedEngine
from megatrain_jax.engine import schedule, transfer
from megatrain_jax.engine.stream import Carry, LayerStream, Outgoing
from megatrain_jax.model import ModelConfig, make_block, make_stages
from test_streaming import batch

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                  num_kv_heads=2)
COMPUTE, HOST = 0, 1


def record_step(monkeypatch, prefetch=1, num_micro=2, offload=False):
    """Runs a warm-up step, then records the next one's main-thread events in order:
    ("dispatch", pass, layer) per layer call, ("wait", arrays) per block_until_ready."""
    first, last = make_stages(CFG, seed=0)
    cpu = jax.devices("cpu")
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(CFG, 0, i),
                            num_layers=CFG.num_layers, optimizer=optax.adamw(1e-2),
                            max_grad_norm=1.0, compute_dtype=jnp.bfloat16, prefetch=prefetch,
                            compute_device=cpu[COMPUTE], host_device=cpu[HOST],
                            offload_activations=offload)
    data = batch(CFG, num_micro=num_micro)
    float(engine.train_step(*data)["loss"])  # compiles; builds engine.functions
    engine.wait()
    events, made = [], {}  # made: id -> (pass, layer) of a block's outputs (kept alive here)
    f, L = engine.functions, CFG.num_layers
    calls = {"forward": 0, "backward": 0}

    def main():
        return threading.current_thread() is threading.main_thread()

    def wrap(name, kind, layer_of):
        fn = getattr(f, name)

        def wrapped(*args, **kwargs):
            layer = layer_of(calls[kind])
            calls[kind] += 1
            out = fn(*args, **kwargs)
            events.append(("dispatch", kind, layer))
            for x in jax.tree.leaves(out[0]):  # (not the copies it made of another layer)
                made[id(x)] = (kind, layer, x)
            return out
        monkeypatch.setattr(f, name, wrapped)

    # one call per layer and pass, every micro-batch inside it
    wrap("layer_fwd", "forward", lambda k: k)
    wrap("layer_bwd", "backward", lambda k: L - 1 - k)
    wait = jax.block_until_ready

    def recording_wait(tree):
        if main():
            events.append(("wait", jax.tree.leaves(tree)))
        return wait(tree)
    monkeypatch.setattr(jax, "block_until_ready", recording_wait)
    float(engine.train_step(*data)["loss"])
    monkeypatch.undo()
    engine.close()
    return events, made


@pytest.fixture(scope="module")
def recorded():
    """recorded(prefetch, offload): record_step's events and arrays, once per setting for the
    module (the tests only read them)."""
    steps = {}

    def get(prefetch, offload=False):
        if (prefetch, offload) not in steps:
            with pytest.MonkeyPatch.context() as monkeypatch:
                steps[prefetch, offload] = record_step(monkeypatch, prefetch, offload=offload)
        return steps[prefetch, offload]
    return get


def layer_waits(events, made):
    """[(index in events, pass, layer)] of every wait on a block's work."""
    out = []
    for k, e in enumerate(events):
        if e[0] == "wait":
            layers = {made[id(x)][:2] for x in e[1] if id(x) in made}
            out += [(k, p, i) for p, i in sorted(layers)]
    return out


@pytest.mark.parametrize("prefetch,offload", [(1, False), (2, True)])
def test_each_layer_is_dispatched_before_the_previous_one_is_waited_for(recorded, prefetch,
                                                                        offload):
    events, made = recorded(prefetch, offload)
    L = CFG.num_layers
    dispatched = {}  # (pass, layer) -> index of its first dispatch
    for k, e in enumerate(events):
        if e[0] == "dispatch":
            dispatched.setdefault(e[1:], k)
    waits = layer_waits(events, made)
    # every layer but each pass's last is waited for (retired) once, in the pass's order
    assert [(p, i) for _, p, i in waits] == (
        [("forward", i) for i in range(L - 1)] + [("backward", i) for i in range(L - 1, 0, -1)])
    for k, p, i in waits:
        following = i + 1 if p == "forward" else i - 1
        assert dispatched[(p, following)] < k, (
            f"{p} layer {i} waited for before layer {following} was dispatched: the device "
            f"queue drains at the layer boundary")


def test_no_wait_on_a_gradients_host_copy_during_the_backward(recorded):
    """A layer's gradient goes to the host while the next layer computes: the dispatching
    thread never waits on an array outside the compute device's own memory (in the step
    recorded at prefetch 1, as the test above)."""
    events, _ = recorded(1)
    compute = jax.devices("cpu")[COMPUTE]
    host_copies = [x for e in events if e[0] == "wait" for x in e[1]
                   if x.sharding.device_set != {compute} or x.sharding.memory_kind != "device"]
    assert not host_copies, f"waited on {len(host_copies)} arrays outside the device's memory"
    assert any(e[0] == "wait" for e in events)  # the recording sees the engine's waits


@pytest.mark.parametrize("n,prefetch", [(1, 0), (1, 1), (5, 0), (5, 1), (5, 2), (3, 4)])
def test_the_schedule_fetches_each_layer_once_before_its_dispatch(n, prefetch):
    ops = schedule.layer_ops(n, prefetch)
    for pos in range(n):
        assert ops.count((schedule.FETCH, pos)) == 1 == ops.count((schedule.DISPATCH, pos))
        assert ops.index((schedule.FETCH, pos)) < ops.index((schedule.DISPATCH, pos))
        done = [o for o in ops if o[1] == pos and o[0] in (schedule.RETIRE, schedule.RELEASE)]
        assert len(done) == 1 and ops.index(done[0]) > ops.index((schedule.DISPATCH, pos))
        if prefetch and pos:  # dispatch before retire: the device always has work queued
            assert ops.index((schedule.DISPATCH, pos)) < ops.index((schedule.RETIRE, pos - 1))
    assert max(schedule.resident(n, prefetch)) == min(prefetch, n - 1) + 1


@pytest.mark.parametrize("n,prefetch", [(1, 1), (5, 1), (5, 2), (3, 4)])
def test_the_jit_form_fetches_each_layer_inside_the_dispatch_prefetch_before_it(n, prefetch):
    """The jit form: layers 0..p-1 fetched before the pass, layer pos + p by dispatch pos (the
    CARRY right before it); each layer's fetched arrays dropped right after its dispatch; the
    retires as in the eager form; as many layers resident as the eager form's."""
    ops = schedule.layer_ops(n, prefetch, schedule.JIT)
    at = {op: k for k, op in enumerate(ops)}
    for pos in range(n):
        if pos < prefetch:
            assert (schedule.CARRY, pos) not in at and at[(schedule.FETCH, pos)] < at[
                (schedule.DISPATCH, 0)]
        else:
            assert (schedule.FETCH, pos) not in at
            assert ops[at[(schedule.CARRY, pos)] + 1] == (schedule.DISPATCH, pos - prefetch)
        assert ops[at[(schedule.DISPATCH, pos)] + 1] == (schedule.DROP, pos)
        if pos:
            assert at[(schedule.DISPATCH, pos)] < at[(schedule.RETIRE, pos - 1)]
    assert max(schedule.resident(n, prefetch, schedule.JIT)) == min(prefetch, n - 1) + 1
    assert schedule.overlapped(n, prefetch, schedule.JIT) == schedule.overlapped(n, prefetch)
    with pytest.raises(ValueError, match="^copies='jit' needs prefetch >= 1"):
        schedule.layer_ops(n, 0, schedule.JIT)


class CallLog:
    """Transfers standing in for the engine's (in_call, grads_out), recording each call's copies."""

    def __init__(self):
        self.calls, self.eager_out = [], []

    def in_call(self, fn, args, weights=None, activations=None, grads=None):
        self.calls.append((args[0], weights, grads))
        return fn(*args), (weights and f"{weights} in", activations), grads and f"{grads} out"

    def grads_out(self, grads, layer=False):
        self.eager_out.append(grads)
        return transfer.Parcel(None, [[f"{grads} out"]])


def one_loop(copies, n, prefetch, call_at=lambda i: True):
    """One pass over n layers, the same loop in either form: a call per layer (where call_at),
    its gradient sent. (the transfers' log, the payloads, the stream)."""
    log, payloads = CallLog(), []
    stream = LayerStream(range(n), lambda i: f"w{i}", prefetch, copies=copies,
                         carry=Carry(lambda i: (f"bus{i}", None), lambda i, copied: copied[0]),
                         transfers=log)
    for i, w in stream:
        payloads.append(w)
        if call_at(i):
            stream.call(lambda layer: layer, (i,))
        stream.send(i, f"g{i}")
        stream.done(())
    return log, payloads, stream


@pytest.mark.parametrize("n,prefetch", [(1, 1), (4, 1), (4, 2)])
def test_the_stream_owns_the_copies_form(n, prefetch):
    """A pass's loop reads the same in both forms (engine/step.py's): eager, every fetch is the
    fetch function's and each gradient goes out at its send; jit, layer i + p's fetch is made in
    layer i's call and layer i's gradient in layer i + 1's, the last one's left for the caller
    (stream.leaving); every gradient goes out once."""
    log, payloads, stream = one_loop(schedule.EAGER, n, prefetch)
    assert payloads == [f"w{i}" for i in range(n)]
    assert log.calls == [(i, None, None) for i in range(n)]
    assert log.eager_out == [f"g{i}" for i in range(n)] and stream.leaving is None
    assert {k: p.pieces for k, p in stream.sent.items()} == {i: [[f"g{i} out"]] for i in range(n)}
    log, payloads, stream = one_loop(schedule.JIT, n, prefetch)
    assert payloads == [f"w{i}" if i < prefetch else f"bus{i} in" for i in range(n)]
    assert log.calls == [(i, f"bus{i + prefetch}" if i + prefetch < n else None,
                          f"g{i - 1}" if i else None) for i in range(n)]
    assert log.eager_out == [] and stream.sent == {i: f"g{i} out" for i in range(n - 1)}
    assert stream.leaving == Outgoing(n - 1, f"g{n - 1}", [f"g{n - 1}"])


def test_a_jit_dispatch_that_makes_no_call_is_an_error():
    """The gradient the layer before sent would never go out: said at once, naming both."""
    with pytest.raises(RuntimeError, match="^layer 3's dispatch made no call to send the "
                                           "gradient of 2 out$"):
        one_loop(schedule.JIT, 4, 1, call_at=lambda i: i < 3)
    one_loop(schedule.EAGER, 4, 1, call_at=lambda i: i < 3)  # (eager: nothing waits on a call)


def test_gradients_and_bus_copies_stay_in_the_compute_devices_pinned_memory(monkeypatch):
    """On the dispatching thread every gradient goes to the compute device's pinned host memory
    (the hop to the host device is the update thread's), and bus copies wait there."""
    from test_streaming import engine_for
    engine = engine_for(CFG, compute_dtype=jnp.bfloat16)
    compute = jax.devices("cpu")[COMPUTE]
    parcels, grads_out = [], engine.transfers.grads_out

    def keep(tree, layer=False):
        parcels.append(grads_out(tree, layer))
        return parcels[-1]
    monkeypatch.setattr(engine.transfers, "grads_out", keep)
    float(engine.train_step(*batch(CFG))["loss"])
    engine.wait()
    pieces = [x for p in parcels for x in p.token()]
    assert len(parcels) == CFG.num_layers + 2 and pieces  # the two stage units'
    assert {(x.sharding.memory_kind, *x.sharding.device_set) for x in pieces} == {
        ("pinned_host", compute)}
    bus = jax.tree.leaves(engine.host.bus(1))[0]
    assert (bus.sharding.memory_kind, *bus.sharding.device_set) == ("pinned_host", compute)
    engine.close()


def test_a_memory_kind_where_the_plan_counts_none_is_a_one_line_error():
    from test_streaming import engine_for
    engine = engine_for(CFG, compute_dtype=jnp.bfloat16)
    in_device_memory = jax.device_put(jnp.zeros(3), jax.devices("cpu")[COMPUTE])
    with pytest.raises(ValueError, match=r"bus copies land in memory kind 'device', not "
                                         r"'pinned_host', on the cpu backend") as e:
        engine.transfers.check([in_device_memory], "pinned_host")
    assert "\n" not in str(e.value)
    engine.close()


def test_a_compute_device_without_pinned_memory_takes_the_logged_fallback(monkeypatch, caplog):
    from megatrain_jax.engine.parallel import Placement
    from megatrain_jax.engine.stream import Counters
    monkeypatch.setattr(transfer, "memory_kinds", lambda device: {"device"})
    cpu = jax.devices("cpu")
    with caplog.at_level("WARNING", logger=transfer.__name__):
        t = transfer.Transfers(Placement([cpu[COMPUTE]]), cpu[HOST], Counters())
    assert t.out_kind is None and "has no pinned_host memory" in caplog.text
    parcel = t.grads_out(jax.device_put(jnp.ones(4), cpu[COMPUTE]))
    assert {x.sharding.device_set == {cpu[HOST]} for x in parcel.token()} == {True}


def test_each_gradient_goes_out_before_the_next_layer_and_is_never_waited_for():
    """The engine's own events (on_event) of a step's backward: layer i's gradient is enqueued
    out with its work (a "dispatch" event ends a layer's dispatching), before layer i - 1 is
    dispatched, and the wait that retires layer i comes after that dispatch."""
    from test_streaming import engine_for
    engine = engine_for(CFG, compute_dtype=jnp.bfloat16)
    float(engine.train_step(*batch(CFG))["loss"])
    events = []
    engine.on_event = lambda kind, what, layer: events.append((kind, what, layer))
    float(engine.train_step(*batch(CFG))["loss"])
    engine.close()
    at = {e: k for k, e in enumerate(events) if e[0] != "transfer"}
    outs = [k for k, e in enumerate(events) if e == ("transfer", "gradient out", None)]
    # the last stage's (at the loss: the host lookup's), every layer's, the rows' (embedding's)
    assert len(outs) == CFG.num_layers + 2
    for i in range(CFG.num_layers - 1, 0, -1):
        out = outs[CFG.num_layers - i]
        assert out < at[("dispatch", "backward", i)] < at[("dispatch", "backward", i - 1)] < at[
            ("wait", "backward", i)]
        if i < CFG.num_layers - 1:
            assert at[("dispatch", "backward", i + 1)] < out


@pytest.mark.parametrize("tie", [False, True])
def test_the_host_thread_updates_the_embedding_first_and_the_head_last(tie):
    """The next forward needs the embedding first and the final norm and head only after every
    layer: the host thread updates the first stage's unit (with tied embeddings, the tied table
    too), then layers 0 .. L-1, then the last stage's unit."""
    import dataclasses
    from test_streaming import engine_for
    engine = engine_for(dataclasses.replace(CFG, tie_embeddings=tie))
    events = []
    engine.on_event = lambda kind, what, layer: events.append((kind, what, layer))
    float(engine.train_step(*batch(CFG))["loss"])
    engine.wait()
    engine.close()
    updates = [e for e in events if e[0] == "update"]
    assert updates == ([("update", "first stage", None)]
                       + [("update", "layer", i) for i in range(CFG.num_layers)]
                       + [("update", "last stage", None)])
