"""A memory plan's figures and their text: `Plan` (what megatrain_jax.plan.plan returns), its
one-line verdict, the two lines a run logs (`summary`), the whole report as tables (`report`),
the largest model of the config's width that fits (`largest_model_line`) and plain data for
JSON (`to_dict`)."""

import dataclasses
import functools
from typing import Callable

import numpy as np

from megatrain_jax.flops import ASSUMED_MFU, Counts, host_lookup, with_layers
from megatrain_jax.machines import GB, Machine
from megatrain_jax.memory_model import DEVICE_KINDS, PHASES, fits
from megatrain_jax.model import Execution

_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))
# The deepest model the search for the largest one tries: far deeper than models are built (each
# depth tried walks the device's schedule, engine/schedule.py, once: time linear in the depth)
MOST_LAYERS = 1024


def _unit(n: float) -> tuple[str, float]:
    return next((u, s) for u, s in _UNITS if abs(n) >= s or s == 1)


def format_bytes(n: float) -> str:
    unit, size = _unit(n)
    return f"{n / size:.2f} {unit}"


def format_params(n: int) -> str:
    """A parameter count: 118.71B, 93.40M, 36.99k, 12."""
    unit, size = next(((u, s) for u, s in (("B", 1e9), ("M", 1e6), ("k", 1e3)) if n >= s),
                      ("", 1))
    return f"{n / size:.2f}{unit}" if size > 1 else f"{n}"


def layer_line(c: Counts) -> str:
    """What one layer streams: its weights (every expert of a MoE layer), and what a token
    computes with (the routed experts: the FLOPs of tokens_to_hide_transfers)."""
    active = ("" if c.active_layer == c.layer else
              f"; {c.active_layer / 1e6:,.2f}M active per token (routed experts)")
    return (f"per layer: {c.layer / 1e6:,.2f}M parameters, "
            f"{format_bytes(c.layer * c.compute)} over the bus per pass{active}")


