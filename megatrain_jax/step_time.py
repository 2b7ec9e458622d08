"""Step-time prediction: a timeline simulation of streamed steps from component rates.

    shape = step_shape(cfg, offload=False)
    p = simulate(shape, Rates(h2d_gbps=55, d2h_gbps=55, device_tflops=989, host_update_gbps=26))
    print(p.report())      # step time, tokens/s, MFU, which resource bounds the step

The simulation replays the engine's schedule (engine/schedule.py's passes, run by the engine's
own interpreter of them, schedule.walk; engine/step.py around them; host.py's updates) on five
resources, each doing one thing at a time in the order it was given work. Each operation that
stands for one of the engine's `on_event` calls records it (`_Timeline.events`), and
tests/test_step_time.py holds that order against the engine's own trace of a step.

  dispatch     the Python thread: every jitted call or device_put costs `dispatch_us` (a
               layer's call per pass takes every micro-batch), and it blocks where the engine
               blocks: a fetch waits for the unit's host update (`HostState.bus`); a pass's
               retire of layer pos - 1 waits, after layer pos has been dispatched, until layer
               pos - 1's work is done on the device (never for a gradient's or an activation's
               copy out); the bench reads each step's loss, made at its head, once the next
               step is dispatched.
  h2d, d2h     the bus, each way: weights and offloaded activations in; gradients (in
               train.grad_dtype) and offloaded activations out. A copy runs beside the
               device's compute, but hides only the measured fraction of its time (the
               overlap, per direction and form, bench_transfer.py's: 1 - overlap of it the device
               loses, "copy not hidden"). Eager copies (a `device_put` of their own) start at
               their dispatch; in the jit form (engine/step.py: a layer's fetch inside the call
               `prefetch` layers before it, its gradient out inside the next layer's backward
               call) a copy starts with the call that makes it.
  device       block forward (2 FLOPs / parameter / token + causal attention over the keys each
               query sees: windows and layer types counted), block backward (the block's
               recompute and its gradients: 6 / parameter / token + 3.5x the forward's
               attention), the loss head (6 * vocab * hidden / token), the global norm.
  host update  the optimizer thread: one unit after another in the order the next forward needs
               them (the first stage's, layer 0, 1, ..., the last stage's), each once its gradient and the global norm are on
               the host (the norm needs every unit's sum of squares: exact clipping, and a
               non-finite norm must change nothing): its bytes at `host_update_gbps`, and on an
               accelerator with the jit path's update (not the direct one: engine/direct.py) the
               host thread's copies between the clients at `hop_gbps` (the gradient from the
               compute device's pinned memory to the CPU client, the new bus copy back). The next step's fetch of a unit waits for that unit's update.

With the host lookup (engine/lookup.py, where flops.host_lookup says the engine takes it) the
first stage's rows cross instead of its weights (after unit 0's update), the last stage's gradient
goes out at the loss, the rows' gradient after the backward, and the host thread takes the first
stage's backward (its bytes at the host update's rate) before unit 0's update; the step returns
once that has made the global norm.

Several steps are simulated and the last one's period is the prediction (the steady state: the
updates of one step overlap the next one's forward). "What bounds the step" is the critical path
of that period: the chain of operations, each started by the one before it, that ends the step,
with its time summed by resource. Rates are effective figures: `device_tflops` is what the
engine's kernels reach (the datasheet peak is a lower bound on time); `host_update_gbps` counts
the bytes one update touches, as scripts/bench_optimizer.py does (read and write params and optax
state, read the gradient, write the bus copy).
"""

import dataclasses
import glob
import json
import math
import os

GB = 1e9
RESOURCES = ("dispatch", "h2d", "d2h", "device", "host update")
# bench_transfer.py's rows for the engine's hop between the clients, each way
HOP_PATHS = ("pinned_host -> cpu backend, numpy view", "cpu backend -> pinned_host, numpy view")

# Defaults: an H100 SXM on PCIe 5.
# - device: the H100 SXM datasheet's dense bf16 tensor-core peak (no sparsity), a bound: a
#   measured bf16 matmul reaches less (docs/benchmarks.md, "GPU step").
# - bus: a typical measured pinned-memory copy each way on PCIe Gen5 x16 (below its paper rate);
#   the same figure as machines.MACHINES["h100"].
# - host update: the engine's fused AdamW update (30 B/param, clipping on) at all the cores of the
#   H100 host (docs/benchmarks.md, "Host update").
# - dispatch: per jitted call or device_put, an assumption (no figure measured yet): the
#   checklist measures a tiny jitted op to completion (transfer.json, small_d2h.tiny_op_ms).
# - hop: the host thread's copy between the accelerator's client and the CPU client
#   (transfer.across_clients: a numpy view of the source put on the other client, one
#   single-threaded host memcpy), as measured each way on the H100 host (docs/benchmarks.md,
#   "Transfers").
# - overlap: the fraction of a copy's time hidden under compute it runs beside, each way and
#   form, as bench_transfer.py defines it, measured on the H200 host (docs/benchmarks.md,
#   "Transfers": the eager rows and the copies made inside one jit).
# - round trip: the device idle while XLA:GPU reads a loop's predicate or a conditional's branch
#   back to the host (while_thunk.cc, conditional_thunk.cc): an estimate, the lower end of what
#   docs/long-context.md derives for the 128K step of docs/results/2026-11-27-h200-b.md.
DEFAULTS = {"h2d_gbps": 55.0, "d2h_gbps": 55.0, "device_tflops": 989.0, "host_update_gbps": 69.8,
            "hop_gbps": 9.5, "dispatch_us": 20.0, "h2d_overlap_eager": 0.36,
            "d2h_overlap_eager": 0.21, "h2d_overlap_jit": 0.92, "d2h_overlap_jit": 1.0,
            "round_trip_us": 40.0}
