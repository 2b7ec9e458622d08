"""Toy first/last stages for engine tests with a user's own (non-Llama) blocks.

Imported as `from toy_model import ...`: pytest puts tests/ on sys.path (it has no __init__.py).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs, scale: float = 1.0):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (vocab, dim)) * scale)

    def __call__(self, tokens):
        return self.table[...][tokens]


class Head(nnx.Module):
    """Mean softmax cross-entropy of a linear readout."""

    def __init__(self, dim: int, vocab: int, rngs: nnx.Rngs, scale: float = 0.1):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, vocab)) * scale)

    def __call__(self, x, targets):
        return optax.softmax_cross_entropy_with_integer_labels(x @ self.w[...], targets).mean()


class Residual(nnx.Module):
    """x + tanh(x w + b) out, w (dim, width): a block whose matrices are not square."""

    def __init__(self, dim: int, width: int, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (dim, width)) * 0.1)
        self.b = nnx.Param(jnp.zeros((width,)))
        self.out = nnx.Param(jax.random.normal(rngs.params(), (width, dim)) * 0.1)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w[...] + self.b[...]) @ self.out[...]


def capture_grads() -> optax.GradientTransformation:
    """Leaves the params alone and keeps the last gradient as its state (its new state is its
    input, so no output of the update takes the donated state's place)."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))
