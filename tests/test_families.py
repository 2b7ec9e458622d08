"""Every family of docs/finetuning.md trained as a user trains it: `scripts/train.py
model.from_hf=DIR data.path=... data.tokenizer=...` (its main, commands.train, in-process), with
the host update the command chooses on a CPU (the fused AdamW kernel called directly), one step,
whose loss is transformers' on the same window."""

import copy
import json
import logging

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import test_hf  # noqa: E402
import test_moe  # noqa: E402
from test_gemma3 import make_gemma  # noqa: E402

from megatrain_jax import commands  # noqa: E402
from megatrain_jax.engine import fused_adamw  # noqa: E402
from megatrain_jax.recipes import load_config, load_dataset  # noqa: E402

pytestmark = pytest.mark.skipif(fused_adamw.kernel() is None,
                                reason="no C++ compiler: no direct update")

# docs/finetuning.md's table, each as its tests make it (tiny, random, fp32, eager attention)
FAMILIES = {
    "llama": lambda: test_hf.make_hf_model("llama"),
    "mistral": lambda: test_hf.make_hf_model("mistral"),
    "qwen2": lambda: test_hf.make_hf_model("qwen2"),
    "qwen3": lambda: test_hf.make_hf_model("qwen3"),
    "phi3": lambda: test_hf.make_hf_model("phi3"),
    "gemma3": make_gemma,  # a local layer (window 5 of the 12 tokens) and a global one
    "mixtral": lambda: test_moe.make_hf_model("mixtral"),
    "qwen3_moe": lambda: test_moe.make_hf_model("qwen3_moe"),
}
DIRECT = "host update: the fused AdamW kernel, called directly"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file of the tokenizer's words and its tokenizer.json: {"path", "tokenizer"}."""
    path = tmp_path_factory.mktemp("corpus")
    test_hf.word_level_tokenizer().save_pretrained(path)
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(90)]
    lines = [" ".join(rng.choice(words, size=rng.integers(5, 30))) for _ in range(40)]
    (path / "train.txt").write_text("\n".join(lines) + "\n")
    return {"path": str(path / "train.txt"), "tokenizer": str(path / "tokenizer.json")}


def transformers_loss(model, inputs, targets, dtype) -> float:
    """transformers' mean cross-entropy on the window (a MoE model's: + router_aux_loss_coef *
    its load-balancing loss, as it computes it with output_router_logits), in `dtype`."""
    model = copy.deepcopy(model).to(dtype)
    coef = getattr(model.config, "router_aux_loss_coef", None)
    if coef is not None:  # the experts' loop, which runs in fp64 too (grouped_mm does not)
        model.set_experts_implementation("eager")
    with torch.no_grad():
        out = model(torch.tensor(inputs, dtype=torch.long),
                    **({"output_router_logits": True} if coef is not None else {}))
        loss = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1]),
            torch.tensor(targets, dtype=torch.long).reshape(-1))
        if coef is not None:
            loss = loss + coef * out.aux_loss
    return loss.item()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_step_from_the_command_line_starts_at_transformers_loss(family, corpus, tmp_path,
                                                                    caplog):
    model = FAMILIES[family]()
    model.save_pretrained(tmp_path / "model")
    args = [f"model.from_hf={tmp_path}/model", f"data.path={corpus['path']}",
            f"data.tokenizer={corpus['tokenizer']}", "data.eos_token=</s>", "data.seq_len=12",
            "data.batch_size=2", "train.steps=1", "train.compute_dtype=float32",
            f"run_dir={tmp_path}/run"]
    caplog.set_level(logging.INFO, logger="megatrain_jax.engine.host")
    assert commands.train(args) == 0
    assert any(r.getMessage().startswith(DIRECT) for r in caplog.records), caplog.text
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        ours = json.loads(f.readline())["loss"]

    inputs, targets = load_dataset(load_config(None, args)).next_batch()  # the step's window
    inputs, targets = inputs[0], targets[0]  # its one micro-batch
    assert inputs.shape == (2, 12)
    ref = transformers_loss(model, inputs, targets, torch.float64)
    # As tests/test_hf.py bounds a gradient: within 100x the error of transformers' own fp32
    # loss (measured here) of its fp64 one.
    err32 = abs(transformers_loss(model, inputs, targets, torch.float32) - ref) / abs(ref)
    assert abs(ours - ref) / abs(ref) <= 100 * max(err32, 2.0 ** -24), (ours, ref)