OVERLAPS = ("h2d_overlap_eager", "d2h_overlap_eager", "h2d_overlap_jit", "d2h_overlap_jit")
# where measured_rates reads them: bench_transfer.py's overlap rows; the host-path check's
# (section, row)
TRANSFER_OVERLAPS = (("h2d_overlap_eager", "pinned_host -> device"),
                     ("d2h_overlap_eager", "device -> pinned_host"),
                     ("h2d_overlap_jit", "pinned_host -> device (in jit)"),
                     ("d2h_overlap_jit", "device -> pinned_host (in jit)"))
HOST_PATH_OVERLAPS = (("h2d_overlap_eager", "write", "overlap P pinned_host -> device"),
                      ("d2h_overlap_eager", "write", "overlap D2H device -> pinned_host"),
                      ("h2d_overlap_jit", "injit", "overlap_value H2D pinned_host -> device"),
                      ("d2h_overlap_jit", "injit", "overlap_value D2H device -> pinned_host"))


@dataclasses.dataclass(frozen=True)
class Rates:
    """Component rates. GB = 1e9 bytes."""
    h2d_gbps: float = DEFAULTS["h2d_gbps"]
    d2h_gbps: float = DEFAULTS["d2h_gbps"]
    device_tflops: float = DEFAULTS["device_tflops"]
    host_update_gbps: float = DEFAULTS["host_update_gbps"]
    hop_gbps: float = DEFAULTS["hop_gbps"]  # bytes copied a second by the hop between clients
    dispatch_us: float = DEFAULTS["dispatch_us"]
    # the fraction of a copy's time hidden under compute (OVERLAPS): each way, eager or in a jit
    h2d_overlap_eager: float = DEFAULTS["h2d_overlap_eager"]
    d2h_overlap_eager: float = DEFAULTS["d2h_overlap_eager"]
    h2d_overlap_jit: float = DEFAULTS["h2d_overlap_jit"]
    d2h_overlap_jit: float = DEFAULTS["d2h_overlap_jit"]
    round_trip_us: float = DEFAULTS["round_trip_us"]  # each host round trip inside a jitted call

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if not valid_rate(name, value):
                what = "in [0, 1]" if name in OVERLAPS else "> 0"
                raise ValueError(f"rate {name} must be a finite number {what}, got {value}")

    def overlap(self, way: str, form: str) -> float:
        """way: "h2d" or "d2h"; form: "eager" or "jit"."""
        return getattr(self, f"{way}_overlap_{form}")


