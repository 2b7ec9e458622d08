"""What the host lookup's backward costs the host thread, piece by piece (engine/lookup.py's
HostBackward._backward).

    python scripts/bench_lookup.py                        # bench_1b's table, 1 and 4 micro-batches
    python scripts/bench_lookup.py --config configs/llama3_8b.yaml model.hidden_size=1024 \
        --micro-batches 1 4 --json out.json

Builds the engine's own functions (DeviceFunctions, stage_units.gradient) for the config's first
stage (the embedding), on the CPU, and times each piece of the backward as HostBackward runs it,
with the table, the token ids and the rows' gradient of one step already on the host:

  zero       the fp32 accumulator of the table's gradient: last step's buffers cleared where
             they lie by the fused kernel's pool (lookup.TableGradient.zeros)
  scatter    each micro-batch's host_embed_bwd: acc + vjp(gather) with acc donated
  gradient   unit 0's gradient in train.grad_dtype (lookup.unit0_gradient in fp32: the
             accumulator's own buffer, donated; then TableGradient.cast: bf16 cast by the pool
             into a buffer kept from step to step)
  squares    its sum of squares (leaf_squares)

Alternatives, timed the same way (what the engine did before, not what it does):
`zero, fresh` is a new accumulator each step (jnp.zeros: its pages faulted in by one thread);
`gradient, a copy` is stage_units.gradient with the accumulator kept (fp32: a copy of it). And,
in the same run, a dense read and write of the accumulator (numpy copy between existing
buffers) as the yardstick: `dense passes` is a piece's time over that copy's. Page faults: minor
faults of the process during the piece. The compiled host_embed_bwd is checked for the scatter
and for its output aliasing the donated accumulator (in place), and whether it reads the table
at all (the vjp of a gather does not: XLA drops it). Times are medians of --reps.
"""

import argparse
import json
import resource
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--config", default="configs/bench_1b.yaml")
parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
parser.add_argument("--json", default="", help="also write the results here")
parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
args = parser.parse_args()

import jax  # noqa: E402  (after the arguments: --help stays quick)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from megatrain_jax.engine import fused_adamw, lookup, stage_units  # noqa: E402
from megatrain_jax.engine.functions import DeviceFunctions  # noqa: E402
from megatrain_jax.flops import abstract_units  # noqa: E402
from megatrain_jax.recipes import execution_for, load_config  # noqa: E402

cfg = load_config(args.config, args.overrides)
cpu = jax.devices("cpu")[0]
execution, _ = execution_for(cfg, "cpu")
stages_def, stages, block_def, _, _, parts = abstract_units(cfg.model, execution)
grad_dtype, compute = jnp.dtype(cfg.train.grad_dtype), jnp.dtype(cfg.train.compute_dtype)
f = DeviceFunctions(stages_def, jax.tree.structure(stages), parts, block_def, grad_dtype)
leaves = jax.tree.leaves(stages)
unit0 = stage_units.indices(stage_units.split(stages)[0])
held = tuple((i, tuple(leaves[i].shape)) for i in unit0)
why = lookup.serves(False, parts, unit0)
if why:
    print(f"{args.config}: the host lookup does not serve it: {why}", file=sys.stderr)
    sys.exit(2)
w = [jax.device_put(np.zeros(leaves[i].shape, compute), cpu) for i in parts.first]
table = sum(x.size for x in w)
B, T, H = cfg.data.batch_size, cfg.data.seq_len, cfg.model.hidden_size
rng = np.random.default_rng(0)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn):
    """(seconds, page faults, result) of fn() to completion."""
    f0, t0 = faults(), time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t0, faults() - f0, out


def zeros():
    return [jnp.zeros(x.shape, jnp.float32, device=cpu) for x in w]


ENGINE = ("zero", "scatter", "gradient", "squares")  # HostBackward's pieces, in its order


def hlo_check(x, dx) -> dict:
    """What the compiled host_embed_bwd does with the accumulator and the table: a scatter, its
    output aliasing an input (the donated accumulator), and whether the table is an input at all
    (the entry's inputs: the table and the accumulator share a shape)."""
    text = f.host_embed_bwd.lower(w, x, dx, zeros()).compile().as_text()
    layout = text[text.index("entry_computation_layout"):]
    inputs = layout[:layout.index("->")]
    dims = "[" + ",".join(map(str, w[0].shape)) + "]"
    return {"scatter": " scatter(" in text, "output_aliases_input": "input_output_alias" in text,
            "table_is_an_input": inputs.count(dims) > 1}


