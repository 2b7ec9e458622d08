"""Regenerates the tables of docs/benchmarks.md from the JSON the benchmarks wrote (docs/results/).

    python scripts/results_tables.py            # rewrites every generated section in place
    python scripts/results_tables.py --check    # exit 1 if a section differs from its JSON

A generated section sits between two marker lines of the document:

    <!-- results_tables: NAME -->
    ...                              (written by this script: do not edit by hand)
    <!-- /results_tables -->

NAME is one of SECTIONS: `long_context_cpu` (docs/results/cpu_long_context_32k.json),
`plan_h100` (docs/results/plan_*_h100_host*gib.json), `step_time_h100`
(docs/results/step_time_*_h100_*k.json: `plan --step-time` predictions), `long_context_h100`
(docs/results/long_context_plan_*_h100_host*gib.json) and `gpu` (every folder
docs/results/<date>-<gpu>/ that a GPU checklist part's results were copied into: one table per kind
of result: bench.py, bench_transfer.py, bench_long_context.py, bench_optimizer.py, the step-time
prediction against the measurement, plan sweeps and the checklist's own step list).
"""

import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = re.compile(r"^<!-- results_tables: (\w+) -->$")
END = "<!-- /results_tables -->"
MODEL_NAMES = {"llama3_8b": "Llama-3-8B", "qwen2_5_7b": "Qwen2.5-7B"}  # config file -> model


def load(path):
    with open(path) as f:
        return json.load(f)


def gb(n, spec=".3g"):
    return "n/a" if n is None else f"{n / 1e9:{spec}}"


def table(head, rows, right=()) -> list:
    """A markdown table; the columns numbered in `right` are right-aligned."""
    line = lambda cells: re.sub(r"\|  (?=\|)", "| ", "| " + " | ".join(map(str, cells)) + " |")
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(head)))
    return [line(head), rule] + [line(row) for row in rows]


# ----------------------------------------------------------------------------- CPU sections
def long_context_cpu(results) -> list:
    r = load(os.path.join(results, "cpu_long_context_32k.json"))
    rss, run, plan, est = r["peak_rss_bytes"], r["run"], r["plan"], r["dense_estimate"]
    device = sum(plan["device"][plan["peak_phase"]].values())
    times = run["step_times_s"]
    temps = lambda fn: (f"**{gb(est['long_context'][fn]['temp_bytes'])} GB / "
                        f"{gb(est['dense'][fn]['temp_bytes'])} GB**")
    rows = [
        ("peak RSS: start / after the plan / after the engine / after "
         f"{len(times)} steps", " / ".join(gb(rss[k], ".3f") for k in
                                           ("start", "before_engine", "after_engine", "after_steps"))
         + " GB"),
        ("growth over the runtime (after the plan → after the steps)",
         f"{gb(rss['after_steps'] - rss['before_engine'], '.3f')} GB"),
        (f"the plan's prediction for the same (host {gb(plan['host_total'], '.3f')} + device "
         f"{gb(device, '.3f')}, one RAM here)", f"{gb(plan['host_total'] + device, '.3f')} GB"),
        ("step time (the first step compiles)",
         ", ".join(f"{t:.0f} s" for t in times) + f": {run['tokens_per_s']:.0f} tokens/s"),
        (f"losses (ln V = {math.log(r['config']['model']['vocab_size']):.4f} at random init)",
         ", ".join(f"{x:.4f}" for x in run["losses"])),
        (f"bytes host → device / device → host, {'both' if len(times) == 2 else 'all'} steps",
         f"{gb(run['bytes_h2d'])} / {gb(run['bytes_d2h'])} GB"),
        ("block backward, XLA temporaries (compiled, not run): long-context path / dense path",
         temps("block_bwd")),
        ("loss head, XLA temporaries: long-context path / dense path", temps("head")),
    ]
    return table(("figure", "value"), rows)


def _fits(row) -> str:
    m = row["machine"]
    short = [what for what, need, have in (("host", row["host_total"], m["host_memory_gb"]),
                                           ("device", row["device_peak"], m["device_memory_gb"]))
             if need > have * 1e9]
    return "yes" if row["fits"] else f"no ({' and '.join(short)})"