def valid_rate(name: str, value: float) -> bool:
    """A rate is a finite number > 0; dispatch_us and round_trip_us may be 0 (no cost); an
    overlap is a fraction in [0, 1]."""
    if name in OVERLAPS:
        return math.isfinite(value) and 0 <= value <= 1
    return math.isfinite(value) and (value > 0 or (name in ("dispatch_us", "round_trip_us")
                                                   and value == 0))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step moves and computes. Bytes and FLOPs; `*_flops` per micro-batch."""
    layers: int
    micro_batches: int
    prefetch: int
    tokens_per_step: int
    first_bytes: int  # the first stage's weights (embedding), in the compute dtype
    last_bytes: int  # the last stage's weights (final norm, head)
    layer_bytes: int  # one block's weights
    stages_grad_bytes: int  # gradients to the host, in train.grad_dtype: the stages' (both
    # parts merged on the device, sent after the embedding's backward as its two units') and one
    # block's
    layer_grad_bytes: int
    act_bytes: int  # one layer's saved inputs, all micro-batches, when offloaded (else 0)
    layer_fwd_flops: float  # the attention as the execution runs it (flops.executed_attention)
    layer_bwd_flops: float
    head_flops: float  # the loss head's forward and backward
    stages_update_bytes: int  # bytes the host updates of the two stage units touch
    layer_update_bytes: int  # of one layer's
    model_flops: float  # useful FLOPs per step (for MFU): flops.flops_per_token's (causal
    # attention, windows), never more than the device executes
    updates_wait_for_norm: bool = True  # the engine's schedule. False: each unit's update is
    # submitted as soon as its gradient is on the host, during the backward (no exact clipping,
    # no non-finite check: not the engine's; a what-if for hiding the update)
    head_update_bytes: int = 0  # the part of stages_update_bytes that is the last stage's own
    head_grad_bytes: int = 0  # the part of stages_grad_bytes that is the last stage's own unit's
    # (the device path: each unit's part goes out as a copy of its own)
    first_hop_bytes: int = 0  # bytes the host thread copies between the clients for a unit's
    layer_hop_bytes: int = 0  # update (its gradient in, its bus copy out to pinned memory), at
    head_hop_bytes: int = 0  # hop_gbps: the first stage's unit, a layer's, the last stage's
    # unit (final norm, untied head), updated last; the rest is the first stage's, updated first
    # The host lookup (engine/lookup.py; flops.host_lookup decides as the engine does): the
    # first stage runs on the host, its weights never cross; its rows (all micro-batches, the
    # compute dtype) cross in, their gradient (as many bytes) out, and stages_grad_bytes is the
    # last unit's gradient alone, sent at the loss. 0: the device path.
    rows_bytes: int = 0
    host_backward_bytes: int = 0  # the host thread's first-stage backward before unit 0's
    # update (HostBackward): bytes touched, at the host update's rate
    copies: str = "eager"  # the form of the layers' weights in and gradients out (engine/step.py)
    # offload.bus=ring (engine/bus.py): bytes of host memory traffic of one layer's fill, the
    # cast of its fp32 master into a ring buffer (read 4 B, write the compute dtype's) on the
    # dispatching thread before each of its two fetches a step, at the host update's rate (the
    # host's memory bandwidth). 0: resident bus copies (the update writes them instead)
    ring_fill_bytes: int = 0
    # host round trips inside one layer's forward and backward call, each micro-batch
    # (flops.host_round_trips): the device idle round_trip_us each
    layer_fwd_round_trips: int = 0
    layer_bwd_round_trips: int = 0

    @property
    def host_lookup(self) -> bool:
        return self.rows_bytes > 0

    @property
    def h2d_bytes(self) -> int:
        """Bytes into the device per step: each layer twice, the embedding twice (or its rows
        once: the host lookup), the head once, offloaded activations back for the backward."""
        first = self.rows_bytes if self.host_lookup else 2 * self.first_bytes
        return (2 * self.layers * self.layer_bytes + first + self.last_bytes
                + self.layers * self.act_bytes)

    @property
    def hop_bytes(self) -> int:
        """Bytes the host thread copies between the clients per step (the units' updates)."""
        return self.first_hop_bytes + self.layers * self.layer_hop_bytes + self.head_hop_bytes

    @property
    def d2h_bytes(self) -> int:
        """Bytes out of the device per step: every unit's gradient (the host lookup: the rows'
        gradient instead of the first stage's), offloaded activations."""
        return (self.layers * (self.layer_grad_bytes + self.act_bytes) + self.stages_grad_bytes
                + self.rows_bytes)


@dataclasses.dataclass
class Op:
    resource: str
    label: str
    step: int
    start: float
    end: float
    pred: "Op" = None  # the operation whose end this one waited for (None: time 0)


@dataclasses.dataclass
class Prediction:
    shape: StepShape
    rates: Rates
    step_s: float
    critical_s: dict  # resource -> seconds of the last step's critical path
    busy_s: dict  # resource -> seconds busy in the last step's period
    ops: list  # every operation of every simulated step
    # (step, kind, what, layer) of every simulated step: the engine's on_event calls it stands
    # for, in the order the engine makes them (updates: in the host thread's order)
    events: list = dataclasses.field(default_factory=list)

    @property
    def bound(self) -> str:
        return max(self.critical_s, key=self.critical_s.get)

    @property
    def tokens_per_s(self) -> float:
        return self.shape.tokens_per_step / self.step_s

    def mfu(self, peak_tflops: float) -> float:
        return self.shape.model_flops / self.step_s / (peak_tflops * 1e12)

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "bound": self.bound,
                "critical_path_s": self.critical_s, "busy_s": self.busy_s,
                "rates": dataclasses.asdict(self.rates), "shape": dataclasses.asdict(self.shape)}

    def report(self, peak_tflops: float = DEFAULTS["device_tflops"]) -> str:
        r = self.rates
        lines = [f"rates: bus {r.h2d_gbps:.3g} GB/s in, {r.d2h_gbps:.3g} GB/s out; device "
                 f"{r.device_tflops:.4g} TFLOP/s; host update {r.host_update_gbps:.3g} GB/s, "
                 f"hop {r.hop_gbps:.3g} GB/s; dispatch {r.dispatch_us:.3g} us",
                 f"copies: the layers' {self.shape.copies}; overlap with compute in / out: "
                 f"eager {r.h2d_overlap_eager:.2f} / {r.d2h_overlap_eager:.2f}, in a jit "
                 f"{r.h2d_overlap_jit:.2f} / {r.d2h_overlap_jit:.2f}",
                 f"predicted step: {self.step_s * 1e3:,.1f} ms, {self.tokens_per_s:,.0f} tokens/s, "
                 f"MFU {self.mfu(peak_tflops):.1%} of {peak_tflops:g} TFLOP/s; bound by "
                 f"{self.bound}",
                 f"  {'resource':<12}{'critical path':>16}{'busy':>16}"]
        for res in RESOURCES:
            cells = [f"{x[res] * 1e3:>10.1f} ms {x[res] / self.step_s:>4.0%}"
                     for x in (self.critical_s, self.busy_s)]
            lines.append(f"  {res:<12}" + "".join(cells))
        return "\n".join(lines)


