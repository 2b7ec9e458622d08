"""Every bad input and fault of issue 11's probe that config, resume, the run lock, checkpoint
saves, HF import and export own, through the real command line: exit code 2 (bad input, refused
before anything is written) or 1 (a fault during the run: a checkpoint could not be written),
exactly one stderr line `error: ...` naming the culprit, no traceback, and no file of an existing
run changed.
docs/reliability.md lists them all, with the other owners' (data.py, engine).

Fast by construction: each command runs through the script itself once or more, and otherwise
through its main in this process (the exit code the script exits with, the lines it prints);
a process of its own where the process is the point (a second one holding the run's lock, a
file-size limit, dropped permissions, its own build cache). The runs that train share the test
run's persistent compilation cache (conftest) with every other test's."""

import concurrent.futures
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from megatrain_jax import checkpoint, commands, hf
from megatrain_jax.config import RESUME_KEYS, Config, ConfigError, load_config, resume_changes, \
    resume_keys, to_dict
from megatrain_jax.model import ModelConfig
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
LLAMA3_8B = os.path.join(ROOT, "configs", "llama3_8b.yaml")
FAST = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "train.log_every=1",
        "checkpoint.keep=10"]


def files(directory) -> dict:
    """{relative path: sha256} of every file under directory: what "nothing changed" compares."""
    out = {}
    for d, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def env():
    """The subprocesses' environment: this process's, with conftest's persistent compilation
    cache, so a tiny run compiled by any test of the run before is not compiled again."""
    assert os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return dict(os.environ)


def train_args(*args, config=TINY):
    return [*(["--config", config] if config else []), *args]


def train_cmd(*args, config=TINY):
    script = os.path.join(ROOT, "scripts", "train.py")
    return [sys.executable, script, *train_args(*args, config=config)]


def export_cmd(*args):
    return [sys.executable, os.path.join(ROOT, "scripts", "export_hf.py"), *args]


# `ulimit -f`, then exec: writes past the limit fail with EFBIG (Python ignores SIGXFSZ), as on a
# full disk. (A preexec_fn would fork this multithreaded JAX process.)
ULIMIT_F = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, "
            "(int(sys.argv[1]),) * 2); os.execv(sys.argv[2], sys.argv[2:])")


def run(cmd, env, limit_file_bytes=None, timeout=240):
    if limit_file_bytes:
        cmd = [sys.executable, "-c", ULIMIT_F, str(limit_file_bytes), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def in_process(main, args, capsys):
    """A script's main run in this process (scripts/train.py's is commands.train, export_hf.py's
    commands.export: tests/test_commands.py), as a finished process: the exit code the script
    exits with, and what it printed."""
    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def run_all(cmds, env):
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda c: run(c, env), cmds))


