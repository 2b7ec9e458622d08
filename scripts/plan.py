"""Plan a run's host RAM and device memory before starting it (megatrain_jax.plan).

    python scripts/plan.py --config configs/llama3_8b.yaml [key=value ...] [--device h100]
    python scripts/plan.py --config configs/llama3_8b.yaml data.seq_len=131072 --host-memory-gb 128
    python scripts/plan.py --config configs/qwen2_5_7b.yaml --sweep 8192,32768,131072,524288

--device is a preset (h100, h200, gh200; default h100) or `local`: this machine's first device.
--sweep prints one row per sequence length instead of the full report. --json writes the plan
(or the sweep's plans) as JSON. Nothing of the model is allocated; on a CPU it takes seconds to a
minute for an 8B model (it compiles the step's functions to read their workspaces).
"""

import argparse
import dataclasses
import json
import os

from megatrain_jax.cli import run_cli, script_exit
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.plan import GB, MACHINES, format_bytes, machine_from_device, plan


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other bad input
        raise ConfigError(message)


def _machine(args):
    if args.device == "local":
        machine = machine_from_device(host_memory_gb=args.host_memory_gb)
    elif args.device in MACHINES:
        machine = MACHINES[args.device]
    else:
        raise ConfigError(f"--device {args.device!r}: expected local or one of "
                          f"{', '.join(MACHINES)}")
    for key in ("host_memory_gb", "device_memory_gb"):
        value = getattr(args, key)
        if value is not None:
            if value <= 0:
                raise ConfigError(f"--{key.replace('_', '-')} must be > 0, got {value:g}")
            machine = dataclasses.replace(machine, **{key: value})
    return machine


def _seq_lens(text: str) -> list:
    try:
        lens = [int(s) for s in text.split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise ConfigError(f"--sweep {text!r}: expected sequence lengths like 8192,32768")
    return lens


def _sweep_table(rows) -> str:
    head = "| seq_len | host total | device peak | peak phase | offload | fits | largest seq |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for seq, p in rows:
        lines.append(f"| {seq:,} | {format_bytes(p.host_total)} | {format_bytes(p.device_peak)} | "
                     f"{p.peak_phase} | {'on' if p.offload_activations else 'off'} | "
                     f"{'yes' if p.fits else 'no'} | {p.largest_seq_len:,} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    def go():
        parser = _Parser(description=__doc__.splitlines()[0])
        parser.add_argument("--config", help="YAML config file (defaults apply without one)")
        parser.add_argument("overrides", nargs="*", metavar="key=value")
        parser.add_argument("--device", default="h100", help="h100, h200, gh200 or local")
        parser.add_argument("--host-memory-gb", type=float, help="host RAM the run may use (GB)")
        parser.add_argument("--device-memory-gb", type=float,
                            help="device memory the run may use (GB)")
        parser.add_argument("--sweep", help="comma-separated data.seq_len values, one row each")
        parser.add_argument("--json", help="write the plan(s) to this file")
        args = parser.parse_args(argv)
        machine = _machine(args)
        if args.sweep:
            seq_lens = _seq_lens(args.sweep)
            rows = [(s, plan(load_config(args.config, [*args.overrides, f"data.seq_len={s}"]),
                             machine)) for s in seq_lens]
            print(f"{machine.name}: device {format_bytes(machine.device_memory_gb * GB)}, "
                  f"host {format_bytes(machine.host_memory_gb * GB)}")
            print(_sweep_table(rows))
            out = [{"seq_len": s, **p.to_dict()} for s, p in rows]
        else:
            p = plan(load_config(args.config, args.overrides), machine)
            print(p.report())
            out = p.to_dict()
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    return run_cli(go)


if __name__ == "__main__":
    script_exit(main)
