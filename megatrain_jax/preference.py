"""Preference data (data.format=preference): pairs of completions of one prompt, the chosen and
the rejected, rendered with the model's chat template (chat.py) and trained on the completion
tokens only.

A line of the JSONL file is one pair, in one of the common shapes:
  {"prompt": "...", "chosen": "...", "rejected": "..."}                   text: a user turn and an
                                                                          assistant turn each
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}    chat: the prompt's
                                                                          turns, then each
                                                                          completion's (assistant)
  {"chosen": [messages], "rejected": [messages]}                          chat, the prompt implicit:
                                                                          the messages both share
A sequence is the prompt and one completion, rendered as chat.encode_conversation renders a
conversation; its loss mask holds the completion's assistant tokens only (not the prompt's
earlier assistant turns). Each sequence takes one row of data.seq_len positions (right padding:
segment id -1), the chosen at row 2p and the rejected at row 2p + 1, so a micro-batch of
data.batch_size rows holds data.batch_size / 2 whole pairs.
"""

import dataclasses

import numpy as np

from megatrain_jax.chat import (PADDING_SEGMENT, ROLES, ChatTemplate, check_vocab,
                                encode_conversation, loaded, read_records)
from megatrain_jax.data import DataError, WindowOrder
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.sources.cache import default_cache_dir
from megatrain_jax.sources.files import BadRows, resolve
from megatrain_jax.sources.sequences import open_sequences

FIELDS = ("prompt", "chosen", "rejected")


