"""Typed run configuration: small frozen dataclasses, loaded from YAML with dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "run_dir=/tmp/run"])

Every mistake (unknown key, wrong type, inconsistent sizes) raises `ConfigError` with a one-line
message that names the key. This module reads no model files: a config with `model.from_hf` is
loaded by `megatrain_jax.recipes.load_config`, which passes in the reader of a HF directory.
"""

import dataclasses
import difflib
import json
import math
import os
import re
import typing

import yaml

from megatrain_jax.attention import DEFAULT_BLOCK, IMPLEMENTATIONS
from megatrain_jax.engine.bus import FORMS as BUS_FORMS
from megatrain_jax.engine.fused_adamw import STATE_DTYPES
from megatrain_jax.engine.transfer import COPIES
from megatrain_jax.errors import ConfigError
from megatrain_jax.model import ModelConfig


SCHEDULES = ("cosine", "linear", "constant", "wsd")  # optimizer.schedule
FORMATS = ("text", "sft", "preference")  # data.format
OVERLONG = ("truncate", "skip")  # data.overlong (sft: a conversation longer than seq_len + 1)
DPO_LOSSES = ("sigmoid", "ipo")  # dpo.loss (megatrain_jax/dpo.py)
COMPUTE_DTYPES = ("bfloat16", "float32")  # train.compute_dtype, train.grad_dtype


def did_you_mean(key: str, choices, prefix: str = "") -> str:
    """` (did you mean <prefix><closest>?)` for the closest of choices to key, or ""."""
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _at_least(least: int, section: str, **values):
    """Refuses the first of values (section keys) under least."""
    for key, value in values.items():
        if value < least:
            raise ConfigError(f"{section}.{key} must be >= {least}, got {value}")


def _true_false_auto(key: str, value):
    if value not in (True, False, "auto"):
        raise ConfigError(f"{key} must be true, false or auto, got {value!r}")