class _Timeline:
    """Operations in program order on FIFO resources: an operation starts when its resource is
    free and everything it waits for has ended; the Python thread's clock moves with each call."""

    def __init__(self, rates: Rates):
        self.rates = rates
        self.last = {res: None for res in RESOURCES}  # the latest operation on each resource
        self.ops = []
        self.events = []  # (step, kind, what, layer): the engine's on_event, in program order
        self.step = 0

    def op(self, resource, label, seconds, after=()) -> Op:
        deps = [o for o in (self.last[resource], *after) if o is not None]
        pred = max(deps, key=lambda o: o.end, default=None)
        start = pred.end if pred else 0.0
        o = Op(resource, label, self.step, start, start + seconds, pred)
        self.last[resource] = o
        self.ops.append(o)
        return o

    def call(self, label, after=()) -> Op:
        """One dispatch on the Python thread, after what it waits for."""
        return self.op("dispatch", label, self.rates.dispatch_us * 1e-6, after)

    def event(self, kind, what, layer=None):
        """The engine's on_event(kind, what, layer) (StreamedEngine.on_event) that the operation
        just given stands for."""
        self.events.append((self.step, kind, what, layer))

    def h2d(self, label, nbytes, after=(), *, what) -> Op:
        """An eager copy in: dispatched once `after` is done. `what`: the engine's name of the
        copy (its on_event "transfer"; None: one it does not announce)."""
        d = self.call(label, after)
        return self._copy("h2d", "eager", label, nbytes, [d], what)

    def d2h(self, label, nbytes, after, *, what) -> Op:
        """An eager copy out, of what `after` makes."""
        d = self.call(label)
        return self._copy("d2h", "eager", label, nbytes, [d, *after], what)

    def beside(self, way, label, nbytes, call: Op, after=(), *, what) -> Op:
        """A copy made inside the jitted call `call` (a compute op): it starts with it (and
        after `after`: what it copies). The engine names it as the eager one, "in the call"."""
        return self._copy(way, "jit", label, nbytes, [o for o in (call.pred, *after) if o],
                          what and f"{what}, in the call")

    def _copy(self, way, form, label, nbytes, after, what) -> Op:
        """The copy on its bus, and the part of it not hidden under compute on the device."""
        if what:
            self.event("transfer", what)
        seconds = nbytes / (getattr(self.rates, f"{way}_gbps") * GB)
        copy = self.op(way, label, seconds, after)
        lost = (1 - self.rates.overlap(way, form)) * seconds
        if lost > 0:
            self.op("device", f"copy not hidden: {label}", lost, after[:1])
        return copy

    def compute(self, label, flops, after=(), round_trips=0) -> Op:
        d = self.call(label)
        seconds = (flops / (self.rates.device_tflops * 1e12)
                   + round_trips * self.rates.round_trip_us * 1e-6)
        return self.op("device", label, seconds, [d, *after])

    def update(self, label, nbytes, after, hop_bytes=0, unit=None, layers=0) -> Op:
        """Work on the host thread; `unit`: it is that unit's update (of a model of `layers`)."""
        d = self.call(label)
        r = self.rates
        seconds = nbytes / (r.host_update_gbps * GB) + hop_bytes / (r.hop_gbps * GB)
        if unit is not None:  # (StreamedEngine's names of the units)
            self.event("update", *(("first stage", None) if unit == 0 else
                                   ("last stage", None) if unit == layers + 1 else
                                   ("layer", unit - 1)))
        return self.op("host update", label, seconds, [d, *after])


def _stream(t: _Timeline, phase, order, fetch, carry, body, prefetch, copies):
    """A pass (`phase`: "forward" or "backward") in the order LayerStream runs it: the engine's
    interpreter of the schedule (schedule.walk). `body(layer, fetched, ahead)` dispatches a
    layer's work and returns (what its retire waits for, the copy of layer `ahead` it made in
    the jit form or None); `fetch(layer)` an eager fetch; `carry(layer)` the jit form's wait for
    what a dispatch copies, returning the layer."""
    from megatrain_jax.engine.schedule import DISPATCH, RETIRE, walk
    events = lambda kind, layer: t.event(kind, phase, layer)
    for op, work in walk(order, prefetch, copies, fetch, carry, events):
        if op == DISPATCH:
            work.done, work.carried = body(work.layer, work.payload, work.ahead)
        elif op == RETIRE:  # block_until_ready, then on
            t.call(f"wait layer {work.layer}", after=work.done)


