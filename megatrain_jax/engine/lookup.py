"""The first stage on the host (the host lookup): the embedding table never crosses the bus.

When the first stage shares no variable with the last (an untied embedding) and the step runs on
one compute device, the engine runs `first` on the host CPU device, on unit 0's bus copy, which
therefore stays in host memory (HostState.keep_bus_on_host): each micro-batch's rows are gathered
there (jitted) and only the rows (batch x seq x hidden, in the compute dtype) cross to the device.
The backward sends back only the rows' gradient (dx at the first stage's output). The host thread,
at the start of unit 0's update (the first it runs), takes the first stage's vjp there (for an
embedding, the scatter-add of the rows' gradient into the table's dense fp32 gradient), then the
stages' sum of squares and the global norm, in the order and dtype the device took them, so the
norm and every update are those of the device path. AdamW still sees the dense gradient: every
row's weight and moments decay, as optax does.
"""

import concurrent.futures

import jax
import jax.numpy as jnp

from megatrain_jax.engine import stage_units, transfer
from megatrain_jax.engine.functions import norm_and_scale


def serves(data_parallel: bool, parts, unit0) -> str:
    """Why the host lookup cannot serve a run ('' when it can): `parts` its StageParts, `unit0`
    the stages leaf indices unit 0 holds."""
    if data_parallel:
        return "data parallel (each device takes its rows of the batch)"
    if set(parts.first) & set(parts.last):
        return "the first and last stages share a variable (tied embeddings)"
    if not set(parts.first) <= set(unit0):
        return "the first stage reads the last stage's variables"
    return ""


def costs_more(rows_bytes: int, table: int, compute_bytes: int, grad_bytes: int) -> str:
    """Why the host lookup would move more bytes a step than the device path ('' when it moves
    fewer): its rows in and their gradient out (`rows_bytes` each: every micro-batch's rows, in
    the compute dtype) against the first stage's weights (`table` parameters) fetched twice in
    the compute dtype (`compute_bytes` an element) and their gradient out (`grad_bytes`)."""
    rows_bytes, table_bytes = 2 * rows_bytes, table * (2 * compute_bytes + grad_bytes)
    if rows_bytes < table_bytes:
        return ""
    return (f"its rows and their gradient ({rows_bytes:,} bytes a step) outweigh the first "
            f"stage's weights fetched twice and their gradient ({table_bytes:,})")


def why_off(setting, serves_why: str, rows_bytes: int, table: int, compute_bytes: int,
            grad_bytes: int) -> str:
    """Why the first stage does not run on the host ('' when it does): the one rule that the
    engine (StreamedEngine._choose_lookup) and the plan and step-time model (flops.host_lookup)
    follow. `setting`: host_lookup (False: never; True: wherever it serves; None: where it also
    moves fewer bytes a step); `serves_why`: serves()'s answer; the rest as costs_more's."""
    if setting is False:
        return "host_lookup=False"
    if serves_why or setting:
        return serves_why
    return costs_more(rows_bytes, table, compute_bytes, grad_bytes)


def held(host, u: int) -> tuple:
    """(index, shape) of each whole stages' leaf that stage unit u holds (one device)."""
    return tuple((i, tuple(host.shapes[0][i])) for i in host.stage_leaves(u))


# stage_units.gradient with the accumulator donated: its output takes the accumulator's buffer
_gradient_in_place = jax.jit(stage_units.gradient, static_argnums=(2, 3, 4, 5, 6),
                             donate_argnums=(0,))


def unit0_gradient(acc: list, first: tuple, held_leaves: tuple, grad_dtype) -> list:
    """Unit 0's gradient leaves in `grad_dtype` from the first stage's fp32 accumulator `acc`
    (its leaves at stages indices `first`; `held_leaves` as held()'s), as stage_units.gradient
    makes them. In fp32 it takes `acc`'s own buffers (donated: `acc` is deleted), so no copy of
    the table's gradient is made (a copy is mostly page faults of the fresh buffer:
    docs/benchmarks.md, "The host lookup's backward on the CPU"); otherwise the cast writes a new
    one and `acc` is kept."""
    make = (_gradient_in_place if jnp.dtype(grad_dtype) == jnp.float32
            else stage_units.gradient)
    return make(acc, [], first, (), held_leaves, grad_dtype, None)


class HostBackward:
    """Unit 0's gradient, the global norm and the scale, made on the host thread by the first
    update that asks (unit 0's, queued first), from: the first stage's bus leaves `w` (host), the
    micro-batches' inputs (host), the rows' gradient (a transfer.Parcel of a list, one per
    micro-batch) and the device's scalars (the layers' total sum of squares, the last unit's per
    leaf, the total loss weight). `grads`, `norm` and `scale` are what HostState.submit takes;
    `result()` waits for (norm, stages' sum of squares) on the calling thread."""

    def __init__(self, engine, w, inputs, rows_grad, scalars):
        self.engine, self.w, self.inputs = engine, w, inputs
        self.rows_grad, self.scalars = rows_grad, scalars
        self._done = concurrent.futures.Future()

    def _compute(self) -> tuple:
        if not self._done.done():
            try:
                self._done.set_result(self._backward())
            except BaseException as e:
                self._done.set_exception(e)
        return self._done.result()

    def _backward(self) -> tuple:
        engine = self.engine
        host, f, parts = engine.host, engine.functions, engine.parts
        on_host = host.host
        dxs = self.rows_grad.arrive(on_host)
        layers_sq, last_sq, weight = transfer.arrive(self.scalars, on_host)
        acc = [jnp.zeros(x.shape, jnp.float32, device=host.host_device) for x in self.w]
        for x, dx in zip(self.inputs, dxs):
            acc = f.host_embed_bwd(self.w, x, dx, acc)
        leaves = unit0_gradient(acc, parts.first, held(host, 0), host.grad_dtype)
        # the stages' sum of squares, leaf by leaf in the order the device's sum_squares adds them
        squares = dict(zip(host.stage_leaves(0), f.leaf_squares(leaves)))
        squares.update(zip(host.stage_leaves(host.last), last_sq))
        stages_sq = f.total([squares[i] for i in sorted(squares)])
        norm, scale = norm_and_scale([layers_sq], stages_sq, weight)
        return stage_units.fill(host.stage_units[0][0], leaves), norm, scale, stages_sq

    def grads(self):
        return self._compute()[0]

    def norm(self):
        return self._compute()[1]

    def scale(self):
        return self._compute()[2]

    def result(self) -> tuple:
        """(global norm, the stages' sum of squares), host scalars, once the host thread made
        them (re-raises what it raised)."""
        _, norm, _, stages_sq = self._done.result()
        return norm, stages_sq
