"""What a run shows: the figures of each step (FLOPs, MFU, ETA, smoothed loss), the plain lines,
the live display (rich's recording console), and metrics.jsonl keeping every field of every step."""

import dataclasses
import glob
import io
import json
import math
import os
import struct
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from rich.console import Console

from megatrain_jax import commands, flops, machines, progress
from megatrain_jax.config import load_config
from megatrain_jax.model import make_block, make_stages
from megatrain_jax.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.intermediate_size=48",
        "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=32", "data.batch_size=2",
        "data.micro_batches=2", "train.steps=4", "train.attention=xla", "checkpoint.async=false"]


def tiny_config(*overrides):
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                       [*FAST, f"data.path={ROOT}/megatrain_jax/texts/devils_dictionary.txt",
                        *overrides])


def test_flops_per_token_counts_the_matmuls_of_the_built_model():
    """6 per parameter of every matrix the model multiplies by (the built modules' own leaves:
    not the input embedding, a lookup; the head, tied or not, counts) plus causal attention
    over (T + 1) / 2 keys on average, and fewer with a sliding window."""
    cfg = tiny_config().model
    T = 32

    def matrices(module, skip=()):
        _, params, _ = nnx.split(nnx.eval_shape(module), nnx.Param, ...)
        return sum(int(np.prod(x.shape)) for path, x in nnx.to_flat_state(params)
                   if len(x.shape) >= 2 and not any(s in str(path) for s in skip))

    per_block = matrices(lambda: make_block(cfg, 0, 0))
    head = cfg.vocab_size * cfg.hidden_size
    assert not cfg.tie_embeddings
    assert matrices(lambda: make_stages(cfg, 0)) == 2 * head  # embedding table (a lookup), head
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_size * (T + 1) / 2
    norms = cfg.num_layers * 2 * cfg.hidden_size + cfg.hidden_size  # counted: < 1% here
    expected = 6 * (cfg.num_layers * per_block + head + norms) + attention
    assert flops.flops_per_token(cfg, T) == pytest.approx(expected, rel=1e-12)
    tied = tiny_config("model.tie_embeddings=true").model
    assert matrices(lambda: make_stages(tied, 0)) == head  # one table: multiplied once, as the head
    assert flops.flops_per_token(tied, T) == pytest.approx(expected, rel=1e-12)
    windowed = load_config(None, ["model.sliding_window=8"]).model
    full = load_config(None).model
    assert flops.visible_keys(windowed, 32) == (8 * 9 / 2 + 24 * 8) / 32
    assert flops.visible_keys(full, 32) == 33 / 2
    assert flops.flops_per_token(windowed, 32) < flops.flops_per_token(full, 32)
    # interleaved local and global layers (Gemma 3): each layer's own keys
    mixed = load_config(None, ["model.num_layers=2", "model.sliding_window=8",
                               "model.layer_types=[sliding_attention, full_attention]"]).model
    per_key = 12 * mixed.num_heads * mixed.head_size
    assert flops.flops_per_token(mixed, 32) - flops.flops_per_token(
        dataclasses.replace(mixed, layer_types=(), sliding_window=0), 32) == pytest.approx(
        per_key * (flops.visible_keys(mixed, 32) - 33 / 2))


def test_attention_flops_per_layer_and_summed_over_the_layer_types():
    """flops.attention_flops, which the MFU numerator, the tokens to hide the transfers and the
    step-time model's layer FLOPs share: 4 * heads * head_dim per key a query sees, a sliding
    layer's keys within its window, a full layer's all (T + 1) / 2, and over the model its layers'
    kinds summed; the FLOPs per token count it three times (forward, backward twice)."""
    mixed = load_config(None, ["model.num_layers=2", "model.sliding_window=8",
                               "model.layer_types=[sliding_attention, full_attention]"]).model
    per_key = 4 * mixed.num_heads * mixed.head_size
    sliding, full = (8 * 9 / 2 + 24 * 8) / 32, 33 / 2
    assert flops.attention_flops(mixed, 32, sliding=True) == per_key * sliding
    assert flops.attention_flops(mixed, 32, sliding=False) == per_key * full
    assert flops.attention_flops(mixed, 32) == per_key * (sliding + full)
    windowed = dataclasses.replace(mixed, layer_types=())  # every layer within the window
    assert flops.attention_flops(windowed, 32) == 2 * per_key * sliding
    matmul = (mixed.num_active_params(include_embeddings=False)
              + mixed.hidden_size * mixed.vocab_size)
    assert flops.flops_per_token(mixed, 32) == 6 * matmul + 3 * per_key * (sliding + full)


