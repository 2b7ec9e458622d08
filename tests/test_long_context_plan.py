"""The plan at long sequences with the block tiled over the sequence (issue 25): the largest
sequence it reports is the compiled boundary (a length that fits, and one 2% longer that does
not, both planned with their own compiled workspaces), and its report says what offloaded
activations take of host RAM, where they could go, and which workspace figure it uses."""

import dataclasses
import math

import pytest

from megatrain_jax.config import Config, DataConfig, OptimizerConfig, TrainConfig
from megatrain_jax.model import ModelConfig
from megatrain_jax.machines import Machine, machine_from_device
from megatrain_jax.plan import LARGEST_SEQ_TOLERANCE, plan

MODEL = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2)
# a GPU-like machine planned on the CPU: workspaces compiled by XLA:CPU as a bf16 estimate. Its
# 6 MB make the largest sequence ~5 times the planned one: long enough for the 64-token quantum
# to be finer than the 2% tolerance (about 100 tokens there), near enough for the first guess (a
# linear fit) to land within a step of it, so the search compiles at few lengths.
MACHINE = Machine("small GPU", device_memory_gb=0.006, host_memory_gb=1.0, bf16_tflops=1.0,
                  host_device_gbps=10.0)
BLOCK = 64


def config(seq: int) -> Config:
    return Config(model=MODEL, optimizer=OptimizerConfig(),
                  data=DataConfig(seq_len=seq, batch_size=1, micro_batches=1),
                  train=TrainConfig(steps=4, compute_dtype="bfloat16", grad_dtype="bfloat16",
                                    offload_activations=True, attention="blockwise",
                                    attention_block=BLOCK, tile_size=4 * BLOCK, loss_chunk=256))


@pytest.fixture(scope="module")
def planned():
    """The plan at 1,024 tokens, made once: its search for the largest sequence compiles at
    every length it tries, and the report shows what it found."""
    return plan(config(1024), MACHINE)


def test_largest_seq_is_the_compiled_boundary_within_2_percent(planned):
    largest = planned.largest_seq_len
    assert largest > 1024
    assert plan(config(largest), MACHINE).fits
    longer = math.ceil(largest * (1 + LARGEST_SEQ_TOLERANCE) / BLOCK) * BLOCK
    assert not plan(config(longer), MACHINE).fits, (largest, longer)


def test_report_names_the_activations_host_ram_and_the_workspace_figures(planned):
    p = planned
    report = p.report()
    acts = p.host["activations"]
    assert acts == MODEL.num_layers * 1024 * MODEL.hidden_size * 2  # bf16 inputs of each layer
    assert "offloaded activations: " in report and "stay in host RAM either way" in report
    assert "XLA:CPU as compiled / bf16 estimate" in report
    # the plan's figures are the estimate; XLA:CPU's own (hoisting fp32 copies) is no smaller
    for phase, estimate in p.workspace.items():
        assert estimate <= p.workspace_cpu_compiled[phase], phase
    assert p.to_dict()["workspace_cpu_compiled"] == p.workspace_cpu_compiled


def test_the_plan_counts_the_measured_blocks_score_buffers(monkeypatch):
    """train.attention_block 0 takes the fastest block measured on the platform that divides the
    tile (attention.MEASURED); the plan compiles the step's functions with it, so its workspace
    holds that block's scores: at 2,048 a block pair's (B, N, S, S) fp32 scores take 16 times
    those of 512, and the backward's workspace grows by at least one of them."""
    from megatrain_jax import attention
    seq, tile = 8192, 4096

    def planned(measured):
        monkeypatch.setitem(attention.MEASURED, "cpu", measured)
        cfg = config(seq)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, attention_block=0, tile_size=tile))
        return plan(cfg, machine_from_device())

    small = planned({})
    big = planned({"blockwise/512": 2.0, "blockwise/2048": 1.0})
    assert (small.execution.attention_block, big.execution.attention_block) == (512, 2048)
    assert "(blocks of 2048)" in big.attention_runs
    scores = lambda block: 1 * MODEL.num_heads * block * block * 4
    grown = big.workspace["backward"] - small.workspace["backward"]
    assert grown >= scores(2048) - scores(512), (grown, scores(2048))


def test_a_faster_attention_that_does_not_fit_gives_way_to_the_next(monkeypatch):
    """Where the block is tiled and train.attention is auto, the plan takes the fastest measured
    candidate that fits the device: cuDNN over the whole sequence holds the sequence's q, k, v
    (and their gradients) where the per-tile forms hold a tile's, so on a device between the two
    peaks the untiled form gives way, the plan says why, and the engine is built with what the
    plan chose (train() passes plan.execution). Asked for by name (cudnn), nothing gives way."""
    from megatrain_jax import attention
    monkeypatch.setitem(attention.MEASURED, "gpu", {"untiled": 1.0, "merged": 2.0,
                                                    f"blockwise/{BLOCK}": 3.0})
    cfg = config(2048)
    auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attention="auto"))
    roomy = dataclasses.replace(MACHINE, device_memory_gb=10.0)
    fastest = plan(auto, roomy)
    assert fastest.execution.tiled == "untiled" and fastest.fits
    monkeypatch.setitem(attention.MEASURED, "gpu", {"merged": 2.0, f"blockwise/{BLOCK}": 3.0})
    tiled = plan(auto, roomy)
    monkeypatch.setitem(attention.MEASURED, "gpu", {"untiled": 1.0, "merged": 2.0,
                                                    f"blockwise/{BLOCK}": 3.0})
    assert tiled.execution.tiled != "untiled" and tiled.device_peak < fastest.device_peak
    between = dataclasses.replace(MACHINE, device_memory_gb=(
        tiled.device_peak + fastest.device_peak) / 2 / 1e9)
    chosen = plan(auto, between)
    assert chosen.fits and chosen.execution == tiled.execution
    assert "untiled does not fit (device peak" in chosen.attention_reason
    asked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, attention="cudnn"))
    refused = plan(asked, between)
    assert refused.execution.tiled == "untiled" and not refused.fits


def test_train_builds_the_engine_with_the_plans_attention(tmp_path, monkeypatch):
    """train() hands the plan's execution (its attention: the fastest that fits) to the engine,
    so the run computes what the plan planned."""
    import os
    from megatrain_jax import train as train_lib
    from megatrain_jax.recipes import load_config
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "tiny.yaml"), [
        f"run_dir={tmp_path}", f"data.path={root}/megatrain_jax/texts/devils_dictionary.txt"])
    planned, built = [], []
    real_plan = train_lib.plan_lib.plan
    monkeypatch.setattr(train_lib.plan_lib, "plan",
                        lambda *a: planned.append(real_plan(*a)) or planned[-1])

    def build(cfg, **kwargs):
        built.append(kwargs)
        raise KeyboardInterrupt  # stops the run here: nothing else to check

    monkeypatch.setattr(train_lib, "build_engine", build)
    with pytest.raises(KeyboardInterrupt):
        train_lib.train(cfg, log=lambda line: None)
    assert built[0]["execution"] is planned[-1].execution
