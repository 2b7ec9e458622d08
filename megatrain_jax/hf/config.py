"""config.json <-> ModelConfig, family by family: which Hugging Face architectures are read and
written, and how each one's config.json fields map onto megatrain_jax.model.ModelConfig.

Llama, Mistral, Qwen2, Qwen3 and Phi-3 differ by flags (q/k/v biases, q/k norms, their sliding
window conventions); Gemma 3 by its four norms, activation, soft-capping and per-layer-type RoPE;
Mixtral and Qwen3-MoE by their experts. Phi-3's resid_pdrop, attention_dropout and embd_pdrop (0 in
the public models) are ignored: training here runs without dropout, as for every architecture.
"""

import json
import math
import os

from megatrain_jax.hf.files import CONFIG_FILE, HFError
from megatrain_jax.model import ModelConfig

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
# Mixture of experts
MOE_MIXTRAL, MOE_QWEN3 = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MOE_MIXTRAL, MOE_QWEN3)

# Gemma 3's differences from Llama, all on or all off (see model.ModelConfig)
GEMMA3_OPTIONS = dict(norm_offset=True, post_norms=True, activation="gelu_tanh",
                      scale_embeddings=True, qk_norm=True)
# ModelConfig keys only Gemma3ForCausalLM can write when they are not at their default
GEMMA3_ONLY = ("norm_offset", "post_norms", "activation", "scale_embeddings",
               "query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping")


# -----------------------------------------------------------------------------
# config.json -> ModelConfig


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


def _check_layer_types(layer_types, num_layers: int, where: str):
    if not (isinstance(layer_types, list) and len(layer_types) == num_layers
            and set(layer_types) <= {"full_attention", "sliding_attention"}):
        raise HFError(f"{where}: layer_types must list 'full_attention' or 'sliding_attention' "
                      f"for each of the {num_layers} layers")


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
        _check_layer_types(layer_types, num_layers, where)
        sliding = [t == "sliding_attention" for t in layer_types]
    if all(sliding):
        return window
    if not any(sliding):
        return 0
    raise HFError(f"{where}: {keys} give {sum(sliding)} of {num_layers} layers a sliding window "
                  f"and the others full attention; only one window for all layers (or none) is "
                  f"supported")


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
    else:
        _check_layer_types(layer_types, num_layers, where)
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


def model_config(hf: dict, model_dir: str) -> ModelConfig:
    """The ModelConfig that `hf` (model_dir's config.json) describes, with `from_hf=model_dir`.
    The weights are not looked at: load.model_config_from_hf checks them against it."""
    where = os.path.join(model_dir, CONFIG_FILE)
    hf = text_config(hf, where)
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
    return cfg


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


# -----------------------------------------------------------------------------
# ModelConfig -> config.json


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