def run(M: int) -> dict:
    # the micro-batches stacked, as the engine hands them over (one call scatters them all)
    xs = jax.device_put(rng.integers(0, cfg.model.vocab_size, (M, B, T), np.int32), cpu)
    dxs = jax.device_put(rng.standard_normal((M, B, T, H), np.float32).astype(compute), cpu)
    kept = lookup.TableGradient(fused_adamw.kernel())  # the engine's buffers, step to step
    pieces = {"zero": [], "scatter": [], "gradient": [], "squares": [], "zero, fresh": [],
              "gradient, a copy": []}
    fault = {k: [] for k in pieces}
    # the yardstick: a dense read and write of the accumulator's bytes, between existing buffers
    src, dst = np.ones(table, np.float32), np.empty(table, np.float32)
    copies = []
    for rep in range(args.reps + 1):  # the first: compiles
        s, n, fresh = timed(zeros)
        pieces["zero, fresh"].append(s), fault["zero, fresh"].append(n)
        del fresh
        s, n, acc = timed(lambda: kept.zeros([x.shape for x in w], cpu))
        pieces["zero"].append(s), fault["zero"].append(n)
        s, n, acc = timed(lambda: f.host_embed_bwd(w, xs, dxs, acc))
        pieces["scatter"].append(s / M), fault["scatter"].append(n / M)
        s, n, copy = timed(lambda: stage_units.gradient(acc, [], parts.first, (), held,
                                                        grad_dtype, None))
        pieces["gradient, a copy"].append(s), fault["gradient, a copy"].append(n)
        del copy
        s, n, grads = timed(lambda: kept.cast(lookup.unit0_gradient(
            acc, parts.first, held, jnp.float32), grad_dtype))
        pieces["gradient"].append(s), fault["gradient"].append(n)
        s, n, _ = timed(lambda: f.leaf_squares(grads))
        pieces["squares"].append(s), fault["squares"].append(n)
        del acc, grads
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    copy_s = statistics.median(copies[1:])
    row = {"micro_batches": M, "rows_per_micro_batch": B * T, "dense_copy_s": copy_s,
           "dense_copy_gb_s": 8 * table / copy_s / 1e9, "pieces": {}}
    for k in pieces:
        s = statistics.median(pieces[k][1:])
        row["pieces"][k] = {"s": s, "dense_passes": s / copy_s,
                            "page_faults": statistics.median(fault[k][1:])}
    row["total_s"] = (sum(row["pieces"][k]["s"] for k in ENGINE)
                      + (M - 1) * row["pieces"]["scatter"]["s"])
    return row


x0 = jax.device_put(np.zeros((1, B, T), np.int32), cpu)
dx0 = jax.device_put(np.zeros((1, B, T, H), compute), cpu)
result = {"config": args.config, "overrides": args.overrides, "table": list(w[0].shape),
          "compute_dtype": str(compute), "grad_dtype": str(grad_dtype),
          "acc_bytes": 4 * table, "jax": jax.__version__, "hlo": hlo_check(x0, dx0),
          "runs": [run(M) for M in args.micro_batches]}

print(f"table {' x '.join(map(str, result['table']))} ({4 * table / 1e9:.3g} GB fp32), "
      f"{compute} rows, {grad_dtype} gradient; jax {jax.__version__}")
print(f"host_embed_bwd compiled: scatter {result['hlo']['scatter']}, output aliases an input "
      f"(the donated acc) {result['hlo']['output_aliases_input']}, reads the table "
      f"{result['hlo']['table_is_an_input']}")
print(f"{'micro-batches':>13} {'piece':<22}{'ms':>9} {'dense passes':>12} {'page faults':>12}")
for r in result["runs"]:
    for k, p in r["pieces"].items():
        label = k + (" (each)" if k == "scatter" else "")
        print(f"{r['micro_batches']:>13} {label:<22}{p['s'] * 1e3:>9.1f} {p['dense_passes']:>12.2f}"
              f" {p['page_faults']:>12,.0f}")
    print(f"{r['micro_batches']:>13} {'total (engine)':<22}{r['total_s'] * 1e3:>9.1f}   (dense read+write "
          f"of the acc: {r['dense_copy_s'] * 1e3:.1f} ms, {r['dense_copy_gb_s']:.1f} GB/s)")
if args.json:
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
