"""Sampling from a run's checkpoint or a Hugging Face model directory, with a KV cache, the layers
streamed through the device as in training (megatrain_jax.engine.decode): `megatrain generate`
and scripts/generate.py.

    model = from_run("runs/tiny")                    # or from_hf("models/Qwen2.5-0.5B")
    ids = model.tokenizer.encode("CYNIC, n.")
    new = generate(model, ids, max_new_tokens=100, temperature=0.8, top_p=0.95, seed=0)
    print(model.tokenizer.decode(new))

What is the model's here: `Block.prefill` and `Block.decode` (megatrain_jax/model.py, the same
attention and MLP code as training's forward), `LMHead.logits`, the tokenizer, the context length.
The cache has a fixed size (the prompt plus max_new_tokens, at most the context), so one compiled
decode step serves every token.
"""

import dataclasses
import json
import math
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax import checkpoint
from megatrain_jax import data as data_lib
from megatrain_jax import hf
from megatrain_jax.config import Config, ConfigError, from_dict
from megatrain_jax.engine.decode import StreamedDecoder
from megatrain_jax.model import Block, block_constants, make_stages


class HFTextTokenizer:
    """A HF model directory's tokenizer.json, as transformers' tokenizer(prompt) uses it: with
    its special tokens (e.g. BOS) added; EOS ids from generation_config.json or config.json."""

    def __init__(self, path: str, eos_ids: tuple):
        from tokenizers import Tokenizer
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise data_lib.DataError(f"could not load tokenizer {path}: "
                                     f"{str(e).splitlines()[0]}") from None
        self.eos_ids = eos_ids

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=True).ids, np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


@dataclasses.dataclass
class Model:
    """What generation needs of a model: its config (model and train sections), where its weights
    come from (`first_last()`, `block(i)`, fp32 modules built on the host), its tokenizer, its
    context length and where that figure comes from, and what it is (for messages)."""
    cfg: Config
    first_last: Callable
    block: Callable
    tokenizer: object
    context: int
    context_source: str
    what: str
    close: Callable = lambda: None  # once the weights are read (a run's checkpoint manager)


def _eos_ids(model_dir: str) -> tuple:
    for name in ("generation_config.json", hf.CONFIG_FILE):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def _module(abstract, params: dict):
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def from_hf(model_dir: str, *, tokenizer: bool = True) -> Model:
    """A local HF model directory: config.json, safetensors weights read a layer at a time,
    tokenizer.json (needed only to encode a text prompt), max_position_embeddings."""
    if not os.path.isdir(model_dir):
        raise hf.HFError(f"--hf {model_dir} is not a directory")
    model_cfg = hf.model_config_from_hf(model_dir)
    cfg = Config(model=model_cfg)
    source = hf.HFSource(model_dir)
    conf = hf.text_config(hf.read_hf_config(model_dir), model_dir)
    context = int(conf.get("max_position_embeddings") or 0)
    tok = None
    if tokenizer:
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise data_lib.DataError(f"--hf {model_dir}: no tokenizer.json to encode the prompt")
        tok = HFTextTokenizer(path, _eos_ids(model_dir))
    return Model(
        cfg=cfg, first_last=lambda execution: hf.load_stages(model_cfg, source, execution),
        block=lambda i, execution: hf.load_block(model_cfg, source, i, execution),
        tokenizer=tok, context=context or 1 << 30,
        context_source=(f"max_position_embeddings in {os.path.join(model_dir, hf.CONFIG_FILE)}"
                        if context else "none given"), what=f"{model_dir}")


def _run_context(cfg: Config, run_dir: str) -> tuple:
    """(context, where the figure is from): the source model's max_position_embeddings when the
    run started from a HF directory that is still there (as export writes it), else the
    sequence length it trained at."""
    if cfg.model.from_hf:
        try:
            conf = hf.text_config(hf.read_hf_config(cfg.model.from_hf), cfg.model.from_hf)
            if conf.get("max_position_embeddings"):
                return (int(conf["max_position_embeddings"]),
                        f"max_position_embeddings in {cfg.model.from_hf}/config.json, the run's "
                        f"model.from_hf")
        except hf.HFError:
            pass
    return cfg.data.seq_len, f"data.seq_len of {run_dir}"


