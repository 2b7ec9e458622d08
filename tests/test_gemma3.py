"""Gemma 3 (Gemma3ForCausalLM) against transformers: import (logits, also soft-capped, also of
Gemma3ForConditionalGeneration's text part), one streamed AdamW step with one compiled block for
local and global layers, a layer's kind out of every optimizer's reach (and a checkpoint that
held it as a parameter), the long-context execution, export -> from_pretrained,
import(export), the older config.json convention, and unsupported options."""

import dataclasses
import json
import os
import shutil

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
import optax  # noqa: E402
from test_hf import (ADAMW, V, adamw_engine, as_hf, assert_adamw_step_equals_torch,  # noqa: E402
                     assert_close, batch, eager_fp32_perturbed, export, hf_engine, import_model,
                     save_checkpoint)

from megatrain_jax import checkpoint, generate, hf  # noqa: E402
from megatrain_jax.cli import run_cli  # noqa: E402
from megatrain_jax.recipes import load_config  # noqa: E402  (model.from_hf read too)
from megatrain_jax.model import Execution  # noqa: E402

# A local and a global layer; a window (5) shorter than the batch's 12 tokens; a query scale
# (24**-0.5) that is not head_dim's (16**-0.5); linear RoPE scaling on the global layers only.
GEMMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
             query_pre_attn_scalar=24, sliding_window=5,
             layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1e5},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}})


def make_gemma(seed: int = 0):
    torch.manual_seed(seed)
    # Gemma's norms start at 0 (they scale by 1 + w): a larger perturbation makes them matter
    return eager_fp32_perturbed(
        transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA)), 0.3)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3"))
    make_gemma().save_pretrained(path)
    return path


def our_logits(cfg, stages_def, block_def, params, inputs):
    def forward(params, inputs):  # jitted: op by op takes longer than compiling
        first, last = nnx.merge(stages_def, params["stages"])
        x = first(inputs)
        for p in params["layers"]:
            x = nnx.merge(block_def, p)(x)
        return last.logits(x)
    return np.asarray(jax.jit(forward)(params, inputs))


def ref_logits(model, inputs):
    with torch.no_grad():
        return model(torch.tensor(inputs, dtype=torch.long)).logits.numpy()


def test_import_matches_transformers_logits(gemma_dir):
    cfg, stages_def, block_def, params = import_model(gemma_dir)
    assert (cfg.norm_offset, cfg.post_norms, cfg.activation, cfg.scale_embeddings, cfg.qk_norm,
            cfg.tie_embeddings) == (True, True, "gelu_tanh", True, True, True)
    assert cfg.layer_types == tuple(GEMMA["layer_types"]) and cfg.sliding_window == 5
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_local_theta) == (
        1e5, "linear", 2.0, 1e3)
    assert cfg.query_pre_attn_scalar == 24 and cfg.head_size == 16
    assert [float(p["sliding"]) for p in params["layers"]] == [1.0, 0.0]
    model = make_gemma()
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())  # the extra norms too
    inputs, _ = batch(seed=4, t=12)
    np.testing.assert_allclose(our_logits(cfg, stages_def, block_def, params, inputs),
                               ref_logits(model, inputs), rtol=1e-5, atol=1e-5)


def test_long_context_execution_gives_the_same_blocks(gemma_dir):
    """Blockwise attention in blocks of 4 (the window of 5 spans block boundaries) in either
    lax.cond branch, and the MLP (GeGLU, post-norm) in tiles of 5 tokens, give each layer's
    output as the dense path does (their gradients: tests/test_attention.py, test_model.py)."""
    cfg = hf.model_config_from_hf(gemma_dir)
    source = hf.HFSource(gemma_dir)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 12, cfg.hidden_size)),
                    jnp.float32)
    outputs = []
    for execution in (Execution(), Execution(attention="blockwise", attention_block=4,
                                             tile_size=5)):
        blocks = [nnx.split(hf.load_block(cfg, source, i, execution)) for i in range(2)]
        forward = jax.jit(lambda w, block_def=blocks[0][0]: nnx.merge(block_def, w)(x))
        outputs.append([np.asarray(forward(nnx.to_pure_dict(w))) for _, w in blocks])
    for long_context, dense in zip(*outputs[::-1]):
        np.testing.assert_allclose(long_context, dense, rtol=1e-5, atol=1e-5)


