"""Copies made inside the jitted calls (engine/step.py's jit form): the same bits as eager copies,
no eager copy of a layer's weights or gradient on the dispatching thread, each bus copy where it
was, compiled once; `copies` / offload.copies refused with one line where it cannot run."""

import collections

import jax
import numpy as np
import pytest
from test_direct import CPU, L, TOKENS, engine_on
from test_engine import count_compiles

from megatrain_jax import commands
from megatrain_jax.engine.tier import DiskTierOptions

STEPS = 3


def train(copies, **kwargs):
    """Three steps on CPU device 1 standing for the accelerator: (losses, grad norms, state,
    counters, transfer events per step, each step's bus pointers per unit, compiles in steps 2
    and 3)."""
    engine = engine_on((CPU[1], CPU[0]), copies=copies, **kwargs)
    assert engine.copies == copies
    events = []
    engine.on_event = lambda kind, what, layer: events.append(what) if kind == "transfer" else None
    losses, norms, buses, compiles = [], [], [], []
    for k, t in enumerate(TOKENS[:STEPS]):
        with count_compiles() as made:
            result = engine.train_step(t[..., :-1], t[..., 1:])
            losses.append(float(result["loss"]))
            norms.append(float(result["grad_norm"]))
            engine.wait()
        compiles += made if k else []
        buses.append([[b.unsafe_buffer_pointer() for b in jax.tree.leaves(engine.host.bus(u))]
                      for u in range(L + 2)])
    state = jax.tree.map(np.array, engine.state())
    counters = (engine.counters.bytes_h2d, engine.counters.bytes_d2h)
    direct = engine.host_update == "direct"
    if direct:
        assert (engine.host.fetches is not None) == kwargs.get("offload_activations", False)
    engine.close()
    return losses, norms, state, counters, collections.Counter(events), buses, compiles, direct


@pytest.mark.parametrize("setup", [dict(), dict(offload_activations=True, prefetch=2),
                                   dict(host_lookup=True), dict(disk=True)],
                         ids=["kept", "offloaded", "lookup", "disk tier"])
def test_the_jit_form_trains_the_eager_forms_bits_with_no_eager_layer_copy(setup, monkeypatch,
                                                                           tmp_path):
    """Two micro-batches, three steps, the host update called directly: the same losses, grad
    norms and state bit for bit, and the same bytes each way. In the jit form the dispatching
    thread issues no eager copy of a layer's weights but the first `prefetch` of each pass, and
    none of a layer's gradient (but layer 0's with the host lookup, where no device function runs
    after it) or of the stages' (on the device path); each unit's bus copy is the same buffer every step; steps 2 and 3 compile
    nothing.
    Offloaded, in debug mode (MEGATRAIN_DEBUG_BUS=1): no update writes a bus copy that a fetch
    made inside a call still reads. The disk tier (its bus copies refreshed into pinned memory by
    a jitted update) too."""
    if setup.get("offload_activations"):
        monkeypatch.setenv("MEGATRAIN_DEBUG_BUS", "1")
    setup, disk = {k: v for k, v in setup.items() if k != "disk"}, setup.get("disk", False)
    tier = lambda form: {"disk_tier": DiskTierOptions(str(tmp_path / form))} if disk else {}
    eager = train("eager", **setup, **tier("eager"))
    losses, norms, state, counters, events, buses, compiles, direct = train(
        "jit", **setup, **tier("jit"))
    assert (losses, norms, counters) == eager[:2] + (eager[3],)
    for a, b in zip(jax.tree.leaves(eager[2]), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    p, lookup = setup.get("prefetch", 1), setup.get("host_lookup", False)
    stage_fetches = 1 if lookup else 3  # (the host lookup: the rows cross, not the embedding)
    assert eager[4]["weights in"] == STEPS * (stage_fetches + 2 * L)
    assert eager[4]["gradient out"] == STEPS * (L + 2)
    assert events["weights in"] == STEPS * (stage_fetches + 2 * p)
    assert events["weights in, in the call"] == STEPS * 2 * (L - p)
    # the device path's stages' gradient is made in pinned memory by its call (two units); the
    # host lookup's last unit goes out at the loss, its rows' gradient and layer 0's at the end
    assert events["gradient out"] == STEPS * 3 * lookup
    assert events["gradient out, in the call"] == STEPS * (L - lookup + 2 * (not lookup))
    if setup.get("offload_activations"):
        assert events["activations in, in the call"] == STEPS * (L - p)
        assert events["activations in"] == STEPS * p
    if direct:  # (the direct update's bus copies are persistent buffers)
        assert buses[0] == buses[1] == buses[2]
    assert compiles == []


def test_jit_copies_where_they_cannot_run_are_one_line():
    with pytest.raises(ValueError, match="^copies must be one of auto, eager, jit, got 'x'$"):
        engine_on((CPU[1], CPU[0]), copies="x")
    with pytest.raises(ValueError, match=r"^copies='jit' cannot run: no accelerator \(nothing "
                                         r"crosses a bus\)$"):
        engine_on((CPU[0], CPU[0]), copies="jit")
    with pytest.raises(ValueError, match="^copies='jit' cannot run: prefetch 0"):
        engine_on((CPU[1], CPU[0]), copies="jit", prefetch=0)
    # auto: the jit form on a GPU only (a CPU device standing in for one is not measured)
    assert engine_on((CPU[1], CPU[0])).copies == "eager"


def test_a_bad_offload_copies_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert commands.train(["offload.copies=fast", f"run_dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip() == ("error: offload.copies must be one of auto, "
                                               "eager, jit, got 'fast'")
    assert not run_dir.exists()