def assert_one_error_line(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def saved_state(run_dir, step):
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"))
    args = ocp.args.Composite(state=ocp.args.StandardRestore())
    state = manager.restore(step, args=args)["state"]
    manager.close()
    return jax.tree.map(np.array, state)  # writable copies


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run with checkpoints 2 and 4, trained by scripts/train.py's main in this
    process (learning_rate=2e-5 on the command line: a YAML 1.2 float that PyYAML alone reads as
    a string)."""
    run_dir = str(tmp_path_factory.mktemp("finished") / "run")
    assert commands.train(train_args(*FAST, "train.steps=4", "checkpoint.every=2",
                                     "optimizer.learning_rate=2e-5", f"run_dir={run_dir}")) == 0
    assert "learning_rate: 2.0e-05" in open(os.path.join(run_dir, "config.yaml")).read()
    return run_dir


@pytest.fixture
def copy_run(finished, tmp_path):
    """copy_run(name): a fresh copy of the finished run."""
    def make(name="run"):
        path = str(tmp_path / name)
        shutil.copytree(finished, path)
        return path
    return make


def cli_cases_refuse_and_leave_the_run_alone(cases, copy_run, env, code=2):
    """cases: [(name, command builder(run_dir) -> argv, [needles])]; each on its own copy."""
    dirs = [copy_run(name) for name, _, _ in cases]
    before = [files(d) for d in dirs]
    procs = run_all([build(d) for (_, build, _), d in zip(cases, dirs)], env)
    for (name, _, needles), proc, d, b in zip(cases, procs, dirs, before):
        assert_one_error_line(proc, code, *needles)
        assert files(d) == b, f"{name}: the run directory changed"


def main_cases_refuse_and_leave_the_run_alone(cases, copy_run, capsys):
    """As cli_cases_refuse_and_leave_the_run_alone, through scripts/train.py's main
    (commands.train) in this process: the exit code it returns is the one the script exits with.
    cases: [(name, arguments builder(run_dir) -> args, [needles])]."""
    for name, args, needles in cases:
        run_dir = copy_run(name)
        before = files(run_dir)
        assert_one_error_line(in_process(commands.train, args(run_dir), capsys), 2, *needles)
        assert files(run_dir) == before, f"{name}: the run directory changed"


# ----------------------------------------------------------------------------- config


def test_yaml_12_floats_in_files_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  learning_rate: 2e-5\n  eps: 1e-8\n  max_grad_norm: 1E0\n")
    cfg = load_config(str(path), ["optimizer.weight_decay=1e-2", "optimizer.min_lr_ratio=.5"])
    opt = cfg.optimizer
    assert (opt.learning_rate, opt.eps, opt.max_grad_norm, opt.weight_decay, opt.min_lr_ratio) == \
           (2e-5, 1e-8, 1.0, 1e-2, 0.5)
    assert load_config(None, ["optimizer.learning_rate=1.0e30"]).optimizer.learning_rate == 1e30
    assert load_config(None, ["optimizer.learning_rate=1e30"]).optimizer.learning_rate == 1e30
    assert load_config(None, ["train.steps=12"]).train.steps == 12  # ints stay ints
    with pytest.raises(ConfigError, match="train.steps: expected int, got float"):
        load_config(None, ["train.steps=1e3"])


def test_bad_config_is_one_line_exit_2_and_the_run_is_untouched(copy_run, tmp_path, env,
                                                                capsys):
    """Refused while the config is read, before JAX starts: one case through scripts/train.py,
    the others through its main (commands.train) in this process, each on a copy of a run."""
    (tmp_path / "dup.yaml").write_text("train:\n  steps: 1\n  seed: 0\n  steps: 500\n")
    (tmp_path / "list.yaml").write_text("- model\n- data\n")
    (tmp_path / "confdir").mkdir()
    cli_cases_refuse_and_leave_the_run_alone([
        ("lr nan", lambda d: train_cmd("optimizer.learning_rate=.nan", f"run_dir={d}"),
         ["optimizer.learning_rate must be a finite number, got nan"])], copy_run, env)
    cases = [
        ("lr inf", lambda d: train_args("optimizer.learning_rate=.inf", f"run_dir={d}"),
         ["optimizer.learning_rate must be a finite number, got inf"]),
        ("clip nan", lambda d: train_args("optimizer.max_grad_norm=.nan", f"run_dir={d}"),
         ["optimizer.max_grad_norm must be a finite number"]),
        ("eps nan", lambda d: train_args("optimizer.eps=.nan", f"run_dir={d}"),
         ["optimizer.eps must be a finite number"]),
        ("wd inf", lambda d: train_args("optimizer.weight_decay=-.inf", f"run_dir={d}"),
         ["optimizer.weight_decay must be a finite number"]),
        ("b1", lambda d: train_args("optimizer.b1=5.0", f"run_dir={d}"),
         ["optimizer.b1 must be in [0, 1), got 5.0"]),
        ("b2", lambda d: train_args("optimizer.b2=1", f"run_dir={d}"),
         ["optimizer.b2 must be in [0, 1)"]),
        ("warmup", lambda d: train_args("optimizer.warmup_steps=-5", f"run_dir={d}"),
         ["optimizer.warmup_steps must be >= 0, got -5"]),
        ("state_dtype", lambda d: train_args("optimizer.state_dtype=bf16", f"run_dir={d}"),
         ["optimizer.state_dtype must be one of float32, bfloat16, got 'bf16'"]),
        ("duplicate key", lambda d: train_args(f"run_dir={d}", config=str(tmp_path / "dup.yaml")),
         ["dup.yaml: duplicate key train.steps (line 4)"]),
        ("yaml list + override", lambda d: train_args("train.steps=2", f"run_dir={d}",
                                                      config=str(tmp_path / "list.yaml")),
         ["list.yaml: expected a mapping", "got a list"]),
        ("config is a directory",
         lambda d: train_args(f"run_dir={d}", config=str(tmp_path / "confdir")),
         [f"--config {tmp_path / 'confdir'} is a directory"]),
        ("allow_changes unknown", lambda d: train_args("checkpoint.allow_changes=[train.stepz]",
                                                       f"run_dir={d}"),
         ["checkpoint.allow_changes: unknown config key train.stepz"]),
        ("allow_changes never compared",
         lambda d: train_args("checkpoint.allow_changes=[train.prefetch]", f"run_dir={d}"),
         ["checkpoint.allow_changes: train.prefetch is never compared on resume"]),
        ("config twice",  # argparse kept the last: an 8B config dropped whole, a tiny run trained
         lambda d: ["--config", LLAMA3_8B, *train_args(f"run_dir={d}")],
         [f"--config given twice ({LLAMA3_8B}, then {TINY}); give one config file and change its "
          f"keys with key=value overrides"]),
    ]
    main_cases_refuse_and_leave_the_run_alone(cases, copy_run, capsys)
    assert_one_error_line(in_process(commands.plan, ["--config", TINY, "--config", TINY], capsys),
                          2, "--config given twice")


@pytest.mark.parametrize("value", ["inf", "nan", "abc", "-8"])
def test_a_pinned_pool_size_that_is_no_size_is_one_line_from_every_command(value, tmp_path, env,
                                                                          capsys, monkeypatch):
    """XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=inf (nan, abc) gave tracebacks from an ordinary CPU
    training run (its plan sizes the pinned pool) and from plan one naming neither the variable
    nor the value: every command that starts XLA refuses it before anything else, one line.
    train through its script once, the others through their mains in this process."""
    line = (f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={value!r} is not a number of GiB > 0 (XLA's "
            f"pinned host pool); set it to one, e.g. 64, or unset it")
    run_dir = tmp_path / "run"
    if value == "inf":
        proc = run(train_cmd(*FAST, "train.steps=1", f"run_dir={run_dir}"),
                   {**env, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": value})
        assert assert_one_error_line(proc, 2) == f"error: {line}"
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", value)
    for main, args in [(commands.train, train_args(*FAST, f"run_dir={run_dir}")),
                       (commands.plan, ["--config", TINY, "--step-time"]),
                       (commands.plan, ["--config", TINY]),
                       (commands.generate, ["--run", str(run_dir), "--prompt", "x"]),
                       (commands.export, ["--run-dir", str(run_dir), "--out", str(tmp_path / "hf")])]:
        assert assert_one_error_line(in_process(main, args, capsys), 2) == f"error: {line}"
    assert not run_dir.exists() and not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- resume


def test_compared_keys_are_explicit():
    cfg = Config()
    assert RESUME_KEYS == ("model", "optimizer", "data.path", "data.sources", "data.text_field",
                           "data.tokenizer", "data.eos_token", "data.token_dtype", "data.seq_len",
                           "data.batch_size", "data.micro_batches", "data.document_mask",
                           "data.eval_path", "data.eval_fraction", "data.format", "data.overlong",
                           "train.seed", "train.steps", "dpo.beta", "dpo.loss")
    keys = resume_keys(cfg)
    assert {k for k in keys if not k.startswith(("model.", "optimizer."))} <= {
        "data.path", "data.sources", "data.text_field", "data.tokenizer", "data.eos_token",
        "data.token_dtype", "data.seq_len", "data.batch_size", "data.micro_batches",
        "data.document_mask", "data.eval_path", "data.eval_fraction", "data.format",
        "data.overlong", "train.seed", "train.steps", "dpo.beta", "dpo.loss"}
    assert {f"optimizer.{k}" for k in to_dict(cfg.optimizer)} <= set(keys)
    assert {f"model.{k}" for k in to_dict(cfg.model)} <= set(keys)
    saved = json.loads(json.dumps(to_dict(cfg)))
    # Execution options, logging and checkpoint cadence are never compared.
    free = ["train.log_every=7", "train.prefetch=3", "train.compute_dtype=float32",
            "train.grad_dtype=bfloat16", "checkpoint.every=5", "checkpoint.keep=1",
            "checkpoint.async=false", "checkpoint.allow_changes=[train.steps]", "run_dir=/x"]
    assert resume_changes(saved, load_config(None, free)) == []
    for override, key, old, new in [("train.steps=7", "train.steps", 100, 7),
                                    ("train.seed=3", "train.seed", 0, 3),
                                    ("data.seq_len=64", "data.seq_len", 128, 64),
                                    ("data.token_dtype=uint32", "data.token_dtype", "uint16",
                                     "uint32"),
                                    ("optimizer.b2=0.99", "optimizer.b2", 0.95, 0.99),
                                    ("model.rope_theta=5e5", "model.rope_theta", 10000.0, 5e5)]:
        assert resume_changes(saved, load_config(None, [override])) == [(key, old, new)]
    # A key the checkpoint predates counts as its default.
    del saved["data"]["micro_batches"]
    assert resume_changes(saved, cfg) == []
    assert resume_changes(saved, load_config(None, ["data.micro_batches=2"])) == [
        ("data.micro_batches", 1, 2)]


def test_data_sources_are_compared_in_any_order_and_named_once():
    """A mixture resumes each source by its path: its order is no change, its weights and
    fields are; a path listed twice would share one position, so it is refused."""
    mix = lambda *sources: load_config(None, ["data.path=''", "data.sources=[" + ", ".join(
        "{" + ", ".join(f"{k}: {v}" for k, v in s.items()) + "}" for s in sources) + "]"])
    saved = json.loads(json.dumps(to_dict(mix({"path": "a.jsonl", "weight": 3},
                                              {"path": "b.parquet", "text_field": "body"}))))
    assert resume_changes(saved, mix({"path": "b.parquet", "text_field": "body"},
                                     {"path": "a.jsonl", "weight": 3})) == []
    assert resume_changes(saved, mix({"path": "b.parquet"}, {"path": "a.jsonl", "weight": 3})) == [
        ("data.sources", "a.jsonl weight 3; b.parquet weight 1, text_field body",
         "b.parquet weight 1; a.jsonl weight 3")]
    changes = {k: (old, new) for k, old, new in resume_changes(
        json.loads(json.dumps(to_dict(Config()))), mix({"path": "a.jsonl"}))}
    assert changes["data.sources"] == ("none", "a.jsonl weight 1")
    with pytest.raises(ConfigError, match=r"^data.sources.2.path repeats data.sources.0.path "
                                          r"\(a.jsonl\); give each source once"):
        mix({"path": "a.jsonl"}, {"path": "b.parquet"}, {"path": "a.jsonl"})


def test_resume_refuses_a_changed_run_names_key_old_new(copy_run, tmp_path, env, capsys):
    """Refused before the engine is built: one case through scripts/train.py, the others through
    its main in this process, each on a copy of the finished run."""
    other = tmp_path / "other.txt"
    shutil.copy(os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt"), other)
    args = lambda *extra: (lambda d: train_args(*FAST, "train.steps=4", "checkpoint.every=2",
                                                "optimizer.learning_rate=2e-5", f"run_dir={d}",
                                                *extra))
    cli_cases_refuse_and_leave_the_run_alone([
        ("seq_len", lambda d: [*train_cmd(config=None), *args("data.seq_len=64")(d)],
         ["checkpoint step 4", "config.data.seq_len is 32 in the checkpoint, 64 now",
          "checkpoint.allow_changes=[data.seq_len]"])], copy_run, env)
    cases = [
        ("seed", args("train.seed=1"), ["config.train.seed is 0 in the checkpoint, 1 now"]),
        ("lr", args("optimizer.learning_rate=1e-3"),
         ["config.optimizer.learning_rate is 2e-05 in the checkpoint, 0.001 now"]),
        ("steps", args("train.steps=8"), ["config.train.steps is 4 in the checkpoint, 8 now"]),
        ("batch", args("data.batch_size=4"),
         ["config.data.batch_size is 2 in the checkpoint, 4 now"]),
        ("micro", args("data.micro_batches=2"), ["config.data.micro_batches is 1"]),
        ("moments' dtype", args("optimizer.state_dtype=bfloat16"),
         ["config.optimizer.state_dtype is 'float32' in the checkpoint, 'bfloat16' now",
          "checkpoint.allow_changes=[optimizer.state_dtype]"]),
        ("data file", args(f"data.path={other}"), ["config.data.path is", f"'{other}' now"]),
        ("allowed one, not the other", args("train.steps=8", "train.seed=2",
                                            "checkpoint.allow_changes=[train.steps]"),
         ["config.train.seed is 0 in the checkpoint, 2 now"]),
        ("resume_step older", args("checkpoint.resume_step=2"),
         ["checkpoint.resume_step=2", "newer checkpoints (steps 4)", "move them out"]),
        ("resume_step absent", args("checkpoint.resume_step=3"), ["no checkpoint at step 3"]),
    ]
    main_cases_refuse_and_leave_the_run_alone(cases, copy_run, capsys)


def test_resume_refuses_a_corpus_edited_in_place_unless_allowed(tmp_path, capsys):
    """The checkpoint records its data files' identity (size, mtime, a hash of the head): a
    corpus edited in place between a run and its resume is refused, naming the file, unless
    allowed: an edit past its first MiB at the same size (which the token cache rebuilt for,
    while the resume went on), then the corpus cut short."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(open(os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt"),
                            "rb").read() * 3)  # 1.15 MB
    run_dir = str(tmp_path / "run")
    args = [*FAST, "checkpoint.every=2", f"data.path={corpus}", f"run_dir={run_dir}",
            f"data.cache_dir={tmp_path}/cache"]
    train(load_config(TINY, [*args, "train.steps=2"]), log=lambda *a: None)
    before = files(run_dir)
    resume = train_args(*args, "train.steps=3", "checkpoint.allow_changes=[train.steps]")
    mtime = corpus.stat().st_mtime_ns + 10**9  # a write within the clock's tick would keep it
    with open(corpus, "r+b") as f:  # 1.1 MB in: past the first MiB, the same size
        f.seek(1_100_000)
        f.write(b"EDITED")
    os.utime(corpus, ns=(mtime, mtime))
    assert_one_error_line(in_process(commands.train, resume, capsys), 2, "checkpoint step 2",
                          "was trained on other data", f"{corpus}: its mtime is ",
                          "the same size and first 1,048,576 bytes: an edit past them",
                          "checkpoint.allow_changes=[data.path]")
    assert files(run_dir) == before
    corpus.write_bytes(corpus.read_bytes()[:60_000])  # cut to 60 KB, same name
    assert_one_error_line(in_process(commands.train, resume, capsys), 2, "checkpoint step 2",
                          "was trained on other data", str(corpus), "60,000 bytes",
                          "checkpoint.allow_changes=[data.path]")
    assert files(run_dir) == before
    lines = []
    train(load_config(TINY, [*args, "train.steps=3",
                             "checkpoint.allow_changes=[train.steps,data.path]"]), log=lines.append)
    assert any(line.startswith("resuming with changed data: ") for line in lines)
    assert [r["step"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))] == [1, 2, 3]


