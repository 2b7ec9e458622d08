"""Hugging Face interop: a local HF model directory in, a HF model directory out.

Import (`model.from_hf: DIR`): `config.json` becomes a ModelConfig, and the safetensors weights are
read one tensor at a time, cast and transposed in one pass into the fp32 host layout of
megatrain_jax.model, one layer at a time (`load_stages`, `load_block`), so the engine never holds a
second copy of the model. Export (`export_checkpoint`, behind scripts/export_hf.py) reads a
checkpoint's parameters a shard at a time and writes safetensors shards, the index and config.json.

Only `config.json`, `model.safetensors.index.json` and `*.safetensors` are ever read from a model
directory: never a pickle (`pytorch_model.bin`). Every problem raises HFError with one line naming
the directory, file, tensor or option.

Layouts (HF stores Linear weights as (out, in)):
    q_proj (N*H, D) <-> wq (D, N, H)    k_proj, v_proj (K*H, D) <-> wk, wv (D, K, H)
    o_proj (D, N*H) <-> wo (N, H, D)    gate_proj, up_proj (F, D) <-> w_gate, w_up (D, F)
    down_proj (D, F) <-> w_down (F, D)  lm_head (V, D) <-> w_out (D, V)    embed_tokens (V, D) as is
    q_norm, k_norm (H,) as is (Qwen3, Gemma 3)
Gemma 3 has four norms a layer: input_layernorm -> attn_norm, post_attention_layernorm (on the
attention's output) -> attn_post_norm, pre_feedforward_layernorm -> mlp_norm,
post_feedforward_layernorm -> mlp_post_norm (Llama's post_attention_layernorm is our mlp_norm).
Phi-3 stores q/k/v and gate/up fused, split on import and fused on export (see Fused):
    qkv_proj ((N + 2K)*H, D) = q_proj, k_proj, v_proj rows    gate_up_proj (2F, D) = gate, up rows
Its resid_pdrop, attention_dropout and embd_pdrop (0 in the public models) are ignored: training
here runs without dropout, as for every architecture.
Mixtral and Qwen3-MoE (see moe_tensors): the router gate.weight (E, D) <-> w_router (D, E); each
expert's gate/up (F, D) and down (D, F) <-> one slice of experts_gate, experts_up (E, D, F) and
experts_down (E, F, D), as save_pretrained writes them (one tensor per expert); a directory holding
transformers 5's in-memory layout (experts.gate_up_proj (E, 2F, D), experts.down_proj (E, D, F))
is read too. Export writes the per-expert layout.
"""

import json
import math
import os
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from megatrain_jax.model import Block, Execution, ModelConfig, make_stages, sliding_flag


class HFError(ValueError):
    """A Hugging Face model directory, or an export request, that cannot be used."""


ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3_text",
                 "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
# Multimodal architectures whose text decoder is read as a text architecture (and exported as
# one): its config.json's text_config (over the text config's defaults, for the keys it leaves
# out), its tensors under `prefix`; the other towers' tensors are never read.
TEXT_PARTS = {"Gemma3ForConditionalGeneration": dict(
    text="Gemma3ForCausalLM", prefix="language_model.",
    others=("vision_tower.", "multi_modal_projector."),
    defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,  # Gemma3TextConfig
                  num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=256))}
# Architectures whose every layer slides by `sliding_window` (null: none).
WINDOWED = ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM")
# Architectures whose windows follow use_sliding_window / layer_types / max_window_layers.
LAYERED_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# What an export copies from the source model's directory beside the weights, when present, so
# that AutoTokenizer and generate() work on the export as on the source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
EXPORT_OLDER = "export an older one with --step {step}"  # the hint for a damaged checkpoint
# Buffers some older checkpoints saved next to the weights; recomputed, so skipped.
IGNORED_TENSOR = re.compile(r".*\.rotary_emb\.inv_freq$")


