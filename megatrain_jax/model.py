"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) as Flax NNX modules.

The model knows nothing about streaming: it is three plain modules, `Embed`, `Block` and `LMHead`,
that the engine (or a plain reference loop) calls in order. `Execution` says how they compute
(attention implementation, MLP tiles, loss chunks), so that long sequences fit in bounded memory.
For generation, `Block.prefill` and `Block.decode` run the same attention and MLP code with a KV
cache (megatrain_jax/generate.py).
Shapes use the letters B batch, T sequence, D hidden, N query heads, K kv heads, H head dim,
F MLP hidden, V vocab.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from megatrain_jax import moe
from megatrain_jax.attention import (TILED, MergedTileAttention, TileAttention, attention,
                                     cached_attention)
from megatrain_jax.engine import Constant
from megatrain_jax.loss import cap_logits, chunked_cross_entropy, chunked_token_logprobs
from megatrain_jax.seqtile import TileFns, tiled_block


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 257
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2
    # Qwen3: RMSNorm over the head dimension of each query and key head (one (H,) scale each,
    # shared by the heads), after the projections and before RoPE.
    qk_norm: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    # RoPE frequency scaling as in HF: "" (none), "linear" (all frequencies / factor) or "llama3"
    # (long wavelengths / factor, short ones kept, a smooth ramp between; Llama 3.1+).
    rope_scaling: str = ""
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    # Mistral/Qwen2 sliding-window attention, one window for all layers (with layer_types: for the
    # sliding ones): 0 = none, else query i sees key j iff 0 <= i - j < sliding_window (HF's).
    sliding_window: int = 0
    # Mixture of experts (Mixtral, Qwen3-MoE; megatrain_jax.moe), when num_experts > 0: every
    # layer's MLP is num_experts SwiGLU experts of intermediate_size, each token routed to
    # experts_per_token of them; moe_renormalize rescales the top-k router weights to sum to 1
    # (Mixtral always, Qwen3-MoE's norm_topk_prob); router_aux_loss_coef weighs the
    # load-balancing loss added to the training loss.
    num_experts: int = 0
    experts_per_token: int = 2
    moe_renormalize: bool = True
    router_aux_loss_coef: float = 0.001
    # Gemma 3's differences (all off for the other families):
    norm_offset: bool = False  # RMSNorm scales by (1 + w), in fp32 before the cast; w starts at 0
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs, before the add
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype
    query_pre_attn_scalar: int = 0  # attention scores scaled by its **-0.5 (0: head_size)
    # Interleaved local and global layers: per layer "sliding_attention" or "full_attention" (HF's
    # names). sliding_window then applies to the sliding layers only, whose RoPE has base
    # rope_local_theta, unscaled (0: the full layers' RoPE). (): every layer alike. A layer's kind
    # is data (Block.sliding, a Constant: no parameter), not structure, so every layer runs one
    # compiled function.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0
    final_logit_softcapping: float = 0.0  # logits = c * tanh(logits / c) (0: off)
    from_hf: str = ""  # a local Hugging Face model directory to initialise from (megatrain_jax.hf)

    def __post_init__(self):
        # Errors name the config key; config.py turns them into one-line CLI errors.
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.head_dim == 0 and self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must divide model.hidden_size "
                             f"({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads ({self.num_kv_heads}) must divide "
                             f"model.num_heads ({self.num_heads})")
        if self.rope_scaling not in ROPE_SCALING_TYPES:
            raise ValueError(f"model.rope_scaling: unsupported type {self.rope_scaling!r} "
                             f"(supported: {', '.join(repr(t) for t in ROPE_SCALING_TYPES)})")
        if self.rope_scaling and self.rope_scaling_factor <= 0:
            raise ValueError(f"model.rope_scaling_factor must be > 0, got {self.rope_scaling_factor}")
        if self.rope_scaling == "llama3" and not (
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ValueError(f"model.rope_low_freq_factor ({self.rope_low_freq_factor}) must be > 0 "
                             f"and < model.rope_high_freq_factor ({self.rope_high_freq_factor})")
        if self.sliding_window < 0:
            raise ValueError(f"model.sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_experts < 0:
            raise ValueError(f"model.num_experts must be >= 0 (0: a dense MLP), got "
                             f"{self.num_experts}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"model.experts_per_token ({self.experts_per_token}) must be in 1.."
                             f"model.num_experts ({self.num_experts})")
        if self.num_experts and (self.post_norms or self.norm_offset
                                 or self.activation != "silu"):
            raise ValueError("model.num_experts: experts with Gemma's post_norms, norm_offset or "
                             "activation are not supported (Mixtral and Qwen3-MoE have none)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation: unsupported {self.activation!r} "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        for key in ("query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key} must be >= 0 (0: off), got {getattr(self, key)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(
                    LAYER_TYPES):
                raise ValueError(f"model.layer_types must give each of the {self.num_layers} "
                                 f"layers one of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("model.layer_types has sliding_attention layers but "
                                 "model.sliding_window is 0")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def num_params(self, *, include_embeddings: bool = True) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_size
        n, k = self.num_heads, self.num_kv_heads
        attn = (d * n * h * 2 + d * k * h * 2 + (n + 2 * k) * h * self.qkv_bias
                + 2 * h * self.qk_norm)
        block = (attn + 3 * d * f * max(1, self.num_experts) + d * self.num_experts
                 + 2 * d * (1 + self.post_norms))
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * block + d + (embed if include_embeddings else 0)

    def num_active_params(self, *, include_embeddings: bool = True) -> int:
        """Parameters a token computes with: a MoE layer's routed experts only (FLOPs, MFU)."""
        idle = self.num_experts - self.experts_per_token if self.num_experts else 0
        return (self.num_params(include_embeddings=include_embeddings)
                - self.num_layers * idle * 3 * self.hidden_size * self.intermediate_size)


ROPE_SCALING_TYPES = ("", "linear", "llama3")
ACTIVATIONS = {"silu": jax.nn.silu,
               # torch's gelu(approximate="tanh"), HF's gelu_pytorch_tanh: the same formula
               "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
LAYER_TYPES = ("sliding_attention", "full_attention")
ATTENTION_IMPLEMENTATIONS = ("cudnn", "blockwise", "xla")  # resolved: no "auto"


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the modules compute, not what: every setting gives the same math (up to rounding).

    Frozen and hashable, so a module keeps it as a static attribute (part of its nnx graphdef) and
    a jitted block is compiled per Execution. Errors name the train.* config key it comes from.
    """

    attention: str = "xla"  # a resolved implementation of attention.attention
    attention_block: int = 512  # blockwise attention's block size
    # tokens per tile of the block over the sequence (0: no tiling): the whole block with
    # blockwise or cuDNN attention (megatrain_jax/seqtile.py), the MLP alone with "xla"
    tile_size: int = 0
    loss_chunk: int = 4096  # tokens per chunk of the chunked cross-entropy
    loss_vocab_chunk: int = 0  # vocabulary chunk of the loss (0: whole vocabulary)
    expert_tile: int = 128  # routed rows per grouped matmul tile of a MoE layer (moe.py)
    # What attends where the block is tiled (attention.TILED, the rule's choice:
    # attention.choose_attention): "blockwise" per query tile; "merged": per query tile two calls
    # of `attention` (cuDNN, or XLA's standing in) merged by their log-sum-exps; "untiled":
    # `attention` over the whole sequence, the MLP in tiles. "": blockwise, untiled with "xla".
    tile_attention: str = ""

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"train.attention must be one of "
                             f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (resolve 'auto' with "
                             f"attention.choose_attention), got {self.attention!r}")
        if self.expert_tile <= 0:
            raise ValueError(f"Execution.expert_tile must be positive, got {self.expert_tile}")
        for key in ("attention_block", "loss_chunk"):
            if getattr(self, key) <= 0:
                raise ValueError(f"train.{key} must be positive, got {getattr(self, key)}")
        for key in ("tile_size", "loss_vocab_chunk"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0 (0: off), got {getattr(self, key)}")
        allowed = {"xla": ("untiled", "merged"), "blockwise": ("blockwise", "untiled"),
                   "cudnn": TILED}[self.attention]
        if self.tile_attention and self.tile_attention not in allowed:
            raise ValueError(f"Execution.tile_attention {self.tile_attention!r} with attention "
                             f"{self.attention!r}: one of {', '.join(allowed)}")

    @property
    def tiled(self) -> str:
        """What attends where the block is tiled (TILED)."""
        return self.tile_attention or ("untiled" if self.attention == "xla" else "blockwise")

    def tiles(self, seq_len: int) -> bool:
        """Whether the whole block runs over tiles at seq_len tokens (seqtile.py)."""
        return 0 < self.tile_size < seq_len and self.tiled != "untiled"

    def tile_block(self) -> int:
        """Blockwise attention's block where the block is tiled: a divisor of the tile, so that
        every tile starts at a key block (the config refuses a tile that is not a multiple)."""
        return math.gcd(self.tile_size, min(self.attention_block, self.tile_size))

    def attention_at(self, seq_len: int) -> str:
        """The attention that runs, forward and backward, for sequences of seq_len tokens."""
        names = {"cudnn": "cuDNN flash attention",
                 "blockwise": f"blockwise flash attention (blocks of {self.attention_block})",
                 "xla": "XLA's dense attention (T x T scores)"}
        if not self.tile_size or seq_len <= self.tile_size:
            return f"{names[self.attention]} over the whole sequence, the block untiled"
        tile = f"{self.tile_size:,}"
        if self.tiled == "untiled":
            return f"{names[self.attention]} over the whole sequence, the MLP in tiles of {tile}"
        if self.tiled == "merged":
            calls = "cuDNN" if self.attention == "cudnn" else "XLA's dot_product_attention"
            return (f"{calls} per query tile of {tile} (the keys before it and its own, merged by "
                    f"their log-sum-exps), the block in tiles of {tile}")
        return (f"blockwise flash attention (blocks of {self.tile_block()}) per query tile of "
                f"{tile}, the block in tiles of {tile}")


def _default_inv_freq(theta: float, h: int):
    return 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))


def rope_inv_freq(cfg: ModelConfig, *, local: bool = False):
    """(H/2,) fp32 inverse frequencies, computed as HF computes them (fp32 throughout); `local`:
    those of the sliding layers of a model with rope_local_theta."""
    h = cfg.head_size
    if local and cfg.rope_local_theta:
        return _default_inv_freq(cfg.rope_local_theta, h)
    inv_freq = _default_inv_freq(cfg.rope_theta, h)
    factor = cfg.rope_scaling_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "llama3":
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * jnp.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def rms_norm(x, scale, eps, offset: bool = False):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:  # As in HF Gemma: scale by (1 + w) in fp32, then cast back.
        return (x32 * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    # As in HF Llama: normalise in fp32, cast back, then scale in the input dtype.
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def _norm_init(cfg: ModelConfig, size: int):
    """A norm's initial weight: the identity (1, or 0 where the norm scales by 1 + w)."""
    return (jnp.zeros if cfg.norm_offset else jnp.ones)((size,), jnp.float32)


def sliding_flag(cfg: ModelConfig, layer: int):
    """Block.sliding of layer `layer` (with model.layer_types): 1.0 local, 0.0 global."""
    return jnp.asarray(float(cfg.layer_types[layer] == "sliding_attention"), jnp.float32)


def block_constants(cfg: ModelConfig, layer: int) -> dict:
    """Layer `layer`'s Constants as a pure dict, as the config gives them (no checkpoint or HF
    file holds them): {"sliding": ...} with model.layer_types, else none."""
    return {"sliding": sliding_flag(cfg, layer)} if cfg.layer_types else {}


def apply_rope(x, inv_freq, positions):
    """Rotary embedding on (B, T, N, H) with HF's half-split layout, at integer `positions`:
    (B, T) (per-document positions of packed sequences) or (T,) (shared by the batch)."""
    h = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B or none, T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # (B or none, T, 1, H)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def swiglu_mlp(x, weights, eps: float, activation: str = "silu", norm_offset: bool = False):
    """The block's MLP with its residual, x + down(act(gate(y)) * up(y)) with y = rms_norm(x), on
    (B, T, D): SwiGLU, or GeGLU with activation gelu_tanh. With a fifth weight (Gemma's post-norm)
    the MLP's output is normed before the residual add. Per-token math: any slice of tokens gives
    that slice of the result."""
    return x + swiglu_update(x, weights, eps, activation, norm_offset)


def swiglu_update(x, weights, eps: float, activation: str = "silu", norm_offset: bool = False):
    """swiglu_mlp without its residual: what the MLP adds to x."""
    norm, w_gate, w_up, w_down, *post_norm = weights
    y = rms_norm(x, norm, eps, norm_offset)
    gate = jnp.einsum("btd,df->btf", y, w_gate)
    up = jnp.einsum("btd,df->btf", y, w_up)
    out = jnp.einsum("btf,fd->btd", ACTIVATIONS[activation](gate) * up, w_down)
    if post_norm:
        out = rms_norm(out, post_norm[0], eps, norm_offset)
    return out


def layer_rope(cfg: ModelConfig, w):
    """(sliding, inv_freq) of a block with weights w: its kind (a traced bool, 1 for a local
    layer; None without model.layer_types) and its RoPE frequencies."""
    sliding, inv_freq = None, rope_inv_freq(cfg)
    if cfg.layer_types:  # local or global by this layer's data
        sliding = w["sliding"] > 0.5
        inv_freq = jnp.where(sliding, rope_inv_freq(cfg, local=True), inv_freq)
    return sliding, inv_freq


def _norm(cfg: ModelConfig):
    return functools.partial(rms_norm, eps=cfg.rms_norm_eps, offset=cfg.norm_offset)


def attention_projections(cfg: ModelConfig, w, x, positions, which: str = "qkv") -> tuple:
    """The attention's q (B, T, N, H), k, v (B, T, K, H) of x (B, T, D), those `which` names,
    from the block's weights w (a dict by attribute name): the input norm, the projections and
    their biases, then for q and k the per-head norm (Qwen3, Gemma 3) and RoPE at `positions`.
    Per-token math: any slice of tokens gives that slice of the result."""
    norm = _norm(cfg)
    y = norm(x, w["attn_norm"])
    inv_freq = layer_rope(cfg, w)[1]

    def project(name):
        out = jnp.einsum("btd,dnh->btnh", y, w["w" + name])
        if cfg.qkv_bias:
            out = out + w[name + "_bias"]
        if name == "v":
            return out
        if cfg.qk_norm:  # over H of each head, before RoPE
            out = norm(out, w[name + "_norm"])
        return apply_rope(out, inv_freq, positions)

    return tuple(project(name) for name in which)


def attention_output(cfg: ModelConfig, w, x, attn):
    """x + the attention sublayer's output: attn (B, T, N, H) projected (Gemma: then normed)."""
    return x + attention_update(cfg, w, attn)


def attention_update(cfg: ModelConfig, w, attn):
    """attention_output without its residual: what the attention sublayer adds to x."""
    out = jnp.einsum("btnh,nhd->btd", attn, w["wo"])
    if cfg.post_norms:
        out = _norm(cfg)(out, w["attn_post_norm"])
    return out


def over_tiles(fn, x, weights, tile: int):
    """fn(x, weights) for a per-token fn on (B, T, D), computed `tile` tokens at a time.

    Each tile is rematerialised (jax.checkpoint) inside a sequential lax.map, so a backward holds
    one tile's intermediates (B x tile x F for the MLP) instead of all T tokens'. T is zero-padded
    to a multiple of `tile` (rms_norm maps a zero row to zero, in either style) and the padding
    dropped again.
    """
    B, T, D = x.shape
    n = -(-T // tile)
    tiles = jnp.pad(x, ((0, 0), (0, n * tile - T), (0, 0))).reshape(B, n, tile, D).swapaxes(0, 1)
    step = jax.checkpoint(fn)
    out = lax.map(lambda t: step(t, weights), tiles)  # (n, B, tile, D)
    return out.swapaxes(0, 1).reshape(B, n * tile, D)[:, :T]


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + swiglu(norm(x)); with post_norms
    (Gemma) x + norm(attn(norm(x))), then + norm(geglu(norm(x))).

    `execution` picks the attention implementation and the tiling over the sequence (a static
    attribute): with execution.tile_size below the sequence's length the whole block is computed
    a tile of tokens at a time (megatrain_jax/seqtile.py), except where execution.tiled is
    "untiled" (always with the dense "xla" reference attention): the attention then runs over the
    whole sequence and only the MLP is tiled around it."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, execution: Execution = Execution(),
                 layer: int = 0):
        self.cfg = cfg
        self.execution = execution
        d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_size
        n, k = cfg.num_heads, cfg.num_kv_heads
        init = jax.nn.initializers.normal(cfg.init_std)
        norm_init = functools.partial(_norm_init, cfg)
        self.attn_norm = nnx.Param(norm_init(d))
        self.wq = nnx.Param(init(rngs.params(), (d, n, h), jnp.float32))
        self.wk = nnx.Param(init(rngs.params(), (d, k, h), jnp.float32))
        self.wv = nnx.Param(init(rngs.params(), (d, k, h), jnp.float32))
        self.wo = nnx.Param(init(rngs.params(), (n, h, d), jnp.float32))
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), jnp.float32))
            self.k_bias = nnx.Param(jnp.zeros((k, h), jnp.float32))
            self.v_bias = nnx.Param(jnp.zeros((k, h), jnp.float32))
        if cfg.qk_norm:  # only then: other models' parameter trees (and checkpoints) are unchanged
            self.q_norm = nnx.Param(norm_init(h))
            self.k_norm = nnx.Param(norm_init(h))
        if cfg.post_norms:
            self.attn_post_norm = nnx.Param(norm_init(d))
            self.mlp_post_norm = nnx.Param(norm_init(d))
        if cfg.layer_types:
            # The layer's kind as data, 1.0 for a sliding (local) layer, 0.0 for a full (global)
            # one, so local and global layers share one structure and one compiled function. A
            # Constant, not a Param: no optimizer sees it (a Param with a zero gradient would
            # still be decayed by a plain optax.adamw, turning a local layer global), and no
            # checkpoint or HF file holds it (block_constants gives it from the config).
            self.sliding = Constant(sliding_flag(cfg, layer))
        self.mlp_norm = nnx.Param(norm_init(d))
        if cfg.num_experts:
            self._init_experts(cfg, init, rngs)
            return
        self.w_gate = nnx.Param(init(rngs.params(), (d, f), jnp.float32))
        self.w_up = nnx.Param(init(rngs.params(), (d, f), jnp.float32))
        self.w_down = nnx.Param(init(rngs.params(), (f, d), jnp.float32))

    def _init_experts(self, cfg: ModelConfig, init, rngs: nnx.Rngs):
        """A MoE layer's MLP (instead of w_gate, w_up, w_down): the router and E experts."""
        d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        self.w_router = nnx.Param(init(rngs.params(), (d, e), jnp.float32))
        self.experts_gate = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
        self.experts_up = nnx.Param(init(rngs.params(), (e, d, f), jnp.float32))
        self.experts_down = nnx.Param(init(rngs.params(), (e, f, d), jnp.float32))

    def __call__(self, x, context=None):
        """(B, T, D) -> (B, T, D), or with experts (cfg.num_experts) ((B, T, D), the router
        statistics of moe.moe_mlp). `context` is None (one sequence per row, positions 0..T-1) or
        data.document_context's {"segment_ids", "positions"}, each (B, T) int32, for packed
        documents: attention stays within a document and RoPE restarts at each one."""
        if context is None:
            segment_ids, positions = None, jnp.arange(x.shape[1])
        else:
            segment_ids, positions = context["segment_ids"], context["positions"]
        if self.execution.tiles(x.shape[1]):
            return self._tiled(x, segment_ids, None if context is None else positions)
        attend = lambda q, k, v, sliding: (self._self_attention(q, k, v, sliding, segment_ids),
                                           None)
        x, _ = self._attention(x, positions, attend)
        # padding (a negative segment id) stays out of the router's statistics
        return self._mlp(self._weights(), x, None if segment_ids is None else segment_ids >= 0)

    def _tiled(self, x, segment_ids, positions):
        """__call__ a tile of execution.tile_size tokens at a time (seqtile.tiled_block), each
        query tile's attention by execution.tiled: blockwise in blocks that divide the tile, or
        two calls of the execution's attention merged (no window, no document mask)."""
        cfg, ex = self.cfg, self.execution
        windows = (cfg.sliding_window, 0) if cfg.layer_types else (cfg.sliding_window,)
        if ex.tiled == "merged":
            if cfg.sliding_window or segment_ids is not None:
                raise ValueError("merged tile attention takes no sliding window and no document "
                                 "mask (attention.choose_attention never picks it for them)")
            attentions = (MergedTileAttention(x.shape[1], ex.attention,
                                              self._scale()),) * len(windows)
        else:
            attentions = tuple(TileAttention(x.shape[1], window, ex.tile_block(), self._scale())
                               for window in windows)

        def update(w, x, attn, valid):
            attn = attention_update(cfg, w, attn)
            mlp, aux = self._mlp_update(w, x + attn, valid)
            return attn + mlp, aux

        fns = TileFns(
            queries=lambda w, x, pos: attention_projections(cfg, w, x, pos, "q")[0],
            keys_values=lambda w, x, pos: attention_projections(cfg, w, x, pos, "kv"),
            update=update,
            # windows[0] for a local layer, windows[1] (none) for a global one
            attention=lambda w: (jnp.where(layer_rope(cfg, w)[0], 0, 1) if cfg.layer_types
                                 else 0))
        with jax.named_scope("tiled_block"):
            y, aux = tiled_block(fns, attentions, self._weights(), x, segment_ids, positions,
                                 ex.tile_size)
        return (y, aux) if cfg.num_experts else y

    # ------------------------------------------------------------------ generation (KV cache)
    # The same attention and MLP code as __call__ (`_attention`, `_mlp`): only where the keys and
    # values come from differs. A cache is {"k", "v"}, each (B, S, K, H) in x's dtype, S a fixed
    # maximum length (so shapes never change from token to token), keys after RoPE.

    def prefill(self, x, cache_len: int):
        """The block over a prompt (B, T, D) at positions 0..T-1, exactly as __call__ computes it
        (with its attention implementation), and this layer's cache of S = cache_len positions
        holding the prompt's keys and values at 0..T-1 (zeros after)."""
        def attend(q, k, v, sliding):
            pad = ((0, 0), (0, cache_len - k.shape[1]), (0, 0), (0, 0))
            return (self._self_attention(q, k, v, sliding, None),
                    {"k": jnp.pad(k, pad), "v": jnp.pad(v, pad)})
        x, cache = self._attention(x, jnp.arange(x.shape[1]), attend)
        return self._dense(self._mlp(self._weights(), x, None)), cache

    def decode(self, x, cache, position):
        """One token per row, x (B, 1, D), at `position` (an int32 scalar: the tokens before it,
        whose keys and values the cache holds): (the block's output (B, 1, D), the cache with this
        token's keys and values written at `position`)."""
        def attend(q, k, v, sliding):
            put = lambda c, new: lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), position,
                                                                 axis=1)
            cache_k, cache_v = put(cache["k"], k), put(cache["v"], v)
            window = self.cfg.sliding_window
            if sliding is not None:  # the layer's kind is data: so is its window
                window = jnp.where(sliding, window, 0)
            attn = cached_attention(q, cache_k, cache_v, position, window=window,
                                    scale=self._scale())
            return attn, {"k": cache_k, "v": cache_v}
        x, cache = self._attention(x, jnp.reshape(position, (1,)), attend)
        return self._dense(self._mlp(self._weights(), x, None)), cache

    # ------------------------------------------------------------------ the shared parts

    def _weights(self) -> dict:
        """The block's weights (and its Constants) by attribute name, as arrays."""
        return {name: v[...] for name, v in vars(self).items()
                if isinstance(v, (nnx.Param, Constant))}

    def _scale(self):
        q_scalar = self.cfg.query_pre_attn_scalar
        return q_scalar**-0.5 if q_scalar else None

    def _dense(self, out):
        """The block's output without a MoE layer's router statistics (not needed to generate)."""
        return out[0] if self.cfg.num_experts else out

    def _self_attention(self, q, k, v, sliding, segment_ids):
        """Causal attention of the sequence's own q, k, v by the execution's implementation;
        `sliding` (a traced bool, or None without layer_types) picks the layer's window."""
        cfg, ex = self.cfg, self.execution
        attend = functools.partial(attention, implementation=ex.attention,
                                   segment_ids=segment_ids, block_size=ex.attention_block,
                                   scale=self._scale())
        if sliding is None:
            return attend(q, k, v, window=cfg.sliding_window)
        # local or global by this layer's data, in one compiled function (both windows are
        # compiled in; XLA:GPU reads the predicate back to the host, one small sync per call, the
        # price of one function for both kinds: cuDNN's window is static, so it cannot be data)
        return lax.cond(sliding, lambda q, k, v: attend(q, k, v, window=cfg.sliding_window),
                        lambda q, k, v: attend(q, k, v, window=0), q, k, v)

    def _attention(self, x, positions, attend):
        """x + the attention sublayer, with `attend(q, k, v, sliding) -> (out (B, T, N, H),
        state)` given the projected, normed, rotated q (B, T, N, H), k, v (B, T, K, H) at integer
        `positions` ((T,) or (B, T)); returns (x, state)."""
        w = self._weights()
        with jax.named_scope("attention"):
            q, k, v = attention_projections(self.cfg, w, x, positions)
            attn, state = attend(q, k, v, layer_rope(self.cfg, w)[0])
            return attention_output(self.cfg, w, x, attn), state

    def _mlp(self, w, x, valid, tile: int | None = None):
        """x + the MLP sublayer (SwiGLU / GeGLU, in tiles of `tile` tokens, by default the
        execution's), or with experts (x + the sparse MLP, the router statistics over the `valid`
        tokens); w the block's weights."""
        tile = self.execution.tile_size if tile is None else tile
        if self.cfg.num_experts:
            out, stats = self._mlp_update(w, x, valid)
            return x + out, stats
        with jax.named_scope("mlp"):
            mlp = functools.partial(swiglu_mlp, **self._mlp_options())
            if tile and x.shape[1] > tile:
                return over_tiles(mlp, x, self._mlp_weights(w), tile)
            return mlp(x, self._mlp_weights(w))

    def _mlp_update(self, w, x, valid):
        """What the MLP sublayer adds to x (B, T, D), untiled, and with experts this layer's router
        statistics over the `valid` tokens (B, T) (None: all; the block returns (x, stats), the
        engine sums the stats over layers for moe.load_balancing_loss), else None."""
        cfg = self.cfg
        if not cfg.num_experts:
            with jax.named_scope("mlp"):
                return swiglu_update(x, self._mlp_weights(w), **self._mlp_options()), None
        with jax.named_scope("moe"):
            y = rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
            weights = (w["w_router"], w["experts_gate"], w["experts_up"], w["experts_down"])
            return moe.moe_mlp(y, weights, top_k=cfg.experts_per_token,
                               renormalize=cfg.moe_renormalize, tile=self.execution.expert_tile,
                               valid=valid)

    def _mlp_weights(self, w) -> tuple:
        weights = (w["mlp_norm"], w["w_gate"], w["w_up"], w["w_down"])
        return weights + ((w["mlp_post_norm"],) if self.cfg.post_norms else ())

    def _mlp_options(self) -> dict:
        cfg = self.cfg
        return dict(eps=cfg.rms_norm_eps, activation=cfg.activation, norm_offset=cfg.norm_offset)


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                        jnp.float32))
        self.scale = cfg.hidden_size**0.5 if cfg.scale_embeddings else None  # static (Gemma)

    def __call__(self, tokens):  # (B, T) int -> (B, T, D) in the weights' dtype
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.scale is not None:  # as HF: the scale rounded to the weights' dtype (bf16: 55.5)
            x = x * jnp.asarray(self.scale, x.dtype)
        return x


