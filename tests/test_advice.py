"""Advice from a run's counters: which cost bounds the step, and the change that helps most, with
its predicted effect (the logic, on hand-made counters; no timing is taken here)."""

import dataclasses

import pytest

from megatrain_jax.advice import Measured, advise
from megatrain_jax.engine.stream import Counters
from megatrain_jax.flops import ASSUMED_MFU
from megatrain_jax.machines import MACHINES, Machine

H100 = MACHINES["h100"]  # 989 bf16 TFLOPS, 55 GB/s each way
CPU = Machine("local CPU", 32.0, 32.0, 0.0, 0.0, platform="cpu", compute_on_host=True)


def compute_flops(seconds, machine=H100):
    """The FLOPs the device computes in `seconds` at the assumed MFU."""
    return seconds * machine.bf16_tflops * 1e12 * ASSUMED_MFU


def fits_up_to(largest, peak_per_micro_batch=5e9):
    return lambda m: (m <= largest, m * peak_per_micro_batch)


def test_measured_is_per_step_between_two_snapshots():
    before = Counters(bytes_h2d=10, bytes_d2h=4, host_update_s=1.0, host_wait_s=0.5)
    after = Counters(bytes_h2d=210, bytes_d2h=104, host_update_s=2.0, host_wait_s=0.7)
    m = Measured.between(before, after, steps=2, step_s=0.3,
                         memory={"device_peak_bytes": 7, "device_bytes_limit": 10})
    assert m == Measured(step_s=0.3, host_wait_s=pytest.approx(0.1), host_update_s=0.5,
                         bus_bytes=150.0, device_peak_bytes=7, device_limit_bytes=10)
    assert Measured.between(before, after, steps=1, step_s=1, memory={}).device_peak_bytes is None


def test_transfer_bound_step_gets_the_micro_batches_that_hide_the_transfers():
    # 32 GB a step at 55 GB/s: 0.58 s of transfers against 0.1 s of compute
    m = Measured(step_s=1.0, host_wait_s=0.05, host_update_s=0.3, bus_bytes=32e9,
                 device_peak_bytes=int(20e9), device_limit_bytes=int(72e9))
    lines = advise(m, machine=H100, flops_per_step=compute_flops(0.1), micro_batches=1,
                   plan_for=fits_up_to(64))
    assert len(lines) == 2
    assert lines[0] == ("advice: steps are bound by transfers: 32.00 GB cross the bus per step, "
                        "~0.582 s at 55 GB/s, against ~0.1 s of compute; device memory 28% used "
                        "(peak 20.00 GB of 72.00 GB)")
    # 8 micro-batches: 0.8 s of compute hides 0.58 s of transfers (4 would give 0.4 s)
    assert lines[1] == ("advice: data.micro_batches=8 (fits: a predicted device peak of 40.00 GB) "
                        "hides it: 8x the tokens per step for ~1 s a step, up to 8.0x the tokens/s")
    # only 4 fit: the most that does, and it says the transfers are shrunk, not hidden
    four = advise(m, machine=H100, flops_per_step=compute_flops(0.1), micro_batches=1,
                  plan_for=fits_up_to(4))
    assert four[1].startswith("advice: data.micro_batches=4 (fits: a predicted device peak of "
                              "20.00 GB) shrinks it: 4x")
    # none fits: offloading activations is what makes room
    none = advise(m, machine=H100, flops_per_step=compute_flops(0.1), micro_batches=1,
                  plan_for=fits_up_to(1))
    assert none[1] == ("advice: data.micro_batches=2 would hide it but does not fit; "
                       "train.offload_activations=true makes room for more micro-batches")


def test_the_prediction_counts_what_the_extra_compute_cannot_hide():
    # compute 0.4 s, transfers 0.58 s, nothing else: 2 micro-batches add 0.4 s of compute of
    # which 0.18 s hide transfers; the step grows by 0.22 s
    m = Measured(step_s=0.6, host_wait_s=0.0, host_update_s=0.1, bus_bytes=32e9)
    lines = advise(m, machine=H100, flops_per_step=compute_flops(0.4), micro_batches=2,
                   plan_for=fits_up_to(8))
    assert lines[1].startswith("advice: data.micro_batches=4 (fits: a predicted device peak of "
                               "20.00 GB) hides it: 2x the tokens per step for ~0.8 s a step, "
                               "up to 1.5x the tokens/s")


