"""Config: optimizer.schedule (the learning rate at key steps of each schedule), its validation and
resume, the closest valid key suggested for an unknown one, and integers written with
underscores."""

import json
import math

import numpy as np
import optax
import pytest

from megatrain_jax.config import (SCHEDULES, Config, ConfigError, OptimizerConfig, load_config,
                                  resume_changes, resume_keys, to_dict)
from megatrain_jax.recipes import build_optimizer, build_schedule

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
