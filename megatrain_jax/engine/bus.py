"""Every unit's bus copy (its weights in the compute dtype, ready to cross to the device) and every
write of it: the one module that makes, fills, writes in place, refreshes and releases a bus copy
(tests/test_architecture.py holds the package to that). `Buses` owns them all for the host state:
the bus form (resident copies, or the layer units' in a `Ring`), each unit's policy, the pinned
policy's staging buffers, the debug mode's fetches, and the update's side of each write: the
buffer a jitted update donates and what it returns (`take`, `updated`, `skipped`), the pointers
the direct kernel writes its cast through (`kernel_targets`, `after_kernel`).

One policy per unit, chosen once by `choose`:

    ParamsBus  the bus copy IS the fp32 master weights: state and compute share a device, fp32
               compute, the state in RAM
    HostBus    a host buffer that the update rewrites in place: kept as `spare` between its
               release and the update
    PinnedBus  the accelerator's pinned host memory: the update writes a reused host buffer
               (`staging`, one per unit structure) that is then copied over

Each policy: `make(params, packing)` a bus copy of the weights, packed as the unit travels
(engine/packing.py: one flat array, or leaf by leaf); `release(unit)` after the unit's last use
in a step; `old_for_update(unit)` the buffer the update donates for its new bus copy (None: none);
`after_update(unit, bus)` the new bus copy from the update's compute-dtype output;
`on_skip(unit, old, packing)` the bus copy when a non-finite norm skipped the update;
`make_staging(bus, host_device)` at construction, the update's reused output buffer (PinnedBus's).
`is_params`: the update returns no bus copy (the weights are it); `on_host`: the copy is in host
memory, where the host reads it (the host lookup, engine/lookup.py). `cast_into` writes a bus
copy from the fp32 master through its leaves' pointers (the bus ring's fills).
"""

import ctypes
import dataclasses
import math
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import fused_adamw, transfer


def refresh(bus, sharding):
    """A new bus copy (written by the host update on the host device) copied to where the compute
    device reads it (`sharding`: its pinned host memory): on the host-update thread."""
    return jax.tree.map(lambda x: transfer.across_clients(x, sharding), bus)


def copy_of(tree, dtype, sharding):
    """A bus copy of `tree` (weights anywhere) in `dtype` where the compute device reads it
    (`sharding`), made once: the decoder's (engine/decode.py), which no update writes."""
    return refresh(jax.tree.map(lambda p: jnp.asarray(p).astype(dtype), tree), sharding)


class _Policy:
    def make_staging(self, bus, host_device):
        """The update's reused output buffer for units structured as `bus`: only PinnedBus has
        one."""


class ParamsBus(_Policy):
    """The bus copy is the unit's fp32 master weights themselves."""
    is_params, on_host = True, True

    def make(self, params, packing):
        return params

    def release(self, unit):
        unit.bus = None

    def old_for_update(self, unit):
        return None

    def after_update(self, unit, bus):
        return unit.params

    def on_skip(self, unit, old, packing):
        return unit.params


class HostBus(_Policy):
    """A host buffer in the compute dtype, rewritten in place by the update."""
    is_params, on_host = False, True

    def __init__(self, compute_dtype, host_device):
        self.compute_dtype, self.host_device = compute_dtype, host_device
        self.host_sharding = jax.sharding.SingleDeviceSharding(host_device)

    def make(self, params, packing):
        if self.compute_dtype == jnp.float32:  # (the disk tier, where the weights leave RAM
            # between updates): a copy, not the weights, which astype and device_put would return
            params = jax.tree.map(lambda p: jnp.array(p, copy=True, device=self.host_device),
                                  params)
        cast = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        return refresh(packing.packed(cast, self.host_sharding), self.host_sharding)

    def release(self, unit):
        """Kept for the update to write in place (the plan counts bus copies and gradients
        together): freed and allocated again, it would be page-faulted in each step."""
        if unit.bus is not None:
            unit.spare = unit.bus
        unit.bus = None

    def old_for_update(self, unit):
        return unit.bus if unit.bus is not None else unit.spare

    def after_update(self, unit, bus):
        return bus

    def on_skip(self, unit, old, packing):
        # old: still the weights' copy
        return old if old is not None else self.make(unit.params, packing)