def _step(t: _Timeline, s: StepShape, updates: list) -> Op:
    """One step; `updates[u]` is unit u's pending host update (None: none). Returns the step's
    end: the Python thread after reading the loss. Replaces `updates` with this step's."""
    M = s.micro_batches  # every call takes them all, stacked
    t.call("put batch")  # inputs and targets, one copy
    t.event("transfer", "batch in")

    def fill(u):  # the bus ring: HostState.bus casts a layer's master into a ring buffer
        if s.ring_fill_bytes and 1 <= u <= s.layers:
            t.op("dispatch", f"fill unit {u}", s.ring_fill_bytes / (t.rates.host_update_gbps * GB),
                 [updates[u]] if updates[u] else [])

    def fetch(u, nbytes):  # HostState.bus waits for the unit's update, then the put
        fill(u)
        return t.h2d(f"fetch unit {u}", nbytes, after=[updates[u]] if updates[u] else [],
                     what="weights in")

    # embed: the first stage's weights fetched, or (the host lookup) its rows gathered on the
    # host from unit 0's bus copy, once its update has finished, and put on the device
    w = (t.h2d("rows in", s.rows_bytes, after=[updates[0]] if updates[0] else [], what="rows in")
         if s.host_lookup else fetch(0, s.first_bytes))
    t.compute("embed", 0, [w])

    def carry(i):  # the jit form: HostState.bus waits for the unit's update before the call
        u = 1 + i
        t.op("dispatch", f"carry unit {u}", 0, [updates[u]] if updates[u] else [])
        fill(u)
        return i

    # forward: each layer retires on its outputs; the activations' copy out is not waited for
    def forward(i, w, ahead):
        y = t.compute(f"forward {i}", M * s.layer_fwd_flops, [w], M * s.layer_fwd_round_trips)
        copy = (None if ahead is None else
                t.beside("h2d", f"fetch unit {1 + ahead}", s.layer_bytes, y, what="weights in"))
        if s.act_bytes:
            t.d2h(f"save activations {i}", s.act_bytes, [y], what="activations out")
        return [y], copy

    _stream(t, "forward", range(s.layers), lambda i: fetch(1 + i, s.layer_bytes), carry, forward,
            s.prefetch, s.copies)

    # loss: the head's gradient stays on the device until the embedding's backward
    w = fetch(s.layers + 1, s.last_bytes)
    loss = t.compute("loss head", M * s.head_flops, [w])  # the loss made here, read a step later
    grads = {}
    if s.host_lookup:  # nothing to merge it with: the last unit's gradient goes out now
        last_sq = t.compute("last stage's squares", 0, [loss])
        grads[s.layers + 1] = t.d2h("last stage's gradient", s.stages_grad_bytes, [last_sq],
                                    what="gradient out")

    # backward: each layer retires on its sum of squares; its gradient's copy out overlaps the
    # next layer
    squares = []

    def fetch_back(i):
        w = fetch(1 + i, s.layer_bytes)
        return ([w, t.h2d(f"load activations {i}", s.act_bytes, what="activations in")]
                if s.act_bytes else [w])

    def gradient_out(u, copy):
        grads[u] = copy
        if not s.updates_wait_for_norm:  # submitted as soon as its gradient is on the host
            updates[u] = t.update(f"update unit {u}", s.layer_update_bytes, [copy],
                                  s.layer_hop_bytes, u, s.layers)

    leaving = []  # the jit form: (unit, its gradient's last compute), out in the next call

    def send(call):  # the gradient leaving, out inside `call`
        u, made = leaving.pop()
        gradient_out(u, t.beside("d2h", f"gradient {u - 1}", s.layer_grad_bytes, call, [made],
                                 what="gradient out"))

    def backward(i, inputs, ahead):
        # (its gradient zeroed, accumulated, its sum of squares and cast: all in the call)
        call = t.compute(f"backward {i}", M * s.layer_bwd_flops, inputs,
                         M * s.layer_bwd_round_trips)
        copies = None
        if ahead is not None:  # its weights and offloaded inputs, inside the call
            copies = [t.beside("h2d", f"fetch unit {1 + ahead}", s.layer_bytes, call,
                               what="weights in")]
            copies += ([t.beside("h2d", f"load activations {ahead}", s.act_bytes, call,
                                 what="activations in")] if s.act_bytes else [])
        if leaving:
            send(call)
        squares.append(call)
        if s.copies == "jit":
            leaving.append((1 + i, call))
        else:
            gradient_out(1 + i, t.d2h(f"gradient {i}", s.layer_grad_bytes, [call],
                                      what="gradient out"))
        return [call], copies

    _stream(t, "backward", reversed(range(s.layers)), fetch_back, carry, backward, s.prefetch,
            s.copies)

    if s.host_lookup:  # the rows' gradient and the device's scalars out; the first stage's
        # backward and the global norm on the host thread, before unit 0's update; the step
        # returns once the norm is made
        if leaving:  # no device function runs after it: layer 0's gradient goes out eagerly
            u, made = leaving.pop()
            gradient_out(u, t.d2h(f"gradient {u - 1}", s.layer_grad_bytes, [made],
                                  what="gradient out"))
        rows_grad = t.d2h("rows' gradient", s.rows_bytes, [t.last["device"]],
                          what="gradient out")
        scalars = t.d2h("squares", 0, [t.compute("squares total", 0, squares)], what=None)
        norm = grads[0] = t.update("first stage's backward", s.host_backward_bytes,
                                   [rows_grad, scalars])
    else:  # the embed backward; the stages' gradient merged and its sum of squares, the global
        # norm, on the device; the norm and the stages' gradient (each unit's part) go out, made
        # in pinned memory by that call in the jit form
        w = fetch(0, s.first_bytes)
        embed_bwd = t.compute("embed backward", 0, [w])
        if leaving:  # layer 0's gradient, out inside the call
            send(embed_bwd)
        # one call: the stages' gradient merged, its sum of squares, the global norm
        merged = t.compute("stages' gradient and the global norm", 0, [embed_bwd, *squares])

        def out(label, nbytes, what):
            if s.copies == "jit":
                return t.beside("d2h", label, nbytes, merged, [merged], what=what)
            return t.d2h(label, nbytes, [merged], what=what)

        norm = out("global norm", 0, None)
        grads[0] = out("stages' gradient, unit 0", s.stages_grad_bytes - s.head_grad_bytes,
                       "gradient out")
        grads[s.layers + 1] = out(f"stages' gradient, unit {s.layers + 1}", s.head_grad_bytes,
                                  "gradient out")

    # update, on the host thread, in the order the next forward needs them: the first stage's
    # unit, the layers, the last stage's
    nbytes = {0: s.stages_update_bytes - s.head_update_bytes, s.layers + 1: s.head_update_bytes}
    hops = {0: s.first_hop_bytes, s.layers + 1: s.head_hop_bytes}
    for u in range(s.layers + 2) if s.updates_wait_for_norm else [0, s.layers + 1]:
        after = [grads[u], norm] if s.updates_wait_for_norm else [grads[u]]
        updates[u] = t.update(f"update unit {u}", nbytes.get(u, s.layer_update_bytes), after,
                              hops.get(u, s.layer_hop_bytes), u, s.layers)
    if s.host_lookup:
        t.call("wait for the norm", after=[norm])
    # the bench's float(loss), the step's sync point: the loss, made at the head, read once the
    # next step is dispatched (here: after this step's dispatching, which its retires bound)
    return t.call("read loss", after=[loss])


