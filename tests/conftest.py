import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the whole run, shared with the subprocesses the tests start
# (the environment is inherited): engines of the same shapes, built again and again across tests
# and CLI runs, compile each function once. Fresh per run and removed at exit, so no test depends
# on a previous run. A cache hit still counts as a compilation for test_engine's compile counter
# (the event wraps compile-or-fetch).
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
# XLA:CPU compiles the tests' programs without LLVM's optimisation passes and with its older
# loop emitters instead of the MLIR fusion emitters (here and in every subprocess a test starts):
# compiling is most of the suite's time, those passes and emitters are most of a compile's, and
# the tests' tiny programs run about as fast without them (docs/benchmarks.md, "The test
# suite"). What the tests compare does not depend on them: every comparison is
# between two programs compiled alike, or against a tolerance derived from an fp64 reference
# (XLA:CPU does no fast math either way). Outside the tests (runs, benchmarks) XLA's defaults stay.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402  (after the environment it reads)

# Three CPU devices, so tests can use one as the "accelerator" and another as the host and every
# transfer the engine makes is a real cross-device put; data-parallel tests use two as compute
# devices and the third as the host. Must run before the backend starts.
jax.config.update("jax_num_cpu_devices", 3)

# The files that take longest, longest first: pytest-xdist hands whole files to its workers in
# this order (--dist loadfile --no-loadscope-reorder in pyproject.toml), so the run ends on short
# files rather than on a long one with the other worker idle. The rest follow in their own order.
# A file missing from this list only costs balance (each file's time: pytest's --durations).
SLOWEST_FILES = ("test_bad_inputs.py", "test_distributed.py", "test_bench.py",
                 "test_gpu_checklist.py", "test_checkpoint.py", "test_plan.py", "test_engine.py",
                 "test_disk_tier.py", "test_hf.py", "test_host_optim.py", "test_ring.py",
                 "test_generate.py", "test_dpo.py", "test_seqtile.py", "test_packing.py",
                 "test_streaming.py", "test_long_context_plan.py", "test_train_faults.py",
                 "test_moe.py", "test_families.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
