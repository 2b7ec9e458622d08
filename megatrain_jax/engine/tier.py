"""The disk tier: each unit's fp32 master weights and optax state in a preallocated file.

    tier = DiskTier(DiskTierOptions("/nvme/run1", read_ahead=1, run="runs/a"), layouts)
    tier.expect(u)                 # unit u's update is queued: its read may start
    params, opt_state = tier.load(u)     # host arrays aliasing unit u's read (ahead) buffer
    tier.store(u, new_params, new_state) # copied out, written back in the background

One file per unit, `unit_00000.bin` (the stages), `unit_00001.bin` (layer 0), ...: the unit's
leaves (params then optax state, in tree order) at 4 KiB-aligned offsets. A unit moves whole, in
one `preadv` or one `pwritev` of its file, through a 4 KiB-aligned buffer from a pool that reads
and writes share; the files are opened with O_DIRECT where the filesystem allows it
(`direct_io`), so the disk, not the page cache, moves the bytes and the cache does not grow by the
model. The I/O runs on a small thread pool: while the host thread updates unit i, units
i + 1 .. i + read_ahead are being read and unit i - 1 written. `load` hands out arrays that alias
the read buffer (no copy in); `store` copies the update's outputs into a buffer and lets them go
at once, so host RAM holds the bus copies plus read_ahead + max(1, read_ahead) + 1 units in
buffers and the update's outputs, not the whole model's state.

The files are scratch, not state of record: the engine writes them whole at construction and a
run resumes from its last checkpoint, never from them. `tier.json` in the directory names the run,
the model and the layout; a directory holding another run's tier, or other files, is refused
(TierError, one line), never reused. A file deleted or truncated mid-run, or a read or write that
fails (a disk filled by other files: ENOSPC), is a TierError naming it.
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time

import jax
import numpy as np

ALIGN = 4096  # page and sector size: O_DIRECT needs addresses, offsets and lengths aligned to it
MANIFEST = "tier.json"
FORMAT = 1
DIRECT_IO = ("auto", "true", "false")  # offload.direct_io


class TierError(ValueError):
    """The disk tier cannot be used or has been damaged: one line naming the path."""


@dataclasses.dataclass(frozen=True)
class DiskTierOptions:
    path: str  # a directory on a fast local disk (created if missing)
    # Units read ahead of the one being updated (and written behind): 1 hides the I/O when a
    # unit's read takes less than its update plus the device's work on it, at the least RAM.
    read_ahead: int = 1
    run: str = ""  # the run owning the directory (e.g. its run_dir): another run's is refused
    model: str = ""  # what the caller calls the model (a config hash), recorded in tier.json
    # O_DIRECT: auto (where the filesystem allows it, else buffered, said once), true (refused
    # where it is not allowed), false (buffered: the page cache holds recently moved units).
    direct_io: str = "auto"


def check_writable(path: str):
    """Raises TierError unless a file can be created in `path`, or in its nearest existing parent
    where `path` is still to be made (tried for real and removed: permission bits are wrong for
    root and for read-only mounts); nothing is left behind."""
    where = os.path.abspath(path)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise TierError(f"offload.path {path} is not writable ({e.strerror or e})") from None


def open_direct(name: str) -> int:
    """`name` opened for reading and writing with O_DIRECT (a seam: tests make it refuse, as
    ramfs, FUSE or tmpfs before Linux 6.6 do, with EINVAL)."""
    return os.open(name, os.O_RDWR | os.O_DIRECT)


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem of `path` (a seam: tests replace it with a small figure)."""
    return shutil.disk_usage(path).free


def check_space(path: str, needed: int):
    """Raises TierError unless the disk of `path` (a directory, or its nearest existing parent)
    has room for `needed` bytes of tier files beyond the unit files already there."""
    where = os.path.abspath(path)
    existing = 0
    if os.path.isdir(where):
        existing = sum(os.path.getsize(os.path.join(where, name)) for name in os.listdir(where)
                       if name.startswith("unit_") and name.endswith(".bin"))
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = free_bytes(where)
    if needed - existing > free:
        raise TierError(f"offload.path {path}: the disk tier needs {(needed - existing) / 1e9:.2f} "
                        f"GB more and the disk has {free / 1e9:.2f} GB free")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Where one unit's leaves lie in its file."""
    treedef: object  # of (params, opt_state)
    leaves: tuple  # ((shape, dtype name, offset), ...)
    nbytes: int  # the file's size (aligned)

    @staticmethod
    def of(params, opt_state) -> "UnitLayout":
        leaves, treedef = jax.tree.flatten((params, opt_state))
        out, offset = [], 0
        for x in leaves:
            out.append((tuple(x.shape), np.dtype(x.dtype).name, offset))
            offset += _align(x.size * np.dtype(x.dtype).itemsize)
        return UnitLayout(treedef, tuple(out), max(offset, ALIGN))

    def describe(self) -> list:
        return [[list(shape), dtype, offset] for shape, dtype, offset in self.leaves]

    def arrays(self, buffer) -> list:
        """The leaves as numpy views into `buffer` (bytes of the file), in tree order."""
        return [np.ndarray(shape, np.dtype(dtype), buffer=buffer, offset=offset)
                for shape, dtype, offset in self.leaves]

    def views(self, buffer) -> tuple:
        """(params, opt_state) as numpy views into `buffer`."""
        return jax.tree.unflatten(self.treedef, self.arrays(buffer))


