import json
import os

import numpy as np
import pytest

from megatrain_jax import data
from megatrain_jax.data import (ByteTokenizer, DataError, HFTokenizer, PackedDataset,
                                check_token_ids, document_context, load_tokenizer, load_tokens)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "megatrain_jax", "texts", "devils_dictionary.txt")


def batches(ds, k):
    return [ds.next_batch() for _ in range(k)]


# -- tokenizers ---------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.eos_id == 256 and tok.vocab_size == 257
    text = "Héllo, wörld — 日本語 🙂"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and len(ids) == len(text.encode("utf-8"))
    assert ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eos_id)) == text  # eos is skipped


def _tiny_hf_tokenizer(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return vocab


def test_hf_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    vocab = _tiny_hf_tokenizer(path)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(vocab)
    assert tok.eos_id == vocab["</s>"]
    ids = tok.encode("hello world again")
    assert ids.dtype == np.int32 and ids.tolist() == [2, 3, 4]
    assert tok.decode(np.append(ids, tok.eos_id)) == "hello world again"

    assert HFTokenizer(str(path), eos_token="again").eos_id == 4
    with pytest.raises(DataError, match="EOS"):
        HFTokenizer(str(path), eos_token="<nope>")

    (tmp_path / "tokens.jsonl").write_text('{"text": "hello"}\n{"text": "world world"}\n')
    assert load_tokens(str(tmp_path / "tokens.jsonl"), tok).tolist() == [2, 1, 3, 3, 1]


def test_tokenizer_errors(tmp_path):
    missing = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(DataError, match="tokenizer file not found: .*nope"):
        load_tokenizer(missing)
    with pytest.raises(DataError, match="unknown tokenizer"):
        load_tokenizer("gpt7")


# -- loading ------------------------------------------------------------------


def test_load_txt(tmp_path):
    tok = ByteTokenizer()
    p = tmp_path / "a.txt"
    p.write_text("abc é", encoding="utf-8")
    tokens = load_tokens(str(p), tok)
    assert tokens.ndim == 1 and tokens.dtype.kind in "iu"
    assert tokens.tolist() == list("abc é".encode("utf-8")) + [tok.eos_id]


def test_load_jsonl_packs_with_eos(tmp_path):
    tok = ByteTokenizer()
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"text": "hi", "id": 1}) + "\n\n" + json.dumps({"body": "yo", "text": "ok"}) + "\n")
    tokens = load_tokens(str(p), tok)
    assert tokens.tolist() == [ord("h"), ord("i"), 256, ord("o"), ord("k"), 256]
    p.write_text(json.dumps({"body": "yo"}) + "\n")
    assert load_tokens(str(p), tok, text_field="body").tolist() == [ord("y"), ord("o"), 256]


def test_load_bin_uint16_is_memmap(tmp_path):
    p = tmp_path / "a.bin"
    data = np.arange(1000, dtype=np.uint16) * 7
    data.tofile(p)
    tokens = load_tokens(str(p), None, token_dtype="uint16")
    assert isinstance(tokens, np.memmap)
    assert tokens.dtype == np.uint16 and np.array_equal(tokens, data)
    np.arange(10, dtype=np.uint32).tofile(p)
    assert load_tokens(str(p), None, token_dtype="uint32").tolist() == list(range(10))