# -----------------------------------------------------------------------------
# config.json <-> ModelConfig


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HFError(f"{what}: {path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFError(f"{path}: expected a JSON object")
    return data


def read_hf_config(model_dir: str) -> dict:
    if not os.path.isdir(model_dir):
        raise HFError(f"model.from_hf: {model_dir} is not a directory")
    return _read_json(os.path.join(model_dir, CONFIG_FILE), f"model.from_hf {model_dir}")


def text_config(hf: dict, where: str) -> dict:
    """`hf` (a config.json) itself, or for a multimodal model of TEXT_PARTS its text decoder's
    config, under the text architecture; any other multimodal model is refused."""
    if "text_config" not in hf:
        return hf
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in TEXT_PARTS or not isinstance(hf["text_config"], dict):
        raise HFError(f"{where}: a multimodal model ({', '.join(map(str, archs)) or 'text_config'})"
                      f" is not supported; only text decoders (supported: "
                      f"{', '.join(ARCHITECTURES)}) and the text part of {', '.join(TEXT_PARTS)}")
    part = TEXT_PARTS[archs[0]]
    return {**part["defaults"], **hf["text_config"], "architectures": [part["text"]]}


def _rope_options(hf: dict, where: str) -> dict:
    """RoPE theta and scaling from either config.json convention: transformers < 5 writes
    `rope_theta` + `rope_scaling`, transformers >= 5 writes `rope_parameters`."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise HFError(f"{where}: per-layer rope parameters are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # Phi-4-mini's 0.75: RoPE on part of each head
        raise HFError(f"{where}: partial_rotary_factor {partial} is not supported (only 1.0)")
    out = {"rope_theta": theta}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise HFError(f"{where}: rope scaling type {kind!r} is not supported "
                      f"(supported: default, linear, llama3)")
    try:
        out.update(rope_scaling=kind, rope_scaling_factor=float(params["factor"]))
        if kind == "llama3":
            out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                       rope_high_freq_factor=float(params["high_freq_factor"]),
                       rope_original_max_position=int(params.get(
                           "original_max_position_embeddings", hf["max_position_embeddings"])))
    except KeyError as e:
        raise HFError(f"{where}: rope scaling {kind!r} is missing {e.args[0]!r}") from None
    return out


# The config.json fields read, by type; None (JSON null) is allowed where HF writes it for "unset".
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
               "max_window_layers", "max_position_embeddings", "original_max_position_embeddings",
               "sliding_window_pattern", "_sliding_window_pattern", "query_pre_attn_scalar")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                 "partial_rotary_factor", "rope_local_base_freq", "final_logit_softcapping",
                 "attn_logit_softcapping")
_BOOL_FIELDS = ("tie_word_embeddings", "use_sliding_window", "attention_bias", "mlp_bias",
                "use_bidirectional_attention")
# Mixture-of-experts fields (Mixtral, Qwen3-MoE)
_INT_FIELDS += ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "decoder_sparse_step")
_FLOAT_FIELDS += ("router_aux_loss_coef", "router_jitter_noise")
_BOOL_FIELDS += ("norm_topk_prob",)


def _check_types(hf: dict, where: str):
    """Each field read from config.json (and its rope dict) has its JSON type: a string "64" or a
    2.5 where an integer belongs is named, not failed on later."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    for fields, where_key in ((hf, ""), (rope if isinstance(rope, dict) else {}, "rope ")):
        for key, value in fields.items():
            if value is None:
                continue
            if key in _INT_FIELDS:
                ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
            elif key in _FLOAT_FIELDS:
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
                want = "a finite number"
            elif key in _BOOL_FIELDS:
                ok, want = isinstance(value, bool), "true or false"
            else:
                continue
            if not ok:
                raise HFError(f"{where}: {where_key}{key} must be {want}, got {json.dumps(value)}")


def _sliding_window(hf: dict, arch: str, num_layers: int, where: str) -> int:
    """The sliding window of every layer (0: none), as transformers reads config.json.

    Mistral and Phi-3 slide every layer by `sliding_window` (null: none). Qwen2 and Qwen3 slide
    layer i by `sliding_window` iff use_sliding_window and layer_types[i] == "sliding_attention",
    where layer_types, when absent, is derived as i >= max_window_layers. ModelConfig has one
    window for all layers, so a model whose layers differ is refused.
    """
    window = hf.get("sliding_window") or 0
    if arch in WINDOWED:
        return window
    if arch == MOE_QWEN3:  # every layer or none (Qwen3MoeConfig drops the window unless used)
        return window if hf.get("use_sliding_window") else 0
    if arch not in LAYERED_WINDOWS or not hf.get("use_sliding_window") or not window:
        return 0
    layer_types = hf.get("layer_types")
    if layer_types is None:
        keys = "use_sliding_window, max_window_layers"
        first = hf.get("max_window_layers")
        first = 28 if first is None else first  # transformers' default
        sliding = [i >= first for i in range(num_layers)]
    else:
        keys = "layer_types"
        if not (isinstance(layer_types, list) and len(layer_types) == num_layers
                and set(layer_types) <= {"full_attention", "sliding_attention"}):
            raise HFError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' "
                          f"for each of the {num_layers} layers")
        sliding = [t == "sliding_attention" for t in layer_types]
    if all(sliding):
        return window
    if not any(sliding):
        return 0
    raise HFError(f"{where}: {keys} give {sum(sliding)} of {num_layers} layers a sliding window "
                  f"and the others full attention; only one window for all layers (or none) is "
                  f"supported")


