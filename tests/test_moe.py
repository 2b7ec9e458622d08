"""Mixture of experts (Mixtral, Qwen3-MoE) against transformers: import (logits, the load-balancing
loss), one streamed AdamW step with the aux loss over two micro-batches, export -> from_pretrained
round trip, the compiled block's memory and FLOPs against the number of experts, bad configs."""

import dataclasses
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
from megatrain_jax.engine import StreamedEngine  # noqa: E402
from megatrain_jax.model import Block, Execution, ModelConfig  # noqa: E402
from megatrain_jax.recipes import decay_mask, load_config  # noqa: E402
from test_engine import count_compiles  # noqa: E402
from test_hf import (assert_close, eager_fp32_perturbed, export, hf_engine,  # noqa: E402
                     save_checkpoint)

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
    return eager_fp32_perturbed(getattr(transformers, model_cls)(config))


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


_block_in_context = jax.jit(lambda graphdef, params, x, c: nnx.merge(graphdef, params)(x, c),
                            static_argnums=0)


def forward(stages, blocks, inputs, context=None):
    """(logits, summed router statistics) of our modules (one compiled block for all layers)."""
    first, last = stages
    x, stats = first(jnp.asarray(inputs)), []
    for block in blocks:
        graphdef, params = nnx.split(block)
        if context is None:
            x, s = _block(graphdef, params, x)
        else:
            x, s = _block_in_context(graphdef, params, x, context)
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


def test_padding_stays_out_of_the_aux_loss_as_transformers_attention_mask_leaves_it(hf_dirs):
    """Rows ending in padding (segment id -1, as chat.pack writes it): the load-balancing loss is
    transformers' with an attention_mask over the same padding, and differs from counting it."""
    model, path = hf_dirs["mixtral"]
    cfg, stages, blocks, _ = import_model(path)
    inputs, _ = batch()
    b, t = inputs.shape
    real = np.array([t, t - 5])[:, None] > np.arange(t)  # row 1 ends in 5 padding tokens
    context = {"segment_ids": jnp.asarray(np.where(real, 0, -1), jnp.int32),
               "positions": jnp.asarray(np.broadcast_to(np.arange(t), (b, t)), jnp.int32)}
    _, stats = forward(stages, blocks, inputs, context)
    _, all_stats = forward(stages, blocks, inputs)
    with torch.no_grad():
        out = model(torch.tensor(inputs, dtype=torch.long),
                    attention_mask=torch.tensor(real, dtype=torch.long), output_router_logits=True)
    ours = float(moe.load_balancing_loss(stats, cfg.num_experts))
    np.testing.assert_allclose(ours, out.aux_loss.item(), rtol=1e-6)
    assert float(stats["rows"]) == cfg.num_layers * real.sum()
    assert abs(float(moe.load_balancing_loss(all_stats, cfg.num_experts)) - ours) > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_import_of_experts_as_transformers_holds_them_in_memory(hf_dirs, arch, tmp_path):
    """A directory holding the model's state_dict as transformers 5 keeps it (each layer's experts
    in two 3-D tensors, experts.gate_up_proj and experts.down_proj; transformers loads it too)
    imports to the same weights as the per-expert layout save_pretrained writes."""
    from safetensors.torch import save_file

    model, path = hf_dirs[arch]
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") and t.ndim == 3 for n, t in state.items())
    save_file(state, str(tmp_path / hf.SINGLE_FILE), metadata={"format": "pt"})
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    assert hf.HFSource(str(tmp_path)).arch == ARCHS[arch][1] + hf.FUSED_EXPERTS
    _, _, _, fused = import_model(str(tmp_path))
    _, _, _, per_expert = import_model(path)
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(per_expert)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(fused) == jax.tree.structure(per_expert)


def keep_gradient() -> optax.GradientTransformation:
    """Passes the update through and keeps it as its state: first in a chain, the gradient."""
    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda updates, state, params=None: (updates, updates))


