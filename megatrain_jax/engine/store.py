"""Every unit's state and its layout: the owner of what the host update reads and writes.

A `Unit` is one unit's record: its fp32 master weights and optax state (jax arrays on the host
device, or `arrays`, UnitArrays: numpy buffers the engine owns, which the direct update writes in
place), its bus copy (bus.py's alone to write), its pending update (host.py's). `Layout` is the
units' layout: the leaf shapes, each structure's (params, opt_state) layout, how its bus copy and
gradient travel (engine/packing.py: a layer unit's one flat array, the stages' leaf by leaf), the
sharded layout's first rows.

Where params and optax state live between updates, one store chosen at construction (`choose`):
`RamStore` (in host RAM, on the units themselves), `DirectStore` (in RAM as UnitArrays, for the
direct update) or `DiskStore` (each unit's in a file of the disk tier, tier.py: read ahead of its
update, written back behind it; the unit's params and opt_state None between updates, only its
bus copy in RAM). Each store: `new(params)` a unit made from its weights; `add(units)` at
construction, as each unit is made; `expect(u)` when u's update is queued; `load(u, unit)` and
`store(u, unit)` around the update, on the host thread; `put(u, unit, params, opt_state)` a loaded
state; `view(u, unit)` (params, opt_state) for the engine to read, `master(u, unit)` its fp32
weights as numpy leaves, `lend(u, unit)` the state for a reader outside the engine (the direct
store tracks those: below); `flush()`, `close()`. `donate`: the jitted update's arguments it may
donate (params 0, optax state 1, the old bus copy 3).

**Readers of the state.** `lend` hands out the state (`params()`, `state()`, a checkpoint's
save) as jax arrays over read-only views of the unit's buffers (no copy), each view made from a
lease of its own (`_Lease`): every array that can reach those bytes, the jax arrays, numpy
arrays taken of them, slices of those, holds it, so it lives exactly as long as a reader can read
them. While a lease of a unit lives, its update copies the unit into fresh buffers first
(copy-on-write, counted in `host_snapshot_bytes`) and leaves the old ones to the reader; once its
leases are gone (the reader dropped the last of them, a save wrote and let go of its last leaf),
updates are in place again. The engine's own views (`trees`) and any other reference to its
buffers are no reader: they never make a copy.

"""

import concurrent.futures
import ctypes
import dataclasses
import mmap
import threading
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import packing as packing_lib
from megatrain_jax.engine import stage_units
from megatrain_jax.engine import tier as tier_lib


@dataclasses.dataclass
class Unit:
    """The host-resident state of one streamed unit."""
    params: Any  # fp32 master weights (pure dict) on the host device
    opt_state: Any  # optax state on the host device
    bus: Any = None  # compute-dtype copy, ready to cross to the device; None between its last
    # use in a step and the update that recreates it (bus.py's to write)
    spare: Any = None  # the released bus copy when it is a host buffer: kept for the update to
    # write the new one into (freed and allocated again, it would be page-faulted in each step)
    pending: Optional[concurrent.futures.Future] = None  # the host update still running
    arrays: Optional["UnitArrays"] = None  # the direct update's state (params and opt_state
    # None then): numpy buffers the engine owns, updated in place


