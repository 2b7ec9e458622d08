"""Generation with a KV cache (megatrain_jax.generate, engine/decode.py): greedy decoding equals
transformers' generate(do_sample=False) token for token (Llama, Gemma 3 with local and
global layers, Qwen3-MoE; and a run's checkpoint after a few training steps, through the CLI), the
cache's logits equal the full-sequence forward's, seeded sampling is reproducible, the layers
stream with bounded residency, the documented commands (the README's tiny-run sample, the
fine-tuning recipe of docs/finetuning.md through a sample), and bad input."""

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
import orbax.checkpoint as ocp  # noqa: E402
from test_gemma3 import make_gemma  # noqa: E402
from test_hf import make_hf_model, word_level_tokenizer  # noqa: E402
from test_moe import make_hf_model as make_moe_model  # noqa: E402

from megatrain_jax import checkpoint, commands, hf  # noqa: E402
from megatrain_jax import generate as gen  # noqa: E402
from megatrain_jax.config import load_config  # noqa: E402
from megatrain_jax.data import ByteTokenizer  # noqa: E402
from megatrain_jax.model import Execution  # noqa: E402
from megatrain_jax.train import train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU0, CPU1 = jax.devices("cpu")[:2]  # compute, host: every fetch is a real transfer
PROMPT = [3, 17, 42, 5, 99, 8, 61, 23]  # 8 tokens: past Gemma's window of 5 already
NEW = 10
# Llama (llama3 RoPE, tied embeddings); Gemma 3 (q/k norms, norm offsets, post-norms, GeGLU, a
# local and a global layer, query scale); Qwen3-MoE (q/k norms, routed experts)
MODELS = {"llama": lambda: make_hf_model("llama"), "gemma3": make_gemma,
          "qwen3_moe": lambda: make_moe_model("qwen3_moe")}


def hf_greedy(model, prompt, new, eos=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                             min_new_tokens=0, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def full_forward_logits(model, seq):
    """(T, V) fp32 logits of the whole sequence by the training forward (Block.__call__)."""
    first, last = model.first_last(Execution())
    blocks = [model.block(i, Execution()) for i in range(model.cfg.model.num_layers)]

    @jax.jit
    def forward(first, last, blocks, tokens):
        x = first(tokens)
        for block in blocks:
            x = block(x)
            x = x[0] if isinstance(x, tuple) else x  # a MoE block's router statistics: dropped
        return last.logits(x)
    return np.asarray(forward(first, last, blocks, jnp.asarray([seq])))[0]


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_equals_transformers_and_cache_logits_equal_the_full_forward(arch, tmp_path):
    reference = MODELS[arch]()
    reference.save_pretrained(str(tmp_path))
    model = gen.from_hf(str(tmp_path), tokenizer=False)
    decoder = gen.decoder(model, len(PROMPT) + NEW, compute_dtype=jnp.float32,
                          compute_device=CPU0, host_device=CPU1)
    ours = gen.generate(model, PROMPT, max_new_tokens=NEW, decode=decoder)
    assert ours == hf_greedy(reference, PROMPT, NEW)
    # The cache's logits at every position equal the full-sequence forward's (the decoder's
    # compiled functions again: same shapes)
    seq = PROMPT + ours
    cached = [np.asarray(decoder.start(np.asarray([PROMPT])))[0]]
    for token in ours[:-1]:
        cached.append(np.asarray(decoder.extend(np.asarray([[token]])))[0])
    full = full_forward_logits(model, seq)[len(PROMPT) - 1:-1]
    np.testing.assert_allclose(np.stack(cached), full, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- from a run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """configs/tiny.yaml, 2 layers, trained for 3 steps at data.seq_len=32 (test_cli's shapes:
    compiled once per suite), in <tmp>/runs/tiny (the README's relative path)."""
    home = tmp_path_factory.mktemp("home")
    run_dir = str(home / "runs" / "tiny")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"data.path={ROOT}/megatrain_jax/texts/devils_dictionary.txt", "train.steps=3",
        "model.num_layers=2", "data.seq_len=32", "data.batch_size=2", "train.log_every=1",
        "logging.tensorboard=false", f"run_dir={run_dir}"])
    train(cfg, log=lambda *a: None)
    return str(home), run_dir


