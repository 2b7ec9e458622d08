"""Loss spikes, and the checkpoint kept from before one.

A step's loss is that of the weights before its update, so it judges the checkpoint that holds
those weights (the last one written, if no update came after it): the checkpoint is healthy when
the loss is normal and the gradient finite (a step skipped for a non-finite gradient proves
nothing of its weights: an update diverging into them can leave a loss that looks normal, such
as ln(vocabulary) from weights that make every logit equal). A loss above SPIKE_RATIO x the
median of the last SPIKE_WINDOW normal losses starts a spike, which lasts until a loss is back
within their range (at most the largest of them): a diverging run's losses swing, and one that
dips under the threshold between two that do not says nothing good of its weights. The last
healthy checkpoint is kept out of checkpoint.keep's rotation (checkpoint.keep_out_of_rotation)
until a newer one proves healthy, so a run that diverges through finite steps (a learning rate
far too high: every step saved, keep 3) still holds a checkpoint to go back to, and the lines
that advise a resume name it.

The running median rather than the run's best loss: one batch's loss is noisy and falls fast early
in a run. The median of the recent normal losses follows that fall and no single lucky batch
lowers it, whereas the best loss so far is such a lucky batch, which ordinary noise later in the
run exceeds by a large ratio (most of all a loss near 0, as DPO's gets). Spikes stay out of the
window, so a divergence never becomes the normal it is measured against.
"""

import math
import statistics

from megatrain_jax import checkpoint

SPIKE_RATIO = 3.0
SPIKE_WINDOW = 16


class Spikes:
    """The losses a run judges against and the checkpoint it keeps, for one manager's
    checkpoints. A checkpoint's meta holds `state()`: a run resumed from it (`progress`, its
    meta's, and `step`, its step) goes on judging against the same losses and keeps the same
    checkpoint (one written before this was recorded starts with neither)."""

    def __init__(self, manager, progress: dict | None = None, step: int | None = None):
        progress = progress or {}
        self.manager = manager
        self.normal = list(progress.get("normal_losses", []))  # the last SPIKE_WINDOW normal
        self.healthy = progress.get("healthy_checkpoint")  # the last step a normal loss judged
        self.holding = step  # the checkpoint holding the current weights (None: updated since)
        self.spiking = False  # the last finite loss was a spike
        checkpoint.keep_out_of_rotation(manager, self.healthy)

    def state(self) -> dict:
        return {"normal_losses": self.normal, "healthy_checkpoint": self.healthy}

    def observe(self, step: int, loss: float, updated: bool) -> str | None:
        """Judges step `step`'s loss (`updated`: the step applied its update, it was not skipped);
        returns the line of a spike's first step, else None."""
        judged, was_spiking = self.holding, self.spiking
        if updated:
            self.holding = None
        if not math.isfinite(loss):
            return None
        median = statistics.median(self.normal) if self.normal else math.inf
        self.spiking = loss > (max(self.normal) if was_spiking else SPIKE_RATIO * median)
        if self.spiking:
            return None if was_spiking else (
                f"step {step:5d} | loss {loss:.4f} is over {SPIKE_RATIO:g}x the median of the "
                f"last {len(self.normal)} normal losses ({median:.4f}): {self.advice()}")
        if not updated:  # a non-finite gradient: neither the loss nor the weights shown normal
            return None
        self.normal = (self.normal + [loss])[-SPIKE_WINDOW:]
        if judged is not None and judged != self.healthy:
            self.healthy = judged
            checkpoint.keep_out_of_rotation(self.manager, judged)
        return None

    def saved(self, step: int):
        """Checkpoint `step` now holds the current weights."""
        self.holding = step

    def advice(self) -> str:
        """Where to go back to after a spike, and how."""
        if self.healthy is None:
            return ("no checkpoint of this run is known to give a normal loss; if the loss does "
                    "not come back down, start again with a lower optimizer.learning_rate")
        return (f"checkpoint step {self.healthy}, the last whose weights gave a normal loss, is "
                f"kept out of checkpoint.keep's rotation; to go back to it, move the checkpoints "
                f"after step {self.healthy} out of {self.manager.directory} and run again with a "
                f"lower optimizer.learning_rate and checkpoint.allow_changes=[optimizer] (or "
                f"check the data)")
