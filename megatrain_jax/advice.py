"""Advice from what a run measured: what bounds its steps, and the config change that would help
most, with its predicted effect.

    before = dataclasses.replace(engine.counters)          # after the first (compiling) step
    ... two more steps ...
    measured = Measured.between(before, engine.counters, steps=2, step_s=mean_step_s,
                                memory=progress.device_memory(device))
    for line in advise(measured, machine=..., flops_per_step=..., micro_batches=...,
                       compute_dtype=..., plan_for=lambda m: (fits, device_peak)):
        print(line)

A step has three costs: device compute (grows with the tokens of a step), the weight and gradient
transfers over the bus (fixed per step: each layer's weights cross twice, its gradient once,
whatever the micro-batches), and the host's optimizer update (fixed per step; it overlaps the next
step's forward, and what it does not hide the step waits for: `Counters.host_wait_s`). Fixed costs
are hidden by more tokens per step, i.e. more micro-batches, as long as they fit in device memory.
A pure function of the numbers it is given: tests/test_advice.py feeds it hand-made counters.
Before a run, `plan` feeds it predicted ones (`for_plan`: the step-time model's simulated step and
the memory plan's device peak), so the advice before and after a run comes from one set of rules.
"""

import dataclasses
from typing import Callable

from megatrain_jax import plan as plan_lib
from megatrain_jax import progress
from megatrain_jax.flops import ASSUMED_MFU, flops_per_token
from megatrain_jax.machines import GB, Machine
from megatrain_jax.plan_report import format_bytes

HOST_BOUND = 0.25  # the step waits this share of its time for the host update or more
MAX_FACTOR = 64  # the most micro-batches advice multiplies by
# Settings that make the host's state and its update lighter, the largest saving first: AdamW's
# moments in bf16 (4 B/param less), the gradients the host receives in bf16 (2 B/param less).
LIGHTER = ("optimizer.state_dtype=bfloat16", "train.grad_dtype=bfloat16")


def lighter_settings(cfg) -> tuple:
    """The settings of LIGHTER that cfg does not make already."""
    made = lambda section, name, value: getattr(getattr(cfg, section), name) == value
    return tuple(s for s in LIGHTER if not made(*_setting(s)))


def _setting(setting: str) -> tuple:
    """(section, key, value) of "section.key=value"."""
    key, value = setting.split("=")
    return (*key.split("."), value)


def _with(cfg, setting: str):
    """cfg with `setting` ("section.key=value") made."""
    section, name, value = _setting(setting)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section),
                                                                    **{name: value})})


@dataclasses.dataclass(frozen=True)
class Measured:
    """Per step, over a few steps after the first (which compiles)."""
    step_s: float  # wall time of a step
    host_wait_s: float  # the step waited for host updates (the exposed part)
    host_update_s: float  # the host thread's time on updates
    bus_bytes: float  # weights to the device, gradients back
    device_peak_bytes: int | None = None  # device.memory_stats(); None on a CPU
    device_limit_bytes: int | None = None

    @classmethod
    def predicted(cls, prediction, device_peak_bytes: int, device_limit_bytes: int) -> "Measured":
        """What a run of the step_time `prediction` would measure, before it runs: the simulated
        step, the host update's share of its critical path as the wait, the host thread's busy
        time, the shape's bytes each way, and the memory plan's device peak."""
        return cls(step_s=prediction.step_s, host_wait_s=prediction.critical_s["host update"],
                   host_update_s=prediction.busy_s["host update"],
                   bus_bytes=prediction.shape.h2d_bytes + prediction.shape.d2h_bytes,
                   device_peak_bytes=device_peak_bytes, device_limit_bytes=device_limit_bytes)

    @classmethod
    def between(cls, before, after, *, steps: int, step_s: float, memory: dict) -> "Measured":
        """From two snapshots of engine.counters `steps` steps apart."""
        per = lambda name: (getattr(after, name) - getattr(before, name)) / steps
        return cls(step_s=step_s, host_wait_s=per("host_wait_s"),
                   host_update_s=per("host_update_s"),
                   bus_bytes=per("bytes_h2d") + per("bytes_d2h"),
                   device_peak_bytes=memory.get("device_peak_bytes"),
                   device_limit_bytes=memory.get("device_bytes_limit"))


