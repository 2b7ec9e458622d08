"""What a step asks of the host state: the one interface between the step's modules (step.py,
evaluate.py, lookup.py) and the host side (host.py's HostState, which satisfies it).

A step fetches a unit's bus copy (`bus`, `stage_bus`: each once its pending host update has
finished), says when a fetch of it was made (`fetched`) and read (`read`) and when the step is
done with the unit (`release_bus`), and queues the step's updates (`submit_all`). It reads the
units' layout (`last`, `shapes`, `stage_units`, `stage_leaves`), where the host's arrays live and
in which dtype the host takes gradients (`host_sharding`, `host_device`, `grad_dtype`,
`bus_sharding`), whether debug mode keeps every fetch (`fetches`), and the counters. Nothing else
of the host.
"""

from typing import Any, Optional, Protocol, runtime_checkable

import jax
import numpy as np

from megatrain_jax.engine.stream import Counters


@runtime_checkable
class StepHost(Protocol):
    """The host state as a step sees it. Unit 0 is the first stage's, unit 1 + i layer i's,
    unit `last` the last stage's own."""

    counters: Counters
    last: int
    shapes: dict  # {0: the whole stages' leaf shapes, 1: a block's}, logical (unsharded)
    stage_units: dict  # {0 and last: (params, opt_state) of that unit, jax.ShapeDtypeStruct trees}
    grad_dtype: np.dtype  # the dtype the host update takes gradients in
    host_sharding: jax.sharding.Sharding  # the host device's memory: the host lookup's work
    host_device: jax.Device
    bus_sharding: jax.sharding.Sharding  # where bus copies live
    fetches: Optional[dict]  # debug mode (not None): every fetch kept until its unit's update

    def bus(self, u: int) -> Any:
        """Unit u's bus copy (a tree of arrays), once its pending update has finished."""

    def stage_bus(self, indices) -> list:
        """The whole stages' bus leaves at `indices`, each once its stage unit's update is done."""

    def stage_leaves(self, u: int) -> tuple:
        """The whole stages' leaf indices that stage unit u (0 or `last`) holds."""

    def fetched(self, u: int, copies) -> None:
        """`copies` (device arrays) are a fetch of unit u's bus copy."""

    def read(self, u: int, token=None) -> None:
        """Unit u's latest fetch has been read: by work now done (token None), or by the work
        that makes `token`, not waited for."""

    def release_bus(self, u: int) -> None:
        """The step is done with unit u's bus copy until its update."""

    def submit_all(self, grads: list, grad_norm, scale) -> None:
        """Queues one step's updates, `grads` a list of (unit, its gradient) in the order they
        run, as one job: each gradient a transfer.Parcel on its way out or host arrays, the
        global norm and the scale scalars, any of them possibly a function the host thread calls
        to make it (the host lookup's, engine/lookup.py)."""
