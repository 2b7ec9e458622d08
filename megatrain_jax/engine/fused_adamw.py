"""AdamW as the host update runs it: one pass over each leaf, in place.

`adamw(...)` is `optax.adamw(...)` (same init, update and state), marked so that the engine's
host update (engine/host.py) runs it here instead: the gradient's scale and global-norm clip, both
moments, the weight and its bf16 bus copy in one loop that reads and writes each once (30 B/param
with a bf16 bus copy; 22 with the moments in bf16, `state_dtype`), where XLA runs optax as several
loops over the same arrays.

The loop is a small C++ kernel (fused_adamw.cc) called through `jax.ffi`, once per unit for all
of its leaves (spread over the cores there), built with the system's C++ compiler on first use and
cached per CPU feature set; without a compiler (or when the build fails) the same
arithmetic runs in JAX, operation for operation and bit for bit, and the log says so once. Any
other optimizer runs through optax as before.
"""

import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import os
import pathlib
import shutil
import subprocess
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

log = logging.getLogger(__name__)
SOURCE = pathlib.Path(__file__).with_name("fused_adamw.cc")
# -ffp-contract=off: no multiply-add contracted into an FMA, as the JAX fallback computes
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-std=c++17", "-shared",
         "-fPIC", "-pthread"]
STATE_DTYPES = ("float32", "bfloat16")  # optimizer.state_dtype: the Adam moments' dtype


@dataclasses.dataclass(frozen=True)
class Hyper:
    learning_rate: Any  # a float or an optax schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any  # None, a tree of bools or a callable on the params, as optax.adamw takes
    state_dtype: str = "float32"  # the moments' (STATE_DTYPES); bfloat16: stochastically rounded


def check(hyper: Hyper):
    """Refuses, in one ValueError line naming it, a hyperparameter that makes no AdamW: the host
    update's two paths (the kernel, optax) would each make something else of it."""
    rules = [("b1", lambda x: 0 <= x < 1, "in [0, 1)"), ("b2", lambda x: 0 <= x < 1, "in [0, 1)"),
             ("eps", lambda x: 0 <= x < math.inf, "finite and >= 0"),
             ("weight_decay", lambda x: 0 <= x < math.inf, "finite and >= 0")]
    if not callable(hyper.learning_rate):  # (a schedule's values are its own)
        rules.insert(0, ("learning_rate", lambda x: 0 <= x < math.inf, "finite and >= 0"))
    for name, ok, rule in rules:
        value = getattr(hyper, name)
        try:
            good = ok(float(value))
        except (TypeError, ValueError):
            good = False
        if not good:
            raise ValueError(f"AdamW {name} must be {rule}, got {value!r}")


class AdamW(optax.GradientTransformation):
    """optax.adamw, carrying its hyperparameters (`hyper`) for the fused host update."""


def adamw(learning_rate, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None,
          state_dtype="float32") -> AdamW:
    """optax.adamw; with state_dtype "bfloat16" its moments (mu, nu) are stored in bf16, computed
    in f32 and stochastically rounded at each update (`round_moments`): not bit-equal to fp32
    AdamW, 4 B a parameter less."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got "
                         f"{state_dtype!r}")
    inner = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=mask)
    tx = AdamW(*inner) if state_dtype == "float32" else AdamW(*_bf16_moments(inner))
    tx.hyper = Hyper(learning_rate, b1, b2, eps, weight_decay, mask, state_dtype)
    return tx


def _bf16_moments(inner: optax.GradientTransformation) -> tuple:
    """(init, update) of `inner` (optax.adamw) with its moments held in bf16: widened to f32 for
    optax's update, rounded back by `round_moments`."""
    def cast(adam, dtype):
        to = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
        return adam._replace(mu=to(adam.mu), nu=to(adam.nu))

    def init(params):
        adam, *rest = inner.init(params)
        return (cast(adam, jnp.bfloat16), *rest)

    def update(updates, state, params=None):
        adam, *rest = state
        updates, (adam, *rest) = inner.update(updates, (cast(adam, jnp.float32), *rest), params)
        treedef = jax.tree.structure(adam.mu)
        # (a plain optax transform: its whole tree is one unit, unit 0)
        rounded = [round_moments(adam.count, 0, i, m, v) for i, (m, v) in enumerate(zip(
            jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), strict=True))]
        mu, nu = (jax.tree.unflatten(treedef, [r[k] for r in rounded]) for k in (0, 1))
        return updates, (adam._replace(mu=mu, nu=nu), *rest)

    return init, update


# ----------------------------------------------------------------------------- the native kernel
def _cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "megatrain_jax"


