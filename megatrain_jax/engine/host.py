"""Host-resident training state: per unit the fp32 master weights, the optax state, the bus copy,
and the optax update that runs on the host CPU device in a background thread."""

import concurrent.futures
import dataclasses
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine import fused_adamw
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.engine import transfer


@dataclasses.dataclass
class Unit:
    """The host-resident state of one streamed unit."""
    params: Any  # fp32 master weights (pure dict) on the host device
    opt_state: Any  # optax state on the host device
    bus: Any = None  # compute-dtype copy, ready to cross to the device; None between its last
    # use in a step and the update that recreates it
    spare: Any = None  # the released bus copy when it is a host buffer: kept for the update to
    # write the new one into (freed and allocated again, it would be page-faulted in each step)
    pending: Optional[concurrent.futures.Future] = None  # the host update still running


class HostState:
    """The units' state and their updates. Unit 0 is the stages, unit 1 + i layer i.

    `submit(u, grads, grad_norm, scale)` queues unit u's update on the host thread: the gradient
    (of the unnormalised loss sum) is scaled by `scale`, clipped to the global norm exactly as
    `optax.clip_by_global_norm` would, and applied. When the global norm is not finite the update
    keeps params and optax state as they were (as `optax.apply_if_finite` does), so one bad batch
    never reaches the weights. `bus(u)` waits for u's update and returns its bus copy.
    """

    def __init__(self, units: list, optimizer: optax.GradientTransformation, *, max_grad_norm,
                 compute_dtype, grad_dtype, compute_device, host_device, counters,
                 disk_tier: Optional[tier_lib.DiskTierOptions] = None, num_units=None,
                 shards=None):
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.grad_dtype = jnp.dtype(grad_dtype)
        self.host_device = host_device
        self.counters = counters
        self.host = jax.sharding.SingleDeviceSharding(host_device)
        # On an accelerator, bus copies wait in its pinned host memory, which it reads by DMA with
        # no staging copy. The update cannot write there (another device's memory), so it writes
        # into a reused host buffer (`staging`, one per unit structure) that is then copied over.
        # When state and compute share a device, the bus is a host buffer rewritten in place.
        self.bus_in_place = (compute_device == host_device
                             or transfer.PINNED not in transfer.memory_kinds(compute_device))
        # In place and fp32 compute: the bus copy is the master weights themselves (not with
        # the disk tier, where the weights leave RAM between updates).
        self.bus_is_params = (self.bus_in_place and self.compute_dtype == jnp.float32
                              and disk_tier is None)
        self.bus_sharding = (self.host if self.bus_in_place else jax.sharding.SingleDeviceSharding(
            compute_device, memory_kind="pinned_host"))
        self.staging = {}
        self.failed = None  # why the state is unknown: a host update failed (see ready)

        # Donating params, optax state and the old bus copy makes the update write in place: on
        # the CPU backend a fresh output buffer is page-faulted in at a fraction of memory speed.
        # keep_unused: the old bus is never read, only donated; jit would otherwise prune it.
        # With the disk tier, params and optax state alias the tier's read buffer (tier.load),
        # which XLA does not own: the outputs get buffers of their own, copied out by tier.store.
        donate = (3,) if disk_tier is not None else (0, 1, 3)
        self._update = jax.jit(self._host_update, donate_argnums=donate, static_argnums=(6,),
                               keep_unused=True)
        # Scaled and clipped inside the update, the gradient becomes an intermediate that both
        # Adam moments read, and XLA:CPU gives it a fresh temporary (~3 B/param, page-faulted each
        # step). An fp32 gradient is therefore prepared first, in place, by its own pass; a bf16
        # one is upcast, so it has no fp32 buffer to work in and is prepared inside the update.
        # AdamW made by fused_adamw.adamw (recipes.build_optimizer's) runs as one pass per leaf
        # that also scales and clips the gradient (fused_adamw.py); any other optimizer, optax.
        self.fused = optimizer.hyper if isinstance(optimizer, fused_adamw.AdamW) else None
        self._native = self.fused is not None and fused_adamw.native()
        self._prepare_first = self.grad_dtype == jnp.float32 and self.fused is None
        self._prepare_in_place = jax.jit(self._prepare, donate_argnums=(0,))
        # out_shardings: optax state that does not depend on the params (counts, zeros) would
        # otherwise land uncommitted on the default device, the accelerator.
        init = jax.jit(optimizer.init, out_shardings=self.host)
        # shards (shard.Shards): keep only this process's rows of every leaf (the sharded layout);
        # `shapes` keeps the logical leaf shapes of the stages (0) and of a block (1).
        if shards is not None and disk_tier is not None:
            raise ValueError("shard_host_state with the disk tier is not supported")
        self.units, self.tier, self.shapes = [], None, {}
        for params in units:  # an iterable: with the disk tier, one unit in RAM at a time
            params = jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
                                    self.host)
            if len(self.units) < 2:
                self.shapes[len(self.units)] = [tuple(p.shape) for p in jax.tree.leaves(params)]
            if shards is not None:
                params = shards.cut(params)
            self.units.append(Unit(params, init(params), self.make_bus(params)))
            if len(self.units) == 1:  # the stages' leaf shapes, for their gradient (step.py)
                leaves, treedef = jax.tree.flatten(params)
                self.stage_shapes = (tuple(tuple(p.shape) for p in leaves), treedef)
            if disk_tier is not None:  # --- disk tier (tier.py): the state goes to its file
                self._to_tier(disk_tier, num_units or len(units))
        if not self.bus_in_place:  # made now, so the update compiles once per unit structure
            zeros = lambda p: jnp.zeros(p.shape, self.compute_dtype, device=host_device)
            self.staging = {key: jax.tree.map(zeros, self.units[key].bus)
                            for key in range(min(2, len(self.units)))}
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-optim")

    # ----------------------------------------------------------------- disk tier hooks
    def _to_tier(self, options, num_units: int):
        """Construction with the disk tier: each unit's state to its file, only its bus kept.
        The files are made once the first block is known (all blocks share its layout)."""
        if len(self.units) < 2:
            return
        layout = lambda unit: tier_lib.UnitLayout.of(unit.params, unit.opt_state)
        if self.tier is None:
            stages, block = self.units
            self.tier = tier_lib.DiskTier(options, [layout(stages)] + [layout(block)] * (
                num_units - 1))
        u = len(self.units) - 1
        if layout(self.units[u]) != self.tier.layouts[u]:
            raise ValueError(f"disk tier: block {u - 1}'s layout differs from block 0's")
        for v in ([0, 1] if u == 1 else [u]):
            unit = self.units[v]
            self.tier.write_now(v, unit.params, unit.opt_state)
            unit.params = unit.opt_state = None

    def unit_state(self, u: int) -> tuple:
        """(params, opt_state) of unit u once its update has finished: host arrays, or with the
        disk tier read-only numpy arrays mapped from its file."""
        unit = self.ready(u)
        if self.tier is not None:
            return self.tier.view(u)
        return unit.params, unit.opt_state

    # ----------------------------------------------------------------- bus copies
    def make_bus(self, params):
        if self.bus_is_params:
            return params
        if self.bus_in_place and self.compute_dtype == jnp.float32:  # disk tier: a copy, not
            # the weights (astype and device_put would return them: see bus_is_params)
            params = jax.tree.map(lambda p: jnp.array(p, copy=True, device=self.host_device),
                                  params)
        return transfer.refresh(jax.tree.map(lambda p: p.astype(self.compute_dtype), params),
                                self.bus_sharding)

    def bus(self, u: int):
        """Unit u's bus copy, once its pending update has finished."""
        unit = self.ready(u)
        if unit.bus is None:  # released by a step that then failed: still the weights' copy
            unit.bus, unit.spare = unit.spare, None
        if unit.bus is None:  # (given back to the pinned pool): rebuilt from the weights
            unit.bus = self.make_bus(self.unit_state(u)[0])
        return unit.bus

    def release_bus(self, u: int):
        """After a unit's last use in a step. A host bus copy is kept for the update to write in
        place (the plan counts bus copies and gradients together); a pinned one goes back to the
        accelerator's pinned pool, while the update writes a reused staging buffer."""
        unit = self.units[u]
        if self.bus_in_place and not self.bus_is_params and unit.bus is not None:
            unit.spare = unit.bus
        unit.bus = None

    # ----------------------------------------------------------------- the update
    def _prepare(self, grads, grad_norm, scale):
        """The gradient of the mean loss, clipped exactly as optax.clip_by_global_norm."""
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        if self.max_grad_norm is None:
            return grads
        clip = grad_norm >= self.max_grad_norm
        return jax.tree.map(
            lambda g: jnp.where(clip, (g / grad_norm.astype(g.dtype)) * self.max_grad_norm, g), grads)

    def _host_update(self, params, opt_state, grads, old_bus, grad_norm, scale, prepared):
        bus_dtype = None if self.bus_is_params else self.compute_dtype
        if self.fused is not None:
            return fused_adamw.update(self.fused, params, opt_state, grads, old_bus, grad_norm,
                                      scale, self.max_grad_norm, bus_dtype, self._native)
        del old_bus  # donated: the new bus copy is written into its buffer
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # no-op in fp32
        if not prepared:
            grads = self._prepare(grads, grad_norm, scale)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, None if self.bus_is_params else jax.tree.map(
            lambda p: p.astype(self.compute_dtype), params)

    def _apply(self, u: int, grads, grad_norm, scale, staging_key):
        """Runs on the host-optimizer thread: one jitted, in-place optax step of one unit, its
        bus copy written in the same call. XLA:CPU spreads each large fused loop over all cores."""
        t0 = time.perf_counter()
        grads, grad_norm, scale = transfer.arrive((grads, grad_norm, scale), self.host)
        unit = self.units[u]
        if self.tier is not None:  # --- disk tier: the state from its file (read ahead)
            unit.params, unit.opt_state = self.tier.load(u, self.host)
        if self.bus_in_place:
            old_bus = None if self.bus_is_params else (
                unit.bus if unit.bus is not None else unit.spare)
        else:
            old_bus = self.staging.pop(staging_key, None)
        unit.bus = unit.spare = None
        # A non-finite global norm skips the update (as optax.apply_if_finite), decided here. A
        # select between the new and the old state inside the update made XLA copy the donated
        # optax state first (8 B/param of fresh memory, page-faulted in every update: 3x slower).
        if not np.isfinite(grad_norm):
            if self.bus_in_place and old_bus is not None:
                unit.bus = old_bus  # still the weights' copy
            else:
                unit.bus = self.make_bus(unit.params)
                if not self.bus_in_place:
                    self.staging[staging_key] = old_bus
        else:
            if self._prepare_first:
                grads = self._prepare_in_place(grads, grad_norm, scale)
            unit.params, unit.opt_state, bus = self._update(
                unit.params, unit.opt_state, grads, old_bus, grad_norm, scale, self._prepare_first)
            unit.bus = self._bus_after_update(unit, bus, staging_key)
        if self.tier is not None:  # --- disk tier: written back behind, out of RAM
            self.tier.store(u, unit.params, unit.opt_state)
            unit.params = unit.opt_state = None
        jax.block_until_ready(unit.bus)  # the future completes when the weights are usable
        self.counters.host_update_s += time.perf_counter() - t0

    def _bus_after_update(self, unit, bus, staging_key):
        """The unit's new bus copy, from the update's compute-dtype output."""
        if self.bus_in_place:
            return unit.params if self.bus_is_params else bus
        self.staging[staging_key] = bus  # reused by the next unit: this copy is waited for
        return transfer.refresh(bus, self.bus_sharding)

    def submit(self, u: int, grads, grad_norm, scale):
        """Queues unit u's update with its gradient (a transfer.Parcel on its way to the host, or
        host arrays), the global norm of the scaled gradient and the scale (scalars in the
        compute device's pinned host memory, or host scalars)."""
        unit = self.units[u]
        if self.tier is not None:
            self.tier.expect(u)  # --- disk tier: its read may start ahead
        unit.pending = self._thread.submit(self._apply, u, grads, grad_norm, scale, min(u, 1))

    def ready(self, u: int) -> Unit:
        """Unit u once its pending update has finished. An update that failed (re-raised here)
        leaves that unit's state unknown: every later call refuses."""
        if self.failed:
            raise RuntimeError(f"the engine is unusable: {self.failed}")
        unit = self.units[u]
        if unit.pending is not None:
            t0 = time.perf_counter()
            future, unit.pending = unit.pending, None
            try:
                future.result()  # re-raises anything the host thread raised
            except BaseException as e:
                name = "the stages'" if u == 0 else f"layer {u - 1}'s"
                self.failed = f"{name} host update failed ({type(e).__name__}: {e})"
                raise
            self.counters.host_wait_s += time.perf_counter() - t0
        return unit

    def wait(self):
        """Blocks until every pending update has finished (with the disk tier, written back)."""
        for u in range(len(self.units)):
            self.ready(u)
        if self.tier is not None:
            self.tier.flush()

    def load_unit(self, u: int, unit_state: dict):
        unit = self.ready(u)
        if self.tier is not None:  # --- disk tier: into its file, only the bus in RAM
            self.tier.write_now(u, unit_state["params"], unit_state["opt_state"])
            unit.bus = self.make_bus(jax.device_put(unit_state["params"], self.host))
            return
        unit.params = jax.device_put(unit_state["params"], self.host)
        unit.opt_state = jax.device_put(unit_state["opt_state"], self.host)
        unit.bus = self.make_bus(unit.params)

    def close(self):
        try:
            if not self.failed:  # (what failed was raised already)
                self.wait()
        finally:
            self._thread.shutdown()
            if self.tier is not None:
                self.tier.close()