class Layout:
    """The units' layout. Unit 0 is the first stage, 1 + i layer i, `last` the last stage's own
    variables; they have three structures (`structure`: 0 the first stage, 1 the blocks, 2 the
    last stage). `shapes`: the logical leaf shapes of the whole stages (0) and of a block (1);
    `stage_units`: the stage units' (params, opt_state) layouts (jax.ShapeDtypeStruct trees),
    `block_layout` a block unit's, made with the first block (`add_block`)."""

    def __init__(self, num_blocks: int, optimizer, stages, shards, bus_is_params: bool,
                 host_sharding, update_in_jit: bool = False):
        """stages: the whole stages' params, put on `host_sharding` (the host device's) in fp32,
        then as `split` their two units' params (this process's rows where `shards`,
        shard.Shards, cut them)."""
        self.last, self.optimizer, self.shards = 1 + num_blocks, optimizer, shards
        self.bus_is_params, self.host_sharding = bus_is_params, host_sharding
        self.update_in_jit = update_in_jit  # packing.why_per_leaf
        stages = self._to_host(stages)
        self.shapes = {0: [tuple(p.shape) for p in jax.tree.leaves(stages)]}
        self.split = stage_units.split(shards.cut(stages) if shards is not None else stages)
        first, last = self.split
        self.stage_units = {0: self._of(first), self.last: self._of(last)}
        self.block_layout = None
        self._packings = {0: self._packing(first, True), 2: self._packing(last, True)}
        self._firsts = {0: self._first_rows(first), 2: self._first_rows(last)}

    def _of(self, params) -> tuple:
        return jax.eval_shape(lambda p: p, params), jax.eval_shape(self.optimizer.init, params)

    def _packing(self, params, stage: bool):
        return packing_lib.choose(params, stage=stage, sharded=self.shards is not None,
                                  bus_is_params=self.bus_is_params,
                                  update_in_jit=self.update_in_jit)

    def _first_rows(self, params) -> list:
        shapes = [x.shape for x in jax.tree.leaves(params)]
        return self.shards.firsts(shapes) if self.shards is not None else [0] * len(shapes)

    def _to_host(self, params):
        return jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params),
                              self.host_sharding)

    def add_block(self, whole):
        """A block's params as its unit holds them (fp32 on the host device, the sharded
        layout's rows); the first sets the blocks' layout."""
        whole = self._to_host(whole)
        params = self.shards.cut(whole) if self.shards is not None else whole
        if self.block_layout is None:
            self.shapes[1] = [tuple(p.shape) for p in jax.tree.leaves(whole)]
            self.block_layout = self._of(params)
            self._packings[1] = self._packing(params, False)
            self._firsts[1] = self._first_rows(params)
        return params

    def structure(self, u: int) -> int:
        return 0 if u == 0 else 2 if u == self.last else 1

    def packing(self, u: int):
        """How unit u's bus copy and gradient travel (packing.py: Flat or PerLeaf)."""
        return self._packings[self.structure(u)]

    def firsts(self, u: int) -> list:
        """Per leaf of unit u, the index in the whole leaf of the first element this process
        holds (the sharded layout's rows; else 0): with u, what keys bf16 moments' rounding."""
        return self._firsts[self.structure(u)]

    def of(self, which) -> tuple:
        """(params, opt_state) of unit `which` (an index, or "stages": the whole stages, as a
        checkpoint holds them) as jax.ShapeDtypeStruct trees: what a loaded state must match."""
        if which == "stages":
            return tuple(stage_units.merge(a, b) for a, b in zip(self.stage_units[0],
                                                                 self.stage_units[self.last]))
        return self.stage_units.get(which, self.block_layout)

    def stage_parts(self, unit_state: dict) -> list:
        """[(u, {"params", "opt_state"})] of each stage unit's part of `unit_state` (the whole
        stages', as a checkpoint holds them), checked first (check_load), its dtypes the units'
        (`cast`)."""
        whole = cast(self.check_load("stages", unit_state), self.of("stages"))
        taken, parts = set(), []  # scalar optax state (a count) goes to both: each its own
        for u, (params, opt_state) in self.stage_units.items():
            part = {"params": stage_units.like(whole[0], params),
                    "opt_state": stage_units.like(whole[1], opt_state)}
            part = jax.tree.map(lambda x: x.copy() if id(x) in taken else x, part)
            taken |= {id(x) for x in jax.tree.leaves(part)}
            parts.append((u, part))
        return parts

    def stage_leaves(self, u: int) -> tuple:
        """The whole stages' leaf indices that stage unit u (0 or `last`) holds."""
        return stage_units.indices(self.stage_units[u][0])

    def name(self, u: int) -> str:
        return "the stages' unit" if u in (0, self.last) else f"layer {u - 1}"

    def check_load(self, which, unit_state: dict) -> tuple:
        """(params, opt_state) of `unit_state` if unit `which` (as `of`) can take it, else one
        ValueError line naming the unit and the leaf (`check`)."""
        what = "the stages" if which in ("stages", 0, self.last) else f"layer {which - 1}"
        return check(unit_state, self.of(which), what)