def from_run(run_dir: str, step: int | None = None) -> Model:
    """Checkpoint `step` (default: the latest) of a training run: its config (from the checkpoint),
    its parameters read a unit at a time (never the optimizer state), the run's tokenizer."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(run_dir):
        raise checkpoint.CheckpointError(f"--run {run_dir}: no such run directory")
    if not os.path.isdir(ckpt_dir):  # checked first: make_manager would create it
        raise checkpoint.CheckpointError(f"--run {run_dir}: no checkpoint (no {ckpt_dir})")
    manager = checkpoint.make_manager(ckpt_dir, async_save=False)
    step = checkpoint.resolve_step(manager, step)  # a missing --step: CheckpointError naming it
    if step is None:
        manager.close()
        raise checkpoint.CheckpointError(f"--run {run_dir}: no complete checkpoint in {ckpt_dir}")
    meta, tree = checkpoint.read_meta(manager, step)
    where = f"checkpoint step {step} in {ckpt_dir}"
    try:
        cfg = from_dict(meta["config"])
    except (KeyError, ConfigError) as e:
        raise checkpoint.CheckpointError(f"{where}: no usable config in its meta ({e})") from None
    d = cfg.data
    tokenizer = data_lib.load_tokenizer(d.tokenizer, eos_token=d.eos_token or None)
    tokenizer.eos_ids = (tokenizer.eos_id,)
    context, source = _run_context(cfg, run_dir)
    model_cfg = cfg.model

    def finite(params, unit: str):  # NaN weights would generate garbage: refused, as export does
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if not (np.isfinite(np.min(leaf)) and np.isfinite(np.max(leaf))):  # NaN propagates
                raise checkpoint.CheckpointError(
                    f"{where}: {unit}/params/{checkpoint.path_str(path)} holds NaN or inf; "
                    f"refusing to generate from it")
        return params

    def first_last(execution):
        params = finite(checkpoint.read_params(manager, step, tree, "stages", meta), "stages")
        abstract = nnx.eval_shape(lambda: make_stages(model_cfg, 0, execution))
        return _module(abstract, {int(k): v for k, v in params.items()})

    def block(i, execution):
        abstract = nnx.eval_shape(lambda: Block(model_cfg, rngs=nnx.Rngs(0), execution=execution))
        params = finite(checkpoint.read_params(manager, step, tree, i, meta), f"layers/{i}")
        expected = nnx.to_pure_dict(nnx.split(abstract, nnx.Param, ...)[1])
        for key, value in expected.items():
            got = params.get(key)
            if got is None or tuple(got.shape) != tuple(value.shape):
                raise checkpoint.CheckpointError(
                    f"{where} does not match its config: layers/{i}/params/{key} is "
                    f"{'absent' if got is None else tuple(got.shape)}, expected {value.shape}")
        # (a checkpoint from before the layer's kind was a Constant holds it as a param, perhaps
        # decayed: the config's stands)
        return _module(abstract, {**params, **block_constants(model_cfg, i)})

    return Model(cfg=cfg, first_last=first_last, block=block, tokenizer=tokenizer,
                 context=context, context_source=source, what=where, close=manager.close)


def decoder(model: Model, max_len: int, *, compute_dtype=None, compute_device=None,
            host_device=None) -> StreamedDecoder:
    """The StreamedDecoder of `model` with caches of `max_len` positions, computing in
    compute_dtype (default: the run's train.compute_dtype)."""
    from megatrain_jax.recipes import execution_for
    compute = compute_device or jax.devices()[0]
    dtype = jnp.dtype(compute_dtype or model.cfg.train.compute_dtype)
    train_cfg = dataclasses.replace(model.cfg.train, compute_dtype=dtype.name)
    execution, choice = execution_for(dataclasses.replace(model.cfg, train=train_cfg),
                                      compute.platform)
    if choice.notice:  # what runs instead of what the run's config asked for, said once
        print(choice.notice, file=sys.stderr)
    host = host_device or jax.devices("cpu")[0]
    with jax.default_device(host):
        first, last = model.first_last(execution)
    return StreamedDecoder(
        first=first, last=last, make_block=lambda i: model.block(i, execution),
        num_layers=model.cfg.model.num_layers,
        start=lambda block, x: block.prefill(x, max_len),
        extend=lambda block, x, cache, position: block.decode(x, cache, position),
        logits=lambda last, x: last.logits(x), compute_dtype=dtype,
        prefetch=model.cfg.train.prefetch, compute_device=compute, host_device=host)


@jax.jit
def _sample(logits, key, temperature, top_p):
    """(B,) token ids sampled from (B, V) logits at `temperature`, from the smallest set of most
    likely tokens whose probability reaches top_p (nucleus sampling, as transformers' top_p)."""
    # The largest logit subtracted first: any positive temperature divides numbers <= 0, which
    # may underflow to -inf (probability 0) but never overflow to NaN
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax((logits - logits.max(axis=-1, keepdims=True)) / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    keep = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p  # the first always stays
    choice = jax.random.categorical(key, jnp.where(keep, jnp.log(sorted_probs), -jnp.inf))
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def check_temperature(temperature: float):
    """A sampling temperature must be a finite number >= 0 (inf would sample uniform noise)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got "
                          f"{temperature:g}")


def check_length(model: Model, prompt_len: int):
    """A prompt must leave room for a token in the model's context."""
    if prompt_len < 1:
        raise ConfigError("--prompt is empty (it encodes to no token)")
    if prompt_len >= model.context:
        raise ConfigError(f"--prompt is {prompt_len:,} tokens, too long for the model's context "
                          f"of {model.context:,} tokens ({model.context_source})")


def generate(model: Model, prompt_ids, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_ids=(), on_token=None, compute_dtype=None,
             decode: StreamedDecoder | None = None, stats: dict | None = None) -> list:
    """The new token ids after `prompt_ids`, one row: greedy (temperature 0) or sampled, stopping
    at an id in `eos_ids` (not returned), after max_new_tokens, or when the prompt and the new
    tokens fill the model's context.
    on_token(id) is called as each arrives. `decode` reuses a StreamedDecoder (its caches must
    hold the prompt plus max_new_tokens); `stats`, when given, gets timings and counts."""
    check_temperature(temperature)
    # Below fp32's smallest normal number (~1.2e-38) a temperature is 0 to XLA (denormals are
    # flushed): greedy, the limit of sampling as the temperature goes to 0
    sample = temperature >= np.finfo(np.float32).tiny
    prompt = np.asarray(prompt_ids, np.int32).reshape(1, -1)
    check_length(model, prompt.shape[1])
    total = min(model.context, prompt.shape[1] + max_new_tokens)
    if decode is None:
        decode = decoder(model, total, compute_dtype=compute_dtype)
        model.close()  # every weight is read
    key = jax.random.key(seed)
    t0 = time.perf_counter()
    logits = decode.start(prompt)
    new, t1 = [], None
    while True:
        if sample:
            token = _sample(logits, jax.random.fold_in(key, len(new)), temperature, top_p)
        else:
            token = jnp.argmax(logits, axis=-1)
        token = int(token[0])
        t1 = t1 or time.perf_counter()
        if token in eos_ids:
            break
        new.append(token)
        if on_token is not None:
            on_token(token)
        if prompt.shape[1] + len(new) >= total:
            break
        logits = decode.extend(np.asarray([[token]], np.int32))
    if stats is not None:
        t2 = time.perf_counter()
        stats.update(prompt_tokens=prompt.shape[1], new_tokens=len(new), prefill_s=t1 - t0,
                     decode_s=t2 - t1, stopped_at_context=prompt.shape[1] + len(new) >= total
                     and total == model.context)
    return new
