"""Every host update of a unit, behind one interface: one strategy, chosen once by `choose`
(HostState's `update`), its hyperparameters checked there.

    Direct      the fused AdamW kernel called directly on numpy state the engine owns
                (direct.py): no copy, no jit but the step's scalars
    FusedInJit  the fused AdamW in one jitted call per unit: the kernel through jax.ffi, or
                where it cannot be built its JAX fallback (fused_adamw.py)
    OptaxInJit  any other optax transform in one jitted call per unit

Each, once `bind`'s (to the units' store and layout, store.py, and their bus copies, bus.py):
`apply(u, unit, grads, grad_norm, scale)` runs unit u's update on the host thread: the gradient
(each argument possibly a function that makes it) waited for, a non-finite global norm skipping
the update (as optax.apply_if_finite: nothing changes, the bus copy still the weights'), the bus
copy after it written by bus.py, the update timed in `counters` (host_update_s, host_compute_s).
`kind` names it ("direct", "ffi", "optax"); `in_place`: it writes each bus copy where it lies.

The two in a jit give pure functions, compiled with the store's donation: `step(params,
opt_state, grads, old_bus, grad_norm, scale, unit, firsts, bus_is_params)` -> (params, opt_state,
the new bus copy or None; unit and firsts: fused_adamw.update's, the keys of bf16 moments'
rounding) and, where `prepare_first`, `prepare(grads, grad_norm, scale)` run before it on the
gradient, in place. They run as `packed(step)`: the gradient and the bus copies as the unit
travels (engine/packing.py), a flat unit's split and packed inside the call.
"""

import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine import direct as direct_lib
from megatrain_jax.engine import fused_adamw, transfer

HOST_UPDATES = ("auto", "direct", "jit")


def check_max_grad_norm(max_grad_norm):
    """max_grad_norm: None (no clipping) or a finite number > 0; else one ValueError line."""
    if max_grad_norm is None:
        return
    try:
        ok = math.isfinite(float(max_grad_norm)) and float(max_grad_norm) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"max_grad_norm must be a finite number > 0 (None: no clipping), got "
                         f"{max_grad_norm!r}")


def fused_hyper(optimizer) -> Optional[fused_adamw.Hyper]:
    """The hyperparameters of fused_adamw.adamw's optimizer, or None: an optax transform whose
    own the engine cannot read (optax runs it as it is)."""
    return optimizer.hyper if isinstance(optimizer, fused_adamw.AdamW) else None


def check(optimizer, max_grad_norm):
    """The one check of the update's hyperparameters, whichever strategy runs it: max_grad_norm,
    and the fused AdamW's own (fused_adamw.check); one ValueError line naming the culprit."""
    check_max_grad_norm(max_grad_norm)
    hyper = fused_hyper(optimizer)
    if hyper is not None:
        fused_adamw.check(hyper)


def why_not_direct(optimizer, disk_tier) -> Optional[str]:
    """None where the direct update runs (the fused AdamW, its kernel built, the state in RAM:
    `disk_tier` None or false), else why not, for the log."""
    if fused_hyper(optimizer) is None:
        return "the optimizer is not fused_adamw.adamw (optax runs it in a jit)"
    if disk_tier:
        return "the disk tier's state is updated through the jit path"
    if fused_adamw.kernel() is None:
        return "the fused AdamW kernel could not be built"
    return None


def threads(update, host_threads) -> tuple:
    """The kernel's threads for `update` (a strategy of `choose`): host_threads of them (None:
    every CPU of the process's affinity), fused_adamw.use_threads. Returns (the CPUs the update's
    own thread is pinned to, [] for none; the log's words). host_threads where the kernel does
    not run (optax, or no compiler): one ValueError line, as it could not be honoured."""
    lib = (update.kernel.lib if update.kind == "direct" else
           fused_adamw.kernel() if update.kind == "ffi" and update.native else None)
    if lib is None:
        if host_threads is not None:
            raise ValueError(f"host_threads={host_threads!r} sets the fused AdamW kernel's "
                             f"threads, and the kernel does not run here ({update.kind} update)")
        return [], ""
    pinned = fused_adamw.use_threads(lib, host_threads)
    n = lib.megatrain_threads()
    return pinned, (f"{n} threads, pinned to the first {n} CPUs of {lib.megatrain_cores()}"
                    if pinned else f"{n} threads")


def prepare(grads, grad_norm, scale, max_grad_norm):
    """The gradient of the mean loss, clipped exactly as optax.clip_by_global_norm."""
    grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
    if max_grad_norm is None:
        return grads
    clip = grad_norm >= max_grad_norm
    return jax.tree.map(
        lambda g: jnp.where(clip, (g / grad_norm.astype(g.dtype)) * max_grad_norm, g), grads)


