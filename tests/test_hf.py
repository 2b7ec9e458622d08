"""Hugging Face interop against transformers itself: import (logits, loss, every gradient, one
AdamW step), export -> from_pretrained round trip, sharded checkpoints, and bad directories."""

import copy
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
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402

from megatrain_jax import hf  # noqa: E402
from megatrain_jax.cli import run_cli  # noqa: E402
from megatrain_jax.config import Config, DataConfig, to_dict  # noqa: E402
from megatrain_jax.engine import StreamedEngine  # noqa: E402
from megatrain_jax.recipes import decay_mask, load_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = 101
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)  # GQA: 4 q, 2 kv
ARCHS = {  # each exercises a different option
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),  # qkv bias
    # q/k norms; an explicit head_dim (32) unlike hidden / heads (16)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
    # fused qkv_proj and gate_up_proj; pad_token_id 32000 would be outside the vocabulary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_theta=20000.0, pad_token_id=None,
                                                   eos_token_id=2)),
}


def word_level_tokenizer():
    """A tokenizer of 92 ids for the tiny models: </s> (0, also EOS), <unk>, then w0 .. w89."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = [f"w{i}" for i in range(90)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["</s>", "<unk>", *words])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                                                unk_token="<unk>")


def make_hf_model(arch: str, seed: int = 0, **overrides):
    config_cls, model_cls, options = ARCHS[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**COMMON, **{**options, **overrides})
    return eager_fp32_perturbed(getattr(transformers, model_cls)(config))


def eager_fp32_perturbed(model, scale: float = 0.1):
    """`model` in fp32 with eager attention, in eval mode, its norms (initialised to 1, or 0 for
    Gemma's 1 + w) and biases (0) perturbed by `scale` so that they matter in a comparison."""
    model = model.float()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(scale * torch.randn_like(p))
    return model.eval()


ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, wd=0.1)  # the AdamW of the parity steps


def hf_engine(path, optimizer, **options):
    """(cfg, a StreamedEngine of the HF model at `path` with `optimizer`, fp32, no clipping;
    `options` go to StreamedEngine, e.g. aux_loss)."""
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    first, last = hf.load_stages(cfg, source)
    engine = StreamedEngine(
        first=first, last=last, make_block=lambda i: hf.load_block(cfg, source, i),
        num_layers=cfg.num_layers, compute_dtype=jnp.float32, max_grad_norm=None,
        optimizer=optimizer, compute_device=jax.devices("cpu")[0],
        host_device=jax.devices("cpu")[1], **options)
    return cfg, engine


