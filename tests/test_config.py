"""Config: optimizer.schedule (the learning rate at key steps of each schedule), its validation and
resume, the closest valid key suggested for an unknown one, and integers written with
underscores."""

import glob
import json
import math
import os

import numpy as np
import optax
import pytest

from megatrain_jax import commands
from megatrain_jax.config import (SCHEDULES, Config, ConfigError, DiskTierConfig,
                                  OptimizerConfig, RamTierConfig, from_dict, load_config,
                                  resume_changes, resume_keys, to_dict)
from megatrain_jax.recipes import build_optimizer, build_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, RATIO, WARMUP, STEPS = 2e-3, 0.1, 10, 100
END = LR * RATIO


def lr_at(schedule, steps, **opt):
    opt = {"learning_rate": LR, "warmup_steps": WARMUP, "min_lr_ratio": RATIO, **opt}
    fn = build_schedule(OptimizerConfig(schedule=schedule, **opt), STEPS)
    return [float(fn(t)) for t in steps]


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-12)


def test_defaults_are_todays_cosine():
    opt = OptimizerConfig()
    assert (opt.schedule, opt.decay_fraction) == ("cosine", 0.1)
    assert load_config("configs/tiny.yaml").optimizer.schedule == "cosine"
    assert SCHEDULES == ("cosine", "linear", "constant", "wsd")


def test_cosine_is_unchanged():
    """The schedule before optimizer.schedule existed, and its closed form."""
    steps = [0, 1, 5, WARMUP, 37, 55, 80, STEPS - 1, STEPS, STEPS + 20]
    before = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=LR, warmup_steps=WARMUP,
                                                decay_steps=STEPS, end_value=END)
    close(lr_at("cosine", steps), [float(before(t)) for t in steps])
    formula = [LR * t / WARMUP if t < WARMUP else
               END + (LR - END) * 0.5 * (1 + math.cos(math.pi * min(t - WARMUP, STEPS - WARMUP)
                                                      / (STEPS - WARMUP)))
               for t in steps]
    close(lr_at("cosine", steps), formula)
    middle = (WARMUP + STEPS) // 2  # halfway through the decay: halfway between peak and end
    close(lr_at("cosine", [middle]), [(LR + END) / 2])


