import json
import os

import numpy as np
import pytest

from megatrain_jax.data import (ByteTokenizer, DataError, HFTokenizer, PackedDataset,
                                load_tokenizer, load_tokens)

CORPUS = os.path.join(os.path.dirname(__file__), "..", "megatrain_jax", "texts", "devils_dictionary.txt")


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
    with pytest.raises(DataError, match="a.npy.*1-D integer"):
        load_tokens(str(p), None)
    np.save(p, np.zeros(4, dtype=np.float32))
    with pytest.raises(DataError, match="a.npy.*1-D integer"):
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
    with pytest.raises(DataError, match=r"too small.*seq_len=8.*batch_size=4 x num_micro_batches=2"):
        PackedDataset(np.arange(50), seq_len=8, batch_size=4, seed=0, num_micro_batches=2)
    # exactly enough: 8 windows need 8 * 8 + 1 tokens
    PackedDataset(np.arange(65), seq_len=8, batch_size=4, seed=0, num_micro_batches=2)


# -- batching -----------------------------------------------------------------


def test_batch_shapes_and_shift():
    stream = (np.arange(1001) * 31 % 257).astype(np.int64)  # values do not reveal positions
    ds = PackedDataset(stream, seq_len=16, batch_size=4, seed=1, num_micro_batches=3)
    assert ds.tokens_per_batch == 3 * 4 * 16
    x, y = ds.next_batch()
    assert x.shape == y.shape == (3, 4, 16)
    assert x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])
    starts = ds.perm[:12] * 16
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