class PinnedBus(_Policy):
    """In the compute device's pinned host memory, which it reads by DMA with no staging copy.
    The update cannot write there (another device's memory), so it writes into a reused host
    buffer (`staging[key]`, shared by the units of one structure) that is then copied over.

    Were that copy a zero-copy view of the staging buffer (transfer.across_clients' numpy-view
    put, which on two CPU devices aliases), the next unit's update could not overwrite the copy
    through the donated staging buffer: PJRT does not donate a buffer that a numpy view still
    references, and XLA writes a fresh one instead. Checked by forcing that path on two CPU
    devices: every exactness test passed, only test_update_reuses_buffers[staged] failed (fresh
    memory each update): the hazard is speed, not correctness."""
    is_params, on_host = False, False

    def __init__(self, compute_dtype, sharding, staging: dict, key: int, host_sharding):
        """host_sharding: the host device's, where a flat bus copy is packed."""
        self.compute_dtype, self.sharding, self.staging, self.key = (compute_dtype, sharding,
                                                                     staging, key)
        self.host_sharding = host_sharding

    def make(self, params, packing):
        cast = jax.tree.map(lambda p: p.astype(self.compute_dtype), params)
        return refresh(packing.packed(cast, self.host_sharding), self.sharding)

    def make_staging(self, bus, host_device):
        """The staging buffer, made before the first update so that it compiles once per unit
        structure."""
        zeros = lambda p: jnp.zeros(p.shape, self.compute_dtype, device=host_device)
        self.staging[self.key] = jax.tree.map(zeros, bus)

    def release(self, unit):
        """Back to the accelerator's pinned pool, while the update writes the staging buffer."""
        unit.bus = None

    def old_for_update(self, unit):
        return self.staging.pop(self.key, None)

    def after_update(self, unit, bus):
        self.staging[self.key] = bus  # reused by the next unit: this copy is waited for
        return refresh(bus, self.sharding)

    def on_skip(self, unit, old, packing):
        bus = self.make(unit.params, packing)
        self.staging[self.key] = old
        return bus


def sharding(compute_device, host_device):
    """Where bus copies wait: the compute device's pinned host memory, which it reads by DMA,
    where it has one and is not the host device; otherwise the host device's memory."""
    if compute_device == host_device or transfer.PINNED not in transfer.memory_kinds(
            compute_device):
        return jax.sharding.SingleDeviceSharding(host_device)
    return jax.sharding.SingleDeviceSharding(compute_device, memory_kind=transfer.PINNED)


def choose(compute_dtype, compute_device, host_device, in_ram: bool, staging: dict) -> tuple:
    """(the sharding bus copies live on, the policies of the three unit structures: 0 the first
    stage, 1 the blocks, 2 the last stage, the policy of a bus copy kept in host memory).

    PinnedBus in the compute device's pinned host memory; otherwise a host buffer rewritten in
    place, the weights themselves in fp32 with the state in RAM (not with the disk tier, where
    the weights leave RAM between updates)."""
    host = HostBus(compute_dtype, host_device)
    on_host = ParamsBus() if compute_dtype == jnp.float32 and in_ram else host
    where = sharding(compute_device, host_device)
    if where.memory_kind != transfer.PINNED:
        return where, [on_host] * 3, on_host
    return where, [PinnedBus(compute_dtype, where, staging, key, host.host_sharding)
                   for key in range(3)], \
        on_host


# ----------------------------------------------------------------------------- every unit's
DEBUG_BUS = "MEGATRAIN_DEBUG_BUS"


