"""The disk tier against the RAM tier: peak RSS, step time, and the disk's own bandwidth.

    python scripts/bench_disk_tier.py --path /nvme/tier_bench          # ~300M params
    python scripts/bench_disk_tier.py --smoke --path /tmp/tier_smoke   # a tiny model, seconds
    python scripts/bench_disk_tier.py --params 1000 --json out.json

Three measurements in one run, each tier in a fresh process so their peaks are their own:

- the disk: sequential write then read of a --disk-gb file in 64 MiB blocks under --path, with
  O_DIRECT where the filesystem allows it (else buffered, fsync'd, its pages dropped before the
  read), so the figures are the device's, not the page cache's; its filesystem (from
  /proc/mounts) and the load average (os.getloadavg) before and after each part;
- per tier (offload.tier ram, then disk with offload.direct_io auto and false): a Llama-shaped
  model of about --params million parameters on a StreamedEngine (bf16 bus and gradients, the CPU
  as both devices), one step to compile, then --steps timed steps. Peak RSS is VmHWM over the
  timed steps (reset after the first) and, apart, over construction and the compiling step, in
  bytes per parameter;
- the disk tier's own throughput, reads and writes apart: bytes over the seconds its I/O threads
  spent in preadv / pwritev, each as a ratio to the disk's O_DIRECT figure, measured before and
  again after the runs (the faster of the two). Buffered, the reads of files that fit in the
  page cache come from RAM (a ratio above 1 says so).
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
        if not direct:  # buffered: until the bytes are on the disk (the tier's O_DIRECT writes
            os.fsync(fd)  # are not fsync'd either: they are scratch)
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


def filesystem(path: str) -> str:
    """The type and device of the mount holding `path` (the longest mount point above it)."""
    path, best = os.path.realpath(path), ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, kind = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(
                    best[0]):
                best = (mount, kind, device)
    return f"{best[1]} ({best[2]} on {best[0]})"


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
    from megatrain_jax.recipes import build_optimizer

    cfg = model_config(args.params, args.smoke)
    rss_before = hostmem.rss_bytes()
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        first, last = make_stages(cfg, 0)
    tier = (DiskTierOptions(os.path.join(args.path, "tier"), read_ahead=args.read_ahead,
                            run="bench_disk_tier", direct_io=args.direct_io)
            if args.child == "disk" else None)
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
    disk_tier = engine.disk_tier
    if disk_tier is not None:  # the timed steps' I/O only, not construction's
        disk_tier.bytes_read = disk_tier.bytes_written = 0
        disk_tier.read_s = disk_tier.write_s = disk_tier.copy_s = disk_tier.wait_s = 0.0
    counters = engine.counters
    counters.host_update_s = counters.host_wait_s = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = engine.train_step(*batch())
        float(out["loss"])
    engine.wait()
    step_s = (time.perf_counter() - t0) / args.steps
    result = {"tier": args.child, "params": params, "layers": cfg.num_layers,
              "step_s": step_s, "steady_peak_rss_bytes": hostmem.peak_rss_bytes() - rss_before,
              "first_step_peak_rss_bytes": first_peak, "loss": float(out["loss"]),
              # per step: the host thread's updates, and how long the step waited for them
              "host_update_s": counters.host_update_s / args.steps,
              "host_wait_s": counters.host_wait_s / args.steps, "loadavg": os.getloadavg()}
    if disk_tier is not None:
        steps = args.steps
        result.update(tier_bytes=disk_tier.total_bytes, io_mode=disk_tier.io_mode,
                      tier_read_gbps=disk_tier.bytes_read / max(disk_tier.read_s, 1e-9) / 1e9,
                      tier_write_gbps=disk_tier.bytes_written / max(disk_tier.write_s, 1e-9) / 1e9,
                      # per step: the I/O threads' seconds in preadv and in pwritev; the host
                      # thread's copying between buffers and arrays, and waiting for the I/O
                      tier_read_s=disk_tier.read_s / steps, tier_write_s=disk_tier.write_s / steps,
                      tier_copy_s=disk_tier.copy_s / steps, tier_wait_s=disk_tier.wait_s / steps,
                      tier_buffers=sum(disk_tier.buffers.values()))
    engine.close()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True, help="a directory on the disk to measure")
    parser.add_argument("--params", type=float, default=300, help="million parameters")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per tier")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--read-ahead", type=int, default=1)
    parser.add_argument("--direct-io", default="auto,false",
                        help="offload.direct_io of each disk-tier run, comma-separated")
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
    load_before = os.getloadavg()
    disk = disk_bandwidth(args.path, int(args.disk_gb * 1e9))
    disk.update(filesystem=filesystem(args.path), loadavg_before=load_before,
                loadavg_after=os.getloadavg())
    print(f"disk {args.path}, {disk['filesystem']}: write {disk['write_gbps']:.2f} GB/s, read "
          f"{disk['read_gbps']:.2f} GB/s ({disk['bytes'] / 1e9:.2f} GB, "
          f"{'O_DIRECT' if disk['direct_io'] else 'buffered'}; load average "
          f"{disk['loadavg_after'][0]:.1f})")
    runs = {}
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    for name, extra in [("ram", [])] + [(f"disk_direct_{d}", ["--direct-io", d])
                                       for d in args.direct_io.split(",")]:
        cmd = [sys.executable, os.path.abspath(__file__), *given, "--child", name.split("_")[0],
               *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)
            return done.returncode
        runs[name] = r = json.loads(done.stdout.strip().splitlines()[-1])
        line = (f"{name:>17}: {r['params'] / 1e6:.1f}M params, step {r['step_s']:.2f} s (updates "
                f"{r['host_update_s']:.2f} s, waited {r['host_wait_s']:.2f} s), peak RSS "
                f"{r['steady_peak_rss_bytes'] / r['params']:.2f} B/param over the steps "
                f"({r['steady_peak_rss_bytes'] / 1e9:.2f} GB), "
                f"{r['first_step_peak_rss_bytes'] / r['params']:.2f} B/param building and "
                f"compiling; load average {r['loadavg'][0]:.1f}")
        if r["tier"] == "disk":
            line += (f"\n{'':>19}{r['io_mode']}: {r['tier_bytes'] / 1e9:.2f} GB on disk; its I/O "
                     f"threads read {r['tier_read_gbps']:.2f} GB/s, wrote "
                     f"{r['tier_write_gbps']:.2f} GB/s; "
                     f"per step {r['tier_read_s']:.2f} s reading, {r['tier_write_s']:.2f} s "
                     f"writing; the host thread {r['tier_copy_s']:.2f} s copying, "
                     f"{r['tier_wait_s']:.2f} s waiting for the I/O")
        print(line)
    # The disk again after the runs: the machine is shared, so its speed drifts; the ratios are
    # taken against the faster of the two measurements (the figure least flattering to the tier).
    after = disk_bandwidth(args.path, int(args.disk_gb * 1e9))
    disk["again"] = dict(after, loadavg_after=os.getloadavg())
    for key in ("read_gbps", "write_gbps"):
        disk[f"best_{key}"] = max(disk[key], after[key])
    print(f"disk again: write {after['write_gbps']:.2f} GB/s, read {after['read_gbps']:.2f} GB/s;"
          f" the tier against the faster of each:")
    for name, r in runs.items():
        assert r["loss"] == runs["ram"]["loss"], f"{name} trained differently from the ram tier"
        if r["tier"] == "disk":
            r["read_ratio"] = r["tier_read_gbps"] / disk["best_read_gbps"]
            r["write_ratio"] = r["tier_write_gbps"] / disk["best_write_gbps"]
            print(f"{name:>17}: reads {r['read_ratio']:.2f}x the disk, writes "
                  f"{r['write_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"disk": disk, "runs": runs, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