# Gemma 3's differences from Llama, all on or all off (see model.ModelConfig)
GEMMA3_OPTIONS = dict(norm_offset=True, post_norms=True, activation="gelu_tanh",
                      scale_embeddings=True, qk_norm=True)
# ModelConfig keys only Gemma3ForCausalLM can write when they are not at their default
GEMMA3_ONLY = ("norm_offset", "post_norms", "activation", "scale_embeddings",
               "query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping")


def _gemma3_options(hf: dict, num_layers: int, where: str) -> dict:
    """ModelConfig fields of a Gemma3ForCausalLM config.json (Gemma3TextConfig, model_type
    gemma3_text), as transformers reads it, from either convention: transformers >= 5 writes
    layer_types and per-layer-type rope_parameters; older ones sliding_window_pattern (every n-th
    layer global), rope_theta, rope_local_base_freq and rope_scaling (of the global layers)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise HFError(f"{where}: attn_logit_softcapping={hf['attn_logit_softcapping']} is not "
                      f"supported (Gemma 3 sets it null; only final_logit_softcapping is)")
    if hf.get("use_bidirectional_attention"):
        raise HFError(f"{where}: use_bidirectional_attention=true is not supported (causal only)")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise HFError(f"{where}: hidden_activation {act!r} is not supported "
                      f"(only gelu_pytorch_tanh)")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern")) or 6
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    elif not (isinstance(layer_types, list) and len(layer_types) == num_layers
              and set(layer_types) <= {"full_attention", "sliding_attention"}):
        raise HFError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' "
                      f"for each of the {num_layers} layers")
    params = hf.get("rope_parameters")
    max_pos = {"max_position_embeddings": hf.get("max_position_embeddings", 131072)}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = params["full_attention"]
        local = params.get("sliding_attention") or {}
        if not isinstance(local, dict):
            raise HFError(f"{where}: rope_parameters.sliding_attention must be an object")
        _check_types({"rope_parameters": full}, where)
        _check_types({"rope_parameters": local}, where)
        full = {**full, "rope_theta": full.get("rope_theta", 1e6)}
        local = {"rope_type": "default", **local, "rope_theta": local.get("rope_theta", 1e4)}
    else:  # the older convention (rope_scaling: the global layers' scaling)
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta") or 1e6}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq") or 1e4}
    rope = _rope_options({"rope_parameters": full, **max_pos}, where)
    if _rope_options({"rope_parameters": local, **max_pos}, where) == rope:
        local_theta = 0.0  # the sliding layers' RoPE is the global one
    elif local.get("rope_type", local.get("type")) == "default":
        local_theta = float(local["rope_theta"])
    else:
        raise HFError(f"{where}: rope scaling of the sliding_attention layers is not supported "
                      f"(only of the full_attention ones)")
    return dict(GEMMA3_OPTIONS, layer_types=tuple(layer_types), rope_local_theta=local_theta,
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar") or 256,
                sliding_window=(hf.get("sliding_window", 4096) or 0)
                if "sliding_attention" in layer_types else 0,
                final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0), **rope)


def model_config_from_hf(model_dir: str) -> ModelConfig:
    """The ModelConfig of a local HF model directory, with `from_hf=model_dir`.

    Checks the weights too (every expected tensor present with the right shape, no unexpected one,
    every shard there), reading only the safetensors headers, so a bad directory fails here,
    before a run writes anything."""
    where = os.path.join(model_dir, CONFIG_FILE)
    hf = text_config(read_hf_config(model_dir), where)
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFError(f"{where}: unsupported architecture {', '.join(map(str, archs)) or '(none)'} "
                      f"(supported: {', '.join(ARCHITECTURES)})")
    arch = archs[0]
    gemma = arch == "Gemma3ForCausalLM"
    if not gemma and hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    for option in ("attention_bias", "mlp_bias"):  # Llama/Qwen3 options: q/k/v/o, MLP biases
        if hf.get(option):
            raise HFError(f"{where}: {option}=true is not supported")
    _check_types(hf, where)
    try:
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        fields = dict(vocab_size=hf["vocab_size"], hidden_size=hidden,
                      intermediate_size=hf["intermediate_size"],
                      num_layers=hf["num_hidden_layers"], num_heads=num_heads)
    except KeyError as e:
        raise HFError(f"{where}: missing {e.args[0]!r}") from None
    # Qwen3Config defaults head_dim to 128 (not hidden/heads) when config.json leaves it out,
    # Gemma3TextConfig to 256
    head_dim = hf.get("head_dim") or {"Qwen3ForCausalLM": 128,
                                      "Gemma3ForCausalLM": 256}.get(arch, 0)
    if gemma:
        options = _gemma3_options(hf, fields["num_layers"], where)
    else:
        options = dict(sliding_window=_sliding_window(hf, arch, fields["num_layers"], where),
                       qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch in ("Qwen3ForCausalLM", MOE_QWEN3),
                       **_rope_options(hf, where))
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_options(hf, arch, fields["num_layers"], where))
    try:
        cfg = ModelConfig(
            **fields, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=0 if head_dim * num_heads == hidden else head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps",  # the configs' defaults
                                      1e-5 if arch in ("Phi3ForCausalLM", MOE_MIXTRAL)
                                      else 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            from_hf=model_dir, **options)
    except (ValueError, TypeError) as e:
        raise HFError(f"{where}: {e}") from None
    HFSource(model_dir).check(cfg)
    return cfg


def _architecture(cfg: ModelConfig, base: dict) -> str:
    """The source model's architecture where it still describes cfg, else the one that does."""
    if cfg.qkv_bias and cfg.qk_norm:  # Qwen3's attention_bias would also bias o_proj
        raise HFError("export: no Hugging Face architecture has q/k/v biases (model.qkv_bias) "
                      "and q/k norms (model.qk_norm) together")
    gemma = {key: getattr(cfg, key) for key in GEMMA3_OPTIONS}
    if gemma == GEMMA3_OPTIONS and not cfg.qkv_bias:
        return "Gemma3ForCausalLM"
    gemma_only = [f"model.{key}={getattr(cfg, key)!r}" for key in GEMMA3_ONLY
                  if getattr(cfg, key) != getattr(ModelConfig, key)]
    if gemma_only:
        needs = [f"model.{key}={value!r}" for key, value in GEMMA3_OPTIONS.items()
                 if getattr(cfg, key) != value] + ["model.qkv_bias=False"] * cfg.qkv_bias
        raise HFError(f"export: {', '.join(gemma_only)} only Gemma3ForCausalLM can write, which "
                      f"also needs {', '.join(needs)}")
    if cfg.layer_types:
        raise HFError("export: model.layer_types (interleaved local and global layers) is written "
                      "for Gemma 3 models only")
    arch = (base.get("architectures") or [None])[0]
    if cfg.num_experts:
        return _moe_architecture(cfg)
    plain = not cfg.qkv_bias and not cfg.qk_norm
    fits = {"Qwen3ForCausalLM": cfg.qk_norm, "Qwen2ForCausalLM": cfg.qkv_bias,
            "MistralForCausalLM": plain, "LlamaForCausalLM": plain and not cfg.sliding_window,
            # transformers' Phi3Config refuses rope scaling other than longrope
            "Phi3ForCausalLM": plain and not cfg.rope_scaling}
    if fits.get(arch):
        return arch
    return ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias else
            "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM")