def _messages(value, where: str, field: str) -> list:
    if isinstance(value, str):
        return [{"role": "user" if field == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        got = type(value).__name__ if not isinstance(value, list) else "an empty list"
        raise DataError(f"{where}: \"{field}\" must be a string or a non-empty list of "
                        f"{{\"role\", \"content\"}} messages, got {got}")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                or message.get("role") not in ROLES:
            raise DataError(f"{where}: \"{field}\" message {j} must be an object with a role "
                            f"({', '.join(ROLES)}) and a string content, got "
                            f"{str(message)[:80]}")
    return value


def parse_pair(obj, where: str) -> tuple:
    """(prompt messages, chosen messages, rejected messages) of one JSONL record, checked."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with \"prompt\", \"chosen\" and "
                        f"\"rejected\", got {type(obj).__name__}")
    for field in ("chosen", "rejected"):
        if field not in obj:
            keys = ", ".join(sorted(obj)) or "none"
            raise DataError(f"{where}: missing \"{field}\" (a preference pair needs \"prompt\", "
                            f"\"chosen\" and \"rejected\"; keys: {keys})")
    chosen = _messages(obj["chosen"], where, "chosen")
    rejected = _messages(obj["rejected"], where, "rejected")
    if "prompt" in obj:
        prompt = _messages(obj["prompt"], where, "prompt")
    elif isinstance(obj["chosen"], list) and isinstance(obj["rejected"], list):
        shared = 0  # the implicit prompt: the messages both conversations begin with
        while (shared < min(len(chosen), len(rejected)) - 1
               and chosen[shared] == rejected[shared]):
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise DataError(f"{where}: missing \"prompt\", and \"chosen\" and \"rejected\" share "
                            f"no leading messages to take as the prompt")
    else:
        keys = ", ".join(sorted(obj))
        raise DataError(f"{where}: missing \"prompt\" (a preference pair needs \"prompt\", "
                        f"\"chosen\" and \"rejected\"; keys: {keys})")
    for field, messages in (("chosen", chosen), ("rejected", rejected)):
        if not messages or messages[-1]["role"] != "assistant":
            raise DataError(f"{where}: \"{field}\" must end with an assistant message (the "
                            f"completion to score)")
    if chosen == rejected:
        raise DataError(f"{where}: \"chosen\" and \"rejected\" are identical, so the pair "
                        f"prefers nothing")
    return prompt, chosen, rejected


@dataclasses.dataclass
class Pairs:
    """Tokenized pairs of one file, in file order: ids[2p], labels[2p] the chosen sequence of pair
    p, [2p + 1] the rejected; each at most seq_len + 1 tokens, labels IGNORE_ID outside the
    completion."""
    path: str
    ids: list
    labels: list
    lines: int = 0  # non-blank lines
    truncated: int = 0  # pairs with a sequence cut to seq_len + 1 tokens (data.overlong=truncate)
    skipped: int = 0  # pairs dropped (data.overlong=skip)
    # pairs dropped because their chosen and rejected sequences are the same within seq_len + 1
    # tokens (they differ only past it, or not at all): DPO's loss is log 2 and its gradient 0
    identical: int = 0

    @property
    def num_pairs(self) -> int:
        return len(self.ids) // 2

    def report(self, seq_len: int, overlong: str) -> str:
        if overlong == "skip":
            what = f"none truncated, {self.skipped} skipped (a sequence over data.seq_len={seq_len})"
        else:
            what = f"{self.truncated} truncated to data.seq_len={seq_len}"
        if self.identical:
            what += (f", {self.identical} skipped with the chosen and the rejected the same "
                     f"within data.seq_len={seq_len} (nothing to learn from)")
        return f"{self.path}: {self.lines} pairs, {self.num_pairs} used; {what}"


def load_pairs(path: str, tokenizer, template: ChatTemplate, *, seq_len: int,
               overlong: str = "truncate", vocab_size: int | None = None) -> Pairs:
    """The pairs of a preference JSONL file as sequences of at most seq_len + 1 tokens. A pair
    with a longer sequence is truncated (the completion's end cut) or skipped per `overlong`, and
    counted; a pair whose two sequences are then the same is skipped and counted. Raises DataError naming file and line for a bad pair, a prompt that leaves no
    completion token within seq_len, or if no pair is left."""
    out, bad = Pairs(path, [], []), BadRows(path)
    for where, obj in read_records(path, "preference pairs", FIELDS):
        out.lines += 1
        try:
            prompt, chosen, rejected = parse_pair(obj, where)
        except DataError as e:
            bad.add(e)  # the load fails at the end, naming the first and counting them all
        if bad.count:
            continue
        sequences = []
        for completion in (chosen, rejected):
            ids, mask = encode_conversation(template, tokenizer, prompt + completion, where,
                                            train_from=len(prompt))
            check_vocab(ids, vocab_size, where)
            if not mask.any():
                raise DataError(f"{where}: a completion renders to no token")
            first = int(np.argmax(mask))  # the prompt's tokens come before it
            if first > seq_len:
                raise DataError(f"{where}: the prompt is {first} tokens, longer than "
                                f"data.seq_len={seq_len} (no completion token would be trained)")
            sequences.append((ids, np.where(mask, ids, IGNORE_ID).astype(np.int32)))
        if any(len(ids) > seq_len + 1 for ids, _ in sequences):
            if overlong == "skip":
                out.skipped += 1
                continue
            sequences = [(ids[:seq_len + 1], labels[:seq_len + 1]) for ids, labels in sequences]
            out.truncated += 1
        (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = sequences
        if np.array_equal(chosen_ids, rejected_ids) and np.array_equal(chosen_labels,
                                                                       rejected_labels):
            out.identical += 1
            continue
        out.ids += [ids for ids, _ in sequences]
        out.labels += [labels for _, labels in sequences]
    return loaded(out, bad, "pair", seq_len, overlong)


def cached_pairs(path: str, tokenizer, template: ChatTemplate, *, seq_len: int, overlong: str,
                 vocab_size: int | None, cache_dir: str, log=print) -> Pairs:
    """load_pairs's pairs, tokenized once: read from their cache in `cache_dir`
    (sources/sequences.py), which load_pairs builds when it is missing or stale."""
    def build():
        p = load_pairs(path, tokenizer, template, seq_len=seq_len, overlong=overlong,
                       vocab_size=vocab_size)
        counts = {"lines": p.lines, "truncated": p.truncated, "skipped": p.skipped,
                  "identical": p.identical}
        return p.ids, p.labels, counts

    settings = {"seq_len": seq_len, "overlong": overlong, "vocab_size": vocab_size}
    ids, labels, counts = open_sequences(resolve(path), tokenizer, template, cache_dir, build,
                                         kind="preference", settings=settings, log=log)
    return Pairs(path, ids, labels, **counts)


def rows(pairs: Pairs, seq_len: int) -> dict:
    """One row of seq_len positions per sequence: {"inputs", "targets", "segment_ids",
    "positions"} (2N, seq_len) int32 and "reference" (2N,) fp32 (zeros until the reference pass
    fills it). Padding at a row's end: segment PADDING_SEGMENT, target IGNORE_ID."""
    n = len(pairs.ids)
    out = {"inputs": np.zeros((n, seq_len), np.int32),
           "targets": np.full((n, seq_len), IGNORE_ID, np.int32),
           "segment_ids": np.full((n, seq_len), PADDING_SEGMENT, np.int32),
           "positions": np.tile(np.arange(seq_len, dtype=np.int32), (n, 1)),
           "reference": np.zeros(n, np.float32)}
    for r, (ids, labels) in enumerate(zip(pairs.ids, pairs.labels)):
        t = len(ids) - 1
        out["inputs"][r, :t] = ids[:-1]
        out["targets"][r, :t] = labels[1:]
        out["segment_ids"][r, :t] = 0
    return out


class PreferenceDataset:
    """Rows of pairs, whole pairs shuffled per epoch (data.WindowOrder: deterministic, resumable,
    the same two-int state). A batch is (inputs, targets, context): inputs (M, B, T) int32,
    targets {"tokens": (M, B, T), "reference": (M, B)}, context {"segment_ids", "positions"}
    (M, B, T), B = data.batch_size rows = B / 2 pairs, the chosen before the rejected."""

    def __init__(self, rows: dict, *, batch_size: int, seed: int, num_micro_batches: int = 1,
                 summary: str = ""):
        self.rows, self.summary = rows, summary
        num_rows, self.seq_len = rows["inputs"].shape
        self.batch_size, self.num_micro_batches = int(batch_size), int(num_micro_batches)
        if self.batch_size % 2:
            raise DataError(f"data.batch_size={batch_size}: with data.format=preference it counts "
                            f"rows, the chosen and the rejected of each pair; give an even number")
        self.num_pairs = num_rows // 2
        self.rows_per_batch = self.batch_size * self.num_micro_batches
        pairs_per_batch = self.rows_per_batch // 2
        if self.num_pairs < pairs_per_batch:
            raise DataError(f"data too small: {self.num_pairs} pairs, but one step takes "
                            f"data.batch_size x data.micro_batches / 2 = {pairs_per_batch} pairs")
        self.order = WindowOrder(self.num_pairs, pairs_per_batch, int(seed), "pairs")

    @property
    def tokens_per_batch(self) -> int:
        return self.rows_per_batch * self.seq_len

    def batch(self, take_rows) -> tuple:
        """The batch of the rows `take_rows` ((M * B,) indices), shaped as next_batch's."""
        shape = lambda x: np.ascontiguousarray(
            x[take_rows].reshape(self.num_micro_batches, self.batch_size, *x.shape[1:]))
        r = {k: shape(v) for k, v in self.rows.items()}
        targets = {"tokens": r["targets"], "reference": r["reference"]}
        return r["inputs"], targets, {"segment_ids": r["segment_ids"], "positions": r["positions"]}

    def next_batch_with_context(self):
        pairs = self.order.take()
        return self.batch(np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1))

    def state(self) -> dict:
        return self.order.state()

    def restore(self, state: dict):
        self.order.restore(state)


def load_preference(d, tokenizer, *, vocab_size: int, seed: int, log=print) -> PreferenceDataset:
    """The training PreferenceDataset of a DataConfig `d` with format preference (reference
    log-probs not yet filled in), its pairs tokenized once into data.cache_dir (`log` says when
    it is built); its `summary` says what was truncated or skipped."""
    template = ChatTemplate.for_tokenizer(tokenizer.path, f"data.format={d.format}")
    pairs = cached_pairs(d.path, tokenizer, template, seq_len=d.seq_len, overlong=d.overlong,
                         vocab_size=vocab_size, cache_dir=d.cache_dir or default_cache_dir(),
                         log=log)
    table = rows(pairs, d.seq_len)
    used = sum(len(ids) - 1 for ids in pairs.ids) / table["targets"].size
    trained = np.count_nonzero(table["targets"] != IGNORE_ID) / table["targets"].size
    summary = (f"preference data: {pairs.report(d.seq_len, d.overlong)}; one row of "
               f"{d.seq_len} tokens per sequence: {used:.0%} of positions hold tokens, "
               f"{trained:.0%} are trained on (completion tokens)")
    return PreferenceDataset(table, batch_size=d.batch_size, seed=seed,
                             num_micro_batches=d.micro_batches, summary=summary)
