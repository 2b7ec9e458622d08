"""scripts/gpu_checklist.py: each part fits its 10 minutes (timeouts within the budget, few result
files, every script and config it names exists), and --smoke runs its steps end to end on the CPU.

The smoke test runs a representative subset of part 1 (the machine, transfer and step-time steps; see
test_smoke_subset_of_part_1) through the same code path as the whole list: the full smoke of all
three parts (`python scripts/gpu_checklist.py 1 2 3 --smoke`) takes minutes on the CPU, over this
suite's budget. The benchmarks it leaves out run at the same tiny sizes in
tests/test_bench.py."""

import importlib.util
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_checklist.py")



def load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checklist, tables = load_script("gpu_checklist"), load_script("results_tables")


def run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # --out, not a caller's $OUT
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_each_part_fits_ten_minutes():
    assert checklist.PART_BUDGET_S <= 570  # a part is at most 10 minutes
    for part, steps in checklist.STEPS.items():
        assert sum(s.timeout_s for s in steps) <= checklist.PART_BUDGET_S, part
        files = checklist.files_of(part)
        assert len(files) <= checklist.MAX_FILES and len(set(files)) == len(files), part
        names = [s.name for s in steps]
        assert len(set(names)) == len(names), part
    # one GPU run's parts are copied into one folder (docs/results/<date>-<gpu>/): no clashes
    every = [f for part in checklist.STEPS for f in checklist.files_of(part)]
    assert len(set(every)) == len(every)
    for part, steps in checklist.STEPS.items():
        for step in steps:
            for smoke in (False, True):
                cmd = step.command(smoke, "/results")
                for arg in cmd:  # every script and config a step names is in the repository
                    if arg.startswith(("scripts/", "configs/", "tests/")):
                        assert os.path.exists(os.path.join(ROOT, arg)), (part, step.name, arg)
            if step.json:
                assert step.command(False, "/r")[-2:] == ["--json", f"/r/{step.json}"]


