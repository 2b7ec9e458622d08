"""Forward-only evaluation: the loss of M micro-batches at the current weights.

    embed     fetch the first stage's weights; x_0[m] = first(inputs[m])
    forward   for layer i (weights prefetched, at most prefetch + 1 resident, as in a step):
                x_{i+1}[m] = block_i(x_i[m]); x_i[m] is freed once layer i is done
    loss      fetch the last stage's weights; loss_sum[m], weight[m] = last(x_L[m])
              (`outputs`: any output(last, x_L[m], targets[m]) instead, e.g. per-sequence
              log-probabilities of a frozen model)

The loss is the last stage's alone: a block's auxiliary statistics (a mixture of experts'
load balancing) are dropped, so a MoE model's evaluation loss is its language-model loss.
No gradient, no saved activations, no optimizer state: the params and optax state are only read.
Each unit is fetched once its pending host update (of the step before) has finished, so the loss is
that of the weights after every step so far. It reuses the step's jitted embed and block forward
(and `head_loss`, compiled at the first evaluation), so nothing compiles after the first.
"""

import jax

from megatrain_jax.engine.schedule import EAGER
from megatrain_jax.engine.step import StepParts


def _forward(sp: StepParts, inputs, contexts):
    """x_L[m] for every micro-batch (stacked): the embedding and every block, streamed, forward
    only, one call per layer."""
    f = sp.functions

    # ---- embed
    xs = sp.first.forward(sp, inputs)

    # ---- forward: each layer's input is freed once its output is computed
    stream = sp.stream(range(sp.num_layers), copies=EAGER)
    for i, w in stream:
        ys, _ = stream.call(f.layer_fwd, ((w, sp.constants[i]), xs, contexts))  # aux: not
        # evaluated (a jitted identity may hand its input back)
        stream.done(ys, (sp.fetched(w), () if ys is xs else xs))
        xs = ys
    return xs


def run(sp: StepParts, inputs, targets, contexts) -> dict:
    """{"loss_sum", "weight", "loss"} (and "stats" when the last stage returns them, summed)
    over M micro-batches stacked on the device; scalars still being computed.
    loss = sum(loss_sum) / sum(weight), as a training step's loss."""
    xs = _forward(sp, inputs, contexts)

    # ---- loss
    w = sp.fetch_stage("last")
    loss, loss_sum, weight, stats = sp.functions.head_loss(w, xs, targets)
    sp.delete((sp.fetched(w), xs))
    result = {"loss_sum": loss_sum, "weight": weight, "loss": loss}
    if stats is not None:
        result["stats"] = stats
    return sp.placement.local(result)


def outputs(sp: StepParts, inputs, targets, contexts, output) -> list:
    """[output(last, x_L[m], targets[m]) for every micro-batch m]: the streamed forward, then any
    function of the last stage (e.g. per-sequence log-probabilities) instead of its loss, in one
    call over the micro-batches."""
    xs = _forward(sp, inputs, contexts)
    w = sp.fetch_stage("last")
    out = sp.functions.head_output(output)(w, xs, targets)
    sp.delete((sp.fetched(w), xs))
    return [jax.tree.map(lambda a: a[m], out) for m in range(len(inputs))]