def advise(m: Measured, *, machine: Machine, flops_per_step: float, micro_batches: int,
           compute_dtype: str = "bfloat16",
           plan_for: Callable[[int], tuple[bool, int]] | None = None,
           lighter: tuple = LIGHTER) -> list[str]:
    """One or two lines: what bounds the step (with the figures), then the change that would help
    most and its predicted effect. plan_for(micro_batches) -> (fits, predicted device peak bytes)
    says whether a larger data.micro_batches fits (the memory plan); `lighter`: the settings of
    LIGHTER the run has not made (lighter_settings)."""
    on_bus = not machine.compute_on_host and machine.host_device_gbps > 0
    transfers_s = m.bus_bytes / (machine.host_device_gbps * GB) if on_bus else 0.0
    device_s = max(m.step_s - m.host_wait_s, 0.0)
    if machine.bf16_tflops:  # at the assumed MFU, and never more than the device side took
        compute_s = min(flops_per_step / (machine.bf16_tflops * 1e12 * ASSUMED_MFU), device_s)
    else:  # what the transfers do not explain
        compute_s = max(device_s - transfers_s, 0.0)
    memory = ""
    if m.device_peak_bytes and m.device_limit_bytes:
        used = m.device_peak_bytes / m.device_limit_bytes
        memory = (f"; device memory {used:.0%} used (peak {format_bytes(m.device_peak_bytes)} of "
                  f"{format_bytes(m.device_limit_bytes)})")

    if m.host_wait_s >= HOST_BOUND * m.step_s:
        bound, fixed = "the host update", m.host_update_s
        why = (f"each step waits {m.host_wait_s:.3g} s of its {m.step_s:.3g} s for the optimizer "
               f"update on the host ({m.host_update_s:.3g} s of host time)")
    elif transfers_s > compute_s:
        bound, fixed = "transfers", transfers_s
        why = (f"{format_bytes(m.bus_bytes)} cross the bus per step, ~{transfers_s:.3g} s at "
               f"{machine.host_device_gbps:g} GB/s, against ~{compute_s:.3g} s of compute")
    else:
        bound, fixed = "device compute", 0.0
        why = f"~{compute_s:.3g} s of the {m.step_s:.3g} s step computes"
    lines = [f"advice: steps are bound by {bound}: {why}{memory}"]

    if bound == "device compute":
        if compute_dtype == "float32" and machine.platform == "gpu":
            lines.append("advice: train.compute_dtype=bfloat16 would compute at the tensor cores' "
                         "bf16 rate (several times float32's), at bf16's precision")
        elif m.device_peak_bytes and m.device_limit_bytes and (
                m.device_peak_bytes > 0.9 * m.device_limit_bytes):
            lines.append("advice: the device is nearly full: train.offload_activations=true or a "
                         "smaller train.tile_size leaves room for longer sequences")
        return lines

    # A fixed cost per step: more micro-batches add compute that hides it.
    overhead = max(m.step_s - compute_s, 0.0)  # what is not compute, now
    factor = 1
    while factor < MAX_FACTOR and factor * compute_s < fixed:
        factor *= 2
    while factor > 1 and plan_for is not None and not plan_for(micro_batches * factor)[0]:
        factor //= 2
    if factor == 1:
        lines.append(f"advice: data.micro_batches={2 * micro_batches} would hide it but does not "
                     f"fit; train.offload_activations=true makes room for more micro-batches"
                     if bound == "transfers" else
                     "advice: no larger data.micro_batches fits to hide it; the host update runs "
                     "at the host's memory bandwidth"
                     + (f" ({' or '.join(lighter)} moves less)" if lighter else ""))
        return lines
    new_step = m.step_s + max((factor - 1) * compute_s - overhead, 0.0)
    gain = factor * m.step_s / new_step
    fits = ""
    if plan_for is not None:
        fits = (f" (fits: a predicted device peak of "
                f"{format_bytes(plan_for(micro_batches * factor)[1])})")
    lines.append(f"advice: data.micro_batches={micro_batches * factor}{fits} "
                 f"{'hides' if factor * compute_s >= fixed else 'shrinks'} it: {factor}x the "
                 f"tokens per step for ~{new_step:.3g} s a step, up to {gain:.1f}x the tokens/s")
    return lines