def test_final_logit_softcapping_matches_transformers_logits(tmp_path):
    """Gemma 3 sets it null; where a config sets it, the logits are capped (the chunked loss and
    its backward with a cap: tests/test_loss.py)."""
    torch.manual_seed(1)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **GEMMA, final_logit_softcapping=0.5)).float()
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path)
    cfg, stages_def, block_def, params = import_model(str(tmp_path))
    assert cfg.final_logit_softcapping == 0.5
    inputs, _ = batch(seed=3, t=12)
    ref = ref_logits(model.eval(), inputs)
    assert 0.4 < np.abs(ref).max() < 0.5  # the cap binds: uncapped, these logits reach ~0.6
    np.testing.assert_allclose(our_logits(cfg, stages_def, block_def, params, inputs), ref,
                               rtol=1e-5, atol=1e-5)


def test_one_streamed_adamw_step_equals_torch_adamw_in_one_compiled_block(gemma_dir):
    """The step equals torch's; the layer's kind is data, so one compiled layer forward and one
    backward serve the local and the global layer."""
    model = make_gemma()
    cfg, engine = adamw_engine(gemma_dir)
    inputs, targets = batch(seed=2)
    loss = float(engine.train_step(inputs[None], targets[None])["loss"])
    params = engine.params()
    assert engine.functions.layer_fwd._cache_size() == 1
    assert engine.functions.layer_bwd._cache_size() == 1
    # the layers' kinds reach the blocks as Constants, beside the weights
    assert [float(k["sliding"]) for k in engine.block_constants] == [1.0, 0.0]
    assert all("sliding" not in p for p in params["layers"])
    before, ref_loss, after = assert_adamw_step_equals_torch(cfg, engine, model, inputs, targets,
                                                             **ADAMW)
    engine.close()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name in after:  # the step moved every tensor (else the comparison proves little)
        assert not np.allclose(after[name], before[name]), name


def paths(tree) -> list:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def test_a_plain_adamw_cannot_turn_a_local_layer_global(gemma_dir):
    """optax.adamw with its default mask decays every parameter, scalars too: at weight decay 300
    and lr 1e-3 a parameter shrinks 0.7x a step, so a kind held as one (1.0 local, read as > 0.5)
    would be global after two steps (lr 3e-4, wd 0.1: ~23K steps). The kind is a Constant: in no
    tree the optimizer sees, and the trained blocks still run as the config says."""
    cfg, engine = hf_engine(gemma_dir, optax.adamw(1e-3, weight_decay=300.0))
    inputs, targets = batch(seed=2)
    for _ in range(2):
        engine.train_step(inputs[None], targets[None])
    assert not [p for p in paths(engine.state()) if "sliding" in p]
    loss = float(engine.evaluate(inputs[None], targets[None])["loss"])
    params = engine.params()

    def forward_loss(kinds):  # the trained weights, each layer of the given kind
        layers = [{**p, "sliding": jnp.float32(k)} for p, k in zip(params["layers"], kinds)]
        logits = our_logits(cfg, engine.stages_graphdef, engine.block_graphdef,
                            {"stages": params["stages"], "layers": layers}, inputs)
        return float(optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean())

    engine.close()
    as_configured, both_global = forward_loss([1.0, 0.0]), forward_loss([0.0, 0.0])
    assert abs(both_global - as_configured) > 1e-3 * as_configured  # the kind matters here
    # (a streamed and a whole fp32 forward of the same blocks: as tests/test_eval.py compares)
    assert loss == pytest.approx(as_configured, rel=1e-6, abs=1e-6)