def _aligned_zeros(nbytes: int) -> np.ndarray:
    # Zeros (calloc: untouched pages cost nothing) so the padding written between leaves is too.
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def describe_layouts(layouts) -> str:
    """A short hash of the layout of every unit (shapes, dtypes, offsets)."""
    text = json.dumps([layout.describe() for layout in layouts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskTier:
    """Unit files under `options.path`, with reads ahead and writes behind on an I/O pool."""

    def __init__(self, options: DiskTierOptions, layouts: list):
        if options.read_ahead < 0:
            raise TierError(f"offload.read_ahead must be >= 0, got {options.read_ahead}")
        if options.direct_io not in DIRECT_IO:
            raise TierError(f"offload.direct_io must be one of {', '.join(DIRECT_IO)}, "
                            f"got {options.direct_io!r}")
        self.options = options
        self.path = os.path.abspath(options.path)
        self.layouts = layouts
        self.files = [os.path.join(self.path, f"unit_{u:05d}.bin") for u in range(len(layouts))]
        self.total_bytes = sum(layout.nbytes for layout in layouts)
        self.direct_io = options.direct_io != "false"  # until the filesystem refuses it (auto)
        self.io_mode = "buffered (offload.direct_io=false)"  # for the log
        self.opened = self._claim_directory()
        self.fds = [self._create(u) for u in range(len(layouts))]  # one open file per unit
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(2, options.read_ahead + 1), thread_name_prefix="disk-tier")
        self._lock = threading.Lock()
        self._upcoming = []  # units whose update is queued, in order (the reads to start)
        self._reads = {}  # unit -> Future of its buffer
        self._writes = {}  # unit -> Future of its last write
        self._free = {}  # nbytes -> [aligned buffers]: reused, never page-faulted again
        self._loaned = {}  # unit -> its read buffer, aliased by the arrays load() returned
        # Bytes moved and the seconds the I/O threads spent in the syscalls moving them (summed
        # over threads): bytes / seconds is the tier's own throughput, for benchmarks. The host
        # thread's seconds: copying between buffers and arrays (copy_s), and waiting for a read
        # or a write to finish (wait_s, the I/O the read ahead did not hide).
        self.bytes_read = self.bytes_written = 0
        self.read_s = self.write_s = self.copy_s = self.wait_s = 0.0
        self.buffers = collections.Counter()  # nbytes -> aligned buffers of that size made

    # ----------------------------------------------------------------- the directory
    def _claim_directory(self) -> str:
        """Checks the directory and writes tier.json; what was there, in words (for the log)."""
        path, where = self.path, f"offload.path {self.options.path}"
        if os.path.exists(path) and not os.path.isdir(path):
            raise TierError(f"{where} is not a directory")
        check_writable(self.options.path)  # before anything is made
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise TierError(f"{where} is not writable ({e.strerror or e})") from None
        manifest_path = os.path.join(path, MANIFEST)
        ours = set(map(os.path.basename, self.files)) | {MANIFEST}
        opened = "new"
        if os.path.exists(manifest_path):
            try:
                with open(manifest_path) as f:
                    old = json.load(f)
                old_run, old_model = old["run"], old.get("model", "")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise TierError(f"{where}: {manifest_path} is not a disk tier's manifest ({e}); "
                                f"delete the directory or choose another offload.path") from None
            if old_run != self.options.run:
                raise TierError(f"{where} holds the disk tier of another run ({old_run!r}, this "
                                f"is {self.options.run!r}); give each run its own offload.path, "
                                f"or delete {path} if that run is over")
            same = (old_model == self.options.model
                    and old.get("layout") == describe_layouts(self.layouts))
            opened = ("this run's files, rewritten" if same else
                      f"this run's files of another model ({old_model!r}), rebuilt")
        else:
            others = sorted(set(os.listdir(path)) - ours)
            if others:
                raise TierError(f"{where} is not empty and holds no {MANIFEST} (e.g. {others[0]}"
                                f"); the disk tier needs a directory of its own")
        if self.direct_io:  # refused (direct_io=true) before any of ours is touched
            fd, probe = tempfile.mkstemp(dir=path, prefix=".direct_io_probe")
            os.close(fd)
            try:
                os.close(self._reopen_direct(probe, os.open(probe, os.O_RDWR)))
            finally:
                os.remove(probe)
        stale = [name for name in os.listdir(path) if name.startswith("unit_")
                 and name.endswith(".bin") and name not in ours]
        for name in stale:  # units of a deeper model of this run
            os.remove(os.path.join(path, name))
        check_space(self.options.path, self.total_bytes)
        manifest = {"format": FORMAT, "run": self.options.run, "model": self.options.model,
                    "layout": describe_layouts(self.layouts), "units": len(self.layouts),
                    "bytes": self.total_bytes}
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(manifest_path + ".tmp", manifest_path)
        return opened

    def _create(self, u: int) -> int:
        try:
            fd = os.open(self.files[u], os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise TierError(f"offload.path {self.options.path}: cannot create {self.files[u]} "
                            f"({e.strerror or e})") from None
        try:
            os.ftruncate(fd, self.layouts[u].nbytes)
            if hasattr(os, "posix_fallocate"):  # the blocks now, not ENOSPC mid-run
                os.posix_fallocate(fd, 0, self.layouts[u].nbytes)
        except OSError as e:
            os.close(fd)
            raise TierError(f"offload.path {self.options.path}: cannot allocate {self.files[u]} "
                            f"({e.strerror or e})") from None
        if self.direct_io:
            fd = self._reopen_direct(self.files[u], fd)
        return fd

    def _reopen_direct(self, name: str, fd: int) -> int:
        """fd (of file `name`) reopened with O_DIRECT; where the filesystem refuses it (tmpfs:
        EINVAL), fd itself, buffered from then on, with io_mode saying why (auto), or a TierError
        (true)."""
        try:
            direct = open_direct(name)
        except (OSError, AttributeError) as e:  # AttributeError: no O_DIRECT on this platform
            why = e.strerror if isinstance(e, OSError) else "not on this platform"
            if self.options.direct_io == "true":
                os.close(fd)
                raise TierError(f"offload.path {self.options.path}: O_DIRECT refused ({why}); "
                                f"set offload.direct_io=auto or false") from None
            self.direct_io = False
            self.io_mode = f"buffered ({self.options.path} refuses O_DIRECT: {why})"
            return fd
        os.close(fd)
        self.io_mode = "O_DIRECT"
        return direct

    # ----------------------------------------------------------------- raw I/O
    def _check(self, u: int, fd: int):
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size < self.layouts[u].nbytes:
            what = "was deleted" if st.st_nlink == 0 else (
                f"was truncated to {st.st_size} of {self.layouts[u].nbytes} bytes")
            raise TierError(f"disk tier file {self.files[u]} {what} mid-run; the run must resume "
                            f"from its last checkpoint (the tier files are rebuilt from it)")

    def _io_error(self, u: int, doing: str, e: OSError) -> "TierError":
        return TierError(f"offload.path {self.options.path}: {doing} {self.files[u]} failed "
                         f"({e.strerror or e})")

    def _take(self, nbytes: int) -> np.ndarray:
        """An aligned buffer of nbytes from the pool (made the first time the pool is short)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.buffers[nbytes] += 1
        return _aligned_zeros(nbytes)

    def _give(self, buffer):
        with self._lock:
            self._free.setdefault(buffer.nbytes, []).append(buffer)

    def _read(self, u: int) -> np.ndarray:
        """Runs on the I/O pool: unit u's file into a buffer from the pool, in one preadv."""
        fd, nbytes = self.fds[u], self.layouts[u].nbytes
        self._check(u, fd)
        buffer = self._take(nbytes)
        view, done = memoryview(buffer), 0
        t0 = time.perf_counter()
        while done < nbytes:  # a single call unless a signal or the kernel cuts it short
            try:
                n = os.preadv(fd, [view[done:]], done)
            except OSError as e:
                self._give(buffer)
                raise self._io_error(u, "reading", e) from None
            if n == 0:
                self._give(buffer)
                self._check(u, fd)
                raise TierError(f"disk tier file {self.files[u]}: unexpected end at {done} bytes")
            done += n
        with self._lock:
            self.bytes_read += nbytes
            self.read_s += time.perf_counter() - t0
        return buffer

    def _fill(self, u: int, leaves: list) -> np.ndarray:
        """Unit u's leaves (host arrays) copied into a buffer from the pool, laid out as its
        file: the arrays can go as soon as this returns, and O_DIRECT gets its aligned source."""
        jax.block_until_ready(leaves)  # the update that makes them is not the copy's time
        t0 = time.perf_counter()
        buffer = self._take(self.layouts[u].nbytes)
        for view, leaf in zip(self.layouts[u].arrays(buffer), leaves):
            np.copyto(view, np.asarray(leaf))
        self.copy_s += time.perf_counter() - t0
        return buffer

    def _write(self, u: int, buffer: np.ndarray):
        """Runs on the I/O pool: a filled buffer into unit u's file in one pwritev; the buffer
        goes back to the pool (also when the write fails)."""
        try:
            fd = self.fds[u]
            self._check(u, fd)
            view, done = memoryview(buffer), 0
            t0 = time.perf_counter()
            while done < len(view):
                try:
                    done += os.pwritev(fd, [view[done:]], done)
                except OSError as e:  # a disk filled mid-run (other files took the space)
                    raise self._io_error(u, "writing", e) from None
            with self._lock:
                self.bytes_written += done
                self.write_s += time.perf_counter() - t0
        finally:
            self._give(buffer)

    def _start_read(self, u: int):
        if u not in self._reads:
            write = self._writes.pop(u, None)
            if write is not None:
                write.result()  # the read must see the last write
            self._reads[u] = self._pool.submit(self._read, u)

    # ----------------------------------------------------------------- the host thread's API
    def expect(self, u: int):
        """Unit u's update has been queued (main thread): its read starts within read_ahead."""
        with self._lock:
            self._upcoming.append(u)

    def load(self, u: int, host_sharding) -> tuple:
        """(params, opt_state) of unit u as arrays on `host_sharding` aliasing its read
        buffer, which must not be donated nor used after `store(u)`; its read was started ahead,
        and the reads of the next read_ahead queued units start now."""
        with self._lock:
            if self._upcoming and self._upcoming[0] == u:
                self._upcoming.pop(0)
            ahead = list(self._upcoming[:self.options.read_ahead])
        t0 = time.perf_counter()
        self._start_read(u)
        buffer = self._reads.pop(u).result()
        t1 = time.perf_counter()
        # No copy: device_put of the (4 KiB-aligned) views aliases the buffer, which stays loaned
        # to these arrays until store() has copied the update's outputs out. Copying it into
        # fresh XLA arrays instead took most of the host thread's time, each page faulted in
        # (docs/benchmarks.md, "Disk tier": no copy in). The update must then not donate them:
        # HostState compiles a non-donating update for the tier.
        state = jax.tree.map(lambda x: jax.device_put(x, host_sharding), self.layouts[u].views(buffer))
        with self._lock:
            self._loaned[u] = buffer
        self.wait_s += t1 - t0
        self.copy_s += time.perf_counter() - t1
        for v in ahead:  # each in a buffer of its own: u's is loaned until store(u)
            self._start_read(v)
        return state

    def store(self, u: int, params, opt_state):
        """Copies unit u's updated state into a buffer (the caller's arrays can then be freed),
        gives back the buffer `load(u)` loaned, and writes the copy in the background. At most
        max(1, read_ahead) writes are pending: beyond that the oldest is waited for first, so its
        buffer is the one this copy reuses."""
        t0 = time.perf_counter()
        while len([f for f in self._writes.values() if not f.done()]) >= max(
                1, self.options.read_ahead):
            oldest = next(v for v, f in self._writes.items() if not f.done())
            self._writes[oldest].result()
        self.wait_s += time.perf_counter() - t0
        buffer = self._fill(u, jax.tree.leaves((params, opt_state)))
        with self._lock:
            loaned = self._loaned.pop(u, None)
        if loaned is not None:
            self._give(loaned)
        self._writes[u] = self._pool.submit(self._write, u, buffer)

    def write_now(self, u: int, params, opt_state):
        """Writes unit u's state and waits (construction, loading a checkpoint)."""
        self.flush()
        self._write(u, self._fill(u, jax.tree.leaves((params, opt_state))))

    def flush(self):
        """Waits for every read and write in flight (re-raising their errors). Refused while a
        unit's update holds its read buffer (between load and store): its reads ahead and its
        bookkeeping are the host thread's until then."""
        with self._lock:
            out = sorted(self._loaned)
        if out:
            raise RuntimeError(f"disk tier: flushed while unit {out[0]}'s update is running; "
                               f"wait for the host updates first")
        self._drain()

    def _drain(self):
        for u, future in list(self._writes.items()):
            future.result()
            self._writes.pop(u, None)
        for u, future in list(self._reads.items()):
            self._give(future.result())
            self._reads.pop(u, None)

    def view(self, u: int) -> tuple:
        """(params, opt_state) of unit u as read-only numpy arrays mapped from its file (no copy:
        file-backed pages the kernel can drop); valid until the unit's next update."""
        self.flush()
        self._check(u, self.fds[u])
        mapped = np.memmap(self.files[u], np.uint8, mode="r", shape=(self.layouts[u].nbytes,))
        return self.layouts[u].views(mapped)

    def close(self):
        try:
            self._drain()  # (after a failed update, its unit's buffer stays loaned)
        finally:
            self._pool.shutdown()
            for fd in self.fds:
                os.close(fd)
            self.fds = []
