"""The data pipeline's speed and memory: tokenizing a corpus into the token cache, and host RAM
while training batches stream from it.

    python scripts/bench_data.py --tokenize-mb 1000 --stream-gb 1 4 --json out.json
    python scripts/bench_data.py --tokenize-mb 2 --stream-gb 0.01 0.02   # a smoke run
    python scripts/bench_data.py --tokenize-mb 1000 --stream-gb   # tokenizing only

1. Tokenizing: a synthetic JSONL corpus of --tokenize-mb MB (documents of random words) is
   tokenized into a fresh cache by sources.cache.open_cache (the path a run takes), in a child
   process: wall time, tokens/s and the child's peak RSS. The baseline, in another child on the
   same machine: the same documents already in memory as a list of strings, encoded with raw
   `tokenizers` encode_batch in batches of the same size (ids discarded): the ratio ours /
   raw is the figure (target >= 0.8).
2. Streaming: for each --stream-gb size, a corpus of that many GB of uint16 token ids on disk,
   read as training does (recipes.load_data: each batch's windows read with pread, the next batch's
   on a thread ahead) for --batches batches in a child process: its RSS after (VmRSS) and peak
   (VmHWM). Flat across sizes: host RAM does not grow with the corpus.

Prints a table; --json writes every figure. The corpus files are written under --dir (default: a
temporary directory, removed after).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED_TOKENIZER = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tokenizer", "tokenizer.json")


def write_corpus(path: str, megabytes: float, seed: int = 0):
    """A JSONL file of about `megabytes` MB: documents of 50-600 random words."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    words = ["".join(map(chr, rng.choice(letters, size=int(n)))) for n in rng.integers(1, 10, 5000)]
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            picks = rng.integers(0, len(words), size=(256, 600))
            lengths = rng.integers(50, 600, size=256)
            lines = "".join(json.dumps({"text": " ".join(words[w] for w in row[:n])}) + "\n"
                            for row, n in zip(picks, lengths))
            f.write(lines)
            written += len(lines)


