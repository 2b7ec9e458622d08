"""Memory and bandwidth plan of a run, made before anything is allocated.

    p = plan(load_config("configs/llama3_8b.yaml"), MACHINES["h100"])
    print(p.report())          # host RAM by kind, device memory by phase and kind, what fits

For a config and a machine the plan predicts the host RAM the engine holds (by kind), the device
peak of every phase of a step (by kind), whether both fit, whether activations must be offloaded
(`train.offload_activations: auto`), the largest micro-batch and sequence that fit, and how many
tokens a step needs for compute to hide the weight transfers.

It models what the engine does, not an idealisation of it (engine/step.py, stream.py, host.py):
the bytes held at each moment of the step's schedule follow from the parameter trees, which are
built abstractly (`nnx.eval_shape`: an 8B model is never allocated), and each phase's working
space is the compiled temp size (`memory_analysis()`) of the engine's own jitted function for that
phase, lowered on abstract arguments. tests/test_plan.py checks both against a real engine.
"""

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.config import Config
from megatrain_jax.engine import schedule, stage_units
from megatrain_jax.engine.functions import DeviceFunctions, stage_parts
from megatrain_jax.model import Execution, ModelConfig, make_block, make_stages

GB = 1e9  # memory and bandwidth figures are in GB and GB/s
# XLA:CPU computes bf16 math in fp32: it converts bf16 operands to fp32, and its loop-invariant
# code motion then hoists whole-sequence fp32 copies (of a block's input, of K and V) out of the
# tile loops, which XLA:GPU, computing in bf16, has no reason to make. The bf16 estimate of a
# workspace is XLA:CPU's with that pass off: fp32 copies stay one tile in size.
_HOISTING_PASS = "while-loop-invariant-code-motion"
ASSUMED_MFU = 0.5  # fraction of the bf16 peak the device reaches (for the transfer-hiding figure)
PINNED_POOL_DEFAULT_GIB = 64  # XLA:GPU's pinned host pool, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB
PHASES = ("embed", "forward", "loss", "backward", "embed backward")
DEVICE_KINDS = ("inputs", "weights", "gradients", "activations", "cotangents", "workspace")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the plan needs to know about a machine. GB = 1e9 bytes.

    device_memory_gb is what the run may use, not the physical size: the presets take 90% of it,
    while JAX's allocator takes 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (set it to
    0.9 to match them). host_memory_gb is the RAM the run may hold.
    """
    name: str
    device_memory_gb: float
    host_memory_gb: float
    bf16_tflops: float  # dense peak
    host_device_gbps: float  # host <-> device, each way, GB/s (1e9 bytes)
    platform: str = "gpu"  # JAX platform of the compute device: picks the attention implementation
    compute_on_host: bool = False  # a CPU-only run: the compute device is the host's own memory


_MIB = 2**20 / GB
# Device memory: 90% of what nvidia-smi reports (81559, 143771, 97871 MiB). Host RAM: an H100's
# share of an 8-GPU node with 2 TB, an H200 box with 512 GB, GH200's 480 GB of LPDDR5X. Bus: PCIe
# 5 x16 pinned ~55 GB/s each way (63 on paper), NVLink-C2C ~375 measured (450 on paper).
# bf16 dense peak 989 TFLOPS for all three.
MACHINES = {
    "h100": Machine("H100 SXM 80GB, PCIe 5", 0.9 * 81559 * _MIB, 256, 989, 55),
    "h200": Machine("H200 SXM 141GB, PCIe 5", 0.9 * 143771 * _MIB, 512, 989, 55),
    "gh200": Machine("GH200 96GB HBM3, NVLink-C2C", 0.9 * 97871 * _MIB, 480, 989, 375),
}


# bf16 dense tensor-core peak (no sparsity) from the datasheets, TFLOPS, by device_kind substring
# (as JAX reports it, e.g. "NVIDIA H100 80GB HBM3"): the first match wins, so "GH200" precedes
# "H200" and the H100 PCIe and NVL parts precede "H100" (SXM).
PEAK_BF16_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
                    ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0),
                    ("L4", 121.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0),
                    ("TPU v6 lite", 918.0))


def peak_bf16_tflops(device_kind: str) -> float | None:
    """The datasheet bf16 dense peak of a device kind (PEAK_BF16_TFLOPS), or None if unknown."""
    kind = device_kind.upper()
    return next((v for k, v in PEAK_BF16_TFLOPS if k.upper() in kind), None)


def visible_keys(model: ModelConfig, seq_len: int, sliding: bool = True) -> float:
    """The mean number of keys a query attends to in a causal sequence of seq_len tokens, in a
    layer with the model's sliding window (sliding=False: a full-attention layer of
    model.layer_types): (T + 1) / 2 without one."""
    window = min((model.sliding_window if sliding else 0) or seq_len, seq_len)
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward and backward, the recompute not counted): 6 per
    matmul parameter (the input embedding is a lookup and does not count; the output projection
    does), plus causal attention's QK^T and PV, 4 * heads * head_dim per visible key and layer
    forward, twice that backward. The numerator of MFU."""
    # a mixture of experts counts its routed experts only
    matmul = (model.num_active_params(include_embeddings=False)
              + model.hidden_size * model.vocab_size)
    kinds = model.layer_types or ("sliding_attention",) * model.num_layers  # windowed if any
    visible = sum(visible_keys(model, seq_len, sliding=k == "sliding_attention") for k in kinds)
    return 6 * matmul + 12 * model.num_heads * model.head_size * visible