class Buses:
    """Every unit's bus copy, for the host state (host.py), which hands each call the unit's
    record (store.Unit: its `bus`, and `spare`, are written here alone).

    `form`, `why`: RESIDENT (each unit's copy kept all step) or RING (the layer units' in a
    `Ring` of ring_size(prefetch) buffers, filled before each fetch), decided once the first
    block is known (`decide`). `in_place`: the update writes each bus copy where it lies (the
    direct kernel): never released, never staged. `policies[u]`: unit u's policy (module
    docstring); `fetches`: debug mode's fetches still copying, per unit (else None)."""

    def __init__(self, compute_dtype, compute_device, host_device, *, in_ram: bool,
                 in_place: bool, form: str, prefetch: int, data_parallel: bool,
                 pool: Optional[int], counters):
        """form: FORMS' RESIDENT, RING or auto (choose_form, from the bytes of each in `pool`,
        the pinned pool, None where the compute device has none); in_ram: the state stays in
        RAM (not the disk tier)."""
        self.compute_dtype, self.host_device = jnp.dtype(compute_dtype), host_device
        self.in_place, self.prefetch, self.pool, self.counters = in_place, prefetch, pool, counters
        self.staging = {}  # the pinned policy's buffers, per unit structure
        self.sharding, self._by_structure, self._on_host = choose(
            self.compute_dtype, compute_device, host_device, in_ram, self.staging)
        if form not in FORMS:
            raise ValueError(f"bus must be one of {', '.join(FORMS)}, got {form!r}")
        no_ring = why_not_ring(self.is_params, not in_ram, data_parallel)
        if form == RING and no_ring:
            raise ValueError(f"bus='ring' cannot run: {no_ring}")
        self.form, self.why = RESIDENT, "asked for"  # until `decide`
        if form == "auto" and no_ring:
            self.why, form = f"auto: the ring cannot run ({no_ring})", RESIDENT
        self._asked = form
        # Debug mode (DEBUG_BUS=1), on both update paths: the fetches of a unit's bus copy still
        # copying are kept until the unit's update, which refuses to write the copy while one of
        # them still is (direct.py: when the bus copy may be written)
        self.debug = os.environ.get(DEBUG_BUS) == "1"
        self.fetches = {} if self.debug else None
        self.ring, self.policies, self.layout, self.store = None, [], None, None

    @property
    def is_params(self) -> bool:
        """Whether a bus copy is the fp32 master weights themselves (ParamsBus)."""
        return self._by_structure[0].is_params

    def attach(self, layout, store, weights):
        """The units' layout and store (store.py); weights(u): unit u's fp32 weights once its
        update and (with the disk tier) every other has finished, to rebuild a bus copy from."""
        self.layout, self.store, self.weights = layout, store, weights
        self.policies = [self._by_structure[layout.structure(u)]
                         for u in range(layout.last + 1)]

    def decide(self, first, last):
        """The form, from the bytes of each (first, last: the stage units' params; the first
        block's layout known)."""
        if self._asked == RESIDENT:
            return
        size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
        pinned = lambda layers: self.compute_dtype.itemsize * (
            size(first) + size(last) + layers * self.layout.packing(1).size)  # (a flat one's
        # padding too)
        self.form, self.why = choose_form(
            self._asked, resident_pinned=pinned(self.layout.last - 1),
            ring_pinned=pinned(ring_size(self.prefetch)), pool=self.pool)

    def in_ring(self, u: int) -> bool:
        """Whether unit u's bus copy is made in the bus ring (a layer unit, with RING)."""
        return self.form == RING and u not in (0, self.layout.last)

    def make(self, u: int, params):
        """A bus copy of unit u's weights `params`, as its policy keeps it, packed as u travels."""
        return self.policies[u].make(params, self.layout.packing(u))

    def new(self, u: int, unit):
        """Unit u's first bus copy, from its weights (none in the ring: its fills make it). New,
        never the old one rewritten: a fetch of the old one may still be copying (a load right
        after an evaluation), and keeps it until it is done."""
        unit.bus = unit.spare = None
        if not self.in_ring(u):
            unit.bus = self.make(u, self.store.view(u, unit)[0])

    def finish(self, units: list):
        """After every unit is made: the ring's buffers (made like a bus copy of layer 0's
        weights, then rewritten), the staging buffers (one per structure, pinned only)."""
        if self.form == RING:
            self.ring = Ring(lambda: self.make(1, self.store.view(1, units[1])[0]),
                             ring_size(self.prefetch), writer(self.layout.packing(1)), self.debug)
        for u in (0, 1, self.layout.last):
            if not self.in_place and not self.in_ring(u):
                self.policies[u].make_staging(units[u].bus, self.host_device)

    def example(self, units: list):
        """A bus copy of a layer unit, as the fetches take it (for Transfers.check)."""
        return self.ring.slots[0].bus if self.ring is not None else units[1].bus

    def nbytes(self, units: list) -> int:
        """Bytes of the bus copies held now: each unit's (or the buffer kept for its update to
        write), the ring's, the staging buffers; none for a copy that is the weights."""
        trees = [(unit.bus, unit.spare) for unit, policy in zip(units, self.policies)
                 if not policy.is_params]
        trees += [slot.bus for slot in self.ring.slots] if self.ring is not None else []
        return transfer.nbytes((trees, list(self.staging.values())))

    # ------------------------------------------------------------------- the step's side
    def get(self, u: int, unit):
        """Unit u's bus copy, its update finished (a layer unit's with the ring: filled into the
        ring's next slot, for one fetch)."""
        if self.in_ring(u):
            return self.ring.fill(u, self.store.master(u, unit))
        if unit.bus is None:  # released by a step that then failed: still the weights' copy
            unit.bus, unit.spare = unit.spare, None
        if unit.bus is None:  # (given back to the pinned pool): rebuilt from the weights
            unit.bus = self.make(u, self.weights(u))
        return unit.bus

    def fetched(self, u: int, copies):
        """Debug mode: `copies` (device arrays) are a fetch of unit u's bus copy, to be done before
        u's update writes it. The unit's earlier fetches already done are let go of (in a loop of
        evaluations no update comes to take them: they would stay on the device)."""
        if self.fetches is not None:
            self.fetches[u] = _copying(self.fetches.get(u, ())) + jax.tree.leaves(copies)
        if self.in_ring(u):
            self.ring.fetched(u, copies)

    def read(self, u: int, token=None):
        """Unit u's latest fetch has been read: by work now done (token None), or by the work
        that makes `token`, not waited for. Frees its bus ring slot."""
        if self.in_ring(u):
            if token is None:
                self.ring.retired(u)
            else:
                self.ring.released(u, token)

    def release(self, u: int, unit):
        """After a unit's last use in a step (a host buffer is kept for the update to write in
        place, a pinned one goes back to the accelerator's pinned pool). An update in place keeps
        every bus copy where it is."""
        if not self.in_place and not self.in_ring(u):
            self.policies[u].release(unit)

    def keep_on_host(self, u: int, unit):
        """Unit u's bus copy stays in host memory, where the host reads it (the host lookup,
        engine/lookup.py); on an accelerator it is no longer refreshed to its pinned memory."""
        if self.policies[u].on_host:
            return
        self.staging.pop(self.layout.structure(u), None)
        self.policies[u] = self._on_host
        self.new(u, unit)

    def loaded(self, u: int, unit):
        """Unit u's state was replaced: its bus copy made anew from it."""
        self.new(u, unit)

    # ------------------------------------------------------------------- the update's side
    def check(self, u: int):
        """Debug mode: refuses to write unit u's bus copy while a fetch of it still copies."""
        copying = _copying((self.fetches or {}).pop(u, ()))
        if copying:
            raise RuntimeError(f"{self.layout.name(u)}: its bus copy would be written while "
                               f"{len(copying)} of its fetched arrays are still being copied (the "
                               f"update must start after every fetch of the unit fed its "
                               f"gradient)")

    def writes(self, u: int) -> bool:
        """Whether unit u's update makes a bus copy (not when the copy is the weights, nor in
        the ring, whose fills make it)."""
        return not (self.policies[u].is_params or self.in_ring(u))

    def take(self, u: int, unit):
        """Before a jitted update of unit u: the buffer it donates for its new bus copy (None:
        none), checked first (`check`); the unit has no bus copy until `updated` or `skipped`."""
        self.check(u)
        old = self.policies[u].old_for_update(unit) if not self.in_ring(u) else None
        unit.bus = unit.spare = None
        return old

    def updated(self, u: int, unit, new):
        """The jitted update's output `new` (None where it `writes` none) is u's bus copy."""
        if self.in_ring(u):
            return
        unit.bus = self.policies[u].after_update(unit, new)
        if not self.policies[u].on_host:  # the refresh to the accelerator's pinned memory
            self.counters.host_copy_bytes += transfer.nbytes(unit.bus)

    def skipped(self, u: int, unit, old):
        """A non-finite norm skipped the update: the bus copy still the weights' (`old`, what
        `take` gave)."""
        if not self.in_ring(u):
            unit.bus = self.policies[u].on_skip(unit, old, self.layout.packing(u))

    def kernel_targets(self, u: int, unit, master: list) -> Optional[list]:
        """Before the direct kernel's update of unit u: per leaf the packing.Target it writes the
        new weights' bf16 cast through (an fp32 one is `after_kernel`'s), checked against the
        `master` leaves; None where the update `writes` no bus copy."""
        self.check(u)
        if not self.writes(u):
            return None
        return kernel_targets(unit.bus, self.layout.packing(u), master, self.layout.name(u))

    def after_kernel(self, u: int, unit, targets, master: list, copied: bool):
        """After it: an fp32 bus copy's leaves copied over from the new `master` (by every core);
        the unit's state `copied` (a reader held the old): a bus copy that is the weights is
        made again from the new ones."""
        if targets is not None:
            lib = fused_adamw.kernel()
            for out, p in zip(targets, master):
                if out.dtype == jnp.float32:
                    lib.megatrain_copy(out.pointer, p.ctypes.data, p.nbytes)
        if copied and self.policies[u].is_params:
            self.new(u, unit)


