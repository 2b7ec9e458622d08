"""A file of token ids read with pread, never memory-mapped: training batches stream from disk and
host RAM (RSS) stays the same whatever the corpus size. A memory map would keep every page a
batch touched mapped into the process, so over an epoch its RSS would grow to the corpus size."""

import os

import numpy as np


class TokenFile:
    """The 1-D array of `length` ids of `dtype` at byte `offset` of `path`, as far as the
    samplers use one: len, dtype, ndim, a slice (another TokenFile), an int, and an index array
    whose rows are runs of consecutive positions (windows: starts[:, None] + arange(n))."""

    ndim = 1

    def __init__(self, path: str, dtype, offset: int = 0, length: int | None = None):
        self.path, self.dtype, self.offset = path, np.dtype(dtype), int(offset)
        if length is None:
            length = (os.path.getsize(path) - self.offset) // self.dtype.itemsize
        self.length = int(length)
        self._fd = None

    @classmethod
    def of(cls, tokens):
        """A TokenFile over the file of an np.memmap (as np.memmap or np.load(mmap_mode) give)."""
        return cls(tokens.filename, tokens.dtype, tokens.offset, len(tokens))

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):  # the descriptor is this process's: reopened where it is used
        return {**self.__dict__, "_fd": None}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop), a fresh array."""
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"tokens [{start}, {stop}) of {self.length}")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = (stop - start) * self.dtype.itemsize
        raw = os.pread(self._fd, size, self.offset + start * self.dtype.itemsize)
        if len(raw) != size:
            raise OSError(f"{self.path}: short read ({len(raw)} of {size} bytes): truncated?")
        return np.frombuffer(raw, dtype=self.dtype).copy()

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                raise IndexError("a TokenFile slice takes every id (step 1)")
            return TokenFile(self.path, self.dtype, self.offset + start * self.dtype.itemsize,
                             max(stop - start, 0))
        if isinstance(index, (int, np.integer)):
            i = int(index) + (self.length if index < 0 else 0)
            return self.read(i, i + 1)[0]
        index = np.asarray(index)
        rows = index.reshape(-1, index.shape[-1]) if index.ndim else index.reshape(1, 1)
        n = rows.shape[1]
        if not rows.size:
            return np.zeros(index.shape, self.dtype)
        if not np.array_equal(rows, rows[:, :1] + np.arange(n)):
            return np.array([self[int(i)] for i in index.reshape(-1)],
                            dtype=self.dtype).reshape(index.shape)
        return np.stack([self.read(int(r), int(r) + n) for r in rows[:, 0]]).reshape(index.shape)

    def __array__(self, dtype=None, copy=None):
        out = self.read(0, self.length)
        return out if dtype is None else out.astype(dtype)

    def __del__(self):
        if self._fd is not None:
            os.close(self._fd)
