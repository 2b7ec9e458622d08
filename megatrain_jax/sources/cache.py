"""Tokenize once: a corpus's token ids in a cache directory, built once and reused by every later
run (a resume never re-tokenizes).

A text source (sources.files.Source) is tokenized into `<cache_dir>/tokens-<id>/`:

    manifest.json   what the cache holds: its identity (the source files' absolute paths, the
                    tokenizer, its EOS id, the field and settings), the fingerprint they had when
                    it was built (each file's size, mtime and a hash of its head, as
                    fingerprint.file_identity gives them, and a hash of the tokenizer file), the
                    dtype, the tokens of each file and the size of each file of the cache
    tokens.bin      every document's ids followed by EOS, file by file, as uint16 (a vocabulary
                    up to 65536) or uint32

SFT and preference data have a layout of their own (sources/sequences.py) built and checked by
the same `build_or_open`.

<id> hashes the identity. A cache whose identity matches and whose fingerprint and file sizes
match is used as is, once its ids are checked against the vocabulary (contents damaged at the same
size are refused, naming the file); one whose fingerprint differs (a source file or the tokenizer
changed) is stale and rebuilt; a directory of that name that is not a cache of this very data is
refused and left alone. A build writes a temporary directory and renames it into place, so a
killed build leaves no half cache; processes building the same cache at once keep one.
"""

import errno
import hashlib
import json
import os
import shutil
import time
import uuid

import numpy as np

from megatrain_jax.data import DataError, check_token_ids, jsonl_objects, load_tokens, read_text
from megatrain_jax.fingerprint import files_identity
from megatrain_jax.sources.files import TOKEN_KINDS, BadRows, resolve, table_rows
from megatrain_jax.tokenfile import TokenFile

CACHE_FORMAT = "megatrain_jax token cache"
VERSION = 2  # 2: the files' fingerprint as fingerprint.file_identity's, the cache's file sizes
DOC_BATCH = 2048  # documents per encode_batch call
COPY_CHUNK = 1 << 24  # tokens per chunk copied from a .bin/.npy shard
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a cache_dir with no room for the cache


