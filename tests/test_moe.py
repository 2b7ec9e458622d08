"""Mixture of experts (Mixtral, Qwen3-MoE) against transformers: import (logits, the load-balancing
loss), one streamed AdamW step with the aux loss over two micro-batches, export -> from_pretrained
round trip, the compiled block's memory and FLOPs against the number of experts, bad configs."""

import json
import os
import re
import shutil

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from megatrain_jax import hf, moe  # noqa: E402
from megatrain_jax.cli import run_cli  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.engine import StreamedEngine  # noqa: E402
from megatrain_jax.model import Block, Execution, ModelConfig  # noqa: E402
from megatrain_jax.train import decay_mask  # noqa: E402
from test_hf import assert_close, export, save_checkpoint  # noqa: E402

V = 101
COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, num_experts_per_tok=2,
              router_aux_loss_coef=0.1)  # a coefficient large enough to move the weights
ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=4, rope_theta=20000.0)),
    # q/k norms, explicit head_dim, norm_topk_prob false (its default: the top-k weights are the
    # raw probabilities; Mixtral renormalises); intermediate_size is the (unused) dense MLP's
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=80, moe_intermediate_size=48, num_experts=4,
                       head_dim=32, norm_topk_prob=False, rope_theta=1e6)),
}


def make_hf_model(arch: str, seed: int = 0, **overrides):
    config_cls, model_cls, options = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **{**options, **overrides})
    model = getattr(transformers, model_cls)(config).float()
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # norms init to 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{arch: (model, saved dir)}: saved as transformers saves them (one tensor per expert)."""
    out = {}
    for arch in ARCHS:
        model = make_hf_model(arch)
        path = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(path)
        out[arch] = (model, path)
    return out


def saved_tensors(model, tmp_path) -> dict:
    """{name: fp32 array} as save_pretrained writes the model (per-expert tensors)."""
    path = str(tmp_path / "saved")
    model.save_pretrained(path)
    return load_file(os.path.join(path, hf.SINGLE_FILE))


def import_model(path):
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    first, last = hf.load_stages(cfg, source)
    blocks = [hf.load_block(cfg, source, i) for i in range(cfg.num_layers)]
    params = {"stages": nnx.to_pure_dict(nnx.split((first, last))[1]),
              "layers": [nnx.to_pure_dict(nnx.split(b)[1]) for b in blocks]}
    return cfg, (first, last), blocks, params


def as_hf(cfg, params, arch) -> dict:
    """Our params as {HF name: fp32 array} in the per-expert layout of `arch`."""
    units = [params["stages"], *params["layers"]]
    out = {}
    for name, shape, unit, key, transpose in hf.all_tensors(cfg, arch):
        if unit == 0:
            x = units[0][key[0]][key[1]]
        elif isinstance(key, hf.Expert):
            x = units[unit][key[0]][key[1]]
        else:
            x = units[unit][key]
        out[name] = hf.to_hf_layout(x, shape, transpose, np.float32)
    return out


def batch(seed=1, b=2, t=12):
    toks = np.random.default_rng(seed).integers(0, V, size=(b, t + 1), dtype=np.int32)
    return toks[:, :-1], toks[:, 1:]


_block = jax.jit(lambda graphdef, params, x: nnx.merge(graphdef, params)(x), static_argnums=0)


def forward(stages, blocks, inputs):
    """(logits, summed router statistics) of our modules (one compiled block for all layers)."""
    first, last = stages
    x, stats = first(jnp.asarray(inputs)), []
    for block in blocks:
        graphdef, params = nnx.split(block)
        x, s = _block(graphdef, params, x)
        stats.append(s)
    return np.asarray(last.logits(x)), jax.tree.map(lambda *s: sum(s), *stats)


def torch_loss(model, inputs, targets):
    """(logits, CE + router_aux_loss_coef * aux, aux) as MixtralForCausalLM computes them with
    output_router_logits=True (labels already shifted here: the CE is taken directly)."""
    out = model(torch.tensor(inputs, dtype=torch.long), output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V),
                                           torch.tensor(targets, dtype=torch.long).reshape(-1))
    return out.logits, ce + model.config.router_aux_loss_coef * out.aux_loss, out.aux_loss


