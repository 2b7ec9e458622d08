"""The disk tier against the RAM tier: peak RSS, step time, and the disk's own bandwidth.

    python scripts/bench_disk_tier.py --path /nvme/tier_bench          # ~300M params
    python scripts/bench_disk_tier.py --smoke --path /tmp/tier_smoke   # a tiny model, seconds
    python scripts/bench_disk_tier.py --params 1000 --json out.json

Three measurements in one run, each tier in a fresh process so their peaks are their own:

- the disk: sequential write then read of a --disk-gb file in 64 MiB blocks under --path, with
  O_DIRECT where the filesystem allows it (else buffered, fsync'd, its pages dropped before the
  read), so the figures are the device's, not the page cache's;
- per tier (offload.tier ram, then disk): a Llama-shaped model of about --params million
  parameters on a StreamedEngine (bf16 bus and gradients, the CPU as both devices), one step to
  compile, then --steps timed steps. Peak RSS is VmHWM over the timed steps (reset after the
  first) and, apart, over construction and the compiling step, in bytes per parameter;
- the disk tier's own throughput: bytes it read and wrote over the seconds its I/O threads spent,
  as a ratio to the disk's. The tier uses buffered I/O, so once its files fit in the page cache
  its reads come from RAM and the ratio exceeds 1: the figure that matters is then step time.
"""

import argparse
import json
import mmap
import os
import subprocess
import sys
import time


def model_config(params_m: float, smoke: bool):
    """Llama-shaped: hidden 1024 (smoke: 64), as many layers as give about params_m million."""
    from megatrain_jax.model import ModelConfig
    hidden = 64 if smoke else 1024
    inter = int(2.75 * hidden)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    layers = 2 if smoke else max(1, round(params_m * 1e6 / per_layer))
    return ModelConfig(vocab_size=257, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=max(1, hidden // 128),
                       num_kv_heads=max(1, hidden // 128))


def disk_bandwidth(path: str, nbytes: int) -> dict:
    """Sequential write and read GB/s of a file of `nbytes` under `path` (removed after)."""
    block = 64 << 20
    nbytes = max(block, nbytes // block * block)
    name = os.path.join(path, "bench_disk_bandwidth.bin")
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(1 << 20) * (block >> 20))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    except OSError:  # e.g. tmpfs: no O_DIRECT
        direct, fd = 0, os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.pwrite(fd, buffer, offset)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | direct)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for offset in range(0, nbytes, block):
            os.preadv(fd, [buffer], offset)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(name)
    return {"bytes": nbytes, "direct_io": bool(direct), "write_gbps": nbytes / write_s / 1e9,
            "read_gbps": nbytes / read_s / 1e9}


def child(args) -> dict:
    """One tier's run (in its own process): the figures as a dict."""
    from megatrain_jax import hostmem
    hostmem.set_mmap_threshold(1 << 20)  # as train() does: freed buffers go back to the kernel
    import jax
    import jax.numpy as jnp
    import numpy as np

    from megatrain_jax.config import OptimizerConfig
    from megatrain_jax.engine import StreamedEngine
    from megatrain_jax.engine.tier import DiskTierOptions
    from megatrain_jax.model import make_block, make_stages
    from megatrain_jax.train import build_optimizer

    cfg = model_config(args.params, args.smoke)
    rss_before = hostmem.rss_bytes()
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        first, last = make_stages(cfg, 0)
    tier = (DiskTierOptions(os.path.join(args.path, "tier"), read_ahead=args.read_ahead,
                            run="bench_disk_tier") if args.child == "disk" else None)
    engine = StreamedEngine(first=first, last=last, make_block=lambda i: make_block(cfg, 0, i),
                            num_layers=cfg.num_layers,
                            optimizer=build_optimizer(OptimizerConfig(), 100), max_grad_norm=1.0,
                            compute_dtype=jnp.bfloat16, grad_dtype=jnp.bfloat16,
                            compute_device=cpu, host_device=cpu, disk_tier=tier)
    del first, last
    params = cfg.num_params()
    rng = np.random.default_rng(0)
    batch = lambda: [rng.integers(0, cfg.vocab_size, (1, args.batch, args.seq), dtype=np.int32)
                     for _ in range(2)]
    engine.train_step(*batch())
    engine.wait()
    first_peak = hostmem.peak_rss_bytes() - rss_before  # construction and the compiling step
    hostmem.reset_peak()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = engine.train_step(*batch())
        float(out["loss"])
    engine.wait()
    step_s = (time.perf_counter() - t0) / args.steps
    result = {"tier": args.child, "params": params, "layers": cfg.num_layers,
              "step_s": step_s, "steady_peak_rss_bytes": hostmem.peak_rss_bytes() - rss_before,
              "first_step_peak_rss_bytes": first_peak, "loss": float(out["loss"])}
    disk_tier = engine.disk_tier
    if disk_tier is not None:
        result.update(tier_bytes=disk_tier.total_bytes,
                      tier_read_gbps=disk_tier.bytes_read / max(disk_tier.read_s, 1e-9) / 1e9,
                      tier_write_gbps=disk_tier.bytes_written / max(disk_tier.write_s, 1e-9) / 1e9)
    engine.close()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True, help="a directory on the disk to measure")
    parser.add_argument("--params", type=float, default=300, help="million parameters")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per tier")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--read-ahead", type=int, default=2)
    parser.add_argument("--disk-gb", type=float, default=2.0, help="bytes of the bandwidth test")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer toy model, 1 step")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=("ram", "disk"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.disk_gb = 1, 0.0625
    if args.child:
        print(json.dumps(child(args)))
        return 0
    os.makedirs(args.path, exist_ok=True)
    disk = disk_bandwidth(args.path, int(args.disk_gb * 1e9))
    print(f"disk {args.path}: write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} "
          f"GB/s ({disk['bytes'] / 1e9:.2f} GB, {'O_DIRECT' if disk['direct_io'] else 'buffered'})")
    runs = {}
    for tier in ("ram", "disk"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", tier,
               *[a for a in (argv if argv is not None else sys.argv[1:])]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)
            return done.returncode
        runs[tier] = json.loads(done.stdout.strip().splitlines()[-1])
        r = runs[tier]
        print(f"{tier:>4} tier: {r['params'] / 1e6:.1f}M params, step {r['step_s']:.2f} s, peak RSS "
              f"{r['steady_peak_rss_bytes'] / r['params']:.2f} B/param over the steps "
              f"({r['steady_peak_rss_bytes'] / 1e9:.2f} GB), "
              f"{r['first_step_peak_rss_bytes'] / r['params']:.2f} B/param building and compiling"
              + (
                  f"; tier {r['tier_bytes'] / 1e9:.2f} GB on disk, its I/O threads read "
                  f"{r['tier_read_gbps']:.2f} GB/s ({r['tier_read_gbps'] / disk['read_gbps']:.2f}"
                  f"x the disk), wrote {r['tier_write_gbps']:.2f} GB/s "
                  f"({r['tier_write_gbps'] / disk['write_gbps']:.2f}x)" if tier == "disk" else ""))
    assert runs["ram"]["loss"] == runs["disk"]["loss"], "the tiers trained differently"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"disk": disk, "runs": runs, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
