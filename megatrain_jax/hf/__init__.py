"""Hugging Face interop: a local HF model directory in, a HF model directory out.

Import (`model.from_hf: DIR`, hf.load): `config.json` becomes a ModelConfig (hf.config), and the
safetensors weights are read one tensor at a time into the fp32 host layout of megatrain_jax.model,
one layer at a time (`load_stages`, `load_block`). Export (`export_checkpoint`, hf.export, behind
scripts/export_hf.py) reads a checkpoint's parameters a shard at a time and writes safetensors
shards, the index, config.json and the source model's tokenizer files (hf.files).

    files.py    HFError, the directory's file names, JSON and safetensors reading and writing,
                the tokenizer files an export copies
    config.py   config.json <-> ModelConfig, family by family (Llama ... Gemma 3, Mixtral,
                Qwen3-MoE)
    tensors.py  the tensor map (HF name, shape <-> our parameter, transposed, fused), both ways
    load.py     import: model_config_from_hf, HFSource, load_stages, load_block
    export.py   export_checkpoint

Only `config.json`, `model.safetensors.index.json` and `*.safetensors` are ever read from a model
directory: never a pickle (`pytorch_model.bin`). Every problem raises HFError with one line naming
the directory, file, tensor or option. `from megatrain_jax import hf` and every name below is the
public API; the submodules are how it is organised.
"""

from megatrain_jax.hf.config import (ARCHITECTURES, GEMMA3_ONLY, GEMMA3_OPTIONS, LAYERED_WINDOWS,
                                     MOE_ARCHITECTURES, MOE_MIXTRAL, MOE_QWEN3, TEXT_PARTS,
                                     WINDOWED, hf_config, model_config, text_config)
from megatrain_jax.hf.export import (EXPORT_DTYPES, EXPORT_OLDER, export_checkpoint, parse_size,
                                     plan_shards)
from megatrain_jax.hf.files import (CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE,
                                    TOKENIZER_FILES, HFError, read_hf_config)
from megatrain_jax.hf.load import (IGNORED_TENSOR, HFSource, load_block, load_stages,
                                   model_config_from_hf)
from megatrain_jax.hf.tensors import (FUSED_EXPERTS, Expert, ExpertsFused, Fused, all_tensors,
                                      block_tensors, moe_tensors, parts, stage_tensors,
                                      to_hf_layout, to_host_layout)
# model names hf has always exported (tests use hf.ModelConfig, hf.sliding_flag)
from megatrain_jax.model import Block, Execution, ModelConfig, make_stages, sliding_flag

__all__ = [
    "ARCHITECTURES", "GEMMA3_ONLY", "GEMMA3_OPTIONS", "LAYERED_WINDOWS", "MOE_ARCHITECTURES",
    "MOE_MIXTRAL", "MOE_QWEN3", "TEXT_PARTS", "WINDOWED", "hf_config", "model_config",
    "text_config",
    "EXPORT_DTYPES", "EXPORT_OLDER", "export_checkpoint", "parse_size", "plan_shards",
    "CONFIG_FILE", "FLOAT_DTYPES", "INDEX_FILE", "SINGLE_FILE", "TOKENIZER_FILES", "HFError",
    "read_hf_config",
    "IGNORED_TENSOR", "HFSource", "load_block", "load_stages", "model_config_from_hf",
    "FUSED_EXPERTS", "Expert", "ExpertsFused", "Fused", "all_tensors", "block_tensors",
    "moe_tensors", "parts", "stage_tensors", "to_hf_layout", "to_host_layout",
    "Block", "Execution", "ModelConfig", "make_stages", "sliding_flag",
]
