"""This process's resident host memory (from /proc/self/status, for benchmarks), and the one
allocator setting that keeps it at the design's bytes per parameter.

    reset_peak(); ...; extra = peak_rss_bytes() - rss_bytes_before

Raises OSError where /proc is not there (not Linux).
"""

import ctypes
import ctypes.util


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