def engine_step(path, optimizer, inputs, targets):
    """(step output, params after it, the gradient), the last two as {HF name: array}, of one
    engine step on `path`'s model over M = len(inputs) micro-batches with
    optax.chain(keep_gradient(), optimizer); then a second step must compile nothing."""
    arch = hf.HFSource(path).arch
    cfg = hf.model_config_from_hf(path)
    cfg, engine = hf_engine(path, optax.chain(keep_gradient(), optimizer),
                            aux_loss=moe.aux_loss(cfg))
    out = engine.train_step(inputs, targets)
    out = {k: float(v) for k, v in out.items()}
    state = engine.state()
    params = as_hf(cfg, engine.params(), arch)  # copies
    grads = as_hf(cfg, {"stages": state["stages"]["opt_state"][0],
                        "layers": [u["opt_state"][0] for u in state["layers"]]}, arch)
    with count_compiles() as compiles:  # the aux loss's functions too compile once
        float(engine.train_step(inputs, targets)["aux_loss"])
    assert compiles == []
    engine.close()
    return out, params, grads


@pytest.mark.parametrize("arch", ARCHS)
def test_one_streamed_adamw_step_with_aux_loss_equals_torch(hf_dirs, arch, tmp_path):
    """Two micro-batches through the engine = one torch step on both rows, whose loss is CE +
    coef * aux over the whole batch (the router statistics add up over micro-batches): the loss,
    every gradient and the weights after one AdamW step."""
    _, path = hf_dirs[arch]
    model = make_hf_model(arch)  # a fresh copy: this test changes its weights
    lr, betas, eps, wd = 1e-3, (0.9, 0.95), 1e-8, 0.1
    inputs, targets = batch(seed=2)
    micro = inputs[:, None], targets[:, None]  # M = 2 micro-batches of one row
    out, ours, our_grads = engine_step(path, optax.adamw(
        lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=wd, mask=decay_mask), *micro)

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
    assert_close(our_grads, grads, 1e-5)
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


@pytest.mark.parametrize("arch", ARCHS)
def test_export_from_pretrained_round_trip_is_exact(hf_dirs, arch, tmp_path):
    """A checkpoint of the imported model (perturbed, so the export cannot pass by copying the
    source files) exports to a directory transformers loads as `arch`, with our logits, in the
    per-expert layout save_pretrained writes; our importer reads it back bit for bit."""
    cfg, _, _, params = import_model(hf_dirs[arch][1])
    params = jax.tree.map(lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)),
                          params)
    units = [params["stages"], *params["layers"]]
    state = {"stages": {"params": units[0], "opt_state": {}},
             "layers": [{"params": u, "opt_state": {}} for u in units[1:]]}
    save_checkpoint(str(tmp_path / "run"), cfg, state, 3)
    out = str(tmp_path / "exported")
    assert export("--run-dir", str(tmp_path / "run"), "--out", out, "--shard-size", "100KB") == 0
    expected = as_hf(cfg, params, ARCHS[arch][1])
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == ARCHS[arch][1]
    model.config._attn_implementation = "eager"
    written = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            written.update(load_file(os.path.join(out, name)))
    assert len(written) == len(expected) and sum(".experts." in n for n in written) == 2 * 4 * 3
    for name in expected:  # identical, not close: fp32 in, fp32 out
        np.testing.assert_array_equal(written[name], expected[name], err_msg=name)
    cfg2, stages, blocks, params2 = import_model(out)
    assert dataclasses.replace(cfg2, from_hf="") == dataclasses.replace(cfg, from_hf="")
    assert_close(as_hf(cfg2, params2, ARCHS[arch][1]), expected, 0.0)
    inputs, _ = batch(seed=7)
    with torch.no_grad():
        ref = model(torch.tensor(inputs, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(forward(stages, blocks, inputs)[0], ref, rtol=0, atol=1e-5)


def test_engine_without_aux_loss_refuses_blocks_that_return_aux(hf_dirs):
    """Blocks returning (x, aux) with no aux_loss to turn them into a loss: one line, and the
    engine stays usable (nothing was submitted)."""
    path = hf_dirs["mixtral"][1]
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    first, last = hf.load_stages(cfg, source)
    engine = StreamedEngine(
        first=first, last=last, make_block=lambda i: hf.load_block(cfg, source, i),
        num_layers=cfg.num_layers, compute_dtype=jnp.float32, optimizer=optax.sgd(0.1),
        compute_device=jax.devices("cpu")[0], host_device=jax.devices("cpu")[1])
    inputs, targets = batch(seed=2)
    with pytest.raises(ValueError, match=r"return \(x, aux\) but the engine has no aux_loss"):
        engine.train_step(inputs[:, None], targets[:, None])
    assert np.isfinite(float(engine.evaluate(inputs[:, None], targets[:, None])["loss"]))
    engine.close()


# -----------------------------------------------------------------------------
# the compiled block against the number of experts


def matmul_flops(jaxpr) -> int:
    """FLOPs of every dot_general in a jaxpr, a scan's body counted `length` times, a cond's
    costliest branch. (XLA's cost_analysis counts a while loop's body once, whatever its trip
    count, so it cannot see the tiles of moe.experts_swiglu.)"""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[d] for d in contract])
        elif eqn.primitive.name == "cond":
            total += max(matmul_flops(b.jaxpr) for b in eqn.params["branches"])
        else:
            assert eqn.primitive.name != "while", "a loop of unknown trip count"
            times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    total += times * matmul_flops(sub)
    return int(total)