def _total_ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def machine_from_device(device=None, *, host_memory_gb=None) -> Machine:
    """The local machine: a GPU's usable memory (memory_stats()["bytes_limit"], i.e. after JAX's
    preallocation fraction) and throughput from the matching preset; a CPU computes in host RAM.
    host_memory_gb defaults to the total RAM (not what other processes leave free)."""
    device = device or jax.devices()[0]
    host = host_memory_gb or _total_ram_gb()
    if device.platform == "cpu":
        return Machine("local CPU", host, host, 0.0, 0.0, platform="cpu", compute_on_host=True)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise ValueError(f"{device} reports no memory limit (memory_stats()['bytes_limit'])")
    kind = device.device_kind
    key = next((k for k in ("gh200", "h200", "h100") if k.upper() in kind.upper()), None)
    preset = MACHINES[key or "h100"]
    name = f"local {kind}" + ("" if key else f" (throughput of the {preset.name} assumed)")
    return Machine(name, limit / GB, host, peak_bf16_tflops(kind) or preset.bf16_tflops,
                   preset.host_device_gbps, platform=device.platform)


# -----------------------------------------------------------------------------
# the engine's functions, abstractly


@functools.lru_cache(maxsize=8)
def _abstract(model: ModelConfig, execution: Execution, grad_dtype: str):
    """(stage params, block params, StageParts, DeviceFunctions) with ShapeDtypeStruct leaves."""
    block_def, block, _ = nnx.split(nnx.eval_shape(lambda: make_block(model, 0, 0, execution)),
                                    nnx.Param, ...)
    stages_def, stages, _ = nnx.split(nnx.eval_shape(lambda: make_stages(model, 0, execution)),
                                      nnx.Param, ...)
    stages, block = nnx.to_pure_dict(stages), nnx.to_pure_dict(block)
    example = np.zeros((1, 1), np.int32)  # which leaves a stage reads does not depend on shapes
    parts = stage_parts(stages_def, stages, example, example)
    functions = DeviceFunctions(stages_def, jax.tree.structure(stages), parts, block_def,
                                jnp.dtype(grad_dtype))
    return stages, block, parts, functions


