"""One training process per run directory: `<run_dir>/train.lock`.

    with RunLock(run_dir, log=print):   # LockedError naming the holder if another run has it
        ...                             # checkpoints, metrics.jsonl, config.yaml are ours alone

The lock is an exclusive `flock` on the file, which the kernel drops when the holder dies however
it dies (SIGKILL included), so a lock left behind by a dead run is taken over, with a log line. The
file says who holds it (`pid host`), for the error message and for the one case flock cannot
decide: a file written on another host (a shared filesystem may not share flocks), which is never
taken over. A clean exit removes the file.
"""

import errno
import fcntl
import os
import socket

from megatrain_jax.errors import LockedError

LOCK_FILE = "train.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_holder(fd) -> tuple:
    """(pid, host) written in the lock file, or (None, None) if it is empty or garbled."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode(errors="replace").split()
    try:
        return int(text[0]), text[1]
    except (IndexError, ValueError):
        return None, None


class RunLock:
    """Holds `<run_dir>/train.lock` from __enter__ to __exit__ (see the module docstring)."""

    def __init__(self, run_dir: str, *, log=print):
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.log = log
        self.fd = None

    def _refuse(self, pid, host, why=""):
        holder = f"pid {pid} on host {host}" if pid is not None else "another process"
        return LockedError(f"run_dir {os.path.dirname(self.path)!r} is in use by {holder} (lock "
                           f"file {self.path}){why}; wait for that run to finish or pick another "
                           f"run_dir")

    def check_free(self):
        """Raises LockedError if another process holds the lock now: a look that takes nothing and
        creates nothing (a data-parallel run's process 0 looks before the others join it)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # no lock file: free (one that cannot be read: __enter__ says so)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._refuse(*_read_holder(fd)) from None
        finally:
            os.close(fd)  # drops our shared lock, if we took it

    def __enter__(self):
        host = socket.gethostname()
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise LockedError(f"cannot create the lock file {self.path} "
                                  f"({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                pid, holder_host = _read_holder(fd)
                os.close(fd)
                raise self._refuse(pid, holder_host) from None
            # The holder may have removed the file between our open and our flock: then we hold a
            # lock on a deleted file, and must start over on the path's current file.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        pid, holder_host = _read_holder(fd)
        if pid is not None and pid != os.getpid():
            if holder_host != host:
                os.close(fd)
                raise self._refuse(pid, holder_host, ", which this host cannot check; delete the "
                                   "lock file if that run is over")
            if _pid_alive(pid):  # the flock is free yet the pid lives: a reused pid, or a holder
                os.close(fd)     # on a filesystem without flock; do not guess
                raise self._refuse(pid, holder_host, ", whose pid is alive; delete the lock file "
                                   "if that run is over")
            self.log(f"took over the stale lock {self.path} of pid {pid} on {host} (no longer "
                     f"running)")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()} {host}\n".encode())
        os.fsync(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            try:
                os.unlink(self.path)  # while still holding the flock: see __enter__
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
