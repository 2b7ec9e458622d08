"""Export (`export_checkpoint`, behind scripts/export_hf.py and `megatrain export`): a checkpoint's
parameters read a shard at a time and written as a HF model directory: safetensors shards, the
index, config.json and the source model's tokenizer files.
"""

import json
import math
import os
import re
import shutil
import tempfile

import jax
import ml_dtypes
import numpy as np

from megatrain_jax.hf.config import hf_config
from megatrain_jax.hf.files import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE, HFError,
                                    copy_tokenizer_files, read_hf_config, read_json,
                                    save_safetensors)
from megatrain_jax.hf.tensors import Expert, all_tensors, parts, to_hf_layout
from megatrain_jax.model import ModelConfig

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
EXPORT_OLDER = "export an older one with --step {step}"  # the hint for a damaged checkpoint


def parse_size(text: str) -> int:
    """"2GB", "500MB", "1.5GiB", "4096" -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m or m.group(1).count(".") > 1:
        raise HFError(f"--shard-size {text!r}: expected a size like 2GB, 500MB or 1048576")
    base = 1024 if m.group(3) else 1000
    size = int(float(m.group(1)) * base ** "_KMGT".index(m.group(2).upper() or "_"))
    if size < 1:
        raise HFError(f"--shard-size {text!r} must be at least one byte")
    return size


def plan_shards(tensors, itemsize: int, shard_size: int) -> list:
    """Greedy in file order: a new shard when the next tensor would overflow the current one."""
    shards, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * itemsize
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _state_path(unit: int, key) -> str:
    """Where a parameter lives in engine.state() (the agreed checkpoint layout), spelled like
    checkpoint.path_str."""
    if unit == 0:
        return f"stages/params/{key[0]}/{key[1]}"
    if isinstance(key, Expert):  # one expert of an (E, ...) parameter
        key = key[0]
    return f"layers/{unit - 1}/params/{key}"


def _carry_chat_template(run_config: dict, out_dir: str) -> str:
    """A chat run (data.format sft or preference) trained with its tokenizer's chat template:
    written into out_dir's tokenizer_config.json as `chat_template` (with the special tokens it
    renders, where the file lacks them), and into chat_template.jinja if one was copied (which
    transformers prefers), so that the export renders conversations as the run did. Returns what
    it did, as the end of copy_tokenizer_files's line."""
    from megatrain_jax.chat import ChatTemplate
    from megatrain_jax.data import DataError

    data = run_config.get("data", {})
    if data.get("format") not in ("sft", "preference"):
        return ""
    try:
        template = ChatTemplate.for_tokenizer(data.get("tokenizer") or "")
    except DataError:
        return (f"; no chat template: the run's data.tokenizer={data.get('tokenizer')} has none "
                f"now (copy it by hand)")
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    config = read_json(config_path, "tokenizer config") if os.path.isfile(config_path) else {}
    config = {**template.variables, **config, "chat_template": template.source}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    jinja_path = os.path.join(out_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, "w", encoding="utf-8") as f:
            f.write(template.source)
    return f"; the chat template it trained with (from {template.where}) in tokenizer_config.json"


def _write_shards(manager, step, tree, tmp, shards, names, np_dtype, where, meta) -> int:
    """Writes each shard's tensors, restored from checkpoint `step` a shard at a time, as
    safetensors files in tmp; returns the bytes written. A tensor that is not finite, or would not
    be in np_dtype, is refused."""
    import orbax.checkpoint as ocp

    from megatrain_jax import checkpoint

    limit = float(ml_dtypes.finfo(np_dtype).max)
    total = 0
    for shard, file_name in zip(shards, names):
        wanted = {_state_path(unit, part) for _, shape, unit, key, _ in shard
                  for part, _, _ in parts(key, shape)}
        target = jax.tree_util.tree_map_with_path(
            lambda p, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            if checkpoint.path_str(p) in wanted else ocp.PLACEHOLDER, tree)
        restore_args = jax.tree.map(
            lambda leaf: ocp.PLACEHOLDER if leaf is ocp.PLACEHOLDER
            else ocp.RestoreArgs(restore_type=np.ndarray), target)
        try:
            state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args)))["state"]
        except Exception as e:
            raise checkpoint.unreadable(manager, step, e, older=EXPORT_OLDER) from None
        restored = {checkpoint.path_str(p): x
                    for p, x in jax.tree_util.tree_leaves_with_path(state)
                    if x is not ocp.PLACEHOLDER}
        restored = {p: checkpoint.cut_padding(meta, p, x) for p, x in restored.items()}
        del state
        out = {}
        for name, shape, unit, key, transpose in shard:
            pieces = parts(key, shape)  # a Fused tensor is written part by part into one buffer
            tensor = np.empty(shape, np_dtype) if len(pieces) > 1 else None
            for part, first, end in pieces:
                path = _state_path(unit, part)
                # pop: each fp32 leaf is freed as soon as its converted copy exists (an (E, ...)
                # expert parameter once the shard is written)
                leaf = restored[path][part[1]] if isinstance(part, Expert) else restored.pop(path)
                lo, hi = float(np.min(leaf)), float(np.max(leaf))  # NaN propagates; no temporaries
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    raise HFError(f"{where}: {path} ({name}) holds NaN or inf; refusing to export "
                                  f"it")
                if max(-lo, hi) > limit:
                    raise HFError(f"{where}: {path} ({name}) holds {max(-lo, hi):.4g}, beyond "
                                  f"{np.dtype(np_dtype).name}'s largest value ({limit:.4g}); "
                                  f"export with --dtype float32")
                piece = to_hf_layout(leaf, (end - first, *shape[1:]), transpose, np_dtype)
                if tensor is None:
                    tensor = piece
                else:
                    tensor[first:end] = piece
                del leaf, piece
            out[name] = tensor
            total += tensor.nbytes
            del tensor
        save_safetensors(out, tmp, file_name)
        del out, restored
    return total


