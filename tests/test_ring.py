"""offload.bus=ring (engine/bus.py's Ring): the layers' bus copies in prefetch + 2 buffers, each
filled from the fp32 master just before its fetch. The same bits as resident bus copies, in both
copies forms and prefetch depths (and under the debug guard); a slot refilled only after the
computation that read it is done, without holding back a dispatch; no layer bus copy written by
the update; the key refused with one line where it cannot run."""

import ctypes
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megatrain_jax import commands
from megatrain_jax.config import load_config
from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.recipes import build_engine

CPU = jax.devices("cpu")
STEPS = 5
# configs/tiny.yaml, smaller, in bf16 (the ring's cast is then a rounding, as on a GPU)
CFG = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16", "data.seq_len=32",
                                        "data.batch_size=2", "data.micro_batches=2"])
L = CFG.model.num_layers
TOKENS = np.random.default_rng(0).integers(0, CFG.model.vocab_size, size=(STEPS, 2, 2, 33))


def engine(bus, copies="eager", prefetch=1, **kwargs):
    """CPU device 1 standing for the accelerator, the state on device 0."""
    cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, prefetch=prefetch))
    built = build_engine(cfg, compute_device=CPU[1], host_device=CPU[0], copies=copies, bus=bus,
                         **kwargs)
    assert (built.copies, built.bus) == (copies, bus)
    return built


def train(built, steps=STEPS):
    """(losses, state as numpy) after `steps` steps."""
    losses = [float(built.train_step(t[..., :-1], t[..., 1:])["loss"]) for t in TOKENS[:steps]]
    return losses, jax.tree.map(np.array, built.state())


@pytest.fixture(scope="module")
def resident():
    built = engine("resident")
    try:
        yield train(built)
    finally:
        built.close()


@pytest.mark.parametrize("copies,prefetch,debug", [("eager", 1, False), ("eager", 2, True),
                                                   ("jit", 1, True), ("jit", 2, False)])
def test_the_ring_trains_the_resident_bits(resident, monkeypatch, copies, prefetch, debug):
    """Losses and final weights and optimizer state bit for bit; every fill found its slot's
    reader done (none written into a fresh buffer); under the debug guard no slot is rewritten
    while a copy from it is still running. (Resident bus copies give the same bits in both forms
    and at every prefetch: tests/test_injit.py.)"""
    if debug:
        monkeypatch.setenv("MEGATRAIN_DEBUG_BUS", "1")
    built = engine("ring", copies, prefetch)
    try:
        ring = built.host.buses.ring
        assert len(ring.slots) == prefetch + 2 and ring.debug == debug
        losses, state = train(built)
        assert ring.fresh == 0
    finally:
        built.close()
    assert losses == resident[0]
    for a, b in zip(jax.tree.leaves(resident[1]), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_without_the_kernel_the_rings_numpy_cast_gives_the_same_bits(resident, monkeypatch):
    """Where the fused AdamW kernel is not built the ring casts with numpy (round to nearest
    even, as the kernel and XLA): the same losses."""
    built = engine("ring")
    monkeypatch.setattr(bus_lib.fused_adamw, "kernel", lambda: None)
    try:
        losses, _ = train(built, steps=3)
    finally:
        built.close()
    assert losses == resident[0][:3]


class _Raised(Exception):
    pass


@pytest.mark.parametrize("copies,phase", [("eager", "backward"), ("jit", "forward")])
def test_after_a_step_that_raised_the_ring_trains_the_resident_bits(resident, copies, phase):
    """A step that raises midway (at layer 1 of a pass) leaves slots whose readers never retired:
    the next fills write into fresh buffers, and the run goes on to the uninterrupted resident
    run's losses and state, bit for bit (a step that raises changes nothing)."""
    built = engine("ring", copies)

    def boom(at, layer=None):
        if at == phase and layer == 1:
            raise _Raised

    try:
        losses = [float(built.train_step(t[..., :-1], t[..., 1:])["loss"]) for t in TOKENS[:2]]
        built.on_phase = boom
        with pytest.raises(_Raised):
            built.train_step(TOKENS[2][..., :-1], TOKENS[2][..., 1:])
        built.on_phase = None
        losses += [float(built.train_step(t[..., :-1], t[..., 1:])["loss"]) for t in TOKENS[2:]]
        assert built.host.buses.ring.fresh > 0
        state = jax.tree.map(np.array, built.state())
    finally:
        built.close()
    assert losses == resident[0]
    for a, b in zip(jax.tree.leaves(resident[1]), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fresh_slot_is_written_once_its_making_is_done():
    """A fill into a fresh buffer writes through the buffer's pointers, which do not wait for the
    computation that makes it: the ring waits for it first, or that computation, landing after
    the write, would overwrite the cast with what it made."""
    n = 1 << 22
    make = jax.jit(lambda: jnp.cumsum(jnp.ones((n,), jnp.float32)).astype(jnp.bfloat16) * 0,
                   out_shardings=jax.sharding.SingleDeviceSharding(CPU[1]))

    written = []

    def write_through_pointer(leaves, master):
        out, = leaves
        ptr = out.unsafe_buffer_pointer()
        view = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint16)), (n,))
        view[:] = master[0].view(np.uint32)[:n] >> 16  # bf16 of the master: its top 16 bits
        written.append(out)

    ring = bus_lib.Ring(lambda: [make()], size=1, write=write_through_pointer, debug=False)
    master = [np.full((n,), 1.5, np.float32)]
    ring.fill(1, master)  # the slot's buffer made at construction
    ring.fill(1, master)  # its reader never retired: a fresh buffer
    assert ring.fresh == 1
    for out in written:
        np.testing.assert_array_equal(np.asarray(out, np.float32), 1.5)