@functools.lru_cache(maxsize=64)
def _workspace(model: ModelConfig, execution: Execution, compute_dtype: str, grad_dtype: str,
               batch: int, seq: int, document_mask: bool, device, hoisting: bool = False) -> dict:
    """Phase -> temp bytes of the engine's jitted function for that phase on one micro-batch of
    (batch, seq), compiled for `device` with the argument shapes and dtypes the step passes.
    On XLA:CPU, LLVM's optimisation level does not change buffer assignment: it is turned off,
    halving the compile time; so is loop-invariant code motion unless `hoisting` (the bf16
    estimate, see _HOISTING_PASS)."""
    stages, block, parts, f = _abstract(model, execution, grad_dtype)
    sharding = jax.sharding.SingleDeviceSharding(device)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    like = lambda tree, dtype: jax.tree.map(lambda p: sds(p.shape, dtype), tree)
    c = jnp.dtype(compute_dtype)
    leaves = jax.tree.leaves(stages)
    first, last = parts.take("first", leaves), parts.take("last", leaves)
    tokens, x = sds((batch, seq), jnp.int32), sds((batch, seq, model.hidden_size), c)
    context = {"segment_ids": tokens, "positions": tokens} if document_mask else None
    w = like(block, c)
    calls = {"embed": (f.embed, (like(first, c), tokens)),
             "forward": (f.block_fwd, (w, x, context)),
             "loss": (f.head, (like(last, c), x, tokens, like(last, jnp.float32))),
             "backward": (f.block_bwd, (w, x, context, x, like(block, jnp.float32))),
             "embed backward": (f.embed_bwd, (like(first, c), tokens, x, like(first, jnp.float32)))}
    options = {}
    if device.platform == "cpu":
        options = {"xla_backend_optimization_level": 0,
                   **({} if hoisting else {"xla_disable_hlo_passes": _HOISTING_PASS})}
    return {phase: fn.lower(*args).compile(compiler_options=options).memory_analysis()
            .temp_size_in_bytes for phase, (fn, args) in calls.items()}


def _compile_device(platform: str):
    """A local device of `platform` to compile for, else the CPU."""
    return next((d for d in jax.local_devices() if d.platform == platform),
                jax.local_devices(backend="cpu")[0])


# -----------------------------------------------------------------------------
# bytes at each moment of a step


