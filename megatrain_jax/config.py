"""Typed run configuration: small frozen dataclasses, loaded from YAML with dotted overrides.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "run_dir=/tmp/run"])

Every mistake (unknown key, wrong type, inconsistent sizes) raises `ConfigError` with a one-line
message that names the key.
"""

import dataclasses
import typing

import yaml

from megatrain_jax.model import ModelConfig


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio at train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only: never to norms or biases
    max_grad_norm: float = 1.0  # global-norm clipping; 0 turns it off


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str = "megatrain_jax/texts/devils_dictionary.txt"
    tokenizer: str = "byte"  # "byte" or a tokenizer.json path
    eos_token: str = ""  # the document separator of a tokenizer.json; "": </s>, <|endoftext|>, ...
    text_field: str = "text"  # for .jsonl
    token_dtype: str = "uint16"  # for .bin token files
    seq_len: int = 128
    batch_size: int = 8  # sequences per micro-batch
    micro_batches: int = 1  # micro-batches per optimizer step (gradient accumulation)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # total optimizer steps of the run
    seed: int = 0
    compute_dtype: str = "bfloat16"  # dtype of streamed weights and device compute
    grad_dtype: str = "float32"  # gradients to and on the host; bfloat16 saves 2 B/param, inexact
    prefetch: int = 1  # layers in flight ahead of the computing one
    log_every: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: only at the end and on a signal
    keep: int = 3
    async_save: bool = dataclasses.field(default=True, metadata={"yaml": "async"})
    resume_step: int = -1  # -1: resume from the latest complete checkpoint


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run_dir: str = "runs/tiny"


def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def _coerce(key: str, value, typ):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {_yaml_name(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key: {prefix}{unknown[0]}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, value, f"{prefix}{name}.")
        else:
            kwargs[f.name] = _coerce(prefix + name, value, typ)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _set_dotted(tree: dict, dotted: str, value):
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"unknown config key: {dotted}")
        tree = node
    tree[leaf] = value


def load_config(path: str | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a YAML config (or the defaults) and applies `key=value` overrides."""
    data = {}
    if path is not None:
        try:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        _set_dotted(data, key, yaml.safe_load(value) if value else "")
    cfg = _build(Config, data, "")
    if cfg.model.from_hf:
        cfg = dataclasses.replace(cfg, model=_model_from_hf(cfg.model, data.get("model", {})))
    _check(cfg)
    return cfg


def _model_from_hf(given: ModelConfig, given_keys) -> ModelConfig:
    """The architecture comes from the HF directory's config.json; a key also set in the config
    must agree with it (so a saved, resolved config.yaml loads again)."""
    from megatrain_jax import hf  # lazy: hf imports the model stack

    model = hf.model_config_from_hf(given.from_hf)
    for key in given_keys:
        if key != "init_std" and getattr(given, key) != getattr(model, key):
            raise ConfigError(f"model.{key}={getattr(given, key)!r} conflicts with "
                              f"{given.from_hf}/config.json ({getattr(model, key)!r}); leave it out "
                              f"when model.from_hf is set")
    return dataclasses.replace(model, init_std=given.init_std)


def _check(cfg: Config):
    positive = {"train.steps": cfg.train.steps, "data.seq_len": cfg.data.seq_len,
                "data.batch_size": cfg.data.batch_size, "data.micro_batches": cfg.data.micro_batches,
                "checkpoint.keep": cfg.checkpoint.keep, "train.log_every": cfg.train.log_every}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if cfg.train.prefetch < 0:
        raise ConfigError(f"train.prefetch must be >= 0, got {cfg.train.prefetch}")
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every must be >= 0, got {cfg.checkpoint.every}")
    if cfg.train.compute_dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"train.compute_dtype must be bfloat16 or float32, "
                          f"got {cfg.train.compute_dtype!r}")
    if cfg.train.grad_dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"train.grad_dtype must be bfloat16 or float32, got {cfg.train.grad_dtype!r}")
    if cfg.optimizer.learning_rate <= 0:
        raise ConfigError(f"optimizer.learning_rate must be > 0, got {cfg.optimizer.learning_rate}")
    if cfg.optimizer.max_grad_norm < 0:
        raise ConfigError(f"optimizer.max_grad_norm must be >= 0, got {cfg.optimizer.max_grad_norm}")
    if not cfg.run_dir:
        raise ConfigError("run_dir must not be empty")
    if cfg.model.sliding_window and cfg.data.seq_len > cfg.model.sliding_window:
        raise ConfigError(f"data.seq_len ({cfg.data.seq_len}) exceeds model.sliding_window "
                          f"({cfg.model.sliding_window}): sliding-window attention is not supported")


def to_dict(cfg) -> dict:
    """The config as plain YAML-able data, with the same keys `load_config` reads."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[_yaml_name(f)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out
