"""SFT data (data.format=sft): chat templates rendered and tokenized as transformers does, loss on
the assistant tokens only, packed examples kept apart, overlong conversations counted, bad lines
refused with their file and line."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from chat_tokenizers import make_tokenizer_dir
from megatrain_jax import chat
from megatrain_jax.chat import (PADDING_SEGMENT, ChatTemplate, Examples, SFTDataset,
                                 encode_conversation, load_examples, pack)
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.data import DataError, PackedDataset, document_context, load_tokenizer
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.model import ModelConfig, make_block, make_stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tiny.jsonl")
BUNDLED_TOKENIZER = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tokenizer", "tokenizer.json")

CONVERSATIONS = {
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "Fine, thanks. And you?"}],
    "multi_turn": [
        {"role": "user", "content": "What is a cynic?"},
        {"role": "assistant", "content": "  A blackguard whose faulty vision sees things as they are.\n"},
        {"role": "user", "content": "And a bore?"},
        {"role": "assistant", "content": "A person who talks when you wish him to listen."}],
    "prompt_completion": chat.record_messages({"prompt": "naïve café — 日本?",
                                             "completion": "Ünïcödé, ok 🙂"}, "test"),
    "ends_with_user": [
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "Thanks!"}],
}
STYLES = ("qwen", "llama3", "mixtral")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{style: (tokenizer.json path, our tokenizer, our template, transformers' tokenizer)}."""
    from transformers import AutoTokenizer

    out = {}
    for style in STYLES:
        directory = tmp_path_factory.mktemp(style)
        path = make_tokenizer_dir(directory, style)
        out[style] = (path, load_tokenizer(path), ChatTemplate.for_tokenizer(path),
                      AutoTokenizer.from_pretrained(str(directory)))
    return out


def _cases(style):
    # Mixtral's template has no system role (it raises; tested with the bad inputs)
    return [name for name, c in CONVERSATIONS.items()
            if not (style == "mixtral" and c[0]["role"] == "system")]


# ----------------------------------------------------------------------------- the template


@pytest.mark.parametrize("style", STYLES)
def test_chat_template_ids_equal_transformers(tokenizers, style):
    _, tok, template, hf = tokenizers[style]
    for name in _cases(style):
        messages = CONVERSATIONS[name]
        ids, _ = encode_conversation(template, tok, messages, name)
        assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True, return_dict=False), name
        for prompt in (False, True):
            assert template.render(messages, add_generation_prompt=prompt) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt), name