def export_checkpoint(run_dir: str, out_dir: str, *, step: int | None = None,
                      dtype: str = "float32", shard_size="2GB", log=print) -> str:
    """Writes checkpoint `step` (default: the latest) of `run_dir` as a HF model directory.

    Parameters only, read a shard at a time (Orbax restores just the leaves a shard needs; the
    optimizer state is never read), so RAM holds one shard, not the model. The directory is
    written next to `out_dir` and renamed into place when complete. Returns out_dir."""
    from megatrain_jax import checkpoint

    if dtype not in EXPORT_DTYPES:
        raise HFError(f"--dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    shard_bytes = parse_size(shard_size)
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise HFError(f"--out {out_dir} exists and is not an empty directory; not overwriting it")
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):  # checked first: make_manager would create it
        raise HFError(f"--run-dir {run_dir}: no checkpoints directory {ckpt_dir}")
    manager = checkpoint.make_manager(ckpt_dir, async_save=False)
    try:
        step = checkpoint.resolve_step(manager, step)
        if step is None:
            raise HFError(f"--run-dir {run_dir}: no complete checkpoint in {ckpt_dir}")
        where = f"checkpoint step {step} in {ckpt_dir}"
        meta, tree = checkpoint.read_meta(manager, step, older=EXPORT_OLDER)
        try:
            cfg = ModelConfig(**meta["config"]["model"])
        except (KeyError, TypeError, ValueError) as e:
            raise HFError(f"{where}: no usable config.model in its meta ({e})") from None
        tree = getattr(tree, "tree", tree)  # a TreeMetadata wraps the plain nested dict
        saved = {checkpoint.path_str(p): leaf
                 for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}
        for name, shape, unit, key, _ in all_tensors(cfg):  # every parameter, unfused
            leaf = saved.get(_state_path(unit, key))
            size = math.prod(shape) * (cfg.num_experts if isinstance(key, Expert) else 1)
            rows = meta.get("logical_rows", {}).get(_state_path(unit, key))  # a sharded save's
            if leaf is not None and rows is not None:
                leaf = jax.ShapeDtypeStruct((rows,) + tuple(leaf.shape[1:]), leaf.dtype)
            if leaf is None or math.prod(leaf.shape) != size:
                raise HFError(f"{where} does not match its config: {_state_path(unit, key)} "
                              f"({name}) is {'absent' if leaf is None else tuple(leaf.shape)}")

        try:  # keep the source model's token ids etc.; optional: a missing or bad one is skipped
            base = read_hf_config(cfg.from_hf) if cfg.from_hf else None
        except HFError:
            base = None
        max_positions = meta.get("config", {}).get("data", {}).get("seq_len", 2048)
        # before any shard is written: a model no HF architecture describes fails here
        config = hf_config(cfg, dtype=dtype, max_position_embeddings=max_positions, base=base)
        tensors = all_tensors(cfg, config["architectures"][0])  # Phi-3: fused
        np_dtype = EXPORT_DTYPES[dtype]
        shards = plan_shards(tensors, np.dtype(np_dtype).itemsize, shard_bytes)
        names = ([SINGLE_FILE] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(len(shards))])

        parent = os.path.dirname(os.path.abspath(out_dir))
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise HFError(f"--out {out_dir}: {parent} is not a directory")
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
        except OSError as e:
            raise HFError(f"--out {out_dir}: cannot write in {parent} ({e.strerror})") from None
        try:  # any failure removes the half-written directory
            total = _write_shards(manager, step, tree, tmp, shards, names, np_dtype, where,
                                  meta)
            if len(shards) > 1:
                weight_map = {t[0]: name for shard, name in zip(shards, names) for t in shard}
                with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                              indent=2)
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(config, f, indent=2)
            copied = copy_tokenizer_files(meta.get("config", {}), tmp)
            copied += _carry_chat_template(meta.get("config", {}), tmp)
            # mkdtemp makes the directory private (0700); give the result the usual permissions.
            umask = os.umask(0)
            os.umask(umask)
            for name in os.listdir(tmp):
                os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
            os.chmod(tmp, 0o777 & ~umask)
            os.replace(tmp, out_dir)  # atomic; replaces only an empty directory
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise HFError(f"--out {out_dir}: writing the export failed "
                          f"({e.strerror or e})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        manager.close()
    log(f"exported {where} to {out_dir}: {len(tensors)} tensors, {total / 1e6:,.1f} MB {dtype} "
        f"in {len(shards)} shard{'s' * (len(shards) > 1)}")
    log(copied)
    return out_dir

