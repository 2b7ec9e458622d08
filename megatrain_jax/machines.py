"""The one table of machines and device peaks: the plan's presets (`MACHINES`), the datasheet bf16
peaks by device kind (`PEAK_BF16_TFLOPS`, which the benchmarks read for MFU), and the local
machine as the plan sees it (`machine_from_device`).

    machine = MACHINES["h100"]                       # or machine_from_device() on this machine
    peak_bf16_tflops("NVIDIA H100 80GB HBM3")        # 989.0

It imports only the standard library (jax when it reads a device), so the command line's help can
list the presets quickly.
"""

import dataclasses
import os

GB = 1e9  # memory and bandwidth figures are in GB and GB/s


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the plan needs to know about a machine. GB = 1e9 bytes.

    device_memory_gb is what the run may use, not the physical size: the presets take 90% of it,
    while JAX's allocator takes 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (set it to
    0.9 to match them). host_memory_gb is the RAM the run may hold.
    """
    name: str
    device_memory_gb: float
    host_memory_gb: float
    bf16_tflops: float  # dense peak
    host_device_gbps: float  # host <-> device, each way, GB/s (1e9 bytes)
    platform: str = "gpu"  # JAX platform of the compute device: picks the attention implementation
    compute_on_host: bool = False  # a CPU-only run: the compute device is the host's own memory
    # compute devices one process sees (distributed.local_devices 0 takes them all); 0: unknown
    # (the presets describe one device of a machine with any number)
    devices: int = 0


_MIB = 2**20 / GB
# Device memory: 90% of what nvidia-smi reports (81559, 143771, 97871 MiB). Host RAM: an H100's
# share of an 8-GPU node with 2 TB, an H200 box with 512 GB, GH200's 480 GB of LPDDR5X. Bus: a
# typical pinned copy each way on PCIe 5 x16, NVLink-C2C's measured host-to-device rate (each below
# its paper rate). The datasheet's bf16 dense peak, the same for all three.
MACHINES = {
    "h100": Machine("H100 SXM 80GB, PCIe 5", 0.9 * 81559 * _MIB, 256, 989, 55),
    "h200": Machine("H200 SXM 141GB, PCIe 5", 0.9 * 143771 * _MIB, 512, 989, 55),
    "gh200": Machine("GH200 96GB HBM3, NVLink-C2C", 0.9 * 97871 * _MIB, 480, 989, 375),
}


# bf16 dense tensor-core peak (no sparsity) from the datasheets, TFLOPS, by device_kind substring
# (as JAX reports it, e.g. "NVIDIA H100 80GB HBM3"): the first match wins, so "GH200" precedes
# "H200" and the H100 PCIe and NVL parts precede "H100" (SXM).
PEAK_BF16_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
                    ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0),
                    ("L4", 121.0), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5", 459.0),
                    ("TPU v6 lite", 918.0))


def peak_bf16_tflops(device_kind: str) -> float | None:
    """The datasheet bf16 dense peak of a device kind (PEAK_BF16_TFLOPS), or None if unknown."""
    kind = device_kind.upper()
    return next((v for k, v in PEAK_BF16_TFLOPS if k.upper() in kind), None)


def _total_ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def machine_from_device(device=None, *, host_memory_gb=None) -> Machine:
    """The local machine: a GPU's usable memory (memory_stats()["bytes_limit"], i.e. after JAX's
    preallocation fraction) and throughput from the matching preset; a CPU computes in host RAM.
    host_memory_gb defaults to the total RAM (not what other processes leave free)."""
    import jax  # here: the table above is read without it
    device = device or jax.devices()[0]
    host = host_memory_gb or _total_ram_gb()
    if device.platform == "cpu":
        return Machine("local CPU", host, host, 0.0, 0.0, platform="cpu", compute_on_host=True,
                       devices=1)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise ValueError(f"{device} reports no memory limit (memory_stats()['bytes_limit'])")
    kind = device.device_kind
    key = next((k for k in ("gh200", "h200", "h100") if k.upper() in kind.upper()), None)
    preset = MACHINES[key or "h100"]
    name = f"local {kind}" + ("" if key else f" (throughput of the {preset.name} assumed)")
    return Machine(name, limit / GB, host, peak_bf16_tflops(kind) or preset.bf16_tflops,
                   preset.host_device_gbps, platform=device.platform,
                   devices=len(jax.local_devices(backend=device.platform)))
