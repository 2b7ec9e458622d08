"""SFT data: chat conversations rendered with the model's own chat template, trained on the
assistant tokens only, packed into rows with document masks.

A line of the JSONL file is one conversation: {"messages": [{"role", "content"}, ...]} or
{"prompt": ..., "completion": ...} (a user turn, then an assistant turn). It is rendered with the
Jinja `chat_template` of the tokenizer (tokenizer_config.json or chat_template.jinja next to the
tokenizer.json), as transformers' `apply_chat_template` renders it, and tokenized like it (the
whole text at once, special tokens matched, none added). The assistant tokens are found without
`{% generation %}` markers: an assistant message i adds the text between the rendering of
messages[:i] with the generation prompt and that of messages[:i+1]; every token overlapping it is
trained on (the content and what the template closes the turn with, e.g. `<|im_end|>\\n`).
"""

import bisect
import dataclasses
import json
import os
from datetime import datetime

import numpy as np

from megatrain_jax.config import OVERLONG
from megatrain_jax.data import DataError, WindowOrder, share_of_batch
from megatrain_jax.loss import IGNORE_ID
from megatrain_jax.sources.cache import default_cache_dir
from megatrain_jax.sources.files import BadRows, records, resolve
from megatrain_jax.sources.sequences import open_sequences

ROLES = ("system", "user", "assistant")
# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES); any
# other `*_token` string of tokenizer_config.json is passed too, as transformers 5 does.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them


# -----------------------------------------------------------------------------
# the chat template


def _environment():
    """Jinja as transformers' `_compile_jinja_template` sets it up: sandboxed and immutable,
    trim_blocks and lstrip_blocks, loop controls, `{% generation %}` accepted (rendered as its
    body), a JSON `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and the
    sandbox's guarded `dict` and `namespace`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda format: datetime.now().strftime(format),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env


def _token_text(value):
    """A special token of tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read it as JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