def test_damaged_checkpoints_read_as_damaged(copy_run, env, capsys):
    def no_metadata(d):
        os.remove(os.path.join(d, "checkpoints", "4", "state", "_METADATA"))
        return train_args(*FAST, "train.steps=4", "optimizer.learning_rate=2e-5", f"run_dir={d}")

    def truncated_arrays(d):
        data = os.path.join(d, "checkpoints", "4", "state", "ocdbt.process_0", "d")
        for name in os.listdir(data):
            os.truncate(os.path.join(data, name), 100)
        return train_args(*FAST, "train.steps=4", "optimizer.learning_rate=2e-5", f"run_dir={d}")

    dirs = [copy_run("nometa"), copy_run("truncated")]
    args = [no_metadata(dirs[0]), truncated_arrays(dirs[1])]
    before = [files(d) for d in dirs]
    # The truncated arrays through the script: the reads Orbax still has pending when the run
    # refuses go with the process (in this one they would be collected during a later test).
    procs = [in_process(commands.train, args[0], capsys),
             run([*train_cmd(config=None), *args[1]], env)]
    line = assert_one_error_line(procs[0], 2, "checkpoint step 4", "unreadable or damaged",
                                 "metadata of its saved state is missing",
                                 "resume from step 2")
    assert "does not match" not in line and "absent" not in line
    line = assert_one_error_line(procs[1], 2, "checkpoint step 4", "unreadable or damaged",
                                 "resume from step 2")
    assert "bound method" not in line and "Event loop" not in procs[1].stderr
    assert [files(d) for d in dirs] == before