@dataclasses.dataclass(frozen=True)
class _Counts:
    """What the plan needs of a config, independent of the micro-batch shape."""
    layers: int
    prefetch: int
    micro_batches: int
    hidden: int
    compute: int  # bytes per element: streamed weights, activations
    grad: int  # bytes per element of a gradient on the host (train.grad_dtype)
    context: bool  # document masks: segment ids and positions beside every micro-batch
    layer: int  # parameters of one block (a MoE block: all its experts, which all stream)
    active_layer: int  # parameters of one block a token computes with (MoE: routed experts only)
    first: int  # parameters the first stage reads (embedding)
    last: int  # parameters the last stage reads (final norm, head)
    stages: int  # parameters of the stages unit
    optimizer: int  # bytes of every unit's optax state
    accelerator: bool  # compute device apart from the host: fetches copy, bus copies are staged
    stages_state: int = 0  # bytes of the stages' master weights and optax state
    layer_state: int = 0  # bytes of one layer's
    # distributed.shard_optimizer over P processes: each holds ~1/P of every unit's rows (master,
    # optax state, bus copy, gradient, staging; the zero padding rows are not counted)
    host_shards: int = 1

    def host(self, tokens: int, offload: bool) -> dict:
        """Kind -> bytes of host RAM at the end of a step, `tokens` per micro-batch.

        The bus copies and the step's gradients are both counted: on a GPU the bus copies (and
        offloaded activations) live in XLA's pinned host pool, a BFC allocator that keeps what it
        has grown to. (On a CPU-only run the released bus copies make room for the gradients.)"""
        params = self.stages + self.layers * self.layer
        bus_is_master = not self.accelerator and self.compute == 4
        share = lambda n: -(-n // self.host_shards)  # this process's rows of the state
        return {
            "master": share(4 * params),
            "optimizer": share(self.optimizer),
            "bus": 0 if bus_is_master else share(self.compute * params),
            # every unit's, waiting for the global norm; the stages' first and last parts, then
            # their merged sum
            "gradients": share(self.grad * (self.layers * self.layer + self.first + self.last
                                            + self.stages)),
            "staging": share(self.compute * (self.stages + self.layer)) if self.accelerator
            else 0,
            "activations": self.layers * self._acts(tokens) if offload else 0,
        }

    def host_on_disk(self, tokens: int, offload: bool, read_ahead: int) -> dict:
        """`host` with offload.tier=disk (engine/tier.py): no master weights or optax state in
        RAM, a bus copy even in fp32, and the units in flight: read_ahead read buffers, the unit
        being updated (its read buffer, which its arrays alias, and the update's outputs) and up
        to read_ahead written behind (at least 1), the buffers from one pool; the stages' own
        buffers (one read, one written) stay pooled besides their arrays while they are
        updated."""
        params = self.stages + self.layers * self.layer
        return {**self.host(tokens, offload), "master": 0, "optimizer": 0,
                "bus": self.compute * params,
                "tier buffers": 3 * self.stages_state
                + (read_ahead + max(1, read_ahead) + 2) * self.layer_state}

    def _acts(self, tokens: int) -> int:
        """One layer's activations (input or output) for all micro-batches."""
        return self.micro_batches * tokens * self.hidden * self.compute

    def device(self, tokens: int, offload: bool, workspace: dict) -> dict:
        """Phase -> kind -> bytes on the compute device at the phase's peak, `tokens` per
        micro-batch: the arrays the step holds right after its largest call in the phase, plus that
        call's compiled temp bytes (workspace)."""
        L, p, act = self.layers, self.prefetch, self._acts(tokens)
        weights = lambda params: params * self.compute if self.accelerator else 0  # no copy
        inputs = self.micro_batches * tokens * 4 * (4 if self.context else 2)  # int32

        def moment(phase=None, **kinds):
            kinds = {"inputs": inputs, **kinds, "workspace": workspace[phase] if phase else 0}
            return {k: int(kinds.get(k, 0)) for k in DEVICE_KINDS}

        # The head's fp32 gradient stays on the device from the loss until the stages' gradient
        # is merged after the embedding's backward. Layers resident: engine/schedule.py's.
        head = 4 * self.last
        out = 4 * self.layer + (self.layer * self.grad if self.grad != 4 else 0)  # a layer's
        forward, backward = [], []
        resident, overlapped = schedule.resident(L, p), schedule.overlapped(L, p)
        for pos in range(L):
            n = resident[pos]
            # saved: every earlier layer's input and this one's, plus its outputs; offloaded:
            # this layer's inputs and outputs, and the one before's inputs until it retires
            forward.append(moment("forward", weights=n * weights(self.layer),
                                  activations=(2 + overlapped[pos] if offload else pos + 2) * act))
            # saved: this layer's inputs and every earlier one's; offloaded: those fetched back
            backward.append(moment("backward", weights=n * weights(self.layer),
                                   # the layer's, and the one before's (with its cast for the
                                   # host) while it goes out
                                   gradients=4 * self.layer + overlapped[pos] * out + head,
                                   activations=(n if offload else L - pos + overlapped[pos]) * act, cotangents=act))
        return {
            "embed": moment("embed", weights=weights(self.first), activations=act),
            "forward": max(forward, key=lambda m: sum(m.values())),
            "loss": moment("loss", weights=weights(self.last), gradients=4 * self.last,
                           activations=(1 if offload else L + 1) * act, cotangents=act),
            "backward": max(backward, key=lambda m: sum(m.values())),
            "embed backward": moment("embed backward", weights=weights(self.first),
                                     gradients=4 * (self.first + self.last), cotangents=act),
        }


def _fits(host_total: int, device_peak: int, machine: Machine) -> bool:
    if machine.compute_on_host:  # one memory for both
        return host_total + device_peak <= machine.host_memory_gb * GB
    return (host_total <= machine.host_memory_gb * GB
            and device_peak <= machine.device_memory_gb * GB)


def _largest_int(ok: Callable[[int], bool]) -> int:
    """The largest n >= 1 with ok(n) (ok monotone: true up to some n), or 0."""
    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi) and hi < 2**40:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


LARGEST_SEQ_TOLERANCE = 0.02


