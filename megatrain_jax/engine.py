"""The streamed-layer engine: host-resident training state, the GPU as a transient compute engine.

The engine trains any model of the form `last(block_{L-1}(... block_0(first(inputs)))), targets)`
where every block has the same structure. It knows nothing about the model inside the blocks.

State lives in host memory, one *unit* at a time: unit 0 holds the first and last stages (they
share a unit, so tied weights stay tied), unit 1 + i holds layer i. Per unit the host keeps the
fp32 master weights, the optax state, and a compute-dtype copy (the "bus copy") that is what
crosses to the device. One step (M micro-batches, layer-major):

    forward   put(w_{i+1}) async | x_{i+1}[m] = block(w_i, x_i[m])    for m < M
    loss      loss[m], dx[m], dW_stages = value_and_grad(last)(w_0, x_L[m], targets[m])
    backward  put(w_{i-1}) async | dx[m], dW_i += vjp(block)(w_i, x_i[m], dx[m])   (recompute)
              dW_i -> host async | host thread: optax update of unit i (or after the norm)
    embed     dW_stages += vjp(first)(w_0, inputs[m], dx[m])

Each block weight crosses the bus twice per step whatever M is. The host update of a unit runs in
a background thread on the CPU device and overlaps device work: during the backward when there is
no clipping, otherwise during the next step's forward, which waits for each unit's update just
before it streams that unit's weights.
"""

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass
class _Unit:
    """The host-resident state of one streamed unit."""
    params: Any  # fp32 master weights (pure dict) on the host device
    opt_state: Any  # optax state on the host device
    bus: Any = None  # compute-dtype copy, ready to cross to the device; None between its last
    # use in a step and the update that recreates it, when its memory must make room for the
    # whole model's gradients (global-norm clipping) or it lives in the accelerator's memory
    pending: Optional[concurrent.futures.Future] = None  # the host update still running


def _param_split(module: nnx.Module, what: str):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"{what} holds non-Param state ({list(rest.flat_state())[0][0]}); "
                         "streamed modules may only hold nnx.Param variables")
    return graphdef, nnx.to_pure_dict(params)


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _sum_squares(tree):
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _tree_add(acc, tree):
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, tree)


