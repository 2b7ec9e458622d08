"""The streamed-layer engine: host-resident training state, the GPU as a transient compute engine.

The engine trains any model of the form `last(block_{L-1}(... block_0(first(inputs)))), targets)`
where every block has the same structure. It knows nothing about the model inside the blocks.
State lives in host memory, one *unit* at a time: unit 0 holds the first stage's variables (a
tied embedding too: tied weights stay one leaf), unit 1 + i layer i, the last unit the last
stage's own; the host thread updates them in that order, the one the next forward needs.

Modules, by concern:
  streamed.py   StreamedEngine: construction, train_step, evaluate, reading and loading state
  step.py       one step, top to bottom, from what it is given (StepParts)
  step_host.py  StepHost: what a step asks of the host state (a Protocol HostState satisfies),
                the only host-side name step.py, evaluate.py and lookup.py use
  schedule.py   the order of a pass's fetches, dispatches and waits (and the step's around them),
                written once, with its one interpreter (walk): executed by stream.py, simulated
                by step_time, read by plan
  transfer.py   every host<->device copy of the step (weights, batch, activations, gradients),
                eager or made inside the jitted calls (the copies' form)
  packing.py    how a unit's bus copy, fetch and gradient travel: a layer's as one flat array
                (its leaves end to end at aligned offsets, split inside the jitted calls), the
                stages' and the sharded layout's leaf by leaf; decided in one place
  evaluate.py   forward only: the loss at the current weights, or any function of the last
                stage (forward_outputs, e.g. per-sequence log-probs)
  decode.py     StreamedDecoder: forwards that carry a per-layer state (a KV cache), to generate
  stream.py     a pass run to the schedule with back-pressure, activation offload, counters;
                the copies' form owned by its LayerStream (call, send)
  host.py       HostState, the coordinator of the three owners below: the thread that runs
                each unit's host update, in order, its futures and its failures
  update.py     every host update behind one interface (apply), chosen once: the fused AdamW
                called directly (direct.py), the fused AdamW in a jit (through jax.ffi), or
                optax in a jit; the non-finite skip and the timing once
  direct.py     the fused AdamW kernel called directly on store.py's numpy state, each
                gradient read where it lies, the bus copy's cast written through bus.py's
                pointers (copy-on-write while a reader's lease lives)
  fused_adamw.py  the project's AdamW (`adamw`: optax.adamw, marked for the fused update) and its
                kernel (fused_adamw.cc, built on first use; a JAX fallback, bit for bit)
  store.py      every unit's state and its layout (Unit, Layout, UnitArrays and its readers'
                leases); where it lives between updates: RAM, the direct update's buffers, or
                the disk tier
  bus.py        every bus copy and every write of it, the one writer (Buses): the weights
                themselves, a host buffer rewritten in place, or the accelerator's pinned
                memory through a staging buffer; or (bus="ring") the layers' in a ring of
                buffers, each filled before its fetch
  tier.py       the disk tier: each unit's master weights and optax state in a file
  functions.py  the jitted device functions
  parallel.py   placement: one device, or data parallel over a mesh of devices and processes
  shard.py      the sharded host layout: which rows of every leaf a process keeps
  stage_units.py  the stages' two units, split from and merged into a checkpoint's one; what a
                streamed module holds: its params, and a block's Constants
  lookup.py     the first stage's way, chosen once: on the device, or the host lookup (an untied
                embedding's rows gathered on the host, its table never crossing; the rows'
                gradient scatter-added into the table's there)
"""

from megatrain_jax.engine.decode import StreamedDecoder
from megatrain_jax.engine.stage_units import Constant
from megatrain_jax.engine.stream import Counters
from megatrain_jax.engine.streamed import StreamedEngine

__all__ = ["Constant", "Counters", "StreamedDecoder", "StreamedEngine"]
