"""The step-time simulation's logic on hand-made steps (megatrain_jax.step_time): what bounds a
transfer-bound and a compute-bound step, the update that waiting for the global norm exposes, the
rates read from measured results, and `plan --step-time` end to end. Figures, not timings: each
case's rates make the expected step time exact."""

import dataclasses
import json
import math
import re
import contextlib
import io
import os
import types

import pytest

from megatrain_jax import commands
from megatrain_jax.step_time import (DEFAULTS, OVERLAPS, RESOURCES, Rates, StepShape,
                                     executed_flops, measured_rates, simulate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 1 GB/s each way, 1 TFLOP/s, 1 GB/s host update, no dispatch cost: bytes/1e9 and FLOPs/1e12
# are seconds; every copy wholly hidden under the compute beside it.
UNIT = Rates(h2d_gbps=1, d2h_gbps=1, device_tflops=1, host_update_gbps=1, dispatch_us=0,
             **{k: 1.0 for k in OVERLAPS})


def shape(**kw) -> StepShape:
    base = dict(layers=4, micro_batches=1, prefetch=1, tokens_per_step=1000, first_bytes=0,
                last_bytes=0, layer_bytes=0, stages_grad_bytes=0, layer_grad_bytes=0, act_bytes=0, layer_fwd_flops=0.0, layer_bwd_flops=0.0,
                head_flops=0.0, stages_update_bytes=0, layer_update_bytes=0, model_flops=1.0)
    return StepShape(**{**base, **kw})


def test_a_transfer_bound_step_is_the_bus_time():
    """Weights of 1 s each way per layer, nothing else: the bus never rests (prefetch keeps the
    next layer coming), and the step is every fetch back to back, 2 per layer + the stages'."""
    s = shape(layers=4, layer_bytes=int(1e9), first_bytes=int(0.5e9), last_bytes=int(0.25e9),
              layer_fwd_flops=1e9, layer_bwd_flops=2e9)
    p = simulate(s, UNIT)
    bus = 2 * 4 * 1.0 + 2 * 0.5 + 0.25  # layers in both passes, the embedding twice, the head
    assert math.isclose(p.step_s, bus, rel_tol=1e-9)
    assert p.bound == "h2d" and math.isclose(p.busy_s["h2d"], bus, rel_tol=1e-9)
    # the critical path covers the step exactly, with no gap
    assert math.isclose(sum(p.critical_s.values()), p.step_s, rel_tol=1e-12)


def test_a_compute_bound_step_is_the_device_time():
    s = shape(layers=3, micro_batches=2, layer_bytes=1000, layer_grad_bytes=1000,
              layer_fwd_flops=1e12, layer_bwd_flops=3e12, head_flops=0.5e12,
              stages_update_bytes=1000, layer_update_bytes=1000, model_flops=10e12)
    p = simulate(s, dataclasses.replace(UNIT, h2d_gbps=1e6, d2h_gbps=1e6, host_update_gbps=1e6))
    device = 2 * (3 * (1 + 3) + 0.5)
    assert math.isclose(executed_flops(s) / 1e12, device)
    assert p.bound == "device" and math.isclose(p.step_s, device, rel_tol=1e-6)
    assert math.isclose(p.mfu(1.0), 10 / device, rel_tol=1e-6)


def test_waiting_for_the_norm_exposes_only_the_updates_the_first_layer_needs():
    """The host update (0.5 s stages + 4 x 0.25 s layers) is shorter than one forward (4 s), so
    it could hide. With exact clipping every update waits for the norm, i.e. for the whole
    backward; the next step needs the stages and (prefetch 1) layer 0 before it dispatches layer
    0, and fetches layer 1 only after that dispatch, while layer 0 computes: 0.5 + 0.25 s
    exposed, layer 1's update hidden. Submitted as each gradient arrives, layers 3..1's updates
    hide in the backward; layer 0's and the stages' gradients come last, so 0.25 + 0.5 s still
    show."""
    s = shape(layers=4, layer_fwd_flops=1e12, layer_bwd_flops=2e12,
              stages_update_bytes=int(0.5e9), layer_update_bytes=int(0.25e9))
    device = 4 * (1 + 2)
    exact = simulate(s, UNIT)
    assert math.isclose(exact.busy_s["device"], device, rel_tol=1e-9)
    assert math.isclose(exact.step_s, device + 0.5 + 0.25, rel_tol=1e-9)
    assert exact.bound == "device" and math.isclose(exact.critical_s["host update"], 0.75)
    eager = simulate(dataclasses.replace(s, updates_wait_for_norm=False), UNIT)
    assert math.isclose(eager.step_s, device + 0.25 + 0.5, rel_tol=1e-9)
    # a deeper prefetch waits for one more layer's update before the forward starts
    deeper = simulate(dataclasses.replace(s, prefetch=2), UNIT)
    assert math.isclose(deeper.step_s, device + 0.5 + 2 * 0.25, rel_tol=1e-9)


def test_the_hop_between_clients_is_the_host_threads_at_its_own_rate():
    """A unit's update on the host thread takes its bytes at host_update_gbps plus its hop's
    between the clients (gradient in, bus copy out) at hop_gbps: 1 s + 0.5 GB at 0.25 GB/s a
    layer here, nothing else in the step."""
    s = shape(layers=3, layer_update_bytes=int(1e9), layer_hop_bytes=int(0.5e9),
              stages_update_bytes=int(1e9), head_update_bytes=int(0.5e9),
              first_hop_bytes=int(0.25e9), head_hop_bytes=int(0.5e9))
    p = simulate(s, dataclasses.replace(UNIT, hop_gbps=0.25))
    busy = 3 * (1 + 2) + (0.5 + 1) + (0.5 + 2)  # the layers, the first stage's, the last's
    assert math.isclose(p.busy_s["host update"], busy, rel_tol=1e-9)
    assert s.hop_bytes == int(3 * 0.5e9 + 0.25e9 + 0.5e9)


def test_each_gradients_copy_out_overlaps_the_next_layers_backward():
    """A backward layer retires on its sum of squares, so its gradient (0.5 s on the bus) crosses
    while the next layer (1 s) computes: only the last layer's shows, and only because the next
    step's first layer needs its update."""
    s = shape(layers=3, layer_fwd_flops=1e12, layer_bwd_flops=1e12, layer_grad_bytes=int(0.5e9))
    p = simulate(s, UNIT)
    assert math.isclose(p.step_s, 3 * 2 + 0.5, rel_tol=1e-9)
    assert math.isclose(p.busy_s["d2h"], 3 * 0.5, rel_tol=1e-9)
    assert math.isclose(p.critical_s["d2h"], 0.5, rel_tol=1e-9)


def test_the_forward_keeps_the_device_busy_while_the_next_fetch_waits():
    """Fetches (0.5 s) shorter than a layer (1 s), 1 ms a dispatch: layer i + 1 is dispatched
    before the host waits for layer i, so the device runs each pass back to back (waiting for
    layer i first, as before, would leave a gap of two dispatches at every boundary)."""
    s = shape(layers=4, layer_bytes=int(0.5e9), layer_fwd_flops=1e12, layer_bwd_flops=1e12)
    p = simulate(s, dataclasses.replace(UNIT, dispatch_us=1000))
    for kind in ("forward", "backward"):
        ops = [o for o in p.ops if o.step == 3 and o.resource == "device"
               and o.label.startswith(kind)]
        assert len(ops) == 4 and [b.start - a.end for a, b in zip(ops, ops[1:])] == [0.0] * 3


@pytest.mark.parametrize("config,seq_len,window", [
    ("configs/llama3_8b.yaml", 65536, 0), ("configs/bench_1b.yaml", 262144, 0),
    ("configs/bench_1b.yaml", 65536, 4096)])
def test_mfu_never_passes_100_percent(config, seq_len, window):
    """Attention is counted as the device runs it (causal; a window: T x window): the useful
    FLOPs never exceed what the device executes, so at the datasheet peak MFU <= 100%."""
    from megatrain_jax.config import load_config
    from megatrain_jax.step_time import step_shape
    cfg = load_config(config, [f"data.seq_len={seq_len}", "data.batch_size=1",
                               "data.micro_batches=1", f"model.sliding_window={window}"])
    s = step_shape(cfg, offload=True)
    assert s.model_flops <= executed_flops(s)
    fast = Rates(h2d_gbps=1e6, d2h_gbps=1e6, device_tflops=989, host_update_gbps=1e6,
                 dispatch_us=0)
    assert simulate(s, fast).mfu(989) <= 1.0
    # the useful count: 6 per matmul parameter, 12 * heads * head_size per visible key and layer
    m, T = cfg.model, seq_len
    W = window or T
    visible = (W * (W + 1) / 2 + (T - W) * W) / T  # keys a query sees, on average
    matmul = m.num_active_params(include_embeddings=False) + m.hidden_size * m.vocab_size
    attention = 12 * m.num_heads * m.head_size * m.num_layers * visible
    assert math.isclose(s.model_flops, (6 * matmul + attention) * T, rel_tol=1e-9)


def test_the_attention_that_runs_is_counted(monkeypatch):
    """flops.executed_attention: per token of one layer, blockwise flash attention computes the
    block pairs its schedule visits (the diagonal blocks whole), cuDNN the keys a query sees,
    XLA's dense attention every key; a backward call recomputes the forward (3.5 forward passes
    with a flash backward), cuDNN's calls merged per query tile take 8 (each call's VJP twice and
    P K once more). The step's layer FLOPs follow the execution the rule picks."""
    from megatrain_jax import attention
    from megatrain_jax.config import load_config
    from megatrain_jax.flops import attention_flops, executed_attention
    from megatrain_jax.model import Execution
    from megatrain_jax.step_time import step_shape
    T, tile, block = 131072, 8192, 512
    cfg = load_config("configs/llama3_8b.yaml", [f"data.seq_len={T}", "data.batch_size=1",
                                                  "model.num_layers=4"])
    model = cfg.model
    useful = attention_flops(model, T) / model.num_layers  # per layer, (T + 1) / 2 keys a query
    run = lambda **kw: executed_attention(model, Execution(**{"tile_size": tile, **kw}), T)
    cudnn = run(attention="cudnn", tile_attention="untiled")
    assert cudnn == (useful, 3.5 * useful)
    assert run(attention="cudnn", tile_attention="merged") == (useful, 8 * useful)
    nb = T // block  # every query block visits the key blocks up to its own, whole
    blockwise = run(attention="blockwise", attention_block=block)
    assert blockwise[0] == 4 * model.num_heads * model.head_size * nb * (nb + 1) / 2 * block**2 / T
    assert useful < blockwise[0] < 1.01 * useful and blockwise[1] == 3.5 * blockwise[0]
    assert run(attention="xla")[0] == 4 * model.num_heads * model.head_size * T  # every key
    # the pairs the blockwise kernel's own schedule visits, with a window and without
    from megatrain_jax.attention import block_schedule
    short = 16384
    for window in (0, 3000):
        windowed = dataclasses.replace(model, sliding_window=window)
        steps = block_schedule(range(short // block), block_size=block, window=window,
                               key_blocks=short // block)
        assert executed_attention(windowed, Execution(attention="blockwise", tile_size=tile),
                                  short)[0] == (4 * model.num_heads * model.head_size
                                                * len(steps) * block**2 / short)
    # the step: auto on the GPU is the fastest measured there (attention.MEASURED: cuDNN
    # untiled) and, with nothing measured, blockwise per query tile; cudnn asked for runs
    # untiled; the shape's layer FLOPs are those
    params = step_shape(cfg, offload=True).layer_bytes // 2  # bf16 weights: 2 bytes a parameter
    measured = attention.MEASURED["gpu"]
    assert min(measured, key=measured.get) == "untiled"
    for table, setting, executed in ((measured, "auto", cudnn), ({}, "auto", blockwise),
                                     ({}, "cudnn", cudnn)):
        monkeypatch.setitem(attention.MEASURED, "gpu", table)
        s = step_shape(dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, attention=setting)), offload=True)
        assert math.isclose(s.layer_fwd_flops, T * (2 * params + executed[0]), rel_tol=1e-12)
        assert math.isclose(s.layer_bwd_flops, T * (6 * params + executed[1]), rel_tol=1e-12)


def _round_trips(hlo: str) -> float:
    """Times a compiled function reads a value back to the host on XLA:GPU: each step of a loop
    (inf where XLA does not know its trip count) and each conditional, with what the calls,
    loops and branches inside them read (a conditional's costliest branch)."""
    computations, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = computations.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif current is not None and line.startswith("  "):
            current.append(line)

    def trips(name):
        total = 0
        for line in computations.get(name, []):
            if " while(" in line:
                count = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                body = re.search(r"body=%([\w.\-]+)", line).group(1)
                total += int(count.group(1)) * trips(body) if count else math.inf
            elif " conditional(" in line:
                branches = re.findall(r"(?:branch_computations=\{|true_computation=|"
                                      r"false_computation=|, )%([\w.\-]+)", line)
                total += 1 + max(trips(b) for b in branches if b in computations)
            else:
                total += sum(trips(c) for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line))
        return total

    return trips(entry)


