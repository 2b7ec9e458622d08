"""Memory and bandwidth plan of a run, made before anything is allocated.

    p = plan(load_config("configs/llama3_8b.yaml"), MACHINES["h100"])
    print(p.report())          # host RAM by kind, device memory by phase and kind, what fits

For a config and a machine the plan predicts the host RAM the engine holds (by kind), the device
peak of every phase of a step (by kind), whether both fit, whether activations must be offloaded
(`train.offload_activations: auto`), the largest micro-batch and sequence that fit, the largest
model of the config's width (its most layers), and how many tokens a step needs for compute to
hide the weight transfers.

Its parts: the machines and their peaks (megatrain_jax.machines), the units' parameter counts and
FLOPs (flops), the bytes held at each moment of the engine's step and each phase's compiled
workspace (memory_model), and the result with its text (plan_report). This module makes the
choices: the workspaces' compiler, activation offloading, the largest shapes that fit.
"""

import dataclasses
import functools
from typing import Callable


from megatrain_jax.config import Config, ConfigError, DiskTierConfig
from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.flops import (ASSUMED_MFU, Counts, counts, devices_assumed, flops_per_token,
                                  host_lookup_off, local_devices, tokens_to_hide, with_layers)
from megatrain_jax.machines import GB, Machine
from megatrain_jax.memory_model import (compile_device, device_bytes, fits, host_bytes,
                                        host_bytes_on_disk, peak_bytes, pinned_bytes,
                                        workspace_bytes)
from megatrain_jax.model import Execution
from megatrain_jax.plan_report import MOST_LAYERS, Plan, format_bytes

LARGEST_SEQ_TOLERANCE = 0.02


def plan(cfg: Config, machine: Machine) -> Plan:
    """The plan of `cfg` on `machine`. Compiles the step's five device functions for the
    configured micro-batch shape (seconds for an 8B model on a CPU); allocates nothing.

    Its attention is the rule's (attention.choose_attention) where that fits; where the block is
    tiled and train.attention is auto, a faster candidate that does not fit the device (cuDNN over
    the whole sequence holds the sequence's q, k, v) gives way to the next, so a sequence that
    fits tiled is never refused for the speed of a form that does not."""
    from megatrain_jax.recipes import execution_for  # the engine's own: lazy, train imports us

    execution, choice = execution_for(cfg, machine.platform)
    result, excluded, why = _plan(cfg, machine, execution, choice), (), ""
    tiled = 0 < execution.tile_size < cfg.data.seq_len
    while (tiled and cfg.train.attention == "auto" and choice.tiled in ("untiled", "merged")
           and result.device_peak > machine.device_memory_gb * GB):
        excluded += (choice.tiled,)
        why += (f"; {choice.tiled} does not fit (device peak {format_bytes(result.device_peak)} "
                f"of {format_bytes(machine.device_memory_gb * GB)})")
        execution, choice = execution_for(cfg, machine.platform, exclude=excluded)
        choice = dataclasses.replace(choice, reason=choice.reason + why)
        result = _plan(cfg, machine, execution, choice)
    return result


