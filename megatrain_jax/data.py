"""Data pipeline: tokenizers, token-stream loading and a packed, resumable batch sampler.

A corpus becomes one flat 1-D stream of token ids (documents joined by EOS), which is cut
into non-overlapping windows of seq_len + 1 tokens; inputs/targets are the window shifted by one.

The sources package (paths of many files, token caches, mixtures) builds on this module, which
imports nothing of it.
"""

import json
import mmap
import os
import re
import stat

import numpy as np

from megatrain_jax.errors import DataError
from megatrain_jax.tokenfile import TokenFile


# -----------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """Raw UTF-8 bytes as ids 0..255, plus one EOS id (256)."""

    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list) -> list:
        """The ids of each text, as encode's."""
        return [self.encode(text) for text in texts]

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

    def encode_batch(self, texts: list) -> list:
        """The ids of each text (lists of ints), as encode's; encoded in parallel across cores."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

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
NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))
SCAN_CHUNK = 1 << 24  # tokens per chunk of the id scan: 32-128 MB, however large the file
SNIFF_PAIRS = 1 << 16  # uint16 pairs per sample of the uint32-read-as-uint16 check


def check_regular(path: str, key: str):
    """Raises DataError if `path` (config key `key`) is not a regular file: opening a FIFO for
    reading waits for a writer, and a device or socket is no corpus."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        what = next((name for test, name in NOT_REGULAR if test(mode)), "a special file")
        raise DataError(f"{key}={path} is {what}, not a regular file; give a data file")


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 text (byte {e.start}); "
                        f"data.path must be UTF-8 text, .jsonl, .bin or .npy") from None


def _pack(docs, eos_id: int) -> np.ndarray:
    eos = np.array([eos_id], dtype=np.int32)
    parts = []
    for doc in docs:
        parts += [doc, eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# A JSON escape of a UTF-16 surrogate: a lone one (no pair to make a character with) decodes to
# a string no tokenizer can encode.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def jsonl_objects(f, path: str):
    """(where, object) for every non-blank line of the JSONL file opened as `f` (bytes, so that
    invalid UTF-8 is reported with its line); where = "path:line". Bad lines raise DataError,
    a string holding a lone surrogate (`"\\ud800"` unpaired: no Unicode text) too."""
    for lineno, raw in enumerate(f, start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start} of the line)") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
        if SURROGATE_ESCAPE.search(line):  # rare: only then is every string looked at
            _check_unicode(obj, where)
        yield where, obj