def test_a_checkpoint_holding_the_kind_as_a_parameter_is_refused_naming_it(gemma_dir, tmp_path):
    """Before the kind was a Constant, checkpoints held it (and its Adam moments) in each layer's
    params, perhaps decayed: resuming from one is one line naming the leaf, and the engine is left
    untouched; sampling from it reads the kind from the config, and it exports."""
    tx = optax.adamw(1e-3)
    cfg, engine = hf_engine(gemma_dir, tx)
    state = jax.tree.map(np.array, engine.state())
    old = dict(state, layers=[])
    for i, layer in enumerate(state["layers"]):
        params = {**layer["params"], "sliding": np.float32([0.49, 0.0][i])}  # layer 0 decayed
        old["layers"].append({"params": params, "opt_state": tx.init(params)})
    save_checkpoint(str(tmp_path), cfg, old, 2)
    save_checkpoint(str(tmp_path), cfg, state, 3)  # as checkpoints are written now
    for step in (2, 3):
        model = generate.from_run(str(tmp_path), step)
        assert [float(model.block(i, Execution()).sliding[...]) for i in range(2)] == [1.0, 0.0]
        model.close()
    assert export("--run-dir", str(tmp_path), "--step", "2", "--out", str(tmp_path / "hf")) == 0
    manager = checkpoint.make_manager(str(tmp_path / "checkpoints"), async_save=False)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.restore(manager, engine, 2)
    manager.close()
    assert str(e.value) == (f"checkpoint step 2 in {tmp_path}/checkpoints does not match this "
                            f"model: layers/0/params/sliding has shape () float32 in the "
                            f"checkpoint, absent in the model")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, engine.state()), state)
    engine.close()


