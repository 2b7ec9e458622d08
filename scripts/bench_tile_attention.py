"""One layer's backward (the block recomputed, then its VJP) of a block tiled over the sequence,
for each way a tiled block can attend, against the block untiled with cuDNN attention: the
figures attention.MEASURED takes, from which the rule (attention.choose_attention) chooses.

    PYTHONPATH=. python3 scripts/bench_tile_attention.py --json out.json   # on a GPU
    PYTHONPATH=. python3 scripts/bench_tile_attention.py --config configs/tiny.yaml \\
        --seq-len 256 --tile-size 64 --blocks 16,32 --reps 1                # any machine

The layer is the config's (default Llama-3-8B's) in --dtype (bf16), at --seq-len tokens (32,768)
in tiles of --tile-size (8,192). Candidates, named as attention.MEASURED names them:
`blockwise/<block>` (blockwise flash attention per query tile, each of --blocks), `merged` (per
query tile, cuDNN on the keys before the tile and on its own, merged by their log-sum-exps) and
`untiled` (cuDNN over the whole sequence, the MLP in tiles); the reference `reference` is the
block untiled with cuDNN attention. Where cuDNN cannot run (not a GPU) XLA's
dot_product_attention stands in for it, and the JSON says so: the figures then say nothing of
cuDNN, only that every path runs.

Each candidate: its compile time, its calls' times (--reps, after one untimed call) and their
median, and the largest difference of its dx and of its weights' gradient from the reference's,
relative to the reference's largest entry (bf16 rounding is ~4e-3; the merged candidate's bf16
log-sum-exps show there). A candidate that fails records its error and the next one runs. The
JSON (--json) is rewritten after each candidate, so a run cut short keeps what it measured; it
records what this jax's dot_product_attention offers (return_residual, key_value_seq_lengths,
query_seq_offsets) and `measured`, the medians as attention.MEASURED takes them.
"""

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/llama3_8b.yaml", help="YAML config of the model")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--tile-size", type=int, default=8192)
    p.add_argument("--blocks", default="512,1024,2048", help="blockwise's blocks, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--reps", type=int, default=3, help="timed calls of each candidate")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",") if b]
    except ValueError:
        p.error(f"--blocks: comma-separated integers, got {args.blocks!r}")
    bad = [b for b in args.blocks if b < 1 or args.tile_size % b]
    if bad or args.tile_size < 1 or args.seq_len <= args.tile_size or args.reps < 1:
        p.error(f"--tile-size ({args.tile_size}) must be below --seq-len ({args.seq_len}) and a "
                f"multiple of every block of --blocks ({bad[0] if bad else args.blocks}); "
                f"--reps >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatrain_jax.cli import run_cli
    return run_cli(lambda: bench(args))


def candidates(args, cudnn: str) -> dict:
    """Name -> Execution; `cudnn` the implementation that runs for cuDNN ("cudnn", or "xla"
    standing in)."""
    from megatrain_jax.model import Execution
    tile = args.tile_size
    runs = {"reference": Execution(attention=cudnn)}
    runs.update({f"blockwise/{b}": Execution(attention="blockwise", attention_block=b,
                                             tile_size=tile) for b in args.blocks})
    runs["merged"] = Execution(attention=cudnn, tile_size=tile, tile_attention="merged")
    runs["untiled"] = Execution(attention=cudnn, tile_size=tile, tile_attention="untiled")
    return runs


def bench(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from megatrain_jax.attention import merge_supported, query_offsets_supported
    from megatrain_jax.model import make_block
    from megatrain_jax.recipes import load_config

    cfg = load_config(args.config, ["model.num_layers=1", *args.overrides]).model
    dev = jax.devices()[0]
    cudnn = "cudnn" if dev.platform == "gpu" else "xla"
    dtype = jnp.dtype(args.dtype)
    params = inspect_params(jax)
    record = {"kind": "tile_attention", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "command": " ".join([sys.executable, *sys.argv]), "jax": jax.__version__,
              "device_kind": dev.device_kind, "platform": dev.platform,
              "cudnn_stands_in": None if cudnn == "cudnn" else "XLA's dot_product_attention",
              "dot_product_attention": params, "merge_supported": merge_supported() or "yes",
              "query_offsets": query_offsets_supported() or "yes",
              "shape": {"seq_len": args.seq_len, "tile_size": args.tile_size,
                        "dtype": dtype.name, "hidden_size": cfg.hidden_size,
                        "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                        "head_dim": cfg.head_size, "intermediate_size": cfg.intermediate_size},
              "candidates": {}, "measured": {}}
    print(f"{dev.device_kind} ({dev.platform}) | jax {jax.__version__} | one layer, "
          f"{args.seq_len:,} tokens in tiles of {args.tile_size:,}, {dtype.name}"
          + ("" if cudnn == "cudnn" else " | XLA's attention stands in for cuDNN"), flush=True)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, args.seq_len, cfg.hidden_size)), dtype)
    dy = jnp.asarray(rng.standard_normal(x.shape), dtype)
    reference = None
    for name, execution in candidates(args, cudnn).items():
        out = record["candidates"][name] = {"attention": execution.attention_at(args.seq_len)}
        try:
            grads = time_backward(jax, nnx, make_block(cfg, 0, 0, execution), dtype, x, dy,
                                  args.reps, out)
        except Exception as e:  # the next candidate still runs; the error is its result
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            grads = None
        if name == "reference":
            reference = grads
        elif grads is not None and reference is not None:
            out.update(differences(jax, np, grads, reference))
        if "step_s" in out and name != "reference":
            record["measured"][name] = out["step_s"]
        print(f"  {name:<16} {line(out)} | {out['attention']}", flush=True)
        if args.json:
            write_json(args.json, record)
    if args.json:
        print(f"wrote {args.json}")