def _largest_compiled(ok: Callable[[int], bool], quantum: int, guess: int) -> int:
    """The largest multiple n of quantum with ok(n) (monotone; each call compiles), found to
    within LARGEST_SEQ_TOLERANCE: bracketed from `guess` by steps of that tolerance, doubled each
    time, then bisected until a length that fits and one that does not are that close (or one
    quantum apart). 0 if one quantum does not fit."""
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
            if hi == quantum:
                return 0
            below = down(int(hi / (1 + step)))
            lo, hi = (below, hi) if ok(below) else (below, below)
            step *= 2
    while hi - lo > quantum and hi > lo * (1 + LARGEST_SEQ_TOLERANCE):
        mid = down((lo + hi) // 2)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _tokens_to_hide(model: ModelConfig, counts: _Counts, seq: int, machine: Machine,
                    offload: bool) -> int:
    """Tokens per step (all micro-batches pass a layer while its weights are there) for which a
    layer's compute takes as long as its transfers, in both directions and both passes, at
    ASSUMED_MFU of the bf16 peak. Per token and layer: forward 2 FLOPs per active parameter (a
    mixture of experts' routed experts, not all of them) plus causal
    attention (QK^T and PV, 4 * N * H per visible key); backward 6 per parameter (the block's
    recompute 2, its gradients 4) plus 3.5x the forward's attention (recompute 2 matmuls,
    flash backward 5). Transfers per layer: its weights in, each pass; in the backward its
    gradient out; offloaded activations out in the forward and in in the backward.
    0: nothing crosses a bus; -1: no number of tokens hides them."""
    if not counts.accelerator:
        return 0
    # The cheapest layer binds: a sliding one, unless model.layer_types makes every layer full.
    slides = not model.layer_types or "sliding_attention" in model.layer_types
    attention = 4 * model.num_heads * model.head_size * visible_keys(model, seq, sliding=slides)
    flops_per_byte = machine.bf16_tflops * 1e12 * ASSUMED_MFU / (machine.host_device_gbps * 1e9)
    act = counts.hidden * counts.compute if offload else 0  # bytes per token
    forward = 2 * counts.active_layer + attention
    backward = 6 * counts.active_layer + 3.5 * attention
    weights, grads = counts.layer * counts.compute, counts.layer * counts.grad
    needed = 0.0
    # (bytes per layer, bytes per token, FLOPs per token) for each pass and direction
    for fixed, per_token, flops in [(weights, 0, forward), (0, act, forward),
                                    (weights, act, backward), (grads, 0, backward)]:
        spare = flops - per_token * flops_per_byte
        if spare <= 0:
            return -1
        needed = max(needed, fixed * flops_per_byte / spare)
    return int(np.ceil(needed))


# -----------------------------------------------------------------------------
# the plan


_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1))


def _unit(n: float) -> tuple[str, float]:
    return next((u, s) for u, s in _UNITS if abs(n) >= s or s == 1)


def format_bytes(n: float) -> str:
    unit, size = _unit(n)
    return f"{n / size:.2f} {unit}"