def _plan(cfg: Config, machine: Machine, execution: Execution, choice) -> Plan:
    """The plan of `cfg` on `machine` with this execution (attention.Choice `choice` says why)."""
    from megatrain_jax.recipes import build_optimizer, host_lookup_setting

    device = compile_device(machine.platform)
    compiled, notes = _compiled_execution(execution, device, machine)
    c = counts(cfg, compiled, machine, optimizer=build_optimizer(cfg.optimizer, cfg.train.steps),
               lookup_setting=host_lookup_setting(cfg))
    M, B, T = cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len
    temps = functools.partial(workspace_bytes, cfg.model, compiled, cfg.train.compute_dtype,
                              cfg.train.grad_dtype, document_mask=cfg.data.document_mask,
                              device=device, hoisting=device.platform == machine.platform,
                              micro_batches=M, flat=bool(c.layer_flat))
    workspace = temps(B, T)
    estimated = device.platform != machine.platform  # compiled by the CPU for a GPU
    cpu_compiled = functools.partial(temps, B, T, hoisting=True) if estimated else dict
    offload, offload_reason, options = _offload(cfg, c, workspace, machine)
    device = device_bytes(c, B * T, offload, workspace)
    c, bus_reason, bus_forms = _bus_form(cfg, c, machine, B * T, offload, peak_bytes(device))
    # the ram tier: the disk tier's default
    read_ahead = getattr(cfg.offload, "read_ahead", DiskTierConfig.read_ahead)
    host_by_tier = {"ram": host_bytes(c, B * T, offload),
                    "disk": host_bytes_on_disk(c, B * T, offload, read_ahead)}
    host = host_by_tier[cfg.offload.tier]
    notes += _pinned_pool_notes(pinned_bytes(c, B * T, host), machine)
    if c.bus == bus_lib.RING:
        notes.append(f"the layers' bus copies are a ring of {bus_lib.ring_size(c.prefetch)} "
                     f"buffers (offload.bus=ring), each cast from the fp32 master on the host "
                     f"before its fetch (6 B/param of host memory traffic a fetch, two fetches a "
                     f"step); the stages' are resident")
    notes += [n for n in [devices_assumed(cfg, machine)] if n]
    lookup_off = host_lookup_off(c, B * T)
    notes.append(f"the first stage runs on the device ({lookup_off})" if lookup_off else
                 "the first stage runs on the host (the host lookup, engine/lookup.py: its rows "
                 "cross, not its weights, and their gradient comes back); unit 0's bus copy "
                 "stays in host memory")
    disk_bytes = 4 * c.params + c.optimizer
    return Plan(host=host, device=device, bus=c.bus, bus_reason=bus_reason,
                offload_activations=offload, offload_reason=offload_reason,
                attention=execution.attention, attention_reason=choice.reason,
                attention_runs=execution.attention_at(T), attention_notice=choice.notice,
                execution=execution, machine=machine, workspace=workspace, micro_batch=(M, B, T),
                tokens_to_hide_transfers=tokens_to_hide(cfg.model, c, T, machine, offload),
                notes=tuple(notes), counts=c, tier=cfg.offload.tier,
                _largest=_largest_search(cfg, machine, c, temps, workspace, options,
                                         execution.attention_block, bus_forms),
                host_by_tier={k: sum(v.values()) for k, v in host_by_tier.items()},
                disk_bytes=disk_bytes,
                disk_gbps_to_hide=_disk_gbps_to_hide(cfg, machine, disk_bytes),
                _cpu_compiled=cpu_compiled)


def plan_sweep(cfgs: list, machine: Machine) -> list:
    """The plans of configs that differ in data.seq_len only (a sweep). Their largest sequence is
    one search (the same config at every length): made for the first and shared."""
    plans = [plan(cfg, machine) for cfg in cfgs]
    for p in plans[1:]:
        p.__dict__["largest_seq_len"] = plans[0].largest_seq_len  # the cached_property's value
    return plans


def _compiled_execution(execution: Execution, device, machine: Machine) -> tuple[Execution, list]:
    """The execution whose functions `device` compiles for the workspaces, and the notes on what
    stands in for what."""
    notes, compiled = [], execution
    if execution.attention == "cudnn" and device.platform != "gpu":
        # the same flash algorithm, memory linear in T: per query tile where cuDNN's calls are
        # merged per tile, over the whole sequence where cuDNN runs untiled
        tiled = "untiled" if execution.tiled == "untiled" else "blockwise"
        compiled = dataclasses.replace(execution, attention="blockwise", tile_attention=tiled)
        where = "over the whole sequence" if tiled == "untiled" else "per query tile"
        notes.append(f"cuDNN attention cannot compile on {device.platform}: blockwise attention "
                     f"stands in for its workspace ({where} where the block is tiled, in blocks "
                     f"of {execution.attention_block}; the same flash algorithm, memory linear "
                     f"in T)")
    if device.platform != machine.platform:
        notes.append(f"workspaces compiled by XLA:{device.platform.upper()}, which computes bf16 "
                     f"math in fp32: an estimate of the {machine.platform.upper()}'s (plan on the "
                     f"machine itself, --device local, for its compiler's own figures)")
    return compiled, notes