# ----------------------------------------------------------------------------- run lock

HOLD = r"""
import os, runpy, sys, time
marker, release, *argv = sys.argv[1:]
from megatrain_jax import data
next_batch, calls = data.PackedDataset.next_batch, []
def held(self):  # before step 2: say so, and wait to be released
    calls.append(1)
    if len(calls) == 2:
        open(marker, "w").close()
        while not os.path.exists(release):
            time.sleep(0.02)
    return next_batch(self)
data.PackedDataset.next_batch = held
sys.argv = ["train.py", *argv]
runpy.run_path(os.path.join(os.getcwd(), "scripts", "train.py"), run_name="__main__")
"""


def test_second_run_on_a_run_dir_refuses_while_the_first_trains(tmp_path, env, capsys):
    run_dir = tmp_path / "run"
    marker, release = tmp_path / "at_step_2", tmp_path / "release"
    # Synchronous saves: while the first run is held, nothing of it is being written.
    args = [*FAST, "train.steps=3", "checkpoint.every=1", "checkpoint.async=false",
            f"run_dir={run_dir}"]
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(marker), str(release), "--config",
                              TINY, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.05)
        before = files(run_dir)
        second = in_process(commands.train, train_args(*args), capsys)
        assert_one_error_line(second, 2, f"run_dir '{run_dir}' is in use by pid {first.pid} on "
                              f"host {socket.gethostname()}", f"lock file {run_dir}/train.lock")
        assert files(run_dir) == before
    finally:
        release.touch()
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert [s for s, _ in losses(run_dir)] == [1, 2, 3]  # each step once, from one process
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "3"]
    assert not (run_dir / "train.lock").exists()


