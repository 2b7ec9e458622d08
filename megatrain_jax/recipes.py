"""What a config builds, in one place: the config itself with a HF model's architecture
(`load_config`), the model's execution options, the optimizer and its schedule, the engine, the
disk tier's options and the data. train.py, plan.py, step_time.py,
generate.py, the scripts and the tests build from here."""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import optax

from megatrain_jax import attention, chat, dpo, hf, moe, preference
from megatrain_jax import data as data_lib
from megatrain_jax import config as config_lib
from megatrain_jax.config import Config, ConfigError, to_dict
from megatrain_jax.engine import StreamedEngine
from megatrain_jax.engine import fused_adamw
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.model import Execution, make_block, make_stages
from megatrain_jax.sources.cache import default_cache_dir, source_tokens
from megatrain_jax.sources.mixture import MixtureDataset
from megatrain_jax.sources.prefetch import ReadAhead


def load_config(path: str | None = None, overrides=()) -> Config:
    """config.load_config, with `model.from_hf`'s architecture read from that HF directory's
    config.json (a model key also given must agree with it)."""
    return config_lib.load_config(path, overrides, hf_model=hf.model_config_from_hf)


def execution_for(cfg: Config, platform: str | None = None,
                  exclude: tuple = ()) -> tuple[Execution, attention.Choice]:
    """The model's execution options from cfg.train, with `train.attention` and
    `train.attention_block` resolved for the compute platform (default: the default device's) by
    attention.choose_attention (`exclude`: tiled candidates not to take), and its choice (the
    reason, and a notice where train.attention asked for what cannot run there)."""
    platform = platform or jax.local_devices()[0].platform
    t = cfg.train
    try:
        choice = attention.choose_attention(
            t.attention, platform=platform, dtype=t.compute_dtype, head_dim=cfg.model.head_size,
            document_mask=cfg.data.document_mask, windowed=cfg.model.sliding_window > 0,
            block=t.attention_block, tile=t.tile_size, exclude=exclude)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return Execution(attention=choice.attention, attention_block=choice.block,
                     tile_size=t.tile_size, loss_chunk=t.loss_chunk,
                     loss_vocab_chunk=t.loss_vocab_chunk, tile_attention=choice.tiled), choice


def decay_mask(params):
    """Weight decay on matrices only: norms and biases (including per-head 2-D biases) are exempt."""
    def is_matrix(path, p):
        return p.ndim >= 2 and not jax.tree_util.keystr(path).endswith("_bias']")
    return jax.tree_util.tree_map_with_path(is_matrix, params)


def build_schedule(cfg, total_steps: int) -> optax.Schedule:
    """The learning rate of optimizer update `count` (0 for the first), from cfg (an
    OptimizerConfig): a linear warmup from 0 to learning_rate over warmup_steps, then
    `cfg.schedule`:

        cosine    cosine decay to learning_rate * min_lr_ratio at count total_steps
        linear    linear decay to learning_rate * min_lr_ratio at count total_steps
        constant  learning_rate
        wsd       learning_rate, then a linear decay over the last decay_fraction of total_steps
                  (at least one step; never into the warmup) to learning_rate * min_lr_ratio at
                  count total_steps

    The warmup is cut to total_steps - 1 steps when longer."""
    lr, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    last = max(total_steps, warmup + 1)  # the count at which a decay reaches `end`
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=last, end_value=end)
    if cfg.schedule == "linear":
        parts = [(warmup, optax.linear_schedule(lr, end, last - warmup))]
    elif cfg.schedule == "constant":
        parts = [(warmup, optax.constant_schedule(lr))]
    elif cfg.schedule == "wsd":
        decay_start = max(warmup, last - max(1, round(cfg.decay_fraction * total_steps)))
        parts = [(warmup, optax.constant_schedule(lr)),
                 (decay_start, optax.linear_schedule(lr, end, last - decay_start))]
    else:
        raise ConfigError(f"optimizer.schedule: unknown schedule {cfg.schedule!r}")
    if warmup:
        parts.insert(0, (0, optax.linear_schedule(0.0, lr, warmup)))
    parts = [(start, fn) for i, (start, fn) in enumerate(parts)  # drop empty segments
             if i + 1 == len(parts) or parts[i + 1][0] > start]
    return optax.join_schedules([fn for _, fn in parts], [start for start, _ in parts[1:]])