def kernel_targets(bus, packing, master: list, what: str) -> list:
    """The bus copy `bus`'s leaves as packing.Target, each checked against its `master` leaf (the
    same number of elements, in bfloat16 or float32): one ValueError line naming `what`."""
    targets = packing.targets(bus, what)
    for out, p in zip(targets, master, strict=True):
        if out.size != p.size or out.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"{what}: its bus copy is {out.dtype} of {out.size} elements, not "
                             f"{p.size} in bfloat16 or float32")
    return targets


def _copying(arrays) -> list:
    """The arrays still being copied (not deleted, not ready)."""
    return [x for x in arrays if not x.is_deleted() and not x.is_ready()]


# ----------------------------------------------------------------------------- the ring
RESIDENT, RING = "resident", "ring"
FORMS = ("auto", RESIDENT, RING)  # offload.bus


@dataclasses.dataclass
class _Slot:
    """One of the ring's buffers and what reads it: `reader` the fill it holds (None: free),
    `token` arrays to wait on before it is rewritten (made by the ring from what its reader's
    computation output, so nothing else deletes or donates them), `fetches` the fetched copies
    kept in debug mode."""
    bus: Any
    reader: Optional[int] = None
    token: Any = None
    fetches: list = dataclasses.field(default_factory=list)


class Ring:
    """The layer units' bus copies as a ring of `size` buffers (the stage units keep their
    resident ones): each fetch of a layer unit takes the next buffer, filled from the unit's fp32
    master weights just before the fetch (`fill`), forward and backward alike. Nothing else
    writes a slot: the update writes no bus copy for a layer unit.

    A slot is rewritten only once every device copy that read it is done. Its reader (the pass
    position whose fetch it holds) frees it when the pass retires that position (`retired`:
    LayerStream waited on a token of the computation that consumed the fetch, which a copy's
    output feeds, so the copy is done). A position released without a wait (a pass's last)
    leaves a token made from its outputs (`released`): a one-element slice of each, computed on
    the device after them, held by the ring alone (nothing donates or deletes it). With
    `size` = prefetch + 2 the buffer a fill takes was last read by a position retired one or two
    layers earlier (engine/schedule.py's order: the eager fetch of position i + p comes after
    the retire of i - 1; the jit form's copy of i + p is made by dispatch i, after the retire of
    i - 2), so a fill waits on nothing in steady state, and never before a dispatch on work the
    device has not been given. A fill whose slot's reader never retired nor released (a step that
    raised midway) writes into a fresh buffer instead (`fresh`, counted): the old one goes with
    its reader. A fill whose slot's token failed (its reader's computation did) raises
    ReaderFailed: the engine names itself unusable, once, with that cause.

    `write(bus, master)` writes the compute-dtype cast of the master leaves (numpy fp32) into a
    slot's bus copy through its leaves' pointers (`writer`). `debug`: the fetches of each slot
    are kept (Buses.fetched) and a fill refuses to write while one is still copying."""

    def __init__(self, make, size: int, write, debug: bool):
        self.make, self.size, self.write, self.debug = make, size, write, debug
        self.slots = [_Slot(self._new()) for _ in range(size)]
        self.next = 0  # the slot the next fill takes: the least recently filled
        self.serial = 0  # fills made so far (a reader's id)
        self.holds = {}  # unit -> (its latest fill's slot, that fill's serial)
        self.fresh = 0  # fills written into a fresh buffer (a reader that never retired)
        self.on_fill = None  # on_fill(unit, slot), when set: each fill, before it waits
        self._mark = jax.jit(lambda leaves: [jnp.ravel(x)[:1] for x in leaves])

    def _new(self):
        """A slot's buffer, ready: `write` writes through its pointers, which do not wait for the
        computation that makes it (written before it lands, the write would be overwritten)."""
        return jax.block_until_ready(self.make())

    def fill(self, u: int, master: list):
        """Unit u's bus copy in the next slot, from `master` (its fp32 leaves, numpy), once the
        slot's last reader is done."""
        s = self.next
        self.next = (s + 1) % self.size
        slot = self.slots[s]
        if self.on_fill is not None:
            self.on_fill(u, s)
        if slot.reader is not None:
            if slot.token is not None:
                try:
                    jax.block_until_ready(slot.token)
                except Exception as e:
                    raise ReaderFailed(s, e) from None
            elif slot.fetches and not any(x.is_deleted() for x in slot.fetches):
                jax.block_until_ready(slot.fetches)  # a copy's output is ready once it is done
            else:
                slot.bus, slot.fetches = self._new(), []
                self.fresh += 1
        if self.debug:
            copying = _copying(slot.fetches)
            if copying:
                raise RuntimeError(f"bus ring slot {s} would be rewritten for layer {u - 1} while "
                                   f"{len(copying)} of the arrays fetched from it are still being "
                                   f"copied")
        self.serial += 1
        slot.reader, slot.token, slot.fetches = self.serial, None, []
        self.holds[u] = (s, self.serial)
        self.write(slot.bus, master)
        return slot.bus

    def _held(self, u: int) -> Optional[_Slot]:
        s, serial = self.holds.get(u, (None, None))
        return self.slots[s] if s is not None and self.slots[s].reader == serial else None

    def fetched(self, u: int, copies):
        """Debug mode: `copies` were fetched from unit u's slot."""
        slot = self._held(u)
        if self.debug and slot is not None:
            slot.fetches.extend(jax.tree.leaves(copies))

    def retired(self, u: int):
        """Unit u's latest fill was read by a computation now done: its slot is free."""
        slot = self._held(u)
        if slot is not None:
            slot.reader, slot.token = None, None

    def released(self, u: int, outputs):
        """Unit u's latest fill was read by the computation that makes `outputs`, not waited
        for: the slot waits, before it is rewritten, on a token made from them."""
        slot = self._held(u)
        leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
        if slot is not None and leaves:
            slot.token = self._mark(leaves)

    @property
    def nbytes(self) -> int:
        return self.size * transfer.nbytes(self.slots[0].bus)