def test_stale_lock_is_taken_over_and_allow_changes_extends_a_run(copy_run, capsys):
    """A lock left by a dead process on this host is taken over (logged); train.steps, listed in
    checkpoint.allow_changes, extends the finished run (logged) from its last checkpoint."""
    run_dir = copy_run()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(run_dir, "train.lock"), "w") as f:
        f.write(f"{dead.pid} {socket.gethostname()}\n")
    proc = in_process(commands.train, train_args(
        *FAST, "train.steps=5", "checkpoint.every=2", "optimizer.learning_rate=2e-5",
        "checkpoint.allow_changes=[train.steps]", f"run_dir={run_dir}"), capsys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"took over the stale lock {run_dir}/train.lock of pid {dead.pid}" in proc.stdout
    assert "resuming with a changed train.steps: 4 in checkpoint step 4" in proc.stdout
    assert "5 now (checkpoint.allow_changes)" in proc.stdout
    assert "resumed from checkpoint step 4" in proc.stdout
    assert [s for s, _ in losses(run_dir)] == [1, 2, 3, 4, 5]
    assert not os.path.exists(os.path.join(run_dir, "train.lock"))


def test_lock_is_exclusive_and_released(tmp_path):
    from megatrain_jax.runlock import LockedError, RunLock
    with RunLock(str(tmp_path)) as lock:
        assert open(lock.path).read() == f"{os.getpid()} {socket.gethostname()}\n"
        with pytest.raises(LockedError, match=f"in use by pid {os.getpid()}"):
            RunLock(str(tmp_path)).__enter__()  # a second open file: flock refuses it too
    assert not os.path.exists(lock.path)
    with RunLock(str(tmp_path)):  # free again
        pass


def test_lock_of_another_host_is_not_taken_over(copy_run, capsys):
    run_dir = copy_run()
    with open(os.path.join(run_dir, "train.lock"), "w") as f:
        f.write("4242 some-other-host\n")
    before = files(run_dir)
    proc = in_process(commands.train, train_args(*FAST, "train.steps=4", f"run_dir={run_dir}"),
                      capsys)
    assert_one_error_line(proc, 2, "in use by pid 4242 on host some-other-host",
                          "delete the lock file if that run is over")
    assert files(run_dir) == before


# ----------------------------------------------------------------------------- visible fallbacks


def test_what_the_run_falls_back_from_is_one_visible_line(tmp_path, env):
    """A run whose fused AdamW kernel cannot be built (no compiler at $CXX, or a compiler that
    fails; an empty build cache) trains on its JAX fallback, and train.host_lookup=true with tied
    embeddings on the device path: each said in one stderr line naming why, not a debug log."""
    failing = tmp_path / "failing-cxx"
    failing.write_text("#!/bin/sh\necho 'fatal error: no room left for the build' >&2\nexit 1\n")
    failing.chmod(0o755)
    compilers = {"missing": (str(tmp_path / "no-such-cxx"),
                             f"fused AdamW: no C++ compiler ({tmp_path / 'no-such-cxx'}); the "
                             f"host update runs its JAX fallback"),
                 "failing": (str(failing),
                             "fused AdamW: the kernel is not available (fatal error: no room left "
                             "for the build); the host update runs its JAX fallback")}

    def train_with(name):
        cxx, _ = compilers[name]
        cmd = train_cmd(*FAST, "train.steps=1", "model.tie_embeddings=true",
                        "train.host_lookup=true", "logging.tensorboard=false",
                        f"run_dir={tmp_path / name}")
        return run(cmd, {**env, "CXX": cxx, "XDG_CACHE_HOME": str(tmp_path / f"cache-{name}")})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = dict(zip(compilers, pool.map(train_with, compilers)))
    for name, proc in procs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stderr.splitlines()  # (a logging prefix, where a library configured one)
        assert len([x for x in lines if x.endswith(compilers[name][1])]) == 1, proc.stderr[-3000:]
        lookup = [x for x in lines if "host_lookup=True does not apply (host lookup off: the "
                  "first and last stages share a variable" in x]
        assert len(lookup) == 1, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- saves that fail


def test_save_into_a_full_disk_is_one_line_exit_1_and_resume_stays_exact(finished, copy_run, env,
                                                                         capsys):
    """`ulimit -f` (a file-size limit: writes fail as on a full disk) while step 4 is saved, with
    asynchronous and with synchronous saves: one line, exit 1, checkpoint 2 untouched; then the
    run resumes from it to the same losses and final state as the uninterrupted run."""
    dirs = [copy_run("async"), copy_run("sync")]
    for d in dirs:  # back to a run killed after checkpoint 2
        shutil.rmtree(os.path.join(d, "checkpoints", "4"))
    kept = [{k: v for k, v in files(d).items() if k.startswith("checkpoints/2/")} for d in dirs]
    args = [*FAST, "train.steps=4", "checkpoint.every=2", "optimizer.learning_rate=2e-5"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda c: run(c, env, limit_file_bytes=256 << 10), [
            train_cmd(*args, f"run_dir={dirs[0]}"),
            train_cmd(*args, "checkpoint.async=false", f"run_dir={dirs[1]}")]))
    for proc, d, k in zip(procs, dirs, kept):
        assert_one_error_line(proc, 1, "saving checkpoint step 4", "failed", "File too large",
                              "completed checkpoints: 2")
        assert {p: h for p, h in files(d).items() if p.startswith("checkpoints/2/")} == k
        assert checkpoint.make_manager(os.path.join(d, "checkpoints")).all_steps() == [2]
    proc = in_process(commands.train, train_args(*args, f"run_dir={dirs[0]}"), capsys)
    assert proc.returncode == 0 and "resumed from checkpoint step 2" in proc.stdout, proc.stderr
    assert losses(dirs[0]) == losses(finished)
    resumed, uninterrupted = saved_state(dirs[0], 4), saved_state(finished, 4)
    for x, y in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
        assert np.array_equal(x, y)