def hf_config(cfg: ModelConfig, *, dtype: str, max_position_embeddings: int,
              base: dict | None = None) -> dict:
    """config.json for cfg. Keys of `base` (the source model's config.json: token ids, ...) are
    kept, the architecture's are overwritten. RoPE is written both ways (see _rope_options)."""
    base = text_config(base or {}, "export: the source config.json")  # its text part
    out = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_parameters")}
    arch = _architecture(cfg, base)
    rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope["factor"] = cfg.rope_scaling_factor
    if cfg.rope_scaling == "llama3":
        rope.update(low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_max_position)
    out.update(
        architectures=[arch], model_type=ARCHITECTURES[arch], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_size, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=rope if cfg.rope_scaling else None, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype, dtype=dtype,
        max_position_embeddings=out.get("max_position_embeddings", max_position_embeddings))
    if arch == "Gemma3ForCausalLM":
        out.update(_gemma3_config(cfg, rope))
        out.pop("hidden_act")  # Gemma's is hidden_activation
    elif arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    elif arch in WINDOWED:
        out["sliding_window"] = cfg.sliding_window or None
    else:  # Qwen2/3: transformers slides layer i iff use_sliding_window and i >= max_window_layers
        if arch == "Qwen3ForCausalLM":
            out["attention_bias"] = False
        out.update(use_sliding_window=bool(cfg.sliding_window),
                   sliding_window=cfg.sliding_window or None)
        if cfg.sliding_window:
            out["max_window_layers"] = 0
        out.pop("layer_types", None)  # transformers derives it from the two above
    if arch in MOE_ARCHITECTURES:
        out.update(_moe_config(cfg, arch, base))
    return out


