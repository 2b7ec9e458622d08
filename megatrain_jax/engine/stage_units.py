"""The stages' two units: the first stage's variables (unit 0, updated first) and the last
stage's own (the last unit, updated last), each kept as the whole stages tree with the other
unit's leaves None.

`param_split((first, last))` gives the stages as `{0: first's variables, 1: last's}`; a variable
both read (tied embeddings) appears once, under the first stage, so it lives in unit 0 and its
gradient is the sum of both parts'. Kept as whole trees with None holes, the two units' params,
optax states (optax maps over the params, so its per-leaf state has the same holes; scalar state
such as Adam's count is in both, and equal) and gradients merge back leaf for leaf into the one
stages unit a checkpoint holds, and split from it.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class Constant(nnx.Variable):
    """A block's per-layer constant (Gemma 3's layer kind): it reaches the block beside its
    weights, as data, so blocks that differ only in their constants share one compiled function;
    but it is no parameter: no gradient, no optimizer state, no checkpoint (make_block(i) gives it
    again). Kept on the compute device for the whole run: meant for a few numbers a layer."""


def param_split(module: nnx.Module, what: str):
    """(graphdef, params, constants), each a pure dict, of a streamed module, which may hold only
    nnx.Param and Constant variables (`what` names it in the error)."""
    graphdef, params, constants, rest = nnx.split(module, nnx.Param, Constant, ...)
    if jax.tree.leaves(rest):
        raise ValueError(f"{what} holds state that is neither nnx.Param nor Constant "
                         f"({list(rest.flat_state())[0][0]}); streamed modules may only hold "
                         "those")
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(constants)


def stages_split(stages) -> tuple:
    """(graphdef, params) of the (first, last) stages, which hold no Constant (there is one
    of each stage, so nothing to share a compiled function with)."""
    graphdef, params, constants = param_split(stages, "the first/last stages")
    if constants:
        raise ValueError(f"the first/last stages hold a Constant ({next(iter(constants))}); "
                         "only blocks may")
    return graphdef, params


def _is_none(x) -> bool:
    return x is None


def flat(tree) -> list:
    """The leaves of `tree` with its None holes kept in place (one entry per stages leaf)."""
    return jax.tree.flatten(tree, is_leaf=_is_none)[0]


def split(stages) -> tuple:
    """(unit 0's tree, the last unit's tree) of the whole stages tree: the first stage's leaves
    (key 0) and the others, each with the other's leaves None."""
    first = lambda path: path[0].key == 0
    keep = lambda want: jax.tree_util.tree_map_with_path(
        lambda path, x: x if first(path) == want else None, stages)
    return keep(True), keep(False)


def merge(first, last):
    """The whole tree of two units' trees (params, optax states, bus copies): each leaf from the
    unit holding it; a leaf in both (scalar optax state, equal) from the first."""
    leaves, treedef = jax.tree.flatten(first, is_leaf=_is_none)
    other = flat(last)
    return jax.tree.unflatten(treedef, [a if a is not None else b
                                        for a, b in zip(leaves, other, strict=True)])


def like(whole, template):
    """The part of `whole` (a whole stages tree) that `template` (one unit's tree, or its shape)
    holds: its None holes kept."""
    holes, treedef = jax.tree.flatten(template, is_leaf=_is_none)
    leaves = jax.tree.leaves(whole)
    return jax.tree.unflatten(treedef, [None if h is None else x
                                        for h, x in zip(holes, leaves, strict=True)])


def fill(template, leaves: list):
    """A unit's tree shaped as `template` (its None holes kept), its leaves `leaves` in order."""
    holes, treedef = jax.tree.flatten(template, is_leaf=_is_none)
    leaves = iter(leaves)
    return jax.tree.unflatten(treedef, [None if h is None else next(leaves) for h in holes])


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def gradient(first, last, first_idx, last_idx, held, dtype, out_sharding):
    """A stage unit's gradient leaves, `held` ((index, shape) pairs of the whole stages' leaves),
    in `dtype`, from the two parts' fp32 gradients (`first[k]` at stages leaf `first_idx[k]`, the
    same for `last`; tied leaves get the sum of both, taken in fp32; a leaf neither reaches is
    zero), where its inputs are."""
    leaves = []
    for i, shape in held:
        leaf = jnp.zeros(shape, jnp.float32)
        for idx, part in ((first_idx, first), (last_idx, last)):
            if i in idx:
                leaf = leaf + part[idx.index(i)].astype(jnp.float32)
        leaf = leaf.astype(dtype)
        if out_sharding is not None:  # the sharded layout: as Placement.reduce leaves a gradient
            leaf = jax.lax.with_sharding_constraint(leaf, out_sharding)
        leaves.append(leaf)
    return leaves


def indices(tree) -> tuple:
    """The stages leaf indices a unit's tree holds."""
    return tuple(i for i, x in enumerate(flat(tree)) if x is not None)