def plan_h100(results) -> list:
    files = glob.glob(os.path.join(results, "plan_*_h100_host*gib.json"))
    by_model = {}
    for f in files:
        model, host = re.match(r"plan_(\w+)_h100_host(\d+)gib\.json$", os.path.basename(f)).groups()
        by_model.setdefault(model, {})[int(host)] = load(f)
    hosts = sorted({h for sizes in by_model.values() for h in sizes})
    rows = []
    for model in sorted(by_model, key=_model_order):
        sizes = by_model[model]
        first = sizes[hosts[0]]
        for i, row in enumerate(first):
            params = row["host"]["master"] / 4 / 1e9
            name = f"{MODEL_NAMES.get(model, model)} ({params:.2f}B)" if i == 0 else ""
            rows.append((name, f"{row['seq_len']:,}", f"{gb(row['host_total'], '.2f')} GB",
                         f"{gb(row['device_peak'], '.2f')} GB ({row['peak_phase']})",
                         "on" if row["offload_activations"] else "off",
                         *(_fits(sizes[h][i]) for h in hosts)))
    return table(("model", "tokens", "host RAM", "device peak (phase)", "offload (auto)",
                  *(f"fits {h} GiB host" for h in hosts)), rows, right=(1, 2, 3))


def step_time_h100(results) -> list:
    """One row per `plan --step-time --json` prediction: config, tokens a step, where the first
    stage runs (on the host: the host lookup), the form of the layers' copies (offload.copies as
    the engine resolves it), the step, MFU of the datasheet peak, what bounds it and the host
    update exposed on its critical path."""
    rows = []
    for f in glob.glob(os.path.join(results, "step_time_*_h100_*k.json")):
        config = re.match(r"step_time_(\w+)_h100_\d+k\.json$", os.path.basename(f)).group(1)
        r = load(f)
        shape, critical = r["shape"], r["critical_path_s"]
        seq = shape["tokens_per_step"] // shape["micro_batches"]
        rows.append(((config, shape["tokens_per_step"]), (
            config, f"{shape['tokens_per_step']:,}", f"{seq:,} x {shape['micro_batches']}",
            "host lookup" if shape.get("rows_bytes") else "device",
            "in the jitted calls" if shape.get("copies") == "jit" else "eager",
            f"{r['step_s']:.3g} s", _pct(r["mfu_vs_datasheet"]), r["bound"],
            f"{critical['host update']:.3g} s ({critical['host update'] / r['step_s']:.0%})",
            f"{r['busy_s']['device'] / r['step_s']:.0%}")))
    return table(("config", "tokens a step", "tokens x micro-batches", "first stage",
                  "layers' copies", "predicted step", "MFU (989 TFLOP/s)", "bound by",
                  "exposed host update", "device busy"), [row for _, row in sorted(rows)],
                 right=(1, 5, 6, 8, 9))


KINDS = ("inputs", "weights", "gradients", "activations", "cotangents", "workspace")


def _model_order(model):
    return (model not in MODEL_NAMES, list(MODEL_NAMES).index(model) if model in MODEL_NAMES
            else model)


def long_context_h100(results) -> list:
    """The plan of each model at long sequences with the block tiled over the sequence
    (docs/results/long_context_plan_<model>_h100_host<N>gib.json: a --sweep), and the largest
    sequence that fits."""
    pattern = re.compile(r"long_context_plan_(\w+)_h100_host(\d+)gib\.json$")
    files = sorted(glob.glob(os.path.join(results, "long_context_plan_*_h100_host*gib.json")))
    by_model = {pattern.match(os.path.basename(f)).group(1): load(f) for f in files}
    rows, largest = [], []
    for model in sorted(by_model, key=_model_order):
        name = MODEL_NAMES.get(model, model)
        for i, row in enumerate(by_model[model]):
            kinds = row["device"][row["peak_phase"]]
            both = (f"{gb(row['workspace_cpu_compiled']['backward'], '.2f')} / "
                    f"{gb(row['workspace']['backward'], '.2f')}")
            rows.append((name if i == 0 else "", f"{row['seq_len']:,}",
                         f"{gb(row['device_peak'], '.2f')} ({row['peak_phase']})",
                         *(gb(kinds[k], ".2f") for k in KINDS), both,
                         f"{gb(row['host_total'], '.1f')} ({gb(row['host']['activations'], '.1f')})",
                         _fits(row)))
        largest.append(f"{name} {by_model[model][0]['largest_seq_len']:,} tokens")
    head = ("model", "tokens", "device peak GB (phase)", *(f"{k} GB" for k in KINDS),
            "block backward workspace GB, XLA:CPU / bf16 estimate", "host RAM GB (activations)",
            "fits")
    return table(head, rows, right=tuple(range(1, 11))) + [
        "", "Largest sequence that fits (the plan's search, compiled at each length it tries, "
        "within 2%): " + "; ".join(largest) + "."]