def cli(capsys, *args):
    code = commands.generate(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_from_a_run_equals_transformers_on_its_export(tiny_run, tmp_path, capsys):
    """Through the CLI, until the run's context (data.seq_len=32) is full: 9 + 23 tokens (the
    README command's shapes: its compiled functions are these)."""
    _, run_dir = tiny_run
    export = str(tmp_path / "hf")
    hf.export_checkpoint(run_dir, export, log=lambda *a: None)
    reference = transformers.AutoModelForCausalLM.from_pretrained(export).float().eval()
    prompt = "CYNIC, n."
    ids = ByteTokenizer().encode(prompt).tolist()
    expected = hf_greedy(reference, ids, 32 - len(ids), eos=ByteTokenizer.eos_id)
    code, out, err = cli(capsys, "--run", run_dir, "--prompt", prompt, "--temperature", "0",
                         "--max-new-tokens", "50")
    assert code == 0, err
    assert out == prompt + ByteTokenizer().decode(expected) + "\n"
    last = err.splitlines()[-1]  # (transformers' progress bars come before)
    assert last.startswith(f"{len(expected)} tokens from checkpoint step 3 in {run_dir}")
    assert last.endswith(f"stopped at the model's context of 32 tokens (data.seq_len of {run_dir})")


@pytest.fixture(scope="module")
def run_decoder(tiny_run):
    """The tiny run's model and a decoder of 32 positions (the shapes of the test above), the
    layers streamed from the second CPU device to the first: every fetch is a real transfer."""
    model = gen.from_run(tiny_run[1])
    return model, gen.decoder(model, 32, compute_device=CPU0, host_device=CPU1)


def test_seeded_sampling_is_reproducible(run_decoder):
    model, decoder = run_decoder
    prompt = model.tokenizer.encode("CYNIC, n.")
    sample = lambda **kw: gen.generate(model, prompt, max_new_tokens=20, decode=decoder, **kw)
    first = sample(temperature=1.0, top_p=0.9, seed=7)
    assert len(first) == 20
    assert sample(temperature=1.0, top_p=0.9, seed=7) == first
    assert sample(temperature=1.0, top_p=0.9, seed=8) != first
    # the nucleus of a tiny top_p is the most likely token alone: greedy
    assert sample(temperature=1.0, top_p=1e-9, seed=7) == sample(temperature=0.0)


def test_tiny_temperatures_are_greedy_and_non_finite_ones_refused(run_decoder, tiny_run, capsys):
    """logits / 1e-30 overflowed to NaN (NUL bytes printed); inf sampled uniform noise."""
    model, decoder = run_decoder
    prompt = model.tokenizer.encode("CYNIC, n.")
    sample = lambda **kw: gen.generate(model, prompt, max_new_tokens=12, decode=decoder, **kw)
    greedy = sample(temperature=0.0)
    assert 0 not in greedy
    for tiny in (1e-30, 1e-38, 1e-50):  # the last is 0 in fp32
        assert sample(temperature=tiny, seed=3) == greedy, tiny
    for bad in ("inf", "nan", "-inf", "1e400"):
        code, out, err = cli(capsys, "--run", tiny_run[1], "--prompt", "A", f"--temperature={bad}")
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("error: --temperature must be a finite number >= 0"), err


def test_a_checkpoint_holding_nan_is_refused_as_export_refuses_it(tiny_run, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    shutil.copytree(tiny_run[1], run_dir)
    manager = checkpoint.make_manager(os.path.join(run_dir, "checkpoints"), async_save=False)
    step = manager.latest_step()
    meta, _ = checkpoint.read_meta(manager, step)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    state = jax.tree.map(np.array, restored["state"])
    (path, leaf), *_ = jax.tree_util.tree_leaves_with_path(state["layers"][1]["params"])
    leaf.flat[7] = np.nan
    manager.save(step + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave({**meta, "step": step + 1})))
    manager.wait_until_finished()
    manager.close()
    code, _, err = cli(capsys, "--run", run_dir, "--prompt", "A", "--temperature", "0")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: checkpoint step {step + 1} in ") and (
        f"layers/1/params/{checkpoint.path_str(path)} holds NaN or inf; refusing" in err), err
    code, _, err = cli(capsys, "--run", run_dir, "--step", str(step), "--prompt", "A",
                       "--temperature", "0", "--max-new-tokens", "2")
    assert code == 0, err  # the healthy step before it still generates