# -----------------------------------------------------------------------------
# mixture of experts (Mixtral, Qwen3-MoE): config.json fields and the experts' tensors

MOE_MIXTRAL, MOE_QWEN3 = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MOE_MIXTRAL, MOE_QWEN3)


def _moe_options(hf: dict, arch: str, num_layers: int, where: str) -> dict:
    """ModelConfig fields of a MoE config.json; an option with no equivalent here is refused."""
    if arch == MOE_MIXTRAL:
        num_experts, renormalize = hf.get("num_local_experts", 8), True
        size = hf.get("intermediate_size")
        if hf.get("router_jitter_noise"):  # multiplicative noise on the router's input in training
            raise HFError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not "
                          f"supported (only 0)")
    else:  # Qwen3MoeConfig maps num_experts to num_local_experts; config.json may hold either
        num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
        renormalize = bool(hf.get("norm_topk_prob", False))
        size = hf.get("moe_intermediate_size", 768)
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % max(step, 1) == 0]
        if len(sparse) != num_layers:
            raise HFError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={dense} give "
                          f"{num_layers - len(sparse)} of {num_layers} layers a dense MLP; only "
                          f"all-sparse models are supported (decoder_sparse_step 1, no "
                          f"mlp_only_layers)")
    if size is None:
        raise HFError(f"{where}: missing 'intermediate_size'")
    return dict(num_experts=num_experts, experts_per_token=hf.get("num_experts_per_tok", 2),
                moe_renormalize=renormalize, intermediate_size=size,
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))


def _moe_architecture(cfg: ModelConfig) -> str:
    """Qwen3-MoE where the layers have q/k norms, else Mixtral (whose router always
    renormalises the top-k weights)."""
    if cfg.qkv_bias:
        raise HFError("export: no Hugging Face MoE architecture has q/k/v biases (model.qkv_bias)")
    if cfg.qk_norm:
        return MOE_QWEN3
    if not cfg.moe_renormalize:
        raise HFError("export: a MoE model without q/k norms exports as Mixtral, whose router "
                      "always renormalises (model.moe_renormalize=false has no HF architecture)")
    return MOE_MIXTRAL