def test_linear():
    middle = (WARMUP + STEPS) // 2
    close(lr_at("linear", [0, WARMUP // 2, WARMUP, middle, STEPS - 1, STEPS, STEPS + 5]),
          [0.0, LR / 2, LR, (LR + END) / 2, END + (LR - END) / (STEPS - WARMUP), END, END])


def test_constant():
    close(lr_at("constant", [0, WARMUP // 2, WARMUP, 50, STEPS - 1, STEPS, STEPS + 5]),
          [0.0, LR / 2, LR, LR, LR, LR, LR])
    close(lr_at("constant", [STEPS], min_lr_ratio=0.0), [LR])  # min_lr_ratio plays no part


def test_wsd():
    # decay_fraction 0.2 of 100 steps: constant to step 80, then linear to END at step 100.
    close(lr_at("wsd", [0, WARMUP // 2, WARMUP, 50, 79, 80, 90, STEPS - 1, STEPS, STEPS + 5],
                decay_fraction=0.2),
          [0.0, LR / 2, LR, LR, LR, LR, (LR + END) / 2, END + (LR - END) / 20, END, END])
    # The default fraction, 0.1: the decay starts at step 90.
    close(lr_at("wsd", [89, 90, 95, STEPS]), [LR, LR, (LR + END) / 2, END])
    # decay_fraction 1: the whole run after the warmup decays, as linear does.
    steps = list(range(0, STEPS + 3))
    close(lr_at("wsd", steps, decay_fraction=1.0), lr_at("linear", steps))


def test_short_runs():
    """The warmup is cut to steps - 1 (as cosine always did); wsd's decay never enters it and
    lasts at least one step."""
    one = lambda name, steps, **kw: [float(build_schedule(OptimizerConfig(
        schedule=name, learning_rate=1.0, warmup_steps=5, min_lr_ratio=0.5, **kw), steps)(t))
        for t in range(steps + 1)]
    for name in SCHEDULES:
        assert one(name, 1) == [1.0, 1.0 if name == "constant" else 0.5]
        values = one(name, 3)  # warmup cut to 2 steps
        close(values[:3], [0.0, 0.5, 1.0])
    close(one("wsd", 10, decay_fraction=0.01), [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0,
                                                0.5])
    close(one("wsd", 8, decay_fraction=0.9), [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.5 + 0.5 * 2 / 3,
                                              0.5 + 0.5 / 3, 0.5])
    close(one("linear", 6), [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.5])


def test_the_optimizer_uses_the_schedule():
    """adamw's first update (count 0) has learning rate 0; with constant and no warmup, the
    update of a zero-decay parameter is -learning_rate * sign(grad) on the first step."""
    opt = OptimizerConfig(schedule="constant", learning_rate=0.5, warmup_steps=0, weight_decay=0.0)
    tx = build_optimizer(opt, 10)
    params = {"w": np.zeros((2, 2), np.float32)}
    updates, _ = tx.update({"w": np.full((2, 2), 3.0, np.float32)}, tx.init(params), params)
    close(np.asarray(updates["w"]), np.full((2, 2), -0.5))


def test_overrides_and_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  schedule: wsd\n  decay_fraction: 0.25\n")
    opt = load_config(str(path)).optimizer
    assert (opt.schedule, opt.decay_fraction) == ("wsd", 0.25)
    assert load_config(None, ["optimizer.schedule=linear"]).optimizer.schedule == "linear"
    assert load_config(None, ["optimizer.decay_fraction=1"]).optimizer.decay_fraction == 1.0


@pytest.mark.parametrize("override,message", [
    ("optimizer.schedule=cosin", "optimizer.schedule must be one of cosine, linear, constant, wsd, "
                                 "got 'cosin' (did you mean cosine?)"),
    ("optimizer.schedule=step", "optimizer.schedule must be one of cosine, linear, constant, wsd, "
                                "got 'step'"),
    ("optimizer.schedule=1", "optimizer.schedule: expected str, got int 1"),
    ("optimizer.decay_fraction=0", "optimizer.decay_fraction must be in (0, 1], got 0.0"),
    ("optimizer.decay_fraction=1.5", "optimizer.decay_fraction must be in (0, 1], got 1.5"),
    ("optimizer.decay_fraction=-0.1", "optimizer.decay_fraction must be in (0, 1], got -0.1"),
    ("optimizer.decay_fraction=.nan", "optimizer.decay_fraction must be a finite number"),
])
def test_bad_schedule_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_host_lookup_is_true_false_or_auto():
    assert load_config("configs/tiny.yaml", ["train.host_lookup=false"]).train.host_lookup is False
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["train.host_lookup=maybe"])
    assert str(e.value) == "train.host_lookup must be true, false or auto, got 'maybe'"


def test_schedule_is_compared_on_resume_and_older_checkpoints_count_defaults():
    cfg = Config()
    assert {"optimizer.schedule", "optimizer.decay_fraction"} <= set(resume_keys(cfg))
    saved = json.loads(json.dumps(to_dict(cfg)))
    del saved["optimizer"]["schedule"], saved["optimizer"]["decay_fraction"]  # an older checkpoint
    assert resume_changes(saved, cfg) == []
    assert resume_changes(saved, load_config(None, ["optimizer.schedule=wsd"])) == [
        ("optimizer.schedule", "cosine", "wsd")]
    assert resume_changes(saved, load_config(None, ["optimizer.decay_fraction=0.2"])) == [
        ("optimizer.decay_fraction", 0.1, 0.2)]
    allowed = load_config(None, ["checkpoint.allow_changes=[optimizer.schedule]"])
    assert allowed.checkpoint.allow_changes == ("optimizer.schedule",)


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("overrides,message", [
    (["train.stepz=3"], "unknown config key: train.stepz (did you mean train.steps?)"),
    (["model.hidden_sise=64"], "unknown config key: model.hidden_sise (did you mean "
                               "model.hidden_size?)"),
    (["optimizer.learning_rat=1e-3"], "unknown config key: optimizer.learning_rat (did you mean "
                                      "optimizer.learning_rate?)"),
    (["trian.steps=3"], "unknown config key: trian (did you mean train?)"),
    (["checkpoint.asynch=false"], "unknown config key: checkpoint.asynch (did you mean "
                                  "checkpoint.async?)"),
    (["train.zzzz=1"], "unknown config key: train.zzzz"),
    (["checkpoint.allow_changes=[train.stepz]"],
     "checkpoint.allow_changes: unknown config key train.stepz (did you mean train.steps?)"),
    (["checkpoint.allow_changes=[optimiser]"],
     "checkpoint.allow_changes: unknown config key optimiser (did you mean optimizer?)"),
])
def test_unknown_key_suggests_the_closest(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


def test_unknown_key_in_a_file_suggests_the_closest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seq_length: 64\n")
    with pytest.raises(ConfigError, match=r"^unknown config key: data.seq_length \(did you mean "
                                          r"data.seq_len\?\)$"):
        load_config(str(path))


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.qqqqqqqq=1"])
    assert str(e.value) == "unknown config key: train.qqqqqqqq"


# ----------------------------------------------------------------------------- underscores


def test_integers_with_underscores_in_files_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 1_000\ndata:\n  seq_len: 2_048\n")
    cfg = load_config(str(path), ["checkpoint.every=1_00", "optimizer.warmup_steps=2_000"])
    assert (cfg.train.steps, cfg.data.seq_len, cfg.checkpoint.every,
            cfg.optimizer.warmup_steps) == (1000, 2048, 100, 2000)
    assert type(cfg.train.steps) is int
    assert load_config(None, ["optimizer.learning_rate=1_0.5"]).optimizer.learning_rate == 10.5
    # A string key keeps the text as written.
    assert load_config(None, ["run_dir=runs/1_000"]).run_dir == "runs/1_000"


def test_integers_are_yaml_1_2_not_octal_or_sexagesimal(tmp_path):
    # YAML 1.1 (PyYAML's default) reads 010 as octal 8 and 1:30 as 90: silently another number.
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 010\n  seed: 0x10\ncheckpoint:\n  every: 0o10\n")
    cfg = load_config(str(path), ["data.seq_len=064"])
    assert (cfg.train.steps, cfg.train.seed, cfg.checkpoint.every, cfg.data.seq_len) == (10, 16, 8, 64)
    with pytest.raises(ConfigError, match=r"train\.steps.*1:30"):
        load_config(None, ["train.steps=1:30"])


# ----------------------------------------------------------------------------- offload, a choice

DISK_KEYS = ("path", "read_ahead", "direct_io")


def flat(tree: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a to_dict tree."""
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else
                   {prefix + key: value})
    return out


@pytest.mark.parametrize("overrides,key", [
    (["offload.path=/nvme/tier"], "path"),  # offload.tier left at its default, ram
    (["offload.tier=ram", "offload.read_ahead=2"], "read_ahead"),
    (["offload.direct_io=false"], "direct_io"),
])
def test_a_disk_key_with_the_ram_tier_is_one_line_exit_2(tmp_path, capsys, overrides, key):
    message = (f"offload.{key} is a key of offload.tier=disk, and offload.tier is ram: set "
               f"offload.tier=disk or leave offload.{key} out")
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == message
    path = tmp_path / "c.yaml"  # the same in a file
    path.write_text("offload:\n" + "".join(f"  {o.split('.', 1)[1].replace('=', ': ')}\n"
                                           for o in overrides))
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert str(e.value) == message
    run_dir = tmp_path / "run"
    assert commands.train(["--config", str(path), f"run_dir={run_dir}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not run_dir.exists()


def test_a_config_saved_before_the_choice_is_accepted_by_config(tmp_path):
    """A config.yaml saved before offload became a choice (the ram tier with the disk keys at
    their defaults), given back to --config, loads: the defaults meant nothing and still don't."""
    path = tmp_path / "config.yaml"
    path.write_text("offload:\n  tier: ram\n  path: ''\n  read_ahead: 1\n  direct_io: auto\n")
    assert load_config(str(path)).offload == RamTierConfig()
    path.write_text("offload:\n  tier: ram\n  path: ''\n  read_ahead: 2\n")
    with pytest.raises(ConfigError, match="^offload.read_ahead is a key of offload.tier=disk"):
        load_config(str(path))


def test_the_disk_keys_belong_to_the_disk_tier():
    ram = load_config(None)
    assert ram.offload == RamTierConfig() and ram.offload.tier == "ram"
    assert not hasattr(ram.offload, "path")  # no dead keys: the ram tier has none of its own
    disk = load_config(None, ["offload.tier=disk", "offload.path=/nvme/t", "offload.read_ahead=3",
                              "offload.direct_io=false"])
    assert disk.offload == DiskTierConfig(path="/nvme/t", read_ahead=3, direct_io=False)
    assert (load_config(None, ["offload.tier=disk", "offload.path=/t"]).offload
            == DiskTierConfig(path="/t"))
    assert to_dict(ram)["offload"] == {"tier": "ram", "copies": "auto", "bus": "auto"}
    assert to_dict(disk)["offload"] == {"tier": "disk", "copies": "auto", "bus": "auto",
                                        "path": "/nvme/t", "read_ahead": 3, "direct_io": False}
    for cfg in (ram, disk):  # what a run saves (config.yaml, a checkpoint's meta) loads again
        assert from_dict(json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_a_config_saved_before_the_choice_loads_with_the_ram_tier():
    """A checkpoint's config written when every offload key was saved whatever the tier: the ram
    tier's disk keys, which meant nothing, are dropped; the disk tier's are read."""
    saved = json.loads(json.dumps(to_dict(Config())))
    saved["offload"] = {"tier": "ram", "path": "", "read_ahead": 1, "direct_io": "auto"}
    assert from_dict(saved) == Config()
    saved["offload"] = {"tier": "disk", "path": "/t", "read_ahead": 2, "direct_io": "auto"}
    assert from_dict(saved).offload == DiskTierConfig(path="/t", read_ahead=2)


def test_every_config_file_loads_to_the_values_it_had():
    """configs/*.yaml and the defaults give the values they had at 6cc7fd1, before offload became
    a choice (tests/configs_loaded_at_6cc7fd1.json: to_dict's values there, as JSON, flattened;
    regenerate it where a config changes on purpose). The ram tier's disk keys are gone, and they
    held the disk tier's defaults, which meant nothing there."""
    with open(os.path.join(ROOT, "tests", "configs_loaded_at_6cc7fd1.json")) as f:
        before = json.load(f)
    assert set(before) == {"defaults", *(os.path.relpath(p, ROOT) for p in
                                         glob.glob(os.path.join(ROOT, "configs", "*.yaml")))}
    for name, expected in before.items():
        cfg = Config() if name == "defaults" else load_config(os.path.join(ROOT, name))
        if expected["offload.tier"] == "ram":
            dead = {k: expected.pop(f"offload.{k}") for k in DISK_KEYS}
            assert dead == {k: getattr(DiskTierConfig(), k) for k in DISK_KEYS}
        loaded = flat(json.loads(json.dumps(to_dict(cfg))))
        assert loaded.pop("offload.copies") == "auto"  # a key of both tiers since, its default
        assert loaded.pop("offload.bus") == "auto"  # (as offload.copies)
        assert loaded.pop("optimizer.host_threads") is None  # added since, its default
        assert loaded == expected, name