@dataclasses.dataclass
class Plan:
    """A config's predicted memory on a machine, in bytes: `host[kind]`, `device[phase][kind]` (at
    the phase's peak), `workspace[phase]` (the compiled temp bytes of the phase's function, part of
    `device`). `largest_batch` and `largest_seq_len` are worked out on first use: they compile the
    step's functions at two more shapes (see `largest` in `plan`)."""
    host: dict
    device: dict
    offload_activations: bool  # resolved
    offload_reason: str
    attention: str  # the resolved implementation
    attention_reason: str
    execution: Execution  # the model's, as the engine will run it
    machine: Machine
    workspace: dict
    micro_batch: tuple  # (micro-batches, batch, seq_len)
    tokens_to_hide_transfers: int  # 0: nothing crosses a bus; -1: no number of tokens does it
    notes: tuple  # what the figures rest on, where it matters
    counts: _Counts = dataclasses.field(repr=False, compare=False)  # parameter counts per unit
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
    # (_HOISTING_PASS); {} where the workspaces were compiled for the device itself
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

    @property
    def tokens_per_step(self) -> int:
        return int(np.prod(self.micro_batch))

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
        return _fits(self.host_total, self.device_peak, self.machine)

    def verdict(self) -> str:
        """"fits", or what does not and by how much."""
        if self.fits:
            return "fits"
        m, host, dev = self.machine, self.host_total, self.device_peak
        if m.compute_on_host:
            return (f"DOES NOT FIT: host + device {format_bytes(host + dev)} > "
                    f"{format_bytes(m.host_memory_gb * GB)} of RAM")
        return "DOES NOT FIT: " + "; ".join(
            f"{what} {format_bytes(need)} > {format_bytes(have * GB)} available"
            for what, need, have in [("host RAM", host, m.host_memory_gb),
                                     ("device peak", dev, m.device_memory_gb)] if need > have * GB)

    def summary(self) -> str:
        """Two lines for a run's log: predicted against available, what was chosen, the verdict."""
        m = self.machine
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host.items() if v)
        return (f"plan ({m.name}): host RAM {format_bytes(self.host_total)} of "
                f"{format_bytes(m.host_memory_gb * GB)} ({kinds}); device peak "
                f"{format_bytes(self.device_peak)} of {format_bytes(m.device_memory_gb * GB)} "
                f"in the {self.peak_phase}\n"
                f"plan: offload activations {'on' if self.offload_activations else 'off'} "
                f"({self.offload_reason}), attention {self.attention} ({self.attention_reason}); "
                f"{self.verdict()}")

    def report(self) -> str:
        """The whole plan as text tables."""
        m, (M, B, T) = self.machine, self.micro_batch
        host_unit, host_size = _unit(self.host_total)
        unit, size = _unit(self.device_peak)
        lines = [f"machine: {m.name}: device {format_bytes(m.device_memory_gb * GB)} usable, host "
                 f"{format_bytes(m.host_memory_gb * GB)}, {m.bf16_tflops:g} bf16 TFLOPS, "
                 f"{m.host_device_gbps:g} GB/s each way",
                 f"step: {M} micro-batch(es) of {B} x {T:,} tokens = {self.tokens_per_step:,}; "
                 f"attention {self.attention} ({self.attention_reason}); offload activations "
                 f"{'on' if self.offload_activations else 'off'} ({self.offload_reason})",
                 self.layer_line(), "",
                 f"host RAM ({host_unit})"]
        lines += [f"  {kind:<14}{v / host_size:>12.2f}" for kind, v in self.host.items()]
        lines += [f"  {'total':<14}{self.host_total / host_size:>12.2f} of "
                  f"{format_bytes(m.host_memory_gb * GB)}", "",
                  f"{'device (' + unit + ')':<16}" + "".join(f"{k:>12}" for k in DEVICE_KINDS)
                  + f"{'total':>12}"]
        for phase, kinds in self.device.items():
            lines.append(f"  {phase:<14}" + "".join(f"{kinds[k] / size:>12.2f}"
                                                    for k in DEVICE_KINDS)
                         + f"{sum(kinds.values()) / size:>12.2f}")
        hide = self.tokens_to_hide_transfers
        hide = {0: "none cross a bus", -1: "none: the bus is slower per token than compute"}.get(
            hide, f"{hide:,} (this step has {self.tokens_per_step:,}: "
                  f"{'hidden' if self.tokens_per_step >= hide else 'exposed'})")
        lines += [f"  {'peak':<14}{self.device_peak / size:>{12 * len(DEVICE_KINDS) + 12}.2f} of "
                  f"{format_bytes(m.device_memory_gb * GB)}, in the {self.peak_phase}", "",
                  self.verdict(),
                  f"largest that fits: batch {self.largest_batch:,} at seq_len {T:,}; "
                  f"seq_len {self.largest_seq_len:,} at batch {B}",
                  f"tokens per step for compute to hide the transfers at {ASSUMED_MFU:.0%} MFU: "
                  f"{hide}"]
        lines += [self.tier_line()]
        lines += [line for line in (self.activations_line(), self.workspace_line()) if line]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

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

    def layer_line(self) -> str:
        """What one layer streams: its weights (every expert of a MoE layer), and what a token
        computes with (the routed experts: the FLOPs of tokens_to_hide_transfers)."""
        c = self.counts
        active = ("" if c.active_layer == c.layer else
                  f"; {c.active_layer / 1e6:,.2f}M active per token (routed experts)")
        return (f"per layer: {c.layer / 1e6:,.2f}M parameters, "
                f"{format_bytes(c.layer * c.compute)} over the bus per pass{active}")

    def to_dict(self) -> dict:
        """Plain data, for JSON."""
        names = ("host", "host_total", "device", "device_peak", "peak_phase", "fits",
                 "offload_activations", "offload_reason", "attention", "attention_reason",
                 "workspace", "largest_batch", "largest_seq_len", "tokens_per_step",
                 "tokens_to_hide_transfers", "tier", "host_by_tier", "disk_bytes",
                 "disk_gbps_to_hide", "workspace_cpu_compiled")
        return {"machine": dataclasses.asdict(self.machine), "micro_batch": list(self.micro_batch),
                "execution": dataclasses.asdict(self.execution), "notes": list(self.notes),
                "layer_params": self.counts.layer, "layer_bus_bytes":
                self.counts.layer * self.counts.compute,
                "active_layer_params": self.counts.active_layer,
                **{name: getattr(self, name) for name in names}}