class _FailedOutput:
    """Stands for an output of a computation that failed on the device: waiting for it raises
    that computation's error, as jax.block_until_ready does for such an array."""

    def block_until_ready(self):
        raise RuntimeError("INTERNAL: the reader's computation failed\n(its traceback)")


def test_a_slot_whose_readers_computation_failed_makes_the_engine_unusable_once_named():
    """Layer 0's last fill (released, its token not yet waited on) read by a computation that
    failed: the step that refills the slot says in one line that the engine is unusable and why,
    and every later step or evaluation says the same (not the old device error again at each
    fill); the host state, which no update touched, is still read."""
    built = engine("ring")
    try:
        losses, before = train(built, steps=1)
        ring = built.host.buses.ring
        slot = ring.slots[ring.holds[1][0]]
        assert slot.reader is not None and slot.token is not None  # released, not retired
        slot.token = [_FailedOutput()]
        unusable = (r"^the engine is unusable: a computation that read bus ring slot \d failed "
                    r"\(RuntimeError: INTERNAL: the reader's computation failed\)$")
        t = TOKENS[1]
        for call in (built.train_step, built.train_step, built.evaluate):
            with pytest.raises(RuntimeError, match=unusable):
                call(t[..., :-1], t[..., 1:])
        for a, b in zip(jax.tree.leaves(built.state()), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    finally:
        built.close()


class _Waited:
    """A token's array, saying whether it was waited for (jax.block_until_ready calls this)."""

    def __init__(self, array):
        self.array, self.waited = array, False

    def block_until_ready(self):
        self.waited = True
        self.array.block_until_ready()
        return self


@pytest.mark.parametrize("copies,prefetch", [("eager", 1), ("jit", 2)])
def test_each_slot_is_refilled_after_its_reader_and_no_dispatch_waits_for_it(copies, prefetch):
    """The order of events over two steps: a slot is rewritten only after the pass retired the
    layer that read it, or, the pass's last layer (released without a wait), once the fill has
    waited for the token the ring made of its outputs (seen at the fill's start, checked at its
    write); and the fill (with the fetch right after it) of each layer comes before the pass
    waits for the layer before it, so the device always has the next layer's copy and compute
    queued while the host waits."""
    built = engine("ring", copies, prefetch)
    ring = built.host.buses.ring
    events, holder, problems, filling, released = [], {}, [], [], []
    read, write = built.host.read, ring.write

    def on_read(u, token=None):
        events.append(("read", u, token is None))
        read(u, token)

    def retired(v, k):
        """Whether unit v's fill at events[k] was read with no token before its next fill."""
        for e in events[k + 1:]:
            if e[:2] == ("fill", v):
                return False
            if e == ("read", v, True):
                return True
        return False

    def on_fill(u, s):  # before the fill waits for anything
        slot, token = ring.slots[s], None
        if s in holder:  # its reader: retired (read with no token), or released with a token
            v, k = holder[s]
            if not retired(v, k):
                if slot.token is None:
                    problems.append((u, s, v))
                else:  # (the fill waits through these)
                    token = slot.token = [_Waited(x) for x in slot.token]
                    released.append(s)
        holder[s] = (u, len(events))
        filling.append((u, s, token))
        events.append(("fill", u, s))

    def on_write(leaves, master):
        u, s, token = filling[-1]
        if token is not None and not all(x.waited and x.array.is_ready() for x in token):
            problems.append((u, s, "written before its reader's token was waited for"))
        write(leaves, master)

    ring.write = on_write
    built.host.read = on_read
    ring.on_fill = on_fill
    built.on_event = lambda kind, what, layer: (
        events.append((kind, what, layer)) if kind in ("dispatch", "wait") else None)
    try:
        train(built, steps=2)
    finally:
        built.close()
    assert problems == [] and released  # (some slots' readers were released)
    fills = [k for k, e in enumerate(events) if e[0] == "fill"]
    assert len(fills) == 2 * 2 * L  # each layer twice a step: its forward's, its backward's
    for step in range(2):
        for n, (phase, order) in enumerate((("forward", list(range(L))),
                                            ("backward", list(reversed(range(L)))))):
            mine = fills[(2 * step + n) * L:(2 * step + n + 1) * L]  # the pass's, in its order
            assert [events[k][1] for k in mine] == [1 + i for i in order]
            for pos in range(1, L):
                wait = [k for k, e in enumerate(events) if e == ("wait", phase, order[pos - 1])]
                assert mine[pos] < wait[step], (step, phase, pos)


@pytest.mark.parametrize("host_update", ["direct", "jit"])
def test_the_debug_guard_has_every_refilled_slots_fetches_to_check(monkeypatch, host_update):
    """MEGATRAIN_DEBUG_BUS=1, whichever path updates the state: each refill of a slot finds the
    copies fetched from it still there for the guard to check (none deleted before it looks)."""
    monkeypatch.setenv("MEGATRAIN_DEBUG_BUS", "1")
    built = engine("ring", host_update=host_update)
    if host_update == "direct" and built.host_update != "direct":
        built.close()
        pytest.skip("the fused AdamW kernel could not be built")
    ring, filled, seen = built.host.buses.ring, set(), []

    def on_fill(u, s):
        if s in filled:
            fetches = ring.slots[s].fetches
            seen.append((len(fetches), sum(not x.is_deleted() for x in fetches)))
        filled.add(s)

    ring.on_fill = on_fill
    try:
        train(built, steps=2)
    finally:
        built.close()
    assert len(seen) == 2 * 2 * L - len(ring.slots)
    assert all(total > 0 and checkable == total for total, checkable in seen), seen


def test_the_update_writes_no_layer_bus_copy_with_the_ring():
    """The direct update's kernel gets no bus pointer for a layer unit (fewer bytes each
    update), and still writes the stages' resident bus copies."""
    built = engine("ring")
    direct = getattr(built.host.update, "kernel", None)
    if direct is None:
        built.close()
        pytest.skip("the fused AdamW kernel could not be built")
    writes = {}
    direct.on_kernel = lambda u, ranges: writes.setdefault(u, []).extend(
        r.bus is not None for r in ranges)
    try:
        train(built, steps=1)
        built.wait()
    finally:
        built.close()
    assert sorted(writes) == list(range(L + 2))
    assert not any(any(writes[u]) for u in range(1, L + 1))
    assert all(writes[0]) and all(writes[L + 1])


def test_a_ring_where_it_cannot_run_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^bus must be one of auto, resident, ring, got 'x'$"):
        build_engine(CFG, compute_device=CPU[1], host_device=CPU[0], bus="x")
    fp32 = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, compute_dtype="float32"))
    with pytest.raises(ValueError, match=r"^offload.bus='ring' cannot run: the bus copy is the "
                                         r"fp32 master itself"):
        build_engine(fp32, compute_device=CPU[0], host_device=CPU[0], bus="ring")