def adamw_engine(path):
    """hf_engine with ADAMW (decay_mask's rule: matrices decay)."""
    lr, betas, eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["wd"]
    return hf_engine(path, optax.adamw(lr, b1=betas[0], b2=betas[1], eps=eps, weight_decay=wd,
                                       mask=decay_mask))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{arch: (model, saved dir)}; qwen2 is saved in several shards."""
    out = {}
    for arch in ARCHS:
        model = make_hf_model(arch)
        path = str(tmp_path_factory.mktemp(arch))
        model.save_pretrained(path, max_shard_size="40KB" if arch == "qwen2" else "50MB")
        out[arch] = (model, path)
    return out


def import_model(path):
    """(cfg, stages graphdef, {"stages": ..., "layers": [...]}) read with megatrain_jax.hf."""
    cfg = hf.model_config_from_hf(path)
    source = hf.HFSource(path)
    stages_def, stages = nnx.split(hf.load_stages(cfg, source))
    blocks = [nnx.split(hf.load_block(cfg, source, i)) for i in range(cfg.num_layers)]
    params = {"stages": nnx.to_pure_dict(stages), "layers": [nnx.to_pure_dict(b[1]) for b in blocks]}
    return cfg, stages_def, blocks[0][0], params


def as_hf(cfg, params) -> dict:
    """Our params (or gradients) as {HF name: fp32 array}, laid out as cfg.from_hf's architecture
    stores them (Phi-3: fused)."""
    arch = hf.read_hf_config(cfg.from_hf)["architectures"][0] if cfg.from_hf else None
    units = [params["stages"], *params["layers"]]
    out = {}
    for name, shape, unit, key, transpose in hf.all_tensors(cfg, arch):
        pieces = []
        for part, first, end in hf.parts(key, shape):
            x = units[unit][part[0]][part[1]] if unit == 0 else units[unit][part]
            pieces.append(hf.to_hf_layout(x, (end - first, *shape[1:]), transpose, np.float32))
        out[name] = np.concatenate(pieces)
    return out


def assert_close(ours: dict, ref: dict, rtol: float):
    """Same names; every tensor within rtol relative error in L2 norm."""
    assert sorted(ours) == sorted(ref)
    for name in ref:
        x, y = np.asarray(ours[name], np.float64), np.asarray(ref[name], np.float64)
        assert x.shape == y.shape, name
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def torch_params(model) -> dict:
    return {n: p.detach().numpy() for n, p in model.named_parameters()}  # tied: embed only


def batch(seed=1, b=2, t=12):
    toks = np.random.default_rng(seed).integers(0, V, size=(b, t + 1), dtype=np.int32)
    return toks[:, :-1], toks[:, 1:]


def torch_loss(model, inputs, targets):
    logits = model(torch.tensor(inputs, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V),
                                             torch.tensor(targets, dtype=torch.long).reshape(-1))
    return logits, loss


def assert_matches_transformers(model, path, inputs, targets):
    """Our import of `path` gives `model`'s logits, mean loss and every gradient on one batch;
    returns the imported ModelConfig."""
    cfg, stages_def, block_def, params = import_model(path)

    def forward(params, inputs):
        first, last = nnx.merge(stages_def, params["stages"])
        x = first(inputs)
        for p in params["layers"]:
            x = nnx.merge(block_def, p)(x)
        return last, x

    def loss_fn(params):
        last, x = forward(params, inputs)
        loss_sum, count = last(x, targets)
        return loss_sum / count

    last, x = forward(params, inputs)
    logits = np.asarray(last.logits(x))
    loss, grads = jax.value_and_grad(loss_fn)(params)

    model.zero_grad()
    ref_logits, ref_loss = torch_loss(model, inputs, targets)
    ref_loss.backward()
    assert_close({"logits": logits}, {"logits": ref_logits.detach().numpy()}, 1e-4)
    np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=1e-5)
    # every parameter transformers has (tied: one embedding, whose gradient sums both uses)
    ref_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    assert_close(as_hf(cfg, grads), ref_grads, 1e-4)
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_import_matches_transformers_logits_loss_and_grads(hf_dirs, arch):
    model, path = hf_dirs[arch]
    cfg = assert_matches_transformers(model, path, *batch())
    assert cfg.tie_embeddings == (arch == "llama") and cfg.qkv_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3") and cfg.head_size == (32 if arch == "qwen3" else 16)
    assert cfg.rope_scaling == {"llama": "llama3", "mistral": "linear"}.get(arch, "")
    assert cfg.rope_theta == {"llama": 5e5, "mistral": 2e4, "phi3": 2e4}.get(arch, 1e6)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps) == (4, 2, 1e-5)
    assert cfg.sliding_window == (4096 if arch == "mistral" else 0)


# Every layer slides: Mistral and Phi-3 always, Qwen2 and Qwen3 from layer max_window_layers on.
WINDOWED = {"mistral": dict(sliding_window=5), "phi3": dict(sliding_window=5),
            "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=0),
            "qwen3": dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)}


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    """{arch: (model, saved dir)} of models with a sliding window of 5."""
    out = {}
    for arch, options in WINDOWED.items():
        model = make_hf_model(arch, seed=3, **options)
        path = str(tmp_path_factory.mktemp(f"{arch}_window"))
        model.save_pretrained(path)
        out[arch] = (model, path)
    return out


@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_window_matches_transformers_beyond_the_window(windowed_dirs, arch):
    model, path = windowed_dirs[arch]
    cfg = assert_matches_transformers(model, path, *batch(seed=4, t=12))  # T = 12 > window 5
    assert cfg.sliding_window == 5


@pytest.mark.parametrize("arch", WINDOWED)
def test_exported_config_means_the_same_window(hf_dirs, windowed_dirs, arch, tmp_path):
    """config.json as export writes it, over a source config without a window (qwen2, qwen3:
    their layer_types and max_window_layers say "no layer slides"), reads back, in transformers
    and here, as the window on every layer."""
    _, path = windowed_dirs[arch]
    cfg = hf.model_config_from_hf(path)
    out = tmp_path / "model"
    shutil.copytree(path, out)
    written = hf.hf_config(cfg, dtype="float32", max_position_embeddings=64,
                           base=hf.read_hf_config(hf_dirs[arch][1]))
    (out / "config.json").write_text(json.dumps(written))
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.sliding_window == 5 and config.architectures == [ARCHS[arch][1]]
    if arch in ("qwen2", "qwen3"):
        assert config.layer_types == ["sliding_attention"] * cfg.num_layers
    assert dataclasses.replace(hf.model_config_from_hf(str(out)), from_hf="") == \
        dataclasses.replace(cfg, from_hf="")


def test_export_config_of_a_qk_norm_model_is_qwen3(hf_dirs, tmp_path):
    """With no source config, or one of another architecture, q/k norms export as Qwen3; no HF
    architecture has both q/k/v biases and q/k norms, so that is refused."""
    cfg = dataclasses.replace(hf.model_config_from_hf(hf_dirs["qwen3"][1]), from_hf="")
    for base in (None, hf.read_hf_config(hf_dirs["llama"][1])):
        written = hf.hf_config(cfg, dtype="float32", max_position_embeddings=64, base=base)
        (tmp_path / "config.json").write_text(json.dumps(written))
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        assert type(config).__name__ == "Qwen3Config"
        assert config.architectures == ["Qwen3ForCausalLM"]
        assert (config.head_dim, config.attention_bias, config.sliding_window) == (32, False, None)
    with pytest.raises(hf.HFError, match=r"model\.qkv_bias.*model\.qk_norm"):
        hf.hf_config(dataclasses.replace(cfg, qkv_bias=True), dtype="float32",
                     max_position_embeddings=64)


def test_sharded_checkpoint_has_several_shards(hf_dirs):
    """Guards the sharded import above: qwen2 really is saved in several shards."""
    path = hf_dirs["qwen2"][1]
    index = json.load(open(os.path.join(path, hf.INDEX_FILE)))
    assert len(set(index["weight_map"].values())) >= 3


# tied; qkv biases; q/k norms; fused qkv and gate/up
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_one_streamed_adamw_step_equals_torch_adamw(hf_dirs, arch):
    _, path = hf_dirs[arch]
    model = make_hf_model(arch)  # a fresh copy: this test changes its weights
    cfg, engine = adamw_engine(path)
    inputs, targets = batch(seed=2)
    engine.train_step(inputs[None], targets[None])
    before, _, after = assert_adamw_step_equals_torch(cfg, engine, model, inputs, targets, **ADAMW)
    engine.close()
    for name in after:  # the step moved every tensor (else the comparison proves little)
        assert not np.allclose(after[name], before[name]), name


def adam_gradient(cfg, state, b1) -> dict:
    """The gradient of the engine's first step, {HF name: fp64}, read back from Adam's first
    moment in `state` (mu = (1 - b1) g after one step)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    mu = lambda unit: next(s.mu for s in jax.tree.leaves(unit["opt_state"], is_leaf=is_adam)
                           if is_adam(s))
    mus = {"stages": mu(state["stages"]), "layers": [mu(layer) for layer in state["layers"]]}
    return {n: np.asarray(g, np.float64) / (1 - b1) for n, g in as_hf(cfg, mus).items()}


