"""The disk tier (engine/tier.py): training with the state in files equals training with it in RAM,
bit for bit; checkpoints go through it unit by unit; its directory is never silently reused."""

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_engine import CFG, DEVICE_SETUPS, batches, make_engine
from test_host_optim import open_files

from megatrain_jax import checkpoint
from megatrain_jax import plan as plan_lib
from megatrain_jax.machines import machine_from_device
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.cli import run_cli
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.engine.tier import DiskTier, DiskTierOptions, TierError, UnitLayout
from megatrain_jax.train import train

STEPS = 5
SMALL = dataclasses.replace(CFG, num_layers=2)


def run_steps(engine, data):
    out = [engine.train_step(inputs, targets) for inputs, targets in data]
    return [float(o["loss"]) for o in out], [float(o["grad_norm"]) for o in out]


def numpy_state(engine):
    return jax.tree.map(np.array, engine.state())


def assert_bit_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(leaves_a) > 10
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), leaves_b):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)


def refuses_direct_io(path) -> str:
    """Why the filesystem of `path` (a directory) refuses O_DIRECT, or "" where it allows it."""
    name = os.path.join(path, "probe")
    try:
        os.close(os.open(name, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return ""
    except (OSError, AttributeError) as e:
        return f"{path} refuses O_DIRECT ({e})"
    finally:
        if os.path.exists(name):
            os.remove(name)


def opened_direct(tier) -> bool:
    import fcntl
    return all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in tier.fds)


@pytest.mark.parametrize("num_micro,max_grad_norm,read_ahead,direct_io",
                         [(1, None, 2, "true"), (2, 0.5, 1, "false")],
                         ids=["plain_direct", "micro2_clip_buffered"])
def test_disk_tier_equals_ram_tier_bit_for_bit(tmp_path, num_micro, max_grad_norm, read_ahead,
                                               direct_io):
    if direct_io == "true" and refuses_direct_io(tmp_path):
        pytest.skip(refuses_direct_io(tmp_path))
    data = batches(num_micro, batch=4 // num_micro)[:STEPS]
    devices = DEVICE_SETUPS["two_devices"]()
    ram = make_engine(SMALL, devices, max_grad_norm)
    ram_losses, norms = run_steps(ram, data)
    ram_state = numpy_state(ram)
    ram.close()
    disk = make_engine(SMALL, devices, max_grad_norm, disk_tier=DiskTierOptions(
        str(tmp_path / "tier"), read_ahead=read_ahead, direct_io=direct_io))
    assert all(u.params is None and u.opt_state is None for u in disk.host.units)  # not in RAM
    tier = disk.disk_tier
    assert opened_direct(tier) == (direct_io == "true")  # the disk moves the bytes, not the cache
    disk_losses, _ = run_steps(disk, data)
    assert disk_losses == ram_losses
    assert_bit_equal(numpy_state(disk), ram_state)
    assert tier.bytes_read >= STEPS * tier.total_bytes  # every unit came from its file each step
    # The layers' buffers are bounded by read_ahead: reads ahead, writes behind and the one
    # the unit being updated aliases, no more.
    assert tier.buffers[tier.layouts[1].nbytes] <= read_ahead + max(1, read_ahead) + 1
    if max_grad_norm is not None:  # clipping must have been active for this test to mean much
        assert max(norms) > max_grad_norm
    disk.close()


def test_loading_a_unit_right_after_a_step_waits_for_every_update(tmp_path):
    """load_unit straight after train_step, layer 1's read slowed and its update delayed (so its
    update is still running): the tier's files are flushed on the calling thread only once no
    update is running, and the state is that of the same calls with wait() first."""
    data = batches(1, batch=2)[:2]
    devices = DEVICE_SETUPS["two_devices"]()

    def load_after_step(name, wait_first):
        engine = make_engine(SMALL, devices, None,
                             disk_tier=DiskTierOptions(str(tmp_path / name)))
        run_steps(engine, data[:1])
        saved = numpy_state(engine)["layers"][0]
        tier, units = engine.disk_tier, engine.host.units
        read, flush, running = tier._read, tier.flush, []
        tier._read = lambda u: (time.sleep(0.5) if u == 2 else None, read(u))[1]
        engine.on_event = lambda kind, what, layer: (
            time.sleep(0.3) if kind == "update" and layer == 1 else None)
        tier.flush = lambda: (running.append(
            any(u.pending is not None and not u.pending.done() for u in units)), flush())
        engine.train_step(*data[1])
        if wait_first:
            engine.wait()
        engine.load_unit(0, saved)
        state = numpy_state(engine)
        engine.close()
        return state, running

    state, running = load_after_step("tier", wait_first=False)
    assert running and not any(running), running
    assert_bit_equal(state, load_after_step("reference", wait_first=True)[0])


# ---------------------------------------------------------------- checkpoints through the tier
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = 4
FAST = ["model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "train.compute_dtype=float32",
        f"train.steps={TRAIN_STEPS}", "checkpoint.every=2", "checkpoint.keep=10",
        "logging.tensorboard=false"]


def make_cfg(run_dir, *extra):
    return load_config(os.path.join(ROOT, "configs/tiny.yaml"), [*FAST, f"run_dir={run_dir}", *extra])


def disk(tmp_path, name="tier"):
    return ["offload.tier=disk", f"offload.path={tmp_path / name}"]


def saved_state(run_dir, step):
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"))
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    manager.close()
    return jax.tree.map(np.asarray, state)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def resumed_from_step_2(source, run_dir, *extra):
    """A copy of `source` without its last checkpoint, resumed to the end with `extra`."""
    shutil.copytree(source, run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", str(TRAIN_STEPS)))
    train(make_cfg(run_dir, *extra), log=lambda *_: None)
    return saved_state(run_dir, TRAIN_STEPS)


@pytest.fixture(scope="module")
def ram_run(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("ram_run"))
    train(make_cfg(run_dir), log=lambda *_: None)
    return run_dir


def test_checkpoints_move_between_tiers_bit_exact(tmp_path, ram_run):
    final = saved_state(ram_run, TRAIN_STEPS)
    # A whole run on the disk tier saves the RAM tier's checkpoints, bit for bit.
    disk_run = str(tmp_path / "disk_run")
    lines = []
    train(make_cfg(disk_run, *disk(tmp_path)), log=lines.append)
    assert any(line.startswith("disk tier: ") for line in lines)
    assert losses(disk_run) == losses(ram_run)
    # The plan's disk bytes are the engine's files, less the 4 KiB alignment of each leaf.
    manifest = json.load(open(tmp_path / "tier" / "tier.json"))
    cfg = make_cfg(disk_run, *disk(tmp_path))
    planned = plan_lib.plan(cfg, machine_from_device(jax.devices()[0])).disk_bytes
    assert planned <= manifest["bytes"] <= planned + 4096 * len(jax.tree.leaves(final))
    for step in (2, TRAIN_STEPS):
        assert_bit_equal(saved_state(disk_run, step), saved_state(ram_run, step))
    # A RAM-tier checkpoint resumes onto the disk tier, and a disk-tier one back onto RAM.
    assert_bit_equal(resumed_from_step_2(ram_run, str(tmp_path / "to_disk"),
                                         *disk(tmp_path, "tier2")), final)
    assert_bit_equal(resumed_from_step_2(disk_run, str(tmp_path / "to_ram")), final)


def test_a_run_that_raises_closes_the_engine_and_its_tier(tmp_path):
    """An error once the engine and the checkpoint manager are made (here from the log, at the
    run's start line): the run closes both on the way out, the disk tier's files included."""
    def log(line):
        if line.startswith("disk tier: "):
            raise RuntimeError("stopped at the start line")

    with pytest.raises(RuntimeError, match="stopped at the start line"):
        train(make_cfg(str(tmp_path / "run"), *disk(tmp_path)), log=log)
    assert os.path.exists(tmp_path / "tier" / "unit_00000.bin")
    assert not [f for f in open_files() if f.startswith(str(tmp_path / "tier"))]


@pytest.fixture
def refusing_path(tmp_path, monkeypatch):
    """A directory whose filesystem refuses O_DIRECT: /dev/shm where it is a tmpfs that does
    (before Linux 6.6), else one where opening with O_DIRECT is made to fail as such ones do."""
    if os.path.isdir("/dev/shm") and refuses_direct_io("/dev/shm"):
        path = os.path.join("/dev/shm", f"megatrain_test_{os.getpid()}_{tmp_path.name}")
        yield path
        shutil.rmtree(path, ignore_errors=True)
        return

    def refuse(name):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), name)
    monkeypatch.setattr(tier_lib, "open_direct", refuse)
    yield str(tmp_path / "refusing")


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_once(tmp_path, ram_run,
                                                                     refusing_path):
    # auto: the run goes on buffered, bit-exact, and its log says so in one line.
    lines = []
    run_dir = str(tmp_path / "resumed")
    shutil.copytree(ram_run, run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", str(TRAIN_STEPS)))
    cfg = make_cfg(run_dir, "offload.tier=disk", f"offload.path={refusing_path}")
    train(cfg, log=lines.append)
    assert_bit_equal(saved_state(run_dir, TRAIN_STEPS), saved_state(ram_run, TRAIN_STEPS))
    said = [line for line in lines if "refuses O_DIRECT" in line]
    assert len(said) == 1 and said[0].startswith("disk tier: ") and "buffered" in said[0]
    # true: refused with one line naming the key, before any file of the tier is written.
    with pytest.raises(TierError, match="offload.path .*: O_DIRECT refused .*direct_io=auto"):
        DiskTier(DiskTierOptions(refusing_path + "/t", run="r", direct_io="true"), layouts())
    assert os.listdir(refusing_path + "/t") == []


# ---------------------------------------------------------------- the directory: scratch, owned
def layouts(width=8, layers=2):
    """The layouts of a toy model: stages and `layers` blocks, params and an Adam-like state."""
    unit = lambda n: ({"w": np.zeros((n, width), np.float32)},
                      ({"mu": np.zeros((n, width), np.float32)}, np.zeros((), np.int32)))
    return [UnitLayout.of(*unit(16))] + [UnitLayout.of(*unit(4))] * layers


def test_another_runs_tier_is_refused_this_runs_rebuilt(tmp_path):
    path = str(tmp_path / "tier")
    first = DiskTier(DiskTierOptions(path, run="runs/a", model="m1"), layouts())
    assert first.opened == "new"
    first.close()
    manifest = json.load(open(os.path.join(path, "tier.json")))
    assert manifest["run"] == "runs/a" and manifest["model"] == "m1" and manifest["units"] == 3
    with pytest.raises(TierError, match="holds the disk tier of another run \\('runs/a'"):
        DiskTier(DiskTierOptions(path, run="runs/b", model="m1"), layouts())
    # The same run after a crash: the files are scratch, rewritten from the engine's state.
    again = DiskTier(DiskTierOptions(path, run="runs/a", model="m1"), layouts())
    assert again.opened == "this run's files, rewritten"
    again.close()
    # The same run with another model (fewer, wider layers): rebuilt, the extra file removed.
    other = DiskTier(DiskTierOptions(path, run="runs/a", model="m2"), layouts(width=16, layers=1))
    assert other.opened == "this run's files of another model ('m1'), rebuilt"
    assert sorted(os.listdir(path)) == ["tier.json", "unit_00000.bin", "unit_00001.bin"]
    assert os.path.getsize(os.path.join(path, "unit_00001.bin")) == other.layouts[1].nbytes
    other.close()


@pytest.mark.parametrize("setup,message", [
    (lambda p: open(p, "w").close(), " is not a directory"),
    (lambda p: (os.makedirs(p), open(os.path.join(p, "notes.txt"), "w").close()),
     " is not empty and holds no tier.json \\(e.g. notes.txt\\)"),
    (lambda p: (os.makedirs(p), open(os.path.join(p, "tier.json"), "w").write("{")),
     ": .*tier.json is not a disk tier's manifest"),
], ids=["file", "foreign_files", "torn_manifest"])
def test_a_directory_that_is_not_a_tier_is_refused(tmp_path, setup, message):
    path = str(tmp_path / "tier")
    setup(path)
    before = sorted(os.listdir(path)) if os.path.isdir(path) else None
    with pytest.raises(TierError, match=f"offload.path {path}{message}"):
        DiskTier(DiskTierOptions(path, run="r"), layouts())
    assert (sorted(os.listdir(path)) if os.path.isdir(path) else None) == before  # untouched


def test_too_little_free_space_is_refused_naming_the_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tier_lib, "free_bytes", lambda path: 10_000)
    path = tmp_path / "tier"
    need = sum(layout.nbytes for layout in layouts())
    with pytest.raises(TierError, match=f"needs {need / 1e9:.2f} GB more and the disk has 0.00 GB"):
        DiskTier(DiskTierOptions(str(path), run="r"), layouts())
    assert not os.path.exists(path / "unit_00000.bin")
    # Through the command line: one line, exit 2, before any step.
    monkeypatch.setattr(tier_lib, "free_bytes", lambda path: 1000)
    run_dir = tmp_path / "run"
    assert run_cli(lambda: train(make_cfg(run_dir, *disk(tmp_path)))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: offload.path {tmp_path / 'tier'}: the disk "
                                               f"tier needs ") and "GB free" in err[0]
    assert not os.path.exists(run_dir)


def test_an_unwritable_path_is_one_line_and_nothing_written(tmp_path, capsys):
    # Root may write anywhere permission bits allow; /sys refuses even root a new file.
    path = "/sys/megatrain_tier"
    if os.path.exists(path) or not os.path.isdir("/sys"):
        pytest.skip("needs /sys (Linux)")
    try:
        tier_lib.check_writable(path)
        pytest.skip("/sys is writable here")
    except TierError:
        pass
    run_dir = tmp_path / "run"
    assert run_cli(lambda: train(make_cfg(run_dir, "offload.tier=disk",
                                          f"offload.path={path}"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: offload.path {path} is not writable (Permission denied)"]
    assert not os.path.exists(run_dir) and not os.path.exists(path)
    with pytest.raises(TierError, match=f"offload.path {path} is not writable"):
        DiskTier(DiskTierOptions(path, run="r"), layouts())


@pytest.mark.parametrize("damage,message", [
    (lambda f: os.truncate(f, 100), "was truncated to 100 of"), (os.remove, "was deleted")])
def test_a_tier_file_damaged_mid_run_is_one_line_naming_it(tmp_path, capsys, damage, message):
    engine = make_engine(SMALL, DEVICE_SETUPS["two_devices"](), None,
                         disk_tier=DiskTierOptions(str(tmp_path / "tier")))
    (inputs, targets), = batches(1, batch=2)[:1]
    engine.train_step(inputs, targets)
    engine.wait()
    damage(engine.disk_tier.files[2])
    assert run_cli(lambda: (engine.train_step(inputs, targets), engine.wait())) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"disk tier file {engine.disk_tier.files[2]} {message}" in err[0]
    assert "resume from its last checkpoint" in err[0]


def test_plan_reports_the_disk_tier(tmp_path):
    # Deep enough for the units in flight to be fewer than the units (a 2-layer model's are not)
    cfg = make_cfg(tmp_path / "run", *disk(tmp_path), "model.num_layers=16", "offload.read_ahead=1")
    machine = machine_from_device(jax.devices()[0])
    p = plan_lib.plan(cfg, machine)
    assert p.tier == "disk" and p.host["master"] == p.host["optimizer"] == 0
    assert p.host_by_tier["disk"] == p.host_total < p.host_by_tier["ram"]
    assert p.tier_line().startswith("offload.tier=disk: host RAM ")  # a line of report()
    # With the ram tier (no disk keys of its own) the disk figure is the disk tier's at its default
    ram = plan_lib.plan(make_cfg(tmp_path / "run", "model.num_layers=16"), machine)
    assert ram.tier == "ram" and ram.host_by_tier == p.host_by_tier


def test_bench_disk_tier_smoke(tmp_path):
    """scripts/bench_disk_tier.py end to end on a toy model: both tiers train alike (the script
    asserts equal losses), and every figure is there and positive."""
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_disk_tier.py"),
                           "--smoke", "--path", str(tmp_path / "disk"), "--json", str(out)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = ("ram", "disk_direct_auto", "disk_direct_false")  # a line each
    assert all(f"{name}: " in done.stdout for name in names)
    result = json.load(open(out))
    assert result["disk"]["read_gbps"] > 0 and result["disk"]["write_gbps"] > 0
    assert len(result["disk"]["loadavg_after"]) == 3 and result["disk"]["filesystem"]
    runs = result["runs"]
    ram, direct, buffered = runs["ram"], runs["disk_direct_auto"], runs["disk_direct_false"]
    assert buffered["io_mode"].startswith("buffered") and direct["io_mode"] != buffered["io_mode"]
    for disk in (direct, buffered):
        assert ram["loss"] == disk["loss"] and ram["params"] == disk["params"]
        assert disk["tier_bytes"] >= 12 * disk["params"]  # fp32 master, Adam's mu and nu
        assert disk["read_ratio"] > 0 and disk["write_ratio"] > 0 and disk["tier_read_s"] > 0
    assert all(r["step_s"] > 0 and r["steady_peak_rss_bytes"] > 0 for r in runs.values())


@pytest.mark.parametrize("overrides,message", [
    (["offload.tier=disk"], "offload.tier=disk needs offload.path"),
    (["offload.tier=dsk"], "offload.tier must be one of ram, disk, got 'dsk' (did you mean disk?)"),
    (["offload.read_ahead=-1"], "offload.read_ahead must be >= 0, got -1"),
    (["offload.direct_io=maybe"], "offload.direct_io must be true, false or auto, got 'maybe'")])
def test_bad_offload_keys_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        make_cfg(tmp_path, *overrides)
    assert str(e.value) == message or str(e.value).startswith(message)