def _idle_expert_params(model: ModelConfig) -> int:
    """Parameters of one MoE layer's experts a token is not routed to."""
    idle = model.num_experts - model.experts_per_token if model.num_experts else 0
    return idle * 3 * model.hidden_size * model.intermediate_size


def _counts(cfg: Config, execution: Execution, machine: Machine) -> _Counts:
    from megatrain_jax.train import build_optimizer  # lazy: train imports this module

    stages, block, parts, _ = _abstract(cfg.model, execution, cfg.train.grad_dtype)
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    leaves = jax.tree.leaves(stages)
    init = build_optimizer(cfg.optimizer, cfg.train.steps).init
    optimizer_bytes = lambda tree: sum(x.size * x.dtype.itemsize
                                       for x in jax.tree.leaves(jax.eval_shape(init, tree)))
    return _Counts(
        layers=cfg.model.num_layers, prefetch=cfg.train.prefetch,
        micro_batches=cfg.data.micro_batches, hidden=cfg.model.hidden_size,
        compute=jnp.dtype(cfg.train.compute_dtype).itemsize,
        grad=jnp.dtype(cfg.train.grad_dtype).itemsize, context=cfg.data.document_mask,
        layer=size(block), active_layer=size(block) - _idle_expert_params(cfg.model),
        first=size(parts.take("first", leaves)),
        last=size(parts.take("last", leaves)), stages=size(stages),
        # the stages as the engine's two units (each with its own scalar state, e.g. a count)
        optimizer=sum(map(optimizer_bytes, stage_units.split(stages)))
        + cfg.model.num_layers * optimizer_bytes(block),
        accelerator=not machine.compute_on_host,
        stages_state=4 * size(stages) + optimizer_bytes(stages),
        layer_state=4 * size(block) + optimizer_bytes(block),
        host_shards=cfg.distributed.num_processes if cfg.distributed.shard_optimizer else 1)