def test_template_features_render_as_transformers():
    """{% generation %} markers, namespace, loop controls, tojson (no HTML escaping), strftime_now
    and raise_exception, through transformers' own renderer."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (
        "{%- set ns = namespace(n=0) %}{{ bos_token }}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}<{{ m.role }} {{ ns.n }}>"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}"
        "{% else %}{{ m | tojson }}{% endif %}\n{% endfor %}"
        "{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('no year') }}{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    ours = ChatTemplate(source, {"bos_token": "<s>"}, "test")
    for messages in CONVERSATIONS.values():
        for prompt in (False, True):
            theirs = render_jinja_template([messages], chat_template=source, bos_token="<s>",
                                           add_generation_prompt=prompt)[0][0]
            assert ours.render(messages, add_generation_prompt=prompt) == theirs
    assert "<&>" in ours.render([{"role": "user", "content": "<&>"}])


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_assistant_mask_is_what_the_assistant_turns_add(tokenizers, style):
    """The unmasked tokens decode to each assistant message's content and the template's end of
    its turn: exactly the text transformers renders for messages[:i+1] beyond messages[:i] with
    the generation prompt."""
    _, tok, template, hf = tokenizers[style]
    end = {"qwen": lambda c: c + "<|im_end|>\n", "llama3": lambda c: c.strip() + "<|eot_id|>"}[style]
    for name in _cases(style):
        messages = CONVERSATIONS[name]
        ids, assistant = encode_conversation(template, tok, messages, name)
        expected, by_hand = "", ""
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                before = hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                after = hf.apply_chat_template(messages[:i + 1], tokenize=False)
                expected += after[len(before):]
                by_hand += end(m["content"])
        assert hf.decode(ids[assistant].tolist()) == expected == by_hand, name
        # the examples' targets: the next token where it is an assistant token, else ignored
        labels = np.where(assistant, ids, IGNORE_ID)
        examples = Examples("x", [ids], [labels])
        rows = pack(examples, len(ids) + 3)
        n = len(ids) - 1
        np.testing.assert_array_equal(rows["inputs"][0, :n], ids[:-1])
        np.testing.assert_array_equal(rows["targets"][0, :n], labels[1:])
        assert np.all(rows["targets"][0, n:] == IGNORE_ID)  # padding


# ----------------------------------------------------------------------------- the loss


# A large init: attention that depends visibly on what each token sees.
CFG = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                  num_kv_heads=2, init_std=0.3)


@pytest.fixture(scope="module")
def model():
    first, last = make_stages(CFG, seed=0)
    blocks = [make_block(CFG, 0, i) for i in range(CFG.num_layers)]
    graph, params = nnx.split((first, last, blocks))

    @jax.jit
    def loss_and_grad(params, inputs, targets, context):
        def loss_sum(params):
            first, last, blocks = nnx.merge(graph, params)
            x = first(inputs)
            for block in blocks:
                x = block(x, context)
            return last(x, targets)[0]  # the trainer's loss: summed over counted targets
        return jax.value_and_grad(loss_sum)(params)

    return params, loss_and_grad


@pytest.fixture(scope="module")
def bundled():
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    return tok, ChatTemplate.for_tokenizer(BUNDLED_TOKENIZER)


def _examples(bundled, seq_len=128, lines=12):
    tok, template = bundled
    head = [json.loads(line) for line in open(BUNDLED, encoding="utf-8").readlines()[:lines]]
    ids, labels = [], []
    for k, obj in enumerate(head):
        i, a = encode_conversation(template, tok, chat.record_messages(obj, str(k)), str(k))
        ids.append(i)
        labels.append(np.where(a, i, IGNORE_ID).astype(np.int32))
    return Examples("bundled", ids, labels)


def _batch(rows, r):
    context = {"segment_ids": jnp.asarray(rows["segment_ids"][r:r + 1]),
               "positions": jnp.asarray(rows["positions"][r:r + 1])}
    return jnp.asarray(rows["inputs"][r:r + 1]), rows["targets"][r:r + 1], context


def test_masked_tokens_contribute_nothing(model, bundled):
    """Loss and gradient are bit-identical when a masked example (all targets ignored) is put in
    a row's padding, whatever its tokens; unmasking its targets changes both."""
    params, loss_and_grad = model
    rows = pack(_examples(bundled), 128)
    r = int(np.argmax((rows["targets"] == IGNORE_ID).sum(1)))  # the row with the most padding
    inputs, targets, context = _batch(rows, r)
    pad = np.flatnonzero(rows["segment_ids"][r] == PADDING_SEGMENT)
    assert len(pad) >= 8
    loss, grads = loss_and_grad(params, inputs, jnp.asarray(targets), context)

    rng = np.random.default_rng(0)
    hidden = np.asarray(inputs).copy()
    hidden[0, pad] = rng.integers(0, CFG.vocab_size, len(pad))  # a masked example, seen by no one
    positions = np.asarray(context["positions"]).copy()
    positions[0, pad] = np.arange(len(pad))
    hidden_context = {**context, "positions": jnp.asarray(positions)}
    loss2, grads2 = loss_and_grad(params, jnp.asarray(hidden), jnp.asarray(targets), hidden_context)
    assert float(loss2) == float(loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    unmasked = targets.copy()
    unmasked[0, pad[:-1]] = hidden[0, pad[1:]]  # the same tokens, trained on
    loss3, grads3 = loss_and_grad(params, jnp.asarray(hidden), jnp.asarray(unmasked), hidden_context)
    assert float(loss3) > float(loss)
    assert not np.array_equal(np.asarray(jax.tree.leaves(grads3)[0]),
                              np.asarray(jax.tree.leaves(grads)[0]))


def test_packed_examples_do_not_see_each_other(model, bundled):
    """An example's loss is the same alone in a row as packed after others (its positions restart
    and it attends only to itself); with the row as one document it would not be."""
    params, loss_and_grad = model
    examples = _examples(bundled)
    rows = pack(examples, 128)
    r = int(np.argmax(rows["segment_ids"].max(1)))  # a row with several examples
    segments = rows["segment_ids"][r]
    seg = 1  # not the row's first example: the causal mask alone would not keep it apart
    inputs, targets, context = _batch(rows, r)
    only = np.where(segments == seg, targets, IGNORE_ID)
    packed, _ = loss_and_grad(params, inputs, jnp.asarray(only), context)
    one_document = {"segment_ids": jnp.zeros_like(context["segment_ids"]),
                    "positions": jnp.arange(128)[None]}
    unmasked, _ = loss_and_grad(params, inputs, jnp.asarray(only), one_document)

    start = int(np.argmax(segments == seg))
    n = int(np.sum(segments == seg))
    k = next(k for k, ids in enumerate(examples.ids)
             if len(ids) - 1 == n and np.array_equal(ids[:-1], rows["inputs"][r, start:start + n]))
    alone_rows = pack(dataclasses.replace(examples, ids=[examples.ids[k]],
                                          labels=[examples.labels[k]]), 128)
    alone, _ = loss_and_grad(params, *(lambda i, t, c: (i, jnp.asarray(t), c))(*_batch(alone_rows, 0)))
    np.testing.assert_allclose(float(packed), float(alone), rtol=1e-6)
    assert abs(float(unmasked) - float(alone)) > 0.01 * abs(float(alone))


# ----------------------------------------------------------------------------- packing


def test_packing_is_deterministic_and_resumable(bundled):
    examples = _examples(bundled, lines=60)
    rows = pack(examples, 128)
    # every example once, whole, with positions restarting at its start
    found = 0
    for r in range(len(rows["inputs"])):
        for seg in np.unique(rows["segment_ids"][r]):
            at = np.flatnonzero(rows["segment_ids"][r] == seg)
            np.testing.assert_array_equal(rows["positions"][r, at], np.arange(len(at)))
            found += any(len(ids) - 1 == len(at) and np.array_equal(ids[:-1], rows["inputs"][r, at])
                         for ids in examples.ids)
    assert found == len(examples.ids)
    assert np.count_nonzero(rows["targets"] != IGNORE_ID) == sum(
        np.count_nonzero(lab[1:] != IGNORE_ID) for lab in examples.labels)

    make = lambda: SFTDataset(rows, batch_size=2, seed=3, num_micro_batches=2)
    a, b = make(), make()
    steps = len(rows["inputs"]) // 4 + 2
    run = [a.next_batch_with_context() for _ in range(steps)]
    assert a.state() == {"epoch": 1, "index": 8}  # crossed an epoch boundary
    for x, y in zip(run, [b.next_batch_with_context() for _ in range(steps)]):
        jax.tree.map(np.testing.assert_array_equal, x, y)
    c = make()
    for _ in range(steps - 3):
        c.next_batch()
    d = make()
    d.restore(c.state())
    for _ in range(5):
        jax.tree.map(np.testing.assert_array_equal, c.next_batch_with_context(),
                     d.next_batch_with_context())
    inputs, targets, context = run[0]
    assert inputs.shape == targets.shape == context["segment_ids"].shape == (2, 2, 128)


def test_eval_fraction_holds_out_the_last_conversations():
    from megatrain_jax.recipes import load_data

    cfg = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                      ["data.eval_fraction=0.25", "train.eval_batches=100"])
    dataset, batches = load_data(cfg)
    assert "400 conversations, 400 used" in dataset.summary

    def examples_in(inputs, targets, segments):  # the token tuples of the rows' examples
        return {tuple(i[s == k]) for i, t, s in zip(inputs, targets, segments)
                for k in np.unique(s) if np.any(t[s == k] != IGNORE_ID)}  # not padding
    rows = dataset.rows
    trained = examples_in(rows["inputs"], rows["targets"], rows["segment_ids"])
    held = set().union(*(examples_in(x.reshape(-1, 256), t.reshape(-1, 256),
                                     c["segment_ids"].reshape(-1, 256)) for x, t, c in batches))
    tok, template = load_tokenizer(cfg.data.tokenizer), ChatTemplate.for_tokenizer(cfg.data.tokenizer)
    every = [tuple(ids[:-1]) for ids in load_examples(BUNDLED, tok, template, seq_len=256).ids]
    assert trained == set(every[:300])  # all of the first three quarters, nothing else
    assert held and held <= set(every[300:])  # whole batches of the last quarter
    assert all(x.shape == (1, 8, 256) for x, _, _ in batches)