class LMHead(nnx.Module):
    """Final norm, output projection (or the tied embedding) and chunked cross-entropy."""

    def __init__(self, cfg: ModelConfig, embed: Embed, *, rngs: nnx.Rngs,
                 execution: Execution = Execution()):
        self.cfg = cfg
        self.execution = execution
        self.norm = nnx.Param(_norm_init(cfg, cfg.hidden_size))
        if cfg.tie_embeddings:
            self.embed = embed  # shared: nnx.split dedupes it, so its gradient sums both uses
        else:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.w_out = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size),
                                        jnp.float32))

    def logits(self, x):  # (B, T, D) -> (B, T, V) fp32
        y = rms_norm(x, self.norm[...], self.cfg.rms_norm_eps, self.cfg.norm_offset)
        if self.cfg.tie_embeddings:
            z = jnp.einsum("btd,vd->btv", y, self.embed.embedding[...],
                           preferred_element_type=jnp.float32)
        else:
            z = jnp.einsum("btd,dv->btv", y, self.w_out[...], preferred_element_type=jnp.float32)
        return cap_logits(z, self.cfg.final_logit_softcapping)[0]

    def __call__(self, x, targets):
        """(loss_sum, count), both fp32 scalars: the cross-entropy summed over the targets that
        are not loss.IGNORE_ID, and how many those are. Sums, so that micro-batches and
        documents of any length add up exactly; the mean is loss_sum / count. The (B, T, V)
        logits are never built whole (loss.chunked_cross_entropy computes them chunk by chunk)."""
        return chunked_cross_entropy(x, self._weight(), targets, **self._loss_options())

    def token_logprobs(self, x, targets):
        """(B, T) fp32 log-probabilities of the targets (0 where a target is loss.IGNORE_ID),
        chunked as the loss is: for losses over whole sequences (preference training)."""
        return chunked_token_logprobs(x, self._weight(), targets, **self._loss_options())

    def _weight(self):
        return self.embed.embedding[...] if self.cfg.tie_embeddings else self.w_out[...]

    def _loss_options(self) -> dict:
        # the final norm is per-token: applied chunk by chunk inside the loss
        eps, offset = self.cfg.rms_norm_eps, self.cfg.norm_offset
        return dict(layout="vd" if self.cfg.tie_embeddings else "dv",
                    chunk=self.execution.loss_chunk, vocab_chunk=self.execution.loss_vocab_chunk,
                    softcap=self.cfg.final_logit_softcapping,
                    prologue=lambda scale, x: rms_norm(x, scale, eps, offset),
                    prologue_params=self.norm[...])


def make_stages(cfg: ModelConfig, seed: int, execution: Execution = Execution()):
    """The resident first and last stages (embedding; final norm + head + loss)."""
    rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 1_000_000))
    embed = Embed(cfg, rngs=rngs)
    return embed, LMHead(cfg, embed, rngs=rngs, execution=execution)


def make_block(cfg: ModelConfig, seed: int, layer: int,
               execution: Execution = Execution()) -> Block:
    """Layer `layer`'s block; each layer's init depends only on (seed, layer), so layers can be
    built one at a time on the host without materialising the whole stack."""
    return Block(cfg, rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), layer)),
                 execution=execution, layer=layer)
