"""Data sources (megatrain_jax/sources): every format, globs and directories of shards, the token
cache (built once, rebuilt when stale, a foreign one refused), mixtures resumed exactly, batches
prepared ahead, SFT and preference data from Parquet, and bad input as one line, exit 2."""

import errno
import json
import os
import re
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatrain_jax import commands
from megatrain_jax.chat import ChatTemplate, load_examples
from megatrain_jax.config import ConfigError, load_config
from megatrain_jax.data import DataError, PackedDataset, load_tokenizer
from megatrain_jax.preference import load_pairs
from megatrain_jax.sources import cache, files
from megatrain_jax.sources.cache import fingerprint, open_cache, source_tokens
from megatrain_jax.sources.files import resolve
from megatrain_jax.sources.mixture import MixtureDataset
from megatrain_jax.sources.prefetch import ReadAhead
from megatrain_jax.tokenfile import TokenFile
from megatrain_jax.recipes import load_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
BUNDLED_TOKENIZER = os.path.join(ROOT, "megatrain_jax", "texts", "sft_tokenizer", "tokenizer.json")
DOCS = [f"document {i}: " + "word " * (i % 7) + "é" * (i % 3) for i in range(40)]
BYTE = load_tokenizer("byte")


def _packed(docs) -> list:
    out = []
    for d in docs:
        out += list(d.encode("utf-8")) + [BYTE.eos_id]
    return out


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _arrow(path, table, stream: bool):
    with pa.OSFile(str(path), "wb") as sink:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema)
        writer.write_table(table, max_chunksize=7)  # several record batches
        writer.close()


def _datasets_dir(path, tables):
    """A directory as datasets.save_to_disk writes it: Arrow streams, state.json listing them,
    dataset_info.json."""
    path.mkdir()
    names = [f"data-{i:05d}-of-{len(tables):05d}.arrow" for i in range(len(tables))]
    for name, table in zip(names, tables):
        _arrow(path / name, table, stream=True)
    (path / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
        "_output_all_columns": False, "_split": "train"}))
    (path / "dataset_info.json").write_text(json.dumps({
        "features": {"text": {"dtype": "string", "_type": "Value"}}}))


def _shards(tmp_path, fmt) -> str:
    """DOCS written in format `fmt`, in 2-3 shards; the data path to give."""
    parts = [DOCS[:15], DOCS[15:31], DOCS[31:]]
    table = lambda docs: pa.table({"text": docs, "id": list(range(len(docs)))})
    d = tmp_path / fmt
    if fmt == "datasets":
        _datasets_dir(d, [table(p) for p in parts])
        return str(d)
    d.mkdir()
    for i, part in enumerate(parts):
        if fmt == "jsonl":
            _jsonl(d / f"part-{i}.jsonl", [{"text": t, "id": 1} for t in part])
        elif fmt == "parquet":
            pq.write_table(table(part), d / f"part-{i}.parquet", row_group_size=4)
        elif fmt in ("arrow-file", "arrow-stream"):
            _arrow(d / f"part-{i}.arrow", table(part), stream=fmt == "arrow-stream")
        elif fmt == "bin":
            np.asarray(_packed(part), np.uint16).tofile(d / f"part-{i}.bin")
        elif fmt == "npy":
            np.save(d / f"part-{i}.npy", np.asarray(_packed(part), np.int32))
    return str(d / "part-*") if fmt in ("jsonl", "bin") else str(d)  # a glob, or the directory


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow-file", "arrow-stream", "datasets",
                                 "bin", "npy"])
def test_every_format_gives_the_documents_tokens_in_order(tmp_path, fmt):
    tokens, sources = source_tokens(_shards(tmp_path, fmt), BYTE, str(tmp_path / "cache"),
                                    vocab_size=257, log=lambda *a: None)
    assert len(sources) == 3 and isinstance(tokens, TokenFile)
    assert np.asarray(tokens).tolist() == _packed(DOCS)


def test_text_files_are_one_document_each(tmp_path):
    for i, doc in enumerate(DOCS[:3]):
        (tmp_path / f"{i}.txt").write_text(doc)
    tokens, _ = source_tokens(str(tmp_path / "*.txt"), BYTE, str(tmp_path / "cache"),
                              log=lambda *a: None)
    assert np.asarray(tokens).tolist() == _packed(DOCS[:3])


