"""Peak host memory (RSS) of importing a Hugging Face model (`model.from_hf`), against its size.

    python scripts/bench_hf_import.py [--layers 12 --hidden 1024 --out bench_hf_import.json]

Writes a random Llama-architecture model (bf16 safetensors shards, as HF checkpoints usually are;
numpy only, no torch), then measures each mode in a fresh process: after jax is imported and its
CPU backend started, the kernel's peak-RSS counter is reset (/proc/self/clear_refs), then

    params only     hf.load_stages + hf.load_block for every layer, all kept (the fp32 params)
    engine (HF)     recipes.build_engine with model.from_hf: params + AdamW state + bus copies
    engine (random) the same engine with random init: the baseline the HF import should match

extra = VmHWM - VmRSS before; held = VmRSS after (minus before); state = bytes the result holds.
"peak over held" is the transient cost of the import: it should be about one tensor.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("params only", "engine (HF)", "engine (random)")


def write_model(path, layers, hidden, vocab, shard_bytes):
    """A random LlamaForCausalLM directory, tensor by tensor, in bf16 shards."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from megatrain_jax import hf
    from megatrain_jax.model import ModelConfig

    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=int(hidden * 2.75) // 64 * 64, num_layers=layers,
                      num_heads=hidden // 64, num_kv_heads=max(hidden // 256, 1), head_dim=64)
    tensors = hf.all_tensors(cfg)
    shards = hf.plan_shards(tensors, 2, shard_bytes)  # bf16: 2 bytes a value
    rng = np.random.default_rng(0)
    weight_map = {}
    for k, shard in enumerate(shards):
        file_name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
               for name, shape, *_ in shard}
        save_file(out, os.path.join(path, file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in out})
        del out
    with open(os.path.join(path, hf.INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
        json.dump(hf.hf_config(cfg, dtype="bfloat16", max_position_embeddings=2048), f)
    return max(int(np.prod(shape)) for _, shape, *_ in tensors)


def child(args):
    import jax

    from megatrain_jax import hf, hostmem
    from megatrain_jax.recipes import build_engine, load_config

    jax.devices()  # start the CPU backend before the baseline
    cfg = load_config(None, [f"model.from_hf={args.model_dir}", "train.compute_dtype=bfloat16"])
    if args.mode == "engine (random)":
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, from_hf=""))
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    hostmem.reset_peak()
    before = hostmem.rss_bytes()
    t0 = time.perf_counter()
    if args.mode == "params only":
        source = hf.HFSource(cfg.model.from_hf)
        kept = [hf.load_stages(cfg.model, source)]
        kept += [hf.load_block(cfg.model, source, i) for i in range(cfg.model.num_layers)]
        from flax import nnx
        state = nbytes(nnx.state(kept))
    else:
        engine = build_engine(cfg)
        state = nbytes(engine.state()) + engine.bus_bytes()
    seconds = time.perf_counter() - t0
    result = {"mode": args.mode, "extra": hostmem.peak_rss_bytes() - before,
              "held": hostmem.rss_bytes() - before, "state": state, "seconds": seconds,
              "rss_file_after": hostmem.status_bytes("RssFile")}
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--out", default="bench_hf_import.json")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        return child(args)

    import jax
    with tempfile.TemporaryDirectory() as tmp:
        largest = write_model(tmp, args.layers, args.hidden, args.vocab, args.shard_mb * 10**6)
        rows = []
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--model-dir", tmp],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mb = lambda b: f"{b / 2**20:,.0f}"
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, bf16 shards of "
          f"{args.shard_mb} MB; largest tensor {mb(4 * largest)} MiB as fp32 | jax {jax.__version__}")
    print(f"{'mode':<16} {'state MiB':>10} {'held MiB':>9} {'peak MiB':>9} {'peak-held':>10} "
          f"{'peak-state':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['mode']:<16} {mb(r['state']):>10} {mb(r['held']):>9} {mb(r['extra']):>9} "
              f"{mb(r['extra'] - r['held']):>10} {mb(r['extra'] - r['state']):>11} "
              f"{r['seconds']:>8.1f}")
    with open(args.out, "w") as f:
        json.dump({"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
                   "largest_tensor_fp32_bytes": 4 * largest, "jax": jax.__version__,
                   "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
