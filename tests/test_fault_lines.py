"""Reliability round 3 (issue 24, items 4-7): each bad input or fault below ends in one line
naming its culprit, and nothing of the user's is overwritten or deleted. In process, tiny runs."""

import errno
import json
import importlib.util
import os
import re
import types

import numpy as np
import pytest

from megatrain_jax import checkpoint, commands, distributed, dpo, metrics_log
from megatrain_jax import machines
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.data import DataError
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.runlock import LockedError, RunLock
from megatrain_jax.errors import TrainingError
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=32", "data.batch_size=2",
        "train.compute_dtype=float32", "train.attention=xla", "optimizer.warmup_steps=1",
        "checkpoint.async=false", "logging.tensorboard=false"]


def tiny(run_dir, *extra):
    return load_config(TINY, [*FAST, f"run_dir={run_dir}", *extra])


# ----------------------------------------------------------------------------- item 6


def test_ignore_plan_runs_a_config_the_plan_refuses_and_says_so(tmp_path, monkeypatch):
    """A plan that over-estimates blocks the run; train.ignore_plan=true runs it, printing the
    plan and that it was overridden."""
    small = machines.Machine("a small machine", 1e-6, 1e-6, 0.0, 0.0, platform="cpu",
                             compute_on_host=True)
    monkeypatch.setattr(machines, "machine_from_device", lambda *a, **k: small)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="does not fit.*train.ignore_plan=true runs it anyway"):
        train(tiny(run_dir, "train.steps=1"), log=lambda line: None)
    assert not run_dir.exists()
    lines = []
    history = train(tiny(run_dir, "train.steps=1", "train.ignore_plan=true"), log=lines.append)
    assert len(history) == 1
    summary = next(i for i, x in enumerate(lines) if x.startswith("plan (a small machine)"))
    assert "does not fit" in lines[summary] or "fits" not in lines[summary].split(";")[-1]
    assert lines[summary + 1].startswith("plan: overridden by train.ignore_plan=true")


# ----------------------------------------------------------------------------- item 4: launch.py

_spec = importlib.util.spec_from_file_location("launch", os.path.join(ROOT, "scripts", "launch.py"))
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

# Process 0 fails (an error line, or a SIGKILL); process 1 dies as JAX's client makes the others
# die when process 0 is gone: a C++ fatal log and SIGABRT. Its log begins a little before process
# 0 is seen gone, as it does for real (it sees the socket close while process 0 is still exiting).
TWO_PROCESSES = """
import os, signal, sys, time
me = int(sys.argv[-1].split("=")[1])
if me == 0:
    time.sleep(1.0)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    print("error: run_dir 'r' is in use by pid 1 on host h", file=sys.stderr)
    sys.exit(2)
time.sleep(0.5)
print("E1126 09:24:28.898566 6073 coordination_service_agent.cc:289] Polled an error from "
      "coordination service", file=sys.stderr, flush=True)
print("F1126 09:24:28.898570 6073 client.h:80] Terminating process because the JAX distributed "
      "service detected fatal errors.", file=sys.stderr, flush=True)
time.sleep(1.0)
print("*** Check failure stack trace: ***", file=sys.stderr, flush=True)
os.abort()
"""


@pytest.mark.parametrize("how, code, line", [
    ("error", 2, "launch: process 0 exited with code 2; stopping the others"),
    ("kill", 128 + 9, "launch: process 0 exited with code -9 (killed by SIGKILL: lost); stopping "
                      "the others")])
def test_launch_reports_the_first_failure_not_the_others_abort(tmp_path, capsys, how, code, line):
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES)
    assert launch.launch(2, [str(script), how], grace=5) == code
    err = capsys.readouterr().err
    assert line in err, err
    if how == "error":
        assert "[0] error: run_dir 'r' is in use" in err
    assert "Polled an error" not in err and "Terminating process" not in err, err
    assert "stack trace" not in err, err


def test_launch_passes_a_lone_cpp_log_line_on(tmp_path, capsys):
    """A C++ log line is held only while another process may be failing: alone, it is printed."""
    script = tmp_path / "warn.py"
    script.write_text("import sys\nprint('W1126 09:24:28.1 1 x.cc:1] a warning', file=sys.stderr)\n")
    assert launch.launch(2, [str(script)], grace=1) == 0
    err = capsys.readouterr().err
    assert err.count("] a warning") == 2, err


