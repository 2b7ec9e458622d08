"""`train(config)`: the Llama-family model on the streamed engine, with a plain loop.

scripts/train.py and `megatrain train` (megatrain_jax.commands) are a thin CLI over this module.
"""

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from megatrain_jax import advice, attention, chat, checkpoint, dpo, preference
from megatrain_jax import distributed
from megatrain_jax import data as data_lib
from megatrain_jax import fingerprint
from megatrain_jax import hf
from megatrain_jax import hostmem
from megatrain_jax import moe
from megatrain_jax import metrics_log
from megatrain_jax import plan as plan_lib
from megatrain_jax import progress
from megatrain_jax.config import Config, ConfigError, resume_changes, to_dict
from megatrain_jax.engine import StreamedEngine
from megatrain_jax.engine import fused_adamw
from megatrain_jax.engine import tier as tier_lib
from megatrain_jax.engine.tier import DiskTierOptions
from megatrain_jax.errors import TrainingError
from megatrain_jax.model import Execution, make_block, make_stages
from megatrain_jax.runlock import RunLock
from megatrain_jax.sources import files as source_files
from megatrain_jax.sources.cache import default_cache_dir, source_tokens
from megatrain_jax.sources.mixture import MixtureDataset
from megatrain_jax.sources.prefetch import ReadAhead


def execution_for(cfg: Config, platform: str | None = None) -> tuple[Execution, str]:
    """The model's execution options from cfg.train, with `train.attention` resolved for the
    compute platform (default: the default device's), and the reason for the choice."""
    platform = platform or jax.local_devices()[0].platform
    try:
        impl, why = attention.choose_implementation(
            cfg.train.attention, platform=platform, dtype=cfg.train.compute_dtype,
            head_dim=cfg.model.head_size, document_mask=cfg.data.document_mask)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.train
    return Execution(attention=impl, attention_block=t.attention_block, tile_size=t.tile_size,
                     loss_chunk=t.loss_chunk, loss_vocab_chunk=t.loss_vocab_chunk), why


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
                             weight_decay=cfg.weight_decay, mask=decay_mask)


def build_engine(cfg: Config, *, offload_activations: bool | None = None,
                 **engine_kwargs) -> StreamedEngine:
    """The engine for cfg. `offload_activations` resolves train.offload_activations=auto (train()
    takes it from the plan); left None, auto means off."""
    model = cfg.model
    compute = (engine_kwargs.get("compute_device") or (engine_kwargs.get("compute_devices")
                                                        or jax.local_devices())[0])
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
        raise ConfigError(str(e)) from None


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


def evaluate(engine: StreamedEngine, batches) -> float:
    """The mean loss per counted token over the eval batches [(inputs, targets, context)]."""
    outs = [engine.evaluate(x, t, c) for x, t, c in batches]  # dispatched, then read
    loss_sum = sum(float(o["loss_sum"]) for o in outs)
    weight = sum(float(o["weight"]) for o in outs)
    return loss_sum / weight if weight > 0 else math.nan


