"""`train(config)`: the Llama-family model on the streamed engine, with a plain loop.

scripts/train.py is a thin CLI over this module.
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import optax
import yaml

from megatrain_jax import data as data_lib
from megatrain_jax.config import Config, ConfigError, to_dict
from megatrain_jax.engine import StreamedEngine
from megatrain_jax.model import make_block, make_stages


def decay_mask(params):
    """Weight decay on matrices only: norms and biases (including per-head 2-D biases) are exempt."""
    def is_matrix(path, p):
        return p.ndim >= 2 and not jax.tree_util.keystr(path).endswith("_bias']")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def build_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay. Clipping is the engine's (`max_grad_norm`)."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=decay_mask)


def build_engine(cfg: Config, **engine_kwargs) -> StreamedEngine:
    model = cfg.model
    first, last = make_stages(model, cfg.train.seed)
    return StreamedEngine(
        first=first, last=last, make_block=lambda i: make_block(model, cfg.train.seed, i),
        num_layers=model.num_layers, optimizer=build_optimizer(cfg.optimizer, cfg.train.steps),
        max_grad_norm=cfg.optimizer.max_grad_norm or None,
        compute_dtype=jnp.dtype(cfg.train.compute_dtype), prefetch=cfg.train.prefetch,
        **engine_kwargs)


def load_dataset(cfg: Config) -> data_lib.PackedDataset:
    tokenizer = data_lib.load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                          f"tokenizer's ({tokenizer.vocab_size}, data.tokenizer={cfg.data.tokenizer})")
    tokens = data_lib.load_tokens(cfg.data.path, tokenizer, text_field=cfg.data.text_field,
                                  token_dtype=cfg.data.token_dtype)
    return data_lib.PackedDataset(tokens, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size,
                                  seed=cfg.train.seed, num_micro_batches=cfg.data.micro_batches)


def prepare_run_dir(run_dir: str):
    """Creates run_dir, or raises ConfigError naming it if it cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir!r} is not writable ({e.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"run_dir {run_dir!r} is not writable")


def train(cfg: Config, *, log=print) -> list[dict]:
    """Trains for cfg.train.steps steps; returns the per-step metrics it logged."""
    dataset = load_dataset(cfg)  # validate all inputs before anything is written
    prepare_run_dir(cfg.run_dir)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)

    log(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    engine = build_engine(cfg)
    log(f"model: {cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.num_layers} layers | "
        f"{dataset.tokens_per_batch} tokens/step | compute {jax.devices()[0].platform}")
    history = []
    with open(os.path.join(cfg.run_dir, "metrics.jsonl"), "a") as metrics_file:
        for step in range(1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            inputs, targets = dataset.next_batch()
            out = engine.train_step(inputs, targets)
            loss, grad_norm = float(out["loss"]), float(out["grad_norm"])  # the step's sync point
            dt = time.perf_counter() - t0
            record = {"step": step, "loss": loss, "grad_norm": grad_norm,
                      "tokens_per_sec": dataset.tokens_per_batch / dt, "step_time_s": dt}
            history.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                log(f"step {step:5d} | loss {loss:.4f} | grad norm {grad_norm:.3f} | "
                    f"{record['tokens_per_sec']:,.0f} tok/s | {dt * 1000:.0f} ms")
    engine.close()
    return history
