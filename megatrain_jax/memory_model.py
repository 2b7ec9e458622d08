"""The memory model: the bytes a step holds at each moment of the engine's schedule, on the host
by kind and on the compute device by phase and kind, and each phase's working space.

It models what the engine does, not an idealisation of it (engine/step.py, stream.py, host.py):
the bytes held follow from the units' parameter counts (megatrain_jax.flops.Counts), and each
phase's working space is the compiled temp size (`memory_analysis()`) of the engine's own jitted
function for that phase, lowered on abstract arguments. tests/test_plan.py checks both against a
real engine.
"""

import functools

import jax
import jax.numpy as jnp

from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import schedule
from megatrain_jax.engine.functions import DeviceFunctions
from megatrain_jax.flops import Counts, abstract_units, host_lookup
from megatrain_jax.machines import GB, Machine
from megatrain_jax.model import Execution, ModelConfig

# XLA:CPU computes bf16 math in fp32: it converts bf16 operands to fp32, and its loop-invariant
# code motion then hoists whole-sequence fp32 copies (of a block's input, of K and V) out of the
# tile loops, which XLA:GPU, computing in bf16, has no reason to make. The bf16 estimate of a
# workspace is XLA:CPU's with that pass off: fp32 copies stay one tile in size.
_HOISTING_PASS = "while-loop-invariant-code-motion"
PHASES = ("embed", "forward", "loss", "backward", "embed backward")
# Beside each phase's function, workspaces that are no phase's: with the host lookup, the last
# unit's gradient leaves and their sums of squares (f.last_unit), made at the loss for the host
# thread's global norm once the head's call has ended; on the device path, the stages' gradient
# merged from its two parts, its sum of squares and the global norm (f.stages), after the
# embedding's backward
LOSS_SQUARES = "loss squares"
STAGES = "stages"
DEVICE_KINDS = ("inputs", "weights", "gradients", "activations", "cotangents", "workspace")


# -----------------------------------------------------------------------------
# the engine's functions, abstractly


@functools.lru_cache(maxsize=8)
def _device_functions(model: ModelConfig, execution: Execution, grad_dtype: str):
    stages_def, stages, block_def, _, _, parts = abstract_units(model, execution)
    return DeviceFunctions(stages_def, jax.tree.structure(stages), parts, block_def,
                           jnp.dtype(grad_dtype))


@functools.lru_cache(maxsize=64)
def workspace_bytes(model: ModelConfig, execution: Execution, compute_dtype: str, grad_dtype: str,
                    batch: int, seq: int, document_mask: bool, device, hoisting: bool = False,
                    micro_batches: int = 1) -> dict:
    """Phase -> temp bytes of the engine's jitted function for that phase on `micro_batches`
    micro-batches of (batch, seq), stacked, compiled for `device` with the argument shapes and
    dtypes the step passes, and LOSS_SQUARES, STAGES -> the temp bytes of the host lookup's last
    unit's gradient at the loss, of the device path's stages' gradient after the embedding's
    backward. On XLA:CPU, LLVM's optimisation level does not change buffer assignment: it is
    turned off, halving the compile time; so is loop-invariant code motion unless `hoisting` (the
    bf16 estimate, see _HOISTING_PASS)."""
    _, stages, _, block, constants, parts = abstract_units(model, execution)
    f = _device_functions(model, execution, grad_dtype)
    sharding = jax.sharding.SingleDeviceSharding(device)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    like = lambda tree, dtype: jax.tree.map(lambda p: sds(p.shape, dtype), tree)
    c = jnp.dtype(compute_dtype)
    leaves = jax.tree.leaves(stages)
    first, last = parts.take("first", leaves), parts.take("last", leaves)
    stacked = (micro_batches, batch, seq)
    tokens, x = sds(stacked, jnp.int32), sds(stacked + (model.hidden_size,), c)
    context = {"segment_ids": tokens, "positions": tokens} if document_mask else None
    layer = (like(block, c), jax.tree.map(lambda k: sds(k.shape, k.dtype), constants))
    scalar = sds((), jnp.float32)
    # the stages' leaves as one unit holds them: every leaf (the device path); the last's alone
    held = lambda indices: tuple((i, tuple(leaves[i].shape)) for i in indices)
    calls = {"embed": (f.embed, (like(first, c), tokens)),
             "forward": (f.layer_fwd, (None, None, layer, x, context)),
             "loss": (f.head, (like(last, c), x, tokens)),
             "backward": (f.layer_bwd, (None, None, layer, x, context, x, None)),
             "embed backward": (f.embed_bwd, (None, None, like(first, c), tokens, x)),
             # the last unit's leaves: the last stage's (untied, where the lookup serves)
             LOSS_SQUARES: (f.last_unit, (like(last, jnp.float32), held(parts.last))),
             STAGES: (f.stages, (like(first, jnp.float32), like(last, jnp.float32),
                                 [scalar] * model.num_layers, scalar,
                                 held(range(len(leaves))), None))}
    options = {}
    if device.platform == "cpu":
        options = {"xla_backend_optimization_level": 0,
                   **({} if hoisting else {"xla_disable_hlo_passes": _HOISTING_PASS})}
    return {phase: fn.lower(*args).compile(compiler_options=options).memory_analysis()
            .temp_size_in_bytes for phase, (fn, args) in calls.items()}