def _check_unicode(obj, where: str, field: str = ""):
    """Raises DataError naming the field (`messages[1].content`) of the first string in `obj`
    that holds a lone surrogate."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = f"{field}.{key}" if field else key
            _check_unicode(key, where, f"{field}.<key>" if field else "<key>")
            _check_unicode(value, where, name)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _check_unicode(value, where, f"{field}[{i}]")
    elif isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as e:
            what = f"field {field!r}" if field else "the line"
            raise DataError(f"{where}: {what} holds a lone surrogate {obj[e.start]!r} at "
                            f"character {e.start} (a \\u escape of half a UTF-16 pair), which is "
                            f"not Unicode text; fix or remove the line") from None


def _jsonl_docs(path: str, tokenizer, text_field: str):
    with open(path, "rb") as f:
        for where, obj in jsonl_objects(f, path):
            if not isinstance(obj, dict) or text_field not in obj:
                raise DataError(f"{where}: missing field {text_field!r} (data.text_field)")
            if not isinstance(obj[text_field], str):
                raise DataError(f"{where}: field {text_field!r} is not a string")
            yield tokenizer.encode(obj[text_field])


def check_token_ids(tokens, vocab_size: int, path: str, vocab_key: str = "model.vocab_size"):
    """Raises DataError at the first id < 0 or >= vocab_size, naming its offset (token index).

    One pass over the stream in chunks of SCAN_CHUNK tokens, so a memory-mapped corpus is read
    once and never loaded whole. Ids that are signed are viewed as unsigned of the same width: a
    negative id becomes huge, so one max per chunk finds both kinds of bad id.
    """
    dtype = np.dtype(tokens.dtype)
    if dtype.kind == "u" and vocab_size > np.iinfo(dtype).max:
        return  # every id the dtype can hold is in range (uint16 with a vocabulary >= 65536)
    # viewed as unsigned, negative ids are >= 2**(bits - 1), so that bound also catches them
    bound = vocab_size if dtype.kind == "u" else min(vocab_size, np.iinfo(dtype).max + 1)
    unsigned = np.dtype(f"u{dtype.itemsize}")
    # a whole np.memmap is read with pread (TokenFile), so that the scan leaves none of the
    # corpus's pages mapped into this process (its RSS stays the same)
    whole_map = isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap)
    source = TokenFile.of(tokens) if whole_map else tokens
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(source[start:start + SCAN_CHUNK]).view(unsigned)
        if chunk.max() < bound:
            continue
        offset = start + int(np.argmax(chunk >= bound))
        bad = int(tokens[offset])
        if bad < 0:
            raise DataError(f"{path}: token id {bad} at offset {offset} is negative")
        hint = ""
        # uint16 ids read as uint32 pair up into ids mostly beyond any vocabulary, though each
        # half is in range; a uint32 file with a few bad ids has most ids in range
        if (dtype == np.uint32 and np.count_nonzero(chunk >= vocab_size) > len(chunk) // 2
                and chunk.view(np.uint16).max() < vocab_size):
            hint = "; if the file holds uint16 ids, set data.token_dtype=uint16"
        raise DataError(f"{path}: token id {bad} at offset {offset} >= {vocab_key} ({vocab_size}){hint}")


def _looks_like_uint32(tokens: np.ndarray, vocab_size: int | None) -> tuple | None:
    """(pairs sampled, largest high half) if a uint16 view of a file looks like uint32 ids, else None.

    Little-endian uint32 ids below 2**16 * k read as uint16 alternate (id, high half), where the
    high half is <= (vocab_size - 1) >> 16: 0 for any vocabulary up to 65536. The test asks for
    that at *every* odd position of three samples (start, middle, end; up to 3 x 65536 pairs) and
    for at least half of the even ones to be non-zero. Real uint16 token streams are not like that:
    it would take one id (0, or 0/1 for a larger vocabulary) at every second position.
    """
    n_pairs = len(tokens) // 2
    if len(tokens) % 2 or n_pairs < 64:  # a uint32 file has an even count; too few to judge
        return None
    high_max = max(vocab_size - 1, 0) >> 16 if vocab_size else 0
    if n_pairs <= 3 * SNIFF_PAIRS:
        windows = [(0, n_pairs)]  # the whole file
    else:
        windows = [(first, first + SNIFF_PAIRS)
                   for first in (0, n_pairs // 2 - SNIFF_PAIRS // 2, n_pairs - SNIFF_PAIRS)]
    sampled = nonzero_low = 0
    for first, stop in windows:
        pairs = np.asarray(tokens[2 * first:2 * stop]).reshape(-1, 2)
        if pairs[:, 1].max() > high_max:
            return None
        sampled += len(pairs)
        nonzero_low += np.count_nonzero(pairs[:, 0])
    return (sampled, high_max) if nonzero_low >= sampled / 2 else None


def _load_bin(path: str, token_dtype, vocab_size: int | None) -> np.memmap:
    if str(token_dtype) not in TOKEN_DTYPES:
        raise DataError(f"{path}: data.token_dtype must be one of {TOKEN_DTYPES} "
                        f"for .bin files, got {token_dtype!r}")
    itemsize = np.dtype(token_dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        hint = ("; if the file holds uint16 ids, set data.token_dtype=uint16"
                if itemsize == 4 and size % 2 == 0 else "")
        raise DataError(f"{path}: size {size} bytes is not a multiple of {itemsize} "
                        f"(data.token_dtype={token_dtype}): truncated, or the wrong dtype{hint}")
    tokens = np.memmap(path, dtype=token_dtype, mode="r")
    if token_dtype == "uint16":
        found = _looks_like_uint32(tokens, vocab_size)
        if found:
            sampled, high_max = found
            high = "0" if high_max == 0 else f"<= {high_max}"
            raise DataError(f"{path}: looks like uint32 token ids read as uint16 (in {sampled:,} "
                            f"sampled pairs every second uint16 is {high}, the high half of a "
                            f"uint32 id); set data.token_dtype=uint32")
    return tokens


def _load_npy(path: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r")  # allow_pickle=False: never unpickles
    except (ValueError, EOFError, OSError) as e:  # truncated, not a .npy file, an object array
        raise DataError(f"{path}: cannot load .npy ({str(e).splitlines()[0]}); data.path must be a "
                        f"1-D integer array saved with np.save") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"{path}: expected a 1-D integer array of token ids, got shape "
                        f"{tokens.shape} dtype {tokens.dtype}; data.path must be a 1-D integer .npy")
    return tokens


def load_tokens(path: str, tokenizer, *, vocab_size: int | None = None, text_field: str = "text",
                token_dtype=None) -> np.ndarray:
    """Load a corpus as a 1-D integer token stream, each document followed by EOS.

    .jsonl: one JSON object per line, `obj[text_field]` is a document.
    .bin:   flat pre-tokenized ids (nanoGPT style), memory-mapped with `token_dtype`.
    .npy:   a 1-D integer array, memory-mapped.
    other:  UTF-8 text, the whole file is one document.

    Every id must be in [0, vocab_size) (the model's `model.vocab_size`; None: the tokenizer's, and
    no upper check for pre-tokenized files without a tokenizer). Pre-tokenized files are checked in
    one chunked pass over the memory map (`check_token_ids`), so the first bad id is refused with
    its offset before training; they are returned memory-mapped.
    """
    if os.path.isdir(path):
        raise DataError(f"data.path {path} is a directory, not a data file")
    check_regular(path, "data.path")
    try:
        with open(path, "rb"):  # one place for missing and unreadable files, for every format
            pass
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})") from None
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty file (0 bytes); data.path must name a corpus")
    vocab_key = "model.vocab_size"
    if vocab_size is None and tokenizer is not None:
        vocab_size, vocab_key = tokenizer.vocab_size, "the tokenizer's vocab_size"
    ext = os.path.splitext(path)[1].lower()

    if ext == ".bin":
        tokens = _load_bin(path, token_dtype, vocab_size)
    elif ext == ".npy":
        tokens = _load_npy(path)
    elif ext == ".jsonl":
        tokens = _pack(_jsonl_docs(path, tokenizer, text_field), tokenizer.eos_id)
        if not tokens.size:
            raise DataError(f"{path}: no documents (every line is blank)")
    else:
        tokens = _pack([tokenizer.encode(read_text(path))], tokenizer.eos_id)
    if not tokens.size:
        raise DataError(f"{path}: no tokens (an empty array); data.path must name a corpus")
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, path, vocab_key)
    return tokens


# -----------------------------------------------------------------------------
# document masks for packed windows


def document_context(inputs, eos_id: int) -> dict:
    """{"segment_ids": int32, "positions": int32}, each shaped like inputs (..., T).

    Windows of a packed stream hold several documents, each ended by EOS. segment_ids[t] counts
    the EOS tokens strictly before t (an EOS belongs to the document it ends), so attention is
    allowed where segment ids are equal; positions[t] is t's index within its document, for RoPE,
    counted from the window's start for the document the window begins in the middle of.
    """
    inputs = np.asarray(inputs)
    is_eos = inputs == eos_id  # (..., T)
    t = np.arange(inputs.shape[-1], dtype=np.int32)
    ends_before = np.zeros(is_eos.shape, dtype=bool)  # token t is the first of its segment
    ends_before[..., 1:] = is_eos[..., :-1]
    ends_before[..., :1] = True
    segment_ids = np.cumsum(ends_before, axis=-1, dtype=np.int32) - 1
    first = np.maximum.accumulate(np.where(ends_before, t, 0), axis=-1)  # first token of t's segment
    return {"segment_ids": segment_ids, "positions": (t - first).astype(np.int32)}


# -----------------------------------------------------------------------------
# batching


class WindowOrder:
    """Which windows (or packed rows) each batch takes, deterministic and resumable: epoch e visits
    the `num_windows` in the order `default_rng((seed, e)).permutation`, `per_batch` at a time; a
    partial batch at the end of an epoch is dropped. The position is two ints, see `state()`."""

    def __init__(self, num_windows: int, per_batch: int, seed: int, what: str = "windows"):
        self.num_windows, self.per_batch, self.seed, self.what = num_windows, per_batch, seed, what
        self._perms = {}
        self.restore({"epoch": 0, "index": 0})

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perms.get(epoch) is None:  # this epoch's and the next (peek) are kept
            self._perms = {e: p for e, p in self._perms.items() if e in (epoch - 1, epoch)}
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(
                self.num_windows)
        return self._perms[epoch]

    def _set_epoch(self, epoch: int):
        self.epoch, self.index = epoch, 0
        self.perm = self._permutation(epoch)

    def _next(self) -> tuple:
        """(epoch, first index) of the next batch."""
        if self.index + self.per_batch > self.num_windows:
            return self.epoch + 1, 0
        return self.epoch, self.index

    def take(self) -> np.ndarray:
        """The next batch's window indices, (per_batch,)."""
        epoch, index = self._next()
        if epoch != self.epoch:
            self._set_epoch(epoch)
        self.index = index + self.per_batch
        return self.perm[index:index + self.per_batch]

    def peek(self) -> np.ndarray:
        """The indices the next take() will return, without taking them."""
        epoch, index = self._next()
        return self._permutation(epoch)[index:index + self.per_batch]

    def state(self) -> dict:
        """Position as plain ints: epoch, and index = windows already taken in this epoch."""
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def restore(self, state: dict):
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.num_windows:
            raise DataError(f"bad data state {state!r} for {self.num_windows} {self.what}")
        self._set_epoch(epoch)
        self.index = index