def test_a_directory_of_text_shards_takes_only_data_files_and_says_which(tmp_path):
    """A LICENSE and a README beside .txt shards were trained on as documents: a directory's
    shards are its files of a data extension, and the run's log says which it took."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for i, doc in enumerate(DOCS[:5]):
        (shards / f"part-{i}.txt").write_text(doc)
    (shards / "LICENSE").write_text("Permission is hereby granted")
    (shards / "README.md").write_text("# shards")
    cfg = load_config(TINY, [f"data.path={shards}", f"data.cache_dir={tmp_path}/cache",
                             "data.seq_len=8", "data.batch_size=2", f"run_dir={tmp_path}/run"])
    lines = []
    dataset, _ = load_data(cfg, log=lines.append)
    assert np.asarray(dataset.tokens).tolist() == _packed(DOCS[:5])
    assert lines[0] == (f"data.path={shards}: 5 text files (part-0.txt, part-1.txt, part-2.txt "
                        f"and 2 more); left out LICENSE, README.md (not .jsonl, .parquet, .arrow, "
                        f".bin, .npy or .txt)")
    for name in os.listdir(shards):
        if name.endswith(".txt"):
            os.remove(shards / name)
    with pytest.raises(DataError, match=re.escape(
            f"data.path={shards}: the directory holds no data file (none ends in .jsonl, "
            f".parquet, .arrow, .bin, .npy, .txt); left out LICENSE, README.md")):
        load_data(cfg, log=lines.append)


def test_a_directory_names_its_subfolders_of_shards_and_the_glob_that_reads_them(tmp_path):
    """Shards in subfolders of a data.path directory were skipped with no line (two thirds of
    them here): a directory is read at its top level, and the log names each subfolder holding
    data files, how many, and the glob that reads every level; a subfolder of none is no news."""
    shards = tmp_path / "shards"
    for i, folder in enumerate(["", "train-b", "train-c/deeper"]):
        (shards / folder).mkdir(parents=True, exist_ok=True)
        (shards / folder / f"part-{i}.txt").write_text(DOCS[i])
    (shards / "train-c" / "part-3.txt").write_text(DOCS[3])
    (shards / "images").mkdir()
    (shards / "images" / "logo.png").write_bytes(b"\x89PNG")
    lines = []
    tokens, _ = source_tokens(str(shards), BYTE, str(tmp_path / "cache"), log=lines.append)
    assert np.asarray(tokens).tolist() == _packed(DOCS[:1])
    glob = os.path.join(str(shards), "**", "*.txt")
    assert lines[0] == (f"data.path={shards}: 1 text file (part-0.txt); left out subfolders "
                        f"train-b/, train-c/ (3 data files under them; a directory is read at its "
                        f"top level: data.path='{glob}' reads every level)")
    lines.clear()
    tokens, _ = source_tokens(glob, BYTE, str(tmp_path / "cache"), log=lines.append)
    assert np.asarray(tokens).tolist() == _packed(DOCS[:4])  # in path order
    os.remove(shards / "part-0.txt")  # none at the top: the refusal says where they are
    with pytest.raises(DataError, match=re.escape(
            f"data.path={shards}: the directory holds no data file (none ends in .jsonl, "
            f".parquet, .arrow, .bin, .npy, .txt); left out subfolders train-b/, train-c/ (3 data "
            f"files under them; a directory is read at its top level: data.path='{glob}'")):
        resolve(str(shards))


def test_a_glob_over_a_loop_of_links_reads_each_file_once_and_names_the_loop(tmp_path):
    """`W/**/*.txt` over a folder holding a link to its parent followed the loop: 2 files became
    82. Each real folder is entered once: the loop is named, not followed, and a file reached
    through two paths is read once; without links `**` matches as Python's glob does."""
    w = tmp_path / "W"
    (w / "sub").mkdir(parents=True)
    (w / "a.txt").write_text(DOCS[0])
    (w / "sub" / "b.txt").write_text(DOCS[1])
    pattern = os.path.join(str(w), "**", "*.txt")
    import glob
    assert resolve(pattern).files == tuple(sorted(glob.glob(pattern, recursive=True)))
    os.symlink("..", w / "sub" / "up")  # the loop
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.txt").write_text(DOCS[2])
    os.symlink(tmp_path / "elsewhere", w / "linked")  # a folder linked in: read
    os.symlink(tmp_path / "elsewhere", w / "sub" / "again")  # the same folder again: once
    os.symlink(w / "a.txt", w / "sub" / "a-link.txt")  # the same file again: once
    source = resolve(pattern)
    assert source.files == (str(w / "a.txt"), str(w / "linked" / "c.txt"), str(w / "sub" / "b.txt"))
    assert source.matched() == (
        f"data.path={pattern}: 3 text files (a.txt, linked/c.txt, sub/b.txt); not followed: "
        f"sub/again -> {tmp_path / 'elsewhere'} (a folder already read); not followed: sub/up -> "
        f"{w} (a loop: a link to a folder above it)")
    lines = []
    tokens, _ = source_tokens(pattern, BYTE, str(tmp_path / "cache"), log=lines.append)
    assert np.asarray(tokens).tolist() == _packed([DOCS[0], DOCS[2], DOCS[1]])
    assert lines[0] == source.matched()


def test_hf_tokenizer_cache_equals_encoding_each_document(tmp_path):
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    path = _shards(tmp_path, "parquet")
    tokens, _ = source_tokens(path, tok, str(tmp_path / "cache"), log=lambda *a: None)
    want = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in DOCS])
    np.testing.assert_array_equal(np.asarray(tokens), want)


# -- the cache ----------------------------------------------------------------


def test_cache_is_reused_never_retokenized(tmp_path, monkeypatch):
    path, cache = _shards(tmp_path, "jsonl"), str(tmp_path / "cache")
    lines = []
    first, _ = source_tokens(path, BYTE, cache, log=lines.append)
    assert any("tokenizing" in line for line in lines)

    def refuse(texts):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(BYTE, "encode_batch", refuse)
    lines.clear()
    again, _ = source_tokens(path, BYTE, cache, log=lines.append)
    matched = f"data.path={path}: 3 jsonl files (part-0.jsonl, part-1.jsonl, part-2.jsonl)"
    assert lines == [matched] and np.asarray(again).tolist() == np.asarray(first).tolist()
    # a resume goes through load_data: the same cache, nothing tokenized either
    cfg = load_config(TINY, [f"data.path={path}", f"data.cache_dir={cache}",
                             f"run_dir={tmp_path}/run", "data.seq_len=16", "data.batch_size=2"])
    lines.clear()
    dataset, _ = load_data(cfg, log=lines.append)
    assert lines == [matched] and dataset.next_batch()[0].shape == (1, 2, 16)


def test_stale_cache_is_rebuilt(tmp_path):
    path = tmp_path / "a.jsonl"
    _jsonl(path, [{"text": d} for d in DOCS[:5]])
    source, cache = resolve(str(path)), str(tmp_path / "cache")
    before = fingerprint(source, BYTE)
    tokens, directory = open_cache(source, BYTE, cache, log=lambda *a: None)
    assert np.asarray(tokens).tolist() == _packed(DOCS[:5])
    _jsonl(path, [{"text": d} for d in DOCS[:6]])  # the source changed
    os.utime(path, ns=(1, 1))
    assert fingerprint(source, BYTE) != before
    lines = []
    tokens, again = open_cache(source, BYTE, cache, log=lines.append)
    assert again == directory and "stale" in lines[0] and str(path) in lines[0]
    assert np.asarray(tokens).tolist() == _packed(DOCS[:6])
    # a damaged tokens.bin (cut short) is rebuilt too
    with open(os.path.join(directory, "tokens.bin"), "r+b") as f:
        f.truncate(10)
    lines.clear()
    tokens, _ = open_cache(source, BYTE, cache, log=lines.append)
    assert "stale" in lines[0] and np.asarray(tokens).tolist() == _packed(DOCS[:6])
    assert os.listdir(cache) == [os.path.basename(directory)]  # no temporary left behind