def plan(cfg: Config, machine: Machine) -> Plan:
    """The plan of `cfg` on `machine`. Compiles the step's five device functions for the
    configured micro-batch shape (seconds for an 8B model on a CPU); allocates nothing."""
    from megatrain_jax.train import execution_for  # the engine's own: lazy, train imports us

    execution, attention_reason = execution_for(cfg, machine.platform)
    device = _compile_device(machine.platform)
    notes, compiled = [], execution
    if execution.attention == "cudnn" and device.platform != "gpu":
        compiled = dataclasses.replace(execution, attention="blockwise")
        notes.append(f"cuDNN attention cannot compile on {device.platform}: blockwise attention "
                     f"stands in for its workspace (the same flash algorithm, memory linear in T)")
    if device.platform != machine.platform:
        notes.append(f"workspaces compiled by XLA:{device.platform.upper()}, which computes bf16 "
                     f"math in fp32: an estimate of the {machine.platform.upper()}'s (plan on the "
                     f"machine itself, --device local, for its compiler's own figures)")
    counts = _counts(cfg, compiled, machine)
    M, B, T = cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len
    if execution.attention == "cudnn" and 0 < execution.tile_size < T:
        notes.append(f"the block is tiled over the sequence (train.tile_size "
                     f"{execution.tile_size:,} < data.seq_len {T:,}): each query tile's attention "
                     f"is blockwise, as cuDNN's public API takes no causal offset for a tile")
    temps = functools.partial(_workspace, cfg.model, compiled, cfg.train.compute_dtype,
                              cfg.train.grad_dtype, document_mask=cfg.data.document_mask,
                              device=device, hoisting=device.platform == machine.platform)
    workspace = temps(B, T)
    estimated = device.platform != machine.platform  # compiled by the CPU for a GPU
    cpu_compiled = functools.partial(temps, B, T, hoisting=True) if estimated else dict
    peak = lambda phases: max(sum(kinds.values()) for kinds in phases.values())

    requested = cfg.train.offload_activations
    if requested == "auto":
        without = peak(counts.device(B * T, False, workspace))
        # on a CPU-only run the "device" is the host's RAM: offloading would gain nothing
        offload = without > machine.device_memory_gb * GB and not machine.compute_on_host
        offload_reason = (f"auto: without, the device peak would be {format_bytes(without)}"
                          if offload else "auto: the device holds them")
    else:
        offload, offload_reason = requested, "requested"
    options = [False, True] if requested == "auto" and not machine.compute_on_host else [offload]

    host_of = counts.host if cfg.offload.tier == "ram" else functools.partial(
        counts.host_on_disk, read_ahead=cfg.offload.read_ahead)

    def fits_at(b, t, workspace):
        return any(_fits(sum(host_of(b * t, o).values()),
                         peak(counts.device(b * t, o, workspace)), machine) for o in options)

    def largest(axis: str) -> int:
        """The largest batch_size (axis "batch") or seq_len ("seq") that fits, everything else as
        configured, offload as the config allows. The arrays the plan counts are linear in a
        micro-batch's tokens. For the batch, a workspace is fitted from one more compile, (2B, T),
        as linear in B: batch rows compute alike. For the sequence, one compile at (B, 4T) fits
        it as linear in T (blockwise attention, tiles, loss chunks) for a first guess, and the
        search compiles at each length it tries from there (_largest_compiled), to within
        LARGEST_SEQ_TOLERANCE of the shortest length that does not fit."""
        if axis == "seq":
            w4 = temps(B, 4 * T)  # the guess: workspaces linear in T
            guess = _largest_int(lambda t: fits_at(B, t, {
                phase: max(0, workspace[phase] + (t - T) * (w4[phase] - workspace[phase]) / (3 * T))
                for phase in PHASES}))
            return _largest_compiled(lambda t: fits_at(B, t, temps(B, t)),
                                     execution.attention_block, guess)
        w1, w2 = workspace, temps(2 * B, T)
        return _largest_int(lambda b: fits_at(b, T, {
            phase: max(0, w1[phase] + (b - B) * (w2[phase] - w1[phase]) / B) for phase in PHASES}))

    read_ahead = cfg.offload.read_ahead
    host_by_kind = {"ram": counts.host(B * T, offload),
                    "disk": counts.host_on_disk(B * T, offload, read_ahead)}
    host = host_by_kind[cfg.offload.tier]
    disk_bytes = 4 * (counts.stages + counts.layers * counts.layer) + counts.optimizer
    compute_s = (flops_per_token(cfg.model, T) * M * B * T
                 / (machine.bf16_tflops * 1e12 * ASSUMED_MFU)) if machine.bf16_tflops else 0
    pinned = host["bus"] + host["activations"]
    if machine.platform == "gpu" and pinned > PINNED_POOL_DEFAULT_GIB * 2**30:
        notes.append(f"the bus copies and offloaded activations take {format_bytes(pinned)} of "
                     f"XLA's pinned host pool, {PINNED_POOL_DEFAULT_GIB} GiB unless set: run with "
                     f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB={int(np.ceil(pinned / 2**30)) + 8}")
    return Plan(host=host, device=counts.device(B * T, offload, workspace),
                offload_activations=offload, offload_reason=offload_reason,
                attention=execution.attention, attention_reason=attention_reason,
                execution=execution, machine=machine, workspace=workspace, micro_batch=(M, B, T),
                tokens_to_hide_transfers=_tokens_to_hide(cfg.model, counts, T, machine, offload),
                notes=tuple(notes), counts=counts, _largest=largest, tier=cfg.offload.tier,
                host_by_tier={k: sum(v.values()) for k, v in host_by_kind.items()},
                disk_bytes=disk_bytes,
                disk_gbps_to_hide=2 * disk_bytes / compute_s / GB if compute_s else 0.0,
                _cpu_compiled=cpu_compiled)


def plan_sweep(cfgs: list, machine: Machine) -> list:
    """The plans of configs that differ in data.seq_len only (a sweep). Their largest sequence is
    one search (the same config at every length): made for the first and shared."""
    plans = [plan(cfg, machine) for cfg in cfgs]
    for p in plans[1:]:
        p.__dict__["largest_seq_len"] = plans[0].largest_seq_len  # the cached_property's value
    return plans