def _offload(cfg: Config, c: Counts, workspace: dict, machine: Machine) -> tuple[bool, str, list]:
    """(whether activations are offloaded, why, the choices the searches for the largest shape
    may make)."""
    requested = cfg.train.offload_activations
    if requested == "auto":
        without = peak_bytes(device_bytes(c, cfg.data.batch_size * cfg.data.seq_len, False,
                                          workspace))
        # on a CPU-only run the "device" is the host's RAM: offloading would gain nothing
        offload = without > machine.device_memory_gb * GB and not machine.compute_on_host
        reason = (f"auto: without, the device peak would be {format_bytes(without)}"
                  if offload else "auto: the device holds them")
    else:
        offload, reason = requested, "requested"
    options = [False, True] if requested == "auto" and not machine.compute_on_host else [offload]
    return offload, reason, options


def _pinned_pool_notes(pinned: int, machine: Machine) -> list:
    """A note where the bus copies and offloaded activations (`pinned` bytes) outgrow XLA's
    pinned host pool (bus.pinned_pool_bytes: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, else its
    default)."""
    pool = bus_lib.pinned_pool_bytes()
    if machine.platform != "gpu" or pinned <= pool:
        return []
    return [bus_lib.pool_line("the bus copies and offloaded activations take", pinned, pool)]


def _bus_form(cfg: Config, c: Counts, machine: Machine, tokens: int, offload: bool,
              device_peak: int) -> tuple:
    """(c with offload.bus resolved, why, the forms the searches for the largest shape may take)
    (engine/bus.py's choose_form: auto takes the ring where resident bus copies leave host RAM
    or XLA's pinned pool short and the ring fits the pool). An asked-for ring that cannot run, or
    that the pool cannot hold: one ConfigError line."""
    setting = cfg.offload.bus
    devices = (local_devices(cfg, machine) or 1) * cfg.distributed.num_processes
    why_not = bus_lib.why_not_ring(c.compute == 4 and machine.compute_on_host,
                                   cfg.offload.tier == "disk", devices > 1)
    resident, ring = (dataclasses.replace(c, bus=form) for form in bus_lib.FORMS[1:])
    if why_not:
        if setting == bus_lib.RING:
            raise ConfigError(f"offload.bus='ring' cannot run: {why_not}")
        return resident, (f"auto: the ring cannot run ({why_not})" if setting == "auto"
                          else "asked for"), [bus_lib.RESIDENT]
    held = lambda counts: host_bytes(counts, tokens, offload)
    total = sum(held(resident).values()) + (device_peak if machine.compute_on_host else 0)
    short = "" if total <= machine.host_memory_gb * GB else (
        f"with resident bus copies host RAM would be {format_bytes(total)} > "
        f"{format_bytes(machine.host_memory_gb * GB)}")
    try:
        form, why = bus_lib.choose_form(
            setting, resident_pinned=pinned_bytes(resident, tokens, held(resident)),
            ring_pinned=pinned_bytes(ring, tokens, held(ring)),
            pool=bus_lib.pinned_pool_bytes() if machine.platform == "gpu" else None,
            host_short=short)
    except ValueError as e:
        raise ConfigError(f"offload.{e}") from None
    forms = list(bus_lib.FORMS[1:]) if setting == "auto" else [form]
    return dataclasses.replace(c, bus=form), why, forms


def _disk_gbps_to_hide(cfg: Config, machine: Machine, disk_bytes: int) -> float:
    """The disk tier's reads + writes per second that a step's compute at ASSUMED_MFU hides
    (every unit read and written once per step); 0 where the machine has no known peak."""
    M, B, T = cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len
    compute_s = (flops_per_token(cfg.model, T) * M * B * T
                 / (machine.bf16_tflops * 1e12 * ASSUMED_MFU)) if machine.bf16_tflops else 0
    return 2 * disk_bytes / compute_s / GB if compute_s else 0.0


# -----------------------------------------------------------------------------
# the largest shapes that fit