@pytest.mark.parametrize("seq,tile", [(40, 8), (48, 8), (40, 0)])
def test_the_host_round_trips_are_the_compiled_blocks(seq, tile):
    """flops.host_round_trips, the step-time model's count, against XLA:CPU's optimized HLO of
    the block's forward and backward calls: Gemma 3's layer kind (data) picks the attention by a
    conditional, once per group of query tiles (5 tiles: two pairs and the middle one; 6: three
    pairs), per pass; no loop is left whose trip count XLA does not know."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from megatrain_jax.flops import host_round_trips
    from megatrain_jax.model import Execution, ModelConfig, make_block
    model = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=5,
                        layer_types=("sliding_attention", "full_attention"), post_norms=True,
                        norm_offset=True, activation="gelu_tanh", qk_norm=True,
                        query_pre_attn_scalar=16, rope_local_theta=100.0)
    execution = Execution(attention="blockwise", attention_block=4, tile_size=tile)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: make_block(model, 0, 0, execution)))
    x = jax.ShapeDtypeStruct((1, seq, model.hidden_size), jnp.float32)
    forward = lambda p, x: nnx.merge(graphdef, p)(x)
    backward = lambda p, x, dy: jax.vjp(forward, p, x)[1](dy)
    compiled = [_round_trips(jax.jit(f).lower(*args).compile().as_text())
                for f, args in ((forward, (params, x)), (backward, (params, x, x)))]
    assert tuple(compiled) == host_round_trips(model, execution, seq)
    assert compiled[0] > 0  # the count sees the conditionals: it can fail


def test_a_round_trip_costs_the_device_its_time():
    """Each host round trip inside a layer's call leaves the device idle round_trip_us: a
    compute-bound step grows by trips x layers x micro-batches of it."""
    s = shape(layers=3, micro_batches=2, layer_fwd_flops=1e12, layer_bwd_flops=2e12)
    fast = dataclasses.replace(UNIT, h2d_gbps=1e6, d2h_gbps=1e6, host_update_gbps=1e6,
                               round_trip_us=1e5)  # 0.1 s each
    base = simulate(s, fast).step_s
    trips = simulate(dataclasses.replace(s, layer_fwd_round_trips=3, layer_bwd_round_trips=6),
                     fast).step_s
    assert math.isclose(trips - base, 0.1 * (3 + 6) * 3 * 2, rel_tol=1e-9)
    assert simulate(s, dataclasses.replace(fast, round_trip_us=0)).step_s == base


def test_the_host_lookups_backward_comes_before_the_first_units_update():
    """The host lookup (engine/lookup.py): the first stage's backward (0.3 s) runs on the host
    thread once the rows' gradient is out, before unit 0's update (0.5 s), which the next step's
    rows wait for; then layer 0's (0.25 s), which its first fetch waits for. All three are
    exposed after the device's 12 s; the table (1 s each way here) never crosses."""
    s = shape(layers=4, layer_fwd_flops=1e12, layer_bwd_flops=2e12, first_bytes=int(1e9),
              stages_update_bytes=int(0.5e9), layer_update_bytes=int(0.25e9), rows_bytes=1000,
              host_backward_bytes=int(0.3e9))
    p = simulate(s, UNIT)
    assert (s.h2d_bytes, s.d2h_bytes) == (1000, 1000)  # the rows in, their gradient out
    assert math.isclose(p.step_s, 12 + 0.3 + 0.5 + 0.25, rel_tol=1e-6)
    assert math.isclose(p.critical_s["host update"], 0.3 + 0.5 + 0.25, rel_tol=1e-6)
    order = [o.label for o in p.ops if o.resource == "host update" and o.step == 3]
    assert order[:3] == ["first stage's backward", "update unit 0", "update unit 1"]


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_the_host_lookups_backward_touches_the_rows_per_micro_batch_not_the_table(grad_dtype):
    """The host lookup's backward (HostBackward) as scripts/bench_lookup.py measured it: the
    table's fp32 gradient zeroed (4 B a parameter), unit 0's gradient made from it (fp32: the
    accumulator itself, donated; bf16: a cast, 4 read and 2 written) and its sum of squares
    (grad read): two or three dense passes a step, whatever the micro-batches; each
    micro-batch's scatter-add is in place in the donated accumulator and
    touches its rows alone: the rows' gradient read (compute dtype), its fp32 copy written and
    read (8), the table's rows read and written (8). bench_1b (32,000 x 2,048 table), 4,096
    tokens a micro-batch, bf16 rows: 1 and 4 micro-batches (train.host_lookup=true: on the
    preset's accelerator, copies in the calls, auto keeps the device path)."""
    from megatrain_jax.config import load_config
    from megatrain_jax.step_time import step_shape
    table, rows, g = 32000 * 2048, 4096 * 2048, (4 if grad_dtype == "float32" else 2)
    for M in (1, 4):
        cfg = load_config("configs/bench_1b.yaml", [
            "data.seq_len=4096", "data.batch_size=1", f"data.micro_batches={M}",
            f"train.grad_dtype={grad_dtype}", "train.host_lookup=true"])
        s = step_shape(cfg, offload=False)
        assert s.host_lookup and s.rows_bytes == M * rows * 2
        cast = 0 if g == 4 else 4 + g
        assert s.host_backward_bytes == table * (4 + cast + g) + M * rows * (2 + 8 + 8)