def _one_of(key: str, value: str, choices):
    """Refuses a value not among choices, suggesting the closest."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}"
                          f"{did_you_mean(value, choices)}")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 10  # linear warmup from 0 to learning_rate
    # After the warmup: cosine or linear decay to learning_rate * min_lr_ratio at train.steps,
    # constant, or wsd (warmup-stable-decay: constant, then a linear decay over the last
    # decay_fraction of train.steps to learning_rate * min_lr_ratio).
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.1  # wsd only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only: never to norms or biases
    max_grad_norm: float = 1.0  # global-norm clipping; 0 turns it off
    # The Adam moments' dtype in host memory: float32 (exact AdamW), or bfloat16, stochastically
    # rounded at each update (not bit-equal to fp32 AdamW; 4 B a parameter less, 8 B less update
    # traffic; engine/fused_adamw.py).
    state_dtype: str = "float32"
    # The fused AdamW kernel's threads on the host: null (every CPU of the process's affinity,
    # measured fastest for the update alone), or fewer, pinned to the first CPUs, so the thread
    # that dispatches the device's work keeps a CPU of its own (at most the CPUs: checked when
    # the engine is built, on the machine that runs it).
    host_threads: typing.Optional[int] = None

    def check(self):
        if self.learning_rate <= 0:
            raise ConfigError(f"optimizer.learning_rate must be > 0, got {self.learning_rate}")
        if self.max_grad_norm < 0:
            raise ConfigError(f"optimizer.max_grad_norm must be >= 0, got {self.max_grad_norm}")
        for key, ok, rule in [
                ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
                ("b1", 0 <= self.b1 < 1, "in [0, 1)"), ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
                ("eps", self.eps >= 0, ">= 0"), ("weight_decay", self.weight_decay >= 0, ">= 0"),
                ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                ("decay_fraction", 0 < self.decay_fraction <= 1, "in (0, 1]")]:
            if not ok:
                raise ConfigError(f"optimizer.{key} must be {rule}, got {getattr(self, key)}")
        _one_of("optimizer.schedule", self.schedule, SCHEDULES)
        _one_of("optimizer.state_dtype", self.state_dtype, STATE_DTYPES)
        if self.host_threads is not None and (isinstance(self.host_threads, bool) or not isinstance(
                self.host_threads, int) or self.host_threads < 1):
            raise ConfigError(f"optimizer.host_threads must be an integer >= 1 (null: every CPU), "
                              f"got {self.host_threads!r}")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One source of a data.sources mixture."""
    path: str = ""  # a file, glob or directory of shards, as data.path
    weight: float = 1.0  # the share of windows drawn from it: weight / the sum of the weights
    text_field: str = ""  # "": data.text_field
    token_dtype: str = ""  # "": data.token_dtype

    def check(self, i: int):
        """As data.sources.<i>."""
        if not self.path:
            raise ConfigError(f"data.sources.{i}.path is empty; give a file, glob or directory")
        if not 0 < self.weight < math.inf:
            raise ConfigError(f"data.sources.{i}.weight must be a finite number > 0, got "
                              f"{self.weight} ({self.path})")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # A file, a glob (data/*.parquet) or a directory of shards (a datasets.save_to_disk directory
    # too): .jsonl, .parquet, .arrow, text, .bin or .npy; see megatrain_jax/sources/files.py.
    path: str = "megatrain_jax/texts/devils_dictionary.txt"
    tokenizer: str = "byte"  # "byte" or a tokenizer.json path
    eos_token: str = ""  # the document separator of a tokenizer.json; "": </s>, <|endoftext|>, ...
    text_field: str = "text"  # for .jsonl
    token_dtype: str = "uint16"  # for .bin token files
    seq_len: int = 128
    batch_size: int = 8  # sequences per micro-batch
    micro_batches: int = 1  # micro-batches per optimizer step (gradient accumulation)
    # Packed documents attend only within themselves (segment ids from the EOS positions) and
    # their RoPE positions restart at each document.
    document_mask: bool = False
    # Held-out evaluation data (see train.eval_every): a separate file in any data.path format, or
    # the fraction in (0, 0.5] of data.path's tokens taken from its end and never trained on.
    # At most one of the two; "" and 0: no evaluation.
    eval_path: str = ""
    eval_fraction: float = 0.0
    # text: data.path is a corpus (text, .jsonl of text_field, .bin, .npy). sft: a JSONL of chat
    # conversations ({"messages": [...]} or {"prompt", "completion"} per line) rendered with the
    # chat template next to data.tokenizer, loss on the assistant tokens only, packed into rows
    # with document masks (data.document_mask is then on). See megatrain_jax/chat.py.
    # preference: a JSONL of pairs ({"prompt", "chosen", "rejected"}, as text or message lists),
    # one row per sequence, loss on the completion tokens; see megatrain_jax/preference.py and
    # the dpo: section.
    format: str = "text"
    # sft: a conversation over data.seq_len is truncated or skipped; preference: a pair with a
    # sequence over data.seq_len
    overlong: str = "truncate"
    # Instead of data.path (format text): a weighted mixture, a list of {path, weight, text_field,
    # token_dtype}; each window of a batch comes from one source drawn by weight.
    sources: tuple[SourceConfig, ...] = ()
    # Where token caches live (tokenized once, reused by every run on the same data and by
    # resumes): "" is ~/.cache/megatrain_jax/tokens ($XDG_CACHE_HOME), shared by this user's runs.
    cache_dir: str = ""

    def check(self):
        _at_least(1, "data", seq_len=self.seq_len, batch_size=self.batch_size,
                  micro_batches=self.micro_batches)
        if self.eval_path and self.eval_fraction:
            raise ConfigError(f"data.eval_path ({self.eval_path!r}) and data.eval_fraction "
                              f"({self.eval_fraction}) are both set; give one held-out split")
        if self.eval_fraction and not 0 < self.eval_fraction <= 0.5:
            raise ConfigError(f"data.eval_fraction must be 0 (none) or in (0, 0.5], "
                              f"got {self.eval_fraction}")
        for i, source in enumerate(self.sources):
            source.check(i)
            first = next(j for j, s in enumerate(self.sources) if s.path == source.path)
            if first != i:  # a mixture's position on resume is kept per path
                raise ConfigError(f"data.sources.{i}.path repeats data.sources.{first}.path "
                                  f"({source.path}); give each source once (its weight sets its "
                                  f"share)")
        if not math.isfinite(sum(s.weight for s in self.sources)):
            raise ConfigError(f"data.sources: the weights sum to inf ("
                              f"{' + '.join(f'{s.weight:g}' for s in self.sources)}); only "
                              f"their ratios matter: scale them down")
        if self.sources and self.format != "text":
            raise ConfigError(f"data.sources (a mixture) is for data.format=text, got "
                              f"data.format={self.format}; give data.path")
        if self.sources and self.eval_fraction:
            raise ConfigError("data.eval_fraction with data.sources: give the held-out data as "
                              "data.eval_path")
        _one_of("data.format", self.format, FORMATS)
        _one_of("data.overlong", self.overlong, OVERLONG)
        if self.format in ("sft", "preference"):
            self._check_chat()

    def _check_chat(self):
        """data.format sft or preference."""
        if not self.document_mask:
            why = ("SFT packs several conversations per row, kept apart by document masks"
                   if self.format == "sft" else "its rows mark their padding with segment ids")
            raise ConfigError(f"data.document_mask=false with data.format={self.format}: {why}; "
                              f"leave data.document_mask out or set it true")
        if not self.tokenizer.endswith(".json"):
            raise ConfigError(f"data.format={self.format} needs data.tokenizer to be a "
                              f"tokenizer.json with the model's chat template beside it, "
                              f"got {self.tokenizer!r}")
        if self.format == "preference" and self.batch_size % 2:
            raise ConfigError(f"data.batch_size must be even with data.format=preference (rows: "
                              f"the chosen and the rejected of each pair), got {self.batch_size}")
        if self.format == "preference" and (self.eval_path or self.eval_fraction):
            raise ConfigError("data.eval_path and data.eval_fraction are not supported with "
                              "data.format=preference yet; leave them out")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # total optimizer steps of the run
    seed: int = 0
    compute_dtype: str = "bfloat16"  # dtype of streamed weights and device compute
    grad_dtype: str = "float32"  # gradients to and on the host; bfloat16 saves 2 B/param, inexact
    prefetch: int = 1  # layers in flight ahead of the computing one
    log_every: int = 1
    # Each layer's saved input goes to host memory between forward and backward: true, false, or
    # auto (on when the plan says the device would not hold them).
    offload_activations: typing.Union[bool, str] = "auto"
    # An untied embedding looked up on the host (engine/lookup.py: its rows cross, not its table):
    # true (wherever it serves: one compute device, untied), false, or auto (where it also moves
    # fewer bytes a step). The plan and the step-time model follow the same rule.
    host_lookup: typing.Union[bool, str] = "auto"
    attention: str = "auto"  # auto (cudnn on a GPU where it can, else blockwise), cudnn, blockwise, xla
    # blockwise attention's block of queries and keys; 0: the fastest measured on the platform
    # that divides train.tile_size (attention.MEASURED), else 512
    attention_block: int = 0
    tile_size: int = 8192  # tokens per tile of the block over the sequence (its backward holds one
    # tile's workspace; megatrain_jax/seqtile.py); 0: none
    loss_chunk: int = 2048  # tokens per chunk of the cross-entropy (the logits never exist whole)
    loss_vocab_chunk: int = 0  # vocabulary chunk of the cross-entropy; 0: the whole vocabulary
    max_bad_steps: int = 3  # consecutive steps with a non-finite gradient before the run stops
    # Run a config the memory plan says does not fit (the plan is printed, the override said):
    # for a plan that over-estimates, e.g. one compiled on the CPU for a GPU.
    ignore_plan: bool = False
    # With data.eval_path or data.eval_fraction: evaluate every eval_every steps (0: only at the
    # end; always at the last step) on the first eval_batches batches of the held-out tokens.
    eval_every: int = 0
    eval_batches: int = 4

    def check(self):
        _at_least(1, "train", steps=self.steps, log_every=self.log_every,
                  eval_batches=self.eval_batches, loss_chunk=self.loss_chunk,
                  max_bad_steps=self.max_bad_steps)
        _at_least(0, "train", prefetch=self.prefetch, tile_size=self.tile_size,
                  loss_vocab_chunk=self.loss_vocab_chunk, attention_block=self.attention_block)
        for key in ("compute_dtype", "grad_dtype"):
            if getattr(self, key) not in COMPUTE_DTYPES:
                raise ConfigError(f"train.{key} must be bfloat16 or float32, "
                                  f"got {getattr(self, key)!r}")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0 (0: only at the end), "
                              f"got {self.eval_every}")
        _true_false_auto("train.offload_activations", self.offload_activations)
        _true_false_auto("train.host_lookup", self.host_lookup)
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(f"train.attention must be one of {', '.join(IMPLEMENTATIONS)}, "
                              f"got {self.attention!r}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: only at the end and on a signal
    keep: int = 3
    async_save: bool = dataclasses.field(default=True, metadata={"yaml": "async"})
    resume_step: int = -1  # -1: the latest complete checkpoint; N: step N, which must be the latest
    # Keys of RESUME_KEYS that may differ from the checkpoint a run resumes from, e.g. [train.steps]
    # to extend a finished run, [data.sources] to add, drop or reweight a mixture's sources (each
    # kept source goes on where it was, an added one starts at its beginning); every allowed
    # change is logged. data.sources listed in another order is no change.
    allow_changes: tuple[str, ...] = ()

    def check(self, cfg: "Config"):
        """cfg: the whole config, which checkpoint.allow_changes names keys of."""
        _at_least(1, "checkpoint", keep=self.keep)
        _at_least(0, "checkpoint", every=self.every)
        if self.resume_step < -1:
            raise ConfigError(f"checkpoint.resume_step must be a step >= 0 or -1 (the latest), "
                              f"got {self.resume_step}")
        under = lambda key, keys: any(k == key or k.startswith(key + ".") for k in keys)
        for key in self.allow_changes:  # a key or a section, e.g. train.steps, optimizer
            flat = _flatten(to_dict(cfg))
            if not under(key, flat):
                sections = {k.rpartition(".")[0] for k in flat} - {""}
                raise ConfigError(f"checkpoint.allow_changes: unknown config key {key}"
                                  f"{did_you_mean(key, [*flat, *sections])}")
            if not under(key, resume_keys(cfg)):
                raise ConfigError(f"checkpoint.allow_changes: {key} is never compared on resume "
                                  f"(it may change freely); compared: {', '.join(RESUME_KEYS)}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    # TensorBoard event files under <run_dir>/tb, when tensorboardX is installed (the extra
    # `tensorboard`); false: none.
    tensorboard: bool = True
    # Weights & Biases (the extra `wandb`): the run's metrics and config; `mode: offline` (or
    # WANDB_MODE=offline) writes under <run_dir>/wandb with no network, `wandb sync` uploads later.
    wandb: bool = False
    wandb_project: str = "megatrain_jax"
    wandb_mode: str = "online"  # online or offline
    # The device's bf16 dense peak in TFLOPS, the denominator of MFU; 0: from the table of known
    # devices (megatrain_jax.machines.PEAK_BF16_TFLOPS), and no MFU on a device not in it (a CPU).
    peak_tflops: float = 0.0

    def check(self):
        if self.peak_tflops < 0:
            raise ConfigError(f"logging.peak_tflops must be >= 0 (0: from the device's name), "
                              f"got {self.peak_tflops}")
        if self.wandb_mode not in ("online", "offline"):
            raise ConfigError(f"logging.wandb_mode must be online or offline, "
                              f"got {self.wandb_mode!r}")


# offload: where each layer's fp32 master weights and optimizer state live between its updates,
# one of two tiers picked by offload.tier (see Config.offload); the disk tier's keys are its own.
# offload.copies, a key of both tiers: how a layer's weights come in and its gradient goes out
# (engine/step.py): auto (inside the jitted calls on a GPU, else eager), eager, jit (COPIES,
# engine/transfer.py's).
# offload.bus, a key of both tiers: how the layers' bus copies (their weights in the compute
# dtype, which the device fetches) are kept (engine/bus.py): auto (the ring where the plan says
# host memory is short for resident ones and the ring fits), resident (every unit's, all step),
# ring (the layers' in a ring of prefetch + 2 buffers, filled just before each fetch) (BUS_FORMS,
# engine/bus.py's FORMS).


def _check_copies(copies, bus):
    _one_of("offload.copies", copies, COPIES)
    _one_of("offload.bus", bus, BUS_FORMS)


@dataclasses.dataclass(frozen=True)
class RamTierConfig:
    """offload.tier=ram: in host RAM (~16 B/param)."""
    tier: str = dataclasses.field(default="ram", init=False)
    copies: str = "auto"  # (both tiers': see COPIES)
    bus: str = "auto"  # (both tiers': see BUS_FORMS)

    def __post_init__(self):
        _check_copies(self.copies, self.bus)

    def check(self):
        """The ram tier has no keys of its own."""


@dataclasses.dataclass(frozen=True)
class DiskTierConfig:
    """offload.tier=disk: in files under offload.path, read just before each layer's update and
    written back after it: ~2-4 B/param of RAM for the bus copies plus a few layers in flight;
    bit-identical training. See engine/tier.py."""
    tier: str = dataclasses.field(default="disk", init=False)
    copies: str = "auto"  # (both tiers': see COPIES)
    bus: str = "auto"  # (both tiers': see BUS_FORMS)
    path: str = ""  # a directory of its own on a fast local disk (NVMe)
    read_ahead: int = 1  # layers read ahead of the one being updated (and written behind)
    # O_DIRECT, so the disk moves the bytes and the page cache does not fill with the model:
    # auto (where the filesystem allows it; else buffered, said once), true, false
    direct_io: typing.Union[bool, str] = "auto"

    def __post_init__(self):
        """The values, checked when built: also when given with offload.tier=ram, where the keys
        are then refused (_build_choice), so that a wrong value is named as such first."""
        _at_least(0, "offload", read_ahead=self.read_ahead)
        _check_copies(self.copies, self.bus)
        _true_false_auto("offload.direct_io", self.direct_io)

    def check(self):
        if not self.path:
            raise ConfigError("offload.tier=disk needs offload.path, a directory on a fast local "
                              "disk")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Data parallel over devices and processes (megatrain_jax/distributed.py). data.batch_size
    is the global micro-batch: its rows are split over every compute device of every process."""
    # Compute devices of this process: 0 is every accelerator, or 1 on a CPU-only machine (where
    # N > 1 needs N + 1 CPU devices, one for the host state:
    # XLA_FLAGS=--xla_force_host_platform_device_count=N+1).
    local_devices: int = 0
    # Several processes (one per host or per GPU) through jax.distributed: the coordinator's
    # host:port (process 0 serves it), "auto" to let JAX detect the cluster (SLURM, Open MPI,
    # Kubernetes), or "" for a single process. scripts/launch.py sets these for local processes.
    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    # Seconds to wait for every process to join, and for a silent process to be declared lost.
    timeout_s: int = 30
    # Shard the host state over the processes (ZeRO-1/2 on the host): each keeps ~1 / processes
    # of the fp32 master weights and optimizer state, and saves its part of a checkpoint.
    shard_optimizer: bool = False

    def check(self):
        if self.local_devices < 0:
            raise ConfigError(f"distributed.local_devices must be >= 0 (0: every accelerator, or "
                              f"1 on a CPU-only machine), got {self.local_devices}")
        _at_least(1, "distributed", num_processes=self.num_processes, timeout_s=self.timeout_s)
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"distributed.process_id must be in [0, distributed.num_processes="
                              f"{self.num_processes}), got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator:
            raise ConfigError(f"distributed.num_processes={self.num_processes} needs "
                              f"distributed.coordinator (host:port of process 0, or auto)")
        if self.coordinator in ("", "auto"):
            return
        if not re.fullmatch(r"[^\s:]+:\d+|\[[^\]]+\]:\d+", self.coordinator):
            raise ConfigError(f"distributed.coordinator must be host:port (or auto), "
                              f"got {self.coordinator!r}")
        port = int(self.coordinator.rsplit(":", 1)[1])
        if not 0 < port < 65536:  # refused now, not blamed on reachability after the timeout
            raise ConfigError(f"distributed.coordinator={self.coordinator}: port {port} is not a "
                              f"TCP port (1 to 65535)")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Preference training (data.format=preference; megatrain_jax/dpo.py)."""
    beta: float = 0.1  # how far the policy may move from the reference (TRL's default)
    loss: str = "sigmoid"  # sigmoid (DPO) or ipo
    # Where the reference log-probs cache lives ("": run_dir); one file per (data, tokenizer,
    # model, settings) key, so a directory shared by runs reuses them.
    reference_dir: str = ""

    def check(self):
        if self.beta <= 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta}")
        _one_of("dpo.loss", self.loss, DPO_LOSSES)


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    dpo: DPOConfig = DPOConfig()
    # One of the tiers, picked by offload.tier: {tier: ram} (the default) or {tier: disk, path:
    # ..., read_ahead: ..., direct_io: ...}; a disk key with the ram tier is an error.
    offload: typing.Union[RamTierConfig, DiskTierConfig] = dataclasses.field(
        default=RamTierConfig(), metadata={"choice": "tier"})
    distributed: DistributedConfig = DistributedConfig()
    run_dir: str = "runs/tiny"


def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def _coerce(key: str, value, typ):
    if typing.get_origin(typ) is typing.Union:  # e.g. bool | str: the value's own type, if listed
        for option in typing.get_args(typ):
            if isinstance(value, option) and (option is not int or not isinstance(value, bool)):
                return value
        names = " or ".join(t.__name__ for t in typing.get_args(typ))
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]: a YAML list (or one string)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{key}: expected a list of strings like [a.b, c.d], got {value!r}")
        return tuple(items)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    if typ is float and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    return value