def for_config(cfg, machine: Machine, measured: Measured) -> list[str]:
    """advise() for a run of cfg on `machine`, with a larger data.micro_batches checked with the
    memory plan (the micro-batch shape is unchanged, so the plan compiles nothing new)."""
    def plan_for(micro_batches):
        data = dataclasses.replace(cfg.data, micro_batches=micro_batches)
        p = plan_lib.plan(dataclasses.replace(cfg, data=data), machine)
        return p.fits, p.device_peak

    tokens = cfg.data.micro_batches * cfg.data.batch_size * cfg.data.seq_len
    return advise(measured, machine=machine, micro_batches=cfg.data.micro_batches,
                  flops_per_step=flops_per_token(cfg.model, cfg.data.seq_len) * tokens,
                  compute_dtype=cfg.train.compute_dtype, plan_for=plan_for,
                  lighter=lighter_settings(cfg))


def for_run(cfg, engine, machine: Machine, before, step_times: list) -> list[str]:
    """After the first steps of a run: engine.counters against the snapshot `before`, taken
    len(step_times) steps ago, and the device's memory."""
    return for_config(cfg, machine, Measured.between(
        before, engine.counters, steps=len(step_times), step_s=sum(step_times) / len(step_times),
        memory=progress.device_memory(engine.compute_device)))


def for_plan(cfg, machine: Machine, run_plan, prediction) -> list[str]:
    """Before a run: the same rules on predicted quantities, the step-time model's `prediction`
    (megatrain_jax.step_time) and the memory plan `run_plan`'s device peak. The bus and the
    device are taken at the prediction's rates (the device's as ASSUMED_MFU of a peak), so the
    advice explains the simulated step."""
    rates = prediction.rates
    at_rates = dataclasses.replace(machine, host_device_gbps=min(rates.h2d_gbps, rates.d2h_gbps),
                                   bf16_tflops=rates.device_tflops / ASSUMED_MFU)
    return _host_fit(cfg, machine, run_plan) + for_config(cfg, at_rates, Measured.predicted(
        prediction, run_plan.device_peak, int(machine.device_memory_gb * GB)))


def _host_fit(cfg, machine: Machine, run_plan) -> list[str]:
    """Where host RAM cannot hold the run: the settings of LIGHTER not yet made, taken one after
    another until the plan fits, and the host RAM they leave (each planned: a new gradient dtype
    compiles the workspaces again)."""
    have = machine.host_memory_gb * GB
    if run_plan.host_total <= have or not lighter_settings(cfg):
        return []
    made, p = [], run_plan
    for setting in lighter_settings(cfg):
        made.append(setting)
        cfg = _with(cfg, setting)
        p = plan_lib.plan(cfg, machine)
        if p.fits:
            break
    need = (f"advice: host RAM {format_bytes(run_plan.host_total)} > {format_bytes(have)}: "
            f"{' and '.join(made)}")
    if p.fits:
        return [f"{need} makes it fit (host RAM {format_bytes(p.host_total)}, device peak "
                f"{format_bytes(p.device_peak)})"]
    return [f"{need} leaves host RAM at {format_bytes(p.host_total)}, still over: "
            f"offload.tier=disk keeps the master weights and optimizer state on disk"]