def _cpu_key() -> str:
    """-march=native code runs only where it was built: the cache key names the CPU's features."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def kernel():
    """The kernel's shared library (ctypes), built once and cached; None, logged once with the
    reason, where it cannot be (no compiler, or the compiler's own error)."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("fused AdamW: no C++ compiler (%s); the host update runs its JAX fallback",
                    os.environ.get("CXX", "g++"))
        return None
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, jax.__version__, _cpu_key(),
                                    *FLAGS]).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"fused_adamw-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_suffix(f".{os.getpid()}.tmp")  # then renamed: safe for concurrent builds
            subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
                            str(tmp)], capture_output=True, text=True, check=True)
            os.replace(tmp, lib)
        dll = ctypes.cdll.LoadLibrary(str(lib))
    except (OSError, subprocess.CalledProcessError) as e:
        why = ((e.stderr or "").strip().splitlines() or ["the build failed"])[-1] \
            if isinstance(e, subprocess.CalledProcessError) else e
        log.warning("fused AdamW: the kernel is not available (%s); the host update runs its JAX "
                    "fallback", why)
        return None
    dll.megatrain_adamw.argtypes = [ctypes.c_void_p, ctypes.POINTER(Range), ctypes.c_int64]
    dll.megatrain_adamw.restype = ctypes.c_int
    dll.megatrain_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    dll.megatrain_copy.restype = None
    dll.megatrain_to_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    dll.megatrain_to_bf16.restype = None
    dll.megatrain_zero.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    dll.megatrain_zero.restype = None
    dll.megatrain_threads.restype = ctypes.c_int
    dll.megatrain_cores.restype = ctypes.c_int
    dll.megatrain_set_threads.argtypes = [ctypes.c_int]
    dll.megatrain_set_threads.restype = ctypes.c_int
    return dll


def use_threads(lib, threads) -> list:
    """Runs the kernel's later jobs on `threads` threads (None: one per CPU of the process's
    affinity); returns the CPUs the update's own thread is to be pinned to ([]: none, every CPU
    is the pool's). With fewer threads than CPUs the pool's workers are pinned to the first CPUs
    and the rest stay free for the thread that dispatches the device's work. One ValueError line
    for a count outside [1, the CPUs]."""
    cores = lib.megatrain_cores()
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= cores):
        raise ValueError(f"host_threads must be an integer from 1 to the {cores} CPUs of this "
                         f"process's affinity, got {threads!r}")
    lib.megatrain_set_threads(cores if threads is None else threads)
    return [] if threads is None or threads == cores else sorted(os.sched_getaffinity(0))[:1]


@functools.cache
def native() -> bool:
    """Builds (once, cached) and registers the kernel with jax.ffi; False when it cannot."""
    dll = kernel()
    if dll is None:
        return False
    for name in ("FusedAdamw", "FusedAdamwBus"):
        jax.ffi.register_ffi_target(f"megatrain_{name}", jax.ffi.pycapsule(getattr(dll, name)),
                                    platform="cpu")
    return True


class Range(ctypes.Structure):
    """One range of the direct call (fused_adamw.cc MegatrainRange): a leaf, or a piece of one,
    updated in place."""
    _fields_ = [("p", ctypes.c_void_p), ("m", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("g", ctypes.c_void_p), ("bus", ctypes.c_void_p), ("n", ctypes.c_uint64),
                ("grad_bf16", ctypes.c_int32), ("decay", ctypes.c_int32),
                ("moments_bf16", ctypes.c_int32), ("leaf", ctypes.c_uint32),
                ("first", ctypes.c_uint64)]


# ----------------------------------------------------------------------------- bf16 moments
def _mix(x):
    """fused_adamw.cc `Mix` on uint32 (multiplications wrap, as in C++)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _leaf_key(count, unit, leaf: int):
    """fused_adamw.cc `LeafKey`: the key of leaf `leaf` of unit `unit`'s roundings at Adam count
    `count`."""
    count, unit = (jnp.asarray(x).astype(jnp.uint32) for x in (count, unit))
    return _mix(_mix(_mix(count * jnp.uint32(0x9E3779B9) ^ jnp.uint32(0x5BD1E995))
                     + unit * jnp.uint32(0xC2B2AE35)) + jnp.uint32(leaf) * jnp.uint32(0x85EBCA6B))


def to_bf16_stochastic(x, r):
    """f32 `x` to bf16, rounded up with probability (its dropped 16 bits) / 2^16 (unbiased), the
    16 random bits the low ones of uint32 `r` (fused_adamw.cc `f32_to_bf16_stochastic`)."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded = (u + (r & jnp.uint32(0xFFFF))) >> 16
    nan = (u >> 16) | jnp.uint32(0x40)
    h = jnp.where((u & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000), nan, rounded)
    return jax.lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.bfloat16)


