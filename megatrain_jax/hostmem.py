"""This process's resident host memory (from /proc/self/status, for benchmarks), and the allocator
settings of a training run: the mmap threshold that keeps RSS at the design's bytes per parameter,
and transparent huge pages for glibc's allocations (`with_huge_pages`, by the training commands).

    reset_peak(); ...; extra = peak_rss_bytes() - rss_bytes_before

Raises OSError where /proc is not there (not Linux).
"""

import ctypes
import ctypes.util
import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) on what malloc maps
OPT_OUT = "MEGATRAIN_HUGE_PAGES"  # =0: run as started
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, RssFile, ...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise KeyError(f"/proc/self/status has no field {field}")


def rss_bytes() -> int:
    """Resident set size now (VmRSS)."""
    return status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or the last `reset_peak()` (VmHWM)."""
    return status_bytes("VmHWM")


def reset_peak():
    """Resets the peak (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def set_mmap_threshold(nbytes: int):
    """glibc malloc: serve every block of at least `nbytes` by its own mmap, unmapped on free.

    By default glibc raises this threshold (up to 32 MiB) each time such a block is freed, after
    which freed blocks of a layer's size stay in its heaps, resident, instead of going back to the
    kernel. Raises OSError if the C library is not glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt") or libc.mallopt(-3, int(nbytes)) != 1:  # -3: M_MMAP_THRESHOLD
        raise OSError("mallopt(M_MMAP_THRESHOLD) is not available (not glibc?)")


def thp_setting(path: str = THP_SETTING) -> str:
    """The kernel's transparent huge page mode (always, madvise or never; never where unknown)."""
    try:
        with open(path) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def huge_pages_env(environ, thp: str):
    """The environment to run a training command in with glibc's allocations on transparent huge
    pages (TUNABLE added to GLIBC_TUNABLES), or None where there is nothing to do: the tunable is
    there already (or the user set glibc.malloc.hugetlb), `MEGATRAIN_HUGE_PAGES=0`, or the kernel's
    mode is `never`. Each step then frees and maps its gradients' and activations' buffers in 2 MB
    pages, 512 times fewer faults and unmaps than in 4 KB pages: the host update as a step runs
    it is faster (docs/benchmarks.md, "Host update": transparent huge pages)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or environ.get(OPT_OUT) == "0" or thp == "never":
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def with_huge_pages():
    """Runs this command again, at once, in huge_pages_env's environment (glibc reads its tunables
    only as a process starts); returns where there is nothing to do. For the training commands'
    entry points only, before anything else: the process is replaced."""
    env = huge_pages_env(os.environ, thp_setting())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def huge_pages_on() -> bool:
    """Whether this process runs with glibc's transparent huge pages (with_huge_pages)."""
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
