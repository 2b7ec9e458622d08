"""What a run shows while it trains: each step's figures beyond its loss (smoothed loss, tokens/s,
MFU, device memory, host RSS, elapsed and ETA), as plain lines, and on a terminal a live progress
bar (rich) under them.

    meter = Meter(total_steps=150, start_step=0, tokens_per_step=2048,
                  flops_per_token=flops.flops_per_token(cfg.model, 128), peak_flops=989e12)
    with LiveDisplay(console, total_steps=150, start_step=0) as live:   # on a terminal
        for step in ...:
            record = {"step": step, "loss": loss, ..., **meter.measure(step, loss, dt)}
            live.update(record)
            if step % log_every == 0:
                print(line(record, total_steps=150))

Every figure is in the record, so metrics.jsonl, TensorBoard and the lines show the same numbers.
"""

import math
import time

from megatrain_jax import hostmem

GB = 1e9


def device_memory(device) -> dict:
    """{"device_bytes_in_use", "device_peak_bytes", "device_bytes_limit"} from
    device.memory_stats(), or {} where the device reports none (a CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory stats raises instead of returning None
        return {}
    names = {"bytes_in_use": "device_bytes_in_use", "peak_bytes_in_use": "device_peak_bytes",
             "bytes_limit": "device_bytes_limit"}
    return {ours: int(stats[theirs]) for theirs, ours in names.items() if theirs in stats}


def host_rss() -> int | None:
    """This process's resident host memory in bytes, or None where /proc is not there."""
    try:
        return hostmem.rss_bytes()
    except (OSError, KeyError):
        return None


class Meter:
    """The figures of each step of a run beyond its loss, from the step's own time:

        tokens        tokens trained so far (the run's, not only this process's)
        loss_smooth   exponential average of the finite losses (debiased; ~10 steps)
        mfu           model FLOPs per second (flops_per_token * tokens/s) over peak_flops; only
                      with a peak (a known device or logging.peak_tflops)
        elapsed_s     since this process's first step began
        eta_s         the steps left at this process's mean time per step after its first one
                      (which compiles), evaluations and checkpoints included
        device_*      device.memory_stats(): bytes in use now, the peak, the limit (not on a CPU)
        host_rss_bytes
    """

    SMOOTHING = 0.9  # weight of the past in loss_smooth

    def __init__(self, *, total_steps: int, start_step: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops: float | None, device=None,
                 clock=time.perf_counter, smoothing: dict | None = None):
        """`smoothing`: a `smoothing()` of the run's meter at start_step (a resumed run goes on
        with it, so its loss_smooth equals an uninterrupted run's)."""
        self.total, self.start = total_steps, start_step
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops, self.device, self.clock = peak_flops, device, clock
        self.began = clock()
        self._first_done = None  # when this process's first step ended
        smoothing = smoothing or {}
        self._average, self._weight = smoothing.get("average", 0.0), smoothing.get("weight", 0.0)

    def smoothing(self) -> dict:
        """loss_smooth's running sums, JSON-able: a checkpoint's, for Meter(smoothing=...)."""
        return {"average": self._average, "weight": self._weight}

    def measure(self, step: int, loss: float, step_time_s: float) -> dict:
        now = self.clock()
        done = step - self.start
        if done == 1:
            self._first_done = now
        if math.isfinite(loss):
            self._average = self.SMOOTHING * self._average + (1 - self.SMOOTHING) * loss
            self._weight = self.SMOOTHING * self._weight + (1 - self.SMOOTHING)
        per_step = ((now - self._first_done) / (done - 1) if done > 1
                    else now - self.began)
        out = {"tokens": step * self.tokens_per_step,
               "loss_smooth": self._average / self._weight if self._weight else math.nan,
               "elapsed_s": now - self.began, "eta_s": max(self.total - step, 0) * per_step}
        if self.peak_flops and step_time_s > 0:
            out["mfu"] = self.flops_per_token * self.tokens_per_step / step_time_s / self.peak_flops
        if self.device is not None:
            out.update(device_memory(self.device))
        rss = host_rss()
        if rss is not None:
            out["host_rss_bytes"] = rss
        return out


def format_duration(seconds: float) -> str:
    """1:05 (m:ss), 2:03:04 (h:mm:ss); "?" when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _figures(record: dict) -> list:
    """The fields the line and the live display share, formatted, in order."""
    parts = []
    if "loss_smooth" in record:
        parts.append(f"smoothed {record['loss_smooth']:.4f}")
    if "reward_accuracy" in record:  # preference training (dpo.step_metrics)
        parts.append(f"reward acc {record['reward_accuracy']:.2f} margin "
                     f"{record['reward_margin']:.3f} | logps chosen {record['logps_chosen']:.2f} "
                     f"rejected {record['logps_rejected']:.2f}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.1%}")
    if "device_bytes_in_use" in record:
        peak = record.get("device_peak_bytes")
        parts.append(f"device {record['device_bytes_in_use'] / GB:.2f} GB"
                     + (f" (peak {peak / GB:.2f})" if peak is not None else ""))
    if "host_rss_bytes" in record:
        parts.append(f"RSS {record['host_rss_bytes'] / GB:.2f} GB")
    return parts


def line(record: dict, *, total_steps: int) -> str:
    """The plain line of a step: `step    10 | loss 3.7536 | grad norm 1.761 | 3,367 tok/s |
    608 ms | smoothed 3.9120 | lr 3.00e-03 | MFU 31.2% | device 1.20 GB (peak 3.40) | RSS 0.41 GB
    | 10/150, 0:06 elapsed, ETA 1:25`."""
    head = (f"step {record['step']:5d} | loss {record['loss']:.4f} | grad norm "
            f"{record['grad_norm']:.3f} | {record['tokens_per_sec']:,.0f} tok/s | "
            f"{record['step_time_s'] * 1000:.0f} ms")
    when = f"{record['step']}/{total_steps}"
    if "elapsed_s" in record:
        when += (f", {format_duration(record['elapsed_s'])} elapsed, "
                 f"ETA {format_duration(record['eta_s'])}")
    return " | ".join([head, *_figures(record), when])


def status(record: dict) -> str:
    """The live display's text beside its bar: ETA, smoothed loss, tokens/s and the rest."""
    parts = [f"ETA {format_duration(record.get('eta_s', math.nan))}",
             f"loss {record.get('loss_smooth', record['loss']):.4f}",
             f"{record['tokens_per_sec']:,.0f} tok/s"]
    parts += [p for p in _figures(record) if not p.startswith("smoothed")]
    return " | ".join(parts)


class LiveDisplay:
    """A progress bar redrawn in place on a terminal: step/total, elapsed (ticking), and the last
    step's status(). What the run prints meanwhile (its log lines) scrolls above it: rich
    redirects stdout and stderr while it is shown. A context manager; the last state stays on
    screen when it closes."""

    def __init__(self, console, *, total_steps: int, start_step: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        from rich.table import Column
        self.progress = Progress(
            TextColumn("step", markup=False), MofNCompleteColumn(), BarColumn(bar_width=24),
            TimeElapsedColumn(),
            # the figures wrap on a narrow terminal, rather than squeezing the bar and the time
            TextColumn("{task.fields[status]}", markup=False,
                       table_column=Column(no_wrap=False, overflow="fold")),
            console=console, refresh_per_second=4)
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                           status="the first step compiles")

    def __enter__(self):
        self.progress.start()
        return self

    def update(self, record: dict):
        self.progress.update(self.task, completed=record["step"], status=status(record))

    def __exit__(self, *exc):
        self.progress.stop()
