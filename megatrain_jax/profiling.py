"""The dispatching thread's costliest functions over some steps (cProfile), for the benchmarks'
`--profile-main`: where a step's time goes on the thread that dispatches it, when it is neither
waiting for the device nor for host updates (stream.Counters counts those)."""

import contextlib
import cProfile
import os
import pstats


class MainThreadProfile:
    """`with profile.steps():` around each profiled step; then `costliest(steps)`. cProfile
    slows the thread it profiles: profile separate steps from the ones timed for a figure."""

    def __init__(self):
        self.profiler = cProfile.Profile()

    @contextlib.contextmanager
    def steps(self):
        self.profiler.enable()
        try:
            yield
        finally:
            self.profiler.disable()

    def costliest(self, steps: int, k: int = 25) -> list:
        """The k functions with the most own time: [{function, calls_per_step, own_s_per_step,
        cumulative_s_per_step}], most first."""
        stats = pstats.Stats(self.profiler).stats  # {(file, line, name): (cc, nc, tt, ct, ...)}
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:k]
        return [{"function": f"{os.path.basename(f)}:{line}({name})",
                 "calls_per_step": nc / steps, "own_s_per_step": tt / steps,
                 "cumulative_s_per_step": ct / steps}
                for (f, line, name), (_, nc, tt, ct, _) in rows]


def format_rows(rows: list) -> list:
    """The table's lines for `costliest`'s rows."""
    return [f"  {r['own_s_per_step'] * 1e3:9.2f} ms {r['cumulative_s_per_step'] * 1e3:9.2f} ms "
            f"{r['calls_per_step']:7.0f}  {r['function']}" for r in rows]