class RamStore:
    tier = None
    # Donating params, optax state and the old bus copy makes the update write in place: on the
    # CPU backend a fresh output buffer is page-faulted in at a fraction of memory speed.
    donate = (0, 1, 3)

    def __init__(self, init):
        self.init = init  # the optax state of a unit's params (on the host device)

    def new(self, params) -> Unit:
        """A unit made from its fp32 master weights (host arrays)."""
        return Unit(params, self.init(params))

    def master(self, u: int, unit) -> list:
        """Unit u's fp32 master weights, as numpy leaves."""
        return [np.asarray(x) for x in jax.tree.leaves(self.view(u, unit)[0])]

    def add(self, units):
        pass

    def expect(self, u: int):
        pass

    def load(self, u: int, unit):
        pass

    def store(self, u: int, unit):
        pass

    def put(self, u: int, unit, params, opt_state):
        unit.params, unit.opt_state = params, opt_state

    def view(self, u: int, unit) -> tuple:
        return unit.params, unit.opt_state

    def lend(self, u: int, unit) -> tuple:
        return self.view(u, unit)

    def flush(self):
        pass

    def close(self):
        pass


class DiskStore(RamStore):
    # Params and optax state alias the tier's read buffer (tier.load), which XLA does not own:
    # the update's outputs get buffers of their own, copied out by tier.store.
    donate = (3,)

    def __init__(self, init, options: tier_lib.DiskTierOptions, num_units: int, last_shapes,
                 host_sharding):
        """last_shapes: the last unit's (params, opt_state) shapes, for its file's layout (the
        files are made before that unit is); host_sharding: the host device's."""
        super().__init__(init)
        self.options, self.num_units, self.host_sharding = options, num_units, host_sharding
        self.last_layout = tier_lib.UnitLayout.of(*last_shapes)
        self.tier = None  # made once the first block is known (all blocks share its layout)

    def add(self, units):
        """Construction: each unit's state to its file, only its bus copy kept in RAM."""
        if len(units) < 2:
            return
        layout = lambda unit: tier_lib.UnitLayout.of(unit.params, unit.opt_state)
        if self.tier is None:
            first, block = units
            self.tier = tier_lib.DiskTier(self.options, [layout(first)] + [layout(block)] * (
                self.num_units - 2) + [self.last_layout])
        u = len(units) - 1
        if layout(units[u]) != self.tier.layouts[u]:
            raise ValueError(f"disk tier: block {u - 1}'s layout differs from block 0's")
        for v in ([0, 1] if u == 1 else [u]):
            unit = units[v]
            self.tier.write_now(v, unit.params, unit.opt_state)
            unit.params = unit.opt_state = None

    def expect(self, u: int):
        self.tier.expect(u)  # its read may start ahead

    def load(self, u: int, unit):
        """The state from its file (read ahead)."""
        unit.params, unit.opt_state = self.tier.load(u, self.host_sharding)

    def store(self, u: int, unit):
        """Written back behind, out of RAM."""
        self.tier.store(u, unit.params, unit.opt_state)
        unit.params = unit.opt_state = None

    def put(self, u: int, unit, params, opt_state):
        """Into its file, only the bus copy in RAM."""
        self.tier.write_now(u, params, opt_state)

    def view(self, u: int, unit) -> tuple:
        """Read-only numpy arrays mapped from its file (its own arrays while it is in RAM: made,
        not yet written)."""
        if unit.params is not None:
            return unit.params, unit.opt_state
        return self.tier.view(u)

    def flush(self):
        self.tier.flush()

    def close(self):
        if self.tier is not None:
            self.tier.close()