class ChatTemplate:
    """The Jinja chat template of a Hugging Face tokenizer, with the variables transformers gives
    it (its special tokens), rendered as `apply_chat_template(..., tokenize=False)` renders it."""

    def __init__(self, source: str, variables: dict, where: str):
        import jinja2

        self.source, self.variables, self.where = source, dict(variables), where
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{where}: the chat template is not valid Jinja ({e.message}, line "
                            f"{e.lineno} of the template)") from None

    @classmethod
    def for_tokenizer(cls, tokenizer_json: str, needed_by: str = "data.format=sft"
                      ) -> "ChatTemplate":
        """The template of the tokenizer.json at `tokenizer_json`: chat_template.jinja beside it
        (which transformers prefers), else tokenizer_config.json's `chat_template` (a string, or
        a list of named templates: the one named "default"). Raises DataError if there is none,
        saying what needs it (`needed_by`)."""
        directory = os.path.dirname(os.path.abspath(tokenizer_json))
        config_path = os.path.join(directory, "tokenizer_config.json")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        source, where = None, config_path
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source, where = f.read(), jinja_path
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
                source = next((t.get("template") for t in source
                               if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(source, str) or not source.strip():
            raise DataError(f"{needed_by} needs the model's chat template: neither "
                            f"{jinja_path} nor a chat_template in {config_path} was found")
        tokens = {}
        map_path = os.path.join(directory, "special_tokens_map.json")  # older repositories
        for origin in ((_read_json(map_path) if os.path.isfile(map_path) else {}), config):
            for key, value in origin.items():
                if key in SPECIAL_TOKENS or key.endswith("_token"):
                    text = _token_text(value)
                    if text is not None:
                        tokens[key] = text
                    else:
                        tokens.pop(key, None)  # null in tokenizer_config.json: no such token
        return cls(source, tokens, where)

    def render(self, messages: list, add_generation_prompt: bool = False) -> str:
        """The conversation as text (raises jinja2 errors, e.g. the template's raise_exception)."""
        chat = []
        for message in messages:  # as transformers passes them: None values dropped
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        return self.template.render(messages=chat, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **self.variables)


# -----------------------------------------------------------------------------
# conversations -> token ids and assistant masks


def record_messages(obj, where: str) -> list:
    """The messages of one JSONL record, checked."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with \"messages\" or \"prompt\" and "
                        f"\"completion\", got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: \"messages\" must be a non-empty list of "
                            f"{{\"role\", \"content\"}} objects")
    elif "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                got = "missing" if key not in obj else f"a {type(obj[key]).__name__}"
                raise DataError(f"{where}: \"{key}\" must be a string, got {got}")
        messages = [{"role": "user", "content": obj["prompt"]},
                    {"role": "assistant", "content": obj["completion"]}]
    else:
        keys = ", ".join(sorted(obj)) or "none"
        raise DataError(f"{where}: no \"messages\" and no \"prompt\"/\"completion\" (keys: {keys})")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: message {j} must be an object with \"role\" and "
                            f"\"content\", got {json.dumps(message)[:80]}")
        if message["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has unknown role {message['role']!r} "
                            f"(expected one of {', '.join(ROLES)})")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: message {j} ({message['role']}): content must be a "
                            f"string, got {type(message['content']).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, so nothing to train on")
    return messages


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _offsets_tokenizer(tokenizer):
    """A copy of the tokenizer without its post-processor: the same ids (no special tokens are
    added with add_special_tokens=False), with offsets that are not trimmed of whitespace."""
    from tokenizers import Tokenizer

    if not hasattr(tokenizer, "_chat_offsets"):
        copy = Tokenizer.from_str(tokenizer.tok.to_str())
        copy.post_processor = None
        tokenizer._chat_offsets = copy
    return tokenizer._chat_offsets


def encode_conversation(template: ChatTemplate, tokenizer, messages: list, where: str,
                        train_from: int = 0) -> tuple:
    """(ids, assistant): the token ids of the rendered conversation (int32, as
    `apply_chat_template(messages, tokenize=True)` gives them) and a bool mask of the tokens that
    assistant messages add (those at index >= `train_from` only: a preference pair's completion,
    not its prompt's earlier turns). Raises DataError naming `where` if the template refuses the
    conversation or does not render its prefixes as prefixes."""
    import jinja2

    try:
        text = template.render(messages)
        spans = []  # (first char, end char) of what each assistant message adds
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < train_from:
                continue
            before = template.render(messages[:i], add_generation_prompt=True)
            after = template.render(messages[:i + 1])
            if not (after.startswith(before) and text.startswith(after)):
                raise DataError(
                    f"{where}: the chat template does not render messages[:{i}] with the "
                    f"generation prompt as a prefix of messages[:{i + 1}] and of the whole "
                    f"conversation, so the tokens of assistant message {i} cannot be found")
            spans.append((len(before), len(after)))
    except DataError:
        raise
    except jinja2.TemplateError as e:
        raise DataError(f"{where}: the chat template refused this conversation "
                        f"({type(e).__name__}: {_first_line(e)})") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise DataError(f"{where}: the chat template failed on this conversation "
                        f"({type(e).__name__}: {_first_line(e)})") from None
    encoding = _offsets_tokenizer(tokenizer).encode(text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int32)
    starts = np.asarray([s for s, _ in encoding.offsets], dtype=np.int64).reshape(-1)
    ends = np.asarray([e for _, e in encoding.offsets], dtype=np.int64).reshape(-1)
    assistant = np.zeros(len(ids), dtype=bool)
    for first, end in spans:  # every token overlapping the span
        assistant |= (ends > first) & (starts < end)
    return ids, assistant


def read_conversations(path: str, bad: BadRows, key: str = "data.path"):
    """("where", messages) for every conversation of data in any record format (sources.files:
    a file, glob or directory of .jsonl, .parquet, .arrow); a bad one is counted in `bad`."""
    for where, obj in read_records(path, "conversations", ("messages", "prompt", "completion"),
                                   key):
        try:
            yield where, record_messages(obj, where)
        except DataError as e:
            bad.add(e)


def read_records(path: str, what: str, columns: tuple, key: str = "data.path"):
    """("where", record) for every record of a file, glob or directory of `what` (JSONL lines, or
    table rows with those of `columns` the table has); where names the file and line or row."""
    yield from records(resolve(path, key), list(columns), what)


# -----------------------------------------------------------------------------
# examples: (ids, labels), cut to the rows' length


@dataclasses.dataclass
class Examples:
    """Tokenized conversations of one file, in file order, each at most seq_len + 1 tokens:
    `ids[k]` the tokens, `labels[k]` the same with IGNORE_ID on every non-assistant token."""
    path: str
    ids: list
    labels: list
    conversations: int = 0  # non-blank lines
    truncated: int = 0  # longer than seq_len + 1 tokens, cut (data.overlong=truncate)
    skipped: int = 0  # dropped: longer (data.overlong=skip), or no assistant token (left when cut)

    def report(self, seq_len: int, overlong: str) -> str:
        if overlong == "skip":
            what = f"none truncated, {self.skipped} skipped (over data.seq_len={seq_len})"
        else:
            what = (f"{self.truncated} truncated to data.seq_len={seq_len}, {self.skipped} skipped "
                    f"(no assistant token within data.seq_len)")
        return f"{self.path}: {self.conversations} conversations, {len(self.ids)} used; {what}"

    def split_tail(self, fraction: float) -> tuple:
        """(head, tail): the last `fraction` of the examples (at least one) held out."""
        cut = len(self.ids) - max(1, int(len(self.ids) * fraction))
        head = dataclasses.replace(self, ids=self.ids[:cut], labels=self.labels[:cut])
        tail = dataclasses.replace(self, ids=self.ids[cut:], labels=self.labels[cut:])
        return head, tail


def load_examples(path: str, tokenizer, template: ChatTemplate, *, seq_len: int,
                  overlong: str = "truncate", vocab_size: int | None = None,
                  key: str = "data.path") -> Examples:
    """The conversations of a chat JSONL file as training examples of at most seq_len + 1 tokens
    (seq_len inputs and targets). A longer one is truncated or skipped per `overlong`, and
    counted. Raises DataError naming file and line for a bad line, or if no example is left."""
    if overlong not in OVERLONG:
        raise DataError(f"data.overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    out, bad = Examples(path, [], []), BadRows(path)
    for where, messages in read_conversations(path, bad, key):
        out.conversations += 1
        if bad.count:  # the load fails at the end, naming the first and counting them all
            continue
        ids, assistant = encode_conversation(template, tokenizer, messages, where)
        check_vocab(ids, vocab_size, where)
        labels = np.where(assistant, ids, IGNORE_ID).astype(np.int32)
        if len(ids) > seq_len + 1:
            if overlong == "skip":
                out.skipped += 1
                continue
            ids, labels = ids[:seq_len + 1], labels[:seq_len + 1]
            if not np.any(labels[1:] != IGNORE_ID):
                out.skipped += 1
                continue
            out.truncated += 1
        if len(ids) < 2 or not np.any(labels[1:] != IGNORE_ID):
            out.skipped += 1  # nothing to predict: empty assistant turns the template adds nothing for
            continue
        out.ids.append(ids)
        out.labels.append(labels)
    return loaded(out, bad, "example", seq_len, overlong)


def check_vocab(ids: np.ndarray, vocab_size: int | None, where: str):
    """Raises DataError naming `where` for a token id the model has no row for."""
    if vocab_size is not None and len(ids) and ids.max() >= vocab_size:
        raise DataError(f"{where}: token id {int(ids.max())} >= model.vocab_size ({vocab_size})")


def loaded(out, bad: BadRows, what: str, seq_len: int, overlong: str):
    """`out` (Examples, or preference.Pairs) once its file is read: DataError naming the file if a
    row was bad (the first, and how many) or no `what` is usable."""
    bad.check()
    if not out.ids:
        raise DataError(f"{out.path}: no usable {what} ({out.report(seq_len, overlong)})")
    return out


def cached_examples(path: str, tokenizer, template: ChatTemplate, *, seq_len: int,
                    overlong: str, vocab_size: int | None, cache_dir: str, key: str = "data.path",
                    log=print) -> Examples:
    """load_examples's examples, tokenized once: read from their cache in `cache_dir`
    (sources/sequences.py), which load_examples builds when it is missing or stale."""
    def build():
        ex = load_examples(path, tokenizer, template, seq_len=seq_len, overlong=overlong,
                           vocab_size=vocab_size, key=key)
        counts = {"conversations": ex.conversations, "truncated": ex.truncated,
                  "skipped": ex.skipped}
        return ex.ids, ex.labels, counts

    settings = {"seq_len": seq_len, "overlong": overlong, "vocab_size": vocab_size}
    ids, labels, counts = open_sequences(resolve(path, key), tokenizer, template, cache_dir,
                                         build, kind="sft", settings=settings, log=log)
    return Examples(path, ids, labels, **counts)


# -----------------------------------------------------------------------------
# packing


PADDING_SEGMENT = -1  # model.Block: a negative segment id is padding


def pack(examples: Examples, seq_len: int) -> dict:
    """Rows of seq_len positions holding whole examples: {"inputs", "targets", "segment_ids",
    "positions"}, each (R, seq_len) int32. An example of n tokens takes n - 1 positions (inputs
    ids[:-1], targets labels[1:]); its segment id is its place in the row and its positions count
    from 0, so it attends only to itself and its RoPE restarts. The rest of a row is padding:
    segment PADDING_SEGMENT (-1: a segment of its own, which a mixture of experts' router
    statistics leave out), target IGNORE_ID. Best-fit decreasing: each example, longest first, goes to the
    fullest row it fits in (rows in file order of their first example; deterministic)."""
    lengths = [len(ids) - 1 for ids in examples.ids]
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    rows, free = [], []  # free: sorted (space left, row index)
    for k in order:
        at = bisect.bisect_left(free, (lengths[k], -1))
        if at == len(free):
            rows.append([k])
            space, r = seq_len - lengths[k], len(rows) - 1
        else:
            space, r = free.pop(at)
            rows[r].append(k)
            space -= lengths[k]
        if space:
            bisect.insort(free, (space, r))
    rows = sorted((sorted(row) for row in rows), key=lambda row: row[0])
    shape = (len(rows), seq_len)
    out = {"inputs": np.zeros(shape, np.int32), "targets": np.full(shape, IGNORE_ID, np.int32),
           "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
    for r, row in enumerate(rows):
        t = 0
        for segment, k in enumerate(row):
            ids, labels, n = examples.ids[k], examples.labels[k], lengths[k]
            out["inputs"][r, t:t + n] = ids[:-1]
            out["targets"][r, t:t + n] = labels[1:]
            out["segment_ids"][r, t:t + n] = segment
            out["positions"][r, t:t + n] = np.arange(n)
            t += n
        out["segment_ids"][r, t:] = PADDING_SEGMENT
        out["positions"][r, t:] = np.arange(seq_len - t)
    return out


def describe_rows(rows: dict, examples: Examples) -> str:
    """How full the rows are and how much of them is trained on."""
    total = rows["targets"].size
    used = sum(len(ids) - 1 for ids in examples.ids)
    trained = int(np.count_nonzero(rows["targets"] != IGNORE_ID))
    return (f"packed into {len(rows['targets'])} rows of {rows['targets'].shape[1]} tokens: "
            f"{used / total:.0%} of positions hold tokens, {trained / total:.0%} are trained on "
            f"(assistant tokens)")


class SFTDataset:
    """Packed rows of SFT examples, shuffled per epoch, deterministic and resumable as
    data.PackedDataset's windows are (data.WindowOrder: the same order and the same two-int
    state)."""

    def __init__(self, rows: dict, *, batch_size: int, seed: int, num_micro_batches: int = 1,
                 summary: str = ""):
        self.rows, self.summary = rows, summary
        self.num_windows, self.seq_len = rows["inputs"].shape
        self.batch_size, self.num_micro_batches = int(batch_size), int(num_micro_batches)
        self.seed = int(seed)
        self.windows_per_batch = self.batch_size * self.num_micro_batches
        if self.num_windows < self.windows_per_batch:
            raise DataError(
                f"data too small: the examples pack into {self.num_windows} rows of "
                f"data.seq_len={self.seq_len} tokens, but one step takes data.batch_size x "
                f"data.micro_batches = {self.batch_size} x {self.num_micro_batches} = "
                f"{self.windows_per_batch} rows; use more data or lower data.batch_size or "
                f"data.micro_batches")
        self.order = WindowOrder(self.num_windows, self.windows_per_batch, self.seed, "rows")
        self.share = (0, 1)  # this process's part of each micro-batch's rows, as PackedDataset's

    @property
    def tokens_per_batch(self) -> int:
        return self.windows_per_batch * self.seq_len

    def next_batch_with_context(self):
        """(inputs, targets, context): int32 (num_micro_batches, batch_size, seq_len) each, and
        context = {"segment_ids", "positions"} of the same shape."""
        take = share_of_batch(self.order.take(), self.num_micro_batches, self.share)
        return _batch(self.rows, take, self.num_micro_batches, self.batch_size // self.share[1])

    def next_batch(self):
        """(inputs, targets), as data.PackedDataset's."""
        return self.next_batch_with_context()[:2]

    def state(self) -> dict:
        return self.order.state()

    def restore(self, state: dict):
        self.order.restore(state)


def _batch(rows: dict, take, num_micro_batches: int, batch_size: int) -> tuple:
    shaped = {k: np.ascontiguousarray(v[take].reshape(num_micro_batches, batch_size, -1))
              for k, v in rows.items()}
    context = {"segment_ids": shaped["segment_ids"], "positions": shaped["positions"]}
    return shaped["inputs"], shaped["targets"], context


def eval_batches(rows: dict, *, batch_size: int, num_micro_batches: int, num_batches: int,
                 what: str) -> list:
    """The first `num_batches` batches of the rows in order (fewer if there are fewer):
    [(inputs, targets, context)], as SFTDataset's. `what` names the data in the error raised when
    it is too small for one batch."""
    per_batch = batch_size * num_micro_batches
    num_rows = len(rows["inputs"])
    if num_rows < per_batch:
        raise DataError(f"{what}: too small for one eval batch: its examples pack into {num_rows} "
                        f"rows, one batch takes data.batch_size x data.micro_batches = "
                        f"{per_batch} rows")
    return [_batch(rows, np.arange(b * per_batch, (b + 1) * per_batch), num_micro_batches,
                   batch_size) for b in range(min(num_batches, num_rows // per_batch))]


def load_sft(d, tokenizer, *, vocab_size: int, seed: int, num_eval_batches: int,
             log=print) -> tuple:
    """(the training SFTDataset, the held-out eval batches or None) for a DataConfig `d` with
    format sft: data.path's conversations (without the last data.eval_fraction of them, held out),
    or data.eval_path's for evaluation, each tokenized once into data.cache_dir (`log` says when
    it is built). The dataset's `summary` says what was truncated, skipped and packed."""
    template = ChatTemplate.for_tokenizer(tokenizer.path)
    load = lambda path, key="data.path": cached_examples(
        path, tokenizer, template, seq_len=d.seq_len, overlong=d.overlong, vocab_size=vocab_size,
        cache_dir=d.cache_dir or default_cache_dir(), key=key, log=log)
    examples = load(d.path)
    lines = [f"sft data: {examples.report(d.seq_len, d.overlong)}"]
    held_out, what = None, None
    if d.eval_fraction:  # the file's last conversations, never trained on
        if len(examples.ids) < 2:
            raise DataError(f"{d.path}: data.eval_fraction={d.eval_fraction} needs at least 2 "
                            f"usable examples, got {len(examples.ids)}")
        examples, held_out = examples.split_tail(d.eval_fraction)
        what = (f"data.eval_fraction={d.eval_fraction} (the last {len(held_out.ids)} examples of "
                f"{d.path})")
    elif d.eval_path:
        try:
            held_out = load(d.eval_path, "data.eval_path")
        except DataError as e:  # named already where the path did not resolve
            raise DataError(str(e) if "data.eval_path" in str(e)
                            else f"data.eval_path: {e}") from None
        what = f"data.eval_path={d.eval_path}"
        lines.append(f"sft eval data: {held_out.report(d.seq_len, d.overlong)}")
    rows = pack(examples, d.seq_len)
    lines[0] += f"; training examples {describe_rows(rows, examples)}"
    dataset = SFTDataset(rows, batch_size=d.batch_size, seed=seed,
                         num_micro_batches=d.micro_batches, summary="\n".join(lines))
    if held_out is None:
        return dataset, None
    batches = eval_batches(pack(held_out, d.seq_len), batch_size=d.batch_size,
                           num_micro_batches=d.micro_batches, num_batches=num_eval_batches,
                           what=what)
    return dataset, batches