def prepare_run_dir(run_dir: str):
    """Creates run_dir, or raises ConfigError naming it if it cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir!r} is not writable ({e.strerror})") from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"run_dir {run_dir!r} is not writable")


class _StopSignals:
    """SIGTERM/SIGINT while training: the first asks to stop after the current step (the loop then
    saves a checkpoint and returns); a second exits at once. Orbax commits a checkpoint by renaming
    its directory when complete, so exiting mid-save leaves the earlier checkpoints as they were."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            os._exit(128 + signum)  # the shell's code for "killed by this signal"
        self.received = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python's rule for handlers
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _keep_metrics_through(path: str, step: int):
    """Drops the records after `step` (logged after the checkpoint a run resumes from, or a torn
    last line), so a resumed run appends each step once. Atomic: a temp file, then os.replace."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if line.endswith("\n") and json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    if kept != lines:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def resume_point(cfg: Config, log=print, data_identity=None) -> int | None:
    """The checkpoint step this run resumes from (None: a fresh run), after checking it can: it must
    be the latest (steps retrained past an older one would not replace the newer checkpoints, which
    are never overwritten), and its saved config must agree with cfg on every RESUME_KEYS key not in
    checkpoint.allow_changes, and its data files' identity must be data_identity's (default:
    the data as it is now). Reads only the checkpoint's meta; writes nothing."""
    directory = os.path.join(cfg.run_dir, "checkpoints")
    if not os.path.isdir(directory):
        if cfg.checkpoint.resume_step >= 0:
            raise checkpoint.CheckpointError(f"checkpoint.resume_step={cfg.checkpoint.resume_step}"
                                             f": no checkpoints directory {directory}")
        return None
    reader = checkpoint.make_manager(directory)
    try:
        step = checkpoint.resolve_step(reader, None if cfg.checkpoint.resume_step < 0
                                       else cfg.checkpoint.resume_step)
        if step is None:
            return None
        newer = [s for s in reader.all_steps() if s > step]
        if newer:
            raise checkpoint.CheckpointError(
                f"checkpoint.resume_step={step}: {reader.directory} holds newer checkpoints (steps "
                f"{', '.join(map(str, newer))}), which the retrained steps would not replace (a "
                f"checkpoint is never overwritten or deleted); move them out of it and run again")
        meta, _ = checkpoint.read_meta(reader, step)
    finally:
        reader.close()
    where = f"checkpoint step {step} in {reader.directory}"
    for key, old, new in resume_changes(meta.get("config") or {}, cfg):
        if not any(key == a or key.startswith(a + ".") for a in cfg.checkpoint.allow_changes):
            raise checkpoint.CheckpointError(
                f"{where} does not match this config: config.{key} is {old!r} in the checkpoint, "
                f"{new!r} now; to resume with the new value, add checkpoint.allow_changes=[{key}]")
        log(f"resuming with a changed {key}: {old!r} in {where}, {new!r} now "
            f"(checkpoint.allow_changes)")
    now = data_identity or fingerprint.files_identity(source_files.data_files(cfg.data))
    change = ("data_files" in meta and  # older checkpoints did not record their data
              fingerprint.first_change(meta["data_files"], now))
    if change:
        if not {"data.path", "data"} & set(cfg.checkpoint.allow_changes):
            raise checkpoint.CheckpointError(
                f"{where} was trained on other data: {change}; to resume with the data as it is "
                f"now, add checkpoint.allow_changes=[data.path]")
        log(f"resuming with changed data: {change} (checkpoint.allow_changes)")
    return step