def _mapping(data, prefix: str, known) -> dict:
    """data, checked to be a mapping of no keys but the known ones (named with prefix)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key: {prefix}{unknown[0]}"
                          f"{did_you_mean(unknown[0], known, prefix)}")
    return data


def _keys(cls) -> list:
    """The YAML keys of a section dataclass (a choice's name, set by its class, is not one)."""
    return [_yaml_name(f) for f in dataclasses.fields(cls) if f.init]


def _build(cls, data: dict, prefix: str):
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in _mapping(data, prefix, fields).items():
        f = fields[name]
        typ = hints[f.name]
        if "choice" in f.metadata:  # e.g. offload: RamTierConfig or DiskTierConfig, by offload.tier
            kwargs[f.name] = _build_choice(typing.get_args(typ), f.metadata["choice"], value,
                                           f"{prefix}{name}.", f.default)
        elif dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, value, f"{prefix}{name}.")
        elif typing.get_origin(typ) is tuple and dataclasses.is_dataclass(typing.get_args(typ)[0]):
            if not isinstance(value, (list, tuple)):  # a list of mappings, e.g. data.sources
                raise ConfigError(f"{prefix}{name}: expected a list of mappings, got {value!r}")
            kwargs[f.name] = tuple(_build(typing.get_args(typ)[0], item, f"{prefix}{name}.{i}.")
                                   for i, item in enumerate(value))
        else:
            kwargs[f.name] = _coerce(prefix + name, value, typ)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _build_choice(classes, key: str, data, prefix: str, default):
    """The one of classes that data[key] names (default's when not given): each holds its name in
    its field `key`. Every other key is built by the classes that have it, which check its value;
    a key that the named class lacks is then refused by name."""
    choices = {getattr(cls, key): cls for cls in classes}
    _mapping(data, prefix, {key, *(k for cls in classes for k in _keys(cls))})
    name = _coerce(prefix + key, data.get(key, getattr(default, key)), str)
    _one_of(prefix + key, name, list(choices))
    built = {cls: _build(cls, {k: v for k, v in data.items() if k in _keys(cls)}, prefix)
             for cls in classes}
    for k in sorted(data.keys() - {key} - set(_keys(choices[name]))):
        owner = next(n for n, cls in choices.items() if k in _keys(cls))
        if _is_default(built[choices[owner]], k):
            continue  # as every config.yaml saved before the choice holds them: meaning nothing
        raise ConfigError(f"{prefix}{k} is a key of {prefix}{key}={owner}, and {prefix}{key} is "
                          f"{name}: set {prefix}{key}={owner} or leave {prefix}{k} out")
    return built[choices[name]]


