"""The command line: `megatrain train|plan|export|generate|plot ...` (or python -m megatrain_jax).

    megatrain train --config configs/tiny.yaml [key=value ...]       # = scripts/train.py
    megatrain plan --config configs/llama3_8b.yaml [--device h100]   # = scripts/plan.py
    megatrain export --run-dir runs/ft --out hf_out                  # = scripts/export_hf.py
    megatrain generate --run runs/tiny --prompt "CYNIC, n."          # = scripts/generate.py
    megatrain plot runs/a runs/b --out runs.png                      # = scripts/plot.py

Each command is a function here, `fn(argv=None, prog=None) -> exit code`, that the scripts in
scripts/ call too. Exit codes as in megatrain_jax.cli: 0 done, 2 bad input (one line on stderr,
`error: ...`), 1 a fault during the run. The heavy imports (jax, the model) wait until a command
runs, so `megatrain --help` is quick.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

# both import only the standard library: `megatrain --help` stays quick
from megatrain_jax import step_time
from megatrain_jax.machines import MACHINES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other bad input
        from megatrain_jax.config import ConfigError
        raise ConfigError(message)

    def add_config(self):
        """--config, given at most once: argparse would keep the last one and drop the first
        whole, config and all, with no word."""
        self.add_argument("--config", action=_Once,
                          help="YAML config file (defaults apply without one)")


class _Once(argparse.Action):
    """An option that may be given once (one run, one config file: its keys are overridden one
    by one with key=value, which the run's config.yaml then records)."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = getattr(namespace, self.dest)
        if first is not None:
            from megatrain_jax.config import ConfigError
            raise ConfigError(f"{option_string} given twice ({first}, then {values}); give one "
                              f"config file and change its keys with key=value overrides")
        setattr(namespace, self.dest, values)


def _run(parse, go, *, xla: bool = True) -> int:
    """run_cli(go(parse())): a bad argument is a one-line error and exit 2 as well, and so, for
    a command that starts XLA (`xla`), is a setting of XLA's pinned host pool that is no
    size."""
    from megatrain_jax.cli import run_cli

    def run():
        args = parse()
        if xla:
            _check_pool_variable()
        go(args)

    return run_cli(run)


def _check_pool_variable():
    """Raises ConfigError for an XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB that is no size (inf, nan,
    abc): the plan sizes the pinned host pool by it, on any machine."""
    from megatrain_jax.config import ConfigError
    from megatrain_jax.engine.bus import pinned_pool_bytes
    try:
        pinned_pool_bytes()
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------- train

TRAIN_HELP = "Train a model on the streamed engine."


def train(argv=None, prog=None) -> int:
    """`megatrain train --config FILE [key=value ...]`: overrides are dotted config keys,
    e.g. `train.steps=20 run_dir=/tmp/run data.seq_len=256`."""
    parser = _Parser(prog=prog, description=TRAIN_HELP,
                     epilog="Overrides are dotted config keys: train.steps=20 run_dir=/tmp/run "
                            "data.seq_len=256 (every key: megatrain_jax/config.py).")
    parser.add_config()
    parser.add_argument("overrides", nargs="*", metavar="key=value")

    def go(args):
        from megatrain_jax.recipes import load_config  # model.from_hf read too
        from megatrain_jax.train import train as train_run
        cfg = load_config(args.config, args.overrides)
        train_run(cfg, console=terminal_console())

    return _run(lambda: parser.parse_args(argv), go)


def terminal_console():
    """A rich Console on stdout when stdout is a terminal and rich is installed (the live
    progress bar), else None (plain lines only: CI, nohup, a pipe)."""
    if not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()


# ----------------------------------------------------------------------------- plan

PLAN_HELP = "Plan a run's host RAM and device memory before starting it."
PLAN_EPILOG = """\
--device is a preset ({presets}; default h100) or `local`: this machine's first device.
--sweep prints one row per sequence length instead of the full report. --json writes the plan
(or the sweep's plans) as JSON. Nothing of the model is allocated; on a CPU it takes seconds to a
minute for an 8B model (it compiles the step's functions to read their workspaces). The host RAM
table gives each kind's bytes a parameter of the model as well.

--largest-model adds the largest model of the config's shape family that fits the machine. The
family: the config's width (hidden_size, intermediate_size, heads, vocabulary) at any depth, so
model.num_layers is varied and every other key (sequence, batch, dtypes, offload) stays as
configured; it reports that depth and its parameters.

--step-time predicts the step time instead (megatrain_jax.step_time): a timeline of the engine's
schedule from component rates, which default to the --device preset's bus and bf16 peak (host
update {host_update_gbps:g} GB/s, the hop between clients {hop_gbps:g} GB/s, dispatch
{dispatch_us:g} us), are read from measured results with --rates (a folder the GPU checklist
wrote, or a step-time JSON) and overridden one by one by --h2d-gbps, --d2h-gbps, --tflops,
--host-update-gbps, --hop-gbps, --dispatch-us. With --rates, a bench.py
result there of the same step is compared with the prediction.""".format(
    presets=", ".join(MACHINES), **step_time.DEFAULTS)

RATE_FLAGS = {"h2d_gbps": "--h2d-gbps", "d2h_gbps": "--d2h-gbps", "device_tflops": "--tflops",
              "host_update_gbps": "--host-update-gbps", "hop_gbps": "--hop-gbps",
              "dispatch_us": "--dispatch-us"}


def _machine(args):
    from megatrain_jax.config import ConfigError
    from megatrain_jax.machines import machine_from_device
    if args.device == "local":
        machine = machine_from_device(host_memory_gb=args.host_memory_gb)
    elif args.device in MACHINES:
        machine = MACHINES[args.device]
    else:
        raise ConfigError(f"--device {args.device!r}: expected local or one of "
                          f"{', '.join(MACHINES)}")
    for key in ("host_memory_gb", "device_memory_gb", "devices"):
        value = getattr(args, key)
        if value is not None:
            if not 0 < value < math.inf:
                what = "> 0" if key == "devices" else "a finite number > 0"
                raise ConfigError(f"--{key.replace('_', '-')} must be {what}, got {value:g}")
            machine = dataclasses.replace(machine, **{key: value})
    return machine


def _seq_lens(text: str) -> list:
    from megatrain_jax.config import ConfigError
    try:
        lens = [int(s) for s in text.split(",")]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise ConfigError(f"--sweep {text!r}: expected sequence lengths like 8192,32768")
    return lens


def _sweep_table(rows) -> str:
    from megatrain_jax.plan_report import format_bytes
    head = "| seq_len | host total | device peak | peak phase | offload | fits | largest seq |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for seq, p in rows:
        lines.append(f"| {seq:,} | {format_bytes(p.host_total)} | {format_bytes(p.device_peak)} | "
                     f"{p.peak_phase} | {'on' if p.offload_activations else 'off'} | "
                     f"{'yes' if p.fits else 'no'} | {p.largest_seq_len:,} |")
    return "\n".join(lines)


def plan(argv=None, prog=None) -> int:
    """`megatrain plan --config FILE [key=value ...] [--device h100] [--sweep 8192,32768]
    [--json FILE]`: prints the memory plan of the run (megatrain_jax.plan)."""
    parser = _Parser(prog=prog, description=PLAN_HELP, epilog=PLAN_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_config()
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--device", default="h100", help=f"{', '.join(MACHINES)} or local")
    parser.add_argument("--host-memory-gb", type=float, help="host RAM the run may use (GB)")
    parser.add_argument("--device-memory-gb", type=float, help="device memory the run may use (GB)")
    parser.add_argument("--devices", type=int, help="compute devices the machine has (a preset's "
                        "count is unknown: distributed.local_devices 0 is planned as 1)")
    parser.add_argument("--sweep", help="comma-separated data.seq_len values, one row each")
    parser.add_argument("--json", help="write the plan(s) to this file")
    parser.add_argument("--largest-model", action="store_true",
                        help="also the most layers (model.num_layers) of the config's width "
                             "that fit, as layers and parameters")
    parser.add_argument("--step-time", action="store_true",
                        help="predict the step time (a timeline simulation) instead")
    parser.add_argument("--rates", help="measured rates: a results folder or a step-time JSON")
    for key, flag in RATE_FLAGS.items():
        parser.add_argument(flag, dest=key, type=float, help=f"rate: {key}")

    def go(args):
        from megatrain_jax.config import ConfigError
        from megatrain_jax.recipes import load_config  # model.from_hf read too
        from megatrain_jax.machines import GB
        from megatrain_jax.plan import plan as make_plan, plan_sweep
        from megatrain_jax.plan_report import format_bytes
        if args.json:
            _check_json_out(args.json)
        machine = _machine(args)
        if args.largest_model and (args.step_time or args.sweep):
            raise ConfigError(f"--largest-model goes with the plan's report, not with "
                              f"{'--step-time' if args.step_time else '--sweep'}")
        config = lambda *extra: _split_batch(load_config(args.config, [*args.overrides, *extra]),
                                             machine)
        if args.step_time:
            out = _step_time(config(), machine, args)
        elif args.sweep:
            seq_lens = _seq_lens(args.sweep)
            rows = list(zip(seq_lens, plan_sweep([config(f"data.seq_len={s}") for s in seq_lens],
                                                 machine)))
            print(f"{machine.name}: device {format_bytes(machine.device_memory_gb * GB)}, "
                  f"host {format_bytes(machine.host_memory_gb * GB)}")
            print(_sweep_table(rows))
            out = [{"seq_len": s, **p.to_dict()} for s, p in rows]
        else:
            cfg = config()
            p = make_plan(cfg, machine)
            print(p.report())
            if args.largest_model:
                print(p.largest_model_line())
            lines = plan_advice(cfg, machine, p, args)
            print("\n".join(lines))
            out = {**p.to_dict(), "advice": lines}
            if args.largest_model:
                out["largest_model"] = p.largest_model
        if args.json:
            _write_json(args.json, out)

    return _run(lambda: parser.parse_args(argv), go)


def _split_batch(cfg, machine):
    """cfg, once its data.batch_size splits over the devices the run would have on `machine`
    (else the ConfigError train gives, before it plans)."""
    from megatrain_jax.distributed import check_batch
    from megatrain_jax.flops import local_devices
    processes = cfg.distributed.num_processes
    check_batch(cfg.data.batch_size, (local_devices(cfg, machine) or 1) * processes, processes)
    return cfg


def _write_json(path: str, out):
    """Writes `out` to --json `path`. A regular file (or a new one) is written whole or not at
    all: into a temporary file beside it, then renamed over it, so a failed write (a full disk)
    leaves the file that was there as it was, and no partial one; anything else (/dev/stdout)
    is written as is. A failed write is one ConfigError line."""
    from megatrain_jax.config import ConfigError
    text = json.dumps(out, indent=1)
    special = os.path.exists(path) and not os.path.isfile(path)
    target = path if special else os.path.realpath(path)  # a link: the file it names
    tmp = None if special else f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp or target, "w") as f:
            f.write(text)
        if tmp:
            os.replace(tmp, target)
    except OSError as e:
        kept = "" if special else ("; the file there is as it was" if os.path.exists(target)
                                   else "; no file was left")
        raise ConfigError(f"--json {path}: writing it failed ({e.strerror}){kept}") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.remove(tmp)


def _check_json_out(path: str):
    """Raises ConfigError, before any planning, if --json `path` cannot be written: a directory,
    a folder that cannot be made, or a file that cannot be opened for writing (tried by opening
    it to append, which changes nothing of a file there; one made by the try is removed). Makes
    the folder."""
    from megatrain_jax.config import ConfigError
    if os.path.isdir(path):
        raise ConfigError(f"--json {path} is a directory; give the name of the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror
        raise ConfigError(f"--json {path}: cannot make its folder {folder} ({why})") from None
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"--json {path} cannot be written ({e.strerror})") from None
    if not existed:
        os.remove(path)


def _rates(machine, args, shape=None) -> tuple:
    """step_time.resolve_rates from the command's --rates and rate flags, each checked: (rates,
    where each comes from, a bench.py result of the same step or None)."""
    from megatrain_jax.config import ConfigError
    flags = {}
    for key, flag in RATE_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            if not step_time.valid_rate(key, value):
                least = ">= 0" if key == "dispatch_us" else "> 0"
                raise ConfigError(f"{flag} must be a finite number {least}, got {value:g}")
            flags[key] = (value, flag)
    if args.rates and not os.path.exists(args.rates):
        raise ConfigError(f"--rates {args.rates}: no such file or folder")
    try:
        return step_time.resolve_rates(machine, flags, args.rates, shape)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--rates {args.rates}: {e}") from None


def plan_advice(cfg, machine, run_plan, args) -> list:
    """The advice a run prints after its first steps (megatrain_jax.advice), from predicted
    quantities: the step-time model's step at run_plan's activation offload, its device peak."""
    from megatrain_jax import advice
    if machine.bf16_tflops <= 0 and args.device_tflops is None and not args.rates:
        return [f"advice: none before the run: {machine.name} has no known peak for the step-time "
                f"model (--tflops, --rates); the run advises after its first steps"]
    shape = step_time.step_shape(cfg, run_plan.offload_activations, devices=machine.devices,
                                 bus=run_plan.bus, execution=run_plan.execution)
    prediction = step_time.simulate(shape, _rates(machine, args, shape)[0])
    return advice.for_plan(cfg, machine, run_plan, prediction)


def _step_time(cfg, machine, args) -> dict:
    """Prints the step-time prediction of cfg; returns it as plain data."""
    offload = cfg.train.offload_activations is True
    from megatrain_jax.flops import devices_assumed
    shape = step_time.step_shape(cfg, offload, devices=machine.devices)
    rates, sources, bench = _rates(machine, args, shape)
    prediction = step_time.simulate(shape, rates)
    peak = machine.bf16_tflops or step_time.DEFAULTS["device_tflops"]
    print(f"step: {shape.micro_batches} micro-batch(es), {shape.tokens_per_step:,} tokens, "
          f"{shape.layers} layers, prefetch {shape.prefetch}, activations "
          f"{'offloaded' if offload else 'kept on the device'}"
          + ("" if offload or cfg.train.offload_activations is False else
             " (train.offload_activations=auto taken as off, as scripts/bench.py runs it)")
          + ("; the first stage on the host (the host lookup: its rows cross, not its weights)"
             if shape.host_lookup else ""))
    print(prediction.report(peak))
    assumed = devices_assumed(cfg, machine)
    if assumed:
        print(f"note: {assumed}")
    for key, source in sources.items():
        print(f"  {key:<17} {source}")
    out = {"kind": "step_time", **prediction.to_dict(), "rate_sources": sources,
           "mfu_vs_datasheet": prediction.mfu(peak), "datasheet_tflops": peak}
    if bench is not None:
        out["compare"] = step_time.compare(prediction, bench)
        c = out["compare"]
        print("against bench.py's measurement of the same step: predicted / measured")
        for key, predicted in c["predicted"].items():
            measured = c["measured"][key]
            print(f"  {key:<23}{predicted:>10.4g} / " + ("n/a" if measured is None else
                                                         f"{measured:.4g}"))
    return out


# ----------------------------------------------------------------------------- export

EXPORT_HELP = ("Export a checkpoint as a Hugging Face model directory (safetensors shards + index "
               "+ config.json).")


def export(argv=None, prog=None) -> int:
    """`megatrain export --run-dir DIR --out HF_DIR [--step N] [--dtype bfloat16]
    [--shard-size 2GB]`: reads only the parameters of the checkpoint, a shard at a time; needs no
    GPU. The result loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`."""
    parser = _Parser(prog=prog, description=EXPORT_HELP,
                     epilog="Reads only the parameters of the checkpoint, a shard at a time; needs "
                            "no GPU. The result loads with "
                            "transformers.AutoModelForCausalLM.from_pretrained(out).")
    parser.add_argument("--run-dir", required=True, help="the run directory (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="the HF directory to write (new or empty)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    from megatrain_jax.hf import EXPORT_DTYPES
    parser.add_argument("--dtype", default="float32", choices=list(EXPORT_DTYPES))
    parser.add_argument("--shard-size", default="2GB", help="largest shard, e.g. 2GB, 500MB")

    def go(args):
        from megatrain_jax.hf import export_checkpoint
        export_checkpoint(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                          shard_size=args.shard_size)

    return _run(lambda: parser.parse_args(argv), go)


# ----------------------------------------------------------------------------- plot

PLOT_HELP = "Plot runs' train and eval loss and tokens/s against the step, overlaid."


def plot(argv=None, prog=None) -> int:
    """`megatrain plot RUN_DIR [RUN_DIR ...] [--out PNG]`: a PNG of the runs' metrics.jsonl
    (megatrain_jax.plot); default out: RUN_DIR/metrics.png for one run, metrics.png for several."""
    parser = _Parser(prog=prog, description=PLOT_HELP,
                     epilog="Needs matplotlib: pip install 'megatrain-jax[plot]'.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory")
    parser.add_argument("--out", help="the picture to write: PNG, or the format its suffix "
                                      "names (.svg, .pdf, ...); a directory: DIR/metrics.png")

    def go(args):
        from megatrain_jax.plot import plot_runs
        out = args.out or (os.path.join(args.run_dirs[0], "metrics.png")
                           if len(args.run_dirs) == 1 else "metrics.png")
        print(f"wrote {plot_runs(args.run_dirs, out)}")

    return _run(lambda: parser.parse_args(argv), go, xla=False)


# ----------------------------------------------------------------------------- generate

GENERATE_HELP = "Sample from a run's checkpoint or a Hugging Face model, with a KV cache."
GENERATE_EPILOG = """\
The layers stream through the device one at a time for the prompt and then for every new token, as
in training, so a model larger than the device generates too. --temperature 0 is greedy decoding
(transformers' generate(do_sample=False)); otherwise each token is drawn at that temperature from
the smallest set of most likely tokens whose probability reaches --top-p, reproducibly from --seed.
The prompt is tokenized as the run trained (its data.tokenizer, no special tokens added), or with
the HF directory's tokenizer.json as transformers' tokenizer(prompt) does (BOS added). Generation
stops at the model's EOS, after --max-new-tokens, or when the context is full (a run's
data.seq_len, or max_position_embeddings of its or the directory's config.json)."""


def generate(argv=None, prog=None) -> int:
    """`megatrain generate (--run RUN_DIR [--step N] | --hf DIR) --prompt TEXT
    [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--dtype D]`: prints the prompt
    and its continuation as it is generated, then a line of timings on stderr."""
    parser = _Parser(prog=prog, description=GENERATE_HELP, epilog=GENERATE_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="RUN_DIR", help="a training run's directory")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face model directory")
    parser.add_argument("--step", type=int, help="the run's checkpoint step (default: the latest)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="compute dtype (default: the run's train.compute_dtype; with --hf "
                             "float32 on a CPU, bfloat16 on an accelerator)")

    def go(args):
        from megatrain_jax import generate as gen
        from megatrain_jax.config import ConfigError
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        gen.check_temperature(args.temperature)
        if not 0 < args.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p:g}")
        if args.step is not None and not args.run:
            raise ConfigError("--step is a checkpoint step of --run; --hf has none")
        if not -(1 << 63) <= args.seed < 1 << 63:
            raise ConfigError(f"--seed must fit in 64 bits (-2**63 to 2**63 - 1), got {args.seed}")
        _check_utf8(args.prompt)
        if args.run:
            model = gen.from_run(args.run, args.step)
        else:
            model = gen.from_hf(args.hf)
        dtype = args.dtype
        if dtype is None and args.hf:
            import jax
            dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
        tokenizer = model.tokenizer
        prompt = tokenizer.encode(args.prompt)
        gen.check_length(model, len(prompt))  # before the weights are read
        out = _TextStream(tokenizer)
        print(args.prompt, end="", flush=True)
        stats = {}
        try:
            gen.generate(model, prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         eos_ids=tokenizer.eos_ids, on_token=out.add, compute_dtype=dtype,
                         stats=stats)
        except BaseException:
            print(flush=True)  # an error goes on a line of its own, not after the prompt's text
            raise
        out.finish()
        why = (f"; stopped at the model's context of {model.context:,} tokens "
               f"({model.context_source})" if stats["stopped_at_context"] else "")
        rate = (stats["new_tokens"] - 1) / stats["decode_s"] if stats["decode_s"] > 0 else 0.0
        print(f"{stats['new_tokens']} tokens from {model.what}: prompt {stats['prompt_tokens']} "
              f"tokens in {stats['prefill_s']:.2f} s (compiling included), then "
              f"{rate:.1f} tokens/s{why}", file=sys.stderr)

    return _run(lambda: parser.parse_args(argv), go)


def _check_utf8(prompt: str):
    """Raises ConfigError if the --prompt's bytes are not UTF-8 (Python hands such bytes of the
    command line over as lone surrogates, which no tokenizer can encode)."""
    from megatrain_jax.config import ConfigError
    try:
        os.fsencode(prompt).decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as e:
        raw = e.object[e.start:e.start + 1]
        byte = f"byte 0x{raw[0]:02x}" if isinstance(raw, bytes) else f"character {raw!r}"
        raise ConfigError(f"--prompt is not valid UTF-8 ({byte} at offset {e.start}); give the "
                          f"prompt as UTF-8 text") from None


class _TextStream:
    """Prints generated text as its tokens arrive: the decoded continuation's new characters,
    held back while they end in an incomplete character (a byte-level tokenizer's half of a
    UTF-8 sequence decodes to U+FFFD until the rest comes)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def add(self, token: int):
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def finish(self):
        text = self.tokenizer.decode(self.ids)
        print(text[len(self.printed):] if text.startswith(self.printed) else "", flush=True)


# ----------------------------------------------------------------------------- megatrain

COMMANDS = {"train": (train, TRAIN_HELP), "plan": (plan, PLAN_HELP),
            "export": (export, EXPORT_HELP), "generate": (generate, GENERATE_HELP),
            "plot": (plot, PLOT_HELP)}


def usage(prog: str) -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {prog} {{{','.join(COMMANDS)}}} [options]", "",
             "Train models larger than GPU memory on one GPU (megatrain_jax).", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", f"`{prog} COMMAND --help` lists a command's options."]
    return "\n".join(lines)


def run(argv=None, prog: str = "megatrain") -> int:
    """Dispatches `argv` (default sys.argv[1:]) to a command; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"error: unknown command {name!r}{hint}; expected one of {', '.join(COMMANDS)} "
              f"(`{prog} --help`)", file=sys.stderr)
        return 2
    return COMMANDS[name][0](rest, prog=f"{prog} {name}")


def main(argv=None, prog: str = "megatrain"):
    """The console script `megatrain` (and `python -m megatrain_jax`): exits with run()'s code.
    `train` from the command line runs again at once with glibc's allocations on transparent huge
    pages (hostmem.with_huge_pages; MEGATRAIN_HUGE_PAGES=0 runs it as started)."""
    if argv is None and sys.argv[1:2] == ["train"]:
        from megatrain_jax import hostmem
        hostmem.with_huge_pages()
    from megatrain_jax.cli import script_exit
    script_exit(lambda: run(argv, prog))
