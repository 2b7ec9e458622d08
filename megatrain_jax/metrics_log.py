"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

    sinks = Sinks.open(cfg, start_step, log)   # what cfg.logging asks for and is installed
    sinks.write(record)                          # every numeric field of a step's record
    sinks.close()

TensorBoard: event files under <run_dir>/tb (tensorboardX, the extra `tensorboard`), on by default
when the package is there (`logging.tensorboard`). A resumed run marks its first step as a purge
point, so TensorBoard drops what a killed run logged after the checkpoint, as metrics.jsonl does.
Weights & Biases (`logging.wandb: true`, the extra `wandb`): the run's config and metrics, with
`logging.wandb_mode: offline` written under <run_dir>/wandb with no network (`wandb sync` uploads
it later); a resumed run continues the same W&B run (its id is kept in <run_dir>/wandb_run_id).

Scalars are named `train/<field>` and, for the evaluation's fields (`eval_loss`, `eval_ppl`),
`eval/<loss|ppl>`.
"""

import math
import os

from megatrain_jax.config import Config, ConfigError, to_dict


def scalars(record: dict) -> dict:
    """{TensorBoard/W&B name: float} for every numeric field of a metrics record but `step`."""
    out = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float)):
            continue
        name = f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"
        out[name] = float(value)
    return out


def check(cfg: Config):
    """Refuses logging.wandb=true without the wandb package, before the run writes anything."""
    if cfg.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("logging.wandb=true needs the wandb package: pip install "
                              "'megatrain-jax[wandb]' (or set logging.wandb=false)") from None


class Sinks:
    """The open writers of a run (none, TensorBoard, W&B or both)."""

    def __init__(self, tensorboard=None, wandb_run=None):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @classmethod
    def open(cls, cfg: Config, start_step: int, log=print) -> "Sinks":
        tensorboard = wandb_run = None
        if cfg.logging.tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                log("tensorboard: not written (pip install 'megatrain-jax[tensorboard]' for "
                    "tensorboardX; logging.tensorboard=false hides this line)")
            else:
                directory = os.path.join(cfg.run_dir, "tb")
                # purge_step: TensorBoard drops the events of steps >= it from earlier files
                tensorboard = SummaryWriter(directory, purge_step=start_step + 1 if start_step
                                            else None, flush_secs=30)
                log(f"tensorboard: {directory} (tensorboard --logdir {directory})")
        if cfg.logging.wandb:
            wandb_run = _open_wandb(cfg, log)
        return cls(tensorboard, wandb_run)

    def write(self, record: dict):
        """Every finite scalar of the record (a skipped step's NaN loss is not drawn; its
        train/skipped is)."""
        values = {k: v for k, v in scalars(record).items() if math.isfinite(v)}
        if self.tensorboard is not None:
            for name, value in values.items():
                self.tensorboard.add_scalar(name, value, record["step"])
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=record["step"])

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _open_wandb(cfg: Config, log):
    import wandb
    id_path = os.path.join(cfg.run_dir, "wandb_run_id")
    run_id = open(id_path).read().strip() if os.path.exists(id_path) else None  # None: a new one
    run = wandb.init(project=cfg.logging.wandb_project, dir=cfg.run_dir, id=run_id,
                     resume="allow", name=os.path.basename(os.path.abspath(cfg.run_dir)),
                     config=to_dict(cfg), mode=cfg.logging.wandb_mode,
                     # console off: W&B leaves stdout alone (the run's lines, the live display)
                     settings=wandb.Settings(console="off", silent=True))
    run_id = run.id
    with open(id_path, "w") as f:
        f.write(run_id + "\n")
    log(f"wandb: run {run_id} ({cfg.logging.wandb_mode}) in {os.path.join(cfg.run_dir, 'wandb')}")
    return run
