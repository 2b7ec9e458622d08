"""The tensor map: one table of HF tensor names, shapes and our parameters, read both ways
(import reads it to fill our parameters, export to write HF tensors).

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
Mixtral and Qwen3-MoE (see moe_tensors): the router gate.weight (E, D) <-> w_router (D, E); each
expert's gate/up (F, D) and down (D, F) <-> one slice of experts_gate, experts_up (E, D, F) and
experts_down (E, F, D), as save_pretrained writes them (one tensor per expert); a directory holding
transformers 5's in-memory layout (experts.gate_up_proj (E, 2F, D), experts.down_proj (E, D, F))
is read too. Export writes the per-expert layout.
"""

import numpy as np

from megatrain_jax.hf.config import MOE_MIXTRAL
from megatrain_jax.model import ModelConfig


class Fused(tuple):
    """The key of a HF tensor that holds several of our parameters, stacked along its rows:
    ((key, first row, end row), ...). Phi-3's qkv_proj and gate_up_proj."""


def parts(key, hf_shape) -> list:
    """[(key, first row, end row)] of a tensor map entry: one part, all the rows, unless Fused."""
    return list(key) if isinstance(key, Fused) else [(key, 0, hf_shape[0])]


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
