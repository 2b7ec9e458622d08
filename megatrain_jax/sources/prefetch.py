"""Batches read ahead on a thread, so the loader never bounds a step: while step k trains, the
windows of batch k + 1 (known in advance: the order is deterministic) are read from disk.

The dataset still takes each batch in the training loop's thread, in order, as without reading
ahead (its position, `state()`, is that of the batches taken): only the reads move to a thread,
and a read ahead is used only if the batch taken is the one it read for (else, after a restore or
a change of `share`, the batch is read there and then).
"""

from concurrent.futures import ThreadPoolExecutor


class ReadAhead:
    """`read(plan)` of the next batch's plan run on a thread while the current batch trains."""

    def __init__(self, read):
        self.read = read
        self.pool = None
        self.pending = None  # (key, future) of the read ahead

    def get(self, key, plan, next_key=None, next_plan=None):
        """read(plan), from the read ahead if it was for `key`; then starts reading next_plan
        (keyed next_key) on the thread, if given."""
        if self.pending is not None and self.pending[0] == key:
            out = self.pending[1].result()
        else:
            out = self.read(plan)
        self.pending = None
        if next_plan is not None:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="megatrain-data")
            self.pending = (next_key, self.pool.submit(self.read, next_plan))
        return out
