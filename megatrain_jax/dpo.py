"""Direct preference optimisation (DPO) on the streamed engine: the loss head and the reference
log-probabilities.

The engine stays generic: DPO is only a different last stage. `PreferenceHead` is the model's
LMHead (the same weights, the same parameter tree, so checkpoints and exports are unchanged)
whose loss is the DPO loss of the pairs in its micro-batch. A micro-batch holds whole pairs, row
2p the chosen and row 2p + 1 the rejected completion of pair p (preference.py), so the loss is
a sum over pairs and the engine's sum(loss_sum) / sum(weight) over micro-batches is the mean over
every pair of the step: micro-batches and accumulation equal one big batch.

The targets of a micro-batch are {"tokens": (2P, T) int32, IGNORE_ID outside the completion,
"reference": (2P,) fp32, each sequence's summed completion log-probability under the frozen
starting weights}. Those come from one forward-only pass of the engine before training
(`reference_logps`, through the engine's generic `forward_outputs`), cached on disk
(`ReferenceCache`), keyed by the data, the tokenizer, the model and the settings they depend on.

Losses, as TRL writes them (h = (pi_c - ref_c) - (pi_r - ref_r), pi the summed log-probs):
  sigmoid  -log sigmoid(beta h)                  (DPO, Rafailov et al. 2023)
  ipo      (h - 1 / (2 beta))^2, pi and ref averaged over each completion's tokens (IPO)
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from megatrain_jax import checkpoint
from megatrain_jax.chat import ChatTemplate
from megatrain_jax.config import DPO_LOSSES, ConfigError
from megatrain_jax.data import DataError
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.model import LMHead


class PreferenceHead(LMHead):
    """`head`'s weights (shared, not copied) with the DPO loss of a micro-batch of pairs:
    returns (sum of the pairs' losses, the number of pairs, statistics summed over pairs)."""

    def __init__(self, head: LMHead, *, beta: float, loss: str = "sigmoid"):
        if loss not in DPO_LOSSES:
            raise ValueError(f"dpo.loss must be one of {', '.join(DPO_LOSSES)}, got {loss!r}")
        self.cfg, self.execution = head.cfg, head.execution
        self.norm = head.norm
        if head.cfg.tie_embeddings:
            self.embed = head.embed
        else:
            self.w_out = head.w_out
        self.beta, self.loss = float(beta), loss  # static: part of the graphdef

    def sequence_logps(self, x, tokens):
        """(rows,) fp32: each row's summed log-probability of its non-ignored targets."""
        return self.token_logprobs(x, tokens).sum(axis=-1)

    def __call__(self, x, targets):
        tokens, reference = targets["tokens"], targets["reference"]
        logps = self.sequence_logps(x, tokens)  # (2P,)
        if self.loss == "ipo":  # IPO compares average log-probs per token
            counts = jnp.maximum(jnp.sum(tokens != IGNORE_ID, axis=-1), 1).astype(jnp.float32)
            logps, reference = logps / counts, reference / counts
        losses, stats = pair_losses(logps, reference, self.beta, self.loss)
        return losses.sum(), jnp.float32(losses.shape[0]), stats


def pair_losses(logps, reference, beta: float, loss: str = "sigmoid"):
    """(per-pair losses (P,), statistics summed over the pairs) from rows' policy and reference
    log-probs (2P,), chosen at even rows, rejected at odd ones."""
    chosen, rejected = logps[0::2], logps[1::2]
    chosen_ref, rejected_ref = reference[0::2], reference[1::2]
    h = (chosen - chosen_ref) - (rejected - rejected_ref)
    if loss == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -jax.nn.log_sigmoid(beta * h)
    chosen_reward = jax.lax.stop_gradient(beta * (chosen - chosen_ref))
    rejected_reward = jax.lax.stop_gradient(beta * (rejected - rejected_ref))
    stats = {"pairs": jnp.float32(chosen.shape[0]),
             "reward_margin": jnp.sum(chosen_reward - rejected_reward),
             "reward_accuracy": jnp.sum((chosen_reward > rejected_reward).astype(jnp.float32)),
             "logps_chosen": jnp.sum(jax.lax.stop_gradient(chosen)),
             "logps_rejected": jnp.sum(jax.lax.stop_gradient(rejected))}
    return losses, stats


def step_metrics(stats: dict) -> dict:
    """A step's (or an evaluation's) summed statistics as means over its pairs, for the log."""
    pairs = float(stats["pairs"])
    return {key: float(value) / pairs for key, value in stats.items() if key != "pairs"}


# -----------------------------------------------------------------------------
# the reference pass


def _reference_output(head, x, targets):
    return head.sequence_logps(x, targets["tokens"])


def reference_logps(engine, dataset) -> np.ndarray:
    """(rows,) fp32: every row's summed completion log-probability under the engine's current
    weights (forward only, streamed: no second copy of the model anywhere), in the dataset's
    batch shapes so the forward functions are those training compiles."""
    rows = dataset.rows
    n = len(rows["inputs"])
    per_batch = dataset.rows_per_batch
    out = np.zeros(n, np.float32)
    batches = [np.arange(start, start + per_batch) % n for start in range(0, n, per_batch)]
    pending = []
    for take in batches:  # dispatched, then read
        inputs, targets, context = dataset.batch(take)
        pending.append((take, engine.forward_outputs(inputs, targets, _reference_output, context)))
    for take, outs in pending:
        out[take] = np.concatenate([np.asarray(o) for o in outs])  # wrapped rows: same values
    return out


# -----------------------------------------------------------------------------
# the cache of reference log-probs


CACHE_VERSION = 1


def file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def text_digest(*parts) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def weights_digest(params: dict) -> str:
    """A digest of the fp32 master weights ({"stages", "layers"} of host arrays), unit by unit on
    threads (hashlib releases the GIL), reading them in place."""
    def unit(tree):
        h = hashlib.blake2b(digest_size=16)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            a = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{jax.tree_util.keystr(path)}{a.dtype}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
        return h.hexdigest()
    units = [params["stages"], *params["layers"]]
    with concurrent.futures.ThreadPoolExecutor(min(8, len(units))) as pool:
        return text_digest(list(pool.map(unit, units)))


class ReferenceCache:
    """The reference log-probs of one (data, tokenizer, model, settings) key, in
    `<directory>/reference_logps-<digest>.npz`: reused when its stored key matches, built into a
    new file when the inputs change (a new key, a new name). A file at our name whose key is not
    ours (stale, copied, foreign or damaged) is refused, never used and never overwritten."""

    def __init__(self, directory: str, key: dict):
        self.key = dict(key, version=CACHE_VERSION)
        self.path = os.path.join(directory, f"reference_logps-{text_digest(self.key)[:16]}.npz")

    def load(self, rows: int):
        """The cached (rows,) log-probs, or None if there is no file. Raises DataError naming
        the file if it is not ours."""
        if not os.path.exists(self.path):
            return None
        try:
            with np.load(self.path, allow_pickle=False) as f:
                key, logps = json.loads(str(f["key"])), np.asarray(f["logps"])
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            # BadZipFile, EOFError: a file cut short (a full disk, a killed copy)
            raise DataError(f"{self.path}: not a reference log-prob cache of this trainer, or a "
                            f"damaged one ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); move it away (it is not "
                            f"overwritten) and the reference pass rebuilds it") from None
        if key != self.key:
            differ = sorted(k for k in set(key) | set(self.key) if key.get(k) != self.key.get(k))
            raise DataError(f"{self.path}: stale or foreign reference cache: its key differs in "
                            f"{', '.join(differ)}; move it away (it is not overwritten)")
        if logps.shape != (rows,):
            raise DataError(f"{self.path}: holds {logps.shape} log-probs, the data has {rows} "
                            f"sequences; move it away (it is not overwritten)")
        return logps

    def save(self, logps: np.ndarray):
        """Writes the file (atomically; never over an existing one)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp.npz"
        np.savez(tmp, key=np.asarray(json.dumps(self.key, sort_keys=True)),
                 logps=np.asarray(logps, np.float32))
        if os.path.exists(self.path):
            os.remove(tmp)
            raise DataError(f"{self.path}: appeared while the reference pass ran; not overwritten")
        os.replace(tmp, self.path)


def reference_key(cfg, engine) -> dict:
    """What the reference log-probs depend on: the data file, the tokenizer and its chat
    template, the model (its config and its weights as the engine holds them now: the starting
    weights) and the settings that change the sequences or their arithmetic."""
    d = cfg.data
    template = ChatTemplate.for_tokenizer(d.tokenizer, f"data.format={d.format}")
    model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "from_hf"}
    return {"data": file_digest(d.path),
            "tokenizer": text_digest(file_digest(d.tokenizer), template.source, template.variables),
            "model": text_digest(model, weights_digest(engine.params())),
            "settings": text_digest(d.format, d.seq_len, d.overlong, cfg.train.compute_dtype)}


def check_reference_dir(cfg):
    """Raises ConfigError naming dpo.reference_dir (or run_dir, its default) unless the cache
    can be written there: a directory, or one still to be made, where a file can be created."""
    key = "dpo.reference_dir" if cfg.dpo.reference_dir else "run_dir"
    directory = cfg.dpo.reference_dir or cfg.run_dir
    where = os.path.abspath(directory)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ConfigError(f"{key}={directory}: {where} is not a directory (where the reference "
                          f"log-probs cache is written)")
    checkpoint.check_writable(where, f"{key}={directory} (where the reference log-probs cache "
                                     f"is written)", ConfigError)


def prepare_reference(cfg, engine, dataset, log=print):
    """Fills dataset.rows["reference"] with the reference log-probs of the engine's current (the
    starting) weights: from the cache when its key matches, else from a reference pass, saved."""
    cache = ReferenceCache(cfg.dpo.reference_dir or cfg.run_dir, reference_key(cfg, engine))
    rows = len(dataset.rows["inputs"])
    logps = cache.load(rows)
    if logps is not None:
        log(f"reference log-probs: {rows} sequences from {cache.path} (key matches)")
    else:
        check_reference_dir(cfg)  # before the pass, not at its end
        t0 = time.perf_counter()
        logps = reference_logps(engine, dataset)
        if not np.all(np.isfinite(logps)):
            raise DataError(f"the reference pass gave non-finite log-probs for "
                            f"{int(np.sum(~np.isfinite(logps)))} sequences; nothing saved")
        cache.save(logps)
        log(f"reference log-probs: {rows} sequences, one streamed forward pass of the starting "
            f"weights in {time.perf_counter() - t0:.1f} s, saved to {cache.path}")
    dataset.rows["reference"][:] = logps
