"""FLOPs and MFU accounting: what a config's units hold (parameter counts, bytes per element),
the model FLOPs of a training token (the numerator of MFU), the attention FLOPs as the device runs
them, and the tokens per step that hide a layer's transfers under its compute.

    c = counts(cfg, execution, MACHINES["h100"], optimizer=build_optimizer(cfg.optimizer,
               cfg.train.steps), lookup_setting=host_lookup_setting(cfg))  # recipes' two
    flops_per_token(cfg.model, cfg.data.seq_len)     # model FLOPs of one training token

The memory plan (megatrain_jax.plan) and the step-time model (megatrain_jax.step_time) read both.
What the run itself builds (its optimizer, its train.host_lookup) is passed in: this module sits
below megatrain_jax.recipes and the data stack it builds.
The parameter trees are built abstractly (`nnx.eval_shape`: an 8B model is never allocated).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megatrain_jax.config import Config, ConfigError
from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import lookup, packing, stage_units, transfer, update
from megatrain_jax.engine.functions import stage_parts
from megatrain_jax.machines import Machine
from megatrain_jax.model import Execution, ModelConfig, make_block, make_stages

ASSUMED_MFU = 0.5  # fraction of the bf16 peak the device reaches (for the transfer-hiding figure)


def visible_keys(model: ModelConfig, seq_len: int, sliding: bool = True) -> float:
    """The mean number of keys a query attends to in a causal sequence of seq_len tokens, in a
    layer with the model's sliding window (sliding=False: a full-attention layer of
    model.layer_types): (T + 1) / 2 without one."""
    window = min((model.sliding_window if sliding else 0) or seq_len, seq_len)
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops(model: ModelConfig, seq_len: int, sliding: bool | None = None) -> float:
    """Forward FLOPs per token of causal attention as the device runs it (QK^T and PV, 4 * heads *
    head_dim per visible key): of one layer with the model's sliding window (sliding=True) or
    without (False), or summed over the model's layers (None: model.layer_types, windowed if
    any)."""
    if sliding is None:
        kinds = model.layer_types or ("sliding_attention",) * model.num_layers
        return sum(attention_flops(model, seq_len, k == "sliding_attention") for k in kinds)
    return 4 * model.num_heads * model.head_size * visible_keys(model, seq_len, sliding)


# Passes of one layer's attention kernel, forward-pass units, in the block's forward call and in its
# backward call (the block recomputed, then its VJP: a flash backward is 5 matmuls to the
# forward's 2, 2.5 units). Merged per query tile (attention.MergedTileAttention), each call's VJP
# runs its forward again and its backward twice (the cotangent and the log-sum-exp's correction),
# and one more forward gives P K: 1 + 1 + 2 * 2.5 + 1.
ATTENTION_PASSES = {"merged": (1.0, 8.0)}
FLASH_PASSES = (1.0, 3.5)


def executed_attention(model: ModelConfig, execution: Execution, seq_len: int) -> tuple:
    """(forward call, backward call) attention FLOPs per token of one layer, on average over the
    model's layers, as `execution` runs them at seq_len tokens: blockwise flash attention computes
    every key block pair its schedule visits whole (the diagonal blocks' masked halves, a window's
    blocks), padded to its blocks; cuDNN, causally, the keys a query sees (its own blocks are
    smaller); XLA's dense attention every key. The backward call recomputes the forward."""
    T = seq_len
    kinds = model.layer_types or ("sliding_attention",) * model.num_layers
    per_key = 4 * model.num_heads * model.head_size
    how = execution.tiled if execution.tiles(T) else "untiled"
    if how == "blockwise" or (how == "untiled" and execution.attention == "blockwise"):
        # per query tile: blocks that divide the tile, the sequence padded to whole tiles
        bs, unit = ((execution.tile_block(), execution.tile_size) if how == "blockwise" else
                    (min(execution.attention_block, T),) * 2)
        blocks = -(-T // unit) * unit // bs
        keys = [_schedule_keys(blocks, bs, model.sliding_window if kind == "sliding_attention"
                               else 0) / T for kind in kinds]
    elif how == "untiled" and execution.attention == "xla":
        keys = [float(T)] * len(kinds)
    else:  # cuDNN, whole or merged per query tile
        keys = [visible_keys(model, T, kind == "sliding_attention") for kind in kinds]
    forward = per_key * sum(keys) / len(kinds)
    passes = ATTENTION_PASSES.get(how, FLASH_PASSES)
    return passes[0] * forward, passes[1] * forward


def _schedule_keys(blocks: int, block: int, window: int) -> int:
    """Query-key pairs the blockwise schedule computes over `blocks` blocks of `block` tokens:
    causally r + 1 key blocks for query block r, with a window the same c for every one."""
    per_row = -(-(window - 1) // block) + 1 if window else 0
    if per_row and per_row < blocks:
        return blocks * per_row * block * block
    return blocks * (blocks + 1) // 2 * block * block


def host_round_trips(model: ModelConfig, execution: Execution, seq_len: int) -> tuple:
    """(forward call, backward call) times one layer's block reads a value back to the host before
    it goes on, on XLA:GPU: each step of a loop whose trip count it learns only at run time (none
    here: tests/test_seqtile.py checks every loop's), and each conditional (the branch index
    read back): a layer's kind as data (model.layer_types) picks its attention by one, once per
    call untiled, once per group of query tiles where the block is tiled (the tiles two at a
    time, the middle one of an odd count alone), and in the backward both in the recompute and
    in the VJP."""
    if not model.layer_types:
        return 0, 0
    if not execution.tiles(seq_len):
        return 1, 2
    groups = -(-seq_len // execution.tile_size)
    groups = groups // 2 + groups % 2
    return groups, 2 * groups


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward and backward, the recompute not counted): 6 per
    matmul parameter (the input embedding is a lookup and does not count; the output projection
    does), plus causal attention's QK^T and PV, attention_flops forward, twice that backward.
    The numerator of MFU."""
    # a mixture of experts counts its routed experts only
    matmul = (model.num_active_params(include_embeddings=False)
              + model.hidden_size * model.vocab_size)
    return 6 * matmul + 3 * attention_flops(model, seq_len)


@dataclasses.dataclass(frozen=True)
class Counts:
    """What the plan and the step-time model need of a config, independent of the micro-batch
    shape: its units' parameters and the bytes of their elements and state."""
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
    accelerator: bool  # compute device apart from the host: fetches copy
    # the host update called directly (engine/direct.py): bus copies written in place, nothing
    # staged; else a jitted update whose bus copies an accelerator's staging buffers take first
    direct: bool = False
    stages_state: int = 0  # bytes of the stages' master weights and optax state
    layer_state: int = 0  # bytes of one layer's
    # distributed.shard_optimizer over P processes: each holds ~1/P of every unit's rows (master,
    # optax state, bus copy, gradient, staging; the zero padding rows are not counted)
    host_shards: int = 1
    # why the host lookup cannot serve the run whatever its shapes (engine/lookup.py's serves():
    # tied embeddings, data parallel; '' when it can)
    lookup_serves: str = ""
    lookup_setting: bool | None = None  # train.host_lookup as the engine takes it (None: auto)
    # the form of the layers' weights in and gradients out (offload.copies as the engine
    # resolves it: engine/transfer.py's copies_form): "eager" or "jit"
    copies: str = transfer.EAGER
    # how the layers' bus copies are kept (offload.bus as the plan resolves it: engine/bus.py):
    # "resident" (every unit's all step) or "ring" (prefetch + 2 layer buffers; the stages'
    # resident)
    bus: str = bus_lib.RESIDENT
    # elements of a layer's bus copy, fetched weights and gradient as they travel flat (the
    # engine's packing.Flat: its leaves end to end, each at an aligned offset); 0: leaf by leaf,
    # `layer` elements (packing.why_per_leaf)
    layer_flat: int = 0

    @property
    def params(self) -> int:
        """Parameters of the whole model: the stages' and every layer's."""
        return self.stages + self.layers * self.layer

    @property
    def layer_buffer(self) -> int:
        """Elements of a layer's bus copy, fetch or gradient, padding included."""
        return self.layer_flat or self.layer

    @property
    def buffers(self) -> int:
        """Elements of every unit's bus copy (or gradient): the stages' and every layer's."""
        return self.stages + self.layers * self.layer_buffer


def with_layers(c: Counts, layers: int) -> Counts:
    """The Counts of the same config with model.num_layers = layers. Every layer is one block
    shape, so only the number of layers and the optax state of all of them change (one layer's
    state is layer_state less its fp32 master weights)."""
    layer_optimizer = c.layer_state - 4 * c.layer
    return dataclasses.replace(c, layers=layers,
                               optimizer=c.optimizer + (layers - c.layers) * layer_optimizer)


@functools.lru_cache(maxsize=8)
def abstract_units(model: ModelConfig, execution: Execution) -> tuple:
    """(stages graph, stage params, block graph, block params, block Constants, StageParts) of
    the engine's units, with ShapeDtypeStruct leaves."""
    block_def, block, constants = stage_units.param_split(
        nnx.eval_shape(lambda: make_block(model, 0, 0, execution)), "block 0")
    stages_def, stages = stage_units.stages_split(
        nnx.eval_shape(lambda: make_stages(model, 0, execution)))
    example = np.zeros((1, 1), np.int32)  # which leaves a stage reads does not depend on shapes
    return (stages_def, stages, block_def, block, constants,
            stage_parts(stages_def, stages, example, example))


def _idle_expert_params(model: ModelConfig) -> int:
    """Parameters of one MoE layer's experts a token is not routed to."""
    idle = model.num_experts - model.experts_per_token if model.num_experts else 0
    return idle * 3 * model.hidden_size * model.intermediate_size


def counts(cfg: Config, execution: Execution, machine: Machine, *,
           optimizer: optax.GradientTransformation, lookup_setting: bool | None) -> Counts:
    """The Counts of `cfg` run with `execution` on `machine`, its units' optax state that of
    `optimizer` (recipes.build_optimizer's) and its host lookup `lookup_setting` (the engine's
    host_lookup: recipes.host_lookup_setting)."""
    _, stages, _, block, _, parts = abstract_units(cfg.model, execution)
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    leaves = jax.tree.leaves(stages)
    init = optimizer.init
    optimizer_bytes = lambda tree: sum(x.size * x.dtype.itemsize
                                       for x in jax.tree.leaves(jax.eval_shape(init, tree)))
    devices = (local_devices(cfg, machine) or 1) * cfg.distributed.num_processes
    disk = cfg.offload.tier == "disk"
    compute = jnp.dtype(cfg.train.compute_dtype)
    fp32 = compute == jnp.float32
    direct = update.why_not_direct(optimizer, disk) is None
    block_packing = packing.choose(  # as HostState takes it (bus.choose: the bus copy)
        block, stage=False, sharded=cfg.distributed.shard_optimizer and devices > 1,
        bus_is_params=machine.compute_on_host and fp32 and not disk, update_in_jit=not direct)
    return Counts(
        layers=cfg.model.num_layers, prefetch=cfg.train.prefetch,
        micro_batches=cfg.data.micro_batches, hidden=cfg.model.hidden_size,
        compute=compute.itemsize,
        grad=jnp.dtype(cfg.train.grad_dtype).itemsize, context=cfg.data.document_mask,
        layer=size(block), active_layer=size(block) - _idle_expert_params(cfg.model),
        first=size(parts.take("first", leaves)),
        last=size(parts.take("last", leaves)), stages=size(stages),
        # the stages as the engine's two units (each with its own scalar state, e.g. a count)
        optimizer=sum(map(optimizer_bytes, stage_units.split(stages)))
        + cfg.model.num_layers * optimizer_bytes(block),
        accelerator=not machine.compute_on_host,
        direct=direct,
        stages_state=4 * size(stages) + optimizer_bytes(stages),
        layer_state=4 * size(block) + optimizer_bytes(block),
        host_shards=cfg.distributed.num_processes if cfg.distributed.shard_optimizer else 1,
        lookup_serves=lookup.serves(devices > 1, parts,
                                    stage_units.indices(stage_units.split(stages)[0])),
        lookup_setting=lookup_setting, copies=copies_form(cfg, machine),
        layer_flat=block_packing.size if block_packing.flat else 0)


def copies_form(cfg: Config, machine: Machine) -> str:
    """offload.copies as the engine resolves it on `machine` (transfer.copies_form; a preset's
    accelerator has pinned_host memory, one on the CPU backend stands in for one as in tests).
    A setting that cannot run there is the engine's error, as a ConfigError."""
    devices = (local_devices(cfg, machine) or 1) * cfg.distributed.num_processes
    try:
        return transfer.copies_form(
            cfg.offload.copies, accelerator=not machine.compute_on_host,
            platform=machine.platform, pinned=not machine.compute_on_host,
            data_parallel=devices > 1, prefetch=cfg.train.prefetch)
    except ValueError as e:
        raise ConfigError(f"offload.{e}") from None


def local_devices(cfg: Config, machine: Machine) -> int:
    """The compute devices each process of `cfg` runs on, as distributed.devices picks them on
    `machine`: distributed.local_devices, or with 0 every accelerator (machine.devices) and one
    on a CPU-only machine; 0 where the machine's count is unknown (the plan assumes 1 and says
    so: devices_assumed)."""
    return cfg.distributed.local_devices or (1 if machine.compute_on_host else machine.devices)


def devices_assumed(cfg: Config, machine: Machine) -> str:
    """What the plan assumed of the device count ('' where it knows it: local_devices)."""
    if local_devices(cfg, machine):
        return ""
    return (f"distributed.local_devices 0 takes every accelerator, and {machine.name} gives no "
            f"device count: planned for 1 a process (with several the run is data parallel and "
            f"the first stage runs on the device); plan on the machine (--device local), pass "
            f"--devices or set distributed.local_devices")


def host_lookup_off(c: Counts, tokens: int) -> str:
    """Why the engine runs the first stage on the device ('' where it runs it on the host,
    engine/lookup.py) for micro-batches of `tokens` tokens: the engine's own rule
    (lookup.why_off) on the config's shapes, copies form and train.host_lookup."""
    rows = c.micro_batches * tokens * c.hidden * c.compute  # every micro-batch's, one way
    return lookup.why_off(c.lookup_setting, c.lookup_serves, rows, c.first, c.compute, c.grad,
                          in_calls=c.copies == transfer.JIT)


def host_lookup(c: Counts, tokens: int) -> bool:
    """Whether the engine runs the first stage on the host (host_lookup_off)."""
    return not host_lookup_off(c, tokens)


def tokens_to_hide(model: ModelConfig, counts: Counts, seq: int, machine: Machine,
                   offload: bool) -> int:
    """Tokens per step (all micro-batches pass a layer while its weights are there) for which a
    layer's compute takes as long as its transfers, in both directions and both passes, at
    ASSUMED_MFU of the bf16 peak. Per token and layer: forward 2 FLOPs per active parameter (a
    mixture of experts' routed experts, not all of them) plus causal
    attention (attention_flops); backward 6 per parameter (the block's
    recompute 2, its gradients 4) plus 3.5x the forward's attention (recompute 2 matmuls,
    flash backward 5). Transfers per layer: its weights in, each pass; in the backward its
    gradient out; offloaded activations out in the forward and in in the backward.
    0: nothing crosses a bus; -1: no number of tokens hides them."""
    if not counts.accelerator:
        return 0
    # The cheapest layer binds: a sliding one, unless model.layer_types makes every layer full.
    slides = not model.layer_types or "sliding_attention" in model.layer_types
    attention = attention_flops(model, seq, sliding=slides)
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