def _moe_config(cfg: ModelConfig, arch: str, base: dict) -> dict:
    common = dict(num_experts_per_tok=cfg.experts_per_token, output_router_logits=False,
                  router_aux_loss_coef=cfg.router_aux_loss_coef)
    if arch == MOE_MIXTRAL:
        return dict(common, num_local_experts=cfg.num_experts, router_jitter_noise=0.0)
    # the Hub's configs write num_experts, transformers 5 num_local_experts (its attribute_map):
    # both, equal, so a source config's one cannot contradict the other
    out = dict(common, num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
               moe_intermediate_size=cfg.intermediate_size,
               norm_topk_prob=cfg.moe_renormalize, decoder_sparse_step=1, mlp_only_layers=[],
               attention_bias=False, sliding_window=cfg.sliding_window or None,
               use_sliding_window=bool(cfg.sliding_window),
               # the dense MLP's size (unused: every layer is sparse); the source's if any
               intermediate_size=base.get("intermediate_size", cfg.intermediate_size))
    return out


class Expert(tuple):
    """The key of a HF tensor that is one expert's matrix of one of our (E, ...) parameters:
    (key, expert). HF checkpoints store each expert's Linear weights separately."""


class ExpertsFused(tuple):
    """The key of a 3-D HF tensor holding every expert, (E, rows, in), as transformers 5 holds
    them in memory (experts.gate_up_proj, experts.down_proj): ((key, first row, end row), ...),
    each part our (E, in, rows) parameter."""


# HFSource.arch's suffix for a directory whose experts are stored as transformers 5 holds them
# (a state_dict saved directly); save_pretrained writes one tensor per expert, as export does.
FUSED_EXPERTS = "/fused-experts"


def moe_tensors(cfg: ModelConfig, prefix: str, arch: str) -> list:
    """A MoE layer's MLP tensors as block_tensors lists them, for `arch`'s names (Mixtral:
    block_sparse_moe.gate, experts.{e}.w1 (gate), w3 (up), w2 (down); Qwen3-MoE: mlp.gate,
    experts.{e}.gate_proj, up_proj, down_proj); any other arch is written as Qwen3-MoE's."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    if arch and arch.endswith(FUSED_EXPERTS):
        p = prefix + "mlp."
        return [(p + "gate.weight", (e, d), "w_router", True),
                (p + "experts.gate_up_proj", (e, 2 * f, d),
                 ExpertsFused((("experts_gate", 0, f), ("experts_up", f, 2 * f))), True),
                (p + "experts.down_proj", (e, d, f), ExpertsFused((("experts_down", 0, d),)),
                 True)]
    if arch == MOE_MIXTRAL:
        p, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        p, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    out = [(p + "gate.weight", (e, d), "w_router", True)]
    for i in range(e):
        out += [(f"{p}experts.{i}.{names[0]}.weight", (f, d), Expert(("experts_gate", i)), True),
                (f"{p}experts.{i}.{names[1]}.weight", (f, d), Expert(("experts_up", i)), True),
                (f"{p}experts.{i}.{names[2]}.weight", (d, f), Expert(("experts_down", i)), True)]
    return out


def _gemma3_config(cfg: ModelConfig, rope: dict) -> dict:
    """The Gemma3TextConfig keys of cfg, in both conventions (see _gemma3_options)."""
    kinds = list(cfg.layer_types) or [
        "sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_layers
    local = ({"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta
             else rope)
    out = dict(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
               query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_size,
               sliding_window=cfg.sliding_window or None, layer_types=kinds,
               rope_parameters={"full_attention": rope, "sliding_attention": local},
               rope_local_base_freq=local["rope_theta"], attn_logit_softcapping=None,
               final_logit_softcapping=cfg.final_logit_softcapping or None,
               use_bidirectional_attention=False)
    if not cfg.rope_local_theta and cfg.rope_scaling:  # the old convention cannot say it
        out["rope_local_base_freq"] = None
    return out


# -----------------------------------------------------------------------------
# the tensor map: one table, read both ways


class Fused(tuple):
    """The key of a HF tensor that holds several of our parameters, stacked along its rows:
    ((key, first row, end row), ...). Phi-3's qkv_proj and gate_up_proj."""