def test_foreign_cache_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "a.jsonl"
    _jsonl(path, [{"text": d} for d in DOCS[:5]])
    source, cache = resolve(str(path)), str(tmp_path / "cache")
    _, directory = open_cache(source, BYTE, cache, log=lambda *a: None)
    manifest_path = os.path.join(directory, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    manifest["identity"]["files"] = ["/some/other/corpus.jsonl"]
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(DataError, match="is not a token cache of .*left as is"):
        open_cache(source, BYTE, cache, log=lambda *a: None)
    with open(manifest_path) as f:
        assert json.load(f) == manifest  # untouched
    os.remove(manifest_path)  # a directory of that name without a manifest: refused too
    with pytest.raises(DataError, match="is not a token cache"):
        open_cache(source, BYTE, cache, log=lambda *a: None)
    assert os.path.exists(os.path.join(directory, "tokens.bin"))


def test_tokenizer_change_makes_the_cache_stale(tmp_path):
    tok_path = tmp_path / "tokenizer.json"
    tok_path.write_bytes(open(BUNDLED_TOKENIZER, "rb").read())
    source = resolve(_shards(tmp_path, "jsonl"))
    open_cache(source, load_tokenizer(str(tok_path)), str(tmp_path / "c"), log=lambda *a: None)
    data = json.loads(tok_path.read_text())
    data["added_tokens"].append({"id": load_tokenizer(str(tok_path)).vocab_size,
                                 "content": "document", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    tok_path.write_text(json.dumps(data))
    lines = []
    tokens, _ = open_cache(source, load_tokenizer(str(tok_path)), str(tmp_path / "c"),
                           log=lines.append)
    assert "tokenizer file changed" in lines[0]
    assert int(tokens[0]) == data["added_tokens"][-1]["id"]  # "document" is one token now
    assert load_tokenizer(BUNDLED_TOKENIZER).tok.token_to_id("document") is None


def _damage_ids(directory, dtype, at: int, value: int):
    """Writes `value` over the id at `at` of a cache's tokens.bin: same size, damaged contents."""
    ids = np.fromfile(os.path.join(directory, "tokens.bin"), dtype=dtype)
    ids[at] = value
    ids.tofile(os.path.join(directory, "tokens.bin"))
    return np.fromfile(os.path.join(directory, "tokens.bin"), dtype=dtype)


def test_a_cache_with_ids_past_the_vocabulary_is_refused_naming_it(tmp_path, capsys):
    """A token cache damaged at the same size (its manifest's sizes still match) trained every
    step as non-finite and exited 0: it is refused when opened, naming the file, and kept."""
    _jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    args = ["--config", TINY, f"data.path={tmp_path}/a.jsonl", f"data.cache_dir={tmp_path}/cache",
            "data.seq_len=16", "data.batch_size=2", "train.steps=1", f"run_dir={tmp_path}/run"]
    _, directory = open_cache(resolve(str(tmp_path / "a.jsonl")), BYTE, str(tmp_path / "cache"),
                              vocab_size=257, log=lambda *a: None)
    damaged = _damage_ids(directory, np.uint16, 300, 60_000)
    code = commands.train(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"error: {directory}/tokens.bin: token id 60000 at offset 300 >= model.vocab_size "
            f"(257): the token cache is damaged; remove {directory} and the next run rebuilds "
            f"it") in err
    np.testing.assert_array_equal(np.fromfile(f"{directory}/tokens.bin", np.uint16), damaged)
    assert not (tmp_path / "run").exists()


# -- bad input ----------------------------------------------------------------
# -- bad input ----------------------------------------------------------------


def _bad_rows_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["fine", None, "fine", None]}), path)
    return path


@pytest.mark.parametrize("case", ["glob", "mixed", "missing", "missing column", "not a string",
                                  "unreadable", "cache not writable", "weight", "weights overflow",
                                  "cache full"])
