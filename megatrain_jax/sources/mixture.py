"""A weighted mixture of token streams: each window of a batch comes from a source drawn by
weight, deterministic and resumable.

Each source has a number, its place in data.sources when the run started. Batch b draws the
source of each of its windows with default_rng((seed, b)) over the sources in the order of their
numbers; a source hands out its windows in the order default_rng((seed, number, epoch)).permutation,
epoch after epoch, so a small source repeats while a large one is still in its first epoch. The
position (`state()`) is plain data keyed by each source's name (its path): the batch count, and
each source's number, epoch, index and the tokens it gave. So a resume with data.sources listed in
another order continues every source where it was, drawing as before; a source added on resume
(checkpoint.allow_changes) takes the next free number and starts at its beginning.
"""

import numpy as np

from megatrain_jax.data import DataError, document_context, share_of_batch


class _Windows:
    """The windows of one source, handed out n at a time across epochs."""

    def __init__(self, tokens, seq_len: int, seed: int, source: int, name: str):
        self.tokens, self.seq_len, self.seed, self.source = tokens, seq_len, seed, source
        self.name = name
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"{name}: {len(tokens):,} tokens make no window of "
                            f"data.seq_len={seq_len} tokens; use more data or lower data.seq_len")
        self._perms = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perms.get(epoch) is None:  # the last two epochs' are kept
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = np.random.default_rng((self.seed, self.source, epoch)).permutation(
                self.num_windows)
        return self._perms[epoch]

    def check(self, epoch: int, index: int):
        if epoch < 0 or not 0 <= index <= self.num_windows:
            raise DataError(f"bad data state (epoch {epoch}, index {index}) for {self.name}, a "
                            f"source of {self.num_windows} windows")

    def renumber(self, source: int):
        """The source's number (its window order's seed) becomes `source`."""
        if source != self.source:
            self.source, self._perms = source, {}

    def take(self, epoch: int, index: int, n: int) -> tuple:
        """(the n windows from position (epoch, index), the position after them)."""
        out = [np.zeros(0, np.int64)]
        while n:
            if index == self.num_windows:
                epoch, index = epoch + 1, 0
            got = self.permutation(epoch)[index:index + n]
            index += len(got)
            n -= len(got)
            out.append(got)
        return np.concatenate(out), (epoch, index)

    def read(self, windows) -> np.ndarray:
        idx = (np.asarray(windows) * self.seq_len)[:, None] + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[idx]).astype(np.int32)