def test_every_local_device_predicts_as_the_engine_runs():
    """distributed.local_devices 0 (every accelerator): on a machine with several the run is data
    parallel and the first stage on the device (lookup.serves), as `plan --step-time --devices`
    predicts it; on one device, or a preset's unknown count (1 assumed, said in a note), the
    host lookup where the rule takes it (bench_1b, 4,096 tokens, eager copies: by bytes) and
    the device path with copies in the calls (the default on the preset's accelerator, by the
    host backward's time on the step's end), said in the plan with the reason."""
    from megatrain_jax.config import load_config
    from megatrain_jax.step_time import step_shape
    overrides = ["data.seq_len=4096", "data.batch_size=1", "offload.copies=eager"]
    cfg = load_config("configs/bench_1b.yaml", overrides)
    assert cfg.distributed.local_devices == 0
    assert [step_shape(cfg, offload=False, devices=n).host_lookup for n in (0, 1, 4)] == [
        True, True, False]
    in_calls = load_config("configs/bench_1b.yaml", overrides[:2])
    assert [step_shape(in_calls, offload=False, devices=n).host_lookup for n in (0, 1, 4)] == [
        False, False, False]
    on_host = "the first stage on the host (the host lookup"
    assumed = "gives no device count: planned for 1 a process"
    # (a batch of 1 does not split over 4 devices: refused, as train refuses it)
    for batch, devices, lookup in (([], [], True),
                                   (["data.batch_size=4"], ["--devices", "4"], False)):
        proc = plan_cli("--config", "configs/bench_1b.yaml", *overrides, *batch, "--step-time",
                        *devices)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (on_host in proc.stdout) == lookup and (assumed in proc.stdout) == lookup
    proc = plan_cli("--config", "configs/bench_1b.yaml", *overrides[:2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the first stage runs on the device (copies in the calls: " in proc.stdout


@pytest.mark.parametrize("tied,setting", [(True, "auto"), (False, "auto"), (False, "false")])
def test_a_configs_shape_moves_the_bytes_the_engine_counts(tied, setting):
    """step_shape's bytes each way per step equal the engine's own counters after a real step
    (bf16 bus copies and gradients; with tied embeddings the two stage parts share a leaf;
    untied, train.host_lookup=auto takes the host lookup here with eager copies, in the engine and
    in step_shape: the rows, 2 x 16 tokens, cross instead of the 257-row table; false keeps the
    table)."""
    import numpy as np
    from megatrain_jax.config import load_config
    from megatrain_jax.step_time import step_shape
    from megatrain_jax.engine import update
    from megatrain_jax.recipes import build_engine
    cfg = load_config("configs/tiny.yaml", [
        "model.num_layers=2", "data.seq_len=16", "data.batch_size=1", "data.micro_batches=2",
        "train.compute_dtype=bfloat16", "train.grad_dtype=bfloat16",
        f"model.tie_embeddings={str(tied).lower()}", f"train.host_lookup={setting}",
        "offload.copies=eager"])  # as the engine on one CPU device takes them
    engine = build_engine(cfg)
    tokens = np.ones((2, 1, 16), np.int32)
    engine.train_step(tokens, tokens)
    engine.wait()
    s = step_shape(cfg, offload=False)
    assert engine.host_lookup == s.host_lookup == (not tied and setting == "auto")
    assert (engine.counters.bytes_h2d, engine.counters.bytes_d2h) == (s.h2d_bytes, s.d2h_bytes)
    # the h100 preset (an accelerator) with the direct host update (engine/direct.py): gradients
    # read and bus copies written where they are, no hop between the clients
    assert s.hop_bytes == 0
    # the jit path's host thread hops: a layer's gradient in and its bus copy out; none for unit 0
    # with the lookup (made and kept on the host)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(update, "why_not_direct", lambda optimizer, disk_tier: "the jit path (test)")
        s = step_shape(cfg, offload=False)
    assert s.layer_hop_bytes == s.layer_grad_bytes + s.layer_bytes > 0
    assert s.first_hop_bytes == (0 if s.host_lookup else 2 * s.first_bytes)  # bf16 both ways
    engine.close()


def test_a_copy_hides_only_its_measured_overlap():
    """Fetches beside layers' compute that lasts longer than they do: the device loses the part
    of each copy the overlap does not hide (at most the copy's time); the eager form never reads
    the jit form's overlap."""
    s = shape(layer_fwd_flops=1e12, layer_bytes=int(0.5e9))
    step = lambda form, overlap: simulate(dataclasses.replace(s, copies=form), dataclasses.replace(
        UNIT, **{f"h2d_overlap_{form}": overlap})).step_s
    for form in ("eager", "jit"):
        hidden, half, none = step(form, 1.0), step(form, 0.5), step(form, 0.0)
        fetches = 2 * s.layers * s.layer_bytes / 1e9  # seconds of every layer's fetch
        assert hidden < half < none <= hidden + fetches
    # (the jit form's eager copies, the first layer's of each pass, take the eager overlap)
    assert simulate(s, dataclasses.replace(UNIT, h2d_overlap_jit=0.0)).step_s == step("eager",
                                                                                       1.0)


def test_the_jit_forms_copies_start_with_the_call_that_makes_them():
    """copies=jit: layer i + 1's fetch starts with layer i's first forward call (and backward
    call, for layer i - 1), and layer i's gradient goes out starting with layer i - 1's first
    backward call (layer 0's with the embedding backward's)."""
    L = 4
    s = shape(layers=L, micro_batches=2, layer_fwd_flops=1e12, layer_bwd_flops=2e12,
              layer_bytes=int(0.1e9), layer_grad_bytes=int(0.2e9), copies="jit")
    ops = [o for o in simulate(s, UNIT).ops if o.step == 3]
    on = lambda resources: [o for o in ops if o.resource in resources]
    first = lambda label: next(o for o in on(("device", "d2h")) if o.label == label)
    starts = lambda label: [o.start for o in on(("h2d",)) if o.label == label]
    assert starts(f"fetch unit {1 + L - 1}")[0] == first(f"forward {L - 2}").start
    for i in range(1, L - 1):
        assert starts(f"fetch unit {1 + i}") == [first(f"forward {i - 1}").start,
                                                 first(f"backward {i + 1}").start]
        assert first(f"gradient {i}").start == first(f"backward {i - 1}").start
    assert first("gradient 0").start == first("embed backward").start
    eager = [o for o in simulate(dataclasses.replace(s, copies="eager"), UNIT).ops if o.step == 3]
    last = next(o for o in eager if o.label == "backward 0" and o.resource == "device")
    assert [o.start >= last.end for o in eager if o.label == "gradient 0" and
            o.resource == "d2h"] == [True]  # (the eager form: after the layer's compute)


ORDERS = {  # (offload.copies, train.prefetch, activations offloaded, train.host_lookup)
    "eager": ("eager", 1, False, False), "jit": ("jit", 1, False, False),
    "eager, prefetch 0": ("eager", 0, False, False),
    "eager, offloaded, prefetch 2, host lookup": ("eager", 2, True, True),
    "jit, offloaded, prefetch 2": ("jit", 2, True, False),
    "jit, host lookup": ("jit", 1, False, True)}


@pytest.mark.parametrize("copies,prefetch,offload,lookup", ORDERS.values(), ids=ORDERS)
def test_the_models_order_is_the_engines(copies, prefetch, offload, lookup):
    """The events the model's operations stand for (Prediction.events) are the engine's own
    on_event trace of a real step of the same config, in order: on the dispatching thread each
    copy (eager or in a call), each layer's dispatch and each retire's wait; on the host thread
    each unit's update. The passes run through one interpreter of the schedule in both
    (schedule.walk); the rest of the step is written twice (engine/step.py, step_time._step),
    so a change to either alone fails here. CPU device 1 stands for the accelerator."""
    import jax
    import numpy as np
    from megatrain_jax.config import load_config
    from megatrain_jax.recipes import build_engine
    from megatrain_jax.step_time import step_shape
    cfg = load_config("configs/tiny.yaml", [
        "model.num_layers=3", "model.hidden_size=32", "model.intermediate_size=64",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=8", "data.batch_size=1",
        "data.micro_batches=2", f"train.prefetch={prefetch}", f"offload.copies={copies}",
        f"train.host_lookup={str(lookup).lower()}", "model.tie_embeddings=false"])
    cpu = jax.devices("cpu")
    engine = build_engine(cfg, compute_device=cpu[1], host_device=cpu[0],
                          offload_activations=offload)
    tokens = np.ones((2, 1, 8), np.int32)
    engine.train_step(tokens, tokens)
    engine.wait()
    trace = []
    engine.on_event = lambda kind, what, layer: trace.append((kind, what, layer))
    engine.train_step(tokens, tokens)
    engine.wait()
    engine.close()
    s = step_shape(cfg, offload=offload)
    assert (s.copies, s.prefetch, s.host_lookup) == (engine.copies, prefetch, engine.host_lookup)
    model = [e[1:] for e in simulate(s, Rates(), steps=2).events if e[0] == 1]
    threads = lambda events: ([e for e in events if e[0] != "update"],
                              [e for e in events if e[0] == "update"])
    assert threads(model) == threads(trace)
    assert ("dispatch", "backward", 0) in trace and len(threads(trace)[1]) == 5


def test_overlaps_come_from_the_gpus_measurements():
    """The H200 host's host-path check (its eager rows and `injit`), and bench_transfer.py's
    overlap rows (the H100 host: eager only)."""
    h200, sources, _ = measured_rates(os.path.join(ROOT, "docs/results/2026-11-27-h200"))
    assert (h200.h2d_overlap_eager, h200.d2h_overlap_eager, h200.d2h_overlap_jit) == (
        0.36, 0.21, 1.0)
    assert math.isclose(h200.h2d_overlap_jit, 0.916, abs_tol=1e-3)
    assert "injit" in sources["h2d_overlap_jit"] and "write" in sources["h2d_overlap_eager"]
    h100, sources, _ = measured_rates(os.path.join(ROOT, "docs/results/2026-11-26-h100"))
    assert math.isclose(h100.h2d_overlap_eager, 0.14, abs_tol=0.005)
    assert math.isclose(h100.d2h_overlap_eager, 0.073, abs_tol=0.005)
    assert sources["h2d_overlap_jit"] == "default"
    with pytest.raises(ValueError, match="^rate h2d_overlap_jit must be a finite number in"):
        Rates(h2d_overlap_jit=1.5)


def test_rates_bad_value():
    with pytest.raises(ValueError, match="h2d_gbps"):
        Rates(h2d_gbps=0)


def results(tmp_path, s: StepShape):
    """A results folder as a checklist part leaves it: transfer, bench (this step and another
    one) and two optimizer runs."""
    files = {
        "transfer.json": {"kind": "transfer", "paths": [
            {"path": "pinned_host -> device", "gb_per_s": 40.0},
            {"path": "device -> pinned_host", "gb_per_s": 3.0},
            {"path": "device -> cpu backend", "gb_per_s": 2.0},
            {"path": "numpy -> device", "gb_per_s": 9.0},
            {"path": "pinned_host -> cpu backend, numpy view", "gb_per_s": 8.0},
            {"path": "cpu backend -> pinned_host, numpy view", "gb_per_s": 11.0}],
            "small_d2h": {"tiny_op_ms": 0.05}},
        "bench_1b.json": {"kind": "train", "tokens_per_step": s.tokens_per_step,
                          "flops": {"per_step": s.model_flops}, "matmul_peak": {"tflops": 700.0},
                          "streamed": {"step_s": 2.0, "resident_compute_s_per_step": 0.5,
                                       "host_update_s_per_step": 1.5}},
        "bench_other.json": {"kind": "train", "tokens_per_step": 7, "flops": {"per_step": 1},
                             "matmul_peak": {"tflops": 1.0}, "streamed": {"step_s": 1.0}},
        "optimizer.json": {"update_gb_s": 60.0, "threads": 16},
        "optimizer_1_core.json": {"update_gb_s": 9.0, "threads": 1},
    }
    for name, obj in files.items():
        (tmp_path / name).write_text(json.dumps(obj))
    return tmp_path


def test_measured_rates_come_from_the_engines_own_paths(tmp_path):
    s = shape(layer_fwd_flops=1e12, layer_bwd_flops=2e12, model_flops=5e12, tokens_per_step=64)
    rates, sources, bench = measured_rates(str(results(tmp_path, s)), s)
    assert (rates.h2d_gbps, rates.d2h_gbps, rates.host_update_gbps) == (40.0, 3.0, 60.0)
    assert math.isclose(rates.dispatch_us, 50.0)
    # the device rate: what the step executes over the engine's resident compute time
    assert math.isclose(rates.device_tflops, executed_flops(s) / 0.5 / 1e12)
    assert "resident compute" in sources["device_tflops"] and "16 threads" in sources["host_update_gbps"]
    assert bench["streamed"]["step_s"] == 2.0
    # the hop between the clients: the slower of the engine's two numpy-view ways
    assert rates.hop_gbps == 8.0 and "pinned_host -> cpu backend" in sources["hop_gbps"]
    # without an optimizer run, bench.py's host-update seconds less the hop's time
    for name in ("optimizer.json", "optimizer_1_core.json"):
        os.rename(tmp_path / name, tmp_path / f"{name}.off")
    hops = dataclasses.replace(s, stages_update_bytes=int(2e9), layer_update_bytes=int(1e9),
                               layer_hop_bytes=int(0.5e9), first_hop_bytes=int(0.4e9))
    rates, sources, _ = measured_rates(str(tmp_path), hops)
    own = 1.5 - (4 * 0.5 + 0.4) / 8.0  # seconds: the bench's, less 2.4 GB at 8 GB/s
    assert math.isclose(rates.host_update_gbps, (2 + 4 * 1) / own)
    assert "less the hop's" in sources["host_update_gbps"]
    # a bench that counted the update's own work apart from its waits: that, not the thread's time
    bench_1b = json.loads((tmp_path / "bench_1b.json").read_text())
    bench_1b["streamed"]["host_compute_s_per_step"] = 0.3
    (tmp_path / "bench_1b.json").write_text(json.dumps(bench_1b))
    rates, sources, _ = measured_rates(str(tmp_path), hops)
    assert math.isclose(rates.host_update_gbps, (2 + 4 * 1) / 0.3)
    assert "own work" in sources["host_update_gbps"]
    for name in ("optimizer.json", "optimizer_1_core.json"):
        os.rename(tmp_path / f"{name}.off", tmp_path / name)
    # another step's bench gives only its measured matmul, and no comparison
    other = dataclasses.replace(s, tokens_per_step=65)
    rates, sources, bench = measured_rates(str(tmp_path), other)
    assert bench is None and "matmul" in sources["device_tflops"]
    # a folder with no rate in it is refused: a prediction "from measured rates" of the defaults
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"^no rate in it \(0 JSON files, none a result of "):
        measured_rates(str(empty), s)


def plan_cli(*args):
    """scripts/plan.py ARGS in-process (its main is commands.plan: tests/test_commands.py):
    returncode, stdout and stderr as a subprocess's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = commands.plan(list(args))
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_resolved_rates_take_each_source_over_the_one_before(tmp_path):
    """step_time.resolve_rates (what `plan --step-time` and the plan's advice predict at): the
    defaults, then the machine's bus and bf16 peak, then the measured results, then the
    overrides; a machine with no known peak (a CPU) gives none."""
    from megatrain_jax.machines import MACHINES, Machine
    from megatrain_jax.step_time import resolve_rates
    gh200 = MACHINES["gh200"]
    rates, sources, bench = resolve_rates(gh200, {})
    assert (rates.h2d_gbps, rates.d2h_gbps, rates.device_tflops) == (375, 375, 989)
    assert rates.host_update_gbps == DEFAULTS["host_update_gbps"] and bench is None
    assert sources["h2d_gbps"] == f"machine {gh200.name}" and sources["dispatch_us"] == "default"
    s = shape(layer_fwd_flops=1e12, layer_bwd_flops=2e12, tokens_per_step=64)
    folder = results(tmp_path, s)
    rates, sources, bench = resolve_rates(gh200, {"d2h_gbps": (7.0, "--d2h-gbps")}, str(folder), s)
    assert (rates.h2d_gbps, rates.d2h_gbps, rates.host_update_gbps) == (40.0, 7.0, 60.0)
    assert math.isclose(rates.device_tflops, executed_flops(s) / 0.5 / 1e12)
    assert sources["d2h_gbps"] == "--d2h-gbps" and bench["tokens_per_step"] == s.tokens_per_step
    cpu = Machine("local CPU", 8.0, 8.0, 0.0, 0.0, platform="cpu", compute_on_host=True)
    rates, sources, _ = resolve_rates(cpu, {})
    assert dataclasses.asdict(rates) == DEFAULTS and set(sources.values()) == {"default"}


def test_plan_step_time_end_to_end(tmp_path):
    """The tiny config, rates from a results folder (its bench is of another step: no
    comparison), the bus overridden by a flag; then that JSON read back as --rates."""
    folder = results(tmp_path, shape())
    out = tmp_path / "prediction.json"
    proc = plan_cli("--config", "configs/tiny.yaml", "--step-time", "--rates", str(folder),
                    "--h2d-gbps", "20", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted step:" in proc.stdout and "bound by" in proc.stdout
    r = json.loads(out.read_text())
    assert r["kind"] == "step_time" and r["bound"] in RESOURCES and r["step_s"] > 0
    assert r["rates"]["h2d_gbps"] == 20 and r["rate_sources"]["h2d_gbps"] == "--h2d-gbps"
    assert r["rates"]["d2h_gbps"] == 3.0 and "compare" not in r
    assert math.isclose(sum(r["critical_path_s"].values()), r["step_s"], rel_tol=1e-9)
    # a prediction's JSON gives its rates back, e.g. to predict another config at the same rates
    rates, sources, _ = measured_rates(str(out))
    assert rates == Rates(**r["rates"]) and sources["h2d_gbps"] == f"{out} (--h2d-gbps)"


def test_plan_step_time_bad_inputs(tmp_path):
    proc = plan_cli("--config", "configs/tiny.yaml", "--step-time", "--d2h-gbps", "-1")
    assert proc.returncode == 2 and "--d2h-gbps must be a finite number > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = plan_cli("--config", "configs/tiny.yaml", "--step-time", "--rates", str(tmp_path / "x"))
    assert proc.returncode == 2 and "--rates" in proc.stderr and "no such file" in proc.stderr
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not JSON"):  # the CLI's exit 2, as above
        measured_rates(str(tmp_path / "bad.json"))