def build_optimizer(cfg, total_steps: int) -> fused_adamw.AdamW:
    """AdamW with the learning-rate schedule of build_schedule. Clipping is the engine's
    (`max_grad_norm`)."""
    schedule = build_schedule(cfg, total_steps)
    return fused_adamw.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask,
                             state_dtype=cfg.state_dtype)


def build_engine(cfg: Config, *, offload_activations: bool | None = None,
                 execution: Execution | None = None, **engine_kwargs) -> StreamedEngine:
    """The engine for cfg. `offload_activations` resolves train.offload_activations=auto and
    `execution` the attention that runs (train() takes both from the plan, whose attention is
    the fastest that fits); left None, auto means off and the attention is execution_for's."""
    model = cfg.model
    compute = (engine_kwargs.get("compute_device") or (engine_kwargs.get("compute_devices")
                                                        or jax.local_devices())[0])
    if execution is None:
        execution, _ = execution_for(cfg, compute.platform)
    if offload_activations is None:
        offload_activations = cfg.train.offload_activations is True
    # The stages are built in host memory, like the blocks (the engine builds those there):
    # the default device would be the accelerator.
    host = engine_kwargs.get("host_device") or jax.local_devices(backend="cpu")[0]
    with jax.default_device(host):
        if model.from_hf:  # the weights of a HF model, read layer by layer into host memory
            source = hf.HFSource(model.from_hf)
            first, last = hf.load_stages(model, source, execution)
            block = lambda i: hf.load_block(model, source, i, execution)
        else:
            first, last = make_stages(model, cfg.train.seed, execution)
            block = lambda i: make_block(model, cfg.train.seed, i, execution)
        if cfg.data.format == "preference":  # the same head weights, the DPO loss
            last = dpo.PreferenceHead(last, beta=cfg.dpo.beta, loss=cfg.dpo.loss)
    if cfg.distributed.shard_optimizer:  # a no-op on one device
        engine_kwargs.setdefault("shard_host_state", True)
    engine_kwargs.setdefault("host_lookup", host_lookup_setting(cfg))
    engine_kwargs.setdefault("copies", cfg.offload.copies)
    engine_kwargs.setdefault("bus", cfg.offload.bus)
    engine_kwargs.setdefault("host_threads", cfg.optimizer.host_threads)
    if cfg.offload.tier == "disk" and "disk_tier" not in engine_kwargs:
        engine_kwargs["disk_tier"] = disk_tier_options(cfg)
    try:
        return StreamedEngine(
            first=first, last=last, make_block=block,
            num_layers=model.num_layers, optimizer=build_optimizer(cfg.optimizer, cfg.train.steps),
            max_grad_norm=cfg.optimizer.max_grad_norm or None,
            compute_dtype=jnp.dtype(cfg.train.compute_dtype), prefetch=cfg.train.prefetch,
            grad_dtype=jnp.dtype(cfg.train.grad_dtype), offload_activations=offload_activations,
            aux_loss=moe.aux_loss(model), **engine_kwargs)
    except ValueError as e:  # e.g. offload asked on a device without host memory kinds
        # the engine's arguments' keys
        key = ("offload." if str(e).startswith(("copies=", "bus=")) else
               "optimizer." if str(e).startswith("host_threads") else "")
        raise ConfigError(key + str(e)) from None


def host_lookup_setting(cfg: Config):
    """train.host_lookup as the engine's host_lookup: True, False, or None (auto)."""
    return None if cfg.train.host_lookup == "auto" else cfg.train.host_lookup


def disk_tier_options(cfg: Config) -> DiskTierOptions:
    """offload.* as the engine's options: the directory is owned by this run_dir and records a
    hash of the model config (engine/tier.py refuses another run's directory)."""
    model = json.dumps(to_dict(cfg.model), sort_keys=True)
    direct_io = cfg.offload.direct_io
    return DiskTierOptions(cfg.offload.path, read_ahead=cfg.offload.read_ahead,
                           direct_io=direct_io if direct_io == "auto" else str(direct_io).lower(),
                           run=os.path.abspath(cfg.run_dir),
                           model=hashlib.sha256(model.encode()).hexdigest()[:16])