def torch_gradients(model, inputs, targets, dtype):
    """(loss, {name: gradient as float64}) of `model` cast to `dtype`, on a copy."""
    model = copy.deepcopy(model).to(dtype)
    _, loss = torch_loss(model, inputs, targets)
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in model.named_parameters()}


def torch_adamw_from(model, grads, *, lr, betas, eps, wd):
    """torch.optim.AdamW's first step in fp64 from `model`'s weights and the given gradients,
    with decay_mask's rule (matrices decay; norms and biases do not): {name: fp64 weights}."""
    model = copy.deepcopy(model).double()
    named = list(model.named_parameters())
    for n, p in named:
        p.grad = torch.tensor(grads[n], dtype=torch.float64)
    torch.optim.AdamW(
        [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": wd},
         {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps).step()
    return {n: p.detach().numpy() for n, p in named}


def assert_adamw_step_equals_torch(cfg, engine, model, inputs, targets, *, lr, betas, eps, wd):
    """The engine's first AdamW step (just taken; `model`: torch's before it) equals
    torch's, compared where fp32 rounding is not amplified, so that it holds on any CPU. (Adam's
    first step is lr * g / (|g| + eps): where |g| ~ eps, rounding noise in g becomes an lr-sized
    difference in the weights, by an amount that differs between CPUs.)
    - The gradient: within 100x the error of torch's fp32 gradient (measured here) of torch's
      fp64 gradient, per tensor in L2.
    - The update: every weight within a few fp32 roundings of torch.optim.AdamW applied in fp64
      to that same gradient (lr * 16 ulp for the update's fp32 arithmetic, 2 ulp of the weight).
    Returns (torch's fp32 params before the step, torch's fp32 loss, our params after it)."""
    before = torch_params(model)
    loss32, grads32 = torch_gradients(model, inputs, targets, torch.float32)
    _, grads64 = torch_gradients(model, inputs, targets, torch.float64)
    ours = adam_gradient(cfg, engine.state(), betas[0])
    assert sorted(ours) == sorted(grads64)
    for name, ref in grads64.items():
        err = lambda g: np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-300)
        bound = 100 * max(err(grads32[name]), 2.0 ** -24)
        got = err(ours[name])
        assert got <= bound, f"{name}: gradient error {got:.2e} > {bound:.2e}"
    expected = torch_adamw_from(model, ours, lr=lr, betas=betas, eps=eps, wd=wd)
    after = as_hf(cfg, engine.params())
    for name, ref in expected.items():
        tol = 2 * np.spacing(np.abs(after[name])) + lr * 16 * 2.0 ** -24
        worst = np.max(np.abs(after[name] - ref) / tol)
        assert worst <= 1, f"{name}: weights {worst:.1f}x past fp32 rounding of AdamW's step"
    return before, loss32, after


def save_checkpoint(run_dir, cfg, state, step, **data):
    """A checkpoint in the agreed layout (see the common brief); `data`: DataConfig fields."""
    manager = ocp.CheckpointManager(os.path.join(run_dir, "checkpoints"),
                                    item_names=("state", "meta"))
    data = DataConfig(**{"seq_len": 64, **data})
    meta = {"step": step, "config": to_dict(Config(model=cfg, data=data)),
            "data_state": {"epoch": 0, "index": 0}}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    manager.close()


@pytest.fixture(scope="module")
def run_dirs(hf_dirs, tmp_path_factory):
    """arch -> a run directory whose checkpoint (step 3) holds the imported model of `arch`,
    perturbed so the export cannot pass by copying the source files, plus an older step 1; made
    on first use, as (path, cfg, {HF name: expected fp32 tensor})."""
    made = {}

    def make(arch):
        if arch not in made:
            cfg, _, _, params = import_model(hf_dirs[arch][1])
            params = jax.tree.map(
                lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params)
            units = [params["stages"], *params["layers"]]
            state = {"stages": {"params": units[0], "opt_state": optax.adam(1e-3).init(units[0])},
                     "layers": [{"params": u, "opt_state": optax.adam(1e-3).init(u)}
                                for u in units[1:]]}
            path = str(tmp_path_factory.mktemp(f"run_{arch}"))
            save_checkpoint(path, cfg, jax.tree.map(jnp.zeros_like, state), 1)
            save_checkpoint(path, cfg, state, 3)
            made[arch] = path, cfg, as_hf(cfg, params)
        return made[arch]

    return make


@pytest.fixture(scope="module")
def run_dir(run_dirs):
    """The qwen2 run directory (several shards, biases)."""
    return run_dirs("qwen2")


def export(*args):
    from importlib import util
    spec = util.spec_from_file_location("export_hf", os.path.join(ROOT, "scripts", "export_hf.py"))
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(args))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_export_from_pretrained_round_trip_is_exact(run_dirs, arch, tmp_path):
    path, cfg, expected = run_dirs(arch)
    out = str(tmp_path / "exported")
    assert export("--run-dir", path, "--out", out, "--shard-size", "30KB") == 0
    files = os.listdir(out)
    assert hf.INDEX_FILE in files and sum(f.endswith(".safetensors") for f in files) >= 3
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == ARCHS[arch][1]
    loaded = torch_params(model)
    assert sorted(loaded) == sorted(expected)
    for name in expected:  # identical, not close: fp32 in, fp32 out
        np.testing.assert_array_equal(loaded[name], expected[name], err_msg=name)
    if arch == "phi3":  # written fused, as Phi-3 stores them
        assert any(name.endswith("qkv_proj.weight") for name in expected)
        assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in expected)
    if arch in ("qwen3", "phi3"):  # the config means the same model too: logits are ours
        if arch == "qwen3":
            assert model.config.head_dim == 32 and not model.config.attention_bias
        model.config._attn_implementation = "eager"
        assert_matches_transformers(model.eval(), out, *batch())
    # and our own importer reads the export back to the same config and weights
    cfg2, _, _, params2 = import_model(out)
    assert dataclasses.replace(cfg2, from_hf="") == dataclasses.replace(cfg, from_hf="")
    assert_close(as_hf(cfg2, params2), expected, 0.0)