def train(cfg: Config, *, log=print, console=None) -> list[dict]:
    """Trains up to cfg.train.steps (the total) steps; returns the per-step metrics it logged.

    `log` takes the run's lines: a line per `train.log_every` steps (progress.line), evaluations,
    checkpoints. `console`, a rich Console, adds a live progress bar under them (the command line
    passes one when stdout is a terminal).

    Resumes from the latest complete checkpoint in `<run_dir>/checkpoints` (or the step
    `checkpoint.resume_step`) when there is one. Saves every `checkpoint.every` steps, at the last
    step, and on SIGTERM/SIGINT (then returns early). Holds `<run_dir>/train.lock` throughout.

    Data parallel (cfg.distributed, megatrain_jax/distributed.py): every process runs this with
    its own distributed.process_id; process 0 alone logs, writes the run's files and saves."""
    if cfg.distributed.process_id == 0:  # a busy run_dir refused before the others join
        RunLock(cfg.run_dir).check_free()  # (process 0 refusing later would abort them)
    distributed.initialize(cfg.distributed)  # before anything touches a device
    devices, host_device = distributed.devices(cfg.distributed)
    distributed.check_batch(cfg.data.batch_size, len(devices), jax.process_count())
    if cfg.data.format == "preference" and len(devices) > 1:
        raise ConfigError(f"data.format=preference is not data parallel yet ({len(devices)} "
                          f"devices from distributed.local_devices/num_processes); run it on one")
    quiet = jax.process_index() != 0
    # validate all inputs before anything is written (a token cache is built here, outside run_dir)
    dataset, eval_set = load_data(cfg, log=(lambda *a, **k: None) if quiet else log)
    me, processes = jax.process_index(), jax.process_count()
    dataset.share = (me, processes)  # this process reads its rows of every batch, no more
    if eval_set:
        eval_set = [distributed.share(batch, me, processes) for batch in eval_set]
    placed = dict(compute_devices=devices, host_device=host_device)
    if me != 0:  # the others train alongside, quietly, writing nothing
        history = _train_locked(cfg, dataset, eval_set, lambda *a, **k: None, None, placed)
        distributed.finish(cfg.distributed)
        return history
    metrics_log.check(cfg)
    try:  # freed layer-sized buffers go back to the kernel: ~22 -> ~14 B/param of RSS, see
        hostmem.set_mmap_threshold(1 << 20)  # docs/benchmarks.md "Host memory per parameter"
    except OSError:  # not glibc: nothing to tune
        pass
    created = not os.path.exists(cfg.run_dir)
    prepare_run_dir(cfg.run_dir)
    try:
        with RunLock(cfg.run_dir, log=log):
            history = _train_locked(cfg, dataset, eval_set, log, console, placed)
        distributed.finish(cfg.distributed)  # every process ends together
        return history
    except BaseException:
        if created:  # refused before writing anything (a first step out of memory too): no trace
            for directory in (os.path.join(cfg.run_dir, "checkpoints"), cfg.run_dir):
                if os.path.isdir(directory) and not os.listdir(directory):
                    os.rmdir(directory)
        raise


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def _out_of_memory_line(e: BaseException, step: int, run_plan) -> str:
    asked = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"out of memory at step {step} ({asked[:200]}); the plan predicted a device peak of "
            f"{run_plan.device_peak / 1e9:.2f} GB of {run_plan.machine.device_memory_gb:.2f} GB and "
            f"{run_plan.host_total / 1e9:.2f} GB of {run_plan.machine.host_memory_gb:.2f} GB host "
            f"RAM; lower data.seq_len, data.batch_size or train.tile_size, or set "
            f"train.offload_activations=true (python scripts/plan.py shows what fits)")


def _raise_if_lost(e: BaseException, step: int):
    """With several processes: a step that failed because another process is gone is a
    TrainingError naming it (exit 1)."""
    if jax.process_count() > 1:
        line = distributed.lost_line(e, step)
        if line:
            raise TrainingError(line) from None


def _tier_fault(e: tier_lib.TierError, step: int, manager) -> TrainingError:
    """The disk tier failed at step `step` (its files are scratch: the checkpoints hold the run)."""
    return TrainingError(f"stopped at step {step}: {e}; {checkpoint.completed(manager)}; run the "
                         f"same command again to resume")


def _peak_flops(cfg: Config, device) -> tuple[float | None, str]:
    """(the bf16 dense peak FLOP/s that MFU is measured against, or None, and where it is from)."""
    if cfg.logging.peak_tflops:
        return (cfg.logging.peak_tflops * 1e12,
                f"MFU against logging.peak_tflops={cfg.logging.peak_tflops:g}")
    tflops = plan_lib.peak_bf16_tflops(device.device_kind)
    if tflops is None:
        return None, f"no MFU: {device.device_kind} has no known peak (set logging.peak_tflops)"
    return tflops * 1e12, f"MFU against {tflops:g} bf16 TFLOPS ({device.device_kind})"


ADVICE_AFTER = 3  # steps into a run: the first compiles, the next two are measured