def simulate(shape: StepShape, rates: Rates, steps: int = 4) -> Prediction:
    """Runs `steps` steps back to back; the prediction is the last one's period."""
    t = _Timeline(rates)
    updates = [None] * (shape.layers + 2)
    ends = []
    for k in range(steps):
        t.step = k
        ends.append(_step(t, shape, updates))
    begin, end = ends[-2].end, ends[-1].end
    critical = dict.fromkeys(RESOURCES, 0.0)
    op = ends[-1]
    while op is not None and op.end > begin:
        critical[op.resource] += op.end - max(op.start, begin)
        op = op.pred
    busy = dict.fromkeys(RESOURCES, 0.0)
    for o in t.ops:
        busy[o.resource] += max(0.0, min(o.end, end) - max(o.start, begin))
    return Prediction(shape, rates, end - begin, critical, busy, t.ops, t.events)


# -----------------------------------------------------------------------------
# the shape of a configured step


def step_shape(cfg, offload: bool, updates_wait_for_norm: bool = True,
               devices: int = 0, bus: str = "", execution=None) -> StepShape:
    """The shape of one step of `cfg` on an accelerator (`offload`: activations offloaded) of a
    machine with `devices` of them (0: unknown, 1 assumed: flops.local_devices), its layers' bus
    copies kept as `bus` ("resident" or "ring"; "": offload.bus, auto taken as resident: the
    plan resolves auto), computing `execution` (the plan's: its attention fits; None: the rule's
    on a GPU)."""
    # lazy: jax and the model (`megatrain --help` stays quick)
    from megatrain_jax.flops import (counts, executed_attention, flops_per_token, host_lookup,
                                     host_round_trips)
    from megatrain_jax.machines import MACHINES
    from megatrain_jax.recipes import build_optimizer, execution_for, host_lookup_setting
    execution = execution or execution_for(cfg, "gpu")[0]
    c = counts(cfg, execution, dataclasses.replace(MACHINES["h100"], devices=devices),
               optimizer=build_optimizer(cfg.optimizer, cfg.train.steps),
               lookup_setting=host_lookup_setting(cfg))
    model, (M, B, T) = cfg.model, (cfg.data.micro_batches, cfg.data.batch_size, cfg.data.seq_len)
    tokens = B * T  # per micro-batch
    head = model.hidden_size * model.vocab_size
    useful = flops_per_token(model, T)  # causal attention over the keys each query sees
    # one layer's attention as it runs, on average over the layers: its forward call's, its
    # backward call's (recompute and VJP)
    attention_fwd, attention_bwd = executed_attention(model, execution, T)
    round_trips = host_round_trips(model, execution, T)
    params = c.stages + c.layers * c.layer
    opt_per_param = c.optimizer / params  # bytes of optax state per parameter (AdamW: 8)
    # params read and written, optax state read and written, the gradient read, the bus copy
    # written (bench_optimizer.py's count); on an accelerator the jit path's host thread also
    # copies, at hop_gbps, the gradient from the compute device's pinned memory to the CPU client
    # and the new bus copy back to pinned memory (transfer.across_clients); the direct update
    # (engine/direct.py) reads and writes them where they are: no hop
    ring = (bus or cfg.offload.bus) == "ring"
    touched = lambda n: n * (8 + 2 * opt_per_param + c.grad + c.compute)
    # a layer's update with the bus ring writes no bus copy: its fills cast one instead
    layer_touched = touched(c.layer) - ring * c.layer * c.compute
    hop = lambda n: n * (c.grad + c.compute) if c.accelerator and not c.direct else 0
    lookup = host_lookup(c, tokens)
    rows = M * tokens * c.hidden * c.compute if lookup else 0
    # the host lookup's first stage backward (HostBackward), as scripts/bench_lookup.py measured
    # it: the table's fp32 gradient written once (zeroed); each micro-batch's scatter-add, in
    # place in that gradient (XLA:CPU aliases the donated accumulator), touches the rows alone:
    # their gradient read, cast to an fp32 copy (written, read), the table's rows it adds to
    # read and written; then unit 0's gradient: the accumulator itself in fp32 (donated), else
    # cast (read, written in train.grad_dtype); and read for its sum of squares. Unit 0's
    # gradient is then made on the host and its bus copy stays there (the lookup reads it): no
    # hop between clients in its update
    rows_scatter = M * tokens * c.hidden * (c.compute + 4 + 4 + 8)
    cast = 0 if c.grad == 4 else 4 + c.grad
    host_backward = rows_scatter + c.first * (4 + cast + c.grad) if lookup else 0
    first_update = touched(c.first)
    last_unit = c.stages - c.first
    return StepShape(
        layers=c.layers, micro_batches=M, prefetch=c.prefetch, tokens_per_step=M * tokens,
        first_bytes=c.first * c.compute, last_bytes=c.last * c.compute,
        layer_bytes=c.layer * c.compute,
        stages_grad_bytes=(last_unit if lookup else c.stages) * c.grad,
        head_grad_bytes=0 if lookup else last_unit * c.grad,
        layer_grad_bytes=c.layer * c.grad,
        act_bytes=M * tokens * c.hidden * c.compute if offload else 0,
        layer_fwd_flops=tokens * (2 * c.layer + attention_fwd),
        layer_bwd_flops=tokens * (6 * c.layer + attention_bwd),
        layer_fwd_round_trips=round_trips[0], layer_bwd_round_trips=round_trips[1],
        head_flops=tokens * 6 * head,
        stages_update_bytes=int(first_update + touched(last_unit)),
        layer_update_bytes=int(layer_touched), head_update_bytes=int(touched(last_unit)),
        first_hop_bytes=0 if lookup else int(hop(c.first)),
        layer_hop_bytes=int(hop(c.layer) and hop(c.layer) - ring * c.layer * c.compute),
        head_hop_bytes=int(hop(last_unit)),
        model_flops=float(useful * M * tokens),
        updates_wait_for_norm=updates_wait_for_norm, rows_bytes=rows,
        host_backward_bytes=int(host_backward), copies=c.copies,
        ring_fill_bytes=ring * c.layer * (4 + c.compute))