def test_load_npy(tmp_path):
    p = tmp_path / "a.npy"
    data = np.arange(500, dtype=np.int32)
    np.save(p, data)
    tokens = load_tokens(str(p), None)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, data)
    np.save(p, np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(DataError, match=r"a\.npy.*1-D integer.*shape \(4, 4\).*data\.path"):
        load_tokens(str(p), None)
    np.save(p, np.zeros(4, dtype=np.float32))
    with pytest.raises(DataError, match=r"a\.npy.*1-D integer.*dtype float32.*data\.path"):
        load_tokens(str(p), None)


def test_shipped_corpus():
    tok = ByteTokenizer()
    tokens = load_tokens(CORPUS, tok)
    assert len(tokens) > 300_000
    assert tokens[-1] == tok.eos_id and (tokens[:-1] < 256).all()
    assert "DEVIL" in tok.decode(tokens[:20_000]).upper()


# -- errors -------------------------------------------------------------------


def test_missing_data_file(tmp_path):
    p = str(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match="data file not found: .*absent.jsonl"):
        load_tokens(p, ByteTokenizer())


def test_bad_jsonl_lines(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"}\n{not json\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:3: invalid JSON"):
        load_tokens(str(p), ByteTokenizer())
    p.write_text('{"text": "a"}\n\n{"txt": "b"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:3: missing field 'text'"):
        load_tokens(str(p), ByteTokenizer())


def test_bad_token_dtype(tmp_path):
    p = tmp_path / "tok.bin"
    np.arange(10, dtype=np.uint16).tofile(p)
    for bad in (None, "int8", "float32"):
        with pytest.raises(DataError, match=r"tok\.bin.*data\.token_dtype"):
            load_tokens(str(p), None, token_dtype=bad)


def test_too_small_data():
    # says what the 8 is (windows, not tokens), and names the keys that change it
    with pytest.raises(DataError) as e:
        PackedDataset(np.arange(50), seq_len=8, batch_size=4, seed=0, num_micro_batches=2)
    assert str(e.value) == (
        "data too small: 50 tokens make 6 windows of data.seq_len=8 tokens, but one step takes "
        "data.batch_size x data.micro_batches = 4 x 2 = 8 windows (65 tokens); use more data or "
        "lower data.seq_len, data.batch_size or data.micro_batches")
    # exactly enough: 8 windows need 8 * 8 + 1 tokens
    PackedDataset(np.arange(65), seq_len=8, batch_size=4, seed=0, num_micro_batches=2)


# -- validation when a dataset opens (issue 11) -------------------------------


def test_bin_ids_beyond_vocab_refused_with_offset(tmp_path):
    p = tmp_path / "x.bin"
    ids = np.arange(1000, dtype=np.uint32) % 500
    ids[123], ids[700] = 70000, 80000  # the first bad one is reported
    ids.tofile(p)
    with pytest.raises(DataError) as e:
        load_tokens(str(p), None, vocab_size=65536, token_dtype="uint32")
    assert str(e.value) == f"{p}: token id 70000 at offset 123 >= model.vocab_size (65536)"
    assert len(load_tokens(str(p), None, vocab_size=80001, token_dtype="uint32")) == 1000

    ids = np.arange(1000, dtype=np.uint16) % 200
    ids[999] = 257  # the last token, against a byte-level model
    ids.tofile(p)
    with pytest.raises(DataError, match=r"x\.bin: token id 257 at offset 999 >= model\.vocab_size \(257\)"):
        load_tokens(str(p), ByteTokenizer(), vocab_size=257, token_dtype="uint16")
    # no vocab_size: the tokenizer's is the bound, and the message says so
    with pytest.raises(DataError, match=r"offset 999 >= the tokenizer's vocab_size \(257\)"):
        load_tokens(str(p), ByteTokenizer(), token_dtype="uint16")


def test_npy_negative_and_large_ids_refused(tmp_path):
    p = tmp_path / "x.npy"
    for dtype in (np.int16, np.int32, np.int64):
        ids = np.arange(300, dtype=dtype) % 100
        ids[7] = -3
        ids[9] = 5000
        np.save(p, ids)
        for vocab_size in (100, 70_000, 2**40):  # also beyond what the dtype can hold
            with pytest.raises(DataError, match=r"x\.npy: token id -3 at offset 7 is negative"):
                load_tokens(str(p), None, vocab_size=vocab_size)
        ids[7] = 1
        np.save(p, ids)
        with pytest.raises(DataError, match=r"x\.npy: token id 5000 at offset 9 >= model\.vocab_size"):
            load_tokens(str(p), None, vocab_size=100)


def test_text_and_jsonl_ids_checked_against_model_vocab(tmp_path):
    tok = ByteTokenizer()
    p = tmp_path / "a.txt"
    p.write_text("abcz")  # 'z' = 122
    with pytest.raises(DataError, match=r"a\.txt: token id 122 at offset 3 >= model\.vocab_size \(100\)"):
        load_tokens(str(p), tok, vocab_size=100)
    q = tmp_path / "a.jsonl"
    q.write_text('{"text": "ab"}\n{"text": "c"}\n')  # a b EOS c EOS: the EOS (256) is out of range
    with pytest.raises(DataError, match=r"a\.jsonl: token id 256 at offset 2 >= model\.vocab_size \(200\)"):
        load_tokens(str(q), tok, vocab_size=200)
    assert load_tokens(str(q), tok, vocab_size=257).tolist() == [97, 98, 256, 99, 256]


class _SliceRecorder:
    """An array stand-in that records how much of it each read asks for."""

    def __init__(self, array):
        self.array, self.dtype, self.reads = array, array.dtype, []

    def __len__(self):
        return len(self.array)

    def __getitem__(self, key):
        out = self.array[key]
        self.reads.append(np.size(out))
        return out


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64])
def test_id_scan_is_chunked(monkeypatch, dtype):
    monkeypatch.setattr(data, "SCAN_CHUNK", 1000)
    ids = (np.arange(10_500) % 50).astype(dtype)
    tokens = _SliceRecorder(ids)
    check_token_ids(tokens, 50, "t")  # all in range: every chunk read once, none larger than a chunk
    assert max(tokens.reads) <= 1000 and sum(tokens.reads) == len(ids)
    ids[9_876] = 50  # in the last full chunk, after clean ones
    with pytest.raises(DataError, match=r"token id 50 at offset 9876 >="):
        check_token_ids(_SliceRecorder(ids), 50, "t")