def test_bad_input_is_one_line_exit_2_before_training(tmp_path, capsys, monkeypatch, case):
    (tmp_path / "d").mkdir()
    _jsonl(tmp_path / "d" / "a.jsonl", [{"text": "hello"}])
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "d" / "b.bin")
    _jsonl(tmp_path / "good.jsonl", [{"text": d} for d in DOCS])
    args = [f"data.path={tmp_path}/good.jsonl", f"data.cache_dir={tmp_path}/cache"]
    if case == "glob":
        args[0], want = f"data.path={tmp_path}/nothing/*.parquet", \
            f"data.path={tmp_path}/nothing/*.parquet: the glob matches no file"
    elif case == "mixed":
        args[0], want = f"data.path={tmp_path}/d", f"{tmp_path}/d/b.bin: a bin shard among jsonl"
    elif case == "missing":
        _jsonl(tmp_path / "m.jsonl", [{"text": "a"}, {"body": "b"}, {"text": "c"}, {"body": 1}])
        args[0] = f"data.path={tmp_path}/m.jsonl"
        want = (f"{tmp_path}/m.jsonl:2: missing field 'text' (data.text_field) (and 1 more bad "
                f"rows in {tmp_path}/m.jsonl; fix or remove them)")
    elif case == "missing column":
        args[0] = f"data.path={_bad_rows_parquet(tmp_path)}"
        want = f"{tmp_path}/bad.parquet[row 1]: missing field 'text' (data.text_field) (and 1 more"
    elif case == "not a string":
        _jsonl(tmp_path / "n.jsonl", [{"text": "a"}, {"text": 7}])
        args[0] = f"data.path={tmp_path}/n.jsonl"
        want = f"{tmp_path}/n.jsonl:2: field 'text' is a int, not a string (data.text_field)"
    elif case == "unreadable":
        real_open = open

        def refuse(path, *a, **k):  # root reads anything: fail as a user's read would
            if str(path).endswith("good.jsonl"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *a, **k)
        monkeypatch.setattr(files, "open", refuse, raising=False)
        want = f"{tmp_path}/good.jsonl: cannot read data file (Permission denied)"
    elif case == "cache not writable":
        (tmp_path / "a_file").write_text("x")
        args[1] = f"data.cache_dir={tmp_path}/a_file/cache"
        want = f"data.cache_dir '{tmp_path}/a_file/cache' is not writable"
    elif case == "weights overflow":
        args[0] = (f"data.sources=[{{path: {tmp_path}/good.jsonl, weight: 1e308}}, "
                   f"{{path: {tmp_path}/d/a.jsonl, weight: 1e308}}]")
        args.append("data.path=''")
        want = ("data.sources: the weights sum to inf (1e+308 + 1e+308); only their ratios "
                "matter: scale them down")
    elif case == "cache full":
        real_open = open

        def full(path, mode="r", *a, **k):  # the cache's files: no room left after a few bytes
            f = real_open(path, mode, *a, **k)
            if "w" in mode and str(path).startswith(f"{tmp_path}/cache"):
                def write(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                f.write = write
            return f
        monkeypatch.setattr(cache, "open", full, raising=False)
        want = (f"data.cache_dir={tmp_path}/cache: writing the token cache of data.path="
                f"{tmp_path}/good.jsonl failed (No space left on device); free space there or "
                f"set data.cache_dir to another directory")
    else:
        args[0] = f"data.sources=[{{path: {tmp_path}/good.jsonl, weight: 0}}]"
        args.append("data.path=''")
        want = f"data.sources.0.weight must be a finite number > 0, got 0.0 ({tmp_path}/good.jsonl)"
    code = commands.train(["--config", TINY, *args, f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and want in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
    if os.path.isdir(tmp_path / "cache"):  # a failed build leaves no partial cache
        assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("key", ["data.path", "data.sources", "data.eval_path"])
def test_a_fifo_as_data_is_refused_by_name_never_waited_on(tmp_path, capsys, key):
    """Opening a FIFO to read waits for a writer: the run hung before its first line."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    _jsonl(tmp_path / "good.jsonl", [{"text": d} for d in DOCS])
    given = {"data.path": [f"data.path={fifo}"],
             "data.sources": [f"data.sources=[{{path: {tmp_path}/good.jsonl}}, {{path: {fifo}}}]",
                              "data.path=''"],
             "data.eval_path": [f"data.path={tmp_path}/good.jsonl", f"data.eval_path={fifo}"]}
    culprit = "data.sources.1.path" if key == "data.sources" else key

    def unblock():  # a writer for a reader that waits, so that a regression fails, not hangs
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader: nothing waits
            pass
    watchdog = threading.Timer(30, unblock)
    watchdog.start()
    try:
        code = commands.train(["--config", TINY, *given[key], f"data.cache_dir={tmp_path}/cache",
                               "data.seq_len=16", "data.batch_size=2", "train.steps=1",
                               f"run_dir={tmp_path}/run"])
    finally:
        watchdog.cancel()
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: {culprit}={fifo} is a FIFO (named pipe), not a regular "
                                 f"file; give a data file\n"), err
    assert not (tmp_path / "run").exists()


def test_data_files_are_every_file_a_config_reads(tmp_path):
    path = _shards(tmp_path, "parquet")
    _jsonl(tmp_path / "eval.jsonl", [{"text": "x"}])
    cfg = load_config(TINY, ["data.path=''", f"data.eval_path={tmp_path}/eval.jsonl",
                             f"data.sources=[{{path: {path}}}, {{path: {tmp_path}/eval.jsonl}}]"])
    shards = [f"{path}/part-{i}.parquet" for i in range(3)]
    assert files.data_files(cfg.data) == [*shards, f"{tmp_path}/eval.jsonl", f"{tmp_path}/eval.jsonl"]
    cfg = load_config(TINY, [f"data.path={path}"])
    assert files.data_files(cfg.data) == shards


def test_an_sft_run_s_data_files_hold_its_chat_template_s(tmp_path):
    """The template renders every sequence: its files are data files too (a resume compares
    them); a checkpoint written before they were recorded is not refused for lacking them."""
    from megatrain_jax.fingerprint import files_identity, first_change

    tok = os.path.dirname(BUNDLED_TOKENIZER)
    path = _chat_data(tmp_path, "sft")
    cfg = load_config(TINY, ["data.format=sft", f"data.path={path}",
                             f"data.tokenizer={BUNDLED_TOKENIZER}", "model.vocab_size=512"])
    assert files.data_files(cfg.data) == [path, f"{tok}/tokenizer_config.json"]
    now = files_identity(files.data_files(cfg.data))
    assert first_change(now[:1], now) is None  # saved before templates were recorded
    jinja = {**now[1], "file": f"{tok}/chat_template.jinja"}
    assert first_change(now, [*now, jinja]) == f"{tok}/chat_template.jinja (of the chat " \
                                                f"template) is new"


def test_datasets_dict_names_its_splits(tmp_path):
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match="DatasetDict .splits: train.; point data.path at one"):
        resolve(str(tmp_path / "dd"))


# -- mixtures -----------------------------------------------------------------


def _mixture(streams, seed=3, **kw):
    return MixtureDataset(streams, [3.0, 1.0], ["a", "b"], seq_len=8, batch_size=4, seed=seed,
                          num_micro_batches=2, **kw)


def test_mixture_resumed_mid_epoch_gives_the_uninterrupted_batches():
    a = np.arange(1000, dtype=np.uint16)  # 124 windows of source a
    b = np.arange(5000, 5090, dtype=np.uint16)  # 11 windows: b wraps into later epochs
    whole = _mixture([a, b])
    batches = [whole.next_batch() for _ in range(12)]
    first = _mixture([a, b])
    for _ in range(8):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
    resumed = _mixture([a, b])
    resumed.restore(state)
    for want in batches[8:]:
        got = resumed.next_batch()
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert resumed.state() == whole.state()
    assert state["epochs"][1] >= 1  # the small source went round before the resume, mid-epoch
    x, y = batches[0]
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    from_a = np.sum(np.concatenate([x.reshape(-1, 8) for x, _ in batches])[:, 0] < 5000)
    assert 0.6 < from_a / (12 * 8) < 0.9  # weight 3:1 -> 75% of the windows
    assert sum(whole.state()["tokens"]) == 12 * 8 * 8
    assert whole.report().startswith("data mixture: a: ")


def test_mixture_resumed_with_its_sources_in_another_order_goes_on_exactly():
    """data.sources listed in another order on resume continued each source at the other's
    position, and the token report swapped: the state is keyed by each source's name."""
    a = np.arange(1000, dtype=np.uint16)
    b = np.arange(5000, 5090, dtype=np.uint16)
    whole = _mixture([a, b])
    batches = [whole.next_batch() for _ in range(12)]
    first = _mixture([a, b])
    for _ in range(8):
        first.next_batch()
    state = json.loads(json.dumps(first.state()))
    swapped = MixtureDataset([b, a], [1.0, 3.0], ["b", "a"], seq_len=8, batch_size=4, seed=3,
                             num_micro_batches=2)
    swapped.restore(state)
    for want in batches[8:]:
        np.testing.assert_array_equal(swapped.next_batch()[0], want[0])
    tokens = dict(zip(whole.state()["sources"], whole.state()["tokens"]))
    assert dict(zip(swapped.state()["sources"], swapped.state()["tokens"])) == tokens
    assert swapped.report().startswith(f"data mixture: b: {tokens['b']:,} tokens")
    # a source added on resume starts at its beginning; the others go on where they were
    added = MixtureDataset([a, np.arange(7000, 7400, dtype=np.uint16), b], [3.0, 1.0, 1.0],
                           ["a", "c", "b"], seq_len=8, batch_size=4, seed=3, num_micro_batches=2)
    added.restore(state)
    after = added.state()
    assert after["numbers"] == [0, 2, 1] and after["tokens"][1] == 0
    assert [after["epochs"][i] for i in (0, 2)] == state["epochs"]
    assert [after["indices"][i] for i in (0, 2)] == state["indices"]


def test_a_mixture_state_written_before_sources_were_named_resumes_as_before():
    a, b = np.arange(1000, dtype=np.uint16), np.arange(5000, 5090, dtype=np.uint16)
    whole = _mixture([a, b])
    batches = [whole.next_batch() for _ in range(6)]
    first = _mixture([a, b])
    for _ in range(4):
        first.next_batch()
    old = {k: v for k, v in first.state().items() if k in ("batch", "epochs", "indices", "tokens")}
    resumed = _mixture([a, b])
    resumed.restore(old)
    for want in batches[4:]:
        np.testing.assert_array_equal(resumed.next_batch()[0], want[0])
    three = MixtureDataset([a, b, a[:100]], [1.0, 1.0, 1.0], ["a", "b", "c"], seq_len=8,
                           batch_size=4, seed=3)
    with pytest.raises(DataError, match=r"written before checkpoints named the sources, it "
                                        r"resumes only with the data.sources it had \(2\)"):
        three.restore(old)
    for bad in ({"batch": 1}, [], {**first.state(), "numbers": [0, 0]}):
        with pytest.raises(DataError, match="^bad data state .* for a mixture of 2 sources$"):
            resumed.restore(bad)


def test_a_changed_mixture_is_refused_by_name_and_the_advised_key_adds_a_source(tmp_path,
                                                                                capsys):
    """Weights edited between checkpoint and resume were accepted silently; adding a source as
    advised (allow_changes=[data.path]) led to another refusal (a bad data state)."""
    text = open(os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt")).read()
    for i, name in enumerate("abc"):
        (tmp_path / f"{name}.txt").write_text(text[i * 20_000:(i + 1) * 20_000])
    mix = lambda *sources: "data.sources=[" + ", ".join(
        f"{{path: {tmp_path}/{name}.txt, weight: {w}}}" for name, w in sources) + "]"
    run = lambda *args: commands.train([
        "--config", TINY, "data.path=''", "model.num_layers=2", "model.hidden_size=32",
        "model.intermediate_size=48", "model.num_heads=2", "model.num_kv_heads=1",
        "data.seq_len=32", "data.batch_size=2", "train.compute_dtype=float32",
        "train.attention=xla", "checkpoint.async=false", "logging.tensorboard=false",
        f"data.cache_dir={tmp_path}/cache", f"run_dir={tmp_path}/run", *args])
    assert run(mix(("a", 1), ("b", 3)), "train.steps=2") == 0
    capsys.readouterr()
    assert run(mix(("b", 1), ("a", 1)), "train.steps=2") == 2
    err = capsys.readouterr().err
    assert err == (f"error: checkpoint step 2 in {tmp_path}/run/checkpoints does not match this "
                   f"config: config.data.sources is '{tmp_path}/a.txt weight 1; {tmp_path}/b.txt "
                   f"weight 3' in the checkpoint, '{tmp_path}/b.txt weight 1; {tmp_path}/a.txt "
                   f"weight 1' now; to resume with the new value, add "
                   f"checkpoint.allow_changes=[data.sources]\n")
    advised = re.search(r"checkpoint.allow_changes=\[(.*)\]$", err.strip()).group(1)
    assert run(mix(("b", 3), ("a", 1), ("c", 50)), "train.steps=3",
               f"checkpoint.allow_changes=[train.steps,{advised}]") == 0
    out = capsys.readouterr().out
    assert f"resuming with a changed data.sources: '{tmp_path}/a.txt weight 1; " in out
    assert f"resuming with changed data: {tmp_path}/c.txt is new (checkpoint.allow_changes)" in out
    report = next(line for line in out.splitlines() if line.startswith("data mixture: "))
    tokens = dict(re.findall(r"(\S+): ([\d,]+) tokens", report))
    assert int(tokens[f"{tmp_path}/c.txt"]) > 0 and sum(
        int(t.replace(",", "")) for t in tokens.values()) == 3 * 2 * 32


def test_mixture_data_parallel_shares_are_the_batch():
    a, b = np.arange(1000, dtype=np.uint16), np.arange(5000, 5090, dtype=np.uint16)
    whole, halves = _mixture([a, b]), [_mixture([a, b]), _mixture([a, b])]
    for i, h in enumerate(halves):
        h.share = (i, 2)
    for _ in range(3):
        want = whole.next_batch()[0]
        got = np.concatenate([h.next_batch()[0] for h in halves], axis=1)
        np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
        assert halves[0].state() == halves[1].state() == whole.state()


def test_mixture_through_the_config(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS])
    pq.write_table(pa.table({"body": DOCS[::-1]}), tmp_path / "b.parquet")
    cfg = load_config(TINY, [
        f"data.sources=[{{path: {tmp_path}/a.jsonl, weight: 2}}, "
        f"{{path: {tmp_path}/b.parquet, weight: 1, text_field: body}}]",
        f"data.cache_dir={tmp_path}/cache", "data.seq_len=16", "data.batch_size=2",
        f"run_dir={tmp_path}/run", "data.path=''"])
    dataset, _ = load_data(cfg, log=lambda *a: None)
    assert "a.jsonl" in dataset.summary and "weight 2" in dataset.summary
    dataset.next_batch()
    assert dataset.state()["batch"] == 1
    with pytest.raises(ConfigError, match="data.path .* and data.sources are both set"):
        load_config(TINY, [f"data.path={tmp_path}/a.jsonl",
                           f"data.sources=[{{path: {tmp_path}/a.jsonl}}]"])


# -- reading ahead -------------------------------------------------------------


def test_read_ahead_gives_the_same_batches_and_state(tmp_path):
    np.save(tmp_path / "s.npy", (np.arange(3001) * 7 % 257).astype(np.uint16))
    stream = TokenFile.of(np.load(tmp_path / "s.npy", mmap_mode="r"))
    make = lambda: PackedDataset(stream, seq_len=16, batch_size=2, seed=5, num_micro_batches=2)
    plain, ahead = make(), make()
    ahead.read_ahead = ReadAhead(ahead.read_windows)
    reads = []
    read = ahead.read_windows
    ahead.read_ahead.read = lambda taken: reads.append(1) or read(taken)
    for _ in range(300):  # several epochs: the peek crosses their boundaries
        np.testing.assert_array_equal(ahead.next_batch()[0], plain.next_batch()[0])
        assert ahead.state() == plain.state()  # the batches taken, not the one read ahead
    ahead.read_ahead.pending[1].result()  # the read of batch 301, under way
    assert len(reads) == 301  # each batch read once (the first at once, the rest ahead)
    ahead.restore({"epoch": 0, "index": 8})  # the read ahead is not of this batch: read now
    plain.restore({"epoch": 0, "index": 8})
    np.testing.assert_array_equal(ahead.next_batch()[0], plain.next_batch()[0])
    ahead.share = plain.share = (1, 2)
    np.testing.assert_array_equal(ahead.next_batch()[0], plain.next_batch()[0])


def test_mixture_read_ahead_gives_the_same_batches_each_planned_once():
    a, b = np.arange(1000, dtype=np.uint16), np.arange(5000, 5090, dtype=np.uint16)
    plain, ahead = _mixture([a, b]), _mixture([a, b])
    ahead.read_ahead = ReadAhead(ahead.read_windows)
    planned, plan = [], ahead.plan
    ahead.plan = lambda batch, positions: planned.append(batch) or plan(batch, positions)
    for _ in range(40):
        np.testing.assert_array_equal(ahead.next_batch()[0], plain.next_batch()[0])
        assert ahead.state() == plain.state()
    assert planned == list(range(41))  # each batch once: taken as read ahead (40: ahead only)
    ahead.restore({**ahead.state(), "batch": 7})  # not the batch read ahead: planned anew
    ahead.next_batch()
    assert planned[41:] == [7, 8]


# -- SFT and preference data through the same sources -------------------------


CONVERSATIONS = [[{"role": "user", "content": f"question {i}"},
                  {"role": "assistant", "content": f"answer {i} " * (1 + i % 3)}] for i in range(9)]


def test_sft_from_parquet_and_a_datasets_dir_equals_jsonl(tmp_path):
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    template = ChatTemplate.for_tokenizer(BUNDLED_TOKENIZER)
    _jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    pq.write_table(pa.table({"messages": CONVERSATIONS[:4]}), tmp_path / "c-0.parquet")
    pq.write_table(pa.table({"messages": CONVERSATIONS[4:]}), tmp_path / "c-1.parquet")
    _datasets_dir(tmp_path / "ds", [pa.table({"messages": CONVERSATIONS})])
    load = lambda p: load_examples(str(p), tok, template, seq_len=64)
    want = load(tmp_path / "c.jsonl")
    for path in (tmp_path / "c-*.parquet", tmp_path / "ds"):
        got = load(path)
        assert len(got.ids) == len(want.ids) == 9
        for g, w in zip(got.ids + got.labels, want.ids + want.labels):
            np.testing.assert_array_equal(g, w)


def test_preference_from_parquet_equals_jsonl_and_bad_rows_are_counted(tmp_path):
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    template = ChatTemplate.for_tokenizer(BUNDLED_TOKENIZER)
    pairs = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(5)]
    _jsonl(tmp_path / "p.jsonl", pairs)
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "p.parquet")
    want = load_pairs(str(tmp_path / "p.jsonl"), tok, template, seq_len=64)
    got = load_pairs(str(tmp_path / "p.parquet"), tok, template, seq_len=64)
    for g, w in zip(got.ids + got.labels, want.ids + want.labels):
        np.testing.assert_array_equal(g, w)
    pq.write_table(pa.table({"prompt": ["q", "q", "q"], "chosen": ["a", None, None],
                             "rejected": ["b", "c", "d"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad.parquet\[row 1\]: \"chosen\" must be a string .*"
                                        r"\(and 1 more bad rows in .*bad.parquet"):
        load_pairs(str(tmp_path / "bad.parquet"), tok, template, seq_len=64)


def test_token_file_reads_what_a_memmap_would(tmp_path):
    ids = (np.arange(1000) * 37 % 50257).astype(np.uint32)
    np.save(tmp_path / "t.npy", ids)
    mapped = np.load(tmp_path / "t.npy", mmap_mode="r")
    tokens = TokenFile.of(mapped)
    assert len(tokens) == 1000 and tokens.dtype == np.uint32 and tokens.ndim == 1
    windows = np.array([3, 500, 983])[:, None] + np.arange(17)
    np.testing.assert_array_equal(tokens[windows], ids[windows])
    tail = tokens[900:]
    assert len(tail) == 100 and int(tail[0]) == int(ids[900]) and int(tail[-1]) == int(ids[-1])
    np.testing.assert_array_equal(tail[np.array([[5, 6, 7]])], ids[900:][[[5, 6, 7]]])
    np.testing.assert_array_equal(tokens[np.array([9, 2, 400])], ids[[9, 2, 400]])
    np.testing.assert_array_equal(np.asarray(tokens[10:20]), ids[10:20])
    with pytest.raises(IndexError):
        tokens[np.array([[995, 996, 997, 998, 999, 1000]])]


def _chat_data(tmp_path, fmt) -> str:
    if fmt == "sft":
        _jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    else:
        _jsonl(tmp_path / "c.jsonl", [{"prompt": f"q{i}", "chosen": f"good {i} " * (1 + i % 4),
                                       "rejected": f"bad {i}"} for i in range(9)])
    return str(tmp_path / "c.jsonl")


@pytest.mark.parametrize("fmt", ["sft", "preference"])
def test_sft_and_preference_tokenized_once_reused_and_rebuilt_when_stale(tmp_path, monkeypatch,
                                                                         fmt):
    from megatrain_jax import chat, preference

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok_dir / name).write_bytes(open(os.path.join(os.path.dirname(BUNDLED_TOKENIZER),
                                                       name), "rb").read())
    path, cache = _chat_data(tmp_path, fmt), tmp_path / "cache"
    cfg = load_config(TINY, [f"data.format={fmt}", f"data.path={path}", f"data.cache_dir={cache}",
                             f"data.tokenizer={tok_dir}/tokenizer.json", "model.vocab_size=512",
                             "data.seq_len=48", "data.batch_size=2", "data.overlong=truncate",
                             f"run_dir={tmp_path}/run"])
    tok, template = load_tokenizer(cfg.data.tokenizer), ChatTemplate.for_tokenizer(cfg.data.tokenizer)
    if fmt == "sft":  # what loading without a cache gives
        want = chat.pack(load_examples(path, tok, template, seq_len=48, vocab_size=512), 48)
    else:
        want = preference.rows(load_pairs(path, tok, template, seq_len=48, vocab_size=512), 48)
    lines = []
    dataset, _ = load_data(cfg, log=lines.append)
    assert [line.split()[0] for line in lines] == ["tokenizing", "tokenized"]
    assert [d.split("-")[0] for d in os.listdir(cache)] == [fmt]
    for key, value in want.items():
        np.testing.assert_array_equal(dataset.rows[key], value)
    assert "truncated" in dataset.summary

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(chat, "encode_conversation", refuse)
    monkeypatch.setattr(preference, "encode_conversation", refuse)
    lines.clear()
    again, _ = load_data(cfg, log=lines.append)  # a resume: nothing rendered or tokenized
    assert lines == [] and again.summary == dataset.summary
    for key, value in want.items():
        np.testing.assert_array_equal(again.rows[key], value)
    monkeypatch.undo()

    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{# edited #}" + config["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    load_data(cfg, log=lines.append)
    assert "stale (the chat template file changed" in lines[0], lines
    with open(path, "a") as f:  # one more record
        f.write(open(path).readline())
    lines.clear()
    grown, _ = load_data(cfg, log=lines.append)
    assert f"stale ({path} changed" in lines[0], lines
    assert (getattr(grown, "num_pairs", None) or grown.num_windows) >= \
        (getattr(dataset, "num_pairs", None) or dataset.num_windows)
    assert len(os.listdir(cache)) == 1  # rebuilt in place: no temporary or old cache left


@pytest.mark.parametrize("fmt", ["sft", "preference"])
def test_an_sft_or_preference_cache_with_ids_past_the_vocabulary_is_refused(tmp_path, fmt):
    path, cache = _chat_data(tmp_path, fmt), tmp_path / "cache"
    cfg = load_config(TINY, [f"data.format={fmt}", f"data.path={path}", f"data.cache_dir={cache}",
                             f"data.tokenizer={BUNDLED_TOKENIZER}", "model.vocab_size=512",
                             "data.seq_len=48", "data.batch_size=2", f"run_dir={tmp_path}/run"])
    load_data(cfg, log=lambda *a: None)
    directory = str(cache / os.listdir(cache)[0])
    _damage_ids(directory, np.uint16, 5, 512)
    with pytest.raises(DataError, match=re.escape(
            f"{directory}/tokens.bin: token id 512 at offset 5 >= model.vocab_size (512): the "
            f"token cache is damaged; remove {directory}")):
        load_data(cfg, log=lambda *a: None)


PAIRS = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(7)]


def _chat_shards(tmp_path, fmt, records) -> str:
    """`records` in 2 shards of format `fmt`; the data path to give (a glob or the directory)."""
    parts = [records[:3], records[3:]]
    d = tmp_path / fmt
    tmp_path.mkdir(exist_ok=True)
    if fmt == "datasets":
        _datasets_dir(d, [pa.Table.from_pylist(p) for p in parts])
        return str(d)
    d.mkdir()
    for i, part in enumerate(parts):
        if fmt == "jsonl":
            _jsonl(d / f"part-{i}.jsonl", part)
        elif fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(part), d / f"part-{i}.parquet")
        else:
            _arrow(d / f"part-{i}.arrow", pa.Table.from_pylist(part), stream=fmt == "arrow-stream")
    return str(d / "part-*") if fmt == "jsonl" else str(d)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow-file", "arrow-stream", "datasets"])
def test_sft_and_preference_from_every_record_format_and_bad_rows_counted(tmp_path, fmt):
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    template = ChatTemplate.for_tokenizer(BUNDLED_TOKENIZER)
    conversations = [{"messages": m} for m in CONVERSATIONS]
    _jsonl(tmp_path / "c.jsonl", conversations)
    _jsonl(tmp_path / "p.jsonl", PAIRS)
    for load, records, want in (
            (load_examples, conversations, load_examples(str(tmp_path / "c.jsonl"), tok, template,
                                                         seq_len=64)),
            (load_pairs, PAIRS, load_pairs(str(tmp_path / "p.jsonl"), tok, template, seq_len=64))):
        got = load(_chat_shards(tmp_path / load.__name__, fmt, records), tok, template, seq_len=64)
        assert len(got.ids) == len(want.ids) == len(records) * (1 + (load is load_pairs))
        for g, w in zip(got.ids + got.labels, want.ids + want.labels):
            np.testing.assert_array_equal(g, w)
    bad = [{"messages": m} for m in CONVERSATIONS[:5]]
    bad[1]["messages"] = bad[4]["messages"] = [{"role": "user", "content": "no answer"}]
    path = _chat_shards(tmp_path / "bad", fmt, bad)
    first = "part-0.jsonl:2" if fmt == "jsonl" else "[row 1]"
    with pytest.raises(DataError, match=rf"{re.escape(first)}: no assistant message.*"
                                        rf"\(and 1 more bad rows in "):
        load_examples(path, tok, template, seq_len=64)


def test_sft_data_of_token_ids_is_refused(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match=r"t.bin: bin files hold no conversations; give .jsonl"):
        load_examples(str(tmp_path / "t.bin"), load_tokenizer(BUNDLED_TOKENIZER),
                      ChatTemplate.for_tokenizer(BUNDLED_TOKENIZER), seq_len=64)


@pytest.mark.parametrize("fmt", ["sft", "preference"])
def test_sources_mixture_with_sft_or_preference_is_one_line_exit_2(tmp_path, capsys, fmt):
    _jsonl(tmp_path / "a.jsonl", PAIRS)
    code = commands.train(["--config", TINY, f"data.format={fmt}", "data.path=''",
                           f"data.sources=[{{path: {tmp_path}/a.jsonl}}]",
                           f"data.tokenizer={BUNDLED_TOKENIZER}", f"run_dir={tmp_path}/run"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == [f"error: data.sources (a mixture) is for data.format=text, got "
                                   f"data.format={fmt}; give data.path"]
    assert not (tmp_path / "run").exists()


def test_documented_mixture_recipe_loads(tmp_path, monkeypatch):
    """docs/data.md's data.sources block as written: Parquet shards by a glob and a directory of JSONL
    whose field is `content`, mixed 3:1."""
    import yaml

    guide = open(os.path.join(ROOT, "docs", "data.md"), encoding="utf-8").read()
    block = guide.split("`data.sources` mixes several such paths by weight:")[1]
    block = block.split("```yaml")[1].split("```")[0]
    (tmp_path / "datasets/fineweb-edu/data").mkdir(parents=True)
    for k in range(2):
        pq.write_table(pa.table({"text": DOCS[k::2]}), tmp_path / f"datasets/fineweb-edu/data/"
                                                                  f"train-{k}.parquet")
    (tmp_path / "datasets/code").mkdir()
    _jsonl(tmp_path / "datasets/code/a.jsonl", [{"content": d} for d in DOCS])
    config = yaml.safe_load(open(TINY)) | yaml.safe_load(block)
    config["data"] = yaml.safe_load(open(TINY))["data"] | config["data"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # the recipe's relative paths
    cfg = load_config(str(tmp_path / "c.yaml"), [f"data.cache_dir={tmp_path}/cache",
                                                 "data.seq_len=16", "data.batch_size=2"])
    assert [(s.path, s.weight) for s in cfg.data.sources] == [
        ("datasets/fineweb-edu/data/*.parquet", 3.0), ("datasets/code", 1.0)]
    dataset, _ = load_data(cfg, log=lambda *a: None)
    for _ in range(20):
        dataset.next_batch()
    tokens = dataset.state()["tokens"]
    assert tokens[0] > tokens[1] > 0 and sum(tokens) == 20 * 2 * 16


def test_a_resume_notices_every_change_the_token_cache_notices(tmp_path):
    """A corpus edited in place past its first MiB, at the same size: the token cache saw it
    (rebuilt) and the resume did not (size and head only), so a run went on with other data.
    The resume compares the mtime too: what the cache compares. A checkpoint from before mtimes
    were recorded compares the size and the head, as it did."""
    from megatrain_jax.fingerprint import HEAD_BYTES, files_identity, first_change

    path = tmp_path / "big.txt"
    path.write_bytes((DOCS[3] * (HEAD_BYTES // len(DOCS[3]) + 2000)).encode())  # ASCII
    assert path.stat().st_size > HEAD_BYTES + 10_000
    source, cache_dir = resolve(str(path)), str(tmp_path / "cache")
    open_cache(source, BYTE, cache_dir, log=lambda *a: None)
    saved = files_identity([str(path)])
    with open(path, "r+b") as f:  # past the head, same size
        f.seek(HEAD_BYTES + 5000)
        f.write(b"EDITED")
    mtime = saved[0]["mtime_ns"] + 10**9  # a write within the clock's tick would keep it
    os.utime(path, ns=(mtime, mtime))
    now = files_identity([str(path)])
    assert [(n["bytes"], n["head_sha256"]) for n in now] == [(s["bytes"], s["head_sha256"])
                                                            for s in saved]
    lines = []
    open_cache(source, BYTE, cache_dir, log=lines.append)
    assert "stale" in lines[0]  # the cache saw it ...
    change = first_change(saved, now)  # ... and so does the resume
    assert change.startswith(f"{path}: its mtime is ") and change.endswith(
        f"when the checkpoint was saved (the same size and first {HEAD_BYTES:,} bytes: an edit "
        f"past them, or the file touched or copied over)")
    older = [{k: v for k, v in s.items() if k != "mtime_ns"} for s in saved]  # older checkpoints
    assert first_change(older, now) is None
    path.write_bytes(path.read_bytes()[:-25])
    assert first_change(saved, files_identity([str(path)])) == (
        f"{path} is {saved[0]['bytes'] - 25:,} bytes, {saved[0]['bytes']:,} when the checkpoint "
        f"was saved")
