"""Data pipeline: tokenizers, token-stream loading and a packed, resumable batch sampler.

A corpus becomes one flat 1-D stream of token ids (documents joined by EOS), which is cut
into non-overlapping windows of seq_len + 1 tokens; inputs/targets are the window shifted by one.
"""

import json
import os

import numpy as np


class DataError(ValueError):
    """Bad input to the data pipeline (missing file, malformed record, bad setting)."""


# -----------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """Raw UTF-8 bytes as ids 0..255, plus one EOS id (256)."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        return bytes(int(i) for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, loaded with the `tokenizers` library."""

    EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")

    def __init__(self, path: str, eos_token: str | None = None):
        from tokenizers import Tokenizer  # lazy: only needed for HF tokenizers

        if not os.path.isfile(path):
            raise DataError(f"tokenizer file not found: {path}")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception
            raise DataError(f"could not load tokenizer {path}: {str(e).splitlines()[0]}") from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token is not None else self.EOS_CANDIDATES
        for token in candidates:
            eos_id = self.tok.token_to_id(token)
            if eos_id is not None:
                self.eos_token, self.eos_id = token, eos_id
                break
        else:
            raise DataError(f"{path}: no EOS token found (tried {', '.join(candidates)}); "
                            f"set the eos token explicitly")

    def encode(self, text: str) -> np.ndarray:
        # no special tokens (e.g. BOS from a post-processor): documents are separated by EOS only
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i != self.eos_id]
        return self.tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(name: str, eos_token: str | None = None):
    """"byte" -> ByteTokenizer; a path to a `tokenizer.json` -> HFTokenizer."""
    if name == "byte":
        return ByteTokenizer()
    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise DataError(f"tokenizer file not found: {name}")
        return HFTokenizer(name, eos_token=eos_token)
    raise DataError(f"unknown tokenizer {name!r}: expected 'byte' or a path to tokenizer.json")


# -----------------------------------------------------------------------------
# loading a corpus into one token stream

TOKEN_DTYPES = ("uint16", "uint32")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 text (byte {e.start})") from None


def _pack(docs, eos_id: int) -> np.ndarray:
    eos = np.array([eos_id], dtype=np.int32)
    parts = []
    for doc in docs:
        parts += [doc, eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _jsonl_docs(path: str, tokenizer, text_field: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise DataError(f"{path}:{lineno}: missing field {text_field!r}")
            if not isinstance(obj[text_field], str):
                raise DataError(f"{path}:{lineno}: field {text_field!r} is not a string")
            yield tokenizer.encode(obj[text_field])


def load_tokens(path: str, tokenizer, *, text_field: str = "text", token_dtype=None) -> np.ndarray:
    """Load a corpus as a 1-D integer token stream, each document followed by EOS.

    .jsonl: one JSON object per line, `obj[text_field]` is a document.
    .bin:   flat pre-tokenized ids (nanoGPT style), memory-mapped with `token_dtype`.
    .npy:   a 1-D integer array, memory-mapped.
    other:  UTF-8 text, the whole file is one document.

    Pre-tokenized files are returned memory-mapped and are not scanned for ids >= vocab_size
    (that would read the whole corpus); text and JSONL streams are checked, since they are in RAM.
    """
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    ext = os.path.splitext(path)[1].lower()

    if ext == ".bin":
        if str(token_dtype) not in TOKEN_DTYPES:
            raise DataError(f"{path}: data.token_dtype must be one of {TOKEN_DTYPES} "
                            f"for .bin files, got {token_dtype!r}")
        try:
            return np.memmap(path, dtype=token_dtype, mode="r")
        except ValueError as e:  # empty file, or size not a multiple of the dtype
            raise DataError(f"{path}: cannot map as {token_dtype}: {e}") from None

    if ext == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise DataError(f"{path}: cannot load .npy: {e}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise DataError(f"{path}: expected a 1-D integer array, "
                            f"got shape {tokens.shape} dtype {tokens.dtype}")
        return tokens

    if ext == ".jsonl":
        tokens = _pack(_jsonl_docs(path, tokenizer, text_field), tokenizer.eos_id)
    else:
        tokens = _pack([tokenizer.encode(_read_text(path))], tokenizer.eos_id)
    if tokens.size and tokens.max() >= tokenizer.vocab_size:
        raise DataError(f"{path}: token id {int(tokens.max())} >= vocab_size {tokenizer.vocab_size}")
    return tokens


# -----------------------------------------------------------------------------
# batching


class PackedDataset:
    """Shuffled non-overlapping windows of a token stream, deterministic and resumable.

    Epoch e visits the windows in the order `default_rng((seed, e)).permutation(n)`; a partial
    batch at the end of an epoch is dropped. The position is two ints, see `state()`.
    """

    def __init__(self, tokens, *, seq_len: int, batch_size: int, seed: int, num_micro_batches: int = 1):
        if getattr(tokens, "ndim", None) != 1:
            raise DataError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
        for name, v in (("seq_len", seq_len), ("batch_size", batch_size),
                        ("num_micro_batches", num_micro_batches)):
            if int(v) < 1:
                raise DataError(f"{name} must be >= 1, got {v}")
        self.tokens = tokens
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.num_micro_batches, self.seed = int(num_micro_batches), int(seed)
        self.num_windows = (len(tokens) - 1) // self.seq_len
        self.windows_per_batch = self.batch_size * self.num_micro_batches
        if self.num_windows < self.windows_per_batch:
            raise DataError(
                f"data too small: {len(tokens)} tokens make {self.num_windows} windows of "
                f"seq_len={self.seq_len}, need seq_len x batch = {self.windows_per_batch} "
                f"(batch_size={self.batch_size} x num_micro_batches={self.num_micro_batches})")
        self.restore({"epoch": 0, "index": 0})

    @property
    def tokens_per_batch(self) -> int:
        return self.windows_per_batch * self.seq_len

    def _set_epoch(self, epoch: int):
        self.epoch, self.index = epoch, 0
        self.perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)

    def next_batch(self):
        """(inputs, targets), int32, shape (num_micro_batches, batch_size, seq_len)."""
        if self.index + self.windows_per_batch > self.num_windows:
            self._set_epoch(self.epoch + 1)
        starts = self.perm[self.index:self.index + self.windows_per_batch] * self.seq_len
        self.index += self.windows_per_batch
        # fancy indexing reads only these windows, so a memmapped corpus stays on disk
        idx = starts[:, None] + np.arange(self.seq_len + 1)
        windows = np.asarray(self.tokens[idx]).astype(np.int32)
        windows = windows.reshape(self.num_micro_batches, self.batch_size, self.seq_len + 1)
        return np.ascontiguousarray(windows[..., :-1]), np.ascontiguousarray(windows[..., 1:])

    def state(self) -> dict:
        """Position as plain ints: epoch, and index = windows already taken in this epoch."""
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def restore(self, state: dict):
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.num_windows:
            raise DataError(f"bad data state {state!r} for {self.num_windows} windows")
        self._set_epoch(epoch)
        self.index = index