def _train_locked(cfg: Config, dataset, eval_set, log, console, placed) -> list[dict]:
    primary = jax.process_index() == 0
    identity = fingerprint.files_identity(source_files.data_files(cfg.data))  # read once
    resume_step = resume_point(cfg, log, identity)
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    if os.path.isdir(ckpt_dir):  # else run_dir was just checked; make_manager creates it
        checkpoint.check_writable(ckpt_dir)  # before training, not at the first save
    # What the run needs, before anything is allocated: a run that cannot fit stops here.
    # Planned for one device's rows: data parallel splits each micro-batch over the devices.
    devices = len(placed["compute_devices"])
    per_device = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, batch_size=cfg.data.batch_size // devices))
    run_plan = plan_lib.plan(per_device, plan_lib.machine_from_device(jax.local_devices()[0]))
    if not run_plan.fits and not cfg.train.ignore_plan:
        raise ConfigError(f"this config does not fit: {' '.join(run_plan.summary().split())} "
                          f"(python scripts/plan.py --config ... shows what would; "
                          f"train.ignore_plan=true runs it anyway)")
    if cfg.offload.tier == "disk":  # the engine checks its exact bytes again, before writing
        try:
            tier_lib.check_writable(cfg.offload.path)
            tier_lib.check_space(cfg.offload.path, run_plan.disk_bytes)
        except tier_lib.TierError as e:
            raise ConfigError(str(e)) from None
    engine = build_engine(cfg, offload_activations=run_plan.offload_activations, **placed)
    ckpt = cfg.checkpoint
    sharded = engine.shards is not None  # every process saves (and restores) its rows
    manager = checkpoint.make_manager(ckpt_dir, keep=ckpt.keep, async_save=ckpt.async_save,
                                      write_bytes=checkpoint.largest_unit_bytes(engine),
                                      sharded=sharded)
    if cfg.data.format == "preference":  # the starting weights', before any checkpoint's
        dpo.prepare_reference(cfg, engine, dataset, log)
    start, saved_progress = 0, {}
    if resume_step is not None:
        # The saved shapes are checked against the engine's before anything is loaded.
        meta = checkpoint.restore(manager, engine, resume_step)
        dataset.restore(meta["data_state"])
        start, saved_progress = meta["step"], meta.get("progress", {})

    log(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    peak_flops, peak_source = _peak_flops(cfg, engine.compute_device)
    log(f"model: {cfg.model.num_params() / 1e6:.2f}M params, {cfg.model.num_layers} layers | "
        f"{dataset.tokens_per_batch} tokens/step | compute {engine.compute_device.platform}"
        f"{_data_parallel_note(devices)} | {peak_source}")
    if peak_flops is not None:
        peak_flops *= devices  # MFU of the whole run: every device's peak
    log(run_plan.summary())
    if not run_plan.fits:
        log("plan: overridden by train.ignore_plan=true: running a config the plan says does not "
            "fit (an out-of-memory error names the step)")
    if engine.disk_tier is not None:
        tier = engine.disk_tier
        log(f"disk tier: {tier.total_bytes / 1e9:.2f} GB in {tier.path} ({tier.opened}), "
            f"read ahead {cfg.offload.read_ahead} layers, {tier.io_mode}")
    log(dataset.summary)  # the data's tokens; for sft/preference, what was truncated, skipped
    if eval_set:
        when = (f"every {cfg.train.eval_every} steps and at the end" if cfg.train.eval_every
                else "at the end")
        log(f"eval: {len(eval_set)} batches of {dataset.tokens_per_batch} tokens from "
            f"{_eval_source(cfg)}, {when}")
    if start:
        log(f"resumed from checkpoint step {start} ({manager.directory})")
    metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
    history, bad_steps = [], 0
    # Updates applied so far: the count the schedule reads (a skipped step applies none). Older
    # checkpoints did not record it: their steps, as if none had been skipped.
    updates = saved_progress.get("updates", start)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # each step's lr, for the log
        lrs = np.asarray(build_schedule(cfg.optimizer, cfg.train.steps)(np.arange(cfg.train.steps)))
    meter = progress.Meter(total_steps=cfg.train.steps, start_step=start,
                           tokens_per_step=dataset.tokens_per_batch,
                           flops_per_token=plan_lib.flops_per_token(cfg.model, cfg.data.seq_len),
                           peak_flops=peak_flops, device=engine.compute_device,
                           smoothing=saved_progress.get("loss_smooth"))
    with _StopSignals() as stop, contextlib.ExitStack() as files:
        live = None
        if console is not None and console.is_terminal and start < cfg.train.steps:
            live = files.enter_context(progress.LiveDisplay(
                console, total_steps=cfg.train.steps, start_step=start))
        metrics_file = None
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            inputs, targets, context = dataset.next_batch_with_context()
            try:
                out = engine.train_step(inputs, targets, context)
                loss, grad_norm = float(out["loss"]), float(out["grad_norm"])  # the sync point
            except (jax.errors.JaxRuntimeError, MemoryError) as e:
                if _is_out_of_memory(e):
                    raise ConfigError(_out_of_memory_line(e, step, run_plan)) from None
                _raise_if_lost(e, step)
                raise
            except tier_lib.TierError as e:  # e.g. the disk of offload.path filled mid-run
                raise _tier_fault(e, step, manager) from None
            except (RuntimeError, ValueError) as e:  # gloo's failed collective is a ValueError
                _raise_if_lost(e, step)
                raise
            dt = time.perf_counter() - t0
            if step == start + 1:  # after the compiling step: advice measures the next ones
                counted, timed = dataclasses.replace(engine.counters), []
            elif step <= start + ADVICE_AFTER:
                timed.append(dt)
            if metrics_file is None:  # the first step ran: now the run writes its files
                if primary:
                    _write_config(cfg)
                    _keep_metrics_through(metrics_path, start)
                metrics_file = files.enter_context(open(metrics_path if primary else os.devnull,
                                                        "a"))
                sinks = (metrics_log.Sinks.open(cfg, start, log) if primary  # TensorBoard, W&B
                         else metrics_log.Sinks())
                files.push(_closing(sinks.close))
            record = {"step": step, "loss": loss, "grad_norm": grad_norm,
                      "tokens_per_sec": dataset.tokens_per_batch / dt, "step_time_s": dt,
                      "lr": float(lrs[updates])}  # the rate this step's update uses
            if "aux_loss" in out:  # a mixture of experts' load balancing, included in loss
                record["aux_loss"] = float(out["aux_loss"])
            if "stats" in out:  # the DPO head's: reward margin and accuracy, log-probs
                record.update(dpo.step_metrics(out["stats"]))
            bad_steps = 0 if math.isfinite(grad_norm) else bad_steps + 1
            if bad_steps:
                record["skipped"] = True
            else:
                updates += 1
            # Forward only: reads the weights (after this step's update), changes nothing.
            evaluating = bool(eval_set) and (
                (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == cfg.train.steps)
            if evaluating:
                eval_loss = evaluate(engine, eval_set)
                record["eval_loss"] = eval_loss
                record["eval_ppl"] = math.exp(eval_loss) if eval_loss < 700 else math.inf
            record.update(meter.measure(step, loss, dt))
            if live is not None:
                live.update(record)
            history.append(record)
            metrics_file.write(_json_line(record))
            metrics_file.flush()
            sinks.write(record)
            if bad_steps:
                where = ", ".join(map(str, engine.nonfinite_units())) or "the loss"
                log(f"step {step:5d} | non-finite gradient (in {where}): skipped, weights and "
                    f"optimizer state unchanged ({bad_steps} of train.max_bad_steps="
                    f"{cfg.train.max_bad_steps} in a row)")
                if bad_steps >= cfg.train.max_bad_steps:
                    checkpoint.wait(manager)  # the last one written is complete before it is named
                    raise TrainingError(
                        f"stopped at step {step}: {bad_steps} consecutive steps with a non-finite "
                        f"gradient (train.max_bad_steps={cfg.train.max_bad_steps}, last in "
                        f"{where}); no update and no checkpoint was made from them; "
                        f"{_resume_hint(manager)}")
            elif step % cfg.train.log_every == 0 or step == cfg.train.steps:
                log(progress.line(record, total_steps=cfg.train.steps))
            if step == start + ADVICE_AFTER:
                for line in advice.for_run(cfg, engine, run_plan.machine, counted, timed):
                    log(line)
            if evaluating:
                log(f"step {step:5d} | eval loss {record['eval_loss']:.4f} | "
                    f"ppl {record['eval_ppl']:.2f}")
            if (ckpt.every and step % ckpt.every == 0) or step == cfg.train.steps or stop.received:
                if not primary and not sharded:  # replicated host state: process 0 saves it all
                    pass
                elif bad_steps:  # its state is an earlier step's: saved, it would rotate that out
                    log(f"step {step:5d} | skipped: no checkpoint ({_last_checkpoint(manager)})")
                elif step in manager.all_steps():  # only after resume_step: never overwrite one
                    log(f"checkpoint step {step} already exists in {manager.directory}; kept as is")
                else:
                    try:  # the state is read back from the disk tier's files, which may fail
                        checkpoint.save(manager, step, engine, {
                            "config": to_dict(cfg), "data_state": dataset.state(),
                            "data_files": identity,
                            "progress": {"updates": updates, "loss_smooth": meter.smoothing()},
                            "rng": {"seed": cfg.train.seed}})  # the home of a future dropout key
                    except tier_lib.TierError as e:
                        raise _tier_fault(e, step, manager) from None
            if stop.received:
                log(f"{stop.received} received: stopped after step {step} with a checkpoint; "
                    f"run the same command again to resume" if not bad_steps else
                    f"{stop.received} received: stopped after step {step}, skipped; "
                    f"{_resume_hint(manager)}")
                break
        checkpoint.wait(manager)  # inside: a second signal still exits at once
    if cfg.data.sources:
        log(dataset.report())  # the tokens each source of the mixture gave
    manager.close()
    engine.close()
    if start >= cfg.train.steps:
        log(f"nothing to do: checkpoint step {start} reached train.steps={cfg.train.steps}")
    return history


def _last_checkpoint(manager) -> str:
    step = manager.latest_step()
    if step is None:
        return f"none written yet in {manager.directory}"
    return f"the last is step {step} in {manager.directory}"


def _resume_hint(manager) -> str:
    """Where the run can go on from after non-finite steps, and how."""
    step = manager.latest_step()
    if step is None:
        return ("no checkpoint was written before them: start again with a lower "
                "optimizer.learning_rate, or check the data")
    return (f"the last checkpoint written before them is step {step} in {manager.directory}; "
            f"to resume from it, run again with a lower optimizer.learning_rate and "
            f"checkpoint.allow_changes=[optimizer] (or check the data)")


def _json_line(record: dict) -> str:
    """A metrics.jsonl line: strict JSON, so a non-finite number (a skipped step's grad_norm, an
    infinite perplexity) is null."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in record.items()}
    return json.dumps(finite) + "\n"


def _closing(close):
    """An ExitStack exit for close(): a close that fails while an error is on its way out (a full
    disk fails TensorBoard's flush too) leaves that error, which names the step and the
    checkpoints, in place."""
    def exit_(exc_type, exc, tb):
        try:
            close()
        except Exception:
            if exc is None:
                raise
        return False
    return exit_


def _data_parallel_note(devices: int) -> str:
    if devices == 1:
        return ""
    return (f" x {devices} (data parallel: {jax.process_count()} process(es) x "
            f"{devices // jax.process_count()} devices)")


def _eval_source(cfg: Config) -> str:
    if cfg.data.eval_path:
        return cfg.data.eval_path
    return f"the last {cfg.data.eval_fraction:g} of {cfg.data.path} (data.eval_fraction)"


def _write_config(cfg: Config):
    path = os.path.join(cfg.run_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:  # a full disk leaves the old one whole
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    os.replace(path + ".tmp", path)