def writer(packing):
    """The bus ring's write for layer units packed as `packing` (engine/packing.py): the master
    leaves cast into a slot where the packing lays them (cast_into)."""
    return lambda bus, master: cast_into(packing.targets(bus, "a bus ring slot"), master)


def cast_into(targets: list, master: list):
    """Each master leaf (fp32) cast into its bus leaf (packing.Target), through its pointer;
    rounded as the update rounds a bus copy (the kernel's own cast where it is built, else
    numpy's round-to-nearest-even)."""
    lib = fused_adamw.kernel()
    for out, p in zip(targets, master, strict=True):
        p = np.ascontiguousarray(np.asarray(p), np.float32)
        if out.size != p.size:
            raise ValueError(f"a bus leaf of {out.size} elements for a leaf of {p.size}")
        if lib is not None and out.dtype == jnp.bfloat16:
            lib.megatrain_to_bf16(out.pointer, p.ctypes.data, p.size)
        elif lib is not None and out.dtype == jnp.float32:
            lib.megatrain_copy(out.pointer, p.ctypes.data, p.nbytes)
        else:
            nbytes = out.size * out.dtype.itemsize
            dst = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(out.pointer))
            np.copyto(dst.view(out.dtype).reshape(p.shape), p, casting="unsafe")


class ReaderFailed(RuntimeError):
    """The computation that read a ring slot failed (`cause`, one line): the device's work is in
    an unknown state, the engine refuses to go on (StreamedEngine: unusable, once named)."""

    def __init__(self, slot: int, e: Exception):
        line = (str(e).strip().splitlines() or [""])[0]
        self.cause = f"a computation that read bus ring slot {slot} failed ({type(e).__name__}: " \
                     f"{line})"
        super().__init__(f"the engine is unusable: {self.cause}")