class DirectStore(RamStore):
    """In host RAM, as numpy buffers the engine owns (`unit.arrays`, UnitArrays), updated
    in place by the kernel called directly (direct.py); read as jax arrays over read-only views
    of them."""

    def __init__(self, init, kernel):
        super().__init__(init)
        self.kernel = kernel  # direct.DirectAdamW: its kernel library and its `wrap`

    def new(self, params) -> Unit:
        return Unit(None, None, arrays=UnitArrays.of(params, self.init(params), self.kernel.lib))

    def master(self, u: int, unit) -> list:
        return unit.arrays.p

    def put(self, u: int, unit, params, opt_state):
        """Copied into new buffers (the caller's arrays are left as they are)."""
        unit.arrays = UnitArrays.of(params, opt_state, self.kernel.lib)

    def view(self, u: int, unit) -> tuple:
        return unit.arrays.trees(self.kernel.wrap)

    def lend(self, u: int, unit) -> tuple:
        """Leased views: the unit's update copies it while they may be read."""
        return unit.arrays.lend(self.kernel.wrap)


def choose(disk_tier, layout: Layout, host, kernel=None):
    """The store for `disk_tier` (DiskTierOptions, or None: RAM; `kernel`, a direct.DirectAdamW:
    the direct update's numpy buffers)."""
    # out_shardings: optax state that does not depend on the params (counts, zeros) would
    # otherwise land uncommitted on the default device, the accelerator.
    init = jax.jit(layout.optimizer.init, out_shardings=host)
    if kernel is not None:
        return DirectStore(init, kernel)
    if disk_tier is None:
        return RamStore(init)
    return DiskStore(init, disk_tier, layout.last + 1, layout.stage_units[layout.last], host)


# ----------------------------------------------------------------------------- the direct update's state
ALIGN = 2 * 2**20  # a huge page: the kernel's threads stream whole pages, TLB misses are rare
LEAF_ALIGN = 64  # each leaf on a cache line (the kernel's cuts fall on lines of every array)


def _madvise_huge(raw: np.ndarray):
    """MADV_HUGEPAGE on raw's pages where the kernel allows (a no-op elsewhere)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    start = raw.ctypes.data
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(raw.nbytes), advice)


def _owner(nbytes: int) -> tuple:
    """(raw, offset): an untouched allocation of nbytes at a 2 MiB-aligned offset of raw."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % ALIGN
    _madvise_huge(raw[offset:offset + nbytes])
    return raw, offset