def test_export_older_step_in_one_bf16_file(run_dir, tmp_path):
    path, _, _ = run_dir
    out = str(tmp_path / "bf16")
    assert export("--run-dir", path, "--out", out, "--step", "1", "--dtype", "bfloat16") == 0
    # one shard: no index; the source's generation_config.json (save_pretrained writes one)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, p in model.named_parameters():  # step 1 holds zeros
        assert p.dtype == torch.bfloat16 and not p.float().any(), name
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


def test_export_tied_model_bf16(hf_dirs, tmp_path):
    """Tied embeddings export without lm_head and come back tied; bf16 rounds like torch does."""
    cfg, _, _, params = import_model(hf_dirs["llama"][1])
    units = [params["stages"], *params["layers"]]
    state = {"stages": {"params": units[0], "opt_state": {}},
             "layers": [{"params": u, "opt_state": {}} for u in units[1:]]}
    save_checkpoint(str(tmp_path / "run"), cfg, state, 5)
    out = str(tmp_path / "out")
    assert export("--run-dir", str(tmp_path / "run"), "--out", out, "--dtype", "bfloat16") == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name, p in model.named_parameters():
        want = torch.tensor(as_hf(cfg, params)[name]).bfloat16()
        assert torch.equal(p.detach(), want), name