def compile_device(platform: str):
    """A local device of `platform` to compile for, else the CPU."""
    return next((d for d in jax.local_devices() if d.platform == platform),
                jax.local_devices(backend="cpu")[0])


# -----------------------------------------------------------------------------
# bytes at each moment of a step


def optimizer_state_bytes(c: Counts) -> int:
    """Bytes of every unit's optax state, as the optimizer's init makes it (AdamW: m and v in
    fp32, 8 B/param, and a step count per unit)."""
    return c.optimizer


def bus_params(c: Counts) -> int:
    """The parameters that have a bus copy at the step's peak: every unit's (resident), or with
    the bus ring (c.bus "ring", engine/bus.py's Ring) the stage units' and the ring's slots,
    each the size of a layer."""
    if c.bus == bus_lib.RING:
        return c.stages + bus_lib.ring_size(c.prefetch) * c.layer
    return c.params


def bus_bytes(c: Counts, tokens: int) -> int:
    """Bytes of the bus copies (the weights in the compute dtype that the device fetches) the
    host holds: every unit's, all step, 2 B/param in bf16, or the stages' and the ring's
    (bus_params). Where the compute dtype is fp32 there is none on a CPU-only run (the bus copy
    is the master), and with the host lookup unit 0's is its master weights
    (HostState._is_params)."""
    if not c.accelerator and c.compute == 4:
        return 0
    return c.compute * (bus_params(c) - (host_lookup(c, tokens) and c.compute == 4) * c.first)