@dataclasses.dataclass
class UnitArrays:
    """One unit's params (f32) and Adam moments (f32, or bf16 with optimizer.state_dtype bfloat16:
    2 B each), leaves in tree order, in one allocation (`owner`) the engine owns; the optax
    state's counts as Python ints; its structure to rebuild the trees."""
    owner: np.ndarray
    p: list
    m: list
    v: list
    count: int
    lr_count: Optional[int]
    params_def: Any
    opt_def: Any  # (adam state, decay state, schedule state) with None leaves
    # the leases of the views handed out (`lend`): weak references, dead once nothing reads them
    leases: list = dataclasses.field(default_factory=list)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False)

    @staticmethod
    def of(params, opt_state, lib) -> "UnitArrays":
        """Copies params and optax.adamw state (host arrays or numpy) into a new allocation, each
        leaf copied by the kernel's threads (its pages first touched by the cores that will update
        them)."""
        adam, decay_state, lr_state = opt_state
        p_leaves, params_def = jax.tree.flatten(params)
        sources = [p_leaves, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)]
        lr_count = lr_state.count if "count" in getattr(lr_state, "_fields", ()) else None
        opt_def = (adam._replace(count=None, mu=None, nu=None), decay_state,
                   lr_state._replace(count=None) if lr_count is not None else lr_state)
        moments = np.dtype(jax.tree.leaves(adam.mu)[0].dtype) if sources[1] else np.float32
        arrays = UnitArrays._allocate([np.shape(x) for x in p_leaves], params_def, opt_def,
                                      int(np.asarray(adam.count)),
                                      None if lr_count is None else int(np.asarray(lr_count)),
                                      moments)
        for kind, leaves in zip((arrays.p, arrays.m, arrays.v), sources):
            for dst, src in zip(kind, leaves, strict=True):
                # (not np.ascontiguousarray: it makes a 0-d leaf 1-d)
                src = np.asarray(src, dst.dtype, order="C")
                if src.shape != dst.shape:
                    raise ValueError(f"a leaf shaped {src.shape} where the unit has {dst.shape}")
                lib.megatrain_copy(dst.ctypes.data, src.ctypes.data, dst.nbytes)
        return arrays

    @staticmethod
    def _allocate(shapes, params_def, opt_def, count, lr_count, moments) -> "UnitArrays":
        dtypes = [np.dtype(np.float32)] * len(shapes) + [np.dtype(moments)] * (2 * len(shapes))
        sizes = [int(np.prod(s, dtype=np.int64)) * d.itemsize
                 for s, d in zip(shapes * 3, dtypes)]
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += -(-n // LEAF_ALIGN) * LEAF_ALIGN
        raw, base = _owner(max(at, LEAF_ALIGN))
        views = [raw[base + o:base + o + n].view(d).reshape(s)
                 for o, n, d, s in zip(offsets, sizes, dtypes, shapes * 3)]
        k = len(shapes)
        return UnitArrays(raw, views[:k], views[k:2 * k], views[2 * k:], count, lr_count,
                          params_def, opt_def)

    def copy(self, lib) -> "UnitArrays":
        """The same state in a new allocation (copy-on-write: the old one stays with a reader)."""
        new = UnitArrays._allocate([x.shape for x in self.p], self.params_def, self.opt_def,
                                   self.count, self.lr_count, self.moments)
        for dst, src in zip(new.p + new.m + new.v, self.p + self.m + self.v):
            lib.megatrain_copy(dst.ctypes.data, src.ctypes.data, dst.nbytes)
        return new

    def lent(self) -> bool:
        """Whether a view handed out by `lend` may still be read."""
        with self._lock:  # (lend runs on the caller's thread, lent on the host thread)
            self.leases = [lease for lease in self.leases if lease() is not None]
            return bool(self.leases)

    @property
    def moments(self) -> np.dtype:
        """The moments' dtype (float32, or bfloat16)."""
        return self.m[0].dtype if self.m else np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.p + self.m + self.v)

    def trees(self, wrap) -> tuple:
        """(params, opt_state) as optax.adamw's trees, each leaf `wrap(read-only view)`: the
        engine's own (its bus copy when that is the weights), never a reader's."""
        return self._trees(wrap, lambda x: x.view())

    def lend(self, wrap) -> tuple:
        """`trees` for a reader: each view leased (the module's docstring), so that the update
        copies the unit while the reader can still read it."""
        self.lent()  # (drops the dead leases: a loop of reads with no update keeps none)

        def leased(x):
            lease = _Lease(x)
            with self._lock:
                self.leases.append(weakref.ref(lease))
            return np.asarray(lease).view(x.dtype).reshape(x.shape)
        return self._trees(wrap, leased)

    def _trees(self, wrap, view) -> tuple:
        def ro(x):
            x = view(x)
            x.flags.writeable = False
            return wrap(x)
        params = jax.tree.unflatten(self.params_def, [ro(x) for x in self.p])
        mu = jax.tree.unflatten(self.params_def, [ro(x) for x in self.m])
        nu = jax.tree.unflatten(self.params_def, [ro(x) for x in self.v])
        adam, decay_state, lr_state = self.opt_def
        count = wrap(np.asarray(self.count, np.int32))
        adam = adam._replace(count=count, mu=mu, nu=nu)
        if self.lr_count is not None:
            lr_state = lr_state._replace(count=wrap(np.asarray(self.lr_count, np.int32)))
        return params, (adam, decay_state, lr_state)


