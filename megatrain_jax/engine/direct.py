"""The host update called directly: the fused AdamW kernel (fused_adamw.cc) through ctypes, which
releases the GIL, on numpy state the engine owns. Each gradient is read where the device wrote it
(a zero-copy view of its pinned piece), each bus copy written where the device reads it (a
persistent buffer per unit: a layer's one flat array, each leaf at its offset, engine/packing.py):
no copy between jax's clients, no memcpy, no jit on the update's path (measured against the kernel
in a jit: docs/benchmarks.md, "Host update").

    arrays = UnitArrays.of(params, opt_state)      # copied in once, by the kernel's threads
    update = DirectAdamW(hyper, max_grad_norm, host_device, counters)
    update.apply(arrays, pieces, grad_norm, scale, bus_leaves)

**When the bus copy may be written.** A fetch (`device_put` of the bus copy, or a copy inside a
jitted call) returns before its copy is done and reads the buffer while it runs: an overwrite
then reaches the device (on a GPU most such copies saw it: docs/benchmarks.md, "Transfers").
The engine writes unit u's bus copy only in u's update, which starts once u's gradient is ready.
Every fetch of u's bus copy in a step fed that gradient (the forward's through the loss, the
backward's through u's backward); a fetch of another call (evaluation, generation) is followed,
on the device's one stream, by the compute of the next step's gradient. So no copy that reads it
is in flight. In debug mode (`MEGATRAIN_DEBUG_BUS=1`, both update paths: the jit path's writes
into the donated old copy) the engine keeps each fetch still copying until the unit's update and
refuses to write while one still is (HostState.fetched); the bus ring's fills check theirs.

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

import ctypes
import dataclasses
import mmap
import threading
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import fused_adamw
from megatrain_jax.engine.packing import PerLeaf

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


class DirectAdamW:
    """AdamW (fused_adamw.Hyper) on UnitArrays, one kernel call per unit. Same bits as the FFI
    kernel in a jit (tests/test_direct.py): the same loop, the same scalars (fused_adamw.
    step_scalars, jitted alone on the host device). The host update's strategy where it runs
    (update.choose)."""
    kind = "direct"

    def __init__(self, hyper, max_grad_norm, host_device, counters, lib):
        self.hyper, self.max_grad_norm, self.counters, self.lib = (hyper, max_grad_norm,
                                                                   counters, lib)
        self.host = jax.sharding.SingleDeviceSharding(host_device)
        self.on_kernel = None  # on_kernel(u, ranges), when set: each call's ranges (for tests)
        self._decays = {}  # per params structure: the leaves' weight-decay flags

        def scalars(count, lr_count, norm, scale, unit):
            s, count, lr_count = fused_adamw.step_scalars(hyper, count, lr_count, norm, scale,
                                                          max_grad_norm, unit)
            return jnp.stack([s[k] for k in fused_adamw.SCALARS]), count, lr_count

        self._scalars = jax.jit(scalars, out_shardings=self.host)

    def wrap(self, x):
        """A host-device jax array over numpy x (zero-copy where the CPU client aliases it)."""
        return jax.device_put(x, self.host)

    def decays(self, arrays: UnitArrays) -> list:
        key = arrays.params_def
        if key not in self._decays:
            shapes = jax.tree.unflatten(key, [jax.ShapeDtypeStruct(x.shape, jnp.float32)
                                              for x in arrays.p])
            self._decays[key] = fused_adamw.decay_flags(self.hyper, shapes)
        return self._decays[key]

    def apply(self, u: int, arrays: UnitArrays, pieces: list, grad_norm, scale, bus, what: str,
              firsts=None, packing=None) -> UnitArrays:
        """One AdamW step of unit u in place (or, when a reader holds its state, in a copy, which
        is returned). pieces: per array of the gradient, its pieces in row order (jax arrays in
        pinned or host memory, or numpy); bus: the bf16 (or f32) bus copy to write, or None (the
        weights are the bus copy); both packed as `packing` (engine/packing.py; None: leaf by
        leaf) says: flat, one array read and written at each leaf's offset. grad_norm, scale:
        scalars (jax or numpy). firsts: per leaf, the index in the whole leaf of its first element
        here (the sharded host layout's rows; None: all 0), which with u keys bf16 moments'
        rounding (fused_adamw.cc)."""
        packing = packing or PerLeaf(None, ())
        if arrays.lent():
            arrays = arrays.copy(self.lib)
            self.counters.host_snapshot_bytes += arrays.nbytes
        vec, count, lr_count = self._scalars(
            np.int32(arrays.count), np.int32(arrays.lr_count or 0),
            np.float32(grad_norm), np.float32(scale), np.int32(u))
        vec = np.ascontiguousarray(np.asarray(vec), np.float32)
        keep, ranges = [vec], []  # keep: what the pointer table points into, until the call returns
        decays = self.decays(arrays)
        firsts = [0] * len(arrays.p) if firsts is None else firsts
        read = [[self._gradient(piece, what) for piece in leaf] for leaf in pieces]
        keep.append(read)
        pieces = packing.leaf_pieces(read, what)
        bus = None if bus is None else packing.targets(bus, what)
        if len(pieces) != len(arrays.p):
            raise ValueError(f"{what}: a gradient of {len(pieces)} leaves for a unit of "
                             f"{len(arrays.p)}")
        for i, (leaf_pieces, p, m, v) in enumerate(zip(pieces, arrays.p, arrays.m, arrays.v,
                                                       strict=True)):
            out = bus[i] if bus is not None else None
            bus_ptr = self._bus_pointer(out, p, what) if out is not None else None
            offset = 0
            for g in leaf_pieces:
                n = g.size
                if offset + n > p.size:
                    raise ValueError(f"{what}: a gradient of {offset + n} elements for a leaf of "
                                     f"{p.size}")
                bf16 = g.dtype == jnp.bfloat16
                if not bf16 and g.dtype != np.float32:
                    raise ValueError(f"{what}: a gradient of dtype {g.dtype}, not float32 or "
                                     f"bfloat16")
                bus_at = None
                if bus_ptr is not None and out.dtype == jnp.bfloat16:
                    bus_at = bus_ptr + 2 * offset
                k = m.itemsize  # 4, or 2 for bf16 moments
                ranges.append(fused_adamw.Range(
                    p.ctypes.data + 4 * offset, m.ctypes.data + k * offset,
                    v.ctypes.data + k * offset, g.ctypes.data, bus_at, n, int(bf16),
                    int(decays[i]), int(k == 2), i, firsts[i] + offset))
                offset += n
            if offset != p.size:
                raise ValueError(f"{what}: a gradient of {offset} elements for a leaf of {p.size}")
        table = (fused_adamw.Range * len(ranges))(*ranges)
        if self.on_kernel is not None:
            self.on_kernel(u, ranges)
        if self.lib.megatrain_adamw(vec.ctypes.data, table, len(ranges)) != 0:
            raise RuntimeError(f"{what}: the fused AdamW kernel refused its arguments")
        if bus is not None:  # an fp32 bus copy: the new weights copied over, by every core
            for out, p in zip(bus, arrays.p):
                if out.dtype == jnp.float32:
                    self.lib.megatrain_copy(self._bus_pointer(out, p, what), p.ctypes.data,
                                            p.nbytes)
        arrays.count = int(np.asarray(count))
        if arrays.lr_count is not None:
            arrays.lr_count = int(np.asarray(lr_count))
        del keep
        return arrays

    def _gradient(self, piece, what: str) -> np.ndarray:
        """A gradient piece as numpy over its own buffer (np.asarray waits for its copy out); a
        piece that cannot be read in place is copied, and counted (`host_copy_bytes`)."""
        if isinstance(piece, jax.Array):
            if piece.is_deleted():
                raise ValueError(f"{what}: its gradient was deleted before the update read it")
            g = np.asarray(piece)
            if g.ctypes.data != piece.unsafe_buffer_pointer():
                self.counters.host_copy_bytes += g.nbytes
        else:
            g = np.asarray(piece)
        if not g.flags.c_contiguous:
            g = np.ascontiguousarray(g)
            self.counters.host_copy_bytes += g.nbytes
        return g.reshape(-1)

    @staticmethod
    def _bus_pointer(out, p, what: str) -> int:
        """The address of a bus leaf (packing.Target) to write leaf p's new weights to."""
        if out.size != p.size or out.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"{what}: its bus copy is {out.dtype} of {out.size} elements, not "
                             f"{p.size} in bfloat16 or float32")
        return out.pointer