def test_export_bad_requests_exit_2(run_dir, tmp_path, capsys):
    path, _, _ = run_dir
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    cases = [(["--run-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")], "no checkpoints"),
             (["--run-dir", path, "--out", str(tmp_path / "o2"), "--step", "2"],
              "no checkpoint at step 2"),
             (["--run-dir", path, "--out", str(tmp_path / "full")], "not overwriting"),
             (["--run-dir", path, "--out", str(tmp_path / "o3"), "--shard-size", "big"],
              "--shard-size")]
    for args, message in cases:
        assert export(*args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert (tmp_path / "full" / "keep.txt").read_text() == "user data"
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# -----------------------------------------------------------------------------
# bad directories


def _break(path, how):
    if how == "missing config.json":
        os.remove(os.path.join(path, "config.json"))
    elif how == "missing shard":
        index = json.load(open(os.path.join(path, hf.INDEX_FILE)))
        os.remove(os.path.join(path, sorted(set(index["weight_map"].values()))[1]))
    elif how in ("shape mismatch", "unsupported architecture", "unsupported rope",
                 "window on some layers", "window on some layer_types", "qwen3 attention_bias",
                 "phi3 partial_rotary_factor", "phi3 longrope"):
        config = json.load(open(os.path.join(path, "config.json")))
        if how == "qwen3 attention_bias":  # Qwen3's q/k/v/o biases: not supported
            config["attention_bias"] = True
        elif how == "phi3 partial_rotary_factor":  # top-level, as Phi-4-mini writes it
            config["rope_parameters"].pop("partial_rotary_factor", None)
            config["partial_rotary_factor"] = 0.5
        elif how == "phi3 longrope":  # as the 128K Phi-3 models write it
            config.pop("rope_parameters")
            config["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 8,
                                      "long_factor": [2.0] * 8}
        elif how.startswith("window on some"):  # qwen2: layer i slides iff i >= max_window_layers
            config.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
            if how == "window on some layers":
                config.pop("layer_types", None)
            else:
                config["layer_types"] = ["sliding_attention", "full_attention"]
        elif how == "shape mismatch":
            config["intermediate_size"] = 128
        elif how == "unsupported architecture":
            config["architectures"] = ["GPT2LMHeadModel"]
        else:
            config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
    elif how == "pickle only":
        index = json.load(open(os.path.join(path, hf.INDEX_FILE)))
        for f in set(index["weight_map"].values()):
            os.remove(os.path.join(path, f))
        os.remove(os.path.join(path, hf.INDEX_FILE))
        open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"not to be unpickled")