def line(out: dict) -> str:
    """A candidate's result in a few words."""
    if "error" in out:
        return out["error"]
    diffs = (f", dx {out['dx_rel_diff']:.2e} and dw {out['dw_rel_diff']:.2e} of the reference's "
             f"largest off" if "dx_rel_diff" in out else "")
    return f"{out['step_s']:.4g} s (compile {out['compile_s']:.3g} s){diffs}"


def inspect_params(jax) -> dict:
    import inspect
    params = inspect.signature(jax.nn.dot_product_attention).parameters
    return {p: p in params for p in ("return_residual", "key_value_seq_lengths",
                                     "query_seq_offsets", "local_window_size")}


def time_backward(jax, nnx, block, dtype, x, dy, reps: int, out: dict):
    """The block's backward, compiled and timed into `out`; returns (dx, dw)."""
    graphdef, w = nnx.split(block, nnx.Param)
    w = jax.tree.map(lambda p: jax.device_put(p.astype(dtype)), w)
    forward = lambda w, x: nnx.merge(graphdef, w)(x)
    backward = jax.jit(lambda w, x, dy: jax.vjp(forward, w, x)[1](dy)[::-1])  # (dx, dw)
    t0 = time.perf_counter()
    compiled = backward.lower(w, x, dy).compile()
    out["compile_s"] = time.perf_counter() - t0
    grads = jax.block_until_ready(compiled(w, x, dy))  # untimed: the first call's allocations
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(w, x, dy))
        times.append(time.perf_counter() - t0)
    out["times_s"], out["step_s"] = times, statistics.median(times)
    return grads


def differences(jax, np, grads, reference) -> dict:
    """The largest |a - b| of dx and of the weights' gradient, over the reference's largest |b|."""
    def rel(a, b):
        a, b = (np.asarray(jax.device_get(t), np.float32) for t in (a, b))
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    (dx, dw), (dx_ref, dw_ref) = grads, reference
    return {"dx_rel_diff": rel(dx, dx_ref),
            "dw_rel_diff": max(rel(a, b) for a, b in zip(jax.tree.leaves(dw),
                                                         jax.tree.leaves(dw_ref)))}


def write_json(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
