"""`StreamedDecoder`: forward passes that carry a per-layer state from one call to the next (a KV
cache), for generation, with the layers' weights streamed from host memory as in a training step.

    decoder = StreamedDecoder(first=embed, last=head, make_block=make_block, num_layers=L,
                              start=lambda block, x: block.prefill(x, max_len),
                              extend=lambda block, x, state, position: block.decode(x, state,
                                                                                    position),
                              logits=lambda last, x: last.logits(x))
    logits = decoder.start(prompt)      # (B, T) token ids -> (B, V) logits of the last position
    logits = decoder.extend(tokens)     # (B, 1) ids at the next position -> (B, V)

One forward, top to bottom:
    first   on the host, with its host copy: a lookup, so its output (B, T, D) crosses the bus
            instead of its table
    layers  for layer i (weights prefetched, at most prefetch + 1 layers resident, LayerStream):
              x, state_i = start(block_i, x)   or   extend(block_i, x, state_i, position)
    head    fetch the part of the last stage `logits` reads; the logits of the last position

The engine knows nothing of the model: `start`, `extend` and `logits` are the model's. The states
stay on the compute device (donated to `extend`, so a fixed-size cache is updated in place); every
weight crosses the bus once per forward, i.e. per generated token. One compiled function per
shape: `start` per prompt length, `extend` once (the position is data, not a shape).
"""

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from megatrain_jax.engine import bus as bus_lib
from megatrain_jax.engine import transfer
from megatrain_jax.engine.functions import merge_part, stage_parts
from megatrain_jax.engine.parallel import Placement
from megatrain_jax.engine.stage_units import param_split, stages_split
from megatrain_jax.engine.stream import Counters, LayerStream, delete


class StreamedDecoder:
    """Generation-time forwards of `last(blocks(first(tokens)))` with per-layer state.

    Args:
      first, last, make_block, num_layers: as for StreamedEngine (blocks of one structure, built
        once each, under the host device). Only their weights are kept, in `compute_dtype`: the
        fp32 arrays the modules hold are dropped layer by layer.
      start: `start(block, x) -> (y, state)`, a block over a prompt, returning its state.
      extend: `extend(block, x, state, position) -> (y, state)`, a block over the next token(s)
        at `position` (an int32 scalar), returning its updated state.
      logits: `logits(last, x) -> (B, T, V)`, the last stage's scores.
      prefetch: layers whose weights are in flight ahead of the computing one.
      compute_device / host_device: where blocks run / where the weights wait (defaults: the
        default device, the first CPU device).
    """

    def __init__(self, *, first: nnx.Module, last: nnx.Module,
                 make_block: Callable[[int], nnx.Module], num_layers: int, start: Callable,
                 extend: Callable, logits: Callable, compute_dtype=jnp.bfloat16, prefetch: int = 1,
                 compute_device=None, host_device=None):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.num_layers, self.prefetch = num_layers, prefetch
        self.compute_device = compute_device or jax.devices()[0]
        self.host_device = host_device or jax.devices("cpu")[0]
        self.placement = Placement([self.compute_device])
        self.compute = self.placement.weights
        self.counters = Counters()
        self.transfers = transfer.Transfers(self.placement, self.host_device, self.counters)
        host = self.transfers.host_sharding
        self.bus_sharding = bus_lib.sharding(self.compute_device, self.host_device)  # as HostState
        self.on_layer = None  # on_layer(layer) after each layer's work is dispatched (tests)
        dtype = jnp.dtype(compute_dtype)
        cast = lambda tree, where: bus_lib.copy_of(tree, dtype, where)

        with jax.default_device(self.host_device):
            stages_def, stages = stages_split((first, last))
            self.layers, self.constants = [], []  # the Constants stay on the compute device
            for i in range(num_layers):
                graphdef, params, constants = param_split(make_block(i), f"block {i}")
                if i == 0:
                    block_def = graphdef
                elif graphdef != block_def:
                    raise ValueError(f"block {i} differs in structure from block 0")
                self.layers.append(cast(params, self.bus_sharding))
                self.constants.append(jax.device_put(constants, self.compute))
                del params
        leaves, treedef = jax.tree.flatten(stages)
        parts = stage_parts(stages_def, stages, jax.ShapeDtypeStruct((1, 1), jnp.int32),
                            head=logits)
        self.first_weights = cast(parts.take("first", leaves), host)
        self.head_weights = cast(parts.take("last", leaves), self.bus_sharding)
        del stages, leaves
        merge = lambda part, w: merge_part(stages_def, treedef, getattr(parts, part), w)

        self._first = jax.jit(lambda w, tokens: merge("first", w)[0](tokens))
        self._logits = jax.jit(lambda w, x: logits(merge("last", w)[1], x[:, -1:])[:, 0])
        self._start = jax.jit(lambda w, k, x: start(nnx.merge(block_def, w, k), x))
        self._extend = jax.jit(
            lambda w, k, x, state, position: extend(nnx.merge(block_def, w, k), x, state,
                                                    position),
            donate_argnums=(3,))
        self.states, self.position = None, 0

    def start(self, tokens) -> jax.Array:
        """Runs the prompt `tokens` (B, T) from position 0, replacing every layer's state;
        returns the logits of its last position, (B, V) fp32."""
        self.states = [None] * self.num_layers
        logits = self._forward(tokens, lambda i, w, x: self._start(w, self.constants[i], x))
        self.position = jnp.shape(tokens)[1]
        return logits

    def extend(self, tokens) -> jax.Array:
        """Runs `tokens` (B, 1) at the position after the last one run; returns their logits,
        (B, V) fp32."""
        if self.states is None:
            raise ValueError("extend before start: there is no state to extend")
        position = jax.device_put(jnp.asarray(self.position, jnp.int32), self.compute)
        logits = self._forward(tokens, lambda i, w, x: self._extend(
            w, self.constants[i], x, self.states[i], position))
        self.position += jnp.shape(tokens)[1]
        return logits

    def _fetch(self, unit: int):
        return self.transfers.weights_in(self.layers[unit] if unit < self.num_layers else
                                         self.head_weights)

    def _forward(self, tokens, run_layer):
        tokens = self.transfers.batch_to_host(jnp.asarray(tokens, jnp.int32))
        x, = self.transfers.rows_in([self._first(self.first_weights, tokens)])
        fetched = (lambda w: w) if self.bus_sharding != self.compute else (lambda w: ())
        logits = None
        stream = LayerStream(range(self.num_layers + 1), self._fetch, self.prefetch)
        for i, w in stream:  # the layers, then the head
            if i == self.num_layers:
                logits = self._logits(w, x)
                stream.done(logits, fetched(w))
                continue
            x, self.states[i] = run_layer(i, w, x)
            stream.done(x, fetched(w))
            if self.on_layer is not None:
                self.on_layer(i)
        delete(x)
        return logits