def _largest_search(cfg: Config, machine: Machine, c: Counts, temps: Callable, workspace: dict,
                    options: list, quantum: int, bus_forms: list) -> Callable[[str], int]:
    """largest(axis): the largest batch_size (axis "batch"), seq_len ("seq"), num_layers
    ("layers") or micro_batches ("micro") that fits, everything else as configured, offload as
    `options` allow. The arrays the plan counts are linear in a micro-batch's tokens and in the
    micro-batches (a call holds them all, stacked: their workspaces fitted from one more compile,
    at 2M, as linear in M). For the batch, a workspace is fitted
    from one more compile, (2B, T), as linear in B: batch rows compute alike. For the sequence,
    one compile at (B, 4T) fits it as linear in T (blockwise attention, tiles, loss chunks) for a
    first guess, and the search compiles at each length it tries from there (_largest_compiled),
    to within LARGEST_SEQ_TOLERANCE of the shortest length that does not fit. For the layers,
    nothing is compiled: every layer is one block shape, so the workspaces stay and the counts
    follow (flops.with_layers). `temps(batch, seq)`: the phases' workspaces; `workspace`: theirs
    at the configured shape; `bus_forms`: the offload.bus forms a shape may take (both with
    auto: the ring where resident bus copies do not fit)."""
    B, T = cfg.data.batch_size, cfg.data.seq_len
    host_of = host_bytes if cfg.offload.tier == "ram" else functools.partial(
        host_bytes_on_disk, read_ahead=cfg.offload.read_ahead)

    def fits_at(b, t, workspace, c=c):
        def fits_with(offload):
            host = min(sum(host_of(dataclasses.replace(c, bus=form), b * t, offload).values())
                       for form in bus_forms)
            # the host alone over: no need to walk the device's schedule (a layer at a time)
            return host <= machine.host_memory_gb * GB and fits(
                host, peak_bytes(device_bytes(c, b * t, offload, workspace)), machine)
        return any(map(fits_with, options))

    def largest(axis: str) -> int:
        if axis == "layers":
            return _largest_int(lambda n: fits_at(B, T, workspace, with_layers(c, n)),
                                most=MOST_LAYERS)
        if axis == "micro":  # every call holds all of them: workspaces fitted as linear in M
            M = c.micro_batches
            w2 = temps(B, T, micro_batches=2 * M)
            return _largest_int(lambda m: fits_at(B, T, {
                phase: max(0, workspace[phase] + (m - M) * (w2[phase] - workspace[phase]) / M)
                for phase in workspace}, dataclasses.replace(c, micro_batches=m)))
        if axis == "seq":
            w4 = temps(B, 4 * T)  # the guess: workspaces linear in T
            guess = _largest_int(lambda t: fits_at(B, t, {
                phase: max(0, workspace[phase] + (t - T) * (w4[phase] - workspace[phase]) / (3 * T))
                for phase in workspace}))
            return _largest_compiled(lambda t: fits_at(B, t, temps(B, t)), quantum, guess)
        w1, w2 = workspace, temps(2 * B, T)
        return _largest_int(lambda b: fits_at(b, T, {
            phase: max(0, w1[phase] + (b - B) * (w2[phase] - w1[phase]) / B)
            for phase in workspace}))

    return largest


def _largest_int(ok: Callable[[int], bool], most: int = 2**40) -> int:
    """The largest n in 1..most with ok(n) (ok monotone: true up to some n), or 0."""
    if not ok(1):
        return 0
    lo, hi = 1, min(2, most)
    while lo < hi and ok(hi):
        lo, hi = hi, min(2 * hi, most)
    if lo == hi:  # `most` fits
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _largest_compiled(ok: Callable[[int], bool], quantum: int, guess: int) -> int:
    """The largest multiple n of quantum with ok(n) (monotone; each call compiles), found to
    within LARGEST_SEQ_TOLERANCE: bracketed from `guess` by steps of that tolerance, doubled each
    time, then bisected until a length that fits and one that does not are that close (or one
    quantum apart). Where one quantum does not fit, the same below it in halved quanta (a length
    under one attention block still trains); 0 if not even one token fits."""
    down = lambda n: max(quantum, n // quantum * quantum)
    lo = hi = down(guess)
    step = LARGEST_SEQ_TOLERANCE
    if ok(lo):
        while hi == lo and lo < 2**40:
            up = max(lo + quantum, down(int(lo * (1 + step))))
            lo, hi = (up, up) if ok(up) else (lo, up)
            step *= 2
    else:
        while lo == hi:
            if hi == quantum:  # not one quantum: compiled only where the search comes down to it
                return _largest_compiled(ok, quantum // 2, quantum // 2) if quantum > 1 else 0
            below = down(int(hi / (1 + step)))
            lo, hi = (below, hi) if ok(below) else (below, below)
            step *= 2
    while hi - lo > quantum and hi > lo * (1 + LARGEST_SEQ_TOLERANCE):
        mid = down((lo + hi) // 2)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
