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

The first stage's way is one strategy, chosen once from the first step's shapes
(StreamedEngine._choose_lookup, by why_off): HostFirst (the host lookup) or DeviceFirst. Each has
the three moments of a step (engine/step.py) where the two ways differ: `forward` (x_0[m] on the
device), `last_gradient` (after the loss: the last unit's gradient kept on the device for the
stages' merge, or sent out at once), and `backward` (the first stage's vjp, the stages' gradient
out, the global norm and the scale: an EmbedBackward).
"""

import concurrent.futures
import dataclasses
import time
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp

from megatrain_jax.engine import schedule, stage_units, transfer
from megatrain_jax.engine.schedule import FIRST_STAGE_WAIT
from megatrain_jax.engine.step_host import StepHost


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


IN_CALLS = ("copies in the calls: the device path's copies of the first stage cross beside "
            "compute, while the host lookup's backward (a table-sized gradient made on the host) "
            "would end every step with the device idle")


def why_off(setting, serves_why: str, rows_bytes: int, table: int, compute_bytes: int,
            grad_bytes: int, in_calls: bool = False) -> str:
    """Why the first stage does not run on the host ('' when it does): the one rule that the
    engine (StreamedEngine._choose_lookup) and the plan and step-time model (flops.host_lookup)
    follow, by the time each way puts on the step's path. `setting`: host_lookup (False: never;
    True: wherever it serves; None: where it also costs the step less); `serves_why`: serves()'s
    answer; `in_calls`: the layers' copies are made inside the jitted calls (an accelerator,
    engine/transfer.py), where the device path's bytes overlap compute and the host backward's
    time does not, so auto keeps the device path (host_lookup=True takes the host lookup where a
    measurement shows it faster: the GPU checklist's A/B); else (eager copies, which serialise
    with compute) the way that moves fewer bytes a step (costs_more's, the rest its arguments)."""
    if setting is False:
        return "host_lookup=False"
    if serves_why or setting:
        return serves_why
    if in_calls:
        return IN_CALLS
    return costs_more(rows_bytes, table, compute_bytes, grad_bytes)


def held(host: StepHost, u: int) -> tuple:
    """(index, shape) of each whole stages' leaf that stage unit u holds (one device)."""
    return tuple((i, tuple(host.shapes[0][i])) for i in host.stage_leaves(u))


# stage_units.gradient with the accumulator donated: its output takes the accumulator's buffer
_gradient_in_place = jax.jit(stage_units.gradient, static_argnums=(2, 3, 4, 5, 6),
                             donate_argnums=(0,))


class TableGradient:
    """The first stage's gradient on the host (the table's, for an embedding), in buffers kept
    from step to step: a fresh table-sized buffer is page-faulted in by one thread every step
    (docs/benchmarks.md, "The host lookup's backward on the CPU"), a kept one is cleared where it
    lies by the fused kernel's pool. `zeros` gives the fp32 accumulator (last step's gradient
    leaves, cleared, or new ones the first time and wherever a buffer was taken: donated by a jit
    update, or the kernel not built); `cast` makes unit 0's gradient in the gradient dtype from
    lookup.unit0_gradient's fp32 leaves, a bf16 one cast by the pool into a kept buffer too (the
    update reads it in place), rounded as XLA rounds (to nearest even). Runs on the host
    thread, after the previous step's updates have read the buffers."""

    def __init__(self, lib):
        self.lib = lib  # fused_adamw.kernel(), or None: fresh buffers and XLA's cast
        self._fp32, self._out = None, None

    @staticmethod
    def _kept(leaves, shapes, dtype) -> bool:
        return leaves is not None and [(x.shape, x.dtype) for x in leaves] == [
            (tuple(s), dtype) for s in shapes] and not any(x.is_deleted() for x in leaves)

    def zeros(self, shapes: list, device) -> list:
        kept, self._fp32 = self._fp32, None
        if self.lib is None or not self._kept(kept, shapes, jnp.float32):
            return [jnp.zeros(s, jnp.float32, device=device) for s in shapes]
        jax.block_until_ready(kept)  # (done long since: last step's update read them)
        for x in kept:
            self.lib.megatrain_zero(x.unsafe_buffer_pointer(), x.nbytes)
        return kept

    def cast(self, leaves: list, grad_dtype) -> list:
        """Unit 0's gradient in grad_dtype from its fp32 leaves (kept for the next step's
        accumulator)."""
        self._fp32 = leaves
        grad_dtype = jnp.dtype(grad_dtype)
        if grad_dtype == jnp.float32:
            return leaves
        if self.lib is None or grad_dtype != jnp.bfloat16:
            return _cast(leaves, grad_dtype)
        shapes = [x.shape for x in leaves]
        if not self._kept(self._out, shapes, grad_dtype):
            device = next(iter(leaves[0].sharding.device_set))
            self._out = [jnp.zeros(s, grad_dtype, device=device) for s in shapes]
        # the pool reads and writes through pointers: the leaves' computation done, and the
        # buffer's (made, or read by the last step's squares)
        jax.block_until_ready(leaves + self._out)
        for out, x in zip(self._out, leaves):
            self.lib.megatrain_to_bf16(out.unsafe_buffer_pointer(), x.unsafe_buffer_pointer(),
                                       x.size)
        return self._out


_cast = jax.jit(lambda leaves, dtype: [x.astype(dtype) for x in leaves], static_argnums=(1,))


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
    update that asks (unit 0's, queued first), from: the step's parts `sp` (step.StepParts), the
    first stage's bus leaves `w` (host), the micro-batches' inputs (host, stacked), the rows'
    gradient (a transfer.Parcel of the micro-batches', stacked) and the device's scalars (the
    layers' total sum of squares, the last unit's per leaf, the total loss weight). `grads`,
    `norm` and `scale` are what HostState.submit takes; `result()` waits for (norm, stages' sum
    of squares) on the calling thread."""

    def __init__(self, sp, table, w, inputs, rows_grad, scalars):
        self.sp, self.table, self.w, self.inputs = sp, table, w, inputs
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
        host, f, parts = self.sp.host, self.sp.functions, self.sp.parts
        on_host = host.host_sharding
        dxs = self.rows_grad.arrive(on_host)
        layers_sq, last_sq, weight = transfer.arrive(self.scalars, on_host)
        acc = self.table.zeros([x.shape for x in self.w], host.host_device)
        acc = f.host_embed_bwd(self.w, self.inputs, dxs, acc)
        leaves = self.table.cast(unit0_gradient(acc, parts.first, held(host, 0), jnp.float32),
                                 host.grad_dtype)
        # the stages' sum of squares, leaf by leaf in the order the device's sum_squares adds them
        squares = dict(zip(host.stage_leaves(0), f.leaf_squares(leaves)))
        squares.update(zip(host.stage_leaves(host.last), last_sq))
        stages_sq = f.total([squares[i] for i in sorted(squares)])
        norm, scale = f.norm_and_scale([layers_sq], stages_sq, weight)
        return stage_units.fill(host.stage_units[0][0], leaves), norm, scale, stages_sq

    def grads(self):
        return self._compute()[0]

    def norm(self):
        return self._compute()[1]

    def scale(self):
        return self._compute()[2]

    def done(self) -> bool:
        return self._done.done()

    def result(self) -> tuple:
        """(global norm, the stages' sum of squares), host scalars, once the host thread made
        them (re-raises what it raised)."""
        _, norm, _, stages_sq = self._done.result()
        return norm, stages_sq


@dataclasses.dataclass(frozen=True)
class EmbedBackward:
    """The embed backward's outcome: unit 0's and the last unit's gradients, the norm and the
    scale, as HostState.submit_all takes them; layer 0's gradient Parcel when it went out here
    (the jit form) else None; `totals()` (global norm, stages' sum of squares), to call once the
    update is queued."""
    first_out: Union[transfer.Parcel, Callable]  # (the host lookup's: made on the host thread)
    last_out: transfer.Parcel
    norm: Union[jax.Array, Callable]
    scale: Union[jax.Array, Callable]
    layer0: Optional[transfer.Parcel]
    totals: Callable[[], tuple]


def _stage_shapes(sp) -> tuple:
    """(index, shape) of every stages' gradient leaf on the device (the sharded layout: padded to
    split over the devices) and where the merge leaves them (None: where jit puts them)."""
    shapes, shards = sp.host.shapes[0], sp.placement.shards
    if shards is None:
        return tuple(enumerate(map(tuple, shapes))), None
    return tuple(enumerate(shards.padded_shape(s) for s in shapes)), sp.placement.pieces


class DeviceFirst:
    """The first stage on the device, from its fetched weights; its gradient merged with the last
    stage's on the device (the stages' gradient), where the global norm is taken."""
    def forward(self, sp, inputs):
        w = sp.fetch_stage("first")
        xs = sp.functions.embed(w, inputs)
        sp.delete(sp.fetched(w))
        return xs

    def last_gradient(self, sp, last_grads):
        return last_grads  # kept on the device for the stages' merge

    def backward(self, sp, inputs, head, layer_sq, leaving) -> EmbedBackward:
        """`head` a step.Head; `leaving` (a stream.Outgoing: layer 0's gradient, and its device
        arrays to free once it is out) to send out beside the embedding backward's compute, or
        None. In the jit form the stages' gradient and the scalars are made in pinned host memory
        (DeviceFunctions.stages), so nothing is copied here."""
        f, host = sp.functions, sp.host
        w = sp.fetch_stage("first")
        first_grads, _, layer0 = sp.transfers.in_call(f.embed_bwd, (w, inputs, head.dxs),
                                                      grads=leaving and leaving.grads)
        sp.delete((sp.fetched(w), head.dxs, leaving and leaving.free))
        held_leaves, sharding = _stage_shapes(sp)
        stage_grads, scalars, stages_sq = f.stages(first_grads, head.last, layer_sq, head.weight,
                                                   held_leaves, sharding)
        sp.delete((first_grads, head.last))  # the parts' fp32 sums, once merged
        if sp.copies == schedule.JIT:
            norm, scale = scalars
            first_out, last_out = (sp.transfers.made_out(stage_units.like(
                stage_grads, host.stage_units[u][0])) for u in (0, host.last))
        else:
            norm, scale = sp.transfers.scalars_out(scalars)
            first_out, last_out = (sp.transfers.grads_out(stage_units.like(
                stage_grads, host.stage_units[u][0])) for u in (0, host.last))
        return EmbedBackward(first_out, last_out, norm, scale, layer0,
                             lambda: (scalars[0], stages_sq))


class HostFirst:
    """The host lookup: the first stage on the host, on unit 0's bus copy; only its rows cross.
    The last unit's gradient goes out as soon as the loss is done; the first stage's backward
    and the global norm run on the host thread (HostBackward), into the table's gradient
    buffers kept from step to step (TableGradient)."""

    def __init__(self, lib=None):
        self.table = TableGradient(lib)

    def forward(self, sp, inputs):
        w = sp.host.stage_bus(sp.parts.first)
        return sp.transfers.rows_in(sp.functions.host_embed(w, inputs))

    def last_gradient(self, sp, last_grads) -> tuple:
        """Nothing to merge it with: (the last unit's gradient on its way out, its sums of
        squares per leaf)."""
        host = sp.host
        leaves, squares = sp.functions.last_unit(last_grads, held(host, host.last))
        parcel = sp.transfers.grads_out(stage_units.fill(host.stage_units[host.last][0], leaves))
        sp.delete(last_grads)  # its fp32 sum; the cast leaves are freed once they are out
        return parcel, squares

    def backward(self, sp, inputs, head, layer_sq, leaving) -> EmbedBackward:
        """As DeviceFirst.backward, on the host thread, from the rows' gradient."""
        f, transfers = sp.functions, sp.transfers
        last_out, last_squares = head.last
        scalars = (f.total(layer_sq), last_squares, head.weight)
        layer0 = None
        if leaving is not None:  # no device function runs after it: layer 0's gradient goes out now
            layer0 = transfers.grads_out(leaving.grads, layer=True)
            sp.delete(leaving.free)
        backward = HostBackward(sp, self.table, sp.host.stage_bus(sp.parts.first), inputs,
                                transfers.grads_out(head.dxs), transfers.scalars_out(scalars))

        def totals():
            t0, waits = time.perf_counter(), not backward.done()
            made = backward.result()
            if waits:  # (made already: no wait)
                sp.host.counters.synced(FIRST_STAGE_WAIT, time.perf_counter() - t0)
            return made
        return EmbedBackward(backward.grads, last_out, backward.norm, backward.scale, layer0,
                             totals)


# The first stage's way, chosen once (StreamedEngine._choose_lookup)
FirstStage = Union[DeviceFirst, HostFirst]