def test_a_busy_run_dir_is_refused_before_the_processes_join(tmp_path, monkeypatch):
    """Process 0 refusing after jax.distributed started would leave the others to abort."""
    def joined(d):
        raise AssertionError("jax.distributed.initialize ran before the lock was checked")

    monkeypatch.setattr(distributed, "initialize", joined)
    run_dir = tmp_path / "run"
    with RunLock(str(run_dir.mkdir() or run_dir)):
        with pytest.raises(LockedError, match=f"run_dir '{run_dir}' is in use by pid {os.getpid()}"):
            train(tiny(run_dir, "distributed.num_processes=2",
                       "distributed.coordinator=127.0.0.1:1234", "distributed.process_id=0"),
                  log=lambda line: None)
    assert os.listdir(run_dir) == []


# ----------------------------------------------------------------------------- item 7


def test_a_disk_tier_filled_mid_run_is_one_line_naming_path_step_and_checkpoints(tmp_path,
                                                                                  monkeypatch):
    """The tier's files are allocated at the start; a write that fails later (ENOSPC: another
    file took the space) stops the run naming offload.path, the step and the checkpoints."""
    full, save = [False], checkpoint.save

    def save_then_fill(manager, step, *args, **kwargs):
        save(manager, step, *args, **kwargs)
        full[0] = step == 2  # the disk fills after checkpoint 2

    def pwritev(fd, buffers, offset, write=os.pwritev):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, buffers, offset)

    monkeypatch.setattr(checkpoint, "save", save_then_fill)
    monkeypatch.setattr(tier_lib.os, "pwritev", pwritev)
    run_dir, path = tmp_path / "run", tmp_path / "tier"
    with pytest.raises(TrainingError) as e:
        train(tiny(run_dir, "train.steps=4", "checkpoint.every=1", "offload.tier=disk",
                   f"offload.path={path}"), log=lambda line: None)
    line = str(e.value)
    assert "\n" not in line
    assert re.match(rf"stopped at step [34]: offload.path {path}: writing {path}/unit_\d+\.bin "
                    rf"failed \(No space left on device\); completed checkpoints: 1, 2 ", line), line
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]


# ----------------------------------------------------------------------------- DPO's reference cache