def test_bin_size_not_a_multiple_of_the_token_size(tmp_path):
    p = tmp_path / "t.bin"
    p.write_bytes(b"\x01\x00" * 10 + b"\x01")  # a uint16 file cut mid-token
    with pytest.raises(DataError, match=r"t\.bin: size 21 bytes is not a multiple of 2 "
                                        r"\(data\.token_dtype=uint16\): truncated"):
        load_tokens(str(p), None, token_dtype="uint16")
    p.write_bytes(b"\x01\x00" * 11)  # 11 uint16 ids read as uint32
    with pytest.raises(DataError, match=r"size 22 bytes is not a multiple of 4 .*data\.token_dtype=uint16"):
        load_tokens(str(p), None, token_dtype="uint32")


@pytest.mark.parametrize("name", ["e.bin", "e.npy", "e.txt", "e.jsonl"])
def test_empty_file(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"")
    with pytest.raises(DataError, match=rf"{name}: empty file \(0 bytes\); data\.path"):
        load_tokens(str(p), ByteTokenizer(), token_dtype="uint16")


def test_no_documents_and_empty_array(tmp_path):
    p = tmp_path / "blank.jsonl"
    p.write_text("\n  \n\n")
    with pytest.raises(DataError, match=r"blank\.jsonl: no documents"):
        load_tokens(str(p), ByteTokenizer())
    q = tmp_path / "empty.npy"
    np.save(q, np.zeros(0, dtype=np.int32))
    with pytest.raises(DataError, match=r"empty\.npy: no tokens"):
        load_tokens(str(q), None)


def _uint32_file(path, rng, vocab_size, n=50_000):
    ids = rng.integers(0, vocab_size, size=n).astype(np.uint32)
    ids.tofile(path)
    return ids