def test_layers_stream_with_bounded_residency_and_cross_once_per_token(run_decoder):
    """At most prefetch + 1 layers' weights on the compute device at once, and per new token
    every layer and the head's part cross the bus exactly once (the embedding stays on the
    host: only the token's hidden state crosses)."""
    model, decoder = run_decoder
    cfg = model.cfg.model  # 2 layers, untied, fp32
    shape = (cfg.hidden_size, cfg.num_heads, cfg.head_size)
    for prefetch in (0, 1):
        decoder.prefetch = prefetch  # read by each forward: the compiled functions are reused
        seen, peak = {}, [0]
        before_forward = {id(a) for a in jax.live_arrays()}  # e.g. earlier tests' weights

        def check(layer):
            for a in jax.live_arrays():
                if (a.shape == shape and a.sharding.device_set == {CPU0} and id(a) not in
                        before_forward and a.sharding.memory_kind == "device"):  # not the bus
                    seen[id(a)] = a
            peak[0] = max(peak[0], sum(not a.is_deleted() for a in seen.values()))

        decoder.on_layer = check
        decoder.start(model.tokenizer.encode("CYNIC, n.")[None])
        before = decoder.counters.bytes_h2d
        logits = decoder.extend(np.zeros((1, 1), np.int32))
        assert logits.shape == (1, cfg.vocab_size)
        per_token = decoder.counters.bytes_h2d - before
        layer_bytes = sum(x.nbytes for x in jax.tree.leaves(decoder.layers))
        head_bytes = (cfg.hidden_size + cfg.hidden_size * cfg.vocab_size) * 4  # norm, w_out
        assert per_token == layer_bytes + head_bytes + cfg.hidden_size * 4
        assert peak[0] == prefetch + 1, (prefetch, peak[0])
    decoder.on_layer = None