def test_a_bad_offload_bus_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert commands.train(["offload.bus=rings", f"run_dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip() == ("error: offload.bus must be one of auto, "
                                               "resident, ring, got 'rings' (did you mean ring?)")
    assert not run_dir.exists()


def test_auto_takes_the_ring_only_where_resident_copies_do_not_fit_and_the_ring_does():
    """bus.choose_form, the rule of the engine and the plan; and an asked-for ring that the
    pinned pool cannot hold: one line naming XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB and the size."""
    choose = lambda setting, **kw: bus_lib.choose_form(
        setting, **{"resident_pinned": 100 * 2**30, "ring_pinned": 10 * 2**30,
                    "pool": 64 * 2**30, **kw})
    assert choose("auto")[0] == "ring"
    assert "64 GiB pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)" in choose("auto")[1]
    assert choose("auto", pool=None)[0] == "resident"  # not a GPU: no pool
    assert choose("auto", pool=None, host_short="host RAM 1.9 TB > 1.5 TB")[0] == "ring"
    assert choose("auto", pool=200 * 2**30)[0] == "resident"
    assert choose("auto", pool=8 * 2**30)[0] == "resident"  # the ring does not fit either
    assert choose("resident") == ("resident", "asked for")
    with pytest.raises(ValueError, match=r"^bus='ring': the bus ring and the stages' bus copies "
                                         r"need 10.74 GB of XLA's pinned host pool, which is "
                                         r"8 GiB: run with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=18$"):
        choose("ring", pool=8 * 2**30)


def _tiny_plan(host_memory_gb, overrides=()):
    from megatrain_jax.machines import MACHINES
    from megatrain_jax.plan import plan
    cfg = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16", *overrides])
    return plan(cfg, dataclasses.replace(MACHINES["h200"], host_memory_gb=host_memory_gb))


def test_the_plan_counts_the_ring_and_auto_takes_it_where_host_ram_is_short(monkeypatch):
    """The plan's bus bytes with the ring: the stages' copies and prefetch + 2 layers' (not
    every layer's); auto takes it where resident copies leave host RAM short and the ring fits,
    and says so; resident where host RAM holds them."""
    monkeypatch.delenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", raising=False)
    roomy = _tiny_plan(1000)
    c = roomy.counts
    assert (roomy.bus, roomy.bus_reason) == ("resident", "auto: host memory holds every unit's "
                                                         "bus copy")
    assert roomy.host["bus"] == 2 * c.params
    ring = _tiny_plan(1000, ["offload.bus=ring"])
    assert (ring.bus, ring.bus_reason) == ("ring", "asked for")
    assert ring.host["bus"] == 2 * (c.stages + 3 * c.layer) < roomy.host["bus"]
    between = (ring.host_total + roomy.host_total) / 2 / 1e9
    short = _tiny_plan(between)
    assert short.bus == "ring" and short.fits and not _tiny_plan(between,
                                                                 ["offload.bus=resident"]).fits
    assert short.bus_reason.startswith("auto: with resident bus copies host RAM would be ")
    assert "bus copies ring (auto: with resident bus copies host RAM" in short.summary()


def test_a_ring_the_pinned_pool_cannot_hold_is_one_line_exit_2(monkeypatch, capsys):
    """offload.bus=ring asked for where XLA's pinned pool is smaller than the ring and the
    stages' copies: `megatrain plan` says so in one line naming XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
    and the size, exit 2; auto then keeps resident copies (and the plan's note names the pool)."""
    from megatrain_jax import commands
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0.0001")
    argv = ["plan", "--config", "configs/tiny.yaml", "--device", "h200",
            "train.compute_dtype=bfloat16"]
    assert commands.run([*argv, "offload.bus=ring"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.fullmatch(r"error: offload.bus='ring': the bus ring and the stages' bus copies need "
                        r"[0-9.]+ (GB|MB) of XLA's pinned host pool, which is 0.0001 GiB: run "
                        r"with XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=9", err), err


def test_the_step_time_model_counts_the_rings_casts_and_no_layer_bus_write():
    """Each layer fetch (two a step) casts its fp32 master into a ring buffer on the dispatching
    thread, 4 + 2 B/param at the host update's rate; the layer's update writes 2 B/param less."""
    from megatrain_jax import step_time
    cfg = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16"])
    resident, ring = (step_time.step_shape(cfg, offload=False, bus=form)
                      for form in ("resident", "ring"))
    layer = ring.layer_bytes // 2  # parameters of a layer (bf16 weights)
    assert (resident.ring_fill_bytes, ring.ring_fill_bytes) == (0, 6 * layer)
    assert resident.layer_update_bytes - ring.layer_update_bytes == 2 * layer
    rates = step_time.Rates(host_update_gbps=1e-3)  # slow enough to see
    fills = [o for o in step_time.simulate(ring, rates, steps=2).ops
             if o.label.startswith("fill unit")]
    assert len(fills) == 2 * 2 * L and {o.resource for o in fills} == {"dispatch"}
    assert fills[0].end - fills[0].start == pytest.approx(6 * layer / 1e6)
