"""Import (`model.from_hf: DIR`): `config.json` becomes a ModelConfig, and the safetensors weights
are read one tensor at a time, cast and transposed in one pass into the fp32 host layout of
megatrain_jax.model, one layer at a time (`load_stages`, `load_block`), so the engine never holds a
second copy of the model.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from megatrain_jax.hf.config import MOE_ARCHITECTURES, TEXT_PARTS, model_config
from megatrain_jax.hf.files import (FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE, HFError,
                                    all_finite, open_safetensors, read_hf_config, read_json)
from megatrain_jax.hf.tensors import (FUSED_EXPERTS, Expert, ExpertsFused, all_tensors,
                                      block_tensors, parts, stage_tensors, to_host_layout)
from megatrain_jax.model import Block, Execution, ModelConfig, block_constants, make_stages

# Buffers some older checkpoints saved next to the weights; recomputed, so skipped.
IGNORED_TENSOR = re.compile(r".*\.rotary_emb\.inv_freq$")


def model_config_from_hf(model_dir: str) -> ModelConfig:
    """The ModelConfig of a local HF model directory, with `from_hf=model_dir`.

    Checks the weights too (every expected tensor present with the right shape, no unexpected one,
    every shard there), reading only the safetensors headers, so a bad directory fails here,
    before a run writes anything."""
    cfg = model_config(read_hf_config(model_dir), model_dir)
    HFSource(model_dir).check(cfg)
    return cfg


class HFSource:
    """The safetensors weights of a HF model directory: which file holds which tensor, and (from
    config.json) the architecture, which says how they are laid out (fused or not)."""

    def __init__(self, model_dir: str):
        self.dir = model_dir
        archs = read_hf_config(model_dir).get("architectures")
        self.arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
        self.stored = {}  # our name -> the name in the files, where they differ (TEXT_PARTS)
        index_path = os.path.join(model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map = read_json(index_path, "index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFError(f"{index_path}: no weight_map")
            self.files = dict(weight_map)
        elif os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
            with self._open(SINGLE_FILE) as f:
                self.files = {name: SINGLE_FILE for name in f.keys()}
        else:
            raise HFError(f"model.from_hf {model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only "
                          f"safetensors weights are read, never pickled *.bin files)")
        if self.arch in TEXT_PARTS:  # the text decoder's tensors, under the text model's names
            part = TEXT_PARTS[self.arch]
            self.arch, prefix, files = part["text"], part["prefix"], self.files
            self.files = {}
            for name, shard in files.items():
                if name.startswith(prefix):
                    self.stored[name[len(prefix):]] = name
                    self.files[name[len(prefix):]] = shard
                elif not name.startswith(part["others"]):
                    self.files[name] = shard  # unexpected: check() names it
        for shard in sorted(set(self.files.values())):
            if os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
                raise HFError(f"{index_path}: bad shard name {shard!r}")
            if not os.path.isfile(os.path.join(model_dir, shard)):
                raise HFError(f"model.from_hf {model_dir}: shard {shard} is missing "
                              f"(listed in {INDEX_FILE})")
        if self.arch in MOE_ARCHITECTURES and any(
                name.endswith(".mlp.experts.gate_up_proj") for name in self.files):
            self.arch += FUSED_EXPERTS

    def _open(self, shard: str):
        return open_safetensors(os.path.join(self.dir, shard))

    def check(self, cfg: ModelConfig):
        """Every tensor cfg needs is present with its shape and a float dtype; nothing else is."""
        expected = {name: shape for name, shape, *_ in all_tensors(cfg, self.arch)}
        for name in self.files:
            if name not in expected and not IGNORED_TENSOR.match(name) and not (
                    cfg.tie_embeddings and name == "lm_head.weight"):
                raise HFError(f"model.from_hf {self.dir}: unexpected tensor {name} in "
                              f"{self.files[name]} (an unsupported option?)")
        for name in expected:
            if name not in self.files:
                raise HFError(f"model.from_hf {self.dir}: tensor {name} is missing")
        by_shard = {}
        for name in expected:
            by_shard.setdefault(self.files[name], []).append(name)
        for shard, names in by_shard.items():
            with self._open(shard) as f:
                present = set(f.keys())
                for name in names:
                    if self.stored.get(name, name) not in present:
                        raise HFError(f"{os.path.join(self.dir, shard)}: tensor {name} is missing "
                                      f"(the index says it is here)")
                    view = f.get_slice(self.stored.get(name, name))
                    shape, dtype = tuple(view.get_shape()), view.get_dtype()
                    if shape != expected[name]:
                        raise HFError(f"{os.path.join(self.dir, shard)}: {name} has shape {shape}, "
                                      f"config.json implies {expected[name]}")
                    if dtype not in FLOAT_DTYPES:
                        raise HFError(f"{os.path.join(self.dir, shard)}: {name} has dtype {dtype} "
                                      f"(supported: {', '.join(FLOAT_DTYPES)})")

    def _finite(self, host: np.ndarray, name: str, shard: str) -> np.ndarray:
        if not all_finite(host):
            raise HFError(f"{os.path.join(self.dir, shard)}: tensor {name} holds NaN or inf; "
                          f"refusing to train from non-finite weights")
        return host

    def read(self, tensors, shapes) -> dict:
        """{key: fp32 host-layout array} for [(HF name, _, key, transpose)] and {key: our shape}.

        Each tensor is read, converted (a Fused one part by part) and dropped before the next, and
        each shard is closed (unmapped) after the tensors asked for, so the transient memory is
        about one tensor."""
        by_shard = {}
        for name, _, key, transpose in tensors:
            by_shard.setdefault(self.files[name], []).append((name, key, transpose))
        out, experts = {}, {}  # experts: (E, ...) numpy buffers filled one expert at a time
        for shard, items in by_shard.items():
            with self._open(shard) as f:
                for name, key, transpose in items:
                    src = f.get_tensor(self.stored.get(name, name))
                    if isinstance(key, ExpertsFused):  # (E, rows, in) -> each part (E, in, rows)
                        for part, lo, hi in key:
                            out[part] = jnp.asarray(self._finite(np.ascontiguousarray(
                                np.swapaxes(src[:, lo:hi], 1, 2), np.float32), name, shard))
                        continue
                    for part, lo, hi in parts(key, src.shape):
                        if isinstance(part, Expert):
                            if part[0] not in experts:
                                experts[part[0]] = np.empty(shapes[part[0]], np.float32)
                            experts[part[0]][part[1]] = to_host_layout(
                                src, shapes[part[0]][1:], transpose)
                            host = experts[part[0]][part[1]]
                        else:
                            host = to_host_layout(src[lo:hi], shapes[part], transpose)
                        if not all_finite(host):
                            at = tuple(int(i) for i in np.argwhere(~np.isfinite(
                                src[lo:hi].astype(np.float32)))[0])
                            at = (at[0] + lo, *at[1:])  # the index in the HF tensor
                            raise HFError(f"{os.path.join(self.dir, shard)}: tensor {name} holds "
                                          f"{float(src[at])} at index {at}; refusing to train "
                                          f"from non-finite weights")
                        # jnp.asarray copies into an XLA buffer on the default device (the host
                        # while the engine builds a block); the numpy buffers die right after, so
                        # the transient is this tensor as stored plus two fp32 copies of it (of
                        # one part of a Fused one). (A zero-copy device_put of the numpy buffer
                        # would save one, but would hand the engine an externally owned buffer to
                        # donate.)
                        if not isinstance(part, Expert):
                            out[part] = jnp.asarray(host)
                        del host
                    del src
        for key in list(experts):  # a layer's experts: one (E, ...) fp32 copy transient
            out[key] = jnp.asarray(experts.pop(key))
        return out


def _load_module(abstract, params: dict):
    """The module `abstract` (from nnx.eval_shape) holding `params` (a pure dict)."""
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def load_stages(cfg: ModelConfig, source: HFSource, execution: Execution = Execution()):
    """(Embed, LMHead) holding the HF weights; no random init runs (nnx.eval_shape)."""
    abstract = nnx.eval_shape(lambda: make_stages(cfg, 0, execution))
    shapes = nnx.to_pure_dict(nnx.split(abstract)[1])
    tensors = stage_tensors(cfg)
    flat = source.read(tensors, {path: shapes[path[0]][path[1]].shape for _, _, path, _ in tensors})
    params = {0: {}, 1: {}}
    for (unit, key), value in flat.items():
        params[unit][key] = value
    return _load_module(abstract, params)


def load_block(cfg: ModelConfig, source: HFSource, layer: int,
               execution: Execution = Execution()) -> Block:
    """Layer `layer`'s Block holding the HF weights: a drop-in for model.make_block."""
    abstract = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), execution=execution))
    shapes = {k: v.shape for k, v in nnx.to_pure_dict(nnx.split(abstract)[1]).items()}
    params = source.read(block_tensors(cfg, layer, source.arch), shapes)
    return _load_module(abstract, {**params, **block_constants(cfg, layer)})


