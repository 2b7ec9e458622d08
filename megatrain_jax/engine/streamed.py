"""`StreamedEngine`: the public face of the engine (construction, one step, evaluation, reading
state)."""

import logging
import math
import threading
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import evaluate as evaluate_lib
from megatrain_jax.engine import fused_adamw, lookup
from megatrain_jax.engine import step, transfer
from megatrain_jax.engine.functions import DeviceFunctions, stage_parts
from megatrain_jax.engine.host import HostState
from megatrain_jax.engine.parallel import Placement
from megatrain_jax.engine.stage_units import param_split, stages_split
from megatrain_jax.engine.stream import Activations, Counters
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.engine.transfer import Transfers

log = logging.getLogger(__name__)


class StreamedEngine:
    """Trains `last(blocks(first(inputs)), targets)` with all state in host memory.

    Args:
      first: the first stage, called as `first(inputs) -> x` (e.g. token embedding).
      last: the last stage, called as `last(x, targets)`, returning a scalar mean loss or a pair
        `(loss_sum, weight)` (e.g. the summed cross-entropy and the number of counted tokens; the
        step's loss is then sum(loss_sum) / sum(weight) over its micro-batches), or a triple
        `(loss_sum, weight, stats)`, stats a pytree of fp32 sums to report (not differentiated),
        summed over the micro-batches. It may share
        variables with `first` (tied embeddings): shared variables get the sum of both gradients.
      make_block: `make_block(i) -> nnx.Module`, layer i's block, all of one structure, called as
        `block(x)`, or `block(x, context)` when `train_step` is given a context. Called once per
        layer at construction, under the host device, so the stack is never built whole on the
        accelerator. Blocks (and stages) may hold only `nnx.Param` state, and blocks per-layer
        `Constant`s (stage_units.py: data beside the weights that no optimizer sees, e.g. a
        layer's kind; `block_constants`). A block may return
        `(x, aux)`, aux a pytree of per-layer fp32 statistics that add up over tokens (e.g. a
        mixture of experts' router counts): then `aux_loss` is required.
      aux_loss: `aux_loss(total) -> scalar`, total the sum of every layer's aux over the layers
        and micro-batches (so micro-batches equal one big batch); added to the step's loss and
        differentiated into each layer's backward (see engine/functions.py).
      num_layers: how many blocks.
      optimizer: any optax GradientTransformation, applied unit by unit on the host. Do not put
        `optax.clip_by_global_norm` in it: a per-unit norm is not the global one; use
        `max_grad_norm`, which clips exactly as `clip_by_global_norm` over the whole model.
      max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
      compute_dtype: dtype of the bus copy and of device compute (bf16 default; fp32 is exact).
      grad_dtype: dtype in which each unit's gradient (accumulated in fp32 on the device) crosses
        to the host and waits there for the global norm; fp32 (default) is exact, bf16 halves its
        bytes each way and its host memory (the norm is taken in fp32).
      prefetch: how many layers' weights are in flight ahead of the one computing; at most
        `prefetch + 1` layers' weights (and saved activations) are on the device at once.
      offload_activations: keep each layer's saved input in the compute device's pinned host
        memory between the forward and the backward, so the device holds O(prefetch) layers of
        activations instead of all of them.
      compute_device / host_device: where blocks run / where state lives and the optimizer runs.
        Defaults: the default device, and the first CPU device.
      disk_tier: DiskTierOptions: each unit's master weights and optax state live in a file
        under its path between updates (engine/tier.py); host RAM keeps the bus copies and a few
        units in flight. Training is bit-identical to keeping them in RAM (None, the default).
      compute_devices: data parallel over several devices instead of compute_device (the compute
        devices of every process, in mesh order; see parallel.py): each micro-batch's rows are
        split over them, each gets every layer's weights, and each unit's gradient is summed over
        them on the devices before it crosses to the host. A micro-batch's rows must divide by
        their number. The host state and its update are as with one device.
      shard_host_state: with compute_devices (several), each process keeps only its rows of
        every unit's master weights and optax state (~1 / processes of the host state; the layout
        is in engine/shard.py): each device is sent its rows of a unit (1 / devices of its bytes)
        and the devices all-gather them, each gradient is reduce-scattered so only this process's
        rows cross to the host, and the update runs on those rows alone. The optimizer must
        therefore be elementwise (adam, adamw, sgd, lion, ...: no per-tensor statistics such as
        adafactor's or a per-tensor norm), and every parameter must have at least one dimension.
        `state()` and `params()` are this process's rows (zero-padded; `param_shapes()` gives the
        whole shapes). Not with the disk tier. Training equals the replicated layout.
      host_lookup: run the first stage on the host device when it shares no variable with the
        last (an untied embedding) and there is one compute device (engine/lookup.py): the
        embedding's rows cross, its table never does, and only the rows' gradient comes back.
        None (default): never with copies made inside the jitted calls (`copies`: the device's
        copies of the table then ride beside compute, while the host backward would end every
        step with the device idle), else where it moves fewer bytes a step than the table's two
        fetches and its gradient (decided at the first step, from its shapes: lookup.why_off);
        True: wherever it serves; False: never. Where it does not run the first stage runs on the device, and the log says why.
        Training equals the device path.
      host_update: how the host update runs. "auto" (default): with fused_adamw.adamw (the
        project's AdamW) and its kernel built, the kernel called directly on numpy state the
        engine owns (engine/direct.py: each gradient read where the device wrote it, each bus copy
        written in place), else a jitted update per unit; "direct": the direct update or an error
        saying why it cannot run; "jit": a jitted update per unit (the kernel through jax.ffi, or
        optax). The log says which. The direct and jit paths give the same bits.
      host_threads: the fused AdamW kernel's threads (None, default: one per CPU of the process's
        affinity, as measured fastest for the update alone). Fewer are pinned to the first CPUs,
        the update's own thread among them, so the rest stay free for the thread that dispatches
        the device's work. A process has one kernel pool: the last engine built sets it. Outside
        [1, the CPUs], or where the kernel does not run: a ValueError line.
      copies: how a layer's weights come in and its gradient goes out (engine/step.py). "eager":
        each a `device_put` of its own between the jitted calls; "jit": made inside the jitted
        calls, beside their compute (the next layer's fetch inside this layer's first call, the
        previous layer's gradient out in it too; transfer.with_copies); "auto" (default): jit on
        an accelerator (not a CPU device) with pinned_host memory and one compute device, with
        prefetch >= 1, else eager. "jit" where it cannot run (no accelerator apart from the host
        device, no pinned_host memory, data parallel, prefetch 0): a ValueError saying why. Both
        forms give the same bits.
      bus: how the layers' bus copies (their weights in the compute dtype, which the fetches
        read) are kept. "resident": every unit's, all step (2 B/param in bf16); "ring": the layer
        units' in a ring of prefetch + 2 buffers, each filled from the fp32 master weights just
        before its fetch (forward and backward), the stage units' resident (engine/bus.py's
        Ring); the update then writes no layer bus copy. "auto" (default): the ring where the
        resident copies do not fit the GPU's pinned host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)
        and the ring does, else resident (a run passes its plan's choice, which also weighs host
        RAM). Not with the disk tier, data parallel, or fp32 compute with no accelerator. The log
        says which and why. Both give the same bits.

    A step whose gradient is not finite changes nothing (see `train_step`); a step that raises
    leaves the state as it was before it.
    """

    def __init__(self, *, first: nnx.Module, last: nnx.Module, make_block: Callable[[int], nnx.Module],
                 num_layers: int, optimizer: optax.GradientTransformation,
                 max_grad_norm: Optional[float] = None, compute_dtype=jnp.bfloat16, prefetch: int = 1,
                 compute_device=None, host_device=None, grad_dtype=jnp.float32,
                 offload_activations: bool = False, aux_loss: Optional[Callable] = None,
                 disk_tier: Optional[DiskTierOptions] = None, compute_devices=None,
                 shard_host_state: bool = False, host_lookup: Optional[bool] = None,
                 host_update: str = "auto", copies: str = "auto", bus: str = "auto",
                 host_threads: Optional[int] = None):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        if not jnp.issubdtype(jnp.dtype(grad_dtype), jnp.floating):
            raise ValueError(f"grad_dtype must be a floating dtype, got {jnp.dtype(grad_dtype)}")
        self.num_layers = num_layers
        self.prefetch = prefetch
        self.counters = Counters()
        self.placement = Placement(compute_devices or [compute_device or jax.local_devices()[0]],
                                   shard=shard_host_state, put=self.counters.put)
        self.compute_device = self.placement.local_devices[0]
        self.host_device = host_device or jax.local_devices(backend="cpu")[0]
        if self.placement.data_parallel and self.host_device in self.placement.devices:
            raise ValueError(f"the host device {self.host_device} is one of the data-parallel "
                             f"compute devices; give the host state a device of its own")
        self.compute = self.placement.weights  # where fetched weights go
        self.host_sharding = jax.sharding.SingleDeviceSharding(self.host_device)
        self.transfers = Transfers(self.placement, self.host_device, self.counters)
        self.copies = transfer.copies_form(
            copies, accelerator=self.transfers.accelerator,
            platform=self.compute_device.platform,
            pinned=self.transfers.out_kind == transfer.PINNED,
            data_parallel=self.placement.data_parallel, prefetch=prefetch)
        log.info("weights in and gradients out: %s", "copies made inside the jitted calls"
                 if self.copies == transfer.JIT else "eager copies")
        self.activations = Activations(self.compute_device, offload_activations, self.transfers,
                                       self.placement.batch)
        # Called as on_phase(phase, layer=None) after each unit's work is dispatched (phases:
        # embed, forward, loss, backward, embed backward): for tests and instrumentation.
        self.on_phase = None
        # Called as on_event(kind, what, layer) by each pass's LayerStream as it dispatches a
        # layer's work ("dispatch", the pass) and before it waits for one ("wait", the pass), by
        # the transfers as each copy is enqueued ("transfer", e.g. "gradient out", None), and on
        # the host thread as each unit's update starts ("update", "first stage" / "layer" /
        # "last stage", the layer or None): for tests and instrumentation.
        self.on_event = None

        with jax.default_device(self.host_device):
            self._stages_def, stages = stages_split((first, last))
        self.block_constants = []  # per layer: its Constants, a pure dict (empty: none)

        def blocks():  # one at a time: the disk tier never holds the whole model in RAM
            with jax.default_device(self.host_device):
                for i in range(num_layers):
                    graphdef, params, constants = param_split(make_block(i), f"block {i}")
                    if i == 0:
                        self._block_def, structure = graphdef, jax.tree.structure(params)
                    elif graphdef != self._block_def or jax.tree.structure(params) != structure:
                        raise ValueError(f"block {i} differs in structure from block 0; all "
                                         "streamed blocks must share one structure")
                    self.block_constants.append(constants)
                    yield params

        self.host = HostState(stages, blocks(), optimizer, max_grad_norm=max_grad_norm,
                              compute_dtype=compute_dtype, grad_dtype=grad_dtype,
                              compute_device=self.compute_device, host_device=self.host_device,
                              counters=self.counters, num_blocks=num_layers,
                              disk_tier=disk_tier, shards=self.placement.shards,
                              host_update=host_update, bus_form=bus, prefetch=prefetch,
                              data_parallel=self.placement.data_parallel,
                              pinned_pool=(bus_lib.pinned_pool_bytes()
                                           if self.compute_device.platform == "gpu"
                                           and self.transfers.out_kind == transfer.PINNED
                                           else None),
                              host_threads=host_threads)
        del stages
        # kept on the compute device for the run (a few numbers a layer), each passed beside its
        # layer's weights
        self._constants_on_device = [self.placement.put_weights(c) for c in self.block_constants]
        self.bus = self.host.buses.form
        ring = self.host.buses.ring
        log.info("bus copies: %s (%s)", f"the layers' in a ring of {len(ring.slots)} buffers, the "
                 f"stages' resident" if ring else "every unit's resident", self.host.buses.why)
        # where the plan counts them: bus copies in the compute device's pinned host memory
        try:
            self.transfers.check(self.host.buses.example(self.host.units),
                                 self.host.bus_sharding.memory_kind)
        except BaseException:
            self.host.close()  # its thread and the disk tier's files
            raise
        self.parts = self.functions = None  # built at the first step, from its shapes
        # asked for (None: where it saves bytes); decided at the first step (_choose_lookup):
        # None until then
        self._host_lookup, self.host_lookup = host_lookup, None
        self.first_stage = None  # lookup.HostFirst or DeviceFirst, with host_lookup
        self.unit_sq = None
        self._broken = None
        self._closed = False
        self.aux_loss = aux_loss

    # ----------------------------------------------------------------- one step
    def device_functions(self, inputs, targets) -> DeviceFunctions:
        """The jitted device functions for micro-batches shaped like inputs[0], targets[0]
        (arrays or jax.ShapeDtypeStruct), e.g. to compile them and read `memory_analysis()`."""
        if self.functions is None:
            stages = self.param_shapes()["stages"]  # whole shapes, whatever the host layout
            self.parts = stage_parts(self._stages_def, stages, inputs, targets)
            self.functions = DeviceFunctions(self._stages_def, jax.tree.structure(stages),
                                             self.parts, self._block_def, self.host.grad_dtype,
                                             self.aux_loss, self.placement, self.counters,
                                             self.copies, packing=self.host.packing(1))
        return self.functions

    def _choose_lookup(self, inputs):
        """Whether the first stage runs on the host (engine/lookup.py), for the whole run, from
        the shapes of its first step's inputs (jax.ShapeDtypeStruct, the micro-batches stacked;
        lookup.why_off: the plan's rule too)."""
        host, first = self.host, self.parts.first
        weights = [jax.ShapeDtypeStruct(host.shapes[0][i], host.compute_dtype) for i in first]
        rows = jax.eval_shape(self.functions.host_embed, weights, inputs)
        why = lookup.why_off(
            self._host_lookup, lookup.serves(self.placement.data_parallel, self.parts,
                                             host.stage_leaves(0)),
            rows_bytes=rows.size * rows.dtype.itemsize,
            table=sum(math.prod(host.shapes[0][i]) for i in first),
            compute_bytes=host.compute_dtype.itemsize, grad_bytes=host.grad_dtype.itemsize,
            in_calls=self.copies == transfer.JIT)
        self.host_lookup = not why
        self.first_stage = (lookup.HostFirst(fused_adamw.kernel()) if self.host_lookup
                            else lookup.DeviceFirst())
        if self.host_lookup:
            self.host.keep_bus_on_host(0)
        elif self._host_lookup:  # asked for: said where the user sees it
            log.warning("host_lookup=True does not apply (host lookup off: %s); the first stage "
                        "runs on the device", why)
        elif self._host_lookup is None:
            log.info("host lookup off: %s; the first stage runs on the device", why)

    def train_step(self, inputs, targets, context=None) -> dict:
        """One optimizer step over M micro-batches: `inputs`, `targets` are (M, ...) arrays;
        `context` (optional) a pytree of (M, ...) arrays given to every block with its
        micro-batch, e.g. document segment ids and positions.

        `targets` may be a pytree of (M, ...) arrays: `last` gets each micro-batch's slice of it.
        The loss is sum(loss_sum) / sum(weight) over the micro-batches (see `last`), so the step
        equals one step on the concatenated batch. When `last` returns (loss_sum, weight, stats),
        `stats` holds their sum over the micro-batches. Returns `loss` and `grad_norm` (the global norm
        before clipping) as scalars still being computed; reading them is the caller's only sync
        point, except with the host lookup (engine/lookup.py), where the step returns once the
        host thread has made the global norm (the next step's first stage would wait for that
        unit's update all the same). With an `aux_loss`, `loss` includes it and `aux_loss` holds it alone. When
        `grad_norm` is not finite the step leaves params and optimizer state unchanged
        (`nonfinite_units()` then says where). If the step raises, the state is as before it
        (a Ctrl-C just after its updates were queued: as after it; they are queued all or none).
        """
        result, self.unit_sq = self._run(step.run, inputs, targets, context)
        return result

    def evaluate(self, inputs, targets, context=None) -> dict:
        """The loss of M micro-batches at the current weights, forward only (shapes as in
        `train_step`): `{"loss_sum", "weight", "loss"}` with loss = sum(loss_sum) / sum(weight),
        scalars still being computed.

        The weights stream layer by layer as in a step's forward (each unit once its pending host
        update has finished); no gradient, no saved activations, and params and optimizer state
        are left exactly as they were. Reuses the step's compiled functions: nothing compiles
        after the first evaluation."""
        return self._run(evaluate_lib.run, inputs, targets, context)

    def forward_outputs(self, inputs, targets, output: Callable, context=None) -> list:
        """Forward only, as `evaluate`, but instead of the loss returns
        `[output(last, x, targets[m]) for each micro-batch m]`: `last` the last stage module at the
        current weights, x its input (the last block's output). E.g. per-sequence scores of a
        frozen model. `output` may read the weights `last` reads; it is compiled once per
        function and shape (pass the same function object to reuse it). Results are still being
        computed, on the compute device."""
        run = lambda sp, i, t, c: evaluate_lib.outputs(sp, i, t, c, output)
        return self._run(run, inputs, targets, context)

    def _run(self, schedule, inputs, targets, context):
        """schedule(the step's parts, inputs, targets, contexts) on the batch put on the device
        (step.StepParts, made here: the hooks may change between calls). If it raises,
        the saved activations are dropped and the state is as before (or, raised after the
        step's updates were queued, as after it: they are queued all or none); a host update
        that failed leaves the engine unusable, saying which, as does a bus ring slot whose
        reader's computation failed (its state can still be read)."""
        self._check_open()
        if self._broken:
            raise RuntimeError(f"the engine is unusable: {self._broken}")
        self.transfers.on_event = self.on_event and (lambda kind, what: self.on_event(kind, what,
                                                                                      None))
        self.host.on_update = self.on_event and self._update_event
        self.counters.dispatcher = threading.get_ident()  # what it counts is this thread's
        shape = lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)  # of a micro-batch
        self.device_functions(shape(inputs), jax.tree.map(shape, targets))
        if self.host_lookup is None:
            self._choose_lookup(jax.ShapeDtypeStruct(np.shape(inputs), inputs.dtype))
        inputs, targets, contexts = self._put_batch(inputs, targets, context)
        try:
            return schedule(self._step_parts(), inputs, targets, contexts)
        except BaseException as e:
            self.activations.clear()
            self._broken = self.host.failure() or (
                e.cause if isinstance(e, bus_lib.ReaderFailed) else None)
            raise

    def _step_parts(self) -> step.StepParts:
        return step.StepParts(
            host=self.host, transfers=self.transfers, functions=self.functions,
            placement=self.placement, parts=self.parts, activations=self.activations,
            num_layers=self.num_layers, prefetch=self.prefetch, copies=self.copies,
            first=self.first_stage, constants=self._constants_on_device,
            on_phase=self.on_phase, on_event=self.on_event)

    def _update_event(self, u: int):
        on_event = self.on_event  # (the caller may unset it while updates are still queued)
        if on_event is None:
            return
        if u in (0, self.host.last):
            on_event("update", "first stage" if u == 0 else "last stage", None)
        else:
            on_event("update", "layer", u - 1)

    def _put_batch(self, inputs, targets, context):
        """(inputs, targets, contexts), the micro-batches stacked, on the compute device (with
        the host lookup, the inputs on the host device); contexts None without a context."""
        rows, devices = np.shape(inputs)[1], self.placement.size // jax.process_count()
        if rows % devices:
            raise ValueError(f"a micro-batch of {rows} rows does not split over this process's "
                             f"{devices} compute devices")
        put = self.transfers.batch_in  # one copy of them all
        if self.host_lookup:
            return (self.transfers.batch_to_host(inputs), *put((targets, context)))
        return put((inputs, targets, context))

    def nonfinite_units(self, unit_sq=None) -> list:
        """Units whose gradient in the last step was not finite: "stages" or a layer index.
        unit_sq: an earlier step's `unit_sq` (its units' sums of squares, kept as it ended)."""
        unit_sq = self.unit_sq if unit_sq is None else unit_sq
        if unit_sq is None:
            return []
        bad = [u for u, sq in enumerate(unit_sq) if not jnp.isfinite(sq)]
        stages = {0, self.host.last} & set(bad)
        return ["stages"] * bool(stages) + [u - 1 for u in bad if u not in stages]

    def apply_gradients(self, grads: dict, grad_norm, scale):
        """Queues the host update of each unit in `grads`, {unit: its gradient}, as a step's end
        queues its own: each unit's bus copy released (its last use in a step), then their
        updates as one job on the host thread, in the order given (`wait()` waits for them). A
        unit is an index into `unit_shapes()`; its gradient, of the unnormalised loss sum, a tree
        shaped as that unit's params, in float32 or `grad_dtype`, on the host device or in the
        compute device's pinned host memory (where a step leaves it), which the update may take
        over. Each is scaled by `scale`, clipped to `max_grad_norm` by `grad_norm` (the global
        norm of the scaled gradient: the caller's word for it), and a `grad_norm` that is not
        finite changes nothing. For measuring and testing the host update alone
        (scripts/bench_optimizer.py); a unit or a gradient that does not fit is one ValueError
        line, nothing queued."""
        self._check_open()
        shapes = self.unit_shapes()
        for u, g in grads.items():
            if not (isinstance(u, (int, np.integer)) and not isinstance(u, bool)
                    and 0 <= u < len(shapes)):
                raise ValueError(f"apply_gradients: unit {u!r} is not one of 0 to "
                                 f"{len(shapes) - 1} (unit_shapes())")
            want = [x.shape for x in jax.tree.leaves(shapes[u])]
            if (jax.tree.structure(g) != jax.tree.structure(shapes[u])
                    or [tuple(np.shape(x)) for x in jax.tree.leaves(g)] != want):
                raise ValueError(f"apply_gradients: unit {u}'s gradient is not shaped as its "
                                 f"params (unit_shapes()[{u}])")
        for u in grads:
            self.host.release_bus(u)
        self.host.submit_all(list(grads.items()), grad_norm, scale)

    # ----------------------------------------------------------------- reading state
    def wait(self):
        """Blocks until every pending host update has finished."""
        self._check_open()
        try:
            self.host.wait()
        except BaseException as e:
            self._broken = self.host.failure() or (None if isinstance(e, KeyboardInterrupt) else
                                                   f"waiting for the host updates failed "
                                                   f"({type(e).__name__}: {e})")
            raise

    @property
    def stages_graphdef(self):
        return self._stages_def

    @property
    def block_graphdef(self):
        """`nnx.merge(engine.block_graphdef, params["layers"][i], engine.block_constants[i])`
        gives back layer i's block (its Constants are no parameters: `block_constants`)."""
        return self._block_def

    def params(self) -> dict:
        """fp32 master weights on the host: {"stages": tree, "layers": [tree, ...]}.

        A view, not a copy. With the host update called directly (engine/direct.py, the fused
        AdamW with its kernel built) it stays the state of this moment for as long as anything
        can read it (any of its arrays, a numpy array or a slice taken of one): each unit it
        reaches is copied once, at its next update, and left to it (counted in
        `counters.host_snapshot_bytes`), so drop what you do not keep, or copy it
        (`jax.tree.map(np.array, ...)`). With the jitted update it is valid until the next
        `train_step`, which updates these buffers in place (reading one afterwards raises "Array
        has been deleted"). `nnx.merge(engine.stages_graphdef, params["stages"])` gives back
        (first, last)."""
        self.wait()
        layers = [self.host.unit_state(1 + i)[0] for i in range(self.num_layers)]
        return {"stages": self.host.stages_state()[0], "layers": layers}

    def param_shapes(self) -> dict:
        """The logical shapes of the master weights, as `params()`'s structure of
        jax.ShapeDtypeStruct (fp32). They are params()' own shapes, except with
        `shard_host_state`, where params() holds this process's rows of each."""
        shapes = self.host.shapes
        struct = lambda leaves, u: jax.tree.unflatten(jax.tree.structure(leaves), [
            jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes[u]])
        params = self.params()
        return {"stages": struct(params["stages"], 0),
                "layers": [struct(layer, 1) for layer in params["layers"]]}

    def state_shapes(self) -> dict:
        """The logical shapes of `state()` (params and optax state per unit, as if one process
        held it all), as jax.ShapeDtypeStruct: a checkpoint's model, whatever the layout."""
        params = self.param_shapes()
        init = lambda p: jax.eval_shape(self.host.optimizer.init, p)
        block = init(params["layers"][0])  # every block has one structure: traced once
        return {"stages": {"params": params["stages"], "opt_state": init(params["stages"])},
                "layers": [{"params": p, "opt_state": block} for p in params["layers"]]}

    @property
    def shards(self):
        """The sharded host layout (engine/shard.py's Shards), or None when every process holds
        the whole state."""
        return self.placement.shards

    def state(self) -> dict:
        """The full training state (params and optax state per unit), host-resident: a view
        that stays the state of this moment, or is valid until the next `train_step`, as
        `params()` says."""
        self.wait()
        unit = lambda state: dict(zip(("params", "opt_state"), state))
        return {"stages": unit(self.host.stages_state()),
                "layers": [unit(self.host.unit_state(1 + i)) for i in range(self.num_layers)]}

    @property
    def disk_tier(self):
        """The DiskTier (engine/tier.py) holding the state, or None when it is in RAM."""
        return self.host.tier

    @property
    def host_update(self) -> str:
        """How the host update runs, as chosen at construction (engine/update.py): "direct" (the
        fused AdamW kernel called directly, engine/direct.py), "ffi" (the fused AdamW in a jitted
        call per unit) or "optax" (any other optax transform, jitted per unit)."""
        return self.host.update.kind

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype of the bus copies and of the device's compute."""
        return self.host.compute_dtype

    @property
    def grad_dtype(self) -> np.dtype:
        """The dtype in which each unit's gradient crosses to the host and waits there."""
        return self.host.grad_dtype

    def unit_shapes(self) -> list:
        """Each unit's params as a tree of jax.ShapeDtypeStruct, in the order of the host
        thread's updates: the first stage's unit (its variables: the embedding, tied or not),
        layer 0, ..., layer L-1, then the last stage's own (final norm, an untied head). A unit
        is what one host update updates; with `shard_host_state`, this process's rows."""
        return [self.host.layout(u)[0] for u in range(self.num_layers + 2)]

    def bus_bytes(self) -> int:
        """Bytes of the bus copies (the weights in the compute dtype, which the fetches read)
        the engine holds now, besides the state: each unit's, or the buffer kept for its update
        to write (`bus="ring"`: the stage units' and the ring's buffers), and the update's
        staging buffers; none for a unit whose bus copy is its fp32 weights themselves."""
        return self.host.buses.nbytes(self.host.units)

    def load_state(self, state: dict):
        """Replaces the training state with `state` (same structure as `state()`), unit by unit,
        once every unit is checked (structure, shapes, kinds of dtype: one ValueError line naming
        the unit and the leaf, nothing replaced). The Adam moments take the engine's dtype.

        The engine takes the arrays over: later steps update them in place (donation), so do
        not keep using them."""
        layers = state["layers"]
        if len(layers) != self.num_layers:
            raise ValueError(f"cannot load a state of {len(layers)} layers into an engine of "
                             f"{self.num_layers}")
        self.host.check_load("stages", state["stages"])
        for i, layer in enumerate(layers):
            self.host.check_load(1 + i, layer)
        self.load_unit("stages", state["stages"])
        for i, layer in enumerate(layers):
            self.load_unit(i, layer)

    def load_unit(self, which, unit_state: dict):
        """Replaces one unit's state, `{"params", "opt_state"}`: which is "stages" or a layer
        index. Restoring unit by unit keeps the extra host memory to one unit's state. Checked
        and cast as in `load_state`."""
        self._check_open()
        layer = isinstance(which, (int, np.integer)) and not isinstance(which, bool)
        if which != "stages" and not (layer and 0 <= which < self.num_layers):
            raise ValueError(f"load_unit: which must be 'stages' or a layer index (0 to "
                             f"{self.num_layers - 1}), got {which!r}")
        if which == "stages":
            self.host.load_stages(unit_state)
        else:
            self.host.load_unit(1 + which, unit_state)

    def close(self):
        """Waits for the pending updates and ends the host thread (and the disk tier): every
        later call that steps or touches the state raises, saying the engine is closed."""
        if self._closed:
            return
        try:
            self.host.close()
        finally:
            self._closed = True

    def _check_open(self):
        if self._closed:  # its thread is gone, the disk tier's files too: nothing to step or read
            raise RuntimeError("the engine is closed (close() was called): it cannot step nor "
                               "give or take state; build a new engine")