@pytest.mark.parametrize("kind,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("TPU v5 lite", 197.0), ("cpu", None), ("Tesla T4", None)])
def test_peak_by_device_kind(kind, tflops):
    assert machines.peak_bf16_tflops(kind) == tflops


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_meter_eta_smoothing_and_mfu():
    clock = Clock()
    meter = progress.Meter(total_steps=10, start_step=4, tokens_per_step=1000, flops_per_token=6e6,
                           peak_flops=1e12, clock=clock)
    clock.now += 30.0  # step 5 compiles
    first = meter.measure(5, 4.0, 30.0)
    assert first["tokens"] == 5000  # the run's, resumed at step 4
    assert first["loss_smooth"] == 4.0  # debiased: the first value is the loss itself
    assert first["elapsed_s"] == 30.0 and first["eta_s"] == 5 * 30.0
    assert first["mfu"] == pytest.approx(6e6 * 1000 / 30.0 / 1e12)
    clock.now += 2.0
    second = meter.measure(6, 2.0, 1.5)
    assert second["eta_s"] == 4 * 2.0  # the compiling step no longer counts
    assert second["loss_smooth"] == pytest.approx((0.9 * 0.1 * 4 + 0.1 * 2) / (0.9 * 0.1 + 0.1))
    assert second["mfu"] == pytest.approx(6e9 / 1.5 / 1e12)
    clock.now += 4.0
    third = meter.measure(7, math.nan, 1.0)  # a skipped step: not in the average
    assert third["loss_smooth"] == second["loss_smooth"]
    assert third["eta_s"] == 3 * 3.0 and third["elapsed_s"] == 36.0
    assert "host_rss_bytes" in third and third["host_rss_bytes"] > 10**7  # this process
    unknown = progress.Meter(total_steps=10, start_step=0, tokens_per_step=1, flops_per_token=1,
                             peak_flops=None, device=jax.devices()[0])
    out = unknown.measure(1, 1.0, 1.0)
    assert "mfu" not in out and "device_bytes_in_use" not in out  # a CPU reports neither


def test_line_and_status():
    record = {"step": 10, "loss": 3.75364, "grad_norm": 1.7612, "tokens_per_sec": 3367.2,
              "step_time_s": 0.6081, "lr": 0.003, "tokens": 20480, "loss_smooth": 3.912,
              "elapsed_s": 6.2, "eta_s": 85.0, "mfu": 0.3123, "device_bytes_in_use": 1.2e9,
              "device_peak_bytes": 3.4e9, "host_rss_bytes": 4.1e8}
    assert progress.line(record, total_steps=150) == (
        "step    10 | loss 3.7536 | grad norm 1.761 | 3,367 tok/s | 608 ms | smoothed 3.9120 | "
        "lr 3.00e-03 | MFU 31.2% | device 1.20 GB (peak 3.40) | RSS 0.41 GB | "
        "10/150, 0:06 elapsed, ETA 1:25")
    assert progress.status(record) == ("ETA 1:25 | loss 3.9120 | 3,367 tok/s | lr 3.00e-03 | "
                                       "MFU 31.2% | device 1.20 GB (peak 3.40) | RSS 0.41 GB")
    assert progress.format_duration(3 * 3600 + 62) == "3:01:02"
    assert progress.format_duration(math.inf) == "?"


FIELDS = {"step", "loss", "grad_norm", "tokens_per_sec", "step_time_s", "lr", "tokens",
          "loss_smooth", "elapsed_s", "eta_s", "mfu", "host_rss_bytes"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 4-step run on a terminal console, with evaluations at steps 2 and 4, TensorBoard and
    W&B (offline): {"dir", "lines", "console", "history", "records"}."""
    run_dir = tmp_path_factory.mktemp("run")
    console = Console(file=io.StringIO(), force_terminal=True, width=200, record=True)
    lines = []
    history = train(tiny_config(f"run_dir={run_dir}", "train.log_every=3",
                                "logging.peak_tflops=0.001", "data.eval_fraction=0.1",
                                "train.eval_every=2", "train.eval_batches=1", "logging.wandb=true",
                                "logging.wandb_mode=offline"),
                    log=lines.append, console=console)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "lines": lines, "console": console, "history": history,
            "records": records}


def test_metrics_keep_every_field_of_every_step(run):
    records = run["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["mfu"] == pytest.approx(flops.flops_per_token(tiny_config().model, 32) * 128
                                         / r["step_time_s"] / 1e9)
    assert [r["tokens"] for r in records] == [128, 256, 384, 512]
    assert records[0]["lr"] == 0.0 and records[-1]["lr"] > 0  # the warmup's first step
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert run["history"] == records


def test_plain_lines_every_log_every_steps(run):
    """The lines every log_every steps and at the last, with the display's fields."""
    lines, records = run["lines"], run["records"]
    steps = [x for x in lines if x.startswith("step ") and " | eval loss " not in x]
    assert [x[:10] for x in steps] == ["step     3", "step     4"]
    assert steps[-1] == progress.line(records[-1], total_steps=4)
    for field in ("| 4/4, ", " elapsed, ETA 0:00", "MFU ", "smoothed ", "RSS ", "tok/s", "lr "):
        assert field in steps[-1]
    assert [x for x in lines if x.startswith("model: ")][0].endswith(
        "| compute cpu | MFU against logging.peak_tflops=0.001")
    # after step 3 (the first compiles, the next two are measured): advice, once
    advice = [i for i, x in enumerate(lines) if x.startswith("advice: steps are bound by ")]
    assert len(advice) == 1
    assert lines.index(steps[0]) < advice[0] < lines.index(steps[1])  # after step 3's line


def test_live_display_on_a_terminal(run):
    shown = run["console"].export_text()
    assert "the first step compiles" in shown
    last = shown[shown.rindex("step 4/4"):]  # the display's last frame
    assert progress.status(run["records"][-1]) in last
    assert "ETA 0:00" in last and "MFU" in last and "tok/s" in last


def read_events(directory):
    """{tag: [(step, value)]} of every scalar in the TensorBoard event files of directory, read
    with the protobuf classes tensorboardX ships (TFRecord framing: length, its crc, the event,
    its crc)."""
    from tensorboardX.proto import event_pb2
    out = {}
    for name in sorted(os.listdir(directory)):
        data = (directory / name).read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_has_every_field(run):
    events = read_events(run["dir"] / "tb")
    records = run["records"]
    for field in FIELDS - {"step"}:
        assert [s for s, _ in events[f"train/{field}"]] == [1, 2, 3, 4]
        np.testing.assert_allclose([v for _, v in events[f"train/{field}"]],
                                   [r[field] for r in records], rtol=1e-6)  # float32 in the file
    assert [s for s, _ in events["eval/loss"]] == [2, 4]
    np.testing.assert_allclose([v for _, v in events["eval/loss"]],
                               [r["eval_loss"] for r in records if "eval_loss" in r], rtol=1e-6)
    assert "eval/ppl" in events
    assert any(x.startswith(f"tensorboard: {run['dir'] / 'tb'}") for x in run["lines"])


def read_wandb(path):
    """The records of a W&B transaction log (.wandb): a 7-byte header (":W&B", magic, version),
    then LevelDB-log blocks of 32 KiB of chunks (crc, length, type: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if (pos % 32768) + 7 > 32768:  # a block's tail too short for a chunk header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            pos += 32768 - pos % 32768
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def test_wandb_offline_has_the_config_and_every_step(run):
    (run_file,) = glob.glob(str(run["dir"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb(run_file)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [1, 2, 3, 4]
    for r in run["records"]:
        assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"], rel=1e-12)
        assert history[r["step"]].get("eval/loss") == (
            pytest.approx(r["eval_loss"]) if "eval_loss" in r else None)
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    assert config["model"].get("value", config["model"])["num_layers"] == 2
    assert (run["dir"] / "wandb_run_id").read_text().strip() in run_file


def test_the_command_line_shows_the_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a pipe, CI, nohup
    assert commands.terminal_console() is None

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdout", Terminal())
    assert isinstance(commands.terminal_console(), Console)


def test_bad_peak_is_one_line():
    with pytest.raises(Exception, match="logging.peak_tflops must be >= 0"):
        tiny_config("logging.peak_tflops=-1")


def test_missing_writer_packages(tmp_path, monkeypatch):
    """W&B asked for but not installed: one line, before anything is written; TensorBoard not
    installed: a log line, and the run goes on."""
    from megatrain_jax import metrics_log
    from megatrain_jax.config import ConfigError
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ConfigError, match=r"^logging.wandb=true needs the wandb package: pip "
                                          r"install 'megatrain-jax\[wandb\]'"):
        metrics_log.check(tiny_config("logging.wandb=true"))
    metrics_log.check(tiny_config())  # not asked: fine
    lines = []
    sinks = metrics_log.Sinks.open(tiny_config(f"run_dir={tmp_path}"), 0, lines.append)
    assert lines == ["tensorboard: not written (pip install 'megatrain-jax[tensorboard]' for "
                     "tensorboardX; logging.tensorboard=false hides this line)"]
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close()
    assert os.listdir(tmp_path) == []