READ_ONLY_AFTER = r"""
import os, runpy, sys, time
run_dir, *argv = sys.argv[1:]
from megatrain_jax import data
next_batch, calls = data.PackedDataset.next_batch, []
def hooked(self):  # before step 3: once checkpoint 2 is committed, checkpoints/ becomes read-only
    calls.append(1)
    if len(calls) == 3:
        while not os.path.isdir(os.path.join(run_dir, "checkpoints", "2")):
            time.sleep(0.01)
        os.chmod(os.path.join(run_dir, "checkpoints"), 0o555)
    return next_batch(self)
data.PackedDataset.next_batch = hooked
sys.argv = ["train.py", *argv]
runpy.run_path(os.path.join(os.getcwd(), "scripts", "train.py"), run_name="__main__")
"""


def unprivileged(cmd):
    """cmd without root's permission override (chmod means nothing to root), or None."""
    if os.geteuid() != 0:
        return cmd
    if not shutil.which("setpriv"):
        return None
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_checkpoints_made_read_only_mid_run_is_one_line_exit_1_no_hang(tmp_path, env, mode):
    run_dir = tmp_path / "run"
    cmd = unprivileged([sys.executable, "-c", READ_ONLY_AFTER, str(run_dir), "--config", TINY,
                        *FAST, "train.steps=5", "checkpoint.every=1", f"run_dir={run_dir}",
                        f"checkpoint.async={'true' if mode == 'async' else 'false'}"])
    if cmd is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    try:
        proc = run(cmd, env, timeout=120)  # it hung for minutes before: a timeout fails the test
        assert_one_error_line(proc, 1, "saving checkpoint step 3", "failed", "Permission denied",
                              "completed checkpoints: 1, 2")
    finally:
        os.chmod(run_dir / "checkpoints", 0o755)
    manager = checkpoint.make_manager(run_dir / "checkpoints")
    assert manager.all_steps() == [1, 2]
    assert checkpoint.read_meta(manager, 2)[0]["step"] == 2  # intact