def share_of_batch(taken, num_micro_batches: int, share: tuple) -> np.ndarray:
    """The window (or row) indices of a batch that process share[0] of share[1] reads: its equal
    part of every micro-batch's rows (data parallel over processes; (0, 1): all of them)."""
    index, count = share
    if count == 1:
        return taken
    per_micro = np.asarray(taken).reshape(num_micro_batches, -1)
    rows = per_micro.shape[1] // count
    return per_micro[:, index * rows:(index + 1) * rows].reshape(-1)


class PackedDataset:
    """Shuffled non-overlapping windows of a token stream, deterministic and resumable (the
    windows' order and the position: WindowOrder)."""

    summary = ""  # what the data is, for the run's log

    def __init__(self, tokens, *, seq_len: int, batch_size: int, seed: int, num_micro_batches: int = 1,
                 eos_id: int | None = None, document_mask: bool = False):
        if getattr(tokens, "ndim", None) != 1:
            raise DataError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
        for name, v in (("seq_len", seq_len), ("batch_size", batch_size),
                        ("num_micro_batches", num_micro_batches)):
            if int(v) < 1:
                raise DataError(f"{name} must be >= 1, got {v}")
        self.tokens, self.eos_id = tokens, eos_id  # eos_id: the document separator, for masks
        self.document_mask = document_mask
        self.seq_len, self.batch_size = int(seq_len), int(batch_size)
        self.num_micro_batches, self.seed = int(num_micro_batches), int(seed)
        self.num_windows = (len(tokens) - 1) // self.seq_len
        self.windows_per_batch = self.batch_size * self.num_micro_batches
        if self.num_windows < self.windows_per_batch:
            need = self.windows_per_batch * self.seq_len + 1  # +1: the last window's last target
            raise DataError(
                f"data too small: {len(tokens):,} tokens make {self.num_windows} windows of "
                f"data.seq_len={self.seq_len} tokens, but one step takes data.batch_size x "
                f"data.micro_batches = {self.batch_size} x {self.num_micro_batches} = "
                f"{self.windows_per_batch} windows ({need:,} tokens); use more data or lower "
                f"data.seq_len, data.batch_size or data.micro_batches")
        self.order = WindowOrder(self.num_windows, self.windows_per_batch, self.seed)
        # (process, processes): which part of every micro-batch's rows next_batch reads; the order
        # and the position (state) stay those of the whole batch.
        self.share = (0, 1)
        self.read_ahead = None  # sources.prefetch.ReadAhead: the next batch read on a thread

    @property
    def tokens_per_batch(self) -> int:
        return self.windows_per_batch * self.seq_len

    def next_batch(self):
        """(inputs, targets), int32, shape (num_micro_batches, batch_size, seq_len) (batch_size /
        share[1] rows: this process's share)."""
        mine = lambda taken: share_of_batch(taken, self.num_micro_batches, self.share)
        taken = mine(self.order.take())
        if self.read_ahead is None:
            windows = self.read_windows(taken)
        else:  # the batch after this one is read on a thread while this one trains
            upcoming = mine(self.order.peek())
            windows = self.read_ahead.get(taken.tobytes(), taken, upcoming.tobytes(), upcoming)
        windows = windows.reshape(self.num_micro_batches, -1, self.seq_len + 1)
        return np.ascontiguousarray(windows[..., :-1]), np.ascontiguousarray(windows[..., 1:])

    def read_windows(self, taken) -> np.ndarray:
        """The windows starting at taken * seq_len, (len(taken), seq_len + 1) int32. Fancy
        indexing reads only these windows, so a memory-mapped corpus stays on disk."""
        idx = (np.asarray(taken) * self.seq_len)[:, None] + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[idx]).astype(np.int32)

    def next_batch_with_context(self):
        """(inputs, targets, context): next_batch's, and document_context(inputs) with
        document_mask (else None)."""
        inputs, targets = self.next_batch()
        if not self.document_mask:
            return inputs, targets, None
        if self.eos_id is None:
            raise DataError("document_mask needs eos_id, the document separator")
        return inputs, targets, document_context(inputs, self.eos_id)

    def state(self) -> dict:
        return self.order.state()

    def restore(self, state: dict):
        self.order.restore(state)