def parts(key, hf_shape) -> list:
    """[(key, first row, end row)] of a tensor map entry: one part, all the rows, unless Fused."""
    return list(key) if isinstance(key, Fused) else [(key, 0, hf_shape[0])]


def stage_tensors(cfg: ModelConfig) -> list:
    """[(HF name, HF shape, path in the stages' pure dict, transpose)] in HF file order."""
    v, d = cfg.vocab_size, cfg.hidden_size
    out = [("model.embed_tokens.weight", (v, d), (0, "embedding"), False),
           ("model.norm.weight", (d,), (1, "norm"), False)]
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", (v, d), (1, "w_out"), True))
    return out


def block_tensors(cfg: ModelConfig, layer: int, arch: str | None = None) -> list:
    """[(HF name, HF shape, key in the block's pure dict or a Fused, transpose)] for layer
    `layer`, as architecture `arch` stores it."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_size
    n, k = cfg.num_heads, cfg.num_kv_heads
    p = f"model.layers.{layer}."
    fused = arch == "Phi3ForCausalLM"
    out = [(p + "input_layernorm.weight", (d,), "attn_norm", False)]
    if fused:
        out.append((p + "self_attn.qkv_proj.weight", ((n + 2 * k) * h, d), Fused((
            ("wq", 0, n * h), ("wk", n * h, (n + k) * h), ("wv", (n + k) * h, (n + 2 * k) * h))),
            True))
    else:
        out += [(p + "self_attn.q_proj.weight", (n * h, d), "wq", True),
                (p + "self_attn.k_proj.weight", (k * h, d), "wk", True),
                (p + "self_attn.v_proj.weight", (k * h, d), "wv", True)]
    out.append((p + "self_attn.o_proj.weight", (d, n * h), "wo", True))
    if cfg.qkv_bias:
        out += [(p + "self_attn.q_proj.bias", (n * h,), "q_bias", False),
                (p + "self_attn.k_proj.bias", (k * h,), "k_bias", False),
                (p + "self_attn.v_proj.bias", (k * h,), "v_bias", False)]
    if cfg.qk_norm:
        out += [(p + "self_attn.q_norm.weight", (h,), "q_norm", False),
                (p + "self_attn.k_norm.weight", (h,), "k_norm", False)]
    if cfg.post_norms:  # Gemma: post_attention_layernorm norms the attention's output
        out += [(p + "post_attention_layernorm.weight", (d,), "attn_post_norm", False),
                (p + "pre_feedforward_layernorm.weight", (d,), "mlp_norm", False),
                (p + "post_feedforward_layernorm.weight", (d,), "mlp_post_norm", False)]
    else:
        out.append((p + "post_attention_layernorm.weight", (d,), "mlp_norm", False))
    if cfg.num_experts:
        return out + moe_tensors(cfg, p, arch)
    if fused:
        out.append((p + "mlp.gate_up_proj.weight", (2 * f, d),
                    Fused((("w_gate", 0, f), ("w_up", f, 2 * f))), True))
    else:
        out += [(p + "mlp.gate_proj.weight", (f, d), "w_gate", True),
                (p + "mlp.up_proj.weight", (f, d), "w_up", True)]
    out.append((p + "mlp.down_proj.weight", (d, f), "w_down", True))
    return out


def all_tensors(cfg: ModelConfig, arch: str | None = None) -> list:
    """Every HF tensor of the model as `arch` stores it, in HF order, as (name, shape, unit, key,
    transpose); unit 0 is the stages, unit 1 + i layer i (the engine's numbering)."""
    stages = stage_tensors(cfg)
    out = [(name, shape, 0, key, t) for name, shape, key, t in stages[:1]]
    for i in range(cfg.num_layers):
        out += [(name, shape, 1 + i, key, t)
                for name, shape, key, t in block_tensors(cfg, i, arch)]
    return out + [(name, shape, 0, key, t) for name, shape, key, t in stages[1:]]


def to_host_layout(src: np.ndarray, shape, transpose: bool):
    """HF tensor -> fp32 array of `shape`, cast and transposed in one pass into one new buffer."""
    out = np.empty(shape, np.float32)
    view = out.reshape(src.shape[::-1] if transpose else src.shape)  # a view of `out`
    np.copyto(view, src.T if transpose else src, casting="unsafe")
    return out


def to_hf_layout(x, hf_shape, transpose: bool, dtype) -> np.ndarray:
    """Our array -> contiguous HF tensor of `hf_shape` in `dtype` (one cast-and-copy pass)."""
    x = np.asarray(x)
    x = x.reshape(hf_shape[::-1]).T if transpose else x.reshape(hf_shape)
    return np.ascontiguousarray(x, dtype=dtype)


# -----------------------------------------------------------------------------
# reading weights


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
            weight_map = _read_json(index_path, "index").get("weight_map")
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
        from safetensors import safe_open
        path = os.path.join(self.dir, shard)
        try:
            return safe_open(path, framework="numpy")
        except Exception as e:  # the Rust side raises its own error types
            raise HFError(f"{path}: not a readable safetensors file ({e})") from None

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
        if not (np.isfinite(host.min()) and np.isfinite(host.max())):
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
                        # min and max: NaN propagates, inf shows; no temporary array
                        if not (np.isfinite(host.min()) and np.isfinite(host.max())):
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
    if cfg.layer_types:  # the layer's kind: data, not an HF tensor
        params["sliding"] = sliding_flag(cfg, layer)
    return _load_module(abstract, params)


# -----------------------------------------------------------------------------
# export


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


def _plan_shards(tensors, itemsize: int, shard_size: int) -> list:
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


def _write_shards(manager, step, tree, tmp, shards, names, np_dtype, where) -> int:
    """Writes each shard's tensors, restored from checkpoint `step` a shard at a time, as
    safetensors files in tmp; returns the bytes written. A tensor that is not finite, or would not
    be in np_dtype, is refused."""
    import orbax.checkpoint as ocp
    from safetensors.numpy import save_file

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
        try:
            save_file(out, os.path.join(tmp, file_name), metadata={"format": "pt"})
        except Exception as e:  # safetensors raises its own type for a full disk
            raise HFError(f"writing {file_name} of the export failed ({e})") from None
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
        shards = _plan_shards(tensors, np.dtype(np_dtype).itemsize, shard_bytes)
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
            total = _write_shards(manager, step, tree, tmp, shards, names, np_dtype, where)
            if len(shards) > 1:
                weight_map = {t[0]: name for shard, name in zip(shards, names) for t in shard}
                with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                              indent=2)
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(config, f, indent=2)
            copied = _copy_tokenizer_files(meta.get("config", {}), tmp)
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


def _copy_tokenizer_files(run_config: dict, out_dir: str) -> str:
    """Copies TOKENIZER_FILES from the run's model.from_hf directory into out_dir (and, when that
    holds no tokenizer.json, the run's data.tokenizer file if it is one); returns a line saying
    what was copied from where."""
    source = run_config.get("model", {}).get("from_hf") or ""
    copied = []
    if source and os.path.isdir(source):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
                copied.append(name)
    tokenizer = run_config.get("data", {}).get("tokenizer") or ""
    extra = ("tokenizer.json" not in copied and tokenizer.endswith(".json")
             and os.path.isfile(tokenizer))
    if extra:
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
    found = [f"{', '.join(copied)} from {source}"] if copied else []
    found += [f"tokenizer.json from data.tokenizer={tokenizer}"] if extra else []
    if found:
        return f"copied {'; '.join(found)}"
    if source and not os.path.isdir(source):
        return (f"no tokenizer files copied: model.from_hf={source} of the run is not there "
                f"(copy them from the source model by hand)")
    return "no tokenizer files copied: the run names no HF model directory or tokenizer.json"