def test_host_bound_step_on_a_cpu():
    # half of each step waits for the host update (0.8 s of host time); the device (the CPU)
    # computes 0.5 s: 2 micro-batches hide the update
    m = Measured(step_s=1.0, host_wait_s=0.5, host_update_s=0.8, bus_bytes=1e9)
    lines = advise(m, machine=CPU, flops_per_step=1e12, micro_batches=1, plan_for=fits_up_to(16))
    assert lines == [
        "advice: steps are bound by the host update: each step waits 0.5 s of its 1 s for the "
        "optimizer update on the host (0.8 s of host time)",
        "advice: data.micro_batches=2 (fits: a predicted device peak of 10.00 GB) hides it: 2x "
        "the tokens per step for ~1 s a step, up to 2.0x the tokens/s"]
    stuck = advise(m, machine=CPU, flops_per_step=1e12, micro_batches=1, plan_for=fits_up_to(1))
    assert stuck[1].startswith("advice: no larger data.micro_batches fits to hide it")


def test_compute_bound_steps():
    m = Measured(step_s=1.0, host_wait_s=0.01, host_update_s=0.3, bus_bytes=5e9,
                 device_peak_bytes=int(70e9), device_limit_bytes=int(72e9))
    lines = advise(m, machine=H100, flops_per_step=compute_flops(0.9), micro_batches=4,
                   compute_dtype="float32", plan_for=fits_up_to(64))
    assert lines[0].startswith("advice: steps are bound by device compute: ~0.9 s of the 1 s step "
                               "computes; device memory 97% used")
    assert lines[1].startswith("advice: train.compute_dtype=bfloat16 ")
    full = advise(m, machine=H100, flops_per_step=compute_flops(0.9), micro_batches=4)
    assert full[1].startswith("advice: the device is nearly full: train.offload_activations=true")
    roomy = dataclasses.replace(m, device_peak_bytes=int(10e9))
    assert len(advise(roomy, machine=H100, flops_per_step=compute_flops(0.9),
                      micro_batches=4)) == 1  # nothing to change
    # on a CPU nothing crosses a bus: what the host does not take is compute
    cpu = advise(Measured(step_s=0.2, host_wait_s=0.01, host_update_s=0.05, bus_bytes=1e9),
                 machine=CPU, flops_per_step=1e9, micro_batches=1)
    assert cpu == ["advice: steps are bound by device compute: ~0.19 s of the 0.2 s step computes"]


# ----------------------------------------------------------------------------- before a run


@pytest.fixture(scope="module")
def tiny_plan():
    """configs/tiny.yaml in bf16 planned for an H100 (the plan compiles the step's functions on
    the CPU for their workspaces: once)."""
    from megatrain_jax.config import load_config
    from megatrain_jax.plan import plan
    from megatrain_jax.step_time import step_shape
    cfg = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16"])
    run_plan = plan(cfg, H100)
    return cfg, run_plan, step_shape(cfg, run_plan.offload_activations)


def test_predicted_measurements_are_the_step_time_models(tiny_plan):
    from megatrain_jax.step_time import Rates, simulate
    cfg, run_plan, shape = tiny_plan
    prediction = simulate(shape, Rates(host_update_gbps=0.01))
    m = Measured.predicted(prediction, run_plan.device_peak, int(72e9))
    assert m.step_s == prediction.step_s
    assert m.host_wait_s == prediction.critical_s["host update"] > 0
    assert m.host_update_s == prediction.busy_s["host update"] >= m.host_wait_s
    assert m.bus_bytes == shape.h2d_bytes + shape.d2h_bytes
    assert (m.device_peak_bytes, m.device_limit_bytes) == (run_plan.device_peak, int(72e9))