def packed(step):
    """`step` taking its gradient and old bus copy, and giving its new bus copy, as `packing`
    (its last argument, static: packing.Flat or PerLeaf) has them: a flat unit's split into its
    leaves by static slices and the new copy packed, inside the same jitted call."""
    def run(params, opt_state, grads, old_bus, grad_norm, scale, unit, firsts, bus_is_params,
            packing):
        old_bus = None if old_bus is None else packing.unpack(old_bus)
        params, opt_state, bus = step(params, opt_state, packing.unpack(grads), old_bus,
                                      grad_norm, scale, unit, firsts, bus_is_params)
        return params, opt_state, None if bus is None else packing.pack(bus)
    return run


class _Update:
    """The interface (module docstring): `apply`'s frame, once for every strategy."""
    in_place = False
    in_jit = False  # a jitted call on the unit's leaves (packing.why_per_leaf)

    def bind(self, store, buses, layout, host_sharding, counters):
        """store, layout: the units' (store.py); buses: their bus copies (bus.Buses);
        host_sharding: the host device's; counters: stream.Counters."""
        self.store, self.buses, self.layout, self.host_sharding, self.counters = (
            store, buses, layout, host_sharding, counters)

    def apply(self, u: int, unit, grads, grad_norm, scale):
        """Unit u's update (`unit`, its store.Unit), on the host thread."""
        t0 = time.perf_counter()
        grads, grad_norm, scale = (x() if callable(x) else x for x in (grads, grad_norm, scale))
        grads, grad_norm, scale = self._arrive(grads, grad_norm, scale)
        t1 = time.perf_counter()  # the inputs' arrival, not the update's work
        # A non-finite global norm skips the update (as optax.apply_if_finite), decided here. A
        # select between the new and the old state inside a jitted update made XLA copy the
        # donated optax state first (8 B/param of fresh memory, page-faulted in every update:
        # several times slower).
        self._update(u, unit, grads, grad_norm, scale, bool(np.isfinite(grad_norm)))
        t2 = time.perf_counter()
        self.counters.host_compute_s += t2 - t1
        self.counters.host_update_s += t2 - t0


class Direct(_Update):
    """The fused AdamW kernel called directly (direct.DirectAdamW, `kernel`), reading the
    gradient's pieces where they are and writing the bus copy in place (through the pointers
    bus.Buses hands it): no copy, no jit but the step's scalars."""
    kind = "direct"
    in_place = True

    def __init__(self, kernel: direct_lib.DirectAdamW):
        self.kernel = kernel

    def _arrive(self, grads, grad_norm, scale):
        grad_norm = np.float32(np.asarray(grad_norm))  # a view of the pinned scalar: waits for it
        if not np.isfinite(grad_norm):
            return None, grad_norm, scale
        pieces = (grads.pieces if isinstance(grads, transfer.Parcel)
                  else [[g] for g in jax.tree.leaves(grads)])
        jax.block_until_ready([p for leaf in pieces for p in leaf  # the copies out (numpy
                               if isinstance(p, jax.Array) and not p.is_deleted()])  # pieces are)
        return pieces, grad_norm, scale

    def _update(self, u, unit, pieces, grad_norm, scale, finite: bool):
        if not finite:
            return
        bus = self.buses.kernel_targets(u, unit, unit.arrays.p)
        arrays = self.kernel.apply(u, unit.arrays, pieces, grad_norm,
                                   np.float32(np.asarray(scale)), bus, self.layout.name(u),
                                   self.layout.firsts(u), self.layout.packing(u))
        copied, unit.arrays = arrays is not unit.arrays, arrays  # copied: a reader holds the old
        self.buses.after_kernel(u, unit, bus, arrays.p, copied)


class _InJit(_Update):
    """One jitted, in-place update of a unit (`step`, a subclass's), its bus copy written in the
    same call into the buffer bus.Buses gives it to donate. XLA:CPU spreads each large fused
    loop over all cores."""
    prepare_first = False
    in_jit = True

    def bind(self, store, buses, layout, host, counters):
        super().bind(store, buses, layout, host, counters)
        # Donating (store.donate) params, optax state and the old bus copy makes the update
        # write in place. keep_unused: the old bus is never read, only donated; jit would
        # otherwise prune it.
        self._step = jax.jit(packed(self.step), donate_argnums=store.donate,
                             static_argnums=(8, 9), keep_unused=True)
        if self.prepare_first:
            self._prepare = jax.jit(self.prepare, donate_argnums=(0,))

    def _arrive(self, grads, grad_norm, scale):
        if isinstance(grads, transfer.Parcel):  # the hop between the clients (copies, counted)
            on_host = self.host_sharding.device_set
            self.counters.host_copy_bytes += sum(
                p.nbytes for p in grads.token() if p.sharding.device_set != on_host)
        grads, grad_norm, scale = transfer.arrive((grads, grad_norm, scale), self.host_sharding)
        jax.block_until_ready((grads, grad_norm))
        return grads, grad_norm, scale

    def _update(self, u, unit, grads, grad_norm, scale, finite: bool):
        old_bus = self.buses.take(u, unit)
        self.store.load(u, unit)  # the disk tier: the state from its file (read ahead)
        if not finite:
            self.buses.skipped(u, unit, old_bus)
        else:
            if self.prepare_first:
                grads = self._prepare(grads, grad_norm, scale)
            unit.params, unit.opt_state, new_bus = self._step(
                unit.params, unit.opt_state, grads, old_bus, grad_norm, scale, np.int32(u),
                np.asarray(self.layout.firsts(u), np.uint32), not self.buses.writes(u),
                self.layout.packing(u))
            self.buses.updated(u, unit, new_bus)
        # The update is done when the weights are usable; and before the disk tier takes back
        # the buffer that params alias: a skipped step's bus copy is made from them.
        jax.block_until_ready((unit.params, unit.bus))
        self.store.store(u, unit)  # the disk tier: written back behind, out of RAM


