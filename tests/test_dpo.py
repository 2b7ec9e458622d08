"""DPO: the loss and its gradient against TRL's formula in torch on a transformers model (with
micro-batches and accumulation), the reference pass against transformers' log-probs, the
reference cache (reused, rebuilt, refused), preference data and its bad inputs, the tiny config
through the CLI."""

import json
import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from megatrain_jax import dpo, hf  # noqa: E402
from megatrain_jax.engine import StreamedEngine  # noqa: E402
from megatrain_jax.loss import IGNORE_ID  # noqa: E402
from test_hf import V, as_hf, assert_close, make_hf_model  # noqa: E402
from test_moe import keep_gradient  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA = 0.3


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, saved dir) of a tiny tied-embedding Llama in fp32."""
    model = make_hf_model("llama")
    path = str(tmp_path_factory.mktemp("dpo_llama"))
    model.save_pretrained(path)
    return model, path


def dpo_engine(path, optimizer, *, beta=BETA, loss="sigmoid"):
    """(cfg, an fp32 StreamedEngine of the HF model at `path` whose last stage is the DPO head)."""
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    first, last = hf.load_stages(cfg, source)
    engine = StreamedEngine(
        first=first, last=dpo.PreferenceHead(last, beta=beta, loss=loss),
        make_block=lambda i: hf.load_block(cfg, source, i), num_layers=cfg.num_layers,
        compute_dtype=jnp.float32, optimizer=optimizer, compute_device=jax.devices("cpu")[0],
        host_device=jax.devices("cpu")[1])
    return cfg, engine


def pairs_batch(num_pairs=4, t=12, seed=0):
    """(inputs, targets) of (2 * num_pairs, t) rows: pair p's chosen at row 2p, rejected at 2p + 1,
    sharing a prompt; targets IGNORE_ID on the prompt and on each row's right padding."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, V, (2 * num_pairs, t + 1)).astype(np.int32)
    targets = inputs[:, 1:].copy()
    inputs = inputs[:, :-1].copy()
    for p in range(num_pairs):
        prompt = int(rng.integers(2, 6))
        inputs[2 * p + 1, :prompt] = inputs[2 * p, :prompt]
        for r in (2 * p, 2 * p + 1):
            end = int(rng.integers(prompt + 2, t + 1))
            targets[r, :prompt - 1] = IGNORE_ID
            targets[r, end:] = IGNORE_ID
    return inputs, targets


def torch_logps(model, inputs, targets):
    """Per-row summed log-probs of the targets, as TRL's concatenated_forward sums them."""
    logits = model(torch.tensor(inputs, dtype=torch.long)).logits
    mask = torch.tensor(targets != IGNORE_ID)
    labels = torch.tensor(np.where(targets == IGNORE_ID, 0, targets), dtype=torch.long)
    per_token = torch.gather(logits.log_softmax(-1), 2, labels[..., None]).squeeze(-1)
    return (per_token * mask).sum(-1)


def trl_dpo_loss(logps, reference, beta, loss_type="sigmoid"):
    """TRL's DPOTrainer.dpo_loss (label_smoothing 0): (mean loss, its metrics)."""
    chosen, rejected = logps[0::2], logps[1::2]
    ref_chosen, ref_rejected = reference[0::2], reference[1::2]
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = -torch.nn.functional.logsigmoid(beta * logits)
    chosen_rewards = beta * (chosen - ref_chosen).detach()
    rejected_rewards = beta * (rejected - ref_rejected).detach()
    metrics = {"reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
               "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
               "logps_chosen": chosen.mean().item(), "logps_rejected": rejected.mean().item()}
    return losses.mean(), metrics


def engine_gradient(path, inputs, targets, micro_batches, **head):
    """(step output, the gradient as {HF name: array}) of one step over the rows split into
    `micro_batches` micro-batches of whole pairs."""
    cfg, engine = dpo_engine(path, optax.chain(keep_gradient(), optax.sgd(0.0)), **head)
    shape = lambda x: x.reshape(micro_batches, -1, *x.shape[1:])
    out = engine.train_step(shape(inputs), {k: shape(v) for k, v in targets.items()})
    state = engine.state()
    grads = as_hf(cfg, {"stages": state["stages"]["opt_state"][0],
                        "layers": [u["opt_state"][0] for u in state["layers"]]})
    engine.close()
    return out, grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradient_equal_trl_formula_in_torch(llama, loss_type):
    """One step over 4 pairs as 2 micro-batches of 2 (accumulated): the loss, the logged metrics
    and every gradient equal TRL's DPO loss of the transformers model over the 4 pairs at once,
    to 1e-5."""
    model, path = llama
    inputs, targets = pairs_batch()
    model.zero_grad()
    logps = torch_logps(model, inputs, targets)
    # a reference that differs from the policy by pair, in both directions
    reference = logps.detach() + torch.tensor(np.random.default_rng(1).normal(0, 2, len(logps)),
                                              dtype=torch.float32)
    counts = torch.tensor((targets != IGNORE_ID).sum(-1), dtype=torch.float32)
    if loss_type == "ipo":  # TRL's IPO: log-probs averaged over each completion's tokens
        ref_loss, metrics = trl_dpo_loss(logps / counts, reference / counts, BETA, "ipo")
    else:
        ref_loss, metrics = trl_dpo_loss(logps, reference, BETA)
    ref_loss.backward()
    ref_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}

    batch = {"tokens": targets, "reference": reference.numpy().astype(np.float32)}
    out, grads = engine_gradient(path, inputs, batch, 2, loss=loss_type)
    np.testing.assert_allclose(float(out["loss"]), ref_loss.item(), rtol=1e-5)
    ours = dpo.step_metrics(out["stats"])
    if loss_type == "sigmoid":  # (IPO's metrics are of the averaged log-probs)
        assert 0 < metrics["reward_accuracy"] < 1  # both kinds of pair
        for key, value in metrics.items():
            np.testing.assert_allclose(ours[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert_close(grads, ref_grads, 1e-5)