def block_backward(num_experts: int, intermediate: int, tokens: int, tile: int):
    """(weight bytes, jitted vjp of one block, its example args) on (1, tokens, 64)."""
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=intermediate, num_layers=1,
                      num_heads=4, num_kv_heads=2, num_experts=num_experts, experts_per_token=2)
    abstract = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0),
                                            execution=Execution(expert_tile=tile)))
    graphdef, params = nnx.split(abstract)

    def backward(params, x):
        out, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
        return vjp(jax.tree.map(jnp.ones_like, out))

    weight_bytes = sum(4 * np.prod(p.shape) for p in jax.tree.leaves(params))
    return weight_bytes, jax.jit(backward), (params, jax.ShapeDtypeStruct((1, tokens, 64),
                                                                          jnp.float32))


def test_compiled_moe_block_grows_with_experts_only_by_their_weights():
    """4 vs 16 experts at top-2 (2048 routed rows): the compiled forward + backward's temporary
    memory grows by the added weights' gradient and the padding tiles' saved matmul outputs,
    where a dense compute of every expert would add (E, rows, F) activations; the matmul FLOPs
    grow only by the padding of each expert's rows to a tile and the router's columns, and equal
    those of a dense SwiGLU as wide as the routed experts plus the router and those."""
    tokens, tile, d, f = 1024, 64, 64, 96
    small, large = (block_backward(e, f, tokens, tile) for e in (4, 16))
    # XLA:CPU's LLVM optimisation level does not change buffer assignment (as plan.py uses it)
    options = {"xla_backend_optimization_level": 0}
    temp = [fn.lower(*args).compile(compiler_options=options).memory_analysis().temp_size_in_bytes
            for _, fn, args in (small, large)]
    added_weights = large[0] - small[0]
    padding_tiles = (16 - 4) * tile * (2 * d + 2 * f) * 4  # inputs, outputs, gate and up
    dense_activations = (16 - 4) * 2 * tokens * f * 4  # one (E, rows, F) fp32 buffer's growth
    assert temp[1] - temp[0] <= 2 * added_weights + padding_tiles < dense_activations, \
        (temp, added_weights)

    flops = [matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr) for _, fn, args in (small, large)]
    swiglu_tile = tile * 3 * 2 * d * f
    router = lambda e: 2 * tokens * d * e
    # the backward: 3 x the forward's matmuls (the forward, and two for its gradients)
    assert flops[1] - flops[0] <= 3 * ((16 - 4) * swiglu_tile + router(16) - router(4)), flops
    # the same block with a dense SwiGLU as wide as the routed experts (top-2 x F), no router
    _, dense, args = block_backward(0, 2 * f, tokens, tile)
    dense_flops = matmul_flops(jax.make_jaxpr(dense)(*args).jaxpr)
    combine = 2 * tokens * 2 * d  # the top-2 outputs weighted and summed
    assert dense_flops < flops[0] <= dense_flops + 3 * (router(4) + combine + 4 * swiglu_tile)
    # the counter agrees with XLA's where there is no loop (XLA adds the elementwise work)
    xla = dense.lower(*args).cost_analysis()["flops"]
    assert dense_flops <= xla <= 1.2 * dense_flops, (dense_flops, xla)