def load_dataset(cfg: Config) -> data_lib.PackedDataset:
    """The training batches (without the tokens data.eval_fraction holds out)."""
    return load_data(cfg)[0]


def load_data(cfg: Config, log=print) -> tuple:
    """(the training dataset: data.PackedDataset, a sources.mixture.MixtureDataset for
    data.sources, chat.SFTDataset for data.format=sft, preference.PreferenceDataset; the held-out
    eval batches: a list of (inputs, targets, context), or None when neither data.eval_path nor
    data.eval_fraction is set). Text data comes from its token cache in data.cache_dir (built
    first if missing or stale: `log` says so); its batches are read ahead on a thread
    (sources.prefetch)."""
    d = cfg.data
    tokenizer = data_lib.load_tokenizer(d.tokenizer, eos_token=d.eos_token or None)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the "
                          f"tokenizer's ({tokenizer.vocab_size}, data.tokenizer={d.tokenizer})")
    if d.format == "sft":  # contexts from the conversations' boundaries, not from EOS
        return chat.load_sft(d, tokenizer, vocab_size=cfg.model.vocab_size, seed=cfg.train.seed,
                             num_eval_batches=cfg.train.eval_batches, log=log)
    if d.format == "preference":  # reference log-probs filled in by the reference pass
        return preference.load_preference(d, tokenizer, vocab_size=cfg.model.vocab_size,
                                          seed=cfg.train.seed, log=log), None
    cache_dir = d.cache_dir or default_cache_dir()
    load = lambda path, key, field="", dtype="": source_tokens(
        path, tokenizer, cache_dir, key=key, text_field=field or d.text_field,
        token_dtype=dtype or d.token_dtype, vocab_size=cfg.model.vocab_size, log=log)[0]
    shape = dict(seq_len=d.seq_len, batch_size=d.batch_size, seed=cfg.train.seed,
                 num_micro_batches=d.micro_batches, eos_id=tokenizer.eos_id,
                 document_mask=d.document_mask)
    held_out, what = None, None
    if d.sources:
        streams = [load(s.path, f"data.sources.{i}.path", s.text_field, s.token_dtype)
                   for i, s in enumerate(d.sources)]
        dataset = MixtureDataset(streams, [s.weight for s in d.sources],
                                 [s.path for s in d.sources], **shape)
        dataset.summary = "text data: " + "; ".join(
            f"{s.path}: {len(t):,} tokens, weight {s.weight:g}" for s, t in zip(d.sources, streams))
    else:
        tokens = load(d.path, "data.path")
        if d.eval_fraction:  # split before the training windows are built: never trained on
            tokens, held_out = data_lib.split_tail(tokens, d.eval_fraction)
            what = f"data.eval_fraction={d.eval_fraction} ({len(held_out):,} tokens of {d.path})"
        dataset = data_lib.PackedDataset(tokens, **shape)
        dataset.summary = f"text data: {d.path}: {len(tokens):,} tokens"
    dataset.read_ahead = ReadAhead(dataset.read_windows)
    if d.eval_path:
        try:
            held_out, what = load(d.eval_path, "data.eval_path"), f"data.eval_path={d.eval_path}"
        except data_lib.DataError as e:
            raise data_lib.DataError(str(e) if "data.eval_path" in str(e)
                                     else f"data.eval_path: {e}") from None
    if held_out is None:
        return dataset, None
    batches = data_lib.eval_batches(held_out, seq_len=d.seq_len, batch_size=d.batch_size,
                                    num_micro_batches=d.micro_batches,
                                    num_batches=cfg.train.eval_batches, what=what)
    context = lambda inputs: (data_lib.document_context(inputs, tokenizer.eos_id)
                              if d.document_mask else None)
    return dataset, [(x, t, context(x)) for x, t in batches]