# ----------------------------------------------------------------------------- GPU results
def _pct(x):
    return "n/a" if x is None else f"{x:.1%}"


def _num(x, spec=".3g"):
    return "n/a" if x is None else format(x, spec)


def train_rows(items) -> list:
    rows = []
    for name, r in items:
        s = r["streamed"]
        vs = lambda b: (f"{s[f'throughput_vs_{b}']:.2f}x" if f"throughput_vs_{b}" in s else
                        r["baselines"].get(b, {}).get("skipped", "not run"))
        overrides = " ".join(a for a in r.get("command", "").split()
                             if "=" in a and not a.startswith("-")) or "none"
        rows.append((name, r.get("config_file"), overrides, s.get("copies", "eager"),
                     f"{r['tokens_per_step']:,}",
                     f"{s['tokens_per_s']:,.0f}", f"{s['step_s'] * 1e3:,.0f}",
                     _pct(s.get("mfu_vs_measured")), _pct(s.get("mfu_vs_datasheet")),
                     _num(s.get("h2d_gb_per_s")), _num(s.get("d2h_gb_per_s")),
                     f"{s['host_update_s_per_step']:.3f} / {s['host_exposed_s_per_step']:.3f}",
                     _pct(s.get("device_busy")), _num(s.get("device_peak_gb")),
                     vs("resident"), vs("offload")))
    return table(("file", "config", "overrides", "copies", "tokens/step", "tokens/s", "ms/step",
                  "MFU (measured matmul)",
                  "MFU (datasheet)", "H2D GB/s", "D2H GB/s", "host update / exposed s",
                  "device busy", "device peak GB", "vs resident", "vs offload"), rows)


def transfer_rows(items) -> list:
    out = []
    for name, r in items:
        overlap = r.get("overlap", {}).get("paths", {})
        rows = [(p["path"], _num(p.get("gb_per_s")),
                 _num(overlap.get(p["path"], {}).get("overlap"), ".2f")) for p in r["paths"]]
        out += [f"{name}: {gb(r['buffer_bytes'])} GB buffer", ""]
        out += table(("path", "GB/s", "overlap with a matmul"), rows) + [""]
    return out[:-1]


def long_context_rows(items) -> list:
    rows = []
    for name, r in items:
        run, plan = r["run"], r["plan"]
        rows.append((name, f"{r['tokens_per_step']:,}", r["config"]["train"]["attention"],
                     ", ".join(f"{t:.2f}" for t in run["step_times_s"]),
                     f"{run['tokens_per_s']:,.0f}", _num(run.get("model_tflops")),
                     gb(run.get("device_peak_bytes"), ".2f"), gb(plan["device_peak"], ".2f")))
    return table(("file", "tokens/step", "attention", "step s", "tokens/s", "model TFLOP/s",
                  "device peak GB", "plan's device peak GB"), rows)


def optimizer_rows(items) -> list:
    """bench_optimizer.py's table: the engine's update beside torch's AdamW and a copy, per
    thread count."""
    rows = [(name, "kernel" if r.get("native_kernel") else "optax" if r.get("optax") else "JAX",
             "on" if r.get("clip") else "off", f"{r['params'] / 1e6:,.0f}M", t["measurement"],
             t["threads"], f"{t['ms']:,.1f}", f"{t['gb_s']:.2f}", t["page_faults"])
            for name, r in items for t in r["table"]]
    return table(("file", "engine path", "clip", "params", "measurement", "threads", "ms",
                  "GB/s", "page faults"), rows, right=(5, 6, 7, 8))


def step_time_rows(items) -> list:
    rows = []
    for name, r in items:
        c = r.get("compare", {})
        c = c and {"measured": {"step_s": c["measured"]["step_s"]},
                   "predicted_over_measured": c["predicted_over_measured"]}
        crit = r["critical_path_s"]
        path = ", ".join(f"{k} {v / r['step_s']:.0%}" for k, v in
                         sorted(crit.items(), key=lambda kv: -kv[1]) if v / r["step_s"] >= 0.01)
        rows.append((name, f"{r['step_s'] * 1e3:,.1f}",
                     f"{c['measured']['step_s'] * 1e3:,.1f}" if c else "n/a",
                     f"{c['predicted_over_measured']:.2f}" if c else "n/a", r["bound"], path))
    return table(("file", "predicted ms/step", "measured ms/step", "predicted / measured",
                  "bound by", "critical path"), rows)