@pytest.mark.parametrize("rates, bound", [
    (dict(h2d_gbps=0.001, d2h_gbps=0.001), "transfers"),  # a slow bus
    (dict(host_update_gbps=0.001), "the host update"),  # a slow host
    (dict(device_tflops=1e-4), "device compute"),  # a slow device
])
def test_plan_advice_names_the_bound_resource_of_the_predicted_step(tiny_plan, rates, bound):
    """The same rules as after step 3 (advise), on the step-time model's step: the resource the
    rates make slow bounds it, and a fixed cost per step gets the micro-batches that hide it,
    checked with the memory plan."""
    from megatrain_jax.advice import for_plan
    from megatrain_jax.step_time import Rates, simulate
    cfg, run_plan, shape = tiny_plan
    prediction = simulate(shape, Rates(**rates))
    lines = for_plan(cfg, H100, run_plan, prediction)
    assert lines[0].startswith(f"advice: steps are bound by {bound}: ")
    if bound == "transfers":
        assert f"{(shape.h2d_bytes + shape.d2h_bytes) / 1e6:.2f} MB cross the bus" in lines[0]
        assert "at 0.001 GB/s" in lines[0]
    if bound == "device compute":
        assert len(lines) == 1  # bf16, the device far from full: nothing to change
    else:
        assert lines[1].startswith("advice: data.micro_batches=")
        assert "(fits: a predicted device peak of " in lines[1]


def test_plan_without_a_step_time_model_says_the_run_advises(tiny_plan):
    """A machine with no known peak (a CPU): no prediction to advise from. (`megatrain plan`
    printing the advice: tests/test_commands.py.)"""
    import argparse

    from megatrain_jax import commands
    flags = argparse.Namespace(device_tflops=None, rates=None)
    assert commands.plan_advice(tiny_plan[0], CPU, None, flags) == [
        "advice: none before the run: local CPU has no known peak for the step-time model "
        "(--tflops, --rates); the run advises after its first steps"]


def test_a_plan_over_host_ram_gets_the_setting_that_makes_it_fit_never_one_already_set(tiny_plan):
    """configs/dense_120b.yaml on an H200 with 1.5 TB: the advice suggested
    train.grad_dtype=bfloat16, which the config sets, and never optimizer.state_dtype=bfloat16,
    which makes it fit. The tiny config in its place (bf16 gradients set), on a host between
    what it needs with fp32 moments and with bf16 ones; the 120B config's own figures:
    tests/test_plan.py."""
    import dataclasses

    from megatrain_jax.advice import for_plan
    from megatrain_jax.config import load_config
    from megatrain_jax.machines import GB
    from megatrain_jax.plan import plan
    from megatrain_jax.plan_report import format_bytes
    from megatrain_jax.step_time import Rates, simulate
    cfg = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16",
                                            "train.grad_dtype=bfloat16"])
    bf16_moments = load_config("configs/tiny.yaml", ["train.compute_dtype=bfloat16",
                                                     "train.grad_dtype=bfloat16",
                                                     "optimizer.state_dtype=bfloat16"])
    need, less = plan(cfg, H100).host_total, plan(bf16_moments, H100).host_total
    assert less < need
    machine = dataclasses.replace(H100, host_memory_gb=(need + less) / 2 / GB)
    run_plan, fixed = plan(cfg, machine), plan(bf16_moments, machine)  # (a ring of bus copies)
    assert not run_plan.fits and fixed.fits
    shape = tiny_plan[2]
    lines = for_plan(cfg, machine, run_plan, simulate(shape, Rates(host_update_gbps=0.001)))
    assert lines[0] == (f"advice: host RAM {format_bytes(run_plan.host_total)} > "
                        f"{format_bytes(machine.host_memory_gb * GB)}: "
                        f"optimizer.state_dtype=bfloat16 makes it fit (host RAM "
                        f"{format_bytes(fixed.host_total)}, device peak "
                        f"{format_bytes(fixed.device_peak)})")
    assert not any("train.grad_dtype=bfloat16" in line for line in lines), lines
    # the host update's advice names only what is not set yet
    m = Measured(step_s=1.0, host_wait_s=0.5, host_update_s=0.8, bus_bytes=1e9)
    stuck = lambda **kw: advise(m, machine=CPU, flops_per_step=1e12, micro_batches=1,
                                plan_for=fits_up_to(1), **kw)[1]
    assert stuck().endswith("memory bandwidth (optimizer.state_dtype=bfloat16 or "
                            "train.grad_dtype=bfloat16 moves less)")
    assert stuck(lighter=("optimizer.state_dtype=bfloat16",)).endswith(
        "memory bandwidth (optimizer.state_dtype=bfloat16 moves less)")
    assert stuck(lighter=()).endswith("runs at the host's memory bandwidth")