def test_read_only_checkpoints_refused_before_training(copy_run, env):
    run_dir = copy_run()
    cmd = unprivileged(train_cmd(*FAST, "train.steps=6", "checkpoint.allow_changes=[train.steps]",
                                 "optimizer.learning_rate=2e-5", f"run_dir={run_dir}"))
    if cmd is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    before = files(run_dir)
    os.chmod(os.path.join(run_dir, "checkpoints"), 0o555)
    try:
        proc = run(cmd, env)
    finally:
        os.chmod(os.path.join(run_dir, "checkpoints"), 0o755)
    assert_one_error_line(proc, 2, f"checkpoint directory {run_dir}/checkpoints is not writable")
    assert "| loss" not in proc.stdout  # refused before training
    assert files(run_dir) == before


# ----------------------------------------------------------------------------- HF import


def fake_hf_dir(path, nan_in=None, **config_overrides):
    """A tiny Llama directory written with numpy (no torch): config.json + model.safetensors."""
    from safetensors.numpy import save_file
    cfg = ModelConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1)
    os.makedirs(path)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 257, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              **config_overrides}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(0)
    tensors = {name: (0.02 * rng.standard_normal(shape)).astype(np.float32)
               for name, shape, *_ in hf.all_tensors(cfg)}
    if nan_in:
        tensors[nan_in][3, 5] = np.nan
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def test_bad_hf_model_is_one_line_exit_2(tmp_path, env, capsys):
    fractional = fake_hf_dir(str(tmp_path / "frac"), num_hidden_layers=2.5)
    text = fake_hf_dir(str(tmp_path / "text"), hidden_size="64")
    nan = fake_hf_dir(str(tmp_path / "nan"), nan_in="model.layers.0.mlp.up_proj.weight")
    new_run = lambda name: str(tmp_path / name)
    args = [train_args(f"model.from_hf={d}", "data.seq_len=32", "data.batch_size=2",
                       "train.steps=1", f"run_dir={new_run(n)}", config=None)
            for d, n in [(fractional, "r1"), (text, "r2"), (nan, "r3")]]
    procs = [run([*train_cmd(config=None), *args[0]], env),  # one through the script
             *(in_process(commands.train, a, capsys) for a in args[1:])]
    assert_one_error_line(procs[0], 2, f"{fractional}/config.json: num_hidden_layers must be an "
                          f"integer, got 2.5")
    assert_one_error_line(procs[1], 2,
                          f'{text}/config.json: hidden_size must be an integer, got "64"')
    assert_one_error_line(procs[2], 2, f"{nan}/model.safetensors: tensor "
                          f"model.layers.0.mlp.up_proj.weight holds nan at index (3, 5)")
    for name in ("r1", "r2", "r3"):
        assert not os.path.exists(new_run(name))  # nothing written


