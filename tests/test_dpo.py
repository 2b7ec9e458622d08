"""DPO: the loss and its gradient against TRL's formula in torch on a transformers model (with
micro-batches and accumulation), the reference pass against transformers' log-probs, the
reference cache (reused, rebuilt, refused), preference data and its bad inputs, the tiny config
through the CLI."""

import json
import os
import re
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
# configs/dpo_tiny.yaml with a smaller model and batch (one set of shapes: compiled once)
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "data.batch_size=8"]


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


def test_chunked_token_logprobs_and_their_gradient_equal_dense():
    """Per-token log-probs and their gradient under any per-token cotangent equal the dense
    log_softmax's, with padded token chunks, vocabulary chunks and a soft cap (the DPO test below
    covers the tied "vd" layout without them)."""
    layout, vocab_chunk, softcap = "dv", 24, 5.0
    from megatrain_jax.loss import chunked_token_logprobs
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(16, 60) if layout == "dv" else (60, 16)), jnp.float32)
    targets = rng.integers(0, 60, (2, 7)).astype(np.int32)
    targets[0, :3] = IGNORE_ID
    cotangent = jnp.asarray(rng.normal(size=(2, 7)), jnp.float32)

    def dense(y, w):
        z = jnp.einsum("btd,dv->btv" if layout == "dv" else "btd,vd->btv", y, w)
        if softcap:
            z = softcap * jnp.tanh(z / softcap)
        logp = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.maximum(targets, 0)[..., None],
                                   -1)[..., 0]
        return jnp.where(targets != IGNORE_ID, logp, 0.0)

    chunked = lambda y, w: chunked_token_logprobs(y, w, jnp.asarray(targets), layout=layout,
                                                  chunk=4, vocab_chunk=vocab_chunk,
                                                  softcap=softcap)
    np.testing.assert_allclose(chunked(y, w), dense(y, w), rtol=1e-5, atol=1e-6)
    grad = lambda f: jax.grad(lambda y, w: jnp.sum(f(y, w) * cotangent), argnums=(0, 1))(y, w)
    for ours, ref in zip(grad(chunked), grad(dense)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)


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


# ----------------------------------------------------------------------------- the reference pass

BUNDLED_PAIRS = os.path.join(ROOT, "megatrain_jax", "texts", "dpo_tiny.jsonl")
BUNDLED_TOKENIZER = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tokenizer")