def default_cache_dir() -> str:
    """Where token caches live without data.cache_dir: $XDG_CACHE_HOME/megatrain_jax/tokens
    (~/.cache/...), shared by every run of this user."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatrain_jax", "tokens")


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tokenizer_name(tokenizer) -> str:
    path = getattr(tokenizer, "path", None)
    return os.path.abspath(path) if path else "byte"


def base_identity(source, tokenizer, kind: str) -> dict:
    """The identity every cache of `source` shares: the format, the data's kind, the files, the
    tokenizer and its EOS id."""
    return {"format": CACHE_FORMAT, "version": VERSION, "kind": kind,
            "files": [os.path.abspath(f) for f in source.files],
            "tokenizer": _tokenizer_name(tokenizer), "eos_id": int(tokenizer.eos_id)}


def identity(source, tokenizer, *, text_field: str, token_dtype: str) -> dict:
    """What a token cache of `source` is a cache of (its directory name hashes this)."""
    out = base_identity(source, tokenizer, source.kind)
    if source.kind in TOKEN_KINDS:
        out["token_dtype"] = token_dtype
    elif source.kind != "text":
        out["text_field"] = text_field
    return out


def fingerprint(source, tokenizer) -> dict:
    """What the data of a cache was when it was built: a stale cache differs in it."""
    path = getattr(tokenizer, "path", None)
    return {"files": files_identity(source.files),
            "tokenizer_sha256": _sha256_file(path) if path else "byte"}


# -----------------------------------------------------------------------------
# documents of a source


def _document(obj, where: str, field: str) -> str:
    if not isinstance(obj, dict) or field not in obj or obj[field] is None:
        raise DataError(f"{where}: missing field {field!r} (data.text_field)")
    if not isinstance(obj[field], str):
        raise DataError(f"{where}: field {field!r} is a {type(obj[field]).__name__}, not a "
                        f"string (data.text_field)")
    return obj[field]


def _rows(path: str, kind: str, field: str):
    """(where, record, bytes of the file read so far) of a record file."""
    if kind == "jsonl":
        with open(path, "rb") as f:
            for where, obj in jsonl_objects(f, path):
                yield where, obj, f.tell()
    else:
        for where, obj in table_rows(path, kind, [field]):
            yield where, obj, 0


def document_batches(path: str, kind: str, field: str, bad: BadRows):
    """(texts, bytes of the file read so far) in batches of DOC_BATCH documents; a bad row is
    counted in `bad` (and its batches no longer encoded: the build fails at the file's end)."""
    if kind == "text":
        yield [read_text(path)], os.path.getsize(path)
        return
    texts, done = [], 0
    for where, obj, done in _rows(path, kind, field):
        try:
            text = _document(obj, where, field)
        except DataError as e:
            bad.add(e)
            continue
        if not bad.count:
            texts.append(text)
        if len(texts) == DOC_BATCH:
            yield texts, done
            texts = []
    yield texts, os.path.getsize(path)


def _packed(ids_list: list, eos_id: int, dtype) -> np.ndarray:
    """The ids of each document followed by EOS, as one array."""
    out = np.empty(sum(len(ids) for ids in ids_list) + len(ids_list), dtype=dtype)
    at = 0
    for ids in ids_list:
        out[at:at + len(ids)] = ids
        at += len(ids)
        out[at] = eos_id
        at += 1
    return out


# -----------------------------------------------------------------------------
# building and using a cache


def _progress():
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    console = Console(stderr=True)
    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


def _write_tokens(source, tokenizer, out, *, dtype, text_field: str, token_dtype: str,
                  vocab_size: int) -> list:
    """Writes every file's tokens to the open file `out`; returns the tokens of each file."""
    counts = []
    total = sum(os.path.getsize(f) for f in source.files)
    with _progress() as progress:
        task = progress.add_task("tokenizing", total=total)
        before = 0
        for path in source.files:
            count = 0
            if source.kind in TOKEN_KINDS:
                tokens = load_tokens(path, None, vocab_size=vocab_size, token_dtype=token_dtype)
                for start in range(0, len(tokens), COPY_CHUNK):
                    out.write(np.asarray(tokens[start:start + COPY_CHUNK]).astype(dtype).tobytes())
                count = len(tokens)
            else:
                bad = BadRows(path)
                for texts, done in document_batches(path, source.kind, text_field, bad):
                    if texts and not bad.count:
                        chunk = _packed(tokenizer.encode_batch(texts), tokenizer.eos_id, dtype)
                        out.write(chunk.tobytes())
                        count += len(chunk)
                    progress.update(task, completed=before + done)
                bad.check()
                if not count:
                    raise DataError(f"{path}: no documents (every line is blank)")
            before += os.path.getsize(path)
            progress.update(task, completed=before)
            counts.append(count)
    return counts


def _read_manifest(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _check_writable(cache_dir: str):
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir {cache_dir!r} is not writable ({e.strerror}); set "
                        f"data.cache_dir to a writable directory") from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise DataError(f"data.cache_dir {cache_dir!r} is not writable; set data.cache_dir to a "
                        f"writable directory")


def _stale_reason(manifest: dict, directory: str, expected: dict) -> str | None:
    """Why a cache of this data cannot be used as is (None: it can)."""
    was = manifest.get("fingerprint") or {}
    if was != expected:
        old = {f.get("file"): f for f in was.get("files", [])}
        for f in expected["files"]:
            if old.get(f["file"]) != f:
                return f"{f['file']} changed since the cache was built"
        changed = next((k for k in expected if k != "files" and was.get(k) != expected[k]), None)
        if changed is None:
            return "its fingerprint is not of this version"
        what = changed.removesuffix("_sha256").replace("_", " ")
        return f"the {what} file changed since the cache was built"
    for name, want in manifest.get("sizes", {}).items():
        try:
            size = os.path.getsize(os.path.join(directory, name))
        except OSError:
            size = None
        if size != want:
            return f"its {name} is {size} bytes, the manifest says {want}"
    return None


def _existing(directory: str, ident: dict, expected: dict, path: str):
    """(manifest, why it is stale or None) of the cache in `directory`, or None if there is none.
    Raises DataError if what is there is not a cache of this data (it is left as is)."""
    if not os.path.exists(directory):
        return None
    manifest = _read_manifest(directory)
    if manifest is None or manifest.get("identity") != ident or "sizes" not in manifest:
        raise DataError(f"{directory}: exists but is not a token cache of {path} (no "
                        f"manifest.json of this data); it is left as is: move it away or set "
                        f"data.cache_dir to another directory")
    return manifest, _stale_reason(manifest, directory, expected)


def build_or_open(source, cache_dir: str, ident: dict, expected: dict, build, *, prefix: str,
                  log=print, check=None) -> tuple:
    """(manifest, directory) of the cache in `cache_dir` of the data `ident` names (its
    directory: `prefix`-<hash of ident>), whose data is now `expected` (fingerprint's, with any
    other key a change of which makes the cache stale). Built first when missing or stale:
    `build(directory)` writes the cache's files into the (temporary) directory and returns the
    manifest's other fields, with "tokens" (how many it wrote). A cache found in place is given
    to `check(manifest, directory)`, if given, which raises DataError for damaged contents.
    Raises DataError as build does (no cache is left), for an unwritable cache_dir when a build
    is needed, or for a directory in the cache's place that is not a cache of this data."""
    name = f"{prefix}-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    directory = os.path.join(cache_dir, name)
    found = _existing(directory, ident, expected, source.path)
    if found is not None:
        manifest, reason = found
        if reason is None:
            if check is not None:
                check(manifest, directory)
            return manifest, directory
        log(f"token cache {directory} is stale ({reason}): rebuilding it")
    _check_writable(cache_dir)
    tmp = f"{directory}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        log(f"tokenizing {source.path} ({len(source.files)} files, "
            f"{sum(f['bytes'] for f in expected['files']) / 1e6:,.1f} MB) into {directory}")
        t0 = time.perf_counter()
        fields = build(tmp)
        seconds = time.perf_counter() - t0
        sizes = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        manifest = {"identity": ident, "fingerprint": expected, **fields, "sizes": sizes,
                    "seconds": round(seconds, 3)}
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        found = _existing(directory, ident, expected, source.path)
        if found is not None and found[1] is None:  # another process built it meanwhile
            return found[0], directory
        _replace(tmp, directory)
    except OSError as e:
        if e.errno not in FULL:
            raise
        raise DataError(f"data.cache_dir={cache_dir}: writing the token cache of {source.key}="
                        f"{source.path} failed ({e.strerror}); free space there or set "
                        f"data.cache_dir to another directory") from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    tokens = manifest["tokens"]
    log(f"tokenized {tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} "
        f"tokens/s)")
    return manifest, directory


def _replace(tmp: str, directory: str):
    """Renames the built `tmp` to `directory`; a stale cache there (of this data: its manifest
    said so) is moved aside first and removed after."""
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process put the same cache there first: keep theirs
        if not os.path.isdir(directory):
            raise
    if old:
        shutil.rmtree(old)


def token_dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids below `vocab_size`."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def open_cache(source, tokenizer, cache_dir: str, *, text_field: str = "text",
               token_dtype: str = "uint16", vocab_size: int | None = None, log=print) -> tuple:
    """(tokens, directory): the token ids of `source` (memory-mapped, read-only) from its cache
    in `cache_dir`, built first when missing or stale. Raises DataError for a bad row (file, row,
    field), an unwritable cache_dir when a build is needed, or a directory in the cache's place
    that is not a cache of this data."""
    vocab_size = max(vocab_size or 0, tokenizer.vocab_size)
    dtype = token_dtype_for(vocab_size)

    def build(directory: str) -> dict:
        with open(os.path.join(directory, "tokens.bin"), "wb") as out:
            counts = _write_tokens(source, tokenizer, out, dtype=dtype, text_field=text_field,
                                   token_dtype=token_dtype, vocab_size=vocab_size)
        return {"dtype": dtype.name, "tokens": sum(counts), "file_tokens": counts}

    ident = identity(source, tokenizer, text_field=text_field, token_dtype=token_dtype)
    check = lambda manifest, directory: check_cached_ids(directory, manifest["dtype"], vocab_size)
    manifest, directory = build_or_open(source, cache_dir, ident, fingerprint(source, tokenizer),
                                        build, prefix="tokens", log=log, check=check)
    return np.memmap(os.path.join(directory, "tokens.bin"), dtype=manifest["dtype"],
                     mode="r"), directory