def round_moments(count, unit, leaf: int, m, v, first=0) -> tuple:
    """(m, v) in f32 rounded to bf16 stochastically, as the kernel rounds leaf `leaf` of unit
    `unit`'s moments at Adam count `count` (the count after the step): element i's random bits
    are Mix(key + first + i) (i its row-major index; `first`, the index of element 0 in the whole
    leaf, where m holds some of its rows), the low 16 for m, the high 16 for v."""
    index = jax.lax.iota(jnp.uint32, max(m.size, 1))[:m.size].reshape(m.shape)
    r = _mix(_leaf_key(count, unit, leaf) + jnp.asarray(first).astype(jnp.uint32) + index)
    return to_bf16_stochastic(m, r), to_bf16_stochastic(v, r >> 16)


# ----------------------------------------------------------------------------- the update
SCALARS = ("scale", "clip", "norm", "max_norm", "step", "bc1", "bc2", "wd", "b1", "c1", "b2", "c2",
           "eps", "count_lo", "count_hi", "unit")  # fused_adamw.cc's order; then (the FFI call)
# the leaves' decay flags, then their first elements' indices (`first`) in two 16-bit halves


def _leaf_jax(s: dict, leaf: int, first, p, m, v, g):
    """The kernel's arithmetic in JAX (fused_adamw.cc `Span`), operation for operation and
    rounding for rounding: each product that a sum takes is rounded to f32 first (`alone`), where
    XLA would contract the two into an FMA (one rounding) and the kernel, built with
    -ffp-contract=off, does not. m, v: f32, or bf16 (widened, and stochastically rounded back;
    `first`: round_moments')."""
    # A product ANDed with all ones is no longer a multiplication that a sum could contract. The
    # ones are made from a value known only at run time (the count's high half, < 2^15), so that
    # neither XLA nor LLVM can fold the AND away.
    ones = (s["count_hi"].astype(jnp.uint32) >> 15) - jnp.uint32(1)
    alone = lambda x: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) & ones, jnp.float32)
    dtype = m.dtype
    m, v = m.astype(jnp.float32), v.astype(jnp.float32)
    g = g.astype(jnp.float32) * s["scale"]
    g = jnp.where(s["clip"] != 0, (g / s["norm"]) * s["max_norm"], g)
    m = alone(s["c1"] * g) + alone(s["b1"] * m)
    v = alone(s["c2"] * (g * g)) + alone(s["b2"] * v)
    # The bias corrections as products with their reciprocals, as XLA compiles optax's divisions
    u = (m * (1 / s["bc1"])) / (jnp.sqrt(v * (1 / s["bc2"])) + s["eps"])
    u = jnp.where(s["decay"] != 0, u + alone(s["wd"] * p), u)
    p = p + alone(s["step"] * u)
    if dtype == jnp.bfloat16:
        count = (s["count_lo"].astype(jnp.uint32)
                 | (s["count_hi"].astype(jnp.uint32) << 16))
        m, v = round_moments(count, s["unit"], leaf, m, v, first)
    return p, m, v