def test_a_truncated_reference_cache_is_one_line_naming_it_and_kept(tmp_path):
    """Item 4: a reference_logps-*.npz cut short (BadZipFile) is refused naming the file; it is
    not ours to delete."""
    cache = dpo.ReferenceCache(str(tmp_path), {"data": "d"})
    cache.save(np.arange(1000, dtype=np.float32))
    whole = open(cache.path, "rb").read()
    for cut in (len(whole) // 2, 10):
        open(cache.path, "wb").write(whole[:cut])
        with pytest.raises(DataError, match=rf"^{re.escape(cache.path)}: not a reference log-prob "
                                            rf"cache of this trainer, or a damaged one .*move it "
                                            rf"away \(it is not overwritten\)"):
            cache.load(1000)
        assert open(cache.path, "rb").read() == whole[:cut]


def test_an_unusable_reference_dir_is_refused_before_the_reference_pass(tmp_path, monkeypatch):
    """Item 5: dpo.reference_dir a file, or not writable (/sys/...: even for root): one line
    naming the key, before the reference pass (not a bare errno after it)."""
    from test_dpo import build, bundled_pairs, preference_cfg, write_pairs
    data = write_pairs(tmp_path / "pairs.jsonl", bundled_pairs(4))
    dataset, engine = build(preference_cfg(tmp_path, data))
    monkeypatch.setattr(dpo, "reference_logps", lambda *a: pytest.fail("the pass ran"))
    a_file = tmp_path / "refs"
    a_file.write_text("mine")
    for where, why in [(a_file, "is not a directory"), ("/sys/megatrain_refs", "is not writable")]:
        cfg = preference_cfg(tmp_path, data, f"dpo.reference_dir={where}")
        with pytest.raises(ConfigError, match=f"^dpo.reference_dir={where}.*{why}"):
            dpo.prepare_reference(cfg, engine, dataset, lambda line: None)
    engine.close()
    assert a_file.read_text() == "mine" and not os.path.exists("/sys/megatrain_refs")


# ----------------------------------------------------------------------------- plot --out


def test_plot_out_names_the_formats_and_says_what_it_wrote(tmp_path, capsys):
    """Item 4: --out x.txt is one line naming the suffixes (not matplotlib's ValueError). Item 5:
    --out DIR (a directory) writes DIR/metrics.png; --out NAME (no suffix) NAME.png; each said."""
    from test_plot import PNG, fake_run
    run = fake_run(tmp_path / "run", 1.0)
    assert commands.plot([str(run), "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {tmp_path / 'x.txt'}: cannot write "
                                               f"a .txt picture"), err
    assert ".png" in err[0] and ".svg" in err[0] and not (tmp_path / "x.txt").exists()
    folder = tmp_path / "plots"
    folder.mkdir()
    for out, written in [(folder, folder / "metrics.png"), (tmp_path / "p", tmp_path / "p.png")]:
        assert commands.plot([str(run), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == f"wrote {written}"
        assert written.read_bytes().startswith(PNG)
    assert not (tmp_path / "plots.png").exists()


# ----------------------------------------------------------------------------- generate


def test_a_generate_error_starts_a_line_of_its_own(monkeypatch, capsys):
    """Item 5: the prompt is printed before generation starts; an error then must not be glued
    to it (`hierror: ...` on a terminal)."""
    from megatrain_jax import generate as gen
    tokenizer = types.SimpleNamespace(encode=lambda text: [104, 105], decode=bytes, eos_ids=[256])
    monkeypatch.setattr(gen, "from_run", lambda run, step: types.SimpleNamespace(
        tokenizer=tokenizer))
    monkeypatch.setattr(gen, "check_length", lambda model, n: None)

    def fails(*args, **kwargs):
        raise ConfigError("checkpoint step 3 holds NaN")

    monkeypatch.setattr(gen, "generate", fails)
    assert commands.generate(["--run", "r", "--prompt", "hi"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "hi\n"
    assert captured.err == "error: checkpoint step 3 holds NaN\n"


# ----------------------------------------------------------------------------- distributed


@pytest.mark.parametrize("port", [99999, 0])
def test_a_coordinator_port_out_of_range_is_refused_at_once(port):
    """Item 5: not a port at all, so not a matter of reachability after distributed.timeout_s."""
    with pytest.raises(ConfigError, match=rf"^distributed.coordinator=127.0.0.1:{port}: port "
                                          rf"{port} is not a TCP port \(1 to 65535\)$"):
        load_config(None, [f"distributed.coordinator=127.0.0.1:{port}",
                           "distributed.num_processes=2"])


# ----------------------------------------------------------------------------- a full disk


def test_a_failed_save_is_the_error_when_closing_the_writers_fails_too(tmp_path, monkeypatch):
    """Item 5: a disk that fills fails the save (SaveError naming the step and the complete
    checkpoints) and then TensorBoard's close: the first error is the one reported."""
    save = checkpoint.save

    def save_until_full(manager, step, *args, **kwargs):
        if step == 2:
            raise checkpoint.SaveError("saving checkpoint step 2 failed (No space left on "
                                       "device); completed checkpoints: 1")
        save(manager, step, *args, **kwargs)

    def close(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save", save_until_full)
    monkeypatch.setattr(metrics_log.Sinks, "close", close)
    with pytest.raises(checkpoint.SaveError, match="^saving checkpoint step 2 failed .*completed "
                                                   "checkpoints: 1$"):
        train(tiny(tmp_path / "run", "train.steps=2", "checkpoint.every=1"), log=lambda x: None)


# ----------------------------------------------------------------------------- round 4 (issue 35)


def _refused_before_planning(monkeypatch):
    """Makes any planning or step-time simulation fail the test: a refusal must come first."""
    from megatrain_jax import plan, step_time

    def planned(*args, **kwargs):
        raise AssertionError("planned before the bad argument was refused")
    for module, name in ((plan, "plan"), (plan, "plan_sweep"), (step_time, "simulate")):
        monkeypatch.setattr(module, name, planned)


@pytest.mark.parametrize("case", ["memory nan", "memory inf", "h2d inf", "json dir",
                                  "json folder is a file"])
def test_plan_refuses_non_finite_numbers_and_an_unusable_json_before_planning(
        tmp_path, capsys, monkeypatch, case):
    """`plan --device-memory-gb nan` planned a machine of NaN bytes, `--h2d-gbps inf` was taken
    (nan was refused), and `--json` naming a directory failed after the whole plan."""
    _refused_before_planning(monkeypatch)
    (tmp_path / "a_file").write_text("x")
    args, line = {
        "memory nan": (["--device-memory-gb", "nan"],
                       "--device-memory-gb must be a finite number > 0, got nan"),
        "memory inf": (["--device-memory-gb", "inf"],
                       "--device-memory-gb must be a finite number > 0, got inf"),
        "h2d inf": (["--step-time", "--h2d-gbps", "inf"],
                    "--h2d-gbps must be a finite number > 0, got inf"),
        "json dir": (["--json", str(tmp_path)],
                     f"--json {tmp_path} is a directory; give the name of the file to write"),
        "json folder is a file": (["--json", f"{tmp_path}/a_file/plan.json"],
                                  f"--json {tmp_path}/a_file/plan.json: cannot make its folder "
                                  f"{tmp_path}/a_file (a file is in the way)")}[case]
    assert commands.plan(["--config", TINY, *args]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_plan_json_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys,
                                                                       monkeypatch):
    _refused_before_planning(monkeypatch)
    real_open = open

    def read_only(path, mode="r", *args, **kwargs):  # root writes anywhere: fail as a user would
        if str(path).endswith("plan.json") and mode != "r":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, mode, *args, **kwargs)
    monkeypatch.setattr(commands, "open", read_only, raising=False)
    out = tmp_path / "plan.json"
    assert commands.plan(["--config", TINY, "--json", str(out)]) == 2
    assert capsys.readouterr().err == f"error: --json {out} cannot be written (Permission denied)\n"


def test_generate_refuses_a_prompt_not_utf8_and_a_seed_past_64_bits(capsys, monkeypatch):
    """A prompt whose bytes are not UTF-8 traced back in the tokenizer; a seed of 2**64 traced
    back in jax.random.key after the weights were read. Both are refused before."""
    from megatrain_jax import generate as gen

    def loads(*args):
        raise AssertionError("the model was read before the bad argument was refused")
    monkeypatch.setattr(gen, "from_run", loads)
    prompt = os.fsdecode(b"caf\xe9 au lait")  # Latin-1 on the command line, as Python has it
    assert commands.generate(["--run", "r", "--prompt", prompt]) == 2
    assert capsys.readouterr().err == ("error: --prompt is not valid UTF-8 (byte 0xe9 at offset "
                                       "3); give the prompt as UTF-8 text\n")
    for seed in (1 << 64, -(1 << 63) - 1):
        assert commands.generate(["--run", "r", "--prompt", "hi", "--seed", str(seed)]) == 2
        assert capsys.readouterr().err == (f"error: --seed must fit in 64 bits (-2**63 to "
                                           f"2**63 - 1), got {seed}\n")


# ----------------------------------------------------------------------------- round 5 (issue 44)


def test_plan_json_onto_a_full_disk_is_one_line_and_leaves_the_file_that_was_there(tmp_path,
                                                                                   capsys):
    """`plan --json` onto a full disk gave a bare `[Errno 28]` after the whole plan, an empty
    file, and an existing plan.json replaced by a truncated one. A file is written beside and
    renamed over: whole or not at all; a device (/dev/full, /dev/stdout) is written as is."""
    import resource
    args = ["--config", TINY, "--step-time"]  # writes its --json as the plan does; compiles none
    assert commands.plan([*args, "--json", "/dev/full"]) == 2
    assert capsys.readouterr().err == ("error: --json /dev/full: writing it failed (No space "
                                       "left on device)\n")
    out = tmp_path / "plan.json"
    out.write_text('{"an earlier": "plan"}')
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, limit[1]))  # a disk full after 100 bytes
    try:  # (Python ignores SIGXFSZ: the write fails with EFBIG)
        code = commands.plan([*args, "--json", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert code == 2 and capsys.readouterr().err == (
        f"error: --json {out}: writing it failed (File too large); the file there is as it was\n")
    assert os.listdir(tmp_path) == ["plan.json"] and out.read_text() == '{"an earlier": "plan"}'
    assert commands.plan([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["kind"] == "step_time"


def test_plan_refuses_rates_it_cannot_read_and_a_batch_the_devices_cannot_split(tmp_path, capsys,
                                                                                monkeypatch):
    """`--rates DIR` with no rates in DIR predicted from the defaults with no word; `--devices 3`
    said a batch of 16 fits where train refuses it at once. Both refused before planning."""
    _refused_before_planning(monkeypatch)
    (tmp_path / "notes.json").write_text('{"something": "else"}')
    assert commands.plan(["--config", TINY, "--step-time", "--rates", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: --rates {tmp_path}: no rate in it (1 JSON file, none a result of the GPU "
        f"checklist's benchmarks nor a step-time prediction with rates): give the folder "
        f"scripts/gpu_checklist.py wrote, or leave --rates out for the defaults\n")
    split = ("error: data.batch_size=16 does not split over the 3 data-parallel devices (1 "
             "process(es) x 3 distributed.local_devices); make it a multiple of 3\n")
    for extra in ([], ["--step-time"], ["--sweep", "64,128"]):
        assert commands.plan(["--config", TINY, "--devices", "3", *extra]) == 2
        assert capsys.readouterr().err == split
    with pytest.raises(ConfigError, match=re.escape(split[len("error: "):-1])):  # train's own
        distributed.check_batch(16, 3, 1)
