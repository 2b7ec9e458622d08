import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the whole run, shared with the subprocesses the tests start
# (the environment is inherited): engines of the same shapes, built again and again across tests
# and CLI runs, compile each function once. It halves the suite's time on 2 cores. Fresh per run
# and removed at exit, so no test depends on a previous run. A cache hit still counts as a
# compilation for test_engine's compile counter (the event wraps compile-or-fetch).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="megatrain-jax-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
# Token caches (data.cache_dir's default) and the fused AdamW kernel's build, under
# $XDG_CACHE_HOME, in a fresh directory per run too: no test reads one a previous run left, none
# writes into the home directory. The run's workers inherit it from the process that starts them
# (as the compilation cache above), so the kernel is built once a run, not once a worker; both
# caches are safe to build from several processes at once (each renames a finished build into
# place).
_XDG_PREFIX = "megatrain-jax-test-xdg-"
if not os.path.basename(os.environ.get("XDG_CACHE_HOME", "")).startswith(_XDG_PREFIX):
    _xdg = tempfile.mkdtemp(prefix=_XDG_PREFIX)
    atexit.register(shutil.rmtree, _xdg, ignore_errors=True)
    os.environ["XDG_CACHE_HOME"] = _xdg
# XLA:CPU compiles the tests' programs without LLVM's optimisation passes (here and in every
# subprocess a test starts): those passes are most of the time of a compile, which is most of the
# suite's, and the tests' tiny programs run about as fast without them. What the tests compare
# does not depend on them (XLA:CPU does no fast math at either level). Outside the tests (runs,
# benchmarks) XLA's default stays.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment it reads)

# Three CPU devices, so tests can use one as the "accelerator" and another as the host and every
# transfer the engine makes is a real cross-device put; data-parallel tests use two as compute
# devices and the third as the host. Must run before the backend starts.
jax.config.update("jax_num_cpu_devices", 3)
