"""AdamW as the host update runs it: one pass over each leaf, in place.

`adamw(...)` is `optax.adamw(...)` (same init, update and state), marked so that the engine's
host update (engine/host.py) runs it here instead: the gradient's scale and global-norm clip, both
moments, the weight and its bf16 bus copy in one loop that reads and writes each once (30 B/param
with a bf16 bus copy), where XLA runs optax as several loops over the same arrays.

The loop is a small C++ kernel (fused_adamw.cc) called through `jax.ffi`, once per unit for all
of its leaves (spread over the cores there), built with the system's C++ compiler on first use and
cached per CPU feature set; without a compiler (or when the build fails) the same
arithmetic runs in JAX, operation for operation, and the log says so once. Any other optimizer
runs through optax as before.
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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax._src import numerics

log = logging.getLogger(__name__)
SOURCE = pathlib.Path(__file__).with_name("fused_adamw.cc")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC",
         "-pthread"]


@dataclasses.dataclass(frozen=True)
class Hyper:
    learning_rate: Any  # a float or an optax schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    mask: Any  # None, a tree of bools or a callable on the params, as optax.adamw takes


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


def adamw(learning_rate, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, mask=None) -> AdamW:
    tx = AdamW(*optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                            mask=mask))
    tx.hyper = Hyper(learning_rate, b1, b2, eps, weight_decay, mask)
    return tx


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
    dll.megatrain_threads.restype = ctypes.c_int
    return dll


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
                ("grad_bf16", ctypes.c_int32), ("decay", ctypes.c_int32)]


# ----------------------------------------------------------------------------- the update
SCALARS = ("scale", "clip", "norm", "max_norm", "step", "bc1", "bc2", "wd", "b1", "c1", "b2", "c2",
           "eps")  # fused_adamw.cc's order; then the leaves' decay flags


def _leaf_jax(s: dict, p, m, v, g):
    """The kernel's arithmetic in JAX (fused_adamw.cc `Run`), operation for operation."""
    g = g.astype(jnp.float32) * s["scale"]
    g = jnp.where(s["clip"] != 0, (g / s["norm"]) * s["max_norm"], g)
    m = s["c1"] * g + s["b1"] * m
    v = s["c2"] * (g * g) + s["b2"] * v
    # The bias corrections as products with their reciprocals, as XLA compiles optax's divisions
    u = (m * (1 / s["bc1"])) / (jnp.sqrt(v * (1 / s["bc2"])) + s["eps"])
    u = jnp.where(s["decay"] != 0, u + s["wd"] * p, u)
    return p + s["step"] * u, m, v


def _unit_native(s: dict, decays: list, ps, ms, vs, gs, buses):
    """Every leaf through one kernel call (one call, so XLA does not run leaves concurrently, each
    over all cores); the outputs are the inputs' buffers (donated by the caller). `buses`: the old
    bf16 copies, or None (no bus copy)."""
    scalars = jnp.stack([s[k] for k in SCALARS] + [jnp.float32(d) for d in decays])
    shapes = lambda xs, dtype: [jax.ShapeDtypeStruct(x.shape, dtype) for x in xs]
    results = [*shapes(ps, jnp.float32), *shapes(ms, jnp.float32), *shapes(vs, jnp.float32)]
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


def step_scalars(hyper: Hyper, adam_count, lr_count, grad_norm, scale, max_grad_norm) -> tuple:
    """(the kernel's scalars as a dict of f32, the new Adam count, the new schedule count or None),
    as optax.adamw computes them at this step (bias corrections, the schedule at its count). To be
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
    s = {"scale": f32(scale), "clip": f32(clip), "norm": f32(grad_norm),
         "max_norm": f32(max_grad_norm or 1.0), "step": f32(step),
         "bc1": f32(1 - hyper.b1 ** count), "bc2": f32(1 - hyper.b2 ** count),
         "wd": f32(hyper.weight_decay), "b1": f32(hyper.b1), "c1": f32(1 - hyper.b1),
         "b2": f32(hyper.b2), "c2": f32(1 - hyper.b2), "eps": f32(hyper.eps)}
    return s, count, lr_count


def decay_flags(hyper: Hyper, params) -> list:
    """Whether each leaf of `params` (in tree order) takes weight decay (optax.adamw's mask)."""
    mask = hyper.mask(params) if callable(hyper.mask) else hyper.mask
    decays = (jax.tree.map(lambda _: True, params) if mask is None else mask)
    leaves = jax.tree.leaves(params)
    return [bool(d) for _, d in zip(leaves, jax.tree.leaves(decays), strict=True)]


def update(hyper: Hyper, params, opt_state, grads, old_bus, grad_norm, scale, max_grad_norm,
           bus_dtype, use_native: bool) -> tuple:
    """(params, opt_state, bus) after one AdamW step, as optax.adamw's update + apply_updates of
    the gradient `grads * scale` clipped to `max_grad_norm` (None: not clipped) by `grad_norm`,
    exactly as optax.clip_by_global_norm. `bus` is the new weights in `bus_dtype` (None: none
    wanted), written into `old_bus` when given. To be traced inside a jit."""
    adam, decay_state, lr_state = opt_state
    s, count, lr_count = step_scalars(
        hyper, adam.count, lr_state.count if callable(hyper.learning_rate) else None, grad_norm,
        scale, max_grad_norm)
    if callable(hyper.learning_rate):
        lr_state = lr_state._replace(count=lr_count)
    decays = decay_flags(hyper, params)
    leaves, treedef = jax.tree.flatten(params)
    fused_bus = use_native and jnp.dtype(bus_dtype or jnp.float32) == jnp.bfloat16
    state = (leaves, jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), jax.tree.leaves(grads))
    if use_native:
        buses = None
        if fused_bus:  # (no old copy to write into: fresh ones)
            buses = (jax.tree.leaves(old_bus) if old_bus is not None
                     else [jnp.empty(p.shape, jnp.bfloat16) for p in leaves])
        out = _unit_native(s, decays, *state, buses)
    else:
        rows = [_leaf_jax({**s, "decay": jnp.float32(d)}, p, m, v, g)
                for p, m, v, g, d in zip(*state, decays, strict=True)]
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