def test_readme_generate_command_as_written(tiny_run):
    """The README's sampling command, run in a directory holding runs/tiny (a 3-step run)."""
    home, _ = tiny_run
    readme = open(os.path.join(ROOT, "README.md")).read()
    lines = [line for line in readme.splitlines() if line.startswith("python scripts/generate.py")]
    assert lines, "the README shows no generate command"
    command = lines[0].replace("python scripts/", f"{sys.executable} {ROOT}/scripts/")
    result = subprocess.run(command, shell=True, cwd=home, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("CYNIC, n.") and len(result.stdout) > len("CYNIC, n.") + 1
    assert "tokens from checkpoint step 3" in result.stderr


def test_bad_input_is_one_line_exit_2(tiny_run, tmp_path, capsys):
    run_dir = tiny_run[1]
    code, out, err = cli(capsys, "--run", run_dir, "--prompt", "y" * 300)
    assert code == 2 and err == (f"error: --prompt is 300 tokens, too long for the model's "
                                 f"context of 32 tokens (data.seq_len of {run_dir})\n")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    code, _, err = cli(capsys, "--run", str(empty), "--prompt", "A")
    assert code == 2 and err == f"error: --run {empty}: no checkpoint (no {empty}/checkpoints)\n"
    code, _, err = cli(capsys, "--run", run_dir, "--step", "2", "--prompt", "A")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: no checkpoint at step 2 in ") and "(complete steps: 3)" in err
    for args, culprit in ((["--temperature", "-1"], "--temperature"),
                          (["--top-p", "0"], "--top-p"),
                          (["--max-new-tokens", "0"], "--max-new-tokens")):
        code, _, err = cli(capsys, "--run", run_dir, "--prompt", "A", *args)
        assert code == 2 and err.startswith(f"error: {culprit} ") and err.count("\n") == 1
    code, _, err = cli(capsys, "--prompt", "A")
    assert code == 2 and "--run" in err and "--hf" in err and err.count("\n") == 1


def llama_with_tokenizer(path):
    """(the tiny HF Llama saved at `path` with a word-level tokenizer.json of 92 tokens, that
    tokenizer as transformers loads it)."""
    reference = make_hf_model("llama")
    reference.save_pretrained(str(path))
    fast = word_level_tokenizer()
    fast.save_pretrained(str(path))
    return reference, fast


def test_hf_directory_with_its_tokenizer_through_the_cli(tmp_path, capsys):
    """--hf DIR: the prompt tokenized by DIR/tokenizer.json, greedy equals transformers."""
    reference, fast = llama_with_tokenizer(tmp_path)
    prompt = "w3 w17 w40 w2 w88 w0 w61 w23"  # as many tokens as PROMPT: the same shapes
    ids = fast(prompt)["input_ids"]
    expected = hf_greedy(reference, ids, NEW)
    code, out, err = cli(capsys, "--hf", str(tmp_path), "--prompt", prompt, "--temperature", "0",
                         "--max-new-tokens", str(NEW))
    assert code == 0, err
    assert out == prompt + fast.decode(expected) + "\n"
    shutil.copytree(tmp_path, tmp_path / "no_tok", ignore=shutil.ignore_patterns("tokenizer*"))
    code, _, err = cli(capsys, "--hf", str(tmp_path / "no_tok"), "--prompt", "w1")
    assert code == 2 and err == (f"error: --hf {tmp_path / 'no_tok'}: no tokenizer.json to "
                                 f"encode the prompt\n")


def test_documented_finetuning_recipe_as_written_through_a_sample(tmp_path, capsys):
    """docs/finetuning.md's "Fine-tuning a Hugging Face model" commands, as written (train, export, sample),
    on the tiny Llama with its tokenizer (its directory for the model's, two small Parquet shards, run
    directories under tmp_path; fewer steps and shorter rows appended to the training)."""
    import numpy as np
    from test_dpo import doc_commands
    model_dir = tmp_path / "model"
    llama_with_tokenizer(model_dir)
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    shards = tmp_path / "datasets/fineweb-edu/data"  # the recipe's Parquet shards, as written
    shards.mkdir(parents=True)
    words = [f"w{i}" for i in range(90)]
    for k in range(2):
        rows = [" ".join(rng.choice(words, size=20)) for _ in range(20)]
        pq.write_table(pa.table({"text": rows}), shards / f"train-0000{k}.parquet")
    scripts = {"scripts/train.py": commands.train, "scripts/export_hf.py": commands.export,
               "scripts/generate.py": commands.generate}
    ran = []
    for argv in doc_commands("docs/finetuning.md", "## Fine-tuning a Hugging Face model"):
        assert argv[0] == "python" and argv[1] in scripts, argv
        args = [a.replace("models/Qwen2.5-0.5B", str(model_dir))
                .replace("=datasets/", f"={tmp_path}/datasets/")
                .replace("runs/", f"{tmp_path}/runs/")
                for a in argv[2:]]
        if argv[1] == "scripts/train.py":
            args += ["train.steps=2", "data.seq_len=16", "data.batch_size=2",
                     "data.micro_batches=1", "train.compute_dtype=float32",
                     "logging.tensorboard=false"]
        assert scripts[argv[1]](args) == 0, (argv, capsys.readouterr().err)
        ran.append(argv[1])
    assert ran == ["scripts/train.py", "scripts/export_hf.py", "scripts/generate.py"]
    out = capsys.readouterr()
    assert out.out.endswith("\n") and "The meaning of life is" in out.out
    assert f"tokens from checkpoint step 2 in {tmp_path}/runs/ft/checkpoints" in out.err