def plan_rows(items) -> list:
    rows = [(name, f"{p['seq_len']:,}", f"{gb(p['host_total'], '.2f')} GB",
             f"{gb(p['device_peak'], '.2f')} GB", p["peak_phase"],
             "on" if p["offload_activations"] else "off", "yes" if p["fits"] else "no")
            for name, r in items for p in r]
    return table(("file", "seq_len", "host total", "device peak", "peak phase", "offload", "fits"),
                 rows)


def checklist_rows(items) -> list:
    rows = [(name, s["name"], s.get("skipped") and f"skipped: {s['skipped']}" or
             f"exit {s['rc']}" + (" (timed out)" if s.get("timed_out") else ""),
             s.get("seconds", ""), s.get("timeout_s", "")) for name, r in items for s in r["steps"]]
    return table(("file", "step", "status", "seconds", "timeout s"), rows)


def kind(r) -> str:
    if isinstance(r, list):
        return "plan"
    if "update_gb_s" in r:
        return "optimizer"
    return r.get("kind", "unknown")


# kind -> (title, table rows)
GPU_KINDS = {"train": ("Training throughput (scripts/bench.py)", train_rows),
             "step_time": ("Step time: the plan's prediction from the measured rates",
                           step_time_rows),
             "transfer": ("Transfer paths (scripts/bench_transfer.py)", transfer_rows),
             "long_context": ("Long context (scripts/bench_long_context.py)", long_context_rows),
             "optimizer": ("Host update (scripts/bench_optimizer.py)", optimizer_rows),
             "plan": ("The plan compiled on the machine (scripts/plan.py --sweep)", plan_rows),
             "gpu_checklist": ("The checklist's steps", checklist_rows)}


def render_folder(folder) -> list:
    """The tables of one folder of a GPU run's results."""
    items = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        r = load(f)
        items.setdefault(kind(r), []).append((os.path.basename(f), r))
    facts = next((r for name, r in items.get("train", []) + items.get("transfer", [])
                  + items.get("long_context", [])), {})
    lines = [f"#### {os.path.basename(os.path.normpath(folder))}", ""]
    if facts:
        lines += [f"{facts.get('device_kind')}, jax {facts.get('jax')}, {facts.get('date')}.", ""]
    for k, (title, rows) in GPU_KINDS.items():
        if k in items:
            lines += [f"{title}:", "", *rows(items[k]), ""]
    return lines[:-1]


def gpu(results) -> list:
    folders = sorted(d for d in glob.glob(os.path.join(results, "*", "")) if os.path.isdir(d))
    if not folders:
        return ["No GPU results are committed yet (docs/results/<date>-<gpu>/ holds them)."]
    lines = []
    for folder in folders:
        lines += render_folder(folder) + [""]
    return lines[:-1]


SECTIONS = {"long_context_cpu": long_context_cpu, "plan_h100": plan_h100,
            "step_time_h100": step_time_h100, "long_context_h100": long_context_h100, "gpu": gpu}


def render(text: str, results: str) -> str:
    """`text` with every generated section rewritten from the JSON in `results`."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = BEGIN.match(lines[i])
        i += 1
        if not m:
            continue
        if m.group(1) not in SECTIONS:
            raise ValueError(f"line {i}: unknown section {m.group(1)!r} "
                             f"(known: {', '.join(SECTIONS)})")
        end = next((j for j in range(i, len(lines)) if lines[j] == END), None)
        if end is None:
            raise ValueError(f"line {i}: section {m.group(1)!r} has no {END!r}")
        out += SECTIONS[m.group(1)](results)
        i = end
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    p.add_argument("--results", default=os.path.join(ROOT, "docs", "results"))
    p.add_argument("--check", action="store_true", help="exit 1 if the document is stale")
    args = p.parse_args(argv)
    with open(args.doc) as f:
        text = f.read()
    try:
        new = render(text, args.results)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {args.doc}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"{args.doc} is stale: run python scripts/results_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(args.doc, "w") as f:
            f.write(new)
        print(f"rewrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
