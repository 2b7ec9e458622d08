"""Where the units' fp32 master weights and optax state live between updates: `RamStore` (in host
RAM, on the units themselves) or `DiskStore` (each unit's in a file of the disk tier, tier.py:
read ahead of its update, written back behind it; the unit's params and opt_state None between
updates, only its bus copy in RAM). HostState chooses one at construction (`choose`).

Each store: `add(units)` at construction, as each unit is made; `expect(u)` when u's update is
queued; `load(u, unit)` and `store(u, unit)` around the update, on the host thread;
`put(u, unit, params, opt_state)` a loaded state; `view(u, unit)` (params, opt_state) for the
engine to read, `lend(u, unit)` the same for a reader outside it (the direct store tracks those:
direct.py, "Readers of the state"); `flush()`, `close()`. `donate`: the update's arguments it
may donate (params 0, optax state 1, the old bus copy 3).
"""

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax.engine import direct as direct_lib
from megatrain_jax.engine import tier as tier_lib


class RamStore:
    tier = None
    # Donating params, optax state and the old bus copy makes the update write in place: on the
    # CPU backend a fresh output buffer is page-faulted in at a fraction of memory speed.
    donate = (0, 1, 3)

    def add(self, units):
        pass

    def expect(self, u: int):
        pass

    def load(self, u: int, unit):
        pass

    def store(self, u: int, unit):
        pass

    def put(self, u: int, unit, params, opt_state):
        unit.params, unit.opt_state = params, opt_state

    def view(self, u: int, unit) -> tuple:
        return unit.params, unit.opt_state

    def lend(self, u: int, unit) -> tuple:
        return self.view(u, unit)

    def flush(self):
        pass

    def close(self):
        pass


class DiskStore:
    # Params and optax state alias the tier's read buffer (tier.load), which XLA does not own:
    # the update's outputs get buffers of their own, copied out by tier.store.
    donate = (3,)

    def __init__(self, options: tier_lib.DiskTierOptions, num_units: int, last_shapes, host):
        """last_shapes: the last unit's (params, opt_state) shapes, for its file's layout (the
        files are made before that unit is); host: the host device's sharding."""
        self.options, self.num_units, self.host = options, num_units, host
        self.last_layout = tier_lib.UnitLayout.of(*last_shapes)
        self.tier = None  # made once the first block is known (all blocks share its layout)

    def add(self, units):
        """Construction: each unit's state to its file, only its bus copy kept in RAM."""
        if len(units) < 2:
            return
        layout = lambda unit: tier_lib.UnitLayout.of(unit.params, unit.opt_state)
        if self.tier is None:
            first, block = units
            self.tier = tier_lib.DiskTier(self.options, [layout(first)] + [layout(block)] * (
                self.num_units - 2) + [self.last_layout])
        u = len(units) - 1
        if layout(units[u]) != self.tier.layouts[u]:
            raise ValueError(f"disk tier: block {u - 1}'s layout differs from block 0's")
        for v in ([0, 1] if u == 1 else [u]):
            unit = units[v]
            self.tier.write_now(v, unit.params, unit.opt_state)
            unit.params = unit.opt_state = None

    def expect(self, u: int):
        self.tier.expect(u)  # its read may start ahead

    def load(self, u: int, unit):
        """The state from its file (read ahead)."""
        unit.params, unit.opt_state = self.tier.load(u, self.host)

    def store(self, u: int, unit):
        """Written back behind, out of RAM."""
        self.tier.store(u, unit.params, unit.opt_state)
        unit.params = unit.opt_state = None

    def put(self, u: int, unit, params, opt_state):
        """Into its file, only the bus copy in RAM."""
        self.tier.write_now(u, params, opt_state)

    def view(self, u: int, unit) -> tuple:
        """Read-only numpy arrays mapped from its file."""
        return self.tier.view(u)

    def lend(self, u: int, unit) -> tuple:
        return self.view(u, unit)

    def flush(self):
        self.tier.flush()

    def close(self):
        if self.tier is not None:
            self.tier.close()