# ----------------------------------------------------------------------------- export


def test_export_faults_are_one_line_exit_2_nothing_left_behind(copy_run, tmp_path, env, capsys):
    damaged, nan_run = copy_run("damaged"), copy_run("nan")
    data = os.path.join(damaged, "checkpoints", "4", "state", "ocdbt.process_0", "d")
    for name in os.listdir(data):
        os.truncate(os.path.join(data, name), 100)
    # A checkpoint holding a NaN weight, written with Orbax directly (checkpoint.save refuses it).
    manager = checkpoint.make_manager(os.path.join(nan_run, "checkpoints"))
    meta, _ = checkpoint.read_meta(manager, 4)
    state = saved_state(nan_run, 4)
    state["layers"][1]["params"]["wq"][0, 0, 0] = np.nan
    manager.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave({**meta, "step": 6})))
    manager.wait_until_finished()
    manager.close()
    (tmp_path / "a_file").write_text("a file where a directory should be")
    outs = tmp_path / "outs"
    outs.mkdir()
    procs = [run(export_cmd("--run-dir", damaged, "--out", str(outs / "damaged")), env),
             *(in_process(commands.export, args, capsys) for args in [
                 ["--run-dir", copy_run("good"), "--out", str(tmp_path / "a_file" / "out")],
                 ["--run-dir", nan_run, "--out", str(outs / "nan")]])]
    assert_one_error_line(procs[0], 2, "checkpoint step 4", "unreadable or damaged",
                          "export an older one with --step 2")
    assert_one_error_line(procs[1], 2, f"--out {tmp_path / 'a_file' / 'out'}: "
                          f"{tmp_path / 'a_file'} is not a directory")
    assert_one_error_line(procs[2], 2, "checkpoint step 6", "layers/1/params/wq",
                          "model.layers.1.self_attn.q_proj.weight", "NaN or inf",
                          "refusing to export")
    assert os.listdir(outs) == []  # no .export-* directory left, no output

    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    cmd = unprivileged(export_cmd("--run-dir", nan_run, "--step", "4", "--out",
                                  str(read_only / "out")))
    if cmd is not None:
        assert_one_error_line(run(cmd, env), 2, f"--out {read_only / 'out'}: cannot write in "
                              f"{read_only} (Permission denied)")