class _Lease:
    """The bytes of one leaf as a buffer of their own (numpy's array interface): a numpy array
    made from it has it as its base, and so do its views and whatever aliases them (a jax array
    over it, numpy arrays of that), where a view of the unit's own array would have the unit's
    allocation as its base. Its lifetime is therefore its readers'. Keeps the allocation alive."""
    __slots__ = ("__array_interface__", "owner", "__weakref__")

    def __init__(self, x: np.ndarray):
        self.owner = x
        self.__array_interface__ = {"shape": (x.nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (x.ctypes.data, True)}  # read-only


# ----------------------------------------------------------------------------- a loaded state
def path_str(path) -> str:
    """A tree path as a/b/0/mu/wq: Orbax's metadata spells namedtuple fields as dict keys; both
    are named alike (the checkpoints' names, checkpoint.py)."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _path(path) -> str:
    """A leaf's path as params/w or opt_state/0/mu/w (as a checkpoint names it)."""
    return "/".join([("params", "opt_state")[path[0].idx], path_str(path[1:])])


def _leaves(tree) -> dict:
    return {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _same_kind(a, b) -> bool:
    """Both floating (of any width: a cast), both integers, or equal."""
    kinds = (jnp.floating, jnp.integer)
    return a == b or any(jnp.issubdtype(a, k) and jnp.issubdtype(b, k) for k in kinds)


def check(unit_state, layout: tuple, what: str) -> tuple:
    """(params, opt_state) of `unit_state` ({"params", "opt_state"}) once checked against the
    unit's `layout` ((params, opt_state) as jax.ShapeDtypeStruct trees): the same structure, every
    leaf's shape, a dtype of the same kind (floating, integer). Else one ValueError line naming
    `what` (the unit) and the leaf, before anything is replaced."""
    if not isinstance(unit_state, dict) or set(unit_state) != {"params", "opt_state"}:
        keys = sorted(unit_state) if isinstance(unit_state, dict) else type(unit_state).__name__
        raise ValueError(f"cannot load {what}: give {{'params': ..., 'opt_state': ...}}, got "
                         f"{keys}")
    given = (unit_state["params"], unit_state["opt_state"])
    have, want = _leaves(given), _leaves(layout)
    for path in want:
        if path not in have:
            raise ValueError(f"cannot load {what}: it has no {path}")
    for path in have:
        if path not in want:
            raise ValueError(f"cannot load {what}: {path} is not in the unit")
    if jax.tree.structure(given) != jax.tree.structure(layout):
        raise ValueError(f"cannot load {what}: its containers differ from the unit's "
                         f"({jax.tree.structure(layout)})")
    for path, x in have.items():
        shape, dtype = tuple(np.shape(x)), _dtype(x)
        if shape != want[path].shape or not _same_kind(dtype, np.dtype(want[path].dtype)):
            raise ValueError(f"cannot load {what}: {path} has shape {shape} {dtype}, the unit's "
                             f"has shape {want[path].shape} {np.dtype(want[path].dtype)}")
    return given


def cast(state: tuple, layout: tuple) -> tuple:
    """`state` (checked) with each leaf in the layout's dtype: the Adam moments of another
    optimizer.state_dtype take the engine's (rounded to the nearest). Leaves already in it are
    the caller's own arrays, not copies."""
    def one(x, like):
        if _dtype(x) == like.dtype:
            return x
        return x.astype(like.dtype) if hasattr(x, "astype") else np.asarray(x, like.dtype)
    return jax.tree.map(one, state, layout)
