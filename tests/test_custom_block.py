"""The public API with a user's own (non-Llama) block, and the README's example as written."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from toy_model import Embed, Head, capture_grads

from megatrain_jax import StreamedEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, V, L = 24, 19, 3


class GatedBlock(nnx.Module):
    def __init__(self, rngs):
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (D, 2 * D)) * 0.2)
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (2 * D,)) * 0.1)
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.2)

    def __call__(self, x):
        a, b = jnp.split(x @ self.w_in[...] + self.bias[...], 2, axis=-1)
        return x + jnp.tanh(a) * jax.nn.sigmoid(b) @ self.w_out[...]


def stages():
    return Embed(V, D, nnx.Rngs(0)), Head(D, V, nnx.Rngs(1), scale=0.2)


def test_custom_block_gradients_equal_jax_grad():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, size=(2, 3, 9))  # 2 micro-batches
    first, last = stages()
    engine = StreamedEngine(first=first, last=last,
                            make_block=lambda i: GatedBlock(nnx.Rngs(10 + i)), num_layers=L,
                            optimizer=capture_grads(), compute_dtype=jnp.float32,
                            compute_device=jax.devices("cpu")[0], host_device=jax.devices("cpu")[1])
    out = engine.train_step(tokens[..., :-1], tokens[..., 1:])
    state = engine.state()

    # The equivalent plain model: the same modules, one batch, jax.grad.
    embed, head = stages()
    blocks = [GatedBlock(nnx.Rngs(10 + i)) for i in range(L)]

    graphdef, params = nnx.split((embed, head, blocks))

    def loss_fn(params, inputs, targets):
        embed, head, blocks = nnx.merge(graphdef, params)
        x = embed(inputs)
        for block in blocks:
            x = block(x)
        return head(x, targets)

    flat = tokens.reshape(-1, tokens.shape[-1])
    loss, grads = jax.value_and_grad(loss_fn)(nnx.to_pure_dict(params), flat[:, :-1], flat[:, 1:])
    np.testing.assert_allclose(float(out["loss"]), float(loss), rtol=1e-6)
    expected = {"stages": {0: grads[0], 1: grads[1]}, "layers": [grads[2][i] for i in range(L)]}
    got = {"stages": state["stages"]["opt_state"],
           "layers": [layer["opt_state"] for layer in state["layers"]]}
    for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expected),
                            strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    engine.close()


def test_readme_example_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("## Using the engine in your own project"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    params = namespace["params"]
    assert len(params["layers"]) == 8
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