def _unit_native(s: dict, decays: list, firsts, ps, ms, vs, gs, buses):
    """Every leaf through one kernel call (one call, so XLA does not run leaves concurrently, each
    over all cores); the outputs are the inputs' buffers (donated by the caller). `buses`: the old
    bf16 copies, or None (no bus copy). firsts: uint32, per leaf (update's)."""
    halves = [(firsts & jnp.uint32(0xFFFF)).astype(jnp.float32),
              (firsts >> 16).astype(jnp.float32)]  # each exact in f32
    scalars = jnp.concatenate([jnp.stack([s[k] for k in SCALARS] +
                                         [jnp.float32(d) for d in decays]), *halves])
    shapes = lambda xs, dtype: [jax.ShapeDtypeStruct(x.shape, dtype) for x in xs]
    results = [*shapes(ps, jnp.float32), *shapes(ms, ms[0].dtype if ms else jnp.float32),
               *shapes(vs, vs[0].dtype if vs else jnp.float32)]
    inputs = [*ps, *ms, *vs, *gs]
    if buses is not None:
        results += shapes(ps, jnp.bfloat16)
        inputs += buses
    n = len(ps)
    aliases = {1 + i: i for i in range(3 * n)}  # (argument 0: the scalars)
    if buses is not None:
        aliases.update({1 + 4 * n + i: 3 * n + i for i in range(n)})
    name = "megatrain_FusedAdamwBus" if buses is not None else "megatrain_FusedAdamw"
    out = jax.ffi.ffi_call(name, results, input_output_aliases=aliases)(scalars, *inputs)
    p, m, v, *bus = [out[i * n:(i + 1) * n] for i in range(len(results) // n)]
    return p, m, v, bus[0] if bus else None


def step_scalars(hyper: Hyper, adam_count, lr_count, grad_norm, scale, max_grad_norm,
                 unit=0) -> tuple:
    """(the kernel's scalars as a dict of f32, the new Adam count, the new schedule count or None),
    as optax.adamw computes them at this step (bias corrections, the schedule at its count) for
    unit `unit` (its index: a bf16 moment's rounding key). To be
    traced inside a jit: the FFI path traces it in its update, the direct path (engine/direct.py)
    jits it alone, so both compute the same bits."""
    count = numerics.safe_increment(adam_count)
    if callable(hyper.learning_rate):
        step = -1 * hyper.learning_rate(lr_count)
        lr_count = numerics.safe_increment(lr_count)
    else:
        step = -1 * hyper.learning_rate
    f32 = lambda x: jnp.asarray(x).astype(jnp.float32)
    clip = jnp.bool_(False) if max_grad_norm is None else grad_norm >= max_grad_norm
    halves = jnp.asarray(count).astype(jnp.uint32)  # each half exact in f32
    s = {"scale": f32(scale), "clip": f32(clip), "norm": f32(grad_norm),
         "max_norm": f32(max_grad_norm or 1.0), "step": f32(step),
         "bc1": f32(1 - hyper.b1 ** count), "bc2": f32(1 - hyper.b2 ** count),
         "wd": f32(hyper.weight_decay), "b1": f32(hyper.b1), "c1": f32(1 - hyper.b1),
         "b2": f32(hyper.b2), "c2": f32(1 - hyper.b2), "eps": f32(hyper.eps),
         "count_lo": f32(halves & 0xFFFF), "count_hi": f32(halves >> 16), "unit": f32(unit)}
    return s, count, lr_count


def decay_flags(hyper: Hyper, params) -> list:
    """Whether each leaf of `params` (in tree order) takes weight decay (optax.adamw's mask)."""
    mask = hyper.mask(params) if callable(hyper.mask) else hyper.mask
    decays = (jax.tree.map(lambda _: True, params) if mask is None else mask)
    leaves = jax.tree.leaves(params)
    return [bool(d) for _, d in zip(leaves, jax.tree.leaves(decays), strict=True)]


def update(hyper: Hyper, params, opt_state, grads, old_bus, grad_norm, scale, max_grad_norm,
           bus_dtype, use_native: bool, unit=0, firsts=None) -> tuple:
    """(params, opt_state, bus) after one AdamW step, as optax.adamw's update + apply_updates of
    the gradient `grads * scale` clipped to `max_grad_norm` (None: not clipped) by `grad_norm`,
    exactly as optax.clip_by_global_norm. `bus` is the new weights in `bus_dtype` (None: none
    wanted), written into `old_bus` when given. `unit` (the unit's index) and `firsts` (per leaf,
    the index in the whole leaf of its first element here: a process's rows of it in the sharded
    host layout; None: all zero) key bf16 moments' rounding. To be traced inside a jit."""
    adam, decay_state, lr_state = opt_state
    s, count, lr_count = step_scalars(
        hyper, adam.count, lr_state.count if callable(hyper.learning_rate) else None, grad_norm,
        scale, max_grad_norm, unit)
    if callable(hyper.learning_rate):
        lr_state = lr_state._replace(count=lr_count)
    decays = decay_flags(hyper, params)
    leaves, treedef = jax.tree.flatten(params)
    firsts = jnp.zeros(len(leaves), jnp.uint32) if firsts is None else jnp.asarray(
        firsts).astype(jnp.uint32)
    fused_bus = use_native and jnp.dtype(bus_dtype or jnp.float32) == jnp.bfloat16
    state = (leaves, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), jax.tree.leaves(grads))
    if use_native:
        buses = None
        if fused_bus:  # (no old copy to write into: fresh ones)
            buses = (jax.tree.leaves(old_bus) if old_bus is not None
                     else [jnp.empty(p.shape, jnp.bfloat16) for p in leaves])
        out = _unit_native(s, decays, firsts, *state, buses)
    else:
        rows = [_leaf_jax({**s, "decay": jnp.float32(d)}, i, firsts[i], p, m, v, g)
                for i, (p, m, v, g, d) in enumerate(zip(*state, decays, strict=True))]
        out = [[row[i] for row in rows] for i in range(3)] + [None]
    new = [None if o is None else jax.tree.unflatten(treedef, list(o)) for o in out]
    params = new[0]
    if bus_dtype is None:
        bus = None
    elif fused_bus:
        bus = new[3]
    else:
        bus = jax.tree.map(lambda x: x.astype(bus_dtype), params)
    opt_state = (adam._replace(count=count, mu=new[1], nu=new[2]), decay_state, lr_state)
    return params, opt_state, bus