@pytest.mark.parametrize("vocab_size", [257, 50_257, 65_536, 128_256, 262_144])
def test_uint32_ids_read_as_uint16_refused(tmp_path, vocab_size):
    p = tmp_path / "ids.bin"
    ids = _uint32_file(p, np.random.default_rng(vocab_size), vocab_size)
    with pytest.raises(DataError, match=r"ids\.bin: looks like uint32 token ids read as uint16.*"
                                        r"set data\.token_dtype=uint32$"):
        load_tokens(str(p), None, vocab_size=vocab_size, token_dtype="uint16")
    np.testing.assert_array_equal(load_tokens(str(p), None, vocab_size=vocab_size, token_dtype="uint32"), ids)


def test_uint32_check_samples_start_middle_and_end(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SNIFF_PAIRS", 1000)  # 50,000 pairs: three samples of 1,000
    p = tmp_path / "ids.bin"
    ids = _uint32_file(p, np.random.default_rng(1), 50_257)
    with pytest.raises(DataError, match=r"in 3,000 sampled pairs every second uint16 is 0"):
        load_tokens(str(p), None, vocab_size=50_257, token_dtype="uint16")
    halves = ids.view(np.uint16).copy()
    halves[2 * 25_000 + 1] = 7  # one high half in the middle sample that no uint32 id < 65536 has
    halves.tofile(p)
    assert len(load_tokens(str(p), None, vocab_size=50_257, token_dtype="uint16")) == 100_000


def test_uint32_check_does_not_fire_on_real_uint16_data(tmp_path):
    p = tmp_path / "ids.bin"
    rng = np.random.default_rng(0)
    corpora = {
        "random gpt2 ids": rng.integers(0, 50_257, size=200_001),
        "byte ids, id 0 common": np.where(rng.random(200_000) < 0.4, 0, rng.integers(1, 257, 200_000)),
        "all zeros (padding)": np.zeros(100_000),
        "id 0 at 99% of odd positions": np.where((np.arange(100_000) % 2 == 1) & (rng.random(100_000) < 0.99),
                                                 0, rng.integers(1, 257, 100_000)),
        "short ascending": np.arange(100),
    }
    for name, ids in corpora.items():
        ids.astype(np.uint16).tofile(p)
        tokens = load_tokens(str(p), None, vocab_size=50_257, token_dtype="uint16")
        assert len(tokens) == len(ids), name


def test_uint16_ids_read_as_uint32_hint(tmp_path):
    p = tmp_path / "ids.bin"
    (np.arange(1000) % 50_000 + 1).astype(np.uint16).tofile(p)
    with pytest.raises(DataError, match=r"ids\.bin: token id \d+ at offset 0 >= model\.vocab_size \(50257\); "
                                        r"if the file holds uint16 ids, set data\.token_dtype=uint16"):
        load_tokens(str(p), None, vocab_size=50_257, token_dtype="uint32")


def test_data_path_is_a_directory(tmp_path):
    with pytest.raises(DataError, match=rf"data\.path {tmp_path} is a directory, not a data file"):
        load_tokens(str(tmp_path), ByteTokenizer())


def test_unreadable_data_file(tmp_path, monkeypatch):
    p = tmp_path / "secret.bin"
    np.arange(100, dtype=np.uint16).tofile(p)
    os.chmod(p, 0)
    try:
        try:
            open(p, "rb").close()
        except PermissionError:
            pass
        else:  # root reads anything: make the read fail as it does for a user
            def refuse(path, *args, **kw):
                raise PermissionError(13, "Permission denied", str(path))
            monkeypatch.setattr(data, "open", refuse, raising=False)
        with pytest.raises(DataError) as e:
            load_tokens(str(p), None, token_dtype="uint16")
        assert str(e.value) == f"{p}: cannot read data file (Permission denied)"
    finally:
        os.chmod(p, 0o644)


def test_invalid_utf8_named_with_its_line(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_bytes(b'{"text": "ok"}\n' + b'\x89PNG\r\n\x1a\n\x00\xff\xfe garbage\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: not valid UTF-8 \(byte 0 of the line\)"):
        load_tokens(str(p), ByteTokenizer())
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')  # latin-1, not UTF-8
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: not valid UTF-8 \(byte 13 of the line\)"):
        load_tokens(str(p), ByteTokenizer())
    q = tmp_path / "a.txt"
    q.write_bytes(b"line one\nline two\nbad \xff here\n")
    with pytest.raises(DataError, match=r"a\.txt:3: not valid UTF-8 text \(byte 22\)"):
        load_tokens(str(q), ByteTokenizer())


def test_bad_npy_files(tmp_path):
    p = tmp_path / "t.npy"
    np.save(p, np.arange(1000, dtype=np.int32))
    p.write_bytes(p.read_bytes()[:500])  # truncated
    with pytest.raises(DataError, match=r"t\.npy: cannot load \.npy \(.*\); data\.path must be"):
        load_tokens(str(p), None)
    np.save(p, np.array([1, "a"], dtype=object))  # never unpickled
    with pytest.raises(DataError, match=r"t\.npy: cannot load \.npy"):
        load_tokens(str(p), None)
    for garbage in (b"\x93NUMPY\x01", b"not a numpy file at all\n" * 10):  # a cut header; text
        p.write_bytes(garbage)
        with pytest.raises(DataError, match=r"t\.npy: cannot load \.npy"):
            load_tokens(str(p), None)


def test_load_dataset_checks_against_model_vocab_size(tmp_path):
    from megatrain_jax.config import load_config
    from megatrain_jax.recipes import load_dataset

    p = tmp_path / "x.bin"
    ids = np.arange(5000, dtype=np.uint16) % 257
    ids[4321] = 300
    ids.tofile(p)
    cfg = load_config(None, [f"data.path={p}", "data.token_dtype=uint16", "model.vocab_size=257"])
    with pytest.raises(DataError, match=r"x\.bin: token id 300 at offset 4321 >= model\.vocab_size \(257\)"):
        load_dataset(cfg)


def test_a_lone_surrogate_in_json_text_is_named_with_its_line_and_field(tmp_path):
    """JSON's \\ud800 unpaired decodes to a string no tokenizer can encode (it was a traceback
    from the tokenizer); a pair of them is one character, an emoji, and trains."""
    p = tmp_path / "corpus.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "abc\\ud800def"}\n')
    with pytest.raises(DataError, match=r"^\S*corpus\.jsonl:2: field 'text' holds a lone surrogate "
                                        r"'\\ud800' at character 3 .*fix or remove the line$"):
        load_tokens(str(p), ByteTokenizer())
    p.write_text('{"text": "ok"}\n{"meta": {"tags": ["x", "\\uDFFF"]}, "text": "y"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: field 'meta.tags\[1\]' holds"):
        load_tokens(str(p), ByteTokenizer())
    p.write_text('{"text": "ok \\ud83d\\ude00"}\n')
    assert load_tokens(str(p), ByteTokenizer())[-5:].tolist() == [240, 159, 152, 128, 256]


def test_bad_data_through_the_cli(tmp_path, capsys):
    """scripts/train.py's main (commands.train, in-process) turns each into one `error:` line,
    exit 2, no traceback, nothing written."""
    from megatrain_jax import commands

    (tmp_path / "garbage.jsonl").write_bytes(b"\x00\x9f\x92\x96" * 100)
    (tmp_path / "half.jsonl").write_text('{"text": "abc\\ud800def"}\n')
    _uint32_file(tmp_path / "u32.bin", np.random.default_rng(0), 257)
    cases = {tmp_path: "a bin shard among jsonl shards", tmp_path / "garbage.jsonl": "garbage.jsonl:1: not valid UTF-8",
             tmp_path / "half.jsonl": "half.jsonl:1: field 'text' holds a lone surrogate",
             tmp_path / "u32.bin": "set data.token_dtype=uint32"}
    for path, message in cases.items():
        code = commands.train(["--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                               f"data.path={path}", f"run_dir={tmp_path}/run"])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("error: ") and message in lines[0]
        assert not (tmp_path / "run").exists()


# -- batching -----------------------------------------------------------------


def test_batch_shapes_and_shift():
    stream = (np.arange(1001) * 31 % 257).astype(np.int64)  # values do not reveal positions
    ds = PackedDataset(stream, seq_len=16, batch_size=4, seed=1, num_micro_batches=3)
    assert ds.tokens_per_batch == 3 * 4 * 16
    x, y = ds.next_batch()
    assert x.shape == y.shape == (3, 4, 16)
    assert x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    starts = ds.order.perm[:12] * 16
    for k, (xi, yi) in enumerate(zip(x.reshape(12, 16), y.reshape(12, 16))):
        np.testing.assert_array_equal(xi, stream[starts[k]:starts[k] + 16])
        np.testing.assert_array_equal(yi, stream[starts[k] + 1:starts[k] + 17])


def test_memmap_batches(tmp_path):
    p = tmp_path / "a.bin"
    np.arange(4097, dtype=np.uint16).tofile(p)
    ds = PackedDataset(load_tokens(str(p), None, token_dtype="uint16"), seq_len=64, batch_size=2, seed=0)
    x, y = ds.next_batch()
    assert type(x) is np.ndarray and x.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)
    assert (x[..., 0] % 64 == 0).all()


def test_seed_determinism():
    stream = np.arange(10_000)
    kw = dict(seq_len=8, batch_size=4)
    a = batches(PackedDataset(stream, seed=0, **kw), 5)
    b = batches(PackedDataset(stream, seed=0, **kw), 5)
    c = batches(PackedDataset(stream, seed=1, **kw), 5)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert any(not np.array_equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_resume_after_k_batches():
    stream = np.arange(401)  # 50 windows of 8 -> 4 batches of 12 per epoch, so resume crosses an epoch
    kw = dict(seq_len=8, batch_size=4, seed=3, num_micro_batches=3)
    ref = PackedDataset(stream, **kw)
    expected = batches(ref, 6)

    ds = PackedDataset(stream, **kw)
    batches(ds, 3)
    state = ds.state()
    assert state == {"epoch": 0, "index": 36}
    assert all(type(v) is int for v in state.values())
    state = json.loads(json.dumps(state))  # survives a checkpoint round trip

    fresh = PackedDataset(stream, **kw)
    fresh.restore(state)
    for (x, y), (xe, ye) in zip(batches(fresh, 3), expected[3:]):
        np.testing.assert_array_equal(x, xe)
        np.testing.assert_array_equal(y, ye)
    assert fresh.state() == ref.state()


def test_epochs_use_every_window_once():
    seq_len, n = 4, 12
    stream = np.arange(n * seq_len + 1)  # token value == position, so inputs[..., 0] is the window start
    ds = PackedDataset(stream, seq_len=seq_len, batch_size=3, seed=7)
    orders = []
    for epoch in range(3):
        starts = np.concatenate([ds.next_batch()[0][..., 0].ravel() for _ in range(n // 3)])
        assert ds.state() == {"epoch": epoch, "index": n}
        assert sorted(starts.tolist()) == list(range(0, n * seq_len, seq_len))
        orders.append(starts.tolist())
    assert orders[0] != orders[1] or orders[1] != orders[2]  # reshuffled per epoch


def test_partial_batch_dropped():
    stream = np.arange(13 * 4 + 1)  # 13 windows, batch 3 -> 4 full batches, 1 window dropped
    ds = PackedDataset(stream, seq_len=4, batch_size=3, seed=0)
    seen = {int(s) for _ in range(4) for s in ds.next_batch()[0][..., 0].ravel()}
    assert len(seen) == 12 and ds.state() == {"epoch": 0, "index": 12}
    ds.next_batch()
    assert ds.state() == {"epoch": 1, "index": 3}


def test_restore_rejects_bad_state():
    ds = PackedDataset(np.arange(101), seq_len=4, batch_size=2, seed=0)
    with pytest.raises(DataError, match="bad data state"):
        ds.restore({"epoch": 0, "index": 26})


# -- document masks for packed windows (issue 10) -------------------------------


def _document_context_loop(row, eos_id):
    """The definition, one token at a time: EOS before t (strictly) and t's index in its document."""
    segment_ids, positions, seg, pos = [], [], 0, 0
    for token in row:
        segment_ids.append(seg)
        positions.append(pos)
        seg, pos = (seg + 1, 0) if token == eos_id else (seg, pos + 1)
    return segment_ids, positions


@pytest.mark.parametrize("row,segment_ids,positions", [
    ([9, 1, 2, 3], [0, 1, 1, 1], [0, 0, 1, 2]),            # EOS at the start ends the previous document
    ([1, 2, 3, 9], [0, 0, 0, 0], [0, 1, 2, 3]),            # EOS at the end belongs to the document it ends
    ([1, 9, 9, 2, 3], [0, 0, 1, 2, 2], [0, 1, 0, 0, 1]),   # two in a row: an empty document between
    ([4, 5, 6, 7, 8], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]),   # no EOS: one (partial) document
    ([9, 9, 9], [0, 1, 2], [0, 0, 0]),
    ([3], [0], [0]),
])
def test_document_context_hand_made(row, segment_ids, positions):
    ctx = document_context(np.array(row), eos_id=9)
    assert set(ctx) == {"segment_ids", "positions"}
    assert ctx["segment_ids"].dtype == ctx["positions"].dtype == np.int32
    assert ctx["segment_ids"].tolist() == segment_ids
    assert ctx["positions"].tolist() == positions


def test_document_context_rows_and_micro_batches():
    inputs = np.array([[[1, 2, 9, 3, 4, 5],     # (micro-batches, batch, T) = (2, 2, 6)
                        [9, 9, 1, 2, 3, 9]],
                       [[1, 2, 3, 4, 5, 6],
                        [7, 9, 8, 9, 6, 9]]])
    ctx = document_context(inputs, eos_id=9)
    assert ctx["segment_ids"].shape == ctx["positions"].shape == (2, 2, 6)
    np.testing.assert_array_equal(ctx["segment_ids"], [[[0, 0, 0, 1, 1, 1], [0, 1, 2, 2, 2, 2]],
                                                       [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 2, 2]]])
    np.testing.assert_array_equal(ctx["positions"], [[[0, 1, 2, 0, 1, 2], [0, 0, 0, 1, 2, 3]],
                                                     [[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 0, 1]]])


def test_document_context_positions_are_arange_within_each_segment():
    rng = np.random.default_rng(0)
    eos_id = 5
    inputs = rng.integers(0, 6, size=(3, 4, 64))  # EOS about one token in six
    ctx = document_context(inputs, eos_id)
    for row, seg, pos in zip(inputs.reshape(-1, 64), ctx["segment_ids"].reshape(-1, 64),
                             ctx["positions"].reshape(-1, 64)):
        ref_seg, ref_pos = _document_context_loop(row, eos_id)
        assert seg.tolist() == ref_seg and pos.tolist() == ref_pos
        for s in np.unique(seg):
            np.testing.assert_array_equal(pos[seg == s], np.arange(np.count_nonzero(seg == s)))
        assert np.all(np.diff(seg) == (row[:-1] == eos_id))  # a new segment right after each EOS


def test_document_context_on_a_batch_from_the_dataset():
    tok = ByteTokenizer()
    stream = np.concatenate([np.append(tok.encode("x" * n), tok.eos_id) for n in (3, 10, 1, 7, 20, 5)] * 20)
    x, _ = PackedDataset(stream, seq_len=16, batch_size=2, seed=0, num_micro_batches=2).next_batch()
    ctx = document_context(x, tok.eos_id)
    assert ctx["positions"].shape == x.shape
    for row, pos in zip(x.reshape(-1, 16), ctx["positions"].reshape(-1, 16)):
        assert pos.tolist() == _document_context_loop(row, tok.eos_id)[1]
