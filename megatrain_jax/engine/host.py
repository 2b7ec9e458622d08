"""The host state's coordinator: the units (store.py), their bus copies (bus.py) and their updates
(update.py) held together, and the thread that runs each unit's update, in order, with its
futures and failures."""

import concurrent.futures
import itertools
import logging
import os
import threading
import time
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import stage_units
from megatrain_jax.engine import store as store_lib
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.engine import update as update_lib
from megatrain_jax.engine.schedule import UPDATE_WAIT

log = logging.getLogger(__name__)


class HostState:
    """The units' state and their updates. Unit 0 is the first stage (the embedding), unit 1 + i
    layer i, the last unit the last stage's own variables (final norm, head): the order in which
    the next forward needs them, and the order of the host thread's updates (stage_units.py).

    `submit_all` queues one step's updates on the host thread (each gradient, of the
    unnormalised loss sum, scaled by `scale` and clipped to the global norm exactly as
    `optax.clip_by_global_norm`; a non-finite norm keeps the state, as `optax.apply_if_finite`).
    `bus(u)`, and every call that reads or replaces the state, first waits for u's update.

    Three owners, chosen at construction, hold the modes: `store` (store.py) every unit's state
    and where it lives between updates (RAM, the direct update's buffers, or the disk tier's
    files), with `units_layout` its layout; `buses` (bus.py) every bus copy and every write of
    it (the form: resident or the ring); `update` (update.py) how a unit is updated (the fused
    AdamW kernel called directly, or a jitted update: the kernel through jax.ffi, or optax).
    """

    def __init__(self, stages, blocks, optimizer: optax.GradientTransformation, *, max_grad_norm,
                 compute_dtype, grad_dtype, compute_device, host_device, counters, num_blocks: int,
                 disk_tier: Optional[tier_lib.DiskTierOptions] = None, shards=None,
                 host_update: str = "auto", bus_form: str = bus_lib.RESIDENT,
                 prefetch: int = 1, data_parallel: bool = False,
                 pinned_pool: Optional[int] = None, host_threads: Optional[int] = None):
        """stages: the stages' params (param_split((first, last))); blocks: an iterable of the
        blocks' params (with the disk tier, one in RAM at a time); shards (shard.Shards): keep
        this process's rows of every leaf; bus_form: of bus.FORMS (chosen: `buses.form`, `.why`)."""
        self.update, why = update_lib.choose(
            optimizer, max_grad_norm, host_update, disk_tier, compute_dtype=compute_dtype,
            grad_dtype=grad_dtype, host_device=host_device, counters=counters)
        pinned, threads = update_lib.threads(self.update, host_threads)
        log.info("host update: %s", f"{why} ({threads})" if threads else why)
        if shards is not None and disk_tier is not None:
            raise ValueError("shard_host_state with the disk tier is not supported")
        self.optimizer, self.counters, self.host_device = optimizer, counters, host_device
        self.compute_dtype, self.grad_dtype = jnp.dtype(compute_dtype), jnp.dtype(grad_dtype)
        self.host_sharding = jax.sharding.SingleDeviceSharding(host_device)
        self.buses = bus_lib.Buses(
            compute_dtype, compute_device, host_device, in_ram=disk_tier is None,
            in_place=self.update.in_place, form=bus_form, prefetch=prefetch,
            data_parallel=data_parallel, pool=pinned_pool, counters=counters)
        self.bus_sharding = self.buses.sharding
        self.failed = None  # why the state is unknown: a host update failed (see ready)
        self.on_update = None  # on_update(u), when set: the host thread starts unit u's update
        layout = self.units_layout = store_lib.Layout(num_blocks, optimizer, stages, shards,
                                                      self.buses.is_params, self.host_sharding,
                                                      self.update.in_jit)
        self.shapes, self.stage_units, self.last = layout.shapes, layout.stage_units, layout.last
        self.packing, self.layout, self.check_load = layout.packing, layout.of, layout.check_load
        self.stage_leaves = layout.stage_leaves
        self.store = store_lib.choose(disk_tier, layout, self.host_sharding,
                                      getattr(self.update, "kernel", None))
        # a bus copy made anew from a unit's weights reads them as a reader would (store.view)
        self.buses.attach(layout, self.store, lambda u: self.unit_state(u, self.store.view)[0])
        # what a step tells of its fetches goes to their owner (bus.Buses)
        self.fetches, self.fetched, self.read = (self.buses.fetches, self.buses.fetched,
                                                 self.buses.read)
        self.update.bind(self.store, self.buses, layout, self.host_sharding, counters)
        self.units = []
        try:
            self._build(blocks)
        except BaseException:
            self.store.close()  # the disk tier's open files, made with the first block
            raise
        self.tier = self.store.tier  # the DiskTier holding the state (tier.py), or None: RAM
        # the update's thread runs the kernel's share t = 0: on its CPU when the pool is pinned
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="host-optim",
            initializer=(lambda: os.sched_setaffinity(0, pinned)) if pinned else None)

    def _build(self, blocks):
        """Every unit made from its weights, into the store (with the disk tier, one block in
        RAM at a time), and its bus copy."""
        first, last = self.units_layout.split
        block_units = (self.units_layout.add_block(params) for params in blocks)
        for params in itertools.chain([first], block_units, [last]):
            u = len(self.units)
            if u == 1:  # the form, from the bytes of each
                self.buses.decide(first, last)
            self.units.append(self.store.new(params))
            self.buses.new(u, self.units[u])
            self.store.add(self.units)  # the disk tier: the state to its file
        del self.units_layout.split
        self.buses.finish(self.units)

    def stages_state(self) -> tuple:
        """(params, opt_state) of the whole stages, as one unit (a checkpoint's), from the two
        stage units once their updates have finished."""
        first, last = self.unit_state(0), self.unit_state(self.last)
        return tuple(stage_units.merge(a, b) for a, b in zip(first, last))

    def load_stages(self, unit_state: dict):
        """Replaces the stages' state with `unit_state` (whole: {"params", "opt_state"}), checked
        first (check_load), its dtypes the units' (store.cast)."""
        for u, part in self.units_layout.stage_parts(unit_state):
            self.load_unit(u, part)

    def unit_state(self, u: int, read=None) -> tuple:
        """(params, opt_state) of unit u once its update has finished, for a reader (store.lend,
        or `read`): host arrays, or with the disk tier read-only numpy arrays mapped from its
        file, once every update has finished (reading a file waits for the tier's reads and
        writes, which only the host thread may do while it updates)."""
        if self.tier is not None:
            self.wait()
        return (read or self.store.lend)(u, self.ready(u))

    # ----------------------------------------------------------------- the step's side (bus.py)
    def keep_bus_on_host(self, u: int):
        """Unit u's bus copy stays in host memory, where the host reads it (bus.Buses)."""
        self.buses.keep_on_host(u, self.ready(u))

    def bus(self, u: int):
        """Unit u's bus copy, once its pending update has finished."""
        return self.buses.get(u, self.ready(u))

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

    def release_bus(self, u: int):
        """After a unit's last use in a step (bus.Buses.release)."""
        self.buses.release(u, self.units[u])

    # ----------------------------------------------------------------- the thread
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
                if self.on_update is not None:
                    self.on_update(u)
                self.update.apply(u, self.units[u], grads, grad_norm, scale)
            except BaseException as e:
                failed = self._failure(u, e)
                future.set_exception(e)
                continue
            future.set_result(None)

    def _failure(self, u: int, e: BaseException) -> str:
        name = "the stages'" if u in (0, self.last) else f"layer {u - 1}'s"
        return f"{name} host update failed ({type(e).__name__}: {e})"

    def ready(self, u: int) -> store_lib.Unit:
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
        thread); its bus copy made anew."""
        params, opt_state = store_lib.cast(self.check_load(u, unit_state), self.layout(u))
        self.wait()
        unit = self.ready(u)
        self.store.put(u, unit, params, opt_state)
        self.buses.loaded(u, unit)

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