def write_pairs(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")
    return str(path)


def bundled_pairs(n):
    with open(BUNDLED_PAIRS, encoding="utf-8") as f:
        return [json.loads(line) for line in f][:n]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model, dir): a tiny Qwen2 over the bundled 512-token ChatML tokenizer, saved with its
    tokenizer files, as a local HF model directory is."""
    from test_hf import COMMON
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**COMMON, "vocab_size": 512, "rope_theta": 1e6,
                                         "tie_word_embeddings": False})
    from test_hf import eager_fp32_perturbed
    model = eager_fp32_perturbed(transformers.Qwen2ForCausalLM(config))
    path = tmp_path_factory.mktemp("chat_model")
    model.save_pretrained(str(path))
    for name in os.listdir(BUNDLED_TOKENIZER):
        shutil.copy(os.path.join(BUNDLED_TOKENIZER, name), path / name)
    return model, str(path)


def preference_cfg(tmp_path, data, *overrides, model_dir=None):
    """configs/dpo_tiny.yaml on `data`, with a small random model or the HF model `model_dir`."""
    import yaml

    from megatrain_jax.recipes import load_config  # model.from_hf read too
    config = os.path.join(ROOT, "configs", "dpo_tiny.yaml")
    given = [f"data.path={data}", f"run_dir={tmp_path / 'run'}"]
    if model_dir:  # the architecture from config.json: no model section
        sections = yaml.safe_load(open(config))
        del sections["model"]
        config = tmp_path / "dpo_hf.yaml"
        config.write_text(yaml.safe_dump(sections))
        given += [f"model.from_hf={model_dir}", f"data.tokenizer={model_dir}/tokenizer.json"]
    else:
        given += SMALL
    return load_config(str(config), given + list(overrides))


def build(cfg):
    """(the PreferenceDataset of cfg, its engine on the two CPU devices)."""
    from megatrain_jax.recipes import build_engine, load_data
    dataset, _ = load_data(cfg)
    engine = build_engine(cfg, compute_device=jax.devices("cpu")[0],
                          host_device=jax.devices("cpu")[1])
    return dataset, engine


def test_reference_logps_equal_transformers(chat_model, tmp_path):
    """The streamed reference pass's per-sequence log-probs (micro-batches of whole pairs, the
    last batch wrapped) equal transformers' on the same token rows to 1e-5, and the rows hold the
    chat template's rendering with the completion's tokens only as targets."""
    model, path = chat_model
    data = write_pairs(tmp_path / "pairs.jsonl", bundled_pairs(10))  # 20 rows: batches of 8
    dataset, engine = build(preference_cfg(tmp_path, data, "data.batch_size=4",
                                           "data.micro_batches=2", model_dir=path))
    ours = dpo.reference_logps(engine, dataset)
    engine.close()
    rows = dataset.rows
    with torch.no_grad():
        ref = torch_logps(model, rows["inputs"], rows["targets"]).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # the first pair's chosen: its targets are the completion, as the template closes it
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pair = bundled_pairs(1)[0]
    messages = [{"role": "user", "content": pair["prompt"]}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(messages + [{"role": "assistant", "content": pair["chosen"]}],
                                   tokenize=False)
    ids = tok(full, add_special_tokens=False)["input_ids"]
    n = len(ids) - 1
    np.testing.assert_array_equal(rows["inputs"][0, :n], ids[:-1])
    trained = rows["targets"][0][rows["targets"][0] != IGNORE_ID]
    assert tok.decode(trained) == full[len(prompt):]  # "<answer><|im_end|>\n"


def test_reference_cache_reused_and_rebuilt_on_each_input(tmp_path, monkeypatch):
    """The cache is reused when data, tokenizer and model match; a change to any of them builds a
    new file and leaves the old one as it was; a stale or foreign file at the cache's name is
    refused, named, and not overwritten."""
    from megatrain_jax.data import DataError
    data = write_pairs(tmp_path / "pairs.jsonl", bundled_pairs(6))
    cfg = preference_cfg(tmp_path, data)
    dataset, engine = build(cfg)
    lines = []
    dpo.prepare_reference(cfg, engine, dataset, lines.append)
    (first,) = [f for f in os.listdir(tmp_path / "run") if f.startswith("reference_logps")]
    cached = tmp_path / "run" / first
    before = cached.read_bytes()
    computed = dataset.rows["reference"].copy()
    assert np.all(computed < 0)

    calls = []
    real = dpo.reference_logps
    monkeypatch.setattr(dpo, "reference_logps", lambda *a: calls.append(1) or real(*a))
    dataset.rows["reference"][:] = 0
    dpo.prepare_reference(cfg, engine, dataset, lines.append)
    assert calls == [] and "(key matches)" in lines[-1]
    np.testing.assert_array_equal(dataset.rows["reference"], computed)

    def rebuilt(cfg, dataset, engine):
        dpo.prepare_reference(cfg, engine, dataset, lines.append)
        assert len(calls) == 1 and "saved to" in lines[-1]
        calls.clear()
        assert cached.read_bytes() == before  # the old one untouched
        return lines[-1].rsplit(" ", 1)[1]

    made = set()
    # data: one more pair
    data2 = write_pairs(tmp_path / "pairs2.jsonl", bundled_pairs(7))
    cfg2 = preference_cfg(tmp_path, data2)
    made.add(rebuilt(cfg2, build(cfg2)[0], engine))
    # tokenizer: the same tokenizer.json, another chat template (its default system message)
    tok_dir = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("a helpful", "an honest")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    cfg3 = preference_cfg(tmp_path, data, f"data.tokenizer={tok_dir}/tokenizer.json")
    made.add(rebuilt(cfg3, build(cfg3)[0], engine))
    # model: other starting weights
    cfg4 = preference_cfg(tmp_path, data, "train.seed=1")
    dataset4, engine4 = build(cfg4)
    made.add(rebuilt(cfg4, dataset4, engine4))
    engine4.close()
    assert len(made) == 3 and str(cached) not in made

    # stale: another key's file at this key's name; foreign: not ours at all
    other = sorted(made)[0]
    for content, message in [(open(other, "rb").read(), "stale or foreign reference cache: its "
                                                         "key differs in (data|tokenizer|model)"),
                             (b"not an npz", "not a reference log-prob cache")]:
        cached.write_bytes(content)
        with pytest.raises(DataError, match=f"^{cached}: {message}.*not overwritten"):
            dpo.prepare_reference(cfg, engine, dataset, lines.append)
        assert cached.read_bytes() == content and calls == []
    engine.close()


# ----------------------------------------------------------------------------- preference data


@pytest.fixture(scope="module")
def bundled():
    from megatrain_jax.chat import ChatTemplate
    from megatrain_jax.data import load_tokenizer
    path = os.path.join(BUNDLED_TOKENIZER, "tokenizer.json")
    return load_tokenizer(path), ChatTemplate.for_tokenizer(path)


def test_pair_shapes_masks_and_overlong(tmp_path, bundled):
    """Text, message lists and an implicit prompt give the same sequences; the masks hold the
    completion only (not the prompt's earlier assistant turn); overlong pairs are truncated or
    skipped, and counted."""
    from megatrain_jax.preference import load_pairs
    tok, template = bundled
    user = {"role": "user", "content": "What is 2 + 2?"}
    good, bad = ({"role": "assistant", "content": a} for a in ("2 + 2 = 4.", "2 + 2 = 5."))
    path = write_pairs(tmp_path / "p.jsonl", [
        {"prompt": user["content"], "chosen": good["content"], "rejected": bad["content"]},
        {"prompt": [user], "chosen": [good], "rejected": [bad]},
        {"chosen": [user, good], "rejected": [user, bad]}])
    pairs = load_pairs(path, tok, template, seq_len=64)
    for k in (2, 4):
        np.testing.assert_array_equal(pairs.ids[k], pairs.ids[0])
        np.testing.assert_array_equal(pairs.labels[k + 1], pairs.labels[1])
    completion = tok.decode(pairs.labels[0][pairs.labels[0] != IGNORE_ID])
    assert completion == "2 + 2 = 4.<|im_end|>\n"
    # a multi-turn prompt: its own assistant turn is not trained on
    turns = [user, good, {"role": "user", "content": "Sure?"}]
    path = write_pairs(tmp_path / "t.jsonl", [{"prompt": turns, "chosen": [good],
                                               "rejected": [bad]}])
    pairs = load_pairs(path, tok, template, seq_len=128)
    assert tok.decode(pairs.labels[1][pairs.labels[1] != IGNORE_ID]) == "2 + 2 = 5.<|im_end|>\n"

    long = {"prompt": "Hi?", "chosen": "word " * 60, "rejected": "No."}
    path = write_pairs(tmp_path / "l.jsonl", [{"prompt": "Hi?", "chosen": "Yes.",
                                               "rejected": "No."}, long])
    kept = load_pairs(path, tok, template, seq_len=48, overlong="truncate")
    assert (kept.lines, kept.num_pairs, kept.truncated) == (2, 2, 1)
    assert max(len(ids) for ids in kept.ids) == 49
    assert "2 pairs, 2 used; 1 truncated to data.seq_len=48" in kept.report(48, "truncate")
    skipped = load_pairs(path, tok, template, seq_len=48, overlong="skip")
    assert (skipped.num_pairs, skipped.skipped) == (1, 1)
    assert "1 skipped (a sequence over data.seq_len=48)" in skipped.report(48, "skip")


def test_pairs_made_identical_by_truncation_are_skipped_counted_and_all_such_refused(tmp_path,
                                                                                   bundled):
    """Two completions that differ only past seq_len are the same sequence once truncated: DPO
    would train on them at loss log 2 with a zero gradient. Skipped and counted; a file of only
    such pairs is one line naming it (exit 2 from the command line)."""
    from megatrain_jax.data import DataError
    from megatrain_jax.preference import load_pairs
    tok, template = bundled
    same_start = {"prompt": "Hi?", "chosen": "word " * 60 + "yes", "rejected": "word " * 60 + "no"}
    path = write_pairs(tmp_path / "p.jsonl", [same_start, {"prompt": "Hi?", "chosen": "Yes.",
                                                           "rejected": "No."}, same_start])
    pairs = load_pairs(path, tok, template, seq_len=48)
    assert (pairs.lines, pairs.num_pairs, pairs.truncated, pairs.identical) == (3, 1, 2, 2)
    assert all(not np.array_equal(pairs.ids[2 * p], pairs.ids[2 * p + 1])
               for p in range(pairs.num_pairs))
    assert "2 skipped with the chosen and the rejected the same" in pairs.report(48, "truncate")
    assert load_pairs(path, tok, template, seq_len=256).identical == 0  # whole, they differ
    only = write_pairs(tmp_path / "only.jsonl", [same_start] * 3)
    with pytest.raises(DataError, match=f"^{only}: no usable pair .*3 skipped with the chosen"):
        load_pairs(only, tok, template, seq_len=48)


def test_batches_keep_pairs_whole_and_resume(tmp_path, bundled):
    from megatrain_jax.preference import PreferenceDataset, load_pairs, rows
    tok, template = bundled
    pairs = load_pairs(write_pairs(tmp_path / "p.jsonl", bundled_pairs(20)), tok, template,
                       seq_len=64)
    table = rows(pairs, 64)
    table["reference"][:] = np.arange(40)  # row r's reference is r: pairs are (2p, 2p + 1)
    make = lambda: PreferenceDataset(table, batch_size=4, seed=1, num_micro_batches=2)
    a, b = make(), make()
    for _ in range(7):  # past an epoch (5 steps of 4 pairs)
        inputs, targets, context = a.next_batch_with_context()
        assert inputs.shape == targets["tokens"].shape == context["segment_ids"].shape == (2, 4, 64)
        ref = targets["reference"].reshape(-1, 2)
        assert np.all(ref[:, 0] % 2 == 0) and np.all(ref[:, 1] == ref[:, 0] + 1)
    b.restore(a.state())
    jax.tree.map(np.testing.assert_array_equal, a.next_batch_with_context(),
                 b.next_batch_with_context())


def test_bad_pairs_name_file_and_line(tmp_path, bundled):
    from megatrain_jax.data import DataError
    from megatrain_jax.preference import load_pairs
    tok, template = bundled
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    cases = [
        ({"prompt": "a", "chosen": "b"}, 'missing "rejected"'),
        ({"chosen": "b", "rejected": "c"}, 'missing "prompt"'),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, '"chosen" and "rejected" are identical'),
        ({"prompt": "a", "chosen": 3, "rejected": "c"}, '"chosen" must be a string or'),
        ({"prompt": [{"role": "robot", "content": "a"}], "chosen": "b", "rejected": "c"},
         '"prompt" message 0 must be an object with a role'),
        ({"prompt": "a " * 80, "chosen": "b", "rejected": "c"},
         r"the prompt is \d+ tokens, longer than data.seq_len=32"),
        ("{not json", "invalid JSON"),
        ({"prompt": "a", "chosen": "b\ud800", "rejected": "c"},  # JSON's "b\\ud800": unpaired
         r"field 'chosen' holds a lone surrogate '\\ud800' at character 1"),
    ]
    for record, message in cases:
        path = write_pairs(tmp_path / "bad.jsonl", [good, "", record])
        for overlong in ("truncate", "skip"):
            with pytest.raises(DataError, match=f"^{path}:3: {message}") as e:
                load_pairs(path, tok, template, seq_len=32, overlong=overlong)
            assert "\n" not in str(e.value)


def test_config_keys():
    from megatrain_jax.config import ConfigError, load_config
    config = os.path.join(ROOT, "configs", "dpo_tiny.yaml")
    cfg = load_config(config)
    assert cfg.data.format == "preference" and cfg.data.document_mask  # implied: padding marked
    assert (cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.reference_dir) == (0.5, "sigmoid", "")
    for override, message in [
            ("dpo.beta=0", "dpo.beta must be > 0, got 0"),
            ("dpo.loss=ipa", "dpo.loss must be one of sigmoid, ipo, got 'ipa' (did you mean ipo?)"),
            ("data.batch_size=7", "data.batch_size must be even with data.format=preference"),
            ("data.eval_fraction=0.1", "not supported with data.format=preference"),
            ("data.document_mask=false", "data.document_mask=false with data.format=preference"),
            ("data.tokenizer=byte", "data.format=preference needs data.tokenizer to be a "
                                    "tokenizer.json")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(config, [override])


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), *args],
                          capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)


def test_cli_refuses_a_bad_pair(tmp_path):
    config = os.path.join(ROOT, "configs", "dpo_tiny.yaml")
    path = write_pairs(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                {"prompt": "a", "chosen": "b"}])
    result = run("--config", config, f"data.path={path}", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f'error: {path}:2: missing "rejected" (a preference pair needs "prompt", "chosen" and '
        f'"rejected"; keys: chosen, prompt)']
    assert not (tmp_path / "run").exists()


def test_dpo_tiny_runs_and_resumes_via_the_command_line(tmp_path, capsys):
    """configs/dpo_tiny.yaml (a smaller model) trains a few steps through the command line
    (`megatrain train`, as scripts/train.py runs it), logs the DPO metrics, and a resumed run
    reuses the reference cache built from the starting weights."""
    from megatrain_jax import commands
    config = os.path.join(ROOT, "configs", "dpo_tiny.yaml")
    data = write_pairs(tmp_path / "pairs.jsonl", bundled_pairs(12))  # a quicker reference pass
    small = ["--config", config, *SMALL, "train.log_every=1", f"run_dir={tmp_path / 'run'}",
             f"data.path={data}", "logging.tensorboard=false"]
    assert commands.train([*small, "train.steps=2"]) == 0
    out = capsys.readouterr().out
    assert "reference log-probs: 24 sequences, one streamed forward pass" in out
    assert f"preference data: {data}: 12 pairs, 12 used" in out
    assert "reward acc" in out and "logps chosen" in out
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for key in ("loss", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert abs(records[0]["loss"] - np.log(2)) < 1e-4  # the policy is the reference at step 1
    assert commands.train([*small, "train.steps=3", "checkpoint.allow_changes=[train.steps]"]) == 0
    out = capsys.readouterr().out
    assert "(key matches)" in out and "resumed from checkpoint step 2" in out
    assert [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [
        1, 2, 3]


def doc_commands(doc: str, section: str) -> list:
    """The bash block of `doc`'s `section` (doc: a path from the repository root), as argv lists
    (continuations joined, comments dropped), with its variable assignments substituted."""
    import shlex
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    block = re.search(re.escape(section) + r"\n.*?```bash\n(.*?)```", text, re.S).group(1)
    commands, variables = [], {}
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, eq, value = line.partition("=")
        if eq and re.fullmatch(r"[A-Z_]+", name):
            variables[name] = value
            continue
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        commands.append(shlex.split(line))
    return commands


def test_documented_sft_then_dpo_commands_run(chat_model, tmp_path):
    """docs/finetuning.md's "SFT then DPO from a local HF model" commands, as written, on the tiny chat model
    (its directory for MODEL, small data files, run directories under tmp_path, and fewer steps
    and shorter rows appended): both runs train, both exports load in transformers, and DPO moved
    the SFT model's weights."""
    from megatrain_jax import commands
    _, model_dir = chat_model
    sft = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tiny.jsonl")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(open(sft, encoding="utf-8").readlines()[:24]), encoding="utf-8")
    pairs = write_pairs(tmp_path / "pairs.jsonl", bundled_pairs(8))
    scripts = {"scripts/train.py": commands.train, "scripts/export_hf.py": commands.export}
    ran = []
    for argv in doc_commands("docs/finetuning.md", "### SFT then DPO from a local HF model"):
        assert argv[0] == "python" and argv[1] in scripts, argv
        args = [a.replace("models/Qwen2.5-0.5B-Instruct", model_dir)
                .replace("=chats.jsonl", f"={chats}").replace("=pairs.jsonl", f"={pairs}")
                .replace("runs/", f"{tmp_path}/runs/") for a in argv[2:]]
        if argv[1] == "scripts/train.py":
            args += ["train.steps=2", "data.seq_len=64", "data.batch_size=4",
                     "train.compute_dtype=float32", "optimizer.learning_rate=1e-3",
                     "optimizer.warmup_steps=0", "logging.tensorboard=false"]
        assert scripts[argv[1]](args) == 0, argv
        ran.append(argv[1])
    assert ran == ["scripts/train.py", "scripts/export_hf.py"] * 2
    sft_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs/sft/hf")
    dpo_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs/dpo/hf")
    assert os.path.exists(tmp_path / "runs/dpo/hf/tokenizer.json")
    moved = [not torch.equal(a, b) for a, b in zip(sft_model.parameters(), dpo_model.parameters())]
    assert all(moved)
    records = [json.loads(line) for line in open(tmp_path / "runs/dpo/metrics.jsonl")]
    assert abs(records[0]["loss"] - np.log(2)) < 1e-4 and "reward_accuracy" in records[0]