def test_smoke_subset_of_part_1(tmp_path):
    out = tmp_path / "results"
    proc = run("1", "--smoke", "--out", str(out), "--only",
               "nvidia-smi,memory and cores,versions,transfer,step_time_1b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "part1.json").read_text())
    assert summary["kind"] == "gpu_checklist" and summary["smoke"] is True
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == ["nvidia-smi", "memory and cores", "versions", "transfer",
                           "step_time_1b"]
    assert "needs a GPU" in steps["nvidia-smi"]["skipped"]
    for name in ("memory and cores", "versions", "transfer", "step_time_1b"):
        assert steps[name]["rc"] == 0 and not steps[name]["timed_out"], name
    # the step wrote its JSON where the summary says, predicted from the transfer's rates (a
    # folder with none is refused: plan --rates); no bench ran: no comparison
    prediction = json.loads((out / steps["step_time_1b"]["json"]).read_text())
    assert prediction["kind"] == "step_time" and prediction["step_s"] > 0
    assert prediction["shape"]["tokens_per_step"] == 2 * 2 * 32  # the smoke's tiny sizes
    assert "compare" not in prediction
    log = (out / "part1.txt").read_text()
    assert "scripts/plan.py --config configs/tiny.yaml" in log and "jax" in log
    assert sorted(p.name for p in out.iterdir()) == ["part1.json", "part1.txt", "step_time_1b.json",
                                                     "transfer.json"]
    assert "part 1  step_time_1b" in proc.stdout
    # the folder renders as docs/benchmarks.md's tables (scripts/results_tables.py)
    rendered = "\n".join(tables.render_folder(str(out)))
    for title in ("Step time", "The checklist's steps"):
        assert title in rendered, title
    assert "| part1.json | nvidia-smi | skipped: needs a GPU (--smoke) | | |" in rendered


def test_a_step_past_its_timeout_is_ended_and_the_next_part_still_runs(tmp_path):
    out = tmp_path / "results"
    proc = run("1", "2", "--smoke", "--out", str(out), "--timeout", "0.5", "--only",
               "versions,memory and cores")
    assert proc.returncode == 1  # a step failed
    first = {s["name"]: s for s in json.loads((out / "part1.json").read_text())["steps"]}
    assert first["versions"]["timed_out"] and first["versions"]["rc"] == 124
    assert first["versions"]["seconds"] < 15  # ended, not waited for
    second = json.loads((out / "part2.json").read_text())["steps"]
    assert [(s["name"], s["rc"]) for s in second] == [("memory and cores", 0)]
    assert "TIMED OUT" in proc.stdout


def test_bad_arguments_are_one_line_errors(tmp_path):
    proc = run("9", "--out", str(tmp_path))
    assert proc.returncode == 2 and "invalid choice: 9" in proc.stderr
    proc = run("2", "--only", "bench_1b", "--out", str(tmp_path))
    assert proc.returncode == 2 and "no step named 'bench_1b'" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_part_7_dry_runs_on_the_cpu_within_eight_minutes(tmp_path):
    """Part 7 (the tiled block's attention, issue 46) at tiny sizes end to end: its steps'
    timeouts stay within 8 minutes; its summary is written after each step; the attention probe
    times every candidate (XLA's attention standing in for cuDNN here) and holds its gradients
    against the reference's; the 128K step's JSON names the attention that ran and the step-time
    model's step beside the measured one."""
    assert sum(s.timeout_s for s in checklist.STEPS[7]) <= 480
    out = tmp_path / "results"
    proc = run("7", "--smoke", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((out / "part7.json").read_text())["steps"]}
    assert list(steps) == ["nvidia-smi", "memory and cores", "tile_attention", "long_128k_tiled"]
    assert all(s["rc"] == 0 for name, s in steps.items() if name != "nvidia-smi")
    probe = json.loads((out / "tile_attention.json").read_text())
    assert probe["cudnn_stands_in"] and probe["dot_product_attention"]["return_residual"]
    assert set(probe["measured"]) == {"blockwise/16", "blockwise/32", "merged", "untiled"}
    for name, c in probe["candidates"].items():  # (their equality: tests/test_seqtile.py)
        assert "error" not in c and c["step_s"] > 0, name
        assert name == "reference" or math.isfinite(c["dx_rel_diff"] + c["dw_rel_diff"]), name
    step = json.loads((out / "long_128k_tiled.json").read_text())
    assert step["attention"].startswith("blockwise flash attention (blocks of 64) per query tile")
    assert step["step_time"]["step_s"] > 0 and len(step["run"]["step_times_s"]) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(checklist.files_of(7))


def test_smoke_of_part_6_the_dispatching_thread(tmp_path):
    """Part 6's steps at tiny sizes (a subset: each of its scripts and settings once): bench.py
    against resident with the dispatch counts, a layer call's dispatch against a bare jit with
    XLA's command buffers off (its JSON records the flags it ran under), the update pool limited
    with the dispatching thread profiled."""
    out = tmp_path / "results"
    proc = run("6", "--smoke", "--out", str(out), "--only",
               "bench_1b_32k,layer_calls_no_command_buffers,threads_15_profile_8l")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((out / "part6.json").read_text())["steps"]}
    assert all(s["rc"] == 0 for s in steps.values()), steps
    bench = json.loads((out / "bench_1b_32k.json").read_text())
    assert set(bench["streamed"]["dispatch"]) >= {"calls_per_step", "arg_leaves_per_step",
                                                  "syncs_per_step", "main_thread_s"}
    assert "resident" in json.dumps(bench["baselines"])
    calls = json.loads((out / "layer_calls_no_command_buffers.json").read_text())
    assert calls["xla_flags"] == "--xla_gpu_enable_command_buffer="
    assert {"layer_fwd bare", "layer_bwd bare", "layer_bwd scan"} <= set(calls["calls"])
    log = (out / "part6.txt").read_text()
    assert "optimizer.host_threads=1" in log and "--profile-main" in log


def test_smoke_of_part_8_while_loops_in_command_buffers(tmp_path):
    """Part 8's steps that differ from part 6's at tiny sizes: a layer call's dispatch and a
    bench_1b step under XLA's command buffers with while loops and conditionals added (each JSON
    records the flags it ran under), and the bus ring against resident bus copies."""
    assert sum(s.timeout_s for s in checklist.STEPS[8]) <= 360  # 6 minutes
    out = tmp_path / "results"
    proc = run("8", "--smoke", "--out", str(out), "--only", "layer_calls_while,bench_1b_ring")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    flags = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
    assert json.loads((out / "layer_calls_while.json").read_text())["xla_flags"] == flags
    ring = json.loads((out / "bench_1b_ring.json").read_text())
    assert ring["config"]["offload"]["bus"] == "ring" and "resident" in json.dumps(ring["baselines"])