def ring_size(prefetch: int) -> int:
    """Slots of the ring: the prefetch + 1 fetched layers of a pass, and one whose reader has
    just retired (Ring's docstring)."""
    return prefetch + 2


POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
POOL_DEFAULT_GIB = 64  # XLA:GPU's pinned host pool where POOL_VARIABLE is not set


def pinned_pool_bytes() -> int:
    """XLA:GPU's pinned host pool, as POOL_VARIABLE sets it (GiB), else its default."""
    value = os.environ.get(POOL_VARIABLE, "")
    try:
        gib = float(value) if value else POOL_DEFAULT_GIB
    except ValueError:
        gib = math.nan
    if not 0 < gib < math.inf:
        raise ValueError(f"{POOL_VARIABLE}={value!r} is not a number of GiB > 0 (XLA's pinned "
                         f"host pool); set it to one, e.g. {POOL_DEFAULT_GIB}, or unset it")
    return int(gib * 2**30)


def pool_line(what: str, need: int, pool: int) -> str:
    """What the pinned pool lacks, and the setting that gives it (with room for the rest)."""
    size = f"{need / 1e9:.2f} GB" if need >= 1e9 else f"{need / 1e6:.2f} MB"
    return (f"{what} {size} of XLA's pinned host pool, which is "
            f"{pool / 2**30:.4g} GiB: run with {POOL_VARIABLE}={-(-need // 2**30) + 8}")