def test_export_loads_in_transformers_and_reimports_exactly(gemma_dir, tmp_path):
    cfg, stages_def, block_def, params = import_model(gemma_dir)
    # perturbed, so the export cannot pass by copying the source files
    params = jax.tree.map(lambda p: p + 0.01 * jnp.sin(jnp.arange(p.size).reshape(p.shape)),
                          params)
    # a checkpoint holds the parameters, not the layers' kinds (Constants)
    units = [params["stages"], *[{k: v for k, v in p.items() if k != "sliding"}
                                 for p in params["layers"]]]
    state = {"stages": {"params": units[0], "opt_state": {}},
             "layers": [{"params": u, "opt_state": {}} for u in units[1:]]}
    run = str(tmp_path / "run")
    save_checkpoint(run, cfg, state, 2)
    out = str(tmp_path / "exported")
    assert export("--run-dir", run, "--out", out) == 0
    written = json.load(open(os.path.join(out, "config.json")))
    assert written["model_type"] == "gemma3_text" and "hidden_act" not in written

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == GEMMA["layer_types"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.config._attn_implementation = "eager"
    inputs, _ = batch(seed=5, t=12)
    np.testing.assert_allclose(ref_logits(model.eval(), inputs),
                               our_logits(cfg, stages_def, block_def, params, inputs),
                               rtol=1e-5, atol=1e-5)

    cfg2, _, _, params2 = import_model(out)
    assert dataclasses.replace(cfg2, from_hf="") == dataclasses.replace(cfg, from_hf="")
    assert_close(as_hf(cfg2, params2), as_hf(cfg, params), 0.0)  # bit-exact
    assert [float(p["sliding"]) for p in params2["layers"]] == [1.0, 0.0]


def test_text_part_of_gemma3_for_conditional_generation(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: its text decoder imports (the
    vision tower is never read), gives the multimodal model's text-only logits, and exports as a
    Gemma3ForCausalLM config without the vision keys."""
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    config = transformers.Gemma3Config(  # image tokens outside the batch's ids (< V)
        text_config={**GEMMA, "vocab_size": V + 3}, vision_config=vision.to_dict(),
        mm_tokens_per_image=4, boi_token_index=V, eoi_token_index=V + 1, image_token_index=V + 2)
    torch.manual_seed(2)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    cfg, stages_def, block_def, params = import_model(str(tmp_path))
    assert cfg.vocab_size == V + 3 and cfg.layer_types == tuple(GEMMA["layer_types"])
    inputs, _ = batch(seed=8, t=12)
    np.testing.assert_allclose(our_logits(cfg, stages_def, block_def, params, inputs),
                               ref_logits(model.eval(), inputs), rtol=1e-5, atol=1e-5)
    written = hf.hf_config(cfg, dtype="float32", max_position_embeddings=64,
                           base=hf.read_hf_config(str(tmp_path)))
    assert written["architectures"] == ["Gemma3ForCausalLM"]
    assert not {"text_config", "vision_config", "mm_tokens_per_image"} & set(written)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps(written))
    text = transformers.AutoConfig.from_pretrained(tmp_path / "text")
    assert type(text).__name__ == "Gemma3TextConfig" and text.layer_types == GEMMA["layer_types"]


def test_older_config_convention_reads_the_same(gemma_dir, tmp_path):
    """transformers < 5 writes sliding_window_pattern, rope_theta, rope_local_base_freq and
    rope_scaling (of the global layers) instead of layer_types and rope_parameters."""
    path = tmp_path / "old"
    shutil.copytree(gemma_dir, path)
    config = json.load(open(path / "config.json"))
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(sliding_window_pattern=2, rope_theta=1e5, rope_local_base_freq=1e3,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    json.dump(config, open(path / "config.json", "w"))
    new, old = hf.model_config_from_hf(gemma_dir), hf.model_config_from_hf(str(path))
    assert dataclasses.replace(old, from_hf="") == dataclasses.replace(new, from_hf="")


UNSUPPORTED = {
    "attn_logit_softcapping": ({"attn_logit_softcapping": 50.0},
                               "attn_logit_softcapping=50.0 is not supported"),
    "hidden_activation": ({"hidden_activation": "relu"},
                          "hidden_activation 'relu' is not supported (only gelu_pytorch_tanh)"),
    "bidirectional": ({"use_bidirectional_attention": True},
                      "use_bidirectional_attention=true is not supported"),
    "local rope scaling": ({"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}},
        "rope scaling of the sliding_attention layers is not supported"),
    "multimodal": ({"architectures": ["PaliGemmaForConditionalGeneration"], "text_config": {}},
                   "a multimodal model (PaliGemmaForConditionalGeneration) is not supported"),
}


@pytest.mark.parametrize("how", UNSUPPORTED)
def test_unsupported_gemma_option_is_one_line_exit_2(gemma_dir, tmp_path, capsys, how):
    change, message = UNSUPPORTED[how]
    path = str(tmp_path / "model")
    shutil.copytree(gemma_dir, path)
    config = json.load(open(os.path.join(path, "config.json")))
    json.dump({**config, **change}, open(os.path.join(path, "config.json"), "w"))
    assert run_cli(lambda: load_config(None, [f"model.from_hf={path}"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert message in err[0] and path in err[0], err[0]


def test_export_refuses_gemma_options_without_gemma(gemma_dir):
    """Only Gemma3ForCausalLM can write Gemma's options, and only all of them together; interleaved
    layers are written for Gemma 3 only."""
    cfg = dataclasses.replace(hf.model_config_from_hf(gemma_dir), from_hf="")
    write = lambda c: hf.hf_config(c, dtype="float32", max_position_embeddings=64)
    assert write(cfg)["architectures"] == ["Gemma3ForCausalLM"]
    with pytest.raises(hf.HFError, match=r"^export: model\.norm_offset=True, .* only "
                                         r"Gemma3ForCausalLM can write, which also needs "
                                         r"model\.post_norms=True$"):
        write(dataclasses.replace(cfg, post_norms=False))
    plain = dataclasses.replace(cfg, **{k: getattr(hf.ModelConfig, k) for k in hf.GEMMA3_ONLY})
    with pytest.raises(hf.HFError, match=r"model\.layer_types .* Gemma 3 models only"):
        write(plain)
    assert write(dataclasses.replace(plain, layer_types=(), sliding_window=0))[
        "architectures"] == ["Qwen3ForCausalLM"]  # q/k norms, nothing of Gemma's
