"""Host-resident training state: per unit the fp32 master weights, the optax state and the bus
copy, and the background thread that runs each unit's host update (update.py's strategy: the
fused AdamW kernel called directly, or a jitted update on the host CPU device)."""

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import direct as direct_lib
from megatrain_jax.engine import packing as packing_lib
from megatrain_jax.engine import stage_units
from megatrain_jax.engine import store as store_lib
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.engine import transfer
from megatrain_jax.engine import update as update_lib
from megatrain_jax.engine.schedule import UPDATE_WAIT

log = logging.getLogger(__name__)
DEBUG_BUS = "MEGATRAIN_DEBUG_BUS"


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
    arrays: Optional[direct_lib.UnitArrays] = None  # the direct update's state (params and
    # opt_state None then): numpy buffers the engine owns, updated in place


class HostState:
    """The units' state and their updates. Unit 0 is the first stage (the embedding), unit 1 + i
    layer i, the last unit the last stage's own variables (final norm, head): the order in which
    the next forward needs them, and the order of the host thread's updates (stage_units.py).

    `submit_all([(u, grads), ...], grad_norm, scale)` queues one step's updates on the host
    thread, as one job (all or none of them; `submit(u, ...)` one unit's): each gradient
    (of the unnormalised loss sum) is scaled by `scale`, clipped to the global norm exactly as
    `optax.clip_by_global_norm` would, and applied. When the global norm is not finite the update
    keeps params and optax state as they were (as `optax.apply_if_finite` does), so one bad batch
    never reaches the weights. `bus(u)` waits for u's update and returns its bus copy. Every
    call that reads or replaces the state (`unit_state` with the disk tier, `load_unit`, `wait`)
    first waits for the pending updates.

    Three strategies, chosen at construction, hold the modes: `update` (update.py) how a unit is
    updated (the fused AdamW kernel called directly, or a jitted update: the kernel through
    jax.ffi, or optax), `store` (store.py) where params and optax state live between updates (RAM,
    or the disk tier's files), and per unit `buses[u]` (bus.py) how its bus copy is kept (the
    weights themselves, a host buffer rewritten in place, or pinned memory refreshed from a
    staging buffer). `packing(u)` (packing.py) is how unit u's bus copy and gradient travel: a
    layer unit's flat, one array each, else leaf by leaf.
    """

    def __init__(self, stages, blocks, optimizer: optax.GradientTransformation, *, max_grad_norm,
                 compute_dtype, grad_dtype, compute_device, host_device, counters, num_blocks: int,
                 disk_tier: Optional[tier_lib.DiskTierOptions] = None, shards=None,
                 host_update: str = "auto", bus: str = bus_lib.RESIDENT, prefetch: int = 1,
                 data_parallel: bool = False, pinned_pool: Optional[int] = None,
                 host_threads: Optional[int] = None):
        """stages: the stages' params (param_split((first, last))); blocks: an iterable of the
        blocks' params (with the disk tier, one in RAM at a time); bus: bus_lib.FORMS' RESIDENT
        (every unit's bus copy kept all step), RING (the layer units' in a ring of
        bus_lib.ring_size(prefetch) buffers, bus.Ring) or auto (bus_lib.choose_form, from the
        bytes of each in `pinned_pool`, None where the compute device has no such pool): the
        form taken and why are `bus_form`, `bus_why`."""
        # How each unit is updated (update.py), its hyperparameters checked there, said once in
        # the log: the fused AdamW kernel called directly on numpy state the engine owns, where
        # it can run; else one jitted update per unit.
        self.update, why = update_lib.choose(
            optimizer, max_grad_norm, host_update, disk_tier, compute_dtype=compute_dtype,
            grad_dtype=grad_dtype, host_device=host_device, counters=counters)
        pinned, threads = update_lib.threads(self.update, host_threads)
        log.info("host update: %s", f"{why} ({threads})" if threads else why)
        self.optimizer = optimizer
        self.compute_dtype = jnp.dtype(compute_dtype)
        self.grad_dtype = jnp.dtype(grad_dtype)
        self.host_device = host_device
        self.counters = counters
        self.host = jax.sharding.SingleDeviceSharding(host_device)
        self.last = 1 + num_blocks
        # How each unit's bus copy is kept (bus.py): per unit structure, and for a unit whose
        # bus copy the host reads (keep_bus_on_host). `staging`: the pinned policy's buffers.
        self.staging = {}
        self.bus_sharding, by_structure, self._on_host = bus_lib.choose(
            self.compute_dtype, compute_device, host_device, disk_tier is None, self.staging)
        self.buses = [by_structure[self._structure(u)] for u in range(self.last + 1)]
        self.ring = None  # bus.Ring with bus=RING: made once the units are
        if bus not in bus_lib.FORMS:
            raise ValueError(f"bus must be one of {', '.join(bus_lib.FORMS)}, got {bus!r}")
        no_ring = bus_lib.why_not_ring(self.buses[1].is_params, disk_tier, data_parallel)
        if bus == bus_lib.RING and no_ring:
            raise ValueError(f"bus='ring' cannot run: {no_ring}")
        self.bus_form, self.bus_why = bus_lib.RESIDENT, "asked for"  # until the units decide
        if bus == "auto" and no_ring:
            self.bus_why, bus = f"auto: the ring cannot run ({no_ring})", bus_lib.RESIDENT
        self._pinned_pool = pinned_pool
        self.failed = None  # why the state is unknown: a host update failed (see ready)
        self.on_update = None  # on_update(u), when set: the host thread starts unit u's update

        # shards (shard.Shards): keep only this process's rows of every leaf (the sharded layout);
        # `shapes` keeps the logical leaf shapes of the whole stages (0) and of a block (1).
        if shards is not None and disk_tier is not None:
            raise ValueError("shard_host_state with the disk tier is not supported")
        self.units, self.shapes = [], {}
        to_host = lambda params: jax.device_put(
            jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params), self.host)
        stages = to_host(stages)
        self.shapes[0] = [tuple(p.shape) for p in jax.tree.leaves(stages)]
        first, last = stage_units.split(shards.cut(stages) if shards is not None else stages)
        del stages
        # the stages' units' shapes of params and optax state (load_stages splits a checkpoint's
        # stages unit by them); the last unit's layout, for the tier's files (made before it is)
        layout = lambda params: (jax.eval_shape(lambda p: p, params),
                                 jax.eval_shape(optimizer.init, params))
        self.stage_units = {0: layout(first), self.last: layout(last)}
        self.block_layout = None  # a block unit's, made with the first
        # how each unit structure's bus copy and gradient travel (packing.py), the blocks' made
        # with the first
        stage = lambda params: packing_lib.choose(params, stage=True, sharded=shards is not None,
                                                  bus_is_params=self.buses[0].is_params)
        self._packings = {0: stage(first), 2: stage(last)}
        # Debug mode (MEGATRAIN_DEBUG_BUS=1), on both update paths: the fetches of a unit's bus
        # copy still copying are kept until the unit's update, which refuses to write the copy
        # while one of them still is (direct.py: when the bus copy may be written)
        debug = os.environ.get(DEBUG_BUS) == "1"
        self.fetches = {} if debug else None
        self._ring_args = (bus, prefetch, debug)
        # Where params and optax state live between updates (store.py): RAM or the disk tier.
        self.store = store_lib.choose(disk_tier, self.last + 1, self.stage_units[self.last],
                                      self.host, self.direct)
        try:
            self._build(first, blocks, last, to_host, shards, host_device, layout)
        except BaseException:
            self.store.close()  # the disk tier's open files, made with the first block
            raise
        shapes = lambda u: [x.shape for x in jax.tree.leaves(self.layout(u)[0])]
        self._firsts = {self._structure(u): shards.firsts(shapes(u)) if shards is not None else
                        [0] * len(shapes(u)) for u in (0, 1, self.last)}
        # the update's thread runs the kernel's share t = 0: on its CPU when the pool is pinned
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="host-optim",
            initializer=(lambda: os.sched_setaffinity(0, pinned)) if pinned else None)

    def _build(self, first, blocks, last, to_host, shards, host_device, layout):
        """The jitted updates, and every unit made from its weights (into the store)."""
        if self.direct is None:
            # Donating (store.donate) params, optax state and the old bus copy makes the update
            # write in place. keep_unused: the old bus is never read, only donated; jit would
            # otherwise prune it.
            self._update = jax.jit(update_lib.packed(self.update.step),
                                   donate_argnums=self.store.donate, static_argnums=(8, 9),
                                   keep_unused=True)
            if self.update.prepare_first:
                self._prepare_in_place = jax.jit(self.update.prepare, donate_argnums=(0,))
        # out_shardings: optax state that does not depend on the params (counts, zeros) would
        # otherwise land uncommitted on the default device, the accelerator.
        self._init = jax.jit(self.optimizer.init, out_shardings=self.host)

        def block_units():  # an iterable: with the disk tier, one unit in RAM at a time
            for params in blocks:
                params = to_host(params)
                self.shapes.setdefault(1, [tuple(p.shape) for p in jax.tree.leaves(params)])
                params = shards.cut(params) if shards is not None else params
                if self.block_layout is None:
                    self.block_layout = layout(params)
                    self._packings[1] = packing_lib.choose(
                        params, stage=False, sharded=shards is not None,
                        bus_is_params=self.buses[1].is_params)
                yield params

        bus, prefetch, debug = self._ring_args
        size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
        in_ring = False
        for params in itertools.chain([first], block_units(), [last]):
            u = len(self.units)
            if u == 1 and bus != bus_lib.RESIDENT:  # decided from the bytes of each form
                stages = size(first) + size(last)
                pinned = lambda layers: self.compute_dtype.itemsize * (
                    stages + layers * self.packing(1).size)  # (a flat one's padding too)
                self.bus_form, self.bus_why = bus_lib.choose_form(
                    bus, resident_pinned=pinned(self.last - 1),
                    ring_pinned=pinned(bus_lib.ring_size(prefetch)), pool=self._pinned_pool)
                in_ring = self.bus_form == bus_lib.RING
            self.units.append(self._new_unit(params, in_ring and u not in (0, self.last)))
            self.store.add(self.units)  # the disk tier: the state to its file
        if in_ring:  # its buffers made like a bus copy of layer 0's weights (then rewritten)
            layer_0 = lambda: self.store.view(1, self.units[1])[0]
            self.ring = bus_lib.Ring(lambda: self.make_bus(layer_0(), 1),
                                     bus_lib.ring_size(prefetch),
                                     bus_lib.writer(self.packing(1)), debug)
        for u in (0, 1, self.last):  # one per structure (pinned bus copies only)
            if self.direct is None and not self.in_ring(u):
                self.buses[u].make_staging(self.units[u].bus, host_device)

    def _new_unit(self, params, in_ring: bool) -> Unit:
        """Unit len(units), its optax state and bus copy (none for a unit `in_ring`: the bus
        ring's fills make it) made from its fp32 master weights."""
        u = len(self.units)
        if self.direct is None:
            return Unit(params, self._init(params), None if in_ring else self.make_bus(params, u))
        unit = Unit(None, None, arrays=direct_lib.UnitArrays.of(params, self._init(params),
                                                                self.direct.lib))
        if not in_ring:
            self._direct_bus(u, unit)
        return unit

    def in_ring(self, u: int) -> bool:
        """Whether unit u's bus copy is made in the bus ring (a layer unit, with bus=RING)."""
        return self.ring is not None and u not in (0, self.last)

    def bus_example(self):
        """A bus copy of a layer unit, as the fetches take it (for Transfers.check)."""
        return self.ring.slots[0].bus if self.ring is not None else self.units[1].bus

    def _direct_bus(self, u: int, unit: Unit):
        """A new bus copy of unit u for the direct update (which then rewrites it in place): the
        weights themselves (wrapped, ParamsBus), or a buffer made from them (packed as u travels:
        a layer's one flat array). New, never
        the old one rewritten: a fetch of the old one may still be copying (a load right after an
        evaluation), and keeps it until it is done."""
        view = self.store.view(u, unit)[0]
        unit.bus = view if self.buses[u].is_params else self.make_bus(view, u)

    @property
    def direct(self) -> Optional[direct_lib.DirectAdamW]:
        """The direct update (direct.py) where it is the one chosen, else None: its units' state
        is then numpy buffers the engine owns (`Unit.arrays`), updated and read in place."""
        return self.update if self.update.kind == "direct" else None

    @property
    def tier(self):
        """The DiskTier holding the state (tier.py), or None when it is in RAM."""
        return self.store.tier

    def _structure(self, u: int) -> int:
        """Which units share a structure (and a staging buffer): 0 the first stage, 1 the
        blocks, 2 the last stage."""
        return 0 if u == 0 else 2 if u == self.last else 1

    def packing(self, u: int):
        """How unit u's bus copy and gradient travel (packing.py: Flat or PerLeaf)."""
        return self._packings[self._structure(u)]

    def stage_leaves(self, u: int) -> tuple:
        """The whole stages' leaf indices that stage unit u (0 or `last`) holds."""
        return stage_units.indices(self.stage_units[u][0])

    def stages_state(self) -> tuple:
        """(params, opt_state) of the whole stages, as one unit (a checkpoint's), from the two
        stage units once their updates have finished."""
        first, last = self.unit_state(0), self.unit_state(self.last)
        return tuple(stage_units.merge(a, b) for a, b in zip(first, last))

    def layout(self, which) -> tuple:
        """(params, opt_state) of unit `which` (an index, or "stages": the whole stages, as a
        checkpoint holds them) as jax.ShapeDtypeStruct trees: what a loaded state must match."""
        if which == "stages":
            return tuple(stage_units.merge(a, b) for a, b in zip(self.stage_units[0],
                                                                 self.stage_units[self.last]))
        return self.stage_units.get(which, self.block_layout)

    def firsts(self, u: int) -> list:
        """Per leaf of unit u, the index in the whole leaf of the first element this process
        holds (the sharded layout's rows; else 0): with u, what keys bf16 moments' rounding."""
        return self._firsts[self._structure(u)]

    def check_load(self, which, unit_state: dict) -> tuple:
        """(params, opt_state) of `unit_state` if unit `which` (as `layout`) can take it, else
        one ValueError line naming the unit and the leaf (store.check)."""
        what = "the stages" if which in ("stages", 0, self.last) else f"layer {which - 1}"
        return store_lib.check(unit_state, self.layout(which), what)

    def load_stages(self, unit_state: dict):
        """Replaces the stages' state with `unit_state` (whole: {"params", "opt_state"}), checked
        first (check_load), its dtypes the units' (store.cast)."""
        whole = store_lib.cast(self.check_load("stages", unit_state), self.layout("stages"))
        taken = set()  # scalar optax state (a count) goes to both units: each gets its own
        for u, (params, opt_state) in self.stage_units.items():
            part = {"params": stage_units.like(whole[0], params),
                    "opt_state": stage_units.like(whole[1], opt_state)}
            part = jax.tree.map(lambda x: x.copy() if id(x) in taken else x, part)
            taken |= {id(x) for x in jax.tree.leaves(part)}
            self.load_unit(u, part)

    def unit_state(self, u: int) -> tuple:
        """(params, opt_state) of unit u once its update has finished: host arrays, or with the
        disk tier read-only numpy arrays mapped from its file, once every update has finished
        (reading a file waits for the tier's reads and writes, which only the host thread may
        do while it updates)."""
        if self.tier is not None:
            self.wait()
        return self.store.lend(u, self.ready(u))

    # ----------------------------------------------------------------- bus copies
    def make_bus(self, params, u: int):
        """A bus copy of unit u's weights `params`, as its policy keeps it, packed as u
        travels."""
        return self.buses[u].make(params, self.packing(u))

    def keep_bus_on_host(self, u: int):
        """Unit u's bus copy stays in host memory, where the host reads it (the host lookup,
        engine/lookup.py); on an accelerator it is no longer refreshed to its pinned memory."""
        unit = self.ready(u)
        if self.buses[u].on_host:
            return
        self.staging.pop(self._structure(u), None)
        self.buses[u] = self._on_host
        if self.direct is not None:
            unit.bus = None
            self._direct_bus(u, unit)
            return
        unit.bus, unit.spare = self.make_bus(self.unit_state(u)[0], u), None

    def bus(self, u: int):
        """Unit u's bus copy, once its pending update has finished (a layer unit's with the bus
        ring: filled into the ring's next slot, for one fetch)."""
        unit = self.ready(u)
        if self.in_ring(u):
            master = (unit.arrays.p if unit.arrays is not None else
                      jax.tree.leaves(self.store.view(u, unit)[0]))
            return self.ring.fill(u, master)
        if unit.bus is None:  # released by a step that then failed: still the weights' copy
            unit.bus, unit.spare = unit.spare, None
        if unit.bus is None:  # (given back to the pinned pool): rebuilt from the weights
            unit.bus = self.make_bus(self.unit_state(u)[0], u)
        return unit.bus

    def stage_bus(self, indices) -> list:
        """The whole stages' bus leaves at `indices`, each from the stage unit holding it once
        that unit's pending update has finished."""
        leaves = {}
        for u in (0, self.last):
            held = set(self.stage_leaves(u)) & set(indices)
            if held:
                bus = stage_units.flat(self.bus(u))
                leaves.update({i: bus[i] for i in held})
        return [leaves[i] for i in indices]

    def fetched(self, u: int, copies):
        """Debug mode: `copies` (device arrays) are a fetch of unit u's bus copy, to be done before
        u's update writes it. The unit's earlier fetches already done are let go of (in a loop of
        evaluations no update comes to take them: they would stay on the device)."""
        if self.fetches is not None:
            copying = [x for x in self.fetches.get(u, ()) if not x.is_deleted()
                       and not x.is_ready()]
            self.fetches[u] = copying + jax.tree.leaves(copies)
        if self.in_ring(u):
            self.ring.fetched(u, copies)

    def read(self, u: int, token=None):
        """Unit u's latest fetch has been read: by work now done (token None), or by the work
        that makes `token`, not waited for (LayerStream's on_retire). Frees its bus ring slot."""
        if self.in_ring(u):
            if token is None:
                self.ring.retired(u)
            else:
                self.ring.released(u, token)

    def _check_fetches(self, u: int, what: str):
        copying = [x for x in (self.fetches or {}).pop(u, ()) if not x.is_deleted()
                   and not x.is_ready()]
        if copying:
            raise RuntimeError(f"{what}: its bus copy would be written while {len(copying)} of "
                               f"its fetched arrays are still being copied (the update must start "
                               f"after every fetch of the unit fed its gradient)")

    def release_bus(self, u: int):
        """After a unit's last use in a step (bus.py: a host buffer is kept for the update to
        write in place, a pinned one goes back to the accelerator's pinned pool). The direct
        update keeps every bus copy where it is and writes it in place."""
        if self.direct is None and not self.in_ring(u):
            self.buses[u].release(self.units[u])

    # ----------------------------------------------------------------- the update
    def _apply_direct(self, u: int, grads, grad_norm, scale):
        """Runs on the host-optimizer thread: unit u's update by the kernel called directly
        (direct.py), reading the gradient's pieces where they are and writing the bus copy in
        place: no copy, no jit but the step's scalars."""
        t0 = time.perf_counter()
        if self.on_update is not None:
            self.on_update(u)
        grads, grad_norm, scale = (x() if callable(x) else x for x in (grads, grad_norm, scale))
        grad_norm = np.float32(np.asarray(grad_norm))  # a view of the pinned scalar: waits for it
        unit = self.units[u]
        t1 = time.perf_counter()
        if np.isfinite(grad_norm):  # else skipped (as optax.apply_if_finite): nothing changes
            pieces = (grads.pieces if isinstance(grads, transfer.Parcel)
                      else [[g] for g in jax.tree.leaves(grads)])
            _wait_for_arrays(pieces)  # the gradient's copies out (arrival, not the update's work)
            t1 = time.perf_counter()
            params_bus = self.buses[u].is_params
            # (the bus ring's units: no bus copy to write, the fills make it)
            bus = None if params_bus or self.in_ring(u) else unit.bus
            what = self._name(u)
            self._check_fetches(u, what)
            arrays = self.direct.apply(u, unit.arrays, pieces, grad_norm,
                                       np.float32(np.asarray(scale)), bus, what, self.firsts(u),
                                       self.packing(u))
            if arrays is not unit.arrays:  # copied: a reader holds the old state
                unit.arrays = arrays
                if params_bus:
                    self._direct_bus(u, unit)
        t2 = time.perf_counter()
        self.counters.host_compute_s += t2 - t1
        self.counters.host_update_s += t2 - t0

    def _apply(self, u: int, bus, grads, grad_norm, scale):
        """Runs on the host-optimizer thread: one jitted, in-place update of one unit (the fused
        AdamW through jax.ffi, or optax), its bus copy (kept by `bus`, unit u's policy) written in the same call. XLA:CPU spreads each
        large fused loop over all cores."""
        t0 = time.perf_counter()
        if self.on_update is not None:
            self.on_update(u)
        grads, grad_norm, scale = (x() if callable(x) else x for x in (grads, grad_norm, scale))
        if isinstance(grads, transfer.Parcel):  # the hop between the clients (copies, counted)
            self.counters.host_copy_bytes += sum(
                p.nbytes for p in grads.token() if p.sharding.device_set != self.host.device_set)
        grads, grad_norm, scale = transfer.arrive((grads, grad_norm, scale), self.host)
        jax.block_until_ready((grads, grad_norm))  # arrival, not the update's work
        t1 = time.perf_counter()
        unit = self.units[u]
        self._check_fetches(u, self._name(u))  # (the update writes into the old bus copy)
        self.store.load(u, unit)  # the disk tier: the state from its file (read ahead)
        in_ring = self.in_ring(u)  # no bus copy to write: the bus ring's fills make it
        old_bus = None if in_ring else bus.old_for_update(unit)
        unit.bus = unit.spare = None
        # A non-finite global norm skips the update (as optax.apply_if_finite), decided here. A
        # select between the new and the old state inside the update made XLA copy the donated
        # optax state first (8 B/param of fresh memory, page-faulted in every update: several
        # times slower).
        if not np.isfinite(grad_norm):
            unit.bus = None if in_ring else bus.on_skip(unit, old_bus, self.packing(u))
        else:
            if self.update.prepare_first:
                grads = self._prepare_in_place(grads, grad_norm, scale)
            unit.params, unit.opt_state, new_bus = self._update(
                unit.params, unit.opt_state, grads, old_bus, grad_norm, scale, np.int32(u),
                np.asarray(self.firsts(u), np.uint32), bus.is_params or in_ring, self.packing(u))
            if not in_ring:
                unit.bus = bus.after_update(unit, new_bus)
            if not bus.on_host and not in_ring:  # the refresh to the accelerator's pinned memory
                self.counters.host_copy_bytes += transfer.nbytes(unit.bus)
        # The future completes when the weights are usable; and before the disk tier takes back
        # the buffer that params alias: a skipped step's bus copy is made from them.
        jax.block_until_ready(unit.params if in_ring else unit.bus)
        self.store.store(u, unit)  # the disk tier: written back behind, out of RAM
        t2 = time.perf_counter()
        self.counters.host_compute_s += t2 - t1
        self.counters.host_update_s += t2 - t0

    def submit(self, u: int, grads, grad_norm, scale):
        """Queues unit u's update, as submit_all."""
        self.submit_all([(u, grads)], grad_norm, scale)

    def submit_all(self, grads: list, grad_norm, scale):
        """Queues one step's updates, `grads` a list of (unit, its gradient) in the order they
        run, as one job: all of them or, when this raises (a KeyboardInterrupt), none. Each
        gradient is a transfer.Parcel on its way to the host, or host arrays; the global norm of
        the scaled gradient and the scale are scalars in the compute device's pinned host memory,
        or host scalars. Each may instead be a function called on the host thread that returns
        it (the host lookup's, engine/lookup.py). Each unit has its own future (`ready`), so the
        next step's fetches wait for their unit's update alone."""
        jobs = [(u, g, concurrent.futures.Future()) for u, g in grads]
        claim = threading.Lock()  # the job starts all of its updates, or the caller cancels all
        previous = [self.units[u].pending for u, _, _ in jobs]
        try:
            for u, _, future in jobs:
                self.units[u].pending = future
            self._thread.submit(self._run_all, claim, jobs, grad_norm, scale)
        except BaseException:
            with claim:
                cancelled = all([future.cancel() for _, _, future in jobs])
            if cancelled:  # not started: as if never queued
                for (u, _, _), future in zip(jobs, previous):
                    self.units[u].pending = future
            raise

    def _run_all(self, claim, jobs, grad_norm, scale):
        """Runs on the host-optimizer thread: one step's updates in order. After one fails the
        rest are not run (their futures say why): the state is unknown from there on."""
        with claim:
            if not all([future.set_running_or_notify_cancel() for _, _, future in jobs]):
                return  # cancelled by submit_all
        for u, _, _ in jobs:
            self.store.expect(u)  # the disk tier: its read may start ahead
        failed = None
        for u, grads, future in jobs:
            if failed is not None:
                future.set_exception(NotRun(failed))
                continue
            try:
                if self.direct is not None:
                    self._apply_direct(u, grads, grad_norm, scale)
                else:
                    self._apply(u, self.buses[u], grads, grad_norm, scale)
            except BaseException as e:
                failed = self._failure(u, e)
                future.set_exception(e)
                continue
            future.set_result(None)

    def _name(self, u: int) -> str:
        return "the stages' unit" if u in (0, self.last) else f"layer {u - 1}"

    def _failure(self, u: int, e: BaseException) -> str:
        name = "the stages'" if u in (0, self.last) else f"layer {u - 1}'s"
        return f"{name} host update failed ({type(e).__name__}: {e})"

    def ready(self, u: int) -> Unit:
        """Unit u once its pending update has finished. An update that failed (re-raised here)
        leaves that unit's state unknown: every later call refuses. Only what the update's
        future carries is its failure: an exception raised in the waiting thread itself (a
        Ctrl-C while it waits) leaves the update pending, to be waited for again."""
        if self.failed:
            raise RuntimeError(f"the engine is unusable: {self.failed}")
        unit = self.units[u]
        if unit.pending is not None:
            t0 = time.perf_counter()
            waits = not unit.pending.done()  # (a finished update is no wait: not counted as one)
            try:
                error = unit.pending.exception()  # waits
            except concurrent.futures.CancelledError as e:  # (by close)
                error = e
            unit.pending = None
            if isinstance(error, NotRun):
                self.failed = str(error)
                raise RuntimeError(f"the engine is unusable: {self.failed}")
            if error is not None:
                self.failed = self._failure(u, error)
                raise error
            if waits:
                self.counters.synced(UPDATE_WAIT, time.perf_counter() - t0)
        return unit

    def failure(self):
        """Why the state is unknown (a host update failed, perhaps not yet seen by `ready`), or
        None: every update that finished succeeded, so the state is that of a whole number of
        steps (those still queued are whole steps too)."""
        if not self.failed:
            for u, unit in enumerate(self.units):
                future = unit.pending
                if future is not None and future.done() and not future.cancelled() and (
                        future.exception() is not None):
                    e = future.exception()
                    self.failed = str(e) if isinstance(e, NotRun) else self._failure(u, e)
                    break
        return self.failed

    def wait(self):
        """Blocks until every pending update has finished (with the disk tier, written back)."""
        for u in range(len(self.units)):
            self.ready(u)
        self.store.flush()

    def load_unit(self, u: int, unit_state: dict):
        """Replaces unit u's state with `unit_state` ({"params", "opt_state"}), checked first
        (check_load), its dtypes the unit's (store.cast: the moments of another state dtype), once
        every pending update has finished (with the disk tier, the file is written on this
        thread)."""
        params, opt_state = store_lib.cast(self.check_load(u, unit_state), self.layout(u))
        self.wait()
        unit = self.ready(u)
        if self.direct is not None:
            self.store.put(u, unit, params, opt_state)
            if not self.in_ring(u):
                self._direct_bus(u, unit)
            return
        params = jax.device_put(params, self.host)
        opt_state = jax.device_put(opt_state, self.host)
        self.store.put(u, unit, params, opt_state)
        unit.bus = None if self.in_ring(u) else self.make_bus(params, u)

    def close(self):
        """Waits for the pending updates (raising what failed); after a failed update, cancels
        those still queued instead."""
        try:
            if not self.failed:  # (what failed was raised already)
                self.wait()
        finally:
            self._thread.shutdown(cancel_futures=True)
            self.store.close()


class NotRun(RuntimeError):
    """A unit's update that did not run: an earlier one of its step failed (the message)."""


def _wait_for_arrays(pieces):
    """Waits until every jax array among a gradient's pieces is ready (numpy pieces are)."""
    jax.block_until_ready([p for leaf in pieces for p in leaf
                           if isinstance(p, jax.Array) and not p.is_deleted()])