# -----------------------------------------------------------------------------
# held-out evaluation data


def split_tail(tokens, fraction: float) -> tuple:
    """(train, held_out): the last `fraction` of `tokens` held out (views, so a memory-mapped
    corpus stays on disk). Training windows are built from `train` alone, so their inputs and
    targets never reach a held-out token."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def eval_batches(tokens, *, seq_len: int, batch_size: int, num_micro_batches: int, num_batches: int,
                 what: str) -> list:
    """The first `num_batches` batches (fewer if the tokens hold fewer) of consecutive windows of
    `tokens`, in order: [(inputs, targets)], int32, each (num_micro_batches, batch_size, seq_len)
    like PackedDataset's. The same every evaluation. `what` names the data in the error raised
    when it is too small for one batch."""
    windows_per_batch = batch_size * num_micro_batches
    num_windows = (len(tokens) - 1) // seq_len if len(tokens) else 0
    if num_windows < windows_per_batch:
        need = windows_per_batch * seq_len + 1
        raise DataError(
            f"{what}: too small for one eval batch: {len(tokens):,} tokens make {num_windows} "
            f"windows of data.seq_len={seq_len} tokens, one batch takes data.batch_size x "
            f"data.micro_batches = {windows_per_batch} windows ({need:,} tokens)")
    out = []
    for b in range(min(num_batches, num_windows // windows_per_batch)):
        starts = (b * windows_per_batch + np.arange(windows_per_batch)) * seq_len
        windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)]).astype(np.int32)
        windows = windows.reshape(num_micro_batches, batch_size, seq_len + 1)
        out.append((np.ascontiguousarray(windows[..., :-1]),
                    np.ascontiguousarray(windows[..., 1:])))
    return out