def executed_flops(shape: StepShape) -> float:
    """FLOPs the device executes in one step (recompute included): the simulation's count."""
    return shape.micro_batches * (shape.layers * (shape.layer_fwd_flops + shape.layer_bwd_flops)
                                  + shape.head_flops)


# -----------------------------------------------------------------------------
# measured rates


def _load_results(path: str) -> list:
    """(file name, object) of every JSON file in `path` (a folder), or of the file itself."""
    files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    out = []
    for f in files:
        with open(f) as fh:
            try:
                out.append((f, json.load(fh)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}: not JSON ({e})") from None
    return out


def measured_rates(path: str, shape: StepShape = None) -> tuple:
    """(rates, {rate: where it came from}, the bench record matching `shape` or None) from the
    results a GPU checklist part wrote in `path`: a folder of the benchmarks' JSON, or one JSON
    file with a "rates" object (a step-time prediction written with --json). A rate no result
    gives keeps its default (said so in its source).

    h2d / d2h: bench_transfer.py's `pinned_host -> device` and `device -> pinned_host` rows, the
    engine's own paths (engine/transfer.py). device: the FLOPs the engine's device functions execute in a step / their
    time run back to back with no transfers (bench.py's resident_compute_s_per_step), else
    bench.py's measured matmul. host update: bench_optimizer.py's update_gb_s, else bench.py's
    host-update seconds per step less the hop's time. hop: the slower of bench_transfer.py's two
    numpy-view rows between the clients (HOP_PATHS). dispatch: bench_transfer.py's tiny jitted
    op to completion. overlaps: bench_transfer.py's overlap rows (TRANSFER_OVERLAPS), or the
    host-path check's (HOST_PATH_OVERLAPS). Raises ValueError where no rate comes from `path`:
    a prediction that said it used measured rates would be of the defaults."""
    values, sources, bench = dict(DEFAULTS), {k: "default" for k in DEFAULTS}, None
    results = _load_results(path)
    for f, r in results:
        if isinstance(r, dict) and isinstance(r.get("rates"), dict):
            for k in DEFAULTS:
                if k in r["rates"]:
                    values[k] = float(r["rates"][k])
                    sources[k] = f"{f} ({r.get('rate_sources', {}).get(k, 'rates')})"
    by_kind = lambda kind: [(f, r) for f, r in results if isinstance(r, dict)
                            and r.get("kind") == kind]
    for f, r in by_kind("transfer")[:1]:
        paths = {p["path"]: p for p in r.get("paths", [])}
        for key, row in (("h2d_gbps", "pinned_host -> device"), ("d2h_gbps", "device -> pinned_host")):
            if paths.get(row, {}).get("gb_per_s"):
                values[key], sources[key] = paths[row]["gb_per_s"], f"{f}: {row}"
        hops = [(paths[row]["gb_per_s"], row) for row in HOP_PATHS
                if paths.get(row, {}).get("gb_per_s")]
        if hops:  # the slower way: a unit's update waits for both
            values["hop_gbps"], row = min(hops)
            sources["hop_gbps"] = f"{f}: {row}"
        tiny = (r.get("small_d2h") or {}).get("tiny_op_ms")
        if tiny:
            values["dispatch_us"], sources["dispatch_us"] = tiny * 1e3, f"{f}: tiny jitted op"
    for f, r in results:  # the host-path check's JSON: its eager rows (`write`), `injit`
        sections = r.get("sections") if isinstance(r, dict) and not r.get("fake") else None
        for key, section, row in HOST_PATH_OVERLAPS if isinstance(sections, dict) else ():
            value = (sections.get(section) or {}).get(row)
            if value is not None:  # a number, or a line that starts with it
                values[key] = float(value if isinstance(value, (int, float)) else
                                    str(value).split()[0])
                sources[key] = f"{f}: {section}, {row}"
    for f, r in by_kind("transfer")[:1]:  # bench_transfer.py's overlap rows
        rows = (r.get("overlap") or {}).get("paths") or {}
        for key, row in TRANSFER_OVERLAPS:
            if "overlap" in rows.get(row, {}):
                values[key], sources[key] = rows[row]["overlap"], f"{f}: overlap, {row}"
    benches = by_kind("train")
    if shape is not None:  # the bench of the same step (its tokens), if there is one
        bench = next(((f, r) for f, r in benches
                      if r.get("tokens_per_step") == shape.tokens_per_step), None)
    f, r = bench or (benches[0] if benches else (None, None))
    if r is not None:
        s = r["streamed"]
        if s.get("resident_compute_s_per_step") and bench is not None:
            values["device_tflops"] = executed_flops(shape) / s["resident_compute_s_per_step"] / 1e12
            sources["device_tflops"] = f"{f}: executed FLOPs / resident compute time"
        elif r.get("matmul_peak", {}).get("tflops"):
            values["device_tflops"] = r["matmul_peak"]["tflops"]
            sources["device_tflops"] = f"{f}: measured matmul"
    optimizers = [(f, r) for f, r in results if isinstance(r, dict) and "update_gb_s" in r]
    if optimizers:
        f, r = max(optimizers, key=lambda fr: fr[1].get("threads", 0))  # all cores, as the engine
        values["host_update_gbps"] = r["update_gb_s"]
        sources["host_update_gbps"] = f"{f}: update_gb_s ({r.get('threads')} threads)"
    elif bench is not None and bench[1]["streamed"].get("host_update_s_per_step"):
        s = bench[1]["streamed"]
        # the update's own work where the bench counted it apart from its waits for gradients
        # and the norm (host_compute_s_per_step); else the host thread's time less the hop's
        own = s.get("host_compute_s_per_step")
        seconds = own or (s["host_update_s_per_step"]
                          - shape.hop_bytes / (values["hop_gbps"] * GB))
        total = (shape.stages_update_bytes + shape.layers * shape.layer_update_bytes
                 + shape.host_backward_bytes)
        if seconds > 0:
            values["host_update_gbps"] = total / seconds / GB
            sources["host_update_gbps"] = (
                f"{bench[0]}: the host update's own work per step (in the run)" if own else
                f"{bench[0]}: host update seconds per step (in the run), less the hop's")
    if all(source == "default" for source in sources.values()):
        raise ValueError(f"no rate in it ({len(results)} JSON file{'s' * (len(results) != 1)}, "
                         f"none a result of the GPU checklist's benchmarks nor a step-time "
                         f"prediction with rates): give the folder scripts/gpu_checklist.py "
                         f"wrote, or leave --rates out for the defaults")
    return Rates(**values), sources, bench[1] if bench else None


def resolve_rates(machine, overrides: dict, results: str | None = None,
                  shape: StepShape = None) -> tuple:
    """(rates, {rate: where it came from}, a bench.py record of the same step or None), each
    source over the one before: the defaults, the machine's bus and bf16 peak (a
    megatrain_jax.machines.Machine; none from one with no known peak), the measured results in
    `results` (measured_rates), then `overrides`, {rate: (value, source)} (a command's flags)."""
    rates, sources, bench = dict(DEFAULTS), {k: "default" for k in DEFAULTS}, None
    if machine.bf16_tflops > 0:  # the preset's bus and peak
        for key, value in (("h2d_gbps", machine.host_device_gbps),
                           ("d2h_gbps", machine.host_device_gbps),
                           ("device_tflops", machine.bf16_tflops)):
            rates[key], sources[key] = value, f"machine {machine.name}"
    if results:
        measured, measured_sources, bench = measured_rates(results, shape)
        for key, source in measured_sources.items():
            if source != "default":
                rates[key], sources[key] = getattr(measured, key), source
    for key, (value, source) in overrides.items():
        rates[key], sources[key] = value, source
    return Rates(**rates), sources, bench


def compare(prediction: Prediction, bench: dict) -> dict:
    """The prediction against a bench.py record of the same step: the step, and the figures
    bench.py measures that the simulation also gives (device busy fraction, host-update seconds
    per step, the bus's achieved GB/s over the step)."""
    s, p = bench["streamed"], prediction
    h2d, d2h = p.shape.h2d_bytes, p.shape.d2h_bytes
    pairs = {"step_s": (p.step_s, s["step_s"]),
             "device_busy": (p.busy_s["device"] / p.step_s, s.get("device_busy")),
             "host_update_s_per_step": (p.busy_s["host update"], s.get("host_update_s_per_step")),
             "h2d_gb_per_s": (h2d / p.step_s / GB, s.get("h2d_gb_per_s")),
             "d2h_gb_per_s": (d2h / p.step_s / GB, s.get("d2h_gb_per_s"))}
    return {"predicted": {k: v[0] for k, v in pairs.items()},
            "measured": {k: v[1] for k, v in pairs.items()},
            "predicted_over_measured": p.step_s / s["step_s"]}