@dataclasses.dataclass
class Plan:
    """A config's predicted memory on a machine, in bytes: `host[kind]`, `device[phase][kind]` (at
    the phase's peak), `workspace[phase]` (the compiled temp bytes of the phase's function, part of
    `device`). `largest_batch`, `largest_seq_len` and `largest_micro_batches` are worked out on
    first use: they compile the step's functions at more shapes (see megatrain_jax.plan's
    search); `largest_num_layers` too, from the counts alone (no compile)."""
    host: dict
    device: dict
    offload_activations: bool  # resolved
    offload_reason: str
    bus: str  # offload.bus resolved: "resident" or "ring" (engine/bus.py)
    bus_reason: str
    attention: str  # the resolved implementation over a whole sequence
    attention_reason: str
    attention_runs: str  # what attends, forward and backward, at this step's sequence length
    attention_notice: str  # one line where train.attention asked for what cannot run here, or ""
    execution: Execution  # the model's, as the engine will run it
    machine: Machine
    workspace: dict
    micro_batch: tuple  # (micro-batches, batch, seq_len)
    tokens_to_hide_transfers: int  # 0: nothing crosses a bus; -1: no number of tokens does it
    notes: tuple  # what the figures rest on, where it matters
    counts: Counts = dataclasses.field(repr=False, compare=False)  # parameter counts per unit
    _largest: Callable = dataclasses.field(repr=False, compare=False)
    # offload.tier, and what each tier takes: host RAM (bytes, {"ram": .., "disk": ..}), the disk
    # tier's files, and the disk read + write GB/s a step needs to hide them under its compute
    # (every unit read and written once per step, at ASSUMED_MFU; 0 where unknown)
    tier: str = "ram"
    host_by_tier: dict = dataclasses.field(default_factory=dict)
    disk_bytes: int = 0
    disk_gbps_to_hide: float = 0.0
    # () -> phase -> XLA:CPU's temp bytes as it compiles by default (its fp32 copies of bf16
    # operands hoisted out of loops), beside `workspace`, the bf16 estimate the plan uses
    # (memory_model's hoisting pass); {} where the workspaces were compiled for the device itself
    _cpu_compiled: Callable = dataclasses.field(default=dict, repr=False, compare=False)

    @functools.cached_property
    def workspace_cpu_compiled(self) -> dict:
        """Compiled on first use (five more compiles)."""
        return self._cpu_compiled()

    @functools.cached_property
    def largest_batch(self) -> int:
        return self._largest("batch")

    @functools.cached_property
    def largest_seq_len(self) -> int:
        return self._largest("seq")

    @functools.cached_property
    def largest_micro_batches(self) -> int:
        """The most micro-batches (data.micro_batches) that fit, the rest as configured: each of
        the step's calls holds every micro-batch's inputs and outputs (0: not one)."""
        return self._largest("micro")

    @functools.cached_property
    def largest_num_layers(self) -> int:
        """The most layers that fit (model.num_layers), every other key as configured: the
        depth of the largest model of this width, up to MOST_LAYERS. 0 if one layer does not
        fit."""
        return self._largest("layers")

    @property
    def largest_model(self) -> dict:
        """The largest model of the config's width that fits: its num_layers and parameters."""
        layers = self.largest_num_layers
        params = with_layers(self.counts, layers).params if layers else 0
        return {"num_layers": layers, "params": params, "hidden_size": self.counts.hidden,
                "most_layers_tried": MOST_LAYERS}

    @property
    def params(self) -> int:
        """The model's parameters: the denominator of host_bytes_per_param."""
        return self.counts.params

    @property
    def host_bytes_per_param(self) -> dict:
        """Kind -> host bytes a parameter of the model, at the step's peak (`host`: what the
        step holds at its end). With distributed.shard_optimizer, this process's share."""
        return {kind: v / self.params for kind, v in self.host.items()}

    @property
    def host_total_bytes_per_param(self) -> float:
        return self.host_total / self.params

    @property
    def tokens_per_step(self) -> int:
        return int(np.prod(self.micro_batch))

    @property
    def host_lookup(self) -> bool:
        """Whether the engine runs the first stage on the host (engine/lookup.py), as the plan
        counts it."""
        _, B, T = self.micro_batch
        return host_lookup(self.counts, B * T)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def peak_phase(self) -> str:
        return max(self.device, key=lambda phase: sum(self.device[phase].values()))

    @property
    def device_peak(self) -> int:
        return sum(self.device[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        return fits(self.host_total, self.device_peak, self.machine)

    def verdict(self) -> str:
        """"fits", or what does not and by how much."""
        if self.fits:
            return "fits"
        m, host, dev = self.machine, self.host_total, self.device_peak
        if m.compute_on_host:
            return (f"DOES NOT FIT: host + device {format_bytes(host + dev)} > "
                    f"{format_bytes(m.host_memory_gb * GB)} of RAM")
        over = [f"{what} {format_bytes(need)} > {format_bytes(have * GB)} available"
                for what, need, have in [("host RAM", host, m.host_memory_gb),
                                         ("device peak", dev, m.device_memory_gb)]
                if need > have * GB]
        M = self.micro_batch[0]
        if dev > m.device_memory_gb * GB and M > 1 and 0 < self.largest_micro_batches < M:
            over.append(f"data.micro_batches {M}: the largest that fits is "
                        f"{self.largest_micro_batches} (each call holds every micro-batch's "
                        f"activations)")
        return "DOES NOT FIT: " + "; ".join(over)

    def summary(self) -> str:
        """Lines for a run's log: predicted against available, what was chosen, the verdict, the
        attention that runs (and a notice where train.attention cannot run as asked)."""
        m = self.machine
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host.items() if v)
        return (f"plan ({m.name}): host RAM {format_bytes(self.host_total)} of "
                f"{format_bytes(m.host_memory_gb * GB)} ({self.host_total_bytes_per_param:.2f} "
                f"B/param: {kinds}); device peak "
                f"{format_bytes(self.device_peak)} of {format_bytes(m.device_memory_gb * GB)} "
                f"in the {self.peak_phase}\n"
                f"plan: offload activations {'on' if self.offload_activations else 'off'} "
                f"({self.offload_reason}), {self.bus_line()}; {self.verdict()}\n"
                f"{self.attention_line()}" + (f"\n{self.attention_notice}"
                                               if self.attention_notice else ""))

    def attention_line(self) -> str:
        """What attends at this step's sequence length, and why."""
        return f"plan: attention {self.attention_runs} ({self.attention_reason})"

    def bus_line(self) -> str:
        """The bus copies' form, and why."""
        return f"bus copies {self.bus} ({self.bus_reason})"

    def report(self) -> str:
        """The whole plan as text tables."""
        m, (M, B, T) = self.machine, self.micro_batch
        lines = [f"machine: {m.name}: device {format_bytes(m.device_memory_gb * GB)} usable, host "
                 f"{format_bytes(m.host_memory_gb * GB)}, {m.bf16_tflops:g} bf16 TFLOPS, "
                 f"{m.host_device_gbps:g} GB/s each way",
                 f"step: {M} micro-batch(es) of {B} x {T:,} tokens = {self.tokens_per_step:,}; "
                 f"offload activations {'on' if self.offload_activations else 'off'} "
                 f"({self.offload_reason}); {self.bus_line()}",
                 self.attention_line(), *([self.attention_notice] if self.attention_notice else []),
                 layer_line(self.counts), "", *self.tables(), "", self.verdict(),
                 f"largest that fits: batch {self.largest_batch:,} at seq_len {T:,}; "
                 f"seq_len {self.largest_seq_len:,} at batch {B}",
                 f"tokens per step for compute to hide the transfers at {ASSUMED_MFU:.0%} MFU: "
                 f"{self.hide_text()}", self.tier_line()]
        lines += [line for line in (self.activations_line(), self.workspace_line()) if line]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def tables(self) -> list:
        """The host RAM by kind, and the device's bytes by phase and kind with the peak."""
        m = self.machine
        host_unit, host_size = _unit(self.host_total)
        unit, size = _unit(self.device_peak)
        per_param = self.host_bytes_per_param
        lines = [f"{'host RAM (' + host_unit + ')':<28}{'B/param':>12}"]
        lines += [f"  {kind:<14}{v / host_size:>12.2f}{per_param[kind]:>12.2f}"
                  for kind, v in self.host.items()]
        lines += [f"  {'total':<14}{self.host_total / host_size:>12.2f}"
                  f"{self.host_total_bytes_per_param:>12.2f} of "
                  f"{format_bytes(m.host_memory_gb * GB)}, {format_params(self.params)} "
                  f"parameters", "",
                  f"{'device (' + unit + ')':<16}" + "".join(f"{k:>12}" for k in DEVICE_KINDS)
                  + f"{'total':>12}"]
        for phase, kinds in self.device.items():
            lines.append(f"  {phase:<14}" + "".join(f"{kinds[k] / size:>12.2f}"
                                                    for k in DEVICE_KINDS)
                         + f"{sum(kinds.values()) / size:>12.2f}")
        lines.append(f"  {'peak':<14}{self.device_peak / size:>{12 * len(DEVICE_KINDS) + 12}.2f} "
                     f"of {format_bytes(m.device_memory_gb * GB)}, in the {self.peak_phase}")
        return lines

    def largest_model_line(self) -> str:
        """The largest model of the config's width that fits, and the next depth, which does
        not."""
        c, layers = self.counts, self.largest_num_layers
        family = (f"model.num_layers varied at hidden_size {c.hidden:,}, every other key as "
                  f"configured; this config: {c.layers} layers, {format_params(self.params)}")
        if not layers:
            return f"largest model that fits: none, one layer does not fit ({family})"
        if layers == MOST_LAYERS:
            return (f"largest model that fits: {layers:,} layers or more, "
                    f"{format_params(self.largest_model['params'])} parameters or more (the "
                    f"search stops at {MOST_LAYERS:,}; {family})")
        above = with_layers(c, layers + 1).params
        return (f"largest model that fits: {layers} layers, "
                f"{format_params(self.largest_model['params'])} parameters ({layers + 1} layers, "
                f"{format_params(above)}, do not; {family})")

    def hide_text(self) -> str:
        """tokens_to_hide_transfers in words, against this step's tokens."""
        hide = self.tokens_to_hide_transfers
        return {0: "none cross a bus", -1: "none: the bus is slower per token than compute"}.get(
            hide, f"{hide:,} (this step has {self.tokens_per_step:,}: "
                  f"{'hidden' if self.tokens_per_step >= hide else 'exposed'})")

    def tier_line(self) -> str:
        """Host RAM with each offload.tier, the disk tier's bytes and the bandwidth it needs."""
        hide = (f"; hiding its I/O under a step's compute needs {self.disk_gbps_to_hide:.2f} GB/s "
                f"of disk reads + writes" if self.disk_gbps_to_hide else "")
        ram, disk = self.host_by_tier.get("ram", 0), self.host_by_tier.get("disk", 0)
        return (f"offload.tier={self.tier}: host RAM {format_bytes(ram)} with the ram tier, "
                f"{format_bytes(disk)} with the disk tier, which puts {format_bytes(self.disk_bytes)} "
                f"on disk{hide}")

    def activations_line(self) -> str:
        """What offloaded activations take of host RAM, what a host then needs, and whether the
        disk tier could take them (it cannot): "" without offloading."""
        c, acts = self.counts, self.host.get("activations", 0)
        if not acts:
            return ""
        ram, disk = self.host_by_tier.get("ram", 0), self.host_by_tier.get("disk", 0)
        return (f"offloaded activations: {format_bytes(acts)} of host RAM ({c.layers} layers' "
                f"inputs, {format_bytes(acts / c.layers)} each); a host needs "
                f"{format_bytes(ram)} with offload.tier=ram, {format_bytes(disk)} with "
                f"offload.tier=disk, which moves the master weights and optimizer state to disk "
                f"but not the activations: they stay in host RAM either way")

    def workspace_line(self) -> str:
        """Each phase's workspace as XLA:CPU compiles it and as the plan estimates it in bf16
        (its figure): "" where the device compiled them itself."""
        if not self.workspace_cpu_compiled:
            return ""
        both = ", ".join(f"{phase} {format_bytes(self.workspace_cpu_compiled[phase])} / "
                         f"{format_bytes(self.workspace[phase])}" for phase in PHASES)
        return (f"workspace, XLA:CPU as compiled / bf16 estimate (XLA:CPU without hoisting its fp32 "
                f"copies out of loops; the plan and `fits` use the estimate): {both}")

    def to_dict(self) -> dict:
        """Plain data, for JSON."""
        names = ("host", "host_total", "device", "device_peak", "peak_phase", "fits",
                 "offload_activations", "offload_reason", "bus", "bus_reason", "attention",
                 "attention_reason", "attention_runs", "attention_notice",
                 "workspace", "largest_batch", "largest_seq_len", "tokens_per_step", "host_lookup",
                 "tokens_to_hide_transfers", "tier", "host_by_tier", "disk_bytes",
                 "disk_gbps_to_hide", "workspace_cpu_compiled", "params",
                 "host_bytes_per_param", "host_total_bytes_per_param")
        return {"machine": dataclasses.asdict(self.machine), "micro_batch": list(self.micro_batch),
                "execution": dataclasses.asdict(self.execution), "notes": list(self.notes),
                "layer_params": self.counts.layer, "layer_bus_bytes":
                self.counts.layer * self.counts.compute,
                "active_layer_params": self.counts.active_layer,
                **{name: getattr(self, name) for name in names}}
