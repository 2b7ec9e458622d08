"""Transfer-path benchmark: GB/s of every way the engine could move one layer's weights.

    PYTHONPATH=. python3 scripts/bench_transfer.py [--mb 512] [--repeats 5] [--json out.json]

For one buffer the size of a large layer it times every host<->device path JAX offers (numpy,
the CPU backend, the GPU device's `pinned_host` memory kind), a PyTorch pinned-memory copy as the
physical reference (in a subprocess, when torch is importable), copies while the GPU runs a large
matmul (do they overlap compute?) in each form the engine could issue them: an eager `device_put`
dispatched behind the matmul (the engine's form today), dispatched before it, issued from a second
thread, and made inside the jitted computation beside the matmul, the latency of a small device->host copy and what it does to the
next kernel (jax#36651), and how much `pinned_host` memory XLA will hand out with and without
XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (the default cap is reported to be 64 GB). GB = 1e9 bytes.

On a CPU-only machine the "device" is CPU device 0 and the "CPU backend" device is CPU device 1, so
every path is a real cross-device copy and the script runs end to end (tests/test_bench.py).
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# Not preallocating leaves GPU memory for the PyTorch reference and for the pinned-pool probe.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

GB = 1e9

# The physical reference: PyTorch pinned-memory copies, in a child process so its CUDA context and
# libraries never meet JAX's. argv: nbytes repeats. Prints one JSON object.
TORCH_REFERENCE = r"""
import json, statistics, sys, time
import torch
n, repeats = int(sys.argv[1]), int(sys.argv[2])
if not torch.cuda.is_available():
    print(json.dumps({"skipped": "torch.cuda.is_available() is False"})); sys.exit()
src = torch.ones(n, dtype=torch.uint8).pin_memory()
dst = torch.empty(n, dtype=torch.uint8).pin_memory()
pageable = torch.ones(n, dtype=torch.uint8)
def timed(fn):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
gpu = src.to("cuda", non_blocking=True)
out = {"torch": torch.__version__,
       "h2d_pinned_s": timed(lambda: src.to("cuda", non_blocking=True)),
       "d2h_pinned_s": timed(lambda: dst.copy_(gpu, non_blocking=True)),
       "h2d_pageable_s": timed(lambda: pageable.to("cuda"))}