class StreamedEngine:
    """Trains `last(blocks(first(inputs)), targets)` with all state in host memory.

    Args:
      first: the first stage, called as `first(inputs) -> x` (e.g. token embedding).
      last: the last stage, called as `last(x, targets) -> scalar mean loss`. It may share
        variables with `first` (tied embeddings): shared variables get the sum of both gradients.
      make_block: `make_block(i) -> nnx.Module`, layer i's block, all of one structure. Called once
        per layer at construction, under the host device, so the stack is never built whole on the
        accelerator. Blocks (and stages) may hold only `nnx.Param` state.
      num_layers: how many blocks.
      optimizer: any optax GradientTransformation, applied unit by unit on the host. Do not put
        `optax.clip_by_global_norm` in it: a per-unit norm is not the global one; use
        `max_grad_norm`, which clips exactly as `clip_by_global_norm` over the whole model.
      max_grad_norm: clip gradients to this global L2 norm (None: no clipping).
      compute_dtype: dtype of the bus copy and of device compute (bf16 default; fp32 is exact).
      grad_dtype: dtype in which each unit's gradient (accumulated in fp32 on the device) crosses
        to the host and waits there for its update, which upcasts it. fp32 (default) is exact;
        bf16 halves the gradient's bytes each way and, with clipping, the host memory that every
        unit's gradient occupies until the global norm is known (the norm is taken in fp32).
      prefetch: how many layers' weights are in flight ahead of the one computing.
      compute_device / host_device: where blocks run / where state lives and the optimizer runs.
        Defaults: the default device, and the first CPU device.
    """

    def __init__(self, *, first: nnx.Module, last: nnx.Module, make_block: Callable[[int], nnx.Module],
                 num_layers: int, optimizer: optax.GradientTransformation,
                 max_grad_norm: Optional[float] = None, compute_dtype=jnp.bfloat16, prefetch: int = 1,
                 compute_device=None, host_device=None, grad_dtype=jnp.float32):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.num_layers = num_layers
        self.prefetch = prefetch
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.grad_dtype = jnp.dtype(grad_dtype)
        if not jnp.issubdtype(self.grad_dtype, jnp.floating):
            raise ValueError(f"grad_dtype must be a floating dtype, got {self.grad_dtype}")
        self.max_grad_norm = max_grad_norm
        self.optimizer = optimizer
        self.compute_device = compute_device or jax.devices()[0]
        self.host_device = host_device or jax.devices("cpu")[0]
        self._host = jax.sharding.SingleDeviceSharding(self.host_device)
        self._compute = jax.sharding.SingleDeviceSharding(self.compute_device)
        # On an accelerator, bus copies wait in its pinned host memory, which it reads by DMA with
        # no staging copy. The update cannot write there (another device's memory), so it writes
        # into a reused host buffer (`_staging`, one per unit structure) that is then copied over.
        # When state and compute share a device, the bus is a host buffer rewritten in place.
        kinds = {m.kind for m in self.compute_device.addressable_memories()}
        self._bus_in_place = self.compute_device == self.host_device or "pinned_host" not in kinds
        # In place and fp32 compute: the bus copy is the master weights themselves.
        self._bus_is_params = self._bus_in_place and self.compute_dtype == jnp.float32
        self._bus = (self._host if self._bus_in_place else
                     jax.sharding.SingleDeviceSharding(self.compute_device, memory_kind="pinned_host"))
        self._staging = {}

        with jax.default_device(self.host_device):
            self._stages_def, stages = _param_split((first, last), "the first/last stages")
            units = [stages]
            for i in range(num_layers):
                graphdef, params = _param_split(make_block(i), f"block {i}")
                if i == 0:
                    self._block_def = graphdef
                elif graphdef != self._block_def or (jax.tree.structure(params)
                                                      != jax.tree.structure(units[1])):
                    raise ValueError(f"block {i} differs in structure from block 0; all streamed "
                                     "blocks must share one structure")
                units.append(params)

        # Donating params, optax state and the old bus copy makes the update write in place: on
        # the CPU backend a fresh output buffer is page-faulted in at a fraction of memory speed.
        # keep_unused: the old bus is never read, only donated; jit would otherwise prune it.
        self._update = jax.jit(self._host_update, donate_argnums=(0, 1, 3), keep_unused=True)
        # Clipped inside the update, the gradient becomes an intermediate that both Adam moments
        # read, and XLA:CPU gives it a fresh temporary buffer (~3 B/param, page-faulted each step;
        # `memory_analysis()`). An fp32 gradient is therefore clipped first, in place, by its own
        # pass; a bf16 one is upcast, so it has no fp32 buffer to clip in and is clipped inside.
        self._clip_first = max_grad_norm is not None and self.grad_dtype == jnp.float32
        self._clip_in_place = jax.jit(self._clip, donate_argnums=(0,))
        # out_shardings: optax state that does not depend on the params (counts, zeros) would
        # otherwise land uncommitted on the default device, the accelerator.
        init = jax.jit(optimizer.init, out_shardings=self._host)
        self._units = []
        for params in units:
            params = jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
                                    self._host)
            self._units.append(_Unit(params, init(params), self._make_bus(params)))
        if not self._bus_in_place:  # made now, so the update compiles once per unit structure
            zeros = lambda p: jnp.zeros(p.shape, self.compute_dtype, device=self.host_device)
            self._staging = {key: jax.tree.map(zeros, self._units[key].params) for key in (0, 1)}
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-optim")
        self._build_device_fns()
        # Running totals, for benchmarks: bytes each way, seconds the host thread spent updating,
        # and seconds the step (main thread) spent waiting for it, i.e. the exposed part.
        self.bytes_h2d = self.bytes_d2h = 0
        self.host_update_s = self.host_wait_s = 0.0

    # ----------------------------------------------------------------- device functions
    def _build_device_fns(self):
        stages_def, block_def = self._stages_def, self._block_def

        def embed(w, inputs):
            first, _ = nnx.merge(stages_def, w)
            return first(inputs)

        def head(w, x, targets, acc, scale):
            def loss_fn(w, x):
                return nnx.merge(stages_def, w)[1](x, targets) * scale
            scaled, (dw, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, x)
            return scaled / scale, dx, _tree_add(acc, dw)

        def embed_bwd(w, inputs, dx, acc):
            _, vjp = jax.vjp(lambda w: embed(w, inputs), w)
            return _tree_add(acc, vjp(dx)[0])

        def block_fwd(w, x):
            return nnx.merge(block_def, w)(x)

        def block_bwd(w, x, dy, acc):
            # Recompute the block from its saved input, then differentiate it.
            _, vjp = jax.vjp(block_fwd, w, x)
            dw, dx = vjp(dy)
            return dx, _tree_add(acc, dw)

        self._embed = jax.jit(embed)
        self._head = jax.jit(head, donate_argnums=(3,))
        self._embed_bwd = jax.jit(embed_bwd, donate_argnums=(3,))
        self._block_fwd = jax.jit(block_fwd)
        self._block_bwd = jax.jit(block_bwd, donate_argnums=(2, 3))
        self._zeros = jax.jit(lambda w: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), w))
        self._cast_grads = jax.jit(lambda g: jax.tree.map(lambda x: x.astype(self.grad_dtype), g))
        self._sum_squares = jax.jit(_sum_squares)
        # One dispatch each for what would otherwise be L (or M) eager adds per step.
        self._global_norm = jax.jit(lambda sq_norms: jnp.sqrt(sum(sq_norms)))
        self._mean = jax.jit(lambda xs: sum(xs) / len(xs))

    # ----------------------------------------------------------------- host side
    def _cast(self, params):
        return jax.tree.map(lambda p: p.astype(self.compute_dtype), params)

    def _to_bus(self, tree):
        return jax.device_put(tree, self._bus)

    def _make_bus(self, params):
        return params if self._bus_is_params else self._to_bus(self._cast(params))

    def _clip(self, grads, grad_norm):
        """Exactly optax.clip_by_global_norm, with the norm taken over the whole model."""
        clip = grad_norm >= self.max_grad_norm
        return jax.tree.map(
            lambda g: jnp.where(clip, (g / grad_norm.astype(g.dtype)) * self.max_grad_norm, g), grads)

    def _host_update(self, params, opt_state, grads, old_bus, grad_norm):
        del old_bus  # donated: the new bus copy is written into its buffer
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # no-op in fp32
        if grad_norm is not None:  # clipped here only when it could not be done in place before
            grads = self._clip(grads, grad_norm)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, None if self._bus_is_params else self._cast(params)

    def _apply_update(self, unit: _Unit, grads, grad_norm, staging_key):
        """Runs on the host-optimizer thread: one jitted, in-place optax step of one unit, its
        bus copy written in the same call. XLA:CPU spreads each large fused loop over all cores."""
        t0 = time.perf_counter()
        if self._bus_in_place:
            old_bus = None if self._bus_is_params else unit.bus
        else:
            old_bus = self._staging.pop(staging_key, None)
        unit.bus = None
        if self._clip_first:
            grads, grad_norm = self._clip_in_place(grads, grad_norm), None
        unit.params, unit.opt_state, bus = self._update(unit.params, unit.opt_state, grads, old_bus,
                                                        grad_norm)
        if self._bus_in_place:
            unit.bus = unit.params if self._bus_is_params else bus
        else:
            unit.bus = self._to_bus(bus)
            self._staging[staging_key] = bus  # reused by the next unit: this copy is waited for
        jax.block_until_ready(unit.bus)  # the future completes when the weights are usable
        self.host_update_s += time.perf_counter() - t0

    def _submit_update(self, u: int, grads, grad_norm):
        unit = self._units[u]
        unit.pending = self._thread.submit(self._apply_update, unit, grads, grad_norm, min(u, 1))

    def _ready(self, u: int) -> _Unit:
        unit = self._units[u]
        if unit.pending is not None:
            t0 = time.perf_counter()
            unit.pending.result()  # re-raises anything the host thread raised
            self.host_wait_s += time.perf_counter() - t0
            unit.pending = None
        return unit

    def _fetch(self, u: int):
        """Starts the (asynchronous) transfer of unit u's weights to the compute device."""
        bus = self._ready(u).bus
        self.bytes_h2d += _nbytes(bus)
        return jax.device_put(bus, self._compute)

    def _send_grads(self, u: int, grads):
        if self.grad_dtype != jnp.float32:  # cast on the device: fewer bytes cross and wait
            grads = self._cast_grads(grads)
        self.bytes_d2h += _nbytes(grads)
        if self.max_grad_norm is not None or not self._bus_in_place:
            # Its last use this step is dispatched: free it for the grads of the whole model (or
            # back to the accelerator's pinned pool). Otherwise the update rewrites it in place.
            self._units[u].bus = None
        return jax.device_put(grads, self._host)

    def _streamed(self, order):
        """Yields (layer, device weights) in `order`, with `prefetch` layers in flight ahead."""
        in_flight = collections.deque(self._fetch(1 + i) for i in order[:self.prefetch])
        for pos, i in enumerate(order):
            if pos + self.prefetch < len(order):
                in_flight.append(self._fetch(1 + order[pos + self.prefetch]))
            yield i, in_flight.popleft()

    # ----------------------------------------------------------------- one step
    def train_step(self, inputs, targets) -> dict:
        """One optimizer step over M micro-batches: `inputs`, `targets` are (M, ...) arrays.

        The loss is the mean of the micro-batch losses, so with equal-sized micro-batches the step
        equals one step on the concatenated batch. Returns device scalars `loss` and `grad_norm`
        (the global norm before clipping); reading them is the caller's only sync point.
        """
        num_micro = len(inputs)
        inputs = [jax.device_put(x, self._compute) for x in inputs]
        targets = [jax.device_put(t, self._compute) for t in targets]
        scale = jnp.float32(1.0 / num_micro)
        L = self.num_layers

        w_stages = self._fetch(0)
        acts = [[self._embed(w_stages, x) for x in inputs]]  # acts[i][m]: input of layer i
        for i, w in self._streamed(list(range(L))):
            acts.append([self._block_fwd(w, x) for x in acts[i]])

        d_stages = self._zeros(w_stages)
        losses, dxs = [], []
        for x, t in zip(acts.pop(), targets):
            loss, dx, d_stages = self._head(w_stages, x, t, d_stages, scale)
            losses.append(loss)
            dxs.append(dx)

        host_grads, sq_norms = {}, []
        for i, w in self._streamed(list(reversed(range(L)))):
            dw = self._zeros(w)
            xs = acts.pop()
            for m in range(num_micro):
                dxs[m], dw = self._block_bwd(w, xs[m], dxs[m], dw)
            del xs
            sq_norms.append(self._sum_squares(dw))
            host_grads[1 + i] = self._send_grads(1 + i, dw)
            if self.max_grad_norm is None:  # nothing to wait for: update while the device works
                self._submit_update(1 + i, host_grads.pop(1 + i), None)

        for x, dx in zip(inputs, dxs):
            d_stages = self._embed_bwd(w_stages, x, dx, d_stages)
        sq_norms.append(self._sum_squares(d_stages))
        host_grads[0] = self._send_grads(0, d_stages)
        grad_norm = self._global_norm(sq_norms)
        # Only clipping reads the norm on the host; without it the host update takes no norm.
        host_norm = None if self.max_grad_norm is None else jax.device_put(grad_norm, self._host)
        # Units in the order the next forward needs them: stages, then layers 0..L-1.
        for u in sorted(host_grads):
            self._submit_update(u, host_grads.pop(u), host_norm)
        return {"loss": self._mean(losses), "grad_norm": grad_norm}

    # ----------------------------------------------------------------- reading state
    def wait(self):
        """Blocks until every pending host update has finished."""
        for u in range(len(self._units)):
            self._ready(u)

    @property
    def stages_graphdef(self):
        return self._stages_def

    @property
    def block_graphdef(self):
        return self._block_def

    def params(self) -> dict:
        """fp32 master weights on the host: {"stages": tree, "layers": [tree, ...]}.

        `nnx.merge(engine.stages_graphdef, params["stages"])` gives back (first, last)."""
        self.wait()
        return {"stages": self._units[0].params, "layers": [u.params for u in self._units[1:]]}

    def state(self) -> dict:
        """The full training state (params and optax state per unit), host-resident."""
        self.wait()
        unit = lambda u: {"params": u.params, "opt_state": u.opt_state}
        return {"stages": unit(self._units[0]), "layers": [unit(u) for u in self._units[1:]]}

    def load_state(self, state: dict):
        """Replaces the training state with `state` (same structure as `state()`).

        The engine takes the arrays over: later steps update them in place (donation), so do
        not keep using them."""
        self.load_unit("stages", state["stages"])
        for i, layer in enumerate(state["layers"]):
            self.load_unit(i, layer)

    def load_unit(self, which, unit_state: dict):
        """Replaces one unit's state, `{"params", "opt_state"}`: which is "stages" or a layer
        index. Restoring unit by unit keeps the extra host memory to one unit's state."""
        unit = self._ready(0 if which == "stages" else 1 + which)
        unit.params = jax.device_put(unit_state["params"], self._host)
        unit.opt_state = jax.device_put(unit_state["opt_state"], self._host)
        unit.bus = self._make_bus(unit.params)

    def close(self):
        self.wait()
        self._thread.shutdown()
