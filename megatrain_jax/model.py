"""A Llama-family decoder (Llama, Mistral, Qwen2) as Flax NNX modules.

The model knows nothing about streaming: it is three plain modules, `Embed`, `Block` and `LMHead`,
that the engine (or a plain reference loop) calls in order. Shapes use the letters
B batch, T sequence, D hidden, N query heads, K kv heads, H head dim, F MLP hidden, V vocab.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


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
    tie_embeddings: bool = False
    init_std: float = 0.02
    # RoPE frequency scaling as in HF: "" (none), "linear" (all frequencies / factor) or "llama3"
    # (long wavelengths / factor, short ones kept, a smooth ramp between; Llama 3.1+).
    rope_scaling: str = ""
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    # Mistral/Qwen2 sliding-window attention: 0 = none. Only sequences no longer than the window
    # are supported (attention is then exactly causal), so the block refuses longer ones.
    sliding_window: int = 0
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

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def num_params(self, *, include_embeddings: bool = True) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_size
        n, k = self.num_heads, self.num_kv_heads
        attn = d * n * h * 2 + d * k * h * 2 + (n + 2 * k) * h * self.qkv_bias
        block = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * block + d + (embed if include_embeddings else 0)


ROPE_SCALING_TYPES = ("", "linear", "llama3")


def rope_inv_freq(cfg: ModelConfig):
    """(H/2,) fp32 inverse frequencies, computed as HF computes them (fp32 throughout)."""
    h = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
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


def rms_norm(x, scale, eps):
    # As in HF Llama: normalise in fp32, cast back, then scale in the input dtype.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * x32.astype(x.dtype)


def apply_rope(x, inv_freq):
    """Rotary embedding on (B, T, N, H) with HF's half-split layout; positions are 0..T-1."""
    h = x.shape[-1]
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]  # (1, T, 1, H)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + swiglu(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_size
        n, k = cfg.num_heads, cfg.num_kv_heads
        init = jax.nn.initializers.normal(cfg.init_std)
        self.attn_norm = nnx.Param(jnp.ones((d,), jnp.float32))
        self.wq = nnx.Param(init(rngs.params(), (d, n, h), jnp.float32))
        self.wk = nnx.Param(init(rngs.params(), (d, k, h), jnp.float32))
        self.wv = nnx.Param(init(rngs.params(), (d, k, h), jnp.float32))
        self.wo = nnx.Param(init(rngs.params(), (n, h, d), jnp.float32))
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), jnp.float32))
            self.k_bias = nnx.Param(jnp.zeros((k, h), jnp.float32))
            self.v_bias = nnx.Param(jnp.zeros((k, h), jnp.float32))
        self.mlp_norm = nnx.Param(jnp.ones((d,), jnp.float32))
        self.w_gate = nnx.Param(init(rngs.params(), (d, f), jnp.float32))
        self.w_up = nnx.Param(init(rngs.params(), (d, f), jnp.float32))
        self.w_down = nnx.Param(init(rngs.params(), (f, d), jnp.float32))

    def __call__(self, x):  # (B, T, D) -> (B, T, D)
        cfg = self.cfg
        if cfg.sliding_window and x.shape[1] > cfg.sliding_window:
            raise ValueError(f"sequence length {x.shape[1]} exceeds model.sliding_window "
                             f"({cfg.sliding_window}): sliding-window attention is not implemented")
        with jax.named_scope("attention"):
            y = rms_norm(x, self.attn_norm[...], cfg.rms_norm_eps)
            q = jnp.einsum("btd,dnh->btnh", y, self.wq[...])
            k = jnp.einsum("btd,dkh->btkh", y, self.wk[...])
            v = jnp.einsum("btd,dkh->btkh", y, self.wv[...])
            if cfg.qkv_bias:
                q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
            inv_freq = rope_inv_freq(cfg)
            q, k = apply_rope(q, inv_freq), apply_rope(k, inv_freq)
            # Grouped-query attention: dot_product_attention broadcasts K kv heads over N.
            attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, T, N, H)
            x = x + jnp.einsum("btnh,nhd->btd", attn, self.wo[...])
        with jax.named_scope("mlp"):
            y = rms_norm(x, self.mlp_norm[...], cfg.rms_norm_eps)
            gate = jnp.einsum("btd,df->btf", y, self.w_gate[...])
            up = jnp.einsum("btd,df->btf", y, self.w_up[...])
            x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.w_down[...])
        return x


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(cfg.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                        jnp.float32))

    def __call__(self, tokens):  # (B, T) int -> (B, T, D) in the weights' dtype
        return jnp.take(self.embedding[...], tokens, axis=0)


class LMHead(nnx.Module):
    """Final norm, output projection (or the tied embedding) and mean cross-entropy."""

    def __init__(self, cfg: ModelConfig, embed: Embed, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), jnp.float32))
        if cfg.tie_embeddings:
            self.embed = embed  # shared: nnx.split dedupes it, so its gradient sums both uses
        else:
            init = jax.nn.initializers.normal(cfg.init_std)
            self.w_out = nnx.Param(init(rngs.params(), (cfg.hidden_size, cfg.vocab_size),
                                        jnp.float32))

    def logits(self, x):  # (B, T, D) -> (B, T, V) fp32
        y = rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)
        if self.cfg.tie_embeddings:
            return jnp.einsum("btd,vd->btv", y, self.embed.embedding[...],
                              preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", y, self.w_out[...], preferred_element_type=jnp.float32)

    def __call__(self, x, targets):  # -> scalar mean loss over B*T tokens
        logits = self.logits(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_stages(cfg: ModelConfig, seed: int):
    """The resident first and last stages (embedding; final norm + head + loss)."""
    rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 1_000_000))
    embed = Embed(cfg, rngs=rngs)
    return embed, LMHead(cfg, embed, rngs=rngs)


def make_block(cfg: ModelConfig, seed: int, layer: int) -> Block:
    """Layer `layer`'s block; each layer's init depends only on (seed, layer), so layers can be
    built one at a time on the host without materialising the whole stack."""
    return Block(cfg, rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), layer)))
