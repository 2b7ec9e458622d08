"""CPU smoke tests of scripts/bench.py, bench_layer_calls.py, bench_transfer.py, bench_optimizer.py,
bench_lookup.py and bench_long_context.py: each runs end to end and prints its table; bench.py,
bench_transfer.py and bench_long_context.py write well-formed JSON whose figures are consistent.
(The figures themselves are GPU work: docs/benchmarks.md.)"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from megatrain_jax import hostmem, step_time
from megatrain_jax.engine import fused_adamw
from megatrain_jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = load_script("results_tables")  # each JSON also renders as its docs table


def run(script, *args, xla_flags=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_one_step_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    # warmup_steps=0: the learning rate is non-zero from step 1, so the baselines' losses can only
    # match the engine's if they really apply the same updates.
    overrides = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2",
                 "data.micro_batches=2", "optimizer.warmup_steps=0"]
    proc = run("bench.py", "--config", "configs/tiny.yaml", "--steps", "1", "--warmup", "1",
               "--json", str(out), "--profile-main", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in ("tokens/s", "model TFLOP/s", "MFU vs measured matmul", "H2D GB/s", "D2H GB/s",
                  "device busy", "host update", "exposed", "device peak GB", "host RSS GB",
                  "vs resident", "vs offload"):
        assert label in proc.stdout, label
    r = json.loads(out.read_text())
    s = r["streamed"]
    assert r["tokens_per_step"] == 2 * 2 * 32 and r["platform"] == "cpu" and r["jax"]
    assert r["config"]["model"]["num_layers"] == 2 and "--steps" in r["command"]
    for key in ("tokens_per_s", "model_tflops", "mfu_vs_measured", "h2d_gb_per_s", "d2h_gb_per_s",
                "host_update_s_per_step", "rss_gb", "resident_compute_s_per_step"):
        assert positive(s[key]), key
    assert s["device_busy"] is None and "CPU" in s["device_busy_method"]
    assert s["copies"] == "eager" and s["host_update"] == "direct"  # what auto picks on a CPU
    assert 0 < s["host_compute_s_per_step"] <= s["host_update_s_per_step"]
    # --profile-main: the dispatching thread's costliest functions, the step's own among them
    profile = s["main_thread_profile"]
    assert len(profile) == 25 and "the dispatching thread" in proc.stdout
    assert all(a["own_s_per_step"] >= b["own_s_per_step"] for a, b in zip(profile, profile[1:]))
    assert any("step.py" in row["function"] for row in profile)
    # the main thread's step: waits at retires, for updates, for the first stage, and the rest
    assert 0 < s["device_wait_s_per_step"] and 0 <= s["main_thread_other_s_per_step"]
    main = s["dispatch"]["main_thread_s"]
    assert main == {"device_wait": s["device_wait_s_per_step"],
                    "update_wait": s["host_exposed_s_per_step"],
                    "first_stage_wait": main["first_stage_wait"],
                    "other": s["main_thread_other_s_per_step"]}
    assert math.isclose(sum(main.values()), s["step_s"])
    # The exposed wait is step time (the main thread's): it may exceed the update's own time by
    # the host thread's hand-offs (stream.Counters), never the step's.
    assert 0 <= s["host_exposed_s_per_step"] <= s["step_s"]
    assert math.isclose(s["tokens_per_s"], r["tokens_per_step"] / s["step_s"])
    # Every block weight crosses the bus twice per step (forward, backward), fp32 in tiny.yaml.
    model = r["config"]["model"]
    embed_and_head = 2 * model["vocab_size"] * model["hidden_size"]  # untied in tiny.yaml
    assert not model["tie_embeddings"]
    assert s["h2d_gb_per_step"] * 1e9 >= 2 * 4 * (r["params"] - embed_and_head)
    assert len(s["losses"]) == 2
    for name in ("resident", "offload"):
        b = r["baselines"][name]
        assert positive(b["tokens_per_s"]), name
        assert math.isclose(s[f"throughput_vs_{name}"], s["tokens_per_s"] / b["tokens_per_s"])
        assert b["loss_max_rel_diff_vs_streamed"] < 1e-4, name  # same model, same updates (fp32)
    # the step-time model reads the device rate from it: executed FLOPs / resident compute time
    shape = step_time.step_shape(load_config("configs/tiny.yaml", overrides), offload=False)
    rates, sources, bench = step_time.measured_rates(str(out), shape)
    assert bench == r and "resident compute" in sources["device_tflops"]
    assert math.isclose(rates.device_tflops, step_time.executed_flops(shape)
                        / s["resident_compute_s_per_step"] / 1e12)
    row = tables.train_rows([("bench.json", r)])[2]
    assert row.startswith("| bench.json | configs/tiny.yaml | model.num_layers=2 data.seq_len=32 "
                          "data.batch_size=2 data.micro_batches=2 optimizer.warmup_steps=0 | "
                          "eager | 128 | ")
    assert f"| {s['throughput_vs_resident']:.2f}x |" in row


def test_bench_rejects_bad_arguments(tmp_path, capsys):
    """scripts/bench.py's main, in-process (the exit code `python scripts/bench.py` exits with):
    each refusal is one line, before anything runs."""
    main = load_script("bench").main
    tiny = ["--config", os.path.join(ROOT, "configs", "tiny.yaml")]
    for args, culprit in [(["--baselines", "fsdp", "--json", str(tmp_path / "x.json")], "fsdp"),
                          (["model.hidden_sise=3"], "model.hidden_sise"),
                          # compile time would be timed
                          (["--warmup", "0", "--json", str(tmp_path / "x.json")], "--warmup")]:
        assert main([*tiny, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].startswith("error: ") and culprit in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_bench_transfer_tiny_buffer(tmp_path):
    out = tmp_path / "transfer.json"
    proc = run("bench_transfer.py", "--mb", "4", "--repeats", "2", "--pinned-probe-gb", "0.01",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pinned_host -> device" in proc.stdout and "overlap" in proc.stdout
    r = json.loads(out.read_text())
    assert r["buffer_bytes"] == 4_000_000 and r["platform"] == "cpu"
    paths = {p["path"]: p for p in r["paths"]}
    for name in ("numpy -> device", "pinned_host -> device", "device -> pinned_host",
                 "device -> cpu backend", "cpu backend -> pinned_host"):
        assert positive(paths[name]["gb_per_s"]), name
        assert math.isclose(paths[name]["gb_per_s"], 4e6 / paths[name]["seconds"] / 1e9)
    # the engine's hops between the clients, and whether each is a copy: on two CPU devices the
    # numpy view of a pinned_host array is put on the CPU backend without one
    hop = paths["pinned_host -> cpu backend, numpy view"]
    assert positive(hop["gb_per_s"]) and hop["zero_copy"] is True
    assert hop["source_aligned_64"] is True
    # a candidate for that hop: the view copied by every core into a reused aligned buffer, which
    # the CPU backend then takes as it is
    threaded = {name.rsplit(", ", 1)[1]: p for name, p in paths.items() if "thread copy" in name}
    assert sorted(threaded) == ["fresh buffer", "reused buffer"]
    for p in threaded.values():
        assert positive(p["gb_per_s"]) and p["threads"] >= 1 and p["exact"] is True
    assert threaded["reused buffer"]["put_aliases"] is True
    assert paths["cpu backend -> pinned_host, numpy view"]["zero_copy"] in (True, False, None)
    # each copy beside a matmul in every form the engine could issue it (a jit cannot copy
    # between two clients)
    forms = ("", " (copy first)", " (second thread)", " (in jit)")
    assert set(r["overlap"]["paths"]) == {f"{p}{form}" for p in (
        "pinned_host -> device", "device -> pinned_host", "device -> cpu backend")
        for form in forms} - {"device -> cpu backend (in jit)"}
    for o in r["overlap"]["paths"].values():
        assert 0 <= o["overlap"] <= 1 and positive(o["gb_per_s_during_matmul"])
    assert r["small_d2h"]["small_d2h_ms"] > 0
    probe = r["pinned_pool_probe"]
    assert probe["default"]["allocated_gb"] >= 0.01 and probe["default"]["error"] is None
    assert probe["raised"]["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == 16
    rates, sources, _ = step_time.measured_rates(str(out))  # the engine's own paths
    assert (rates.h2d_gbps, rates.d2h_gbps) == (paths["pinned_host -> device"]["gb_per_s"],
                                                paths["device -> pinned_host"]["gb_per_s"])
    assert math.isclose(rates.dispatch_us, r["small_d2h"]["tiny_op_ms"] * 1e3)
    rendered = "\n".join(tables.transfer_rows([("transfer.json", r)]))
    assert "| pinned_host -> device | " in rendered and "0.004 GB buffer" in rendered


def check_optimizer_rows(r, threads):
    """bench_optimizer.py's JSON: a row for each measurement at each thread count, each with
    its time, GB/s, page faults and CPU time; the engine's update (its gradients freed by the
    host thread, and kept) and, where the kernel is called directly, the kernel in a jitted
    update beside it; torch fused (alone and followed by its bf16 copy), foreach and a copy."""
    rows = {(row["measurement"], row["threads"]): row for row in r["table"]}
    engine_rows = ("update", "update_kept") + (("update_jit",) if r["direct"] else ())
    assert r["direct"] is (fused_adamw.kernel() is not None)
    assert set(rows) == {(m, t) for m in (*engine_rows, "torch_fused", "torch_fused_bus",
                                          "torch_foreach", "copy")
                         for t in threads}
    assert not r["direct"] or positive(r["update_jit_vs_torch_fused"])
    assert all(positive(row["ms"]) and positive(row["gb_s"]) and row["page_faults"] >= 0
               and positive(row["cpu_ms"]) for row in rows.values())
    assert positive(r["update_gb_s"]) and positive(r["update_vs_torch_fused_bus"])
    assert positive(r["update_kept_vs_torch_fused"])
    # --mmap-threshold 1 and --huge-pages: the command ran itself again with the tunable, and so
    # did every child it started
    on = (hostmem.TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
          or hostmem.huge_pages_env(os.environ, r["thp_mode"]) is not None)
    for res in [r, *(r["results"][str(t)] for t in threads)]:
        assert res["mmap_threshold_mib"] == 1 and res["huge_pages"] is on
    return rows


def test_bench_optimizer_tiny(tmp_path):
    """The engine's update against torch's, at all cores, with --processes 2: each in two fresh
    processes, each run's samples pooled, the ratios the processes' median (the one-core child:
    the next test's)."""
    out = tmp_path / "opt.json"
    proc = run("bench_optimizer.py", "--params", "1", "--hidden", "256", "--reps", "1",
               "--mmap-threshold", "1", "--huge-pages", "--processes", "2", "--no-one-core",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    key, value = proc.stdout.strip().splitlines()[-1].split(": ")
    assert key == "update_vs_torch_fused" and positive(float(value))
    r = json.loads(out.read_text())
    rows = check_optimizer_rows(r, {r["threads"]})
    assert r["bytes_per_param_touched"] == 30 and rows[("update", r["threads"])][
        "bytes_per_param"] == 30
    t = str(r["threads"])
    assert r["processes"] == 2 and all(len(run["seconds"]) == 2
                                       for run in r["results"][t]["runs"].values())
    per = r["per_process"][t]
    assert len(per) == 2 and r["update_vs_torch_fused"] == pytest.approx(
        np.median([x["update_vs_torch_fused"] for x in per]))


def test_bench_optimizer_with_bf16_moments_at_all_cores_and_one(tmp_path):
    """--state-dtype bfloat16: the engine's update counts 22 B/param (param 4 + moments 2 + 2,
    read and written, the fp32 gradient, the bus copy), torch fused its 28 (34 with its bf16
    copy), the JSON says which. At all cores in this process, then in a child under taskset at
    one, with the ratios at one thread (wall and CPU time)."""
    out = tmp_path / "opt.json"
    proc = run("bench_optimizer.py", "--params", "1", "--hidden", "256", "--reps", "1",
               "--mmap-threshold", "1", "--huge-pages", "--state-dtype", "bfloat16",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bfloat16 moments" in proc.stdout
    r = json.loads(out.read_text())
    rows = check_optimizer_rows(r, {r["threads"], 1})
    assert r["state_dtype"] == "bfloat16" and r["bytes_per_param_touched"] == 22
    for t in {r["threads"], 1}:
        assert rows[("update", t)]["bytes_per_param"] == 22
        assert rows[("torch_fused", t)]["bytes_per_param"] == 28
        assert rows[("torch_fused_bus", t)]["bytes_per_param"] == 34
    assert r["processes"] == 1 and len(r["per_process"]["1"]) == 1
    assert positive(r["update_vs_torch_fused_1"]) and positive(r["update_vs_torch_fused_1_cpu"])


def test_bench_cpu_devices_takes_the_accelerators_path_and_counts_the_dispatch(tmp_path):
    """--cpu-devices 2: device 1 computes, device 0 holds the state, so the engine makes its
    copies inside the calls; the dispatching thread's work a step is counted: one call per layer
    and pass and the stages' few, their argument leaves, the eager copies, the deletes and the
    syncs by kind (a retire per layer and pass but each pass's last)."""
    out = tmp_path / "bench.json"
    L = 3
    proc = run("bench.py", "--config", "configs/tiny.yaml", "--steps", "2", "--baselines", "none",
               "--cpu-devices", "2", "--json", str(out), f"model.num_layers={L}",
               "data.seq_len=32", "data.batch_size=2", "data.micro_batches=4",
               "train.host_lookup=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s, d = r["streamed"], r["streamed"]["dispatch"]
    assert r["cpu_devices"] == 2 and s["copies"] == "jit"
    # embed, L forward, head, L backward, embed backward, the stages' gradient and norm
    assert d["calls_per_step"] == 2 * L + 4
    assert 0 < d["arg_leaves_per_step"] and 0 < d["deleted_per_step"]
    # the stages' fetches (first, last, first), each pass's first layer (prefetch 1), the batch
    # (inputs and targets, one copy)
    assert d["device_puts_per_step"] == 3 + 2 + 1
    assert d["syncs_by_kind_per_step"]["block_until_ready"] == 2 * (L - 1)
    assert d["syncs_per_step"] == sum(d["syncs_by_kind_per_step"].values())
    assert set(d["main_thread_s"]) == {"device_wait", "update_wait", "first_stage_wait", "other"}
    for label in ("main thread: jitted calls", "main thread: syncs", "block_until_ready"):
        assert label in proc.stdout, label


def test_bench_layer_calls_tiny(tmp_path):
    """Both forms of a layer's call compile and run: compile time, dispatch and call time each;
    and a bare jit of the same arguments beside them."""
    out = tmp_path / "calls.json"
    proc = run("bench_layer_calls.py", "--config", "configs/tiny.yaml", "--reps", "1",
               "--json", str(out), "data.seq_len=16", "data.batch_size=2", "data.micro_batches=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = json.loads(out.read_text())["calls"]
    assert set(calls) == {f"{fn} {form}" for fn in ("layer_fwd", "layer_bwd")
                          for form in ("scan", "unrolled", "bare")}
    for row in calls.values():
        assert all(positive(v) for v in row.values()), row
    assert "layer_bwd unrolled" in proc.stdout


def test_bench_cpu_devices_other_than_two_is_one_line_exit_2():
    proc = run("bench.py", "--config", "configs/tiny.yaml", "--cpu-devices", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --cpu-devices must be 2 (device 1 computes, device 0 "
                                   "holds the state), got 3")


def test_bench_lookup_tiny(tmp_path):
    """The host lookup's backward piece by piece: the compiled scatter-add is in place (its output
    aliases the donated accumulator) and never reads the table; each piece timed; a tied
    embedding is one line, exit 2."""
    out = tmp_path / "lookup.json"
    tiny = ("--config", "configs/tiny.yaml", "data.seq_len=16", "data.batch_size=2")
    # compiled as XLA compiles it outside the tests (conftest's faster emitters expand the
    # scatter into a loop of row updates)
    proc = run("bench_lookup.py", *tiny, "--micro-batches", "1", "2", "--reps", "1",
               "--json", str(out), xla_flags="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["hlo"] == {"scatter": True, "output_aliases_input": True,
                        "table_is_an_input": False}
    assert r["table"] == [257, 128] and [x["micro_batches"] for x in r["runs"]] == [1, 2]
    for x in r["runs"]:
        assert set(x["pieces"]) == {"zero", "scatter", "gradient", "squares", "zero, fresh",
                                    "gradient, a copy"}
        assert all(positive(p["s"]) for p in x["pieces"].values())
    proc = run("bench_lookup.py", *tiny, "model.tie_embeddings=true")
    assert proc.returncode == 2 and "tied embeddings" in proc.stderr.strip().splitlines()[-1]


def test_bench_long_context_tiny(tmp_path):
    """The long-context bench at a tiny size, every chunked path on (several attention blocks, MLP
    tiles, token and vocabulary chunks of the loss, offloaded activations), with the dense path's
    compiled estimate."""
    out = tmp_path / "long.json"
    proc = run("bench_long_context.py", "--seq-len", "256", "--vocab", "512", "--hidden", "32",
               "--layers", "1", "--heads", "2", "--kv-heads", "1", "--attention-block", "64",
               "--tile-size", "64", "--loss-chunk", "64", "--loss-vocab-chunk", "128",
               "--dense-estimate", "--profile-main", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in ("peak RSS before engine", "peak RSS after steps", "step time", "tokens/s",
                  "losses", "plan: host GB", "plan: device peak GB", "block backward, dense",
                  "loss head, long-context"):
        assert label in proc.stdout, label
    r = json.loads(out.read_text())
    run_, rss, plan = r["run"], r["peak_rss_bytes"], r["plan"]
    assert r["tokens_per_step"] == 256 and r["config"]["train"]["offload_activations"] is True
    assert len(run_["losses"]) == 2 and all(abs(x - math.log(512)) < 0.5 for x in run_["losses"])
    assert positive(run_["tokens_per_s"]) and len(run_["step_times_s"]) == 2
    # the first step compiles, the second runs what it compiled
    assert run_["compiles"][0]["count"] > 0 and run_["compiles"][1]["count"] == 0
    # --profile-main: the second step's dispatching thread, the engine's step among its functions
    profile = run_["main_thread_profile"]
    assert len(profile) == 25 and any("step.py" in row["function"] for row in profile)
    assert "the dispatching thread" in proc.stdout
    assert positive(run_["model_tflops"]) and "model TFLOP/s" in proc.stdout
    assert run_["device_peak_bytes"] is None  # no memory_stats on the CPU
    assert 0 < rss["start"] <= rss["before_engine"] <= rss["after_engine"] <= rss["after_steps"]
    assert positive(plan["host_total"]) and positive(plan["device_peak"]) and plan["fits"]
    est = r["dense_estimate"]
    for fn in ("block_bwd", "head"):  # the dense path needs more: T x T scores, T x V logits
        assert 0 < est["long_context"][fn]["temp_bytes"] < est["dense"][fn]["temp_bytes"], fn
    row = tables.long_context_rows([("long.json", r)])[2]
    assert row.startswith("| long.json | 256 | blockwise | ")
    # what attends, not only the setting; the step-time model's step beside the measured one
    runs = "blockwise flash attention (blocks of 64) per query tile of 64, the block in tiles of 64"
    assert r["attention"] == plan["attention_runs"] == runs and runs in proc.stdout
    assert positive(r["step_time"]["step_s"]) and r["step_time"]["layer_round_trips"] == [0, 0]