print(json.dumps(out))
"""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=512, help="buffer size in MB (1e6 bytes)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per path (median kept)")
    p.add_argument("--matmul", type=int, default=0,
                   help="square matmul size for the overlap test (0: 8192 on GPU, 256 on CPU)")
    p.add_argument("--pinned-probe-gb", type=float, default=-1,
                   help="probe XLA's pinned_host pool up to this many GB (-1: 72 on GPU, skipped "
                        "on CPU; 0: skip)")
    p.add_argument("--json", default="runs/bench/transfer.json", help="where to write the results")
    p.add_argument("--probe-child", type=float, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def torch_reference(nbytes, repeats) -> dict:
    if importlib.util.find_spec("torch") is None:
        return {"skipped": "torch is not importable"}
    proc = subprocess.run([sys.executable, "-c", TORCH_REFERENCE, str(nbytes), str(repeats)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"skipped": f"torch reference failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pinned_probe_child(limit_gb: float):
    """Child mode: allocate 2 GB pinned_host chunks until limit_gb or failure; print JSON."""
    import jax
    import numpy as np
    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    chunk = np.ones(int(min(2 * GB, limit_gb * GB)), np.uint8)
    held, error, t0 = [], None, time.perf_counter()
    try:
        while len(held) * chunk.nbytes < limit_gb * GB:
            held.append(jax.device_put(chunk, pinned))
            jax.block_until_ready(held[-1])
    except Exception as e:  # the failure is the measurement
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    print(json.dumps({"allocated_gb": len(held) * chunk.nbytes / GB, "error": error,
                      "seconds": time.perf_counter() - t0}))


def pinned_probe(limit_gb: float) -> dict:
    """How much pinned_host memory XLA gives, with the default cap and with it raised."""
    out = {}
    for label, cap in (("default", None), ("raised", int(limit_gb) + 16)):
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", None)
        if cap is not None:
            env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(cap)
        try:
            proc = subprocess.run([sys.executable, __file__, "--probe-child", str(limit_gb)],
                                  capture_output=True, text=True, env=env, timeout=300)
            lines = proc.stdout.strip().splitlines()
            result = (json.loads(lines[-1]) if proc.returncode == 0 and lines else
                      {"allocated_gb": None, "error": f"child exited {proc.returncode}: "
                       f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}"})
        except subprocess.TimeoutExpired:
            result = {"allocated_gb": None, "error": "timed out after 300 s"}
        out[label] = dict(result, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=cap, asked_gb=limit_gb)
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.probe_child is not None:
        return pinned_probe_child(args.probe_child)
    nbytes = int(args.mb * 1e6) // 2 * 2
    # Before JAX touches the GPU, so the reference has the device to itself.
    reference = torch_reference(nbytes, args.repeats)

    import jax
    import jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_num_cpu_devices", 2)  # on a CPU-only machine: "device" 0, "host" 1

    dev = jax.devices()[0]
    on_gpu = dev.platform != "cpu"
    cpu = jax.devices("cpu")[0 if on_gpu else 1]
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    on_cpu = jax.sharding.SingleDeviceSharding(cpu)
    kinds = {m.kind for m in dev.addressable_memories()}
    pinned = (jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
              if "pinned_host" in kinds else None)
    print(f"device: {dev.device_kind} ({dev.platform}) | memory kinds {sorted(kinds)} | "
          f"buffer {nbytes / 1e6:.0f} MB | jax {jax.__version__}")

    def timed(fn, setup=lambda: None, repeats=args.repeats):
        """Median seconds of fn(setup()) to completion; setup runs untimed (fresh inputs)."""
        jax.block_until_ready(fn(setup()))
        times = []
        for _ in range(repeats):
            arg = setup()
            jax.block_until_ready(arg)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    host_np = np.ones(nbytes // 2, jnp.bfloat16)
    x_dev = jax.device_put(host_np, on_dev)
    x_cpu = jax.device_put(host_np, on_cpu)
    x_pin = jax.device_put(host_np, pinned) if pinned else None
    fresh_dev = lambda: x_dev + 0  # np.asarray caches its result on the array: give it a new one
    hop = lambda x, where: jax.device_put(np.asarray(x), where)
    threads = min(16, os.cpu_count() or 1)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    reused = aligned_empty(host_np.shape, host_np.dtype)

    # name -> (direction, engine role, fn[, setup])
    paths = {
        "numpy -> device": ("h2d", "", lambda _: jax.device_put(host_np, on_dev)),
        "cpu backend -> device": ("h2d", "", lambda _: jax.device_put(x_cpu, on_dev)),
        "pinned_host -> device": ("h2d", "weights fetch; offloaded activations back",
                                  lambda _: jax.device_put(x_pin, on_dev)),
        "device -> pinned_host": ("d2h", "gradients out; activation offload (save)",
                                  lambda _: jax.device_put(x_dev, pinned)),
        "device -> cpu backend": ("d2h", "",
                                  lambda _: jax.device_put(x_dev, on_cpu)),
        "device -> pinned_host -> cpu backend": (
            "d2h", "", lambda _: jax.device_put(jax.device_put(x_dev, pinned), on_cpu)),
        "device -> numpy (np.asarray)": ("d2h", "", lambda x: np.asarray(x), fresh_dev),
        "cpu backend -> pinned_host": ("host", "", lambda _: jax.device_put(x_cpu, pinned)),
        "pinned_host -> cpu backend": ("host", "", lambda _: jax.device_put(x_pin, on_cpu)),
        # the engine's hops between the clients (transfer.across_clients): a numpy view put
        "cpu backend -> pinned_host, numpy view": (
            "host", "bus copy, after each host update", lambda _: hop(x_cpu, pinned)),
        "pinned_host -> cpu backend, numpy view": (
            "host", "gradients' hop to the host state (update thread)",
            lambda _: hop(x_pin, on_cpu)),
        # a candidate for that hop: the cores idle while the host thread copies
        f"pinned_host -> cpu backend, {threads}-thread copy, reused buffer": (
            "host", "", lambda _: threaded_hop(jax, x_pin, on_cpu, reused, pool, threads)),
        # the same into fresh memory each time: its pages faulted in by the copying threads
        f"pinned_host -> cpu backend, {threads}-thread copy, fresh buffer": (
            "host", "", lambda _: threaded_hop(jax, x_pin, on_cpu, None, pool, threads)),
        "numpy -> pinned_host": ("host", "", lambda _: jax.device_put(host_np, pinned)),
    }
    dst_np = np.empty_like(host_np)
    rows = [{"path": "host memcpy (np.copyto, existing buffer)", "direction": "host",
             "engine": "reference", "seconds": timed(lambda _: np.copyto(dst_np, host_np))}]
    for name, (direction, role, fn, *setup) in paths.items():
        row = {"path": name, "direction": direction, "engine": role}
        if pinned is None and "pinned" in name:
            row["skipped"] = f"{dev.platform} device has no pinned_host memory kind"
        else:
            try:
                row["seconds"] = timed(fn, *setup)
                if name.endswith("numpy view"):  # a copy, or the source's memory itself?
                    src = x_cpu if name.startswith("cpu") else x_pin
                    row["zero_copy"] = shares_memory(src, fn(None))
                    # the CPU backend aliases only a 64-byte aligned numpy buffer
                    row["source_aligned_64"] = np.asarray(src).ctypes.data % 64 == 0
                elif "thread copy" in name:  # exact? the reused buffer then put as it is?
                    out = fn(None)
                    row["threads"], row["exact"] = threads, bool(np.array_equal(out, host_np))
                    if name.endswith("reused buffer"):
                        row["put_aliases"] = shares_memory(reused, out)
            except Exception as e:  # an unsupported path is a result, not a crash
                row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)

    for key in ("h2d_pinned_", "d2h_pinned_", "h2d_pageable_"):
        if key + "s" in reference:
            reference[key + "gbps"] = nbytes / reference[key + "s"] / GB
    ref = {"h2d": reference.get("h2d_pinned_s"), "d2h": reference.get("d2h_pinned_s")}
    for row in rows:
        if "seconds" in row:
            row["gb_per_s"] = nbytes / row["seconds"] / GB
            if ref.get(row["direction"]):
                row["ratio_to_torch"] = ref[row["direction"]] / row["seconds"]

    overlap = measure_overlap(jax, jnp, x_dev, x_pin, pinned, on_dev, on_cpu, nbytes,
                              args.matmul or (8192 if on_gpu else 256), timed)
    latency = measure_small_d2h(jax, jnp, on_dev, on_cpu, timed)
    probe_gb = args.pinned_probe_gb if args.pinned_probe_gb >= 0 else (72 if on_gpu else 0)
    skip = ("no pinned_host memory kind" if not pinned else
            "CPU machine (the pool is the GPU client's)" if not on_gpu else "--pinned-probe-gb 0")
    probe = pinned_probe(probe_gb) if probe_gb > 0 and pinned else {"skipped": skip}

    print_report(rows, reference, overlap, latency, probe)
    result = {"kind": "transfer", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "jax": jax.__version__,
              "python": platform.python_version(), "device_kind": dev.device_kind,
              "platform": dev.platform, "buffer_bytes": nbytes, "repeats": args.repeats,
              "env": {k: v for k, v in os.environ.items() if k.startswith("XLA")},
              "paths": rows, "torch_reference": reference, "overlap": overlap,
              "small_d2h": latency, "pinned_pool_probe": probe}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")


def aligned_empty(shape, dtype):
    """An uninitialised numpy array whose data starts on a 64-byte line (malloc gives 16)."""
    import numpy as np
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def threaded_hop(jax, x, where, dst, pool, threads):
    """Host-resident x put on `where` by copying its numpy view into `dst` (a reused, aligned host
    buffer; None: a fresh one) in `threads` contiguous slices at once, on `pool` (numpy releases
    the GIL while it copies), then putting `dst` there (a zero-copy alias where the backend takes
    it)."""
    import numpy as np
    dst = aligned_empty(x.shape, x.dtype) if dst is None else dst
    src, out = np.asarray(x).reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    cuts = [len(src) * i // threads // 64 * 64 for i in range(threads)] + [len(src)]
    list(pool.map(lambda i: np.copyto(out[cuts[i]:cuts[i + 1]], src[cuts[i]:cuts[i + 1]]),
                  range(threads)))
    return jax.device_put(dst, where)


def shares_memory(src, out):
    """Whether `out` (a copy's result) is `src`'s memory itself (None: a pointer not readable)."""
    import numpy as np
    try:
        return np.asarray(src).ctypes.data == out.unsafe_buffer_pointer()
    except Exception:
        return None


def measure_overlap(jax, jnp, x_dev, x_pin, pinned, on_dev, on_cpu, nbytes, n, timed):
    """Copies while a bf16 matmul chain runs: does the copy finish in its own time (overlap)?"""
    a = jax.device_put(jnp.full((n, n), 1e-3, jnp.bfloat16), on_dev)

    def chain(a, iters):
        return jax.lax.fori_loop(0, iters, lambda i, c: c @ a, a)

    one = jax.jit(chain, static_argnums=1)
    t_one = timed(lambda _: one(a, 1))
    copies = {"pinned_host -> device": (x_pin, on_dev), "device -> pinned_host": (x_dev, pinned),
              "device -> cpu backend": (x_dev, on_cpu)}
    out = {"matmul_n": n, "matmul_tflops": 2 * n ** 3 / t_one / 1e12, "paths": {}}
    for name, (x, target) in copies.items():
        if pinned is None and "pinned" in name:
            out["paths"][name] = {"skipped": "no pinned_host memory kind"}
            continue
        copy = lambda: jax.device_put(x, target)
        t_copy = timed(lambda _: copy())
        iters = max(1, min(1000, round(t_copy / t_one)))  # compute about as long as the copy
        t_mm = timed(lambda _: one(a, iters))
        forms = {"": eager(one, a, iters, copy, copy_first=False),
                 " (copy first)": eager(one, a, iters, copy, copy_first=True),
                 " (second thread)": threaded(one, a, iters, copy)}
        if "cpu backend" not in name:  # (a jit cannot copy between two clients)
            forms[" (in jit)"] = in_jit(jax, chain, a, iters, x, target, timed)
        for form, (t_c, t_b, t_alone) in forms.items():
            t_alone = t_alone or t_copy
            out["paths"][name + form] = {
                "copy_alone_s": t_alone, "matmul_alone_s": t_mm, "copy_during_matmul_s": t_c,
                "both_s": t_b, "gb_per_s_alone": nbytes / t_alone / GB,
                "gb_per_s_during_matmul": nbytes / t_c / GB,
                # 1: the shorter of the two was fully hidden under the other; 0: serial
                "overlap": max(0.0, min(1.0, (t_alone + t_mm - t_b) / min(t_alone, t_mm)))}
    return out


def _medians(run, repeats=3) -> tuple:
    """Median (copy done, both done) seconds of `run()`, which returns them once."""
    done = [run() for _ in range(repeats)]
    return (statistics.median(c for c, _ in done), statistics.median(b for _, b in done), None)


def eager(one, a, iters, copy, copy_first: bool) -> tuple:
    """Both dispatched as eager calls: the matmul first, then the copy (`jax.device_put`), the
    engine's eager form; or the copy first, to see whether the order is what serialises them."""
    def run():
        t0 = time.perf_counter()
        if copy_first:
            y = copy()
            r = one(a, iters)
        else:
            r = one(a, iters)
            y = copy()
        y.block_until_ready()
        c = time.perf_counter() - t0
        r.block_until_ready()
        return c, time.perf_counter() - t0
    return _medians(run)


def threaded(one, a, iters, copy) -> tuple:
    """The copy issued and waited for on a second thread while this one dispatches the matmul."""
    import threading

    def run():
        done = {}

        def put():
            copy().block_until_ready()
            done["copy"] = time.perf_counter()
        t0 = time.perf_counter()
        r = one(a, iters)
        thread = threading.Thread(target=put)
        thread.start()
        r.block_until_ready()
        thread.join()
        return done["copy"] - t0, time.perf_counter() - t0
    return _medians(run)


def in_jit(jax, chain, a, iters, x, target, timed) -> tuple:
    """The copy made inside the jitted computation beside the matmul (a memory-kind device_put in
    the jit, which XLA schedules as an asynchronous copy); its outputs are ready together. Also
    returns the copy alone as its own jit."""
    alone = jax.jit(lambda x: jax.device_put(x, target))
    both = jax.jit(lambda a, x: (chain(a, iters), jax.device_put(x, target)))
    t_alone = timed(lambda _: alone(x))

    def run():
        t0 = time.perf_counter()
        r, y = both(a, x)
        jax.block_until_ready((r, y))
        t = time.perf_counter() - t0
        return t, t
    jax.block_until_ready(both(a, x))  # compiled
    c, b, _ = _medians(run)
    return c, b, t_alone


def measure_small_d2h(jax, jnp, on_dev, on_cpu, timed):
    """Latency of a 4 KB device->host copy, and how long a tiny kernel takes right after one."""
    small = jax.device_put(jnp.ones(1024, jnp.float32), on_dev)
    tiny = jax.jit(lambda x: x + 1)
    t_op = timed(lambda _: tiny(small), repeats=20)
    t_d2h = timed(lambda _: jax.device_put(small, on_cpu), repeats=20)
    after = []
    for _ in range(20):
        jax.block_until_ready(jax.device_put(small, on_cpu))
        t0 = time.perf_counter()
        jax.block_until_ready(tiny(small))
        after.append(time.perf_counter() - t0)
    t_after = statistics.median(after)
    return {"tiny_op_ms": t_op * 1e3, "small_d2h_ms": t_d2h * 1e3,
            "tiny_op_after_d2h_ms": t_after * 1e3, "stall_after_d2h_ms": (t_after - t_op) * 1e3}


def print_report(rows, reference, overlap, latency, probe):
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    print(f"\n{'path':<42} {'dir':<5} {'GB/s':>8} {'vs torch':>9}  engine uses")
    for r in rows:
        if "skipped" in r:
            print(f"{r['path']:<42} {r['direction']:<5} {'skipped':>8}  {r['skipped']}")
            continue
        same = {True: " (zero-copy: the source's memory)", False: " (a copy)"}.get(
            r.get("zero_copy"), "")
        same += {True: " (then put as it is: aliased)", False: " (then put: another copy)"}.get(
            r.get("put_aliases"), "")
        print(f"{r['path']:<42} {r['direction']:<5} {r['gb_per_s']:8.2f} "
              f"{fmt(r.get('ratio_to_torch'), '9.2f'):>9}  {r['engine']}{same}")
    if "skipped" in reference:
        print(f"PyTorch reference: skipped ({reference['skipped']})")
    else:
        print(f"PyTorch {reference['torch']} reference (ratios above are JAX GB/s / these): "
              + ", ".join(f"{k[:-2].replace('_', ' ')} {reference[k + 'gbps']:.2f} GB/s"
                          for k in ("h2d_pinned_", "d2h_pinned_", "h2d_pageable_")))
    print(f"\ncopy while a {overlap['matmul_n']}^3 bf16 matmul chain runs "
          f"({overlap['matmul_tflops']:.3g} TFLOP/s alone):")
    for name, o in overlap["paths"].items():
        if "skipped" in o:
            print(f"  {name:<40} skipped ({o['skipped']})")
        else:
            print(f"  {name:<40} {o['gb_per_s_alone']:7.2f} GB/s alone, "
                  f"{o['gb_per_s_during_matmul']:7.2f} GB/s during matmul, "
                  f"overlap {o['overlap']:.2f}")
    print(f"\nsmall (4 KB) D2H: {latency['small_d2h_ms']:.3f} ms | tiny kernel "
          f"{latency['tiny_op_ms']:.3f} ms alone, {latency['tiny_op_after_d2h_ms']:.3f} ms right "
          f"after a D2H (stall {latency['stall_after_d2h_ms']:+.3f} ms)")
    if "skipped" in probe:
        print(f"pinned_host pool probe: skipped ({probe['skipped']})")
    else:
        for label, p in probe.items():
            print(f"pinned_host pool probe ({label}, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="
                  f"{p['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB']}): got {fmt(p['allocated_gb'], '.2f')} "
                  f"of {p['asked_gb']:.2f} GB{'; ' + p['error'] if p['error'] else ''}")


if __name__ == "__main__":
    sys.exit(main())