def check_cached_ids(directory: str, dtype: str, vocab_size: int):
    """Raises DataError if an id in the tokens.bin (of `dtype`) of the cache in `directory` is
    not below vocab_size: contents damaged at the same size, which the manifest's sizes cannot
    see and which would otherwise be trained on (every step skipped as non-finite). One chunked
    max over the file."""
    path = os.path.join(directory, "tokens.bin")
    try:
        check_token_ids(TokenFile(path, dtype), vocab_size, path)
    except DataError as e:
        raise DataError(f"{e}: the token cache is damaged; remove {directory} and the next run "
                        f"rebuilds it") from None


def source_tokens(path: str, tokenizer, cache_dir: str, *, key: str = "data.path",
                  text_field: str = "text", token_dtype: str = "uint16",
                  vocab_size: int | None = None, log=print) -> tuple:
    """(tokens, source files) of a data path (file, glob or directory; `key` names it in errors):
    a tokenfile.TokenFile of one .bin or .npy file as it is, or of its token cache."""
    source = resolve(path, key)
    if source.matched():
        log(source.matched())
    if source.kind in TOKEN_KINDS and len(source.files) == 1:
        tokens = load_tokens(source.files[0], tokenizer, vocab_size=vocab_size,
                             token_dtype=token_dtype)
    else:
        tokens, _ = open_cache(source, tokenizer, cache_dir, text_field=text_field,
                               token_dtype=token_dtype, vocab_size=vocab_size, log=log)
    return TokenFile.of(tokens), source.files