BAD_DIRS = {"missing config.json": re.escape("config.json not found"),
            "missing shard": re.escape("is missing (listed in model.safetensors.index.json)"),
            "shape mismatch": r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape \((96, 64|64, 96)\), "
                              r"config\.json implies \((128, 64|64, 128)\)",
            "unsupported architecture": re.escape(
                "unsupported architecture GPT2LMHeadModel (supported: LlamaForCausalLM, "
                "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
                "Gemma3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM)"),
            "qwen3 attention_bias": re.escape("config.json: attention_bias=true is not supported"),
            "phi3 partial_rotary_factor": re.escape(
                "config.json: partial_rotary_factor 0.5 is not supported (only 1.0)"),
            "phi3 longrope": re.escape("rope scaling type 'longrope' is not supported"),
            "unsupported rope": re.escape("rope scaling type 'yarn' is not supported"),
            "window on some layers": re.escape("use_sliding_window, max_window_layers give 1 of 2 "
                                               "layers a sliding window"),
            "window on some layer_types": re.escape("layer_types give 1 of 2 layers a sliding "
                                                    "window"),
            "pickle only": re.escape("never pickled")}


@pytest.mark.parametrize("how", BAD_DIRS)
def test_bad_directory_is_one_line_exit_2(hf_dirs, tmp_path, capsys, how):
    path = str(tmp_path / "model")
    shutil.copytree(hf_dirs[how.split()[0] if how.startswith(("qwen3", "phi3")) else "qwen2"][1],
                    path)
    _break(path, how)
    assert run_cli(lambda: load_config(None, [f"model.from_hf={path}"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert re.search(BAD_DIRS[how], err[0]) and path in err[0], err[0]


def test_train_cli_bad_directory_exit_2(tmp_path, capsys):
    """scripts/train.py's main (commands.train), in-process; through the script itself:
    tests/test_bad_inputs.py."""
    from megatrain_jax import commands

    assert commands.train([f"model.from_hf={tmp_path}/absent", f"run_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip() == f"error: model.from_hf: {tmp_path}/absent is not a directory"
    assert not (tmp_path / "run").exists()


def test_config_keys_must_agree_with_the_hf_directory(hf_dirs):
    path = hf_dirs["llama"][1]
    cfg = load_config(None, [f"model.from_hf={path}", "model.hidden_size=64"])  # agrees: fine
    assert cfg.model.hidden_size == 64 and cfg.model.tie_embeddings
    with pytest.raises(Exception, match=r"model.num_layers=4 conflicts with .*config.json \(2\)"):
        load_config(None, [f"model.from_hf={path}", "model.num_layers=4"])


def test_the_config_layer_reads_no_hf_directory(hf_dirs):
    """config.load_config imports nothing of hf: a config with model.from_hf is refused there by
    name, and recipes.load_config reads it."""
    from megatrain_jax import config
    path = hf_dirs["llama"][1]
    with pytest.raises(config.ConfigError, match=r"model.from_hf=.*recipes.load_config"):
        config.load_config(None, [f"model.from_hf={path}"])
    assert load_config(None, [f"model.from_hf={path}"]).model.num_layers == 2


def test_finetune_from_hf_on_jsonl_starts_at_the_hf_models_loss(hf_dirs, tmp_path):
    """The README workflow: model.from_hf + a JSONL corpus + a tokenizer.json through train();
    the first step's loss is transformers' loss on the same batch (the weights were imported)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatrain_jax.recipes import load_dataset
    from megatrain_jax.train import train

    words = [f"w{i}" for i in range(90)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["</s>", "<unk>", *words])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 30)))}) + "\n")
    model, path = hf_dirs["mistral"]
    cfg = load_config(None, [f"model.from_hf={path}", f"data.path={tmp_path}/train.jsonl",
                             f"data.tokenizer={tmp_path}/tokenizer.json", "data.eos_token=</s>",
                             "data.seq_len=16", "data.batch_size=2", "train.steps=2",
                             "train.compute_dtype=float32", f"run_dir={tmp_path}/run"])
    history = train(cfg, log=lambda *a: None)
    inputs, targets = load_dataset(cfg).next_batch()  # the batch train() took first
    with torch.no_grad():
        _, ref_loss = torch_loss(model, inputs[0], targets[0])
    np.testing.assert_allclose(history[0]["loss"], ref_loss.item(), rtol=1e-5)
    # ... and the run's final checkpoint exports to a model transformers loads, trained
    out = str(tmp_path / "hf")
    assert export("--run-dir", str(tmp_path / "run"), "--out", out) == 0
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(tuned).__name__ == "MistralForCausalLM" and tuned.config.sliding_window == 4096
    before, after = torch_params(model), torch_params(tuned)
    assert sorted(before) == sorted(after)
    assert all(np.isfinite(after[n]).all() for n in after)
    assert any(not np.allclose(before[n], after[n]) for n in after)  # the steps moved it


def test_export_of_a_chat_run_carries_the_chat_template_it_trained_with(hf_dirs, tmp_path):
    """An SFT run on a tokenizer.json whose chat template sits beside it (tokenizer_config.json):
    the export renders conversations as the run did, with transformers and as a DPO run's
    data.tokenizer; a tokenizer without one is refused naming the format that needs it."""
    from megatrain_jax.chat import ChatTemplate
    from megatrain_jax.data import DataError
    bundled = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tokenizer", "tokenizer.json")
    cfg, _, _, params = import_model(hf_dirs["llama"][1])  # its directory has no tokenizer
    units = [params["stages"], *params["layers"]]
    state = {"stages": {"params": units[0], "opt_state": {}},
             "layers": [{"params": u, "opt_state": {}} for u in units[1:]]}
    save_checkpoint(str(tmp_path / "run"), cfg, state, 2, format="sft", tokenizer=bundled)
    out = str(tmp_path / "out")
    lines = []
    hf.export_checkpoint(str(tmp_path / "run"), out, log=lines.append)
    assert "the chat template it trained with" in lines[-1], lines[-1]
    trained = ChatTemplate.for_tokenizer(bundled)
    messages = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yes."}]
    exported = ChatTemplate.for_tokenizer(os.path.join(out, "tokenizer.json"), "data.format=preference")
    assert exported.render(messages) == trained.render(messages)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.apply_chat_template(messages, tokenize=False) == trained.render(messages)
    os.remove(os.path.join(out, "tokenizer_config.json"))
    with pytest.raises(DataError, match="^data.format=preference needs the model's chat template"):
        ChatTemplate.for_tokenizer(os.path.join(out, "tokenizer.json"), "data.format=preference")


def test_export_carries_the_tokenizer_so_both_auto_classes_load_it(hf_dirs, tmp_path):
    """The source model's tokenizer files, generation config and chat template are copied: the
    export loads with AutoTokenizer (the same ids, the same chat template) and with
    AutoModelForCausalLM (the same weights: the checkpoint holds the import)."""
    source = str(tmp_path / "source")
    shutil.copytree(hf_dirs["llama"][1], source)
    fast = word_level_tokenizer()
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
    fast.save_pretrained(source)
    transformers.GenerationConfig(eos_token_id=0, max_new_tokens=7).save_pretrained(source)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "generation_config.json"} <= set(os.listdir(source))
    cfg, _, _, params = import_model(source)
    units = [params["stages"], *params["layers"]]
    state = {"stages": {"params": units[0], "opt_state": {}},
             "layers": [{"params": u, "opt_state": {}} for u in units[1:]]}
    save_checkpoint(str(tmp_path / "run"), cfg, state, 2)
    out = str(tmp_path / "out")
    lines = []
    hf.export_checkpoint(str(tmp_path / "run"), out, log=lines.append)
    assert lines[-1].startswith("copied tokenizer.json, tokenizer_config.json, ") and source in lines[-1]
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    text = "w3 w17 w89 w0"
    assert loaded(text)["input_ids"] == fast(text)["input_ids"] == [5, 19, 91, 2]
    messages = [{"role": "user", "content": "w1 w2"}]
    assert (loaded.apply_chat_template(messages, tokenize=False)
            == fast.apply_chat_template(messages, tokenize=False) == "w1 w2 </s> ")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.max_new_tokens == 7
    expected = torch_params(hf_dirs["llama"][0])
    loaded_params = torch_params(model)
    for name in expected:
        np.testing.assert_array_equal(loaded_params[name], expected[name], err_msg=name)
    # a run whose source directory is gone: the model alone, and a line saying so
    shutil.rmtree(source)
    hf.export_checkpoint(str(tmp_path / "run"), str(tmp_path / "out2"), log=lines.append)
    assert lines[-1].startswith(f"no tokenizer files copied: model.from_hf={source} of the run "
                                f"is not there")
    assert sorted(os.listdir(tmp_path / "out2")) == ["config.json", "model.safetensors"]