def why_not_ring(params_bus: bool, disk_tier, data_parallel: bool) -> Optional[str]:
    """Why the layer units' bus copies cannot be a ring (None: they can)."""
    if params_bus:
        return "the bus copy is the fp32 master itself (float32 compute, no accelerator)"
    if disk_tier:
        return "the disk tier (its master weights leave RAM between updates)"
    if data_parallel:
        return "data parallel over several devices (not built yet)"
    return None


def choose_form(setting: str, *, resident_pinned: int, ring_pinned: int, pool: Optional[int],
                host_short: str = "") -> tuple:
    """(RESIDENT or RING, why) for offload.bus `setting` (FORMS). resident_pinned, ring_pinned:
    the bytes each form keeps in the pinned pool (bus copies, offloaded activations); pool: the
    pool's size (pinned_pool_bytes; None: no pool, not a GPU); host_short: why host RAM cannot
    hold resident bus copies ("" where it can, or where it is not known: the plan knows).
    auto: the ring where resident bus copies do not fit host RAM or the pool and the ring does;
    else resident. An asked-for ring that the pool cannot hold: one ValueError line."""
    if setting not in FORMS:
        raise ValueError(f"bus must be one of {', '.join(FORMS)}, got {setting!r}")
    ring_fits = pool is None or ring_pinned <= pool
    if setting == RING and not ring_fits:
        raise ValueError("bus='ring': " + pool_line("the bus ring and the stages' bus copies "
                                                     "need", ring_pinned, pool))
    if setting != "auto":
        return setting, "asked for"
    if not host_short and pool is not None and resident_pinned > pool:
        host_short = (f"resident bus copies would take {resident_pinned / 1e9:.2f} GB of the "
                      f"{pool / 2**30:.4g} GiB pinned pool ({POOL_VARIABLE})")
    if host_short and ring_fits:
        return RING, f"auto: {host_short}"
    if host_short:
        return RESIDENT, f"auto: {host_short}, and the ring does not fit either"
    return RESIDENT, "auto: host memory holds every unit's bus copy"