def test_text_windows_get_their_document_context_from_eos():
    """The trainer takes every batch with its context: PackedDataset's from the EOS positions
    (data.document_mask), SFTDataset's from the conversations' boundaries."""
    tokens = np.arange(200, dtype=np.int32) % 7
    packed = PackedDataset(tokens, seq_len=16, batch_size=2, seed=0, eos_id=0, document_mask=True)
    inputs, targets, context = packed.next_batch_with_context()
    jax.tree.map(np.testing.assert_array_equal, context, document_context(inputs, 0))
    plain = PackedDataset(tokens, seq_len=16, batch_size=2, seed=0, eos_id=0)
    assert plain.next_batch_with_context()[2] is None


# ----------------------------------------------------------------------------- overlong


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")
    return str(path)


def test_overlong_truncated_or_skipped_and_counted(tmp_path, bundled):
    tok, template = bundled
    short = {"prompt": "Hi?", "completion": "Hello."}
    long = {"prompt": "Hi?", "completion": "word " * 200}
    late = {"prompt": "word " * 200, "completion": "Hello."}  # its assistant tokens are past seq_len
    path = _write(tmp_path / "c.jsonl", [short, long, late, short])
    kept = load_examples(path, tok, template, seq_len=64, overlong="truncate")
    assert (kept.conversations, len(kept.ids), kept.truncated, kept.skipped) == (4, 3, 1, 1)
    assert max(len(ids) for ids in kept.ids) == 65
    assert "1 truncated to data.seq_len=64, 1 skipped" in kept.report(64, "truncate")
    skipped = load_examples(path, tok, template, seq_len=64, overlong="skip")
    assert (len(skipped.ids), skipped.truncated, skipped.skipped) == (2, 0, 2)
    assert "none truncated, 2 skipped (over data.seq_len=64)" in skipped.report(64, "skip")


