"""A picture of one or more runs from their metrics.jsonl: train and eval loss, and tokens/s,
against the step, runs overlaid (one colour each).

    plot_runs(["runs/tiny", "runs/tiny_bf16"], "runs.png")

matplotlib (the extra `plot`) with the Agg backend: no display needed.
"""

import json
import math
import os

from megatrain_jax.config import ConfigError


def read_metrics(run_dir: str) -> list[dict]:
    """The records of run_dir/metrics.jsonl by step (a step logged twice: the last); ConfigError
    naming the directory, or the file and line, when there is nothing to plot."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: not a directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir}: no metrics.jsonl (not a run directory, or no step has "
                          f"finished in it)")
    by_step = {}
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                step, loss = int(record["step"]), float(record["loss"])
            except (ValueError, KeyError, TypeError):
                if not text.endswith("\n"):  # a torn last line (a killed run): skipped
                    continue
                raise ConfigError(f"{path} line {number}: not a metrics record (a JSON object "
                                  f"with step and loss)") from None
            by_step[step] = {**record, "step": step, "loss": loss}
    if not by_step:
        raise ConfigError(f"{path}: no steps recorded")
    return [by_step[s] for s in sorted(by_step)]


def _series(records, key):
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def output_path(out: str, formats) -> str:
    """Where `--out out` writes: out itself, `out/metrics.png` for a directory, `out.png` when it
    has no suffix; ConfigError naming the suffixes `formats` (matplotlib's) when it has another."""
    if os.path.isdir(out):
        return os.path.join(out, "metrics.png")
    suffix = os.path.splitext(out)[1][1:].lower()
    if not suffix:
        return out + ".png"
    if suffix not in formats:
        raise ConfigError(f"--out {out}: cannot write a .{suffix} picture; the suffix picks the "
                          f"format, one of {', '.join('.' + f for f in sorted(formats))}")
    return out


def plot_runs(run_dirs, out: str) -> str:
    """Writes the picture `out` (a PNG unless its suffix says otherwise; see output_path) for
    run_dirs; returns the path written."""
    runs = [(d, read_metrics(d)) for d in run_dirs]  # every input checked before any drawing
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'megatrain-jax[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    out = output_path(out, FigureCanvasAgg.get_supported_filetypes())
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                            gridspec_kw={"height_ratios": [2, 1]})
    names = _names(run_dirs)
    for (run_dir, records), name, color in zip(runs, names, plt.rcParams["axes.prop_cycle"]
                                               .by_key()["color"] * len(runs)):
        loss_ax.plot(*_series(records, "loss"), color=color, alpha=0.35, linewidth=1)
        if any("loss_smooth" in r for r in records):
            loss_ax.plot(*_series(records, "loss_smooth"), color=color, label=f"{name} train")
        else:
            loss_ax.lines[-1].set(alpha=1, label=f"{name} train")
        steps, evals = _series(records, "eval_loss")
        if steps:
            loss_ax.plot(steps, evals, "o--", color=color, markersize=4, label=f"{name} eval")
        speed_ax.plot(*_series(records, "tokens_per_sec"), color=color, label=name)
    loss_ax.set_ylabel("loss (train: raw, faint; smoothed)")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    speed_ax.set_ylim(bottom=0)
    speed_ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def _names(run_dirs) -> list:
    """Short labels: each run directory's path, relative to where they all differ."""
    paths = [os.path.normpath(d) for d in run_dirs]
    if len(paths) == 1:
        return [os.path.basename(os.path.abspath(paths[0]))]
    common = os.path.commonpath([os.path.abspath(p) for p in paths])
    return [os.path.relpath(os.path.abspath(p), common) or p for p in paths]
