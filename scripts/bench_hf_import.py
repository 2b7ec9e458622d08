"""Peak host memory (RSS) of importing a Hugging Face model (`model.from_hf`), against its size.

    python scripts/bench_hf_import.py [--layers 12 --hidden 1024 --out bench_hf_import.json]

Writes a random Llama-architecture model (bf16 safetensors shards, as HF checkpoints usually are;
numpy only, no torch), then measures each mode in a fresh process: after jax is imported and its
CPU backend started, the kernel's peak-RSS counter is reset (/proc/self/clear_refs), then

    params only     hf.load_stages + hf.load_block for every layer, all kept (the fp32 params)
    engine (HF)     train.build_engine with model.from_hf: params + AdamW state + bus copies
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

    heads, kv, inter = hidden // 64, max(hidden // 256, 1), int(hidden * 2.75) // 64 * 64
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (hidden, hidden)),
                   (p + "self_attn.k_proj.weight", (kv * 64, hidden)),
                   (p + "self_attn.v_proj.weight", (kv * 64, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    rng = np.random.default_rng(0)
    shards, current, size = [], {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        if current and size + 2 * n > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += 2 * n
    shards.append(current)
    weight_map, largest = {}, 0
    for k, shard in enumerate(shards):
        file_name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
                   for name, shape in shard.items()}
        save_file(tensors, os.path.join(path, file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
        largest = max([largest] + [int(np.prod(s)) for s in shard.values()])
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return largest


def child(args):
    import jax

    from megatrain_jax import hf, hostmem
    from megatrain_jax.config import load_config
    from megatrain_jax.train import build_engine

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
        state = nbytes(engine.state()) + nbytes([u.bus for u in engine._units])
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