def _is_default(section, yaml_key: str) -> bool:
    """Whether a section's key holds its class's default."""
    f = next(f for f in dataclasses.fields(section) if _yaml_name(f) == yaml_key)
    return getattr(section, f.name) == f.default


def _set_dotted(tree: dict, dotted: str, value):
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"unknown config key: {dotted}")
        tree = node
    tree[leaf] = value


class _Loader(yaml.SafeLoader):
    """YAML with 1.2 numbers and no duplicate keys. PyYAML implements YAML 1.1, whose floats need a
    dot and a signed exponent (1.0e+30), so `2e-5` or `1e30` would load as strings, and whose ints
    read `010` as octal 8 and `1:30` as 90."""


_FLOAT, _INT = "tag:yaml.org,2002:float", "tag:yaml.org,2002:int"
_Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] not in (_FLOAT, _INT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# YAML 1.2 ints (decimal, 0x hex, 0o octal), with underscores as digit separators (1_000).
_Loader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$"),
                              list("-+0123456789"))
_Loader.add_constructor(_INT, lambda loader, node: int(
    loader.construct_scalar(node).replace("_", ""), 0 if node.value[:2] in ("0x", "0o") else 10))
_Loader.add_implicit_resolver(_FLOAT, re.compile(r"""^(?:
    [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def _duplicate_key(node, prefix=""):
    """(dotted key, line) of the first key given twice in one mapping of a composed YAML node."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            if key in seen:
                return key, key_node.start_mark.line + 1
            seen.add(key)
            found = _duplicate_key(value_node, key + ".")
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _duplicate_key(item, f"{prefix}{i}.")
            if found:
                return found
    return None


def _load_yaml(stream, where: str):
    """One YAML document with _Loader; a key given twice raises ConfigError naming it."""
    loader = _Loader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        duplicate = _duplicate_key(node)
        if duplicate:
            raise ConfigError(f"{where}: duplicate key {duplicate[0]} (line {duplicate[1]}); "
                              f"give each key once")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), *,
                hf_model: typing.Callable[[str], ModelConfig] | None = None) -> Config:
    """Reads a YAML config (or the defaults) and applies `key=value` overrides. With
    model.from_hf set, the architecture is `hf_model(model.from_hf)` (recipes.load_config passes
    the hf package's reader); a config that sets it is refused without one."""
    data = {}
    if path is not None:
        if os.path.isdir(path):
            raise ConfigError(f"--config {path} is a directory, not a YAML file")
        try:
            with open(path, encoding="utf-8") as f:
                data = _load_yaml(f, path)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as e:
            raise ConfigError(f"config file {path} is not readable ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a text (UTF-8) YAML file") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config sections (model:, data:, "
                              f"...), got a {type(data).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        try:
            parsed = _load_yaml(value, f"override {key}") if value else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: not a valid YAML value "
                              f"({str(e).splitlines()[0]})") from None
        _set_dotted(data, key, parsed)
    cfg = _build(Config, data, "")
    given_data = data.get("data") if isinstance(data.get("data"), dict) else {}
    if cfg.data.sources and given_data.get("path"):
        raise ConfigError(f"data.path ({cfg.data.path}) and data.sources are both set; give one "
                          f"(data.sources: a mixture of paths with weights)")
    if cfg.data.format in ("sft", "preference") and "document_mask" not in given_data:
        # sft rows are packed; preference rows mark their padding
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    if cfg.model.from_hf:
        if hf_model is None:
            raise ConfigError(f"model.from_hf={cfg.model.from_hf}: this loader reads no model "
                              f"files; load the config with megatrain_jax.recipes.load_config")
        cfg = dataclasses.replace(cfg, model=_model_from_hf(cfg.model, data.get("model", {}),
                                                            hf_model))
    _check(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """The Config of plain data as to_dict writes it (a checkpoint's meta, a saved config.yaml),
    checked as load_config checks a file; model.from_hf is not read again. Data written before
    offload became a choice holds the disk tier's keys whatever the tier: with the ram tier, where
    they meant nothing, they are dropped."""
    offload = data.get("offload")
    if isinstance(offload, dict) and offload.get("tier", RamTierConfig.tier) == RamTierConfig.tier:
        dead = set(_keys(DiskTierConfig)) - set(_keys(RamTierConfig))
        data = {**data, "offload": {k: v for k, v in offload.items() if k not in dead}}
    cfg = _build(Config, data, "")
    _check(cfg)
    return cfg


def _model_from_hf(given: ModelConfig, given_keys, hf_model) -> ModelConfig:
    """The architecture comes from the HF directory's config.json (`hf_model`); a key also set
    in the config must agree with it (so a saved, resolved config.yaml loads again)."""
    model = hf_model(given.from_hf)
    for key in given_keys:
        if key != "init_std" and getattr(given, key) != getattr(model, key):
            raise ConfigError(f"model.{key}={getattr(given, key)!r} conflicts with "
                              f"{given.from_hf}/config.json ({getattr(model, key)!r}); leave it out "
                              f"when model.from_hf is set")
    return dataclasses.replace(model, init_std=given.init_std)


def _check(cfg: Config):
    """Each section's own rules (its check, next to it), then the rules across sections."""
    for section in (cfg.train, cfg.data, cfg.optimizer, cfg.logging, cfg.dpo, cfg.offload,
                    cfg.distributed):
        section.check()
    cfg.checkpoint.check(cfg)
    if not cfg.run_dir:
        raise ConfigError("run_dir must not be empty")
    dist = cfg.distributed
    if cfg.offload.tier == "disk" and dist.num_processes > 1:
        raise ConfigError(f"offload.tier=disk with distributed.num_processes={dist.num_processes}: "
                          f"the disk tier holds one process's state; use offload.tier=ram")
    if cfg.offload.tier == "disk" and dist.shard_optimizer:
        raise ConfigError("distributed.shard_optimizer=true with offload.tier=disk: the disk tier "
                          "holds the whole state; use one or the other")
    tile, block = cfg.train.tile_size, cfg.train.attention_block or DEFAULT_BLOCK
    if 0 < tile < cfg.data.seq_len and tile > block and tile % block:
        # a tile's queries start at a key block: no block pair is visited by two tiles
        raise ConfigError(f"train.tile_size ({tile}) must be a multiple of train.attention_block "
                          f"({block}) when it tiles data.seq_len ({cfg.data.seq_len})")


# What a resumed run must share with the checkpoint it resumes from: the keys that fix the model,
# the token stream (file, tokenization, batch shape, shuffling seed, the held-out split, which
# changes what is trained on), the optimizer and the schedule
# (train.steps sets its length). A section name covers every key under it. A key listed here that
# this version does not have is skipped. Everything else (dtypes, prefetch and other execution
# options, logging, checkpoint cadence, run_dir) may change between a run and its resume.
RESUME_KEYS = ("model", "optimizer", "data.path", "data.sources", "data.text_field",
               "data.tokenizer", "data.eos_token", "data.token_dtype", "data.seq_len",
               "data.batch_size", "data.micro_batches", "data.document_mask", "data.eval_path",
               "data.eval_fraction", "data.format", "data.overlong", "train.seed", "train.steps",
               "dpo.beta", "dpo.loss")


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def resume_keys(cfg: Config) -> list:
    """The dotted keys of cfg that RESUME_KEYS names, in config order."""
    return [k for k in _flatten(to_dict(cfg))
            if any(k == r or k.startswith(r + ".") for r in RESUME_KEYS)]


def resume_changes(saved: dict, cfg: Config) -> list:
    """[(dotted key, saved value, current value)] for every RESUME_KEYS key whose value differs
    between `saved` (a checkpoint's config, as to_dict wrote it) and cfg. A key the saved config
    lacks (written before the key existed) counts as its default."""
    current = json.loads(json.dumps(to_dict(cfg)))  # tuples as lists, as the checkpoint has them
    defaults = json.loads(json.dumps(to_dict(Config())))
    saved_flat, current_flat, default_flat = (_flatten(t) for t in (saved, current, defaults))
    changes = []
    for key in resume_keys(cfg):
        old, new = saved_flat.get(key, default_flat.get(key)), current_flat[key]
        if key == "data.sources":  # in any order: a mixture resumes each source by its path
            old, new = _sources(old), _sources(new)
            if sorted(old, key=str) == sorted(new, key=str):
                continue
            old, new = _sources_text(old), _sources_text(new)
        if old != new:
            changes.append((key, old, new))
    return changes


def _sources(sources: list) -> list:
    """data.sources as to_dict gives them, each with every key (a default where one is
    missing) and its weight a float."""
    default = to_dict(SourceConfig())
    return [{**default, **s, "weight": float(s.get("weight", default["weight"]))}
            for s in sources]


def _sources_text(sources: list) -> str:
    """_sources' in words: "path weight w[, key value]; ...", or "none"."""
    def one(source: dict) -> str:
        extra = "".join(f", {k} {v}" for k, v in source.items()
                        if k not in ("path", "weight") and v)
        return f"{source['path']} weight {source['weight']:g}{extra}"
    return "; ".join(one(s) for s in sources) or "none"


def to_dict(cfg) -> dict:
    """The config as plain YAML-able data, with the same keys `load_config` reads."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        if isinstance(value, tuple):
            value = [to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[_yaml_name(f)] = value
    return out