class FusedInJit(_InJit):
    """fused_adamw.adamw in one jitted call per unit, one pass per leaf that also scales and clips
    the gradient (fused_adamw.update): the kernel through jax.ffi, else its JAX fallback."""
    kind = "ffi"  # (prepare_first False: the kernel's own pass scales and clips)

    def __init__(self, hyper: fused_adamw.Hyper, max_grad_norm, compute_dtype):
        self.hyper, self.max_grad_norm, self.compute_dtype = hyper, max_grad_norm, compute_dtype
        self.native = fused_adamw.native()

    def step(self, params, opt_state, grads, old_bus, grad_norm, scale, unit, firsts,
             bus_is_params):
        return fused_adamw.update(self.hyper, params, opt_state, grads, old_bus, grad_norm, scale,
                                  self.max_grad_norm, None if bus_is_params else self.compute_dtype,
                                  self.native, unit, firsts)


class OptaxInJit(_InJit):
    """Any optax transform in one jitted call per unit, after the gradient's scale and exact
    global-norm clip (`prepare`)."""
    kind = "optax"

    def __init__(self, optimizer: optax.GradientTransformation, max_grad_norm, compute_dtype,
                 grad_dtype):
        self.optimizer, self.max_grad_norm, self.compute_dtype = (optimizer, max_grad_norm,
                                                                  compute_dtype)
        # Scaled and clipped inside the update, the gradient becomes an intermediate that both
        # Adam moments read, and XLA:CPU gives it a fresh temporary (~3 B/param, page-faulted each
        # step). An fp32 gradient is therefore prepared first, in place, by its own pass; a bf16
        # one is upcast, so it has no fp32 buffer to work in and is prepared inside the update.
        self.prepare_first = jnp.dtype(grad_dtype) == jnp.float32

    def prepare(self, grads, grad_norm, scale):
        return prepare(grads, grad_norm, scale, self.max_grad_norm)

    def step(self, params, opt_state, grads, old_bus, grad_norm, scale, unit, firsts,
             bus_is_params):
        del old_bus, unit, firsts  # old_bus donated: the new bus copy is written into its buffer
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # no-op in fp32
        if not self.prepare_first:
            grads = self.prepare(grads, grad_norm, scale)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, None if bus_is_params else jax.tree.map(
            lambda p: p.astype(self.compute_dtype), params)


def choose(optimizer: optax.GradientTransformation, max_grad_norm, host_update: str, disk_tier,
           *, compute_dtype, grad_dtype, host_device, counters) -> tuple:
    """(the strategy, the log line's words for which runs and why), after `check`.

    host_update "auto": the direct update where it runs (why_not_direct), else one in a jit;
    "direct": the direct update or one ValueError line saying why it cannot run; "jit": one in a
    jit. In a jit: fused_adamw.adamw's fused pass, any other optimizer through optax."""
    check(optimizer, max_grad_norm)
    if host_update not in HOST_UPDATES:
        raise ValueError(f"host_update must be one of {', '.join(HOST_UPDATES)}, got "
                         f"{host_update!r}")
    why = "host_update='jit'" if host_update == "jit" else why_not_direct(optimizer, disk_tier)
    if why is not None and host_update == "direct":
        raise ValueError(f"host_update='direct' cannot run: {why}")
    hyper = fused_hyper(optimizer)
    if why is None:
        lib = fused_adamw.kernel()
        return (Direct(direct_lib.DirectAdamW(hyper, max_grad_norm, host_device, counters, lib)),
                "the fused AdamW kernel, called directly")
    if hyper is None:
        return (OptaxInJit(optimizer, max_grad_norm, compute_dtype, grad_dtype),
                f"a jitted update per unit ({why})")
    update = FusedInJit(hyper, max_grad_norm, compute_dtype)
    how = "through jax.ffi" if update.native else "as its JAX fallback"
    return update, f"a jitted update per unit ({why}): the fused AdamW kernel {how}"