@pytest.mark.parametrize("arch", ARCHS)
def test_import_matches_transformers_logits_and_aux_loss(hf_dirs, arch):
    model, path = hf_dirs[arch]
    cfg, stages, blocks, _ = import_model(path)
    assert (cfg.num_experts, cfg.experts_per_token) == (4, 2)
    assert cfg.moe_renormalize == (arch == "mixtral")
    assert cfg.intermediate_size == (96 if arch == "mixtral" else 48)
    assert cfg.qk_norm == (arch == "qwen3_moe") and cfg.router_aux_loss_coef == 0.1
    inputs, targets = batch()
    logits, stats = forward(stages, blocks, inputs)
    with torch.no_grad():
        ref_logits, _, ref_aux = torch_loss(model, inputs, targets)
    np.testing.assert_allclose(logits, ref_logits.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(moe.load_balancing_loss(stats, cfg.num_experts)),
                               ref_aux.item(), rtol=1e-6)


def engine_step(path, optimizer, inputs, targets):
    """(step output, params after it as {HF name: array}) of one engine step on `path`'s model
    over M = len(inputs) micro-batches."""
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    first, last = hf.load_stages(cfg, source)
    engine = StreamedEngine(
        first=first, last=last, make_block=lambda i: hf.load_block(cfg, source, i),
        num_layers=cfg.num_layers, compute_dtype=jnp.float32, max_grad_norm=None,
        optimizer=optimizer, aux_loss=moe.aux_loss(cfg),
        compute_device=jax.devices("cpu")[0], host_device=jax.devices("cpu")[1])
    out = engine.train_step(inputs, targets)
    out = {k: float(v) for k, v in out.items()}
    params = as_hf(cfg, engine.params(), hf.HFSource(path).arch)
    engine.close()
    return out, params


@pytest.mark.parametrize("arch", ARCHS)
def test_one_streamed_adamw_step_with_aux_loss_equals_torch(hf_dirs, arch, tmp_path):
    """Two micro-batches through the engine = one torch step on both rows, whose loss is CE +
    coef * aux over the whole batch (the router statistics add up over micro-batches): the loss,
    every gradient (an SGD step of rate 1) and the weights after one AdamW step."""
    _, path = hf_dirs[arch]
    model = make_hf_model(arch)  # a fresh copy: this test changes its weights
    lr, betas, eps, wd = 1e-3, (0.9, 0.95), 1e-8, 0.1
    inputs, targets = batch(seed=2)
    micro = inputs[:, None], targets[:, None]  # M = 2 micro-batches of one row
    out, ours = engine_step(path, optax.adamw(lr, b1=betas[0], b2=betas[1], eps=eps,
                                              weight_decay=wd, mask=decay_mask), *micro)
    # SGD at rate 1e4: (before - after) / 1e4 is the gradient, free of the cancellation a rate of
    # 1 would leave in fp32 where the gradient is small next to the weight
    _, sgd = engine_step(path, optax.sgd(1e4), *micro)

    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": wd},
         {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps)
    before = saved_tensors(model, tmp_path / "before")
    weights = {n: p.detach().clone() for n, p in named}
    _, loss, aux = torch_loss(model, inputs, targets)
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    np.testing.assert_allclose(out["aux_loss"], 0.1 * aux.item(), rtol=1e-5)
    # gradients, in the saved layout: a copy of the model holding them as its weights
    with torch.no_grad():
        for _, p in named:
            p.copy_(p.grad)
    grads = saved_tensors(model, tmp_path / "grads")
    assert_close({n: (before[n] - sgd[n]) / 1e4 for n in sgd}, grads, 1e-5)
    with torch.no_grad():  # back to the weights, for the AdamW step
        for n, p in named:
            p.copy_(weights[n])
    opt.step()
    after = saved_tensors(model, tmp_path / "after")
    assert sorted(ours) == sorted(after)
    # As in test_hf: Adam's first step is lr * g / (|g| + eps), which turns fp32 rounding noise
    # in a gradient within ~100 eps of 0 into visible differences (an expert few tokens reach):
    # within 1e-5 with those elements left out, and within 1e-4 all told.
    tiny = {n: np.abs(g) < 100 * eps for n, g in grads.items()}
    assert_close({n: np.where(tiny[n], after[n], x) for n, x in ours.items()}, after, 1e-5)
    assert_close(ours, after, 1e-4)
    for name in after:  # the step moved every tensor (else the comparison proves little)
        assert not np.allclose(after[name], before[name]), name