def write_tokens(path: str, gigabytes: float, seed: int = 0):
    """`gigabytes` GB of random uint16 ids below 32000, written in 64 MB chunks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    left = int(gigabytes * 1e9) // 2
    with open(path, "wb") as f:
        while left:
            n = min(left, 1 << 25)
            f.write(rng.integers(0, 32000, size=n, dtype=np.uint16).tobytes())
            left -= n


def _peak() -> int:
    from megatrain_jax import hostmem
    return hostmem.peak_rss_bytes()


def child_ours(args) -> dict:
    from megatrain_jax.data import load_tokenizer
    from megatrain_jax.sources.cache import open_cache
    from megatrain_jax.sources.files import resolve

    tok = load_tokenizer(args.tokenizer)
    t0 = time.perf_counter()
    tokens, _ = open_cache(resolve(args.corpus), tok, args.cache, log=lambda *a: None)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": int(len(tokens)), "peak_rss_bytes": _peak()}


def child_raw(args) -> dict:
    from tokenizers import Tokenizer

    from megatrain_jax.sources.cache import DOC_BATCH

    tok = Tokenizer.from_file(args.tokenizer)
    with open(args.corpus, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    t0, count = time.perf_counter(), 0
    for start in range(0, len(texts), DOC_BATCH):
        encodings = tok.encode_batch(texts[start:start + DOC_BATCH], add_special_tokens=False)
        count += sum(len(e.ids) + 1 for e in encodings)  # + 1: the EOS ours appends
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": count, "peak_rss_bytes": _peak()}


def child_stream(args) -> dict:
    from megatrain_jax import hostmem
    from megatrain_jax.config import load_config
    from megatrain_jax.recipes import load_data

    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"data.path={args.corpus}", "model.vocab_size=32000", "data.seq_len=1024",
        "data.batch_size=8", "data.micro_batches=4", f"data.cache_dir={args.cache}"])
    before = hostmem.rss_bytes()
    dataset, _ = load_data(cfg, log=lambda *a: None)
    t0 = time.perf_counter()
    for _ in range(args.batches):
        dataset.next_batch_with_context()
    seconds = time.perf_counter() - t0
    return {"rss_before_bytes": before, "rss_after_bytes": hostmem.rss_bytes(),
            "peak_rss_bytes": _peak(), "batches_per_s": args.batches / seconds,
            "tokens": int(len(dataset.tokens))}


def run_child(role: str, **kw) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", role]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    if proc.returncode:
        raise SystemExit(f"bench_data: the {role} child failed:\n{proc.stderr[-3000:]}")
    # the machine's 1-minute load average as the child started and as it ended
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "load_average": [load_before, os.getloadavg()[0]]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenize-mb", type=float, default=1000.0)
    p.add_argument("--stream-gb", type=float, nargs="*", default=[1.0, 4.0])
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--tokenizer", default=BUNDLED_TOKENIZER)
    p.add_argument("--dir", default="")
    p.add_argument("--json", default="")
    p.add_argument("--child", choices=["ours", "raw", "stream"], help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps({"ours": child_ours, "raw": child_raw, "stream": child_stream}[
            args.child](args)))
        return
    if args.tokenize_mb <= 0 or any(g <= 0 for g in args.stream_gb) or args.batches < 1:
        p.error("--tokenize-mb, --stream-gb and --batches must be positive")
    work = args.dir or tempfile.mkdtemp(prefix="bench-data-")
    os.makedirs(work, exist_ok=True)
    try:
        result = bench(args, work)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def bench(args, work: str) -> dict:
    corpus = os.path.join(work, "corpus.jsonl")
    write_corpus(corpus, args.tokenize_mb)
    size = os.path.getsize(corpus)
    ours = run_child("ours", corpus=corpus, cache=os.path.join(work, "cache"),
                     tokenizer=args.tokenizer)
    raw = run_child("raw", corpus=corpus, tokenizer=args.tokenizer)
    os.remove(corpus)
    shutil.rmtree(os.path.join(work, "cache"))
    tok = {"corpus_bytes": size, "tokenizer": args.tokenizer, "ours": ours, "raw": raw,
           "ours_tokens_per_s": ours["tokens"] / ours["seconds"],
           "raw_tokens_per_s": raw["tokens"] / raw["seconds"]}
    tok["ratio"] = tok["ours_tokens_per_s"] / tok["raw_tokens_per_s"]
    print(f"tokenizing {size / 1e6:,.1f} MB of JSONL ({ours['tokens']:,} tokens, "
          f"{os.path.basename(args.tokenizer)}):")
    print(f"  {'':34s} {'seconds':>9s} {'tokens/s':>12s} {'MB/s':>8s} {'peak RSS GB':>12s}")
    for name, r in (("ours (open_cache, into the cache)", ours),
                    ("raw tokenizers encode_batch", raw)):
        print(f"  {name:34s} {r['seconds']:9.2f} {r['tokens'] / r['seconds']:12,.0f} "
              f"{size / 1e6 / r['seconds']:8.2f} {r['peak_rss_bytes'] / 1e9:12.3f}")
    print(f"  ours / raw tokens/s: {tok['ratio']:.2f}x (target >= 0.8); load average "
          f"{ours['load_average'][0]:.1f} -> {raw['load_average'][1]:.1f}")
    streams = []
    if not args.stream_gb:
        return {"tokenize": tok, "stream": streams, "batches": args.batches, **_machine()}
    print(f"streaming {args.batches} batches of 4 x 8 x 1024 tokens (load_data, read ahead):")
    print(f"  {'corpus GB':>9s} {'RSS before GB':>14s} {'RSS after GB':>13s} {'peak GB':>8s} "
          f"{'batches/s':>10s}")
    for gb in args.stream_gb:
        path = os.path.join(work, f"tokens-{gb:g}.bin")
        write_tokens(path, gb)
        r = run_child("stream", corpus=path, cache=os.path.join(work, "cache"),
                      batches=args.batches)
        os.remove(path)
        r["corpus_gb"] = gb
        streams.append(r)
        print(f"  {gb:9.2f} {r['rss_before_bytes'] / 1e9:14.3f} {r['rss_after_bytes'] / 1e9:13.3f} "
              f"{r['peak_rss_bytes'] / 1e9:8.3f} {r['batches_per_s']:10.1f}")
    return {"tokenize": tok, "stream": streams, "batches": args.batches, **_machine()}


def _machine() -> dict:
    import platform

    return {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


if __name__ == "__main__":
    main()