def host_bytes(c: Counts, tokens: int, offload: bool) -> dict:
    """Kind -> bytes of host RAM at the end of a step, `tokens` per micro-batch.

    The bus copies and the step's gradients are both counted: on a GPU the bus copies (and
    offloaded activations) live in XLA's pinned host pool, a BFC allocator that keeps what it
    has grown to. (On a CPU-only run the released bus copies make room for the gradients.)
    With the host lookup (flops.host_lookup) unit 0's bus copy is in host memory instead
    (pinned_bytes), and so not staged. The host thread's compiled temps are not counted (the
    host lookup's sum of squares of unit 0's gradient takes none on XLA:CPU)."""
    share = lambda n: -(-n // c.host_shards)  # this process's rows of the state
    lookup = host_lookup(c, tokens)
    # every unit's, waiting for the global norm. The device path: the stages' first and last
    # parts, then their merged sum. The host lookup: the last unit's once, and on the host
    # thread the rows' gradient, the table's dense fp32 gradient the host scatter-adds it into,
    # and unit 0's gradient made from that (engine/lookup.py's HostBackward): in fp32 the same
    # buffer (lookup.unit0_gradient), else a cast beside it
    accumulator = 4 * c.first * (c.grad != 4)
    stage_grads = (c.grad * c.stages + accumulator + activation_bytes(c, tokens) if lookup
                   else c.grad * (c.first + c.last + c.stages))
    return {
        "master": share(4 * c.params),
        "optimizer": share(optimizer_state_bytes(c)),
        "bus": share(bus_bytes(c, tokens)),
        "gradients": share(c.grad * c.layers * c.layer + stage_grads),
        # (the jit path's update writes a bus copy there first; the ring's layers have none)
        "staging": (share(c.compute * (c.stages - lookup * c.first
                                       + c.layer * (c.bus != bus_lib.RING)))
                    if c.accelerator and not c.direct else 0),
        "activations": c.layers * activation_bytes(c, tokens) if offload else 0,
    }


def pinned_bytes(c: Counts, tokens: int, host: dict) -> int:
    """The bytes of `host` (host_bytes' result) in the compute device's pinned host memory: the
    bus copies but unit 0's with the host lookup (this process's rows), offloaded
    activations."""
    params = bus_params(c) - host_lookup(c, tokens) * c.first
    return -(-c.compute * params // c.host_shards) + host["activations"]


def host_bytes_on_disk(c: Counts, tokens: int, offload: bool, read_ahead: int) -> dict:
    """`host_bytes` with offload.tier=disk (engine/tier.py): no master weights or optax state in
    RAM, a bus copy even in fp32, and the units in flight: read_ahead read buffers, the unit
    being updated (its read buffer, which its arrays alias, and the update's outputs) and up
    to read_ahead written behind (at least 1), the buffers from one pool; the stages' own
    buffers (one read, one written) stay pooled besides their arrays while they are
    updated."""
    return {**host_bytes(c, tokens, offload), "master": 0, "optimizer": 0,
            "bus": c.compute * c.params,
            "tier buffers": 3 * c.stages_state
            + (read_ahead + max(1, read_ahead) + 2) * c.layer_state}


def activation_bytes(c: Counts, tokens: int) -> int:
    """One layer's activations (input or output) for all micro-batches."""
    return c.micro_batches * tokens * c.hidden * c.compute


def device_bytes(c: Counts, tokens: int, offload: bool, workspace: dict) -> dict:
    """Phase -> kind -> bytes on the compute device at the phase's peak, `tokens` per
    micro-batch: the arrays the step holds right after its largest call in the phase, plus that
    call's compiled temp bytes (workspace). With the host lookup (flops.host_lookup) the inputs
    stay on the host, the embed phases run no device function and fetch no weights (the rows
    cross, their gradient goes out), and the head's gradient goes out at the loss."""
    L, p, act = c.layers, c.prefetch, activation_bytes(c, tokens)
    weights = lambda params: params * c.compute if c.accelerator else 0  # no copy
    lookup = host_lookup(c, tokens)
    # int32 token ids: inputs (on the host with the lookup), targets, document masks' context
    inputs = c.micro_batches * tokens * 4 * ((4 if c.context else 2) - lookup)

    def moment(phase=None, **kinds):
        kinds = {"inputs": inputs, **kinds, "workspace": workspace[phase] if phase else 0}
        return {k: int(kinds.get(k, 0)) for k in DEVICE_KINDS}

    # The head's fp32 gradient stays on the device from the loss until the stages' gradient
    # is merged after the embedding's backward (the host lookup: it goes out at the loss, after
    # its leaves are made in train.grad_dtype with the head's input freed).
    # Layers resident: engine/schedule.py's. A layer's call accumulates its gradient in fp32
    # inside (its workspace) and returns it in train.grad_dtype.
    head = 0 if lookup else 4 * c.last
    out = c.layer * c.grad  # a layer's gradient, made
    forward, backward = [], []
    resident = schedule.resident(L, p, c.copies)
    overlapped = schedule.overlapped(L, p, c.copies)
    for pos in range(L):
        n = resident[pos]
        # saved: every earlier layer's input and this one's, plus its outputs; offloaded:
        # this layer's inputs and outputs, and the one before's inputs until it retires
        forward.append(moment("forward", weights=n * weights(c.layer),
                              activations=(2 + overlapped[pos] if offload else pos + 2) * act))
        # saved: this layer's inputs and every earlier one's; offloaded: those fetched back
        backward.append(moment("backward", weights=n * weights(c.layer),
                               # the layer's, and the one before's while it goes out
                               gradients=(1 + overlapped[pos]) * out + head,
                               activations=(n if offload else L - pos + overlapped[pos]) * act,
                               cotangents=act))
    loss = [moment("loss", weights=weights(c.last), gradients=4 * c.last,
                   activations=(1 if offload else L + 1) * act, cotangents=act)]
    if lookup:  # its leaves for the host made, and their sums of squares: the last unit's
        # gradient twice, no head input
        loss.append(moment(LOSS_SQUARES, gradients=4 * c.last + c.grad * c.last,
                           activations=0 if offload else L * act, cotangents=act))
    # The jit form: layer 0's gradient stays on the device until it goes out inside the
    # embedding backward's call (the host lookup: out at once, eagerly). The stages' gradient,
    # merged from its two parts' after that call, is made in pinned host memory in the jit form,
    # else on the device, where it waits to go out
    jit = c.copies == schedule.JIT and c.accelerator
    leaving = out if jit else 0
    parts = 4 * (c.first + c.last)
    embed_backward = [moment("embed backward", weights=weights(c.first),
                             gradients=parts + leaving, cotangents=act),
                      moment(STAGES, gradients=parts + (0 if jit else c.grad * c.stages))]
    return {
        "embed": (moment(activations=act) if lookup else
                  moment("embed", weights=weights(c.first), activations=act)),
        "forward": max(forward, key=lambda m: sum(m.values())),
        "loss": max(loss, key=lambda m: sum(m.values())),
        "backward": max(backward, key=lambda m: sum(m.values())),
        "embed backward": (moment(cotangents=act) if lookup else
                           max(embed_backward, key=lambda m: sum(m.values()))),
    }


def peak_bytes(device: dict) -> int:
    """The largest phase's total of device_bytes' result."""
    return max(sum(kinds.values()) for kinds in device.values())


def fits(host_total: int, device_peak: int, machine: Machine) -> bool:
    """Whether host RAM and the device peak fit the machine (one memory on a CPU-only run)."""
    if machine.compute_on_host:  # one memory for both
        return host_total + device_peak <= machine.host_memory_gb * GB
    return (host_total <= machine.host_memory_gb * GB
            and device_peak <= machine.device_memory_gb * GB)