def test_plan_streams_every_expert_and_counts_flops_of_the_routed_ones():
    """The plan's bus bytes per layer are the whole block's (every expert streams with the
    layer); its FLOPs per token (for the tokens needed to hide the transfers) count the routed
    experts only, so hiding a MoE layer's transfers takes more tokens than if every expert
    computed."""
    from megatrain_jax import flops
    from megatrain_jax.config import Config, DataConfig
    from megatrain_jax.machines import MACHINES
    from megatrain_jax.plan_report import format_bytes, layer_line
    from megatrain_jax.recipes import build_optimizer

    d, f, e, k = 64, 96, 16, 2
    moe_cfg = ModelConfig(vocab_size=V, hidden_size=d, intermediate_size=f, num_layers=2,
                          num_heads=4, num_kv_heads=2, num_experts=e, experts_per_token=k)
    machine = MACHINES["h100"]
    cfg = Config(model=moe_cfg, data=DataConfig(seq_len=64))
    counts = flops.counts(cfg, Execution(), machine, lookup_setting=None,
                          optimizer=build_optimizer(cfg.optimizer, cfg.train.steps))
    block = nnx.eval_shape(lambda: Block(moe_cfg, rngs=nnx.Rngs(0)))
    assert counts.layer == sum(p.size for p in jax.tree.leaves(nnx.state(block)))
    assert counts.active_layer == counts.layer - (e - k) * 3 * d * f
    assert moe_cfg.num_params(include_embeddings=False) == 2 * counts.layer + d  # + final norm
    assert moe_cfg.num_active_params(include_embeddings=False) == 2 * counts.active_layer + d
    line = layer_line(counts)
    assert f"{format_bytes(2 * counts.layer)} over the bus per pass" in line  # bf16
    assert f"{counts.active_layer / 1e6:,.2f}M active per token" in line
    hide = flops.tokens_to_hide(moe_cfg, counts, 64, machine, False)
    every_expert = dataclasses.replace(counts, active_layer=counts.layer)
    assert hide > 2 * flops.tokens_to_hide(moe_cfg, every_expert, 64, machine, False) > 0


BAD_CONFIGS = {  # arch, config.json change, the line's text
    "decoder_sparse_step": ("qwen3_moe", dict(decoder_sparse_step=2), re.escape(
        "decoder_sparse_step=2, mlp_only_layers=[] give 1 of 2 layers a dense MLP; only "
        "all-sparse models are supported")),
    "mlp_only_layers": ("qwen3_moe", dict(mlp_only_layers=[1]), re.escape(
        "decoder_sparse_step=1, mlp_only_layers=[1] give 1 of 2 layers a dense MLP")),
    "router_jitter_noise": ("mixtral", dict(router_jitter_noise=0.01), re.escape(
        "router_jitter_noise=0.01 is not supported (only 0)")),
    "num_experts_per_tok": ("mixtral", dict(num_experts_per_tok=5), re.escape(
        "model.experts_per_token (5) must be in 1..model.num_experts (4)")),
}


@pytest.mark.parametrize("how", BAD_CONFIGS)
def test_unsupported_moe_option_is_one_line_exit_2(hf_dirs, tmp_path, capsys, how):
    arch, change, message = BAD_CONFIGS[how]
    path = str(tmp_path / "model")
    shutil.copytree(hf_dirs[arch][1], path)
    config = json.load(open(os.path.join(path, "config.json")))
    json.dump({**config, **change}, open(os.path.join(path, "config.json"), "w"))
    assert run_cli(lambda: load_config(None, [f"model.from_hf={path}"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and path in err[0], err
    assert re.search(message, err[0]), err[0]