class DirectStore(RamStore):
    """In host RAM, as numpy buffers the engine owns (`unit.arrays`, direct.UnitArrays), updated
    in place by the kernel called directly (direct.py); read as jax arrays over read-only views
    of them."""

    def __init__(self, update):
        self.update = update  # direct.DirectAdamW

    def put(self, u: int, unit, params, opt_state):
        """Copied into new buffers (the caller's arrays are left as they are)."""
        unit.arrays = direct_lib.UnitArrays.of(params, opt_state, self.update.lib)

    def view(self, u: int, unit) -> tuple:
        return unit.arrays.trees(self.update.wrap)

    def lend(self, u: int, unit) -> tuple:
        """Leased views: the unit's update copies it while they may be read."""
        return unit.arrays.lend(self.update.wrap)


def choose(disk_tier, num_units: int, last_shapes, host, direct=None):
    """The store for `disk_tier` (DiskTierOptions, or None: RAM; `direct`, a direct.DirectAdamW:
    the direct update's numpy buffers)."""
    if direct is not None:
        return DirectStore(direct)
    return RamStore() if disk_tier is None else DiskStore(disk_tier, num_units, last_shapes, host)


# ----------------------------------------------------------------------------- a loaded state
def _path(path) -> str:
    """A leaf's path as params/w or opt_state/0/mu/w (as a checkpoint names it)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path[1:]]
    return "/".join([("params", "opt_state")[path[0].idx], *keys])


def _leaves(tree) -> dict:
    return {_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _same_kind(a, b) -> bool:
    """Both floating (of any width: a cast), both integers, or equal."""
    kinds = (jnp.floating, jnp.integer)
    return a == b or any(jnp.issubdtype(a, k) and jnp.issubdtype(b, k) for k in kinds)


def check(unit_state, layout: tuple, what: str) -> tuple:
    """(params, opt_state) of `unit_state` ({"params", "opt_state"}) once checked against the
    unit's `layout` ((params, opt_state) as jax.ShapeDtypeStruct trees): the same structure, every
    leaf's shape, a dtype of the same kind (floating, integer). Else one ValueError line naming
    `what` (the unit) and the leaf, before anything is replaced."""
    if not isinstance(unit_state, dict) or set(unit_state) != {"params", "opt_state"}:
        keys = sorted(unit_state) if isinstance(unit_state, dict) else type(unit_state).__name__
        raise ValueError(f"cannot load {what}: give {{'params': ..., 'opt_state': ...}}, got "
                         f"{keys}")
    given = (unit_state["params"], unit_state["opt_state"])
    have, want = _leaves(given), _leaves(layout)
    for path in want:
        if path not in have:
            raise ValueError(f"cannot load {what}: it has no {path}")
    for path in have:
        if path not in want:
            raise ValueError(f"cannot load {what}: {path} is not in the unit")
    if jax.tree.structure(given) != jax.tree.structure(layout):
        raise ValueError(f"cannot load {what}: its containers differ from the unit's "
                         f"({jax.tree.structure(layout)})")
    for path, x in have.items():
        shape, dtype = tuple(np.shape(x)), _dtype(x)
        if shape != want[path].shape or not _same_kind(dtype, np.dtype(want[path].dtype)):
            raise ValueError(f"cannot load {what}: {path} has shape {shape} {dtype}, the unit's "
                             f"has shape {want[path].shape} {np.dtype(want[path].dtype)}")
    return given


def cast(state: tuple, layout: tuple) -> tuple:
    """`state` (checked) with each leaf in the layout's dtype: the Adam moments of another
    optimizer.state_dtype take the engine's (rounded to the nearest). Leaves already in it are
    the caller's own arrays, not copies."""
    def one(x, like):
        if _dtype(x) == like.dtype:
            return x
        return x.astype(like.dtype) if hasattr(x, "astype") else np.asarray(x, like.dtype)
    return jax.tree.map(one, state, layout)