# ----------------------------------------------------------------------------- bad input


def test_bad_lines_name_file_and_line(tmp_path, bundled, tokenizers):
    tok, template = bundled
    good = json.dumps({"prompt": "a", "completion": "b"})
    cases = [
        ("{not json", "invalid JSON"),
        (json.dumps({"text": "hello"}), 'no "messages" and no "prompt"/"completion"'),
        (json.dumps({"messages": [{"role": "tool", "content": "x"}]}), "unknown role 'tool'"),
        (json.dumps({"messages": [{"role": "user", "content": ["a"]}]}), "content must be a string"),
        (json.dumps({"prompt": "a", "completion": 3}), '"completion" must be a string'),
        (json.dumps({"messages": [{"role": "user", "content": "a"}]}), "no assistant message"),
        (json.dumps({"prompt": "a\ud800", "completion": "b"}),  # JSON's "a\\ud800": unpaired
         r"field 'prompt' holds a lone surrogate '\\ud800' at character 1"),
        (json.dumps({"messages": [{"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "\udfff"}]}),
         r"field 'messages\[1\].content' holds a lone surrogate"),
    ]
    for line, message in cases:
        path = _write(tmp_path / "bad.jsonl", [good, "", line])
        with pytest.raises(DataError, match=f"^{path}:3: .*{message}") as e:
            load_examples(path, tok, template, seq_len=64)
        assert "\n" not in str(e.value)
    # the template's own refusal (raise_exception), with its message
    path_m, tok_m, template_m, _ = tokenizers["mixtral"]
    path = _write(tmp_path / "sys.jsonl", [good, json.dumps({"messages": CONVERSATIONS["multi_turn"]}),
                                          json.dumps({"messages": CONVERSATIONS["system_user_assistant"]})])
    with pytest.raises(DataError, match=f"^{path}:3: the chat template refused .*"
                                        f"Conversation roles must alternate"):
        load_examples(path, tok_m, template_m, seq_len=256)
    # a template that renders the last message differently: prefixes are not prefixes
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "tokenizer.json").write_text(open(BUNDLED_TOKENIZER, encoding="utf-8").read())
    (odd / "tokenizer_config.json").write_text(json.dumps({"chat_template": "unused"}))
    (odd / "chat_template.jinja").write_text(  # preferred to tokenizer_config.json's
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    path = _write(tmp_path / "turns.jsonl", [json.dumps({"messages": CONVERSATIONS["multi_turn"]})])
    with pytest.raises(DataError, match=f"^{path}:1: the chat template does not render "
                                        r"messages\[:1\] with the generation prompt as a prefix"):
        load_examples(path, tok, ChatTemplate.for_tokenizer(str(odd / "tokenizer.json")), seq_len=256)
    # no usable example: everything over seq_len with overlong=skip
    path = _write(tmp_path / "long.jsonl", [json.dumps({"prompt": "a " * 100, "completion": "b"})])
    with pytest.raises(DataError, match=f"^{path}: no usable example .*1 skipped"):
        load_examples(path, tok, template, seq_len=16, overlong="skip")
    # a tokenizer without a chat template
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_text(open(BUNDLED_TOKENIZER, encoding="utf-8").read())
    with pytest.raises(DataError, match="data.format=sft needs the model's chat template: neither "
                                        ".*chat_template.jinja nor a chat_template in "
                                        ".*tokenizer_config.json"):
        ChatTemplate.for_tokenizer(str(plain / "tokenizer.json"))


def test_config_keys():
    cfg = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"))
    assert cfg.data.format == "sft" and cfg.data.document_mask  # implied by sft
    for override, message in [
            ("data.format=chat", "data.format must be one of text, sft"),
            ("data.overlong=drop", "data.overlong must be one of truncate, skip"),
            ("data.document_mask=false", "data.document_mask=false with data.format=sft"),
            ("data.tokenizer=byte", "data.format=sft needs data.tokenizer to be a tokenizer.json")]:
        with pytest.raises(ConfigError, match=message):
            load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"), [override])


def test_cli_refuses_a_bad_line(tmp_path, capsys, monkeypatch):
    """`megatrain train` (= scripts/train.py's main), in-process: exit 2, the one line."""
    from megatrain_jax import commands

    path = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"},
                                           {"messages": [{"role": "robot", "content": "x"}]}])
    monkeypatch.chdir(ROOT)  # the config's relative tokenizer path, as from the repository
    code = commands.train(["--config", os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                           f"data.path={path}", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"error: {path}:2: message 0 has unknown role 'robot' (expected one of system, user, "
        f"assistant)"]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the config


def test_sft_tiny_trains_and_resumes_its_data_position(tmp_path):
    """...and a chat template edited before a resume is a change of its data, as an edited
    corpus is: refused by name unless checkpoint.allow_changes allows it (it resumed silently)."""
    import shutil

    from megatrain_jax import checkpoint
    from megatrain_jax.train import resume_point, train

    tok = tmp_path / "tok"
    shutil.copytree(os.path.dirname(BUNDLED_TOKENIZER), tok)
    lines = []
    overrides = ["train.steps=2", f"run_dir={tmp_path}", "model.num_layers=2",
                 "model.hidden_size=64", "model.intermediate_size=128", "data.seq_len=128",
                 "data.batch_size=4", f"data.tokenizer={tok}/tokenizer.json"]
    cfg = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"), overrides)
    history = train(cfg, log=lines.append)
    assert [r["step"] for r in history] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in history) and "eval_loss" in history[-1]
    summary = [line for line in lines if line.startswith("sft data:")]
    assert len(summary) == 1 and "400 conversations" in summary[0] and "truncated" in summary[0]

    # one more step from the checkpoint: the rows continue where step 2 left them
    cfg = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                      overrides + ["train.steps=3", "checkpoint.allow_changes=[train.steps]"])
    assert [r["step"] for r in train(cfg, log=lines.append)] == [3]
    manager = checkpoint.make_manager(os.path.join(tmp_path, "checkpoints"))
    try:
        states = [checkpoint.read_meta(manager, step)[0]["data_state"] for step in (2, 3)]
    finally:
        manager.close()
    assert states == [{"epoch": 0, "index": 8}, {"epoch": 0, "index": 12}]

    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    more = overrides + ["train.steps=4"]
    with pytest.raises(checkpoint.CheckpointError, match=(
            rf"^checkpoint step 3 in {tmp_path}/checkpoints was trained on other data: "
            rf"{tok}/tokenizer_config.json \(of the chat template\) is [\d,]+ bytes, [\d,]+ when "
            rf"the checkpoint was saved; to resume with the data as it is now, add "
            rf"checkpoint.allow_changes=\[data.path\]$")):
        train(load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                          more + ["checkpoint.allow_changes=[train.steps]"]), log=lines.append)
    lines.clear()
    allowed = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                          more + ["checkpoint.allow_changes=[train.steps,data.path]"])
    assert resume_point(allowed, lines.append) == 3
    assert lines[-1].startswith(f"resuming with changed data: {tok}/tokenizer_config.json (of "
                                f"the chat template) is ")