class MixtureDataset:
    """Batches as data.PackedDataset's (same shapes, same next_batch_with_context), each window
    from one of `streams` (1-D token arrays on disk) drawn with probability weight / sum."""

    summary = ""  # what the data is, for the run's log

    def __init__(self, streams: list, weights: list, names: list, *, seq_len: int, batch_size: int,
                 seed: int, num_micro_batches: int = 1, eos_id: int | None = None,
                 document_mask: bool = False):
        self.names, self.seed = list(names), int(seed)
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.num_micro_batches, self.eos_id = int(num_micro_batches), eos_id
        self.document_mask = document_mask
        self.windows_per_batch = self.batch_size * self.num_micro_batches
        if len(set(self.names)) != len(self.names):
            twice = next(n for n in self.names if self.names.count(n) > 1)
            raise DataError(f"a mixture's sources are known by their names, and {twice!r} "
                            f"names two")
        weights = np.asarray(weights, dtype=np.float64)
        self.probabilities = weights / weights.sum()
        self.sources = [_Windows(t, self.seq_len, self.seed, s, n)
                        for s, (t, n) in enumerate(zip(streams, names))]
        self.share = (0, 1)  # as PackedDataset's: this process's part of each micro-batch's rows
        self.read_ahead = None  # sources.prefetch.ReadAhead: the next batch read on a thread
        self._last_plan = None  # (key, plan) of planned()
        n = len(streams)
        self.restore({"batch": 0, "sources": self.names, "numbers": list(range(n)),
                      "epochs": [0] * n, "indices": [0] * n, "tokens": [0] * n})

    @property
    def tokens_per_batch(self) -> int:
        return self.windows_per_batch * self.seq_len

    def planned(self, batch: int, positions: list) -> tuple:
        """(key, plan(batch, positions)): the last plan made is kept, so the batch read ahead is
        not planned again when it is taken. key: the batch, positions and share it is of."""
        key = (batch, tuple(positions), self.share, tuple(self.draw_order))
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, self.plan(batch, positions))
        return self._last_plan

    def plan(self, batch: int, positions: list) -> tuple:
        """(plan of batch `batch` from the sources' `positions`, their positions after it, the
        windows each source gives). plan: (this process's slots, [(source, slots, windows)])."""
        rng = np.random.default_rng((self.seed, batch))
        chosen = self.draw_order[rng.choice(len(self.sources), size=self.windows_per_batch,
                                            p=self.probabilities[self.draw_order])]
        mine = share_of_batch(np.arange(self.windows_per_batch), self.num_micro_batches,
                              self.share)
        reads, after, counts = [], [], []
        for s, (source, position) in enumerate(zip(self.sources, positions)):
            slots = np.flatnonzero(chosen == s)
            taken, position = source.take(*position, len(slots))  # every process takes all
            keep = np.isin(slots, mine)
            reads.append((s, slots[keep], taken[keep]))
            after.append(position)
            counts.append(len(slots))
        return (mine, reads), after, counts

    def read_windows(self, plan) -> np.ndarray:
        mine, reads = plan
        windows = np.empty((self.windows_per_batch, self.seq_len + 1), np.int32)
        for s, slots, taken in reads:
            windows[slots] = self.sources[s].read(taken)
        return windows[mine]

    def next_batch(self):
        """(inputs, targets), int32 (num_micro_batches, rows, seq_len): this process's rows."""
        key, (plan, self.positions, counts) = self.planned(self.batch, self.positions)
        self.tokens_given = [t + n * self.seq_len for t, n in zip(self.tokens_given, counts)]
        self.batch += 1
        if self.read_ahead is None:
            windows = self.read_windows(plan)
        else:  # the batch after this one is read on a thread while this one trains
            next_key, (next_plan, _, _) = self.planned(self.batch, self.positions)
            windows = self.read_ahead.get(key, plan, next_key, next_plan)
        windows = windows.reshape(self.num_micro_batches, -1, self.seq_len + 1)
        return np.ascontiguousarray(windows[..., :-1]), np.ascontiguousarray(windows[..., 1:])

    def next_batch_with_context(self):
        inputs, targets = self.next_batch()
        if not self.document_mask:
            return inputs, targets, None
        return inputs, targets, document_context(inputs, self.eos_id)

    def state(self) -> dict:
        """The position, each list in data.sources' order: "sources" names them."""
        return {"batch": int(self.batch), "sources": list(self.names),
                "numbers": [int(s.source) for s in self.sources],
                "epochs": [int(e) for e, _ in self.positions],
                "indices": [int(i) for _, i in self.positions],
                "tokens": [int(t) for t in self.tokens_given]}

    def restore(self, state: dict):
        """Continues from `state` (state()'s, in any order of the sources): each source known to
        it where it was, a source it does not name from its start with the next free number.
        A state without "sources" (written before the sources were named) is taken in
        data.sources' order."""
        saved = _saved_sources(state, self.names)
        free = max((number for number, _, _ in saved.values()), default=-1) + 1
        positions, tokens = [], []
        for source in self.sources:
            if source.name in saved:
                number, position, given = saved[source.name]
                source.check(*position)
            else:
                number, position, given, free = free, (0, 0), 0, free + 1
            source.renumber(number)
            positions.append(position)
            tokens.append(given)
        self.draw_order = np.argsort([s.source for s in self.sources], kind="stable")
        self.batch, self.positions, self.tokens_given = int(state["batch"]), positions, tokens
        self._last_plan = None

    def report(self) -> str:
        """The tokens each source gave so far (training batches, every process's rows)."""
        total = max(sum(self.tokens_given), 1)
        return "data mixture: " + "; ".join(
            f"{name}: {t:,} tokens ({t / total:.1%}, weight {p:.1%})"
            for name, t, p in zip(self.names, self.tokens_given, self.probabilities))


def _saved_sources(state: dict, names: list) -> dict:
    """{name: (number, (epoch, index), tokens)} of a mixture's state. Raises DataError for a
    state that is not one (`names`: this mixture's sources, in data.sources' order)."""
    bad = DataError(f"bad data state {state!r} for a mixture of {len(names)} sources")
    if not isinstance(state, dict):
        raise bad
    named = "sources" in state
    try:
        columns = [list(state[k]) for k in ("epochs", "indices", "tokens")]
        listed = [str(n) for n in state["sources"]] if named else list(names)
        numbers = list(state["numbers"]) if named else list(range(len(columns[0])))
        rows = [(int(n), (int(e), int(i)), int(t))
                for n, e, i, t in zip(numbers, *columns, strict=True)]
        ok = int(state["batch"]) >= 0 and len(set(listed)) == len(listed) == len(rows) \
            and len({n for n, _, _ in rows}) == len(rows)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok and not named and isinstance(state.get("epochs"), list):
        raise DataError(f"bad data state {state!r}: written before checkpoints named the "
                        f"sources, it resumes only with the data.sources it had "
                        f"({len(state['epochs'])}), in their order")
    if not ok:
        raise bad
    return dict(zip(listed, rows))
