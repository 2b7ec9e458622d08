"""Tokenize once, for SFT and preference data: the tokenized sequences and the mask of their
trained tokens, in a cache built and checked as the text token cache is (cache.build_or_open).

Data of `kind` (sft or preference) is cached in `<cache_dir>/<kind>-<id>/`:

    manifest.json   as a token cache's, its identity also holding the data's kind and settings
                    (data.seq_len, data.overlong, model.vocab_size), its fingerprint also the
                    hash of the chat template (a changed template makes the cache stale), and
                    the build's counts (conversations or pairs read, truncated, skipped)
    tokens.bin      every sequence's ids, one after another, as uint16 or uint32
    trained.bin     one byte per token: 1 where the token is trained on (its label is itself)
    offsets.npy     int64 (sequences + 1): sequence k is tokens [offsets[k], offsets[k + 1])

The sequences are those of chat.load_examples or preference.load_pairs (truncated, in file order,
a preference pair's chosen then its rejected), so a build gives what loading without a cache
gives, and a later run (a resume) reads them back without rendering or tokenizing anything.
"""

import hashlib
import json
import os

import numpy as np

from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.sources.cache import (base_identity, build_or_open, check_cached_ids,
                                         fingerprint, token_dtype_for)


def template_sha256(template) -> str:
    """A hash of a chat.ChatTemplate: its Jinja source and the variables it is rendered with."""
    both = json.dumps([template.source, template.variables], sort_keys=True)
    return hashlib.sha256(both.encode()).hexdigest()


def _write(directory: str, ids: list, trained: list, dtype) -> int:
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    with open(os.path.join(directory, "tokens.bin"), "wb") as f:
        for x in ids:
            f.write(np.asarray(x).astype(dtype).tobytes())
    with open(os.path.join(directory, "trained.bin"), "wb") as f:
        for m in trained:
            f.write(np.asarray(m, dtype=np.uint8).tobytes())
    np.save(os.path.join(directory, "offsets.npy"), offsets)
    return int(offsets[-1])


def _read(directory: str, dtype: str) -> tuple:
    offsets = np.load(os.path.join(directory, "offsets.npy"))
    tokens = np.fromfile(os.path.join(directory, "tokens.bin"), dtype=dtype).astype(np.int32)
    trained = np.fromfile(os.path.join(directory, "trained.bin"), dtype=np.uint8).astype(bool)
    labels = np.where(trained, tokens, IGNORE_ID).astype(np.int32)
    cuts = offsets[1:-1]
    return np.split(tokens, cuts), np.split(labels, cuts)


def open_sequences(source, tokenizer, template, cache_dir: str, build, *, kind: str,
                   settings: dict, log=print) -> tuple:
    """(ids, labels, counts) of the data path `source` (a sources.files.Source): lists of int32
    arrays (labels: IGNORE_ID where a token is not trained on, else the token) and a dict of
    counts, from the cache of this data in `cache_dir`, built first when missing or stale by
    `build()`, which tokenizes the data and returns those three. Raises DataError as build does
    (no cache is left), or as cache.build_or_open does."""
    if source.matched():
        log(source.matched())
    vocab_size = max(settings.get("vocab_size") or 0, tokenizer.vocab_size)
    dtype = token_dtype_for(vocab_size)

    def build_into(directory: str) -> dict:
        ids, labels, counts = build()
        trained = [np.asarray(x) != IGNORE_ID for x in labels]
        return {"dtype": dtype.name, "tokens": _write(directory, ids, trained, dtype),
                "sequences": len(ids), "counts": counts}

    ident = {**base_identity(source, tokenizer, kind), "source_kind": source.kind,
             "settings": settings}
    expected = {**fingerprint(source, tokenizer), "chat_template_sha256": template_sha256(template)}
    check = lambda manifest, directory: check_cached_ids(directory, manifest["dtype"], vocab_size)
    manifest, directory = build_or_open(source, cache_dir, ident, expected, build_into,
                                        prefix=kind, log=log, check=check)
    return (*_read(directory, manifest["dtype"]), manifest["counts"])
