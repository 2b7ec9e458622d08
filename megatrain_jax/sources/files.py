"""The files a data path names, and their records.

A path is a file, a glob (`data/*.parquet`) or a directory of shards, all of one format:

    .jsonl     one JSON object per line
    .parquet   a Parquet table (pyarrow, the `data` extra)
    .arrow     an Arrow IPC file or stream (pyarrow)
    datasets   a directory written by `datasets.save_to_disk` (state.json + Arrow streams)
    .bin .npy  pre-tokenized ids (data.token_dtype for .bin)
    other      UTF-8 text, each file one document

Record formats (jsonl, parquet, arrow) give (where, row) pairs, where = "file:line" for JSONL and
"file[row N]" (0-based, as ds[N]) for tables, so every error names the file and the row.
"""

import dataclasses
import glob
import json
import os

from megatrain_jax.data import DataError, check_regular, jsonl_objects
from megatrain_jax.fingerprint import CHAT_TEMPLATE_FILES

KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".bin": "bin",
         ".npy": "npy"}
# A directory's shards are its files of these extensions: a LICENSE or README beside them is no
# shard (a file named as data.path is read whatever its extension).
DATA_EXTENSIONS = (*KINDS, ".txt")
RECORD_KINDS = ("jsonl", "parquet", "arrow")
TOKEN_KINDS = ("bin", "npy")
TABLE_BATCH = 1024  # rows per record batch read from a Parquet file
NAMES_SHOWN = 3  # file names a log line lists before "and N more"


@dataclasses.dataclass(frozen=True)
class Source:
    """The files of one data path (given as config key `key`), in order, and their one format
    (a KINDS value or "text"); `skipped`: the files of a directory left out as no data file."""
    path: str
    files: tuple
    kind: str
    key: str = "data.path"
    skipped: tuple = ()

    def matched(self) -> str | None:
        """What a glob or directory matched, for the run's log (None for a file named as is)."""
        if self.files == (self.path,):
            return None
        base = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        names = lambda paths: _some([os.path.relpath(f, base) for f in paths])
        count = f"{len(self.files)} {self.kind} file{'s' if len(self.files) > 1 else ''}"
        line = f"{self.key}={self.path}: {count} ({names(self.files)})"
        if self.skipped:
            line += (f"; left out {names(self.skipped)} (not {', '.join(DATA_EXTENSIONS[:-1])} "
                     f"or {DATA_EXTENSIONS[-1]})")
        return line


def _some(names: list) -> str:
    more = len(names) - NAMES_SHOWN
    return ", ".join(names[:NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def kind_of(path: str) -> str:
    return KINDS.get(os.path.splitext(path)[1].lower(), "text")


def _check_readable(path: str):
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e.strerror})") from None


def _datasets_files(directory: str) -> list:
    """The Arrow files of a `datasets.save_to_disk` directory, in its state.json order."""
    state_path = os.path.join(directory, "state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state["_data_files"]]
    except OSError as e:
        raise DataError(f"{state_path}: cannot read ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{state_path}: not a datasets state.json (no _data_files list of "
                        f"filenames: {type(e).__name__} {e})") from None
    if not names:
        raise DataError(f"{state_path}: lists no data files")
    return [os.path.join(directory, name) for name in names]


def _directory_files(directory: str, key: str) -> tuple:
    """(the data files of `directory`, in name order, the other files left out)."""
    if os.path.isfile(os.path.join(directory, "state.json")):
        return _datasets_files(directory), []
    if os.path.isfile(os.path.join(directory, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(directory)
                        if os.path.isdir(os.path.join(directory, d)))
        raise DataError(f"{key}={directory} is a datasets DatasetDict (splits: "
                        f"{', '.join(splits)}); point {key} at one split, e.g. "
                        f"{os.path.join(directory, splits[0] if splits else 'train')}")
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise DataError(f"{key}={directory}: cannot list the directory ({e.strerror})") from None
    found = [os.path.join(directory, n) for n in names
             if not n.startswith((".", "_")) and os.path.isfile(os.path.join(directory, n))]
    files = [f for f in found if os.path.splitext(f)[1].lower() in DATA_EXTENSIONS]
    skipped = [f for f in found if f not in files]
    if not files:
        left = f"; left out {_some([os.path.basename(f) for f in skipped])}" if skipped else ""
        raise DataError(f"{key}={directory}: the directory holds no data file (none ends in "
                        f"{', '.join(DATA_EXTENSIONS)}){left}")
    return files, skipped


def resolve(path: str, key: str = "data.path") -> Source:
    """The Source that `path` (a file, glob or directory; the config key `key`) names. Raises
    DataError for a glob that matches nothing, an empty directory, shards of more than one
    format, or a file that cannot be read."""
    if not path:
        raise DataError(f"{key} is empty; give a file, a glob or a directory of shards")
    skipped = []
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key}={path}: the glob matches no file")
    elif os.path.isdir(path):
        files, skipped = _directory_files(path, key)
    else:
        files = [path]
    kinds = [kind_of(f) for f in files]
    for f, kind in zip(files, kinds):
        if kind != kinds[0]:
            raise DataError(f"{f}: a {kind} shard among {kinds[0]} shards of {key}={path}; "
                            f"a data path's shards must all have one format")
        check_regular(f, key)
        _check_readable(f)
        if os.path.getsize(f) == 0:
            raise DataError(f"{f}: empty file (0 bytes); {key} must name a corpus")
    return Source(path, tuple(files), kinds[0], key, tuple(skipped))


# -----------------------------------------------------------------------------
# records


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading Parquet and Arrow data needs pyarrow: pip install "
                        "'megatrain-jax[data]' (pip install -e '.[data]' in a clone)") from None
    return pyarrow


def _table_batches(path: str, kind: str, columns: list):
    """(rows, {column: values}) per record batch of a Parquet or Arrow file, with only those of
    `columns` that the file has."""
    pa = _pyarrow()
    try:
        if kind == "parquet":
            table = pa.parquet.ParquetFile(path)
            names = table.schema_arrow.names
            batches = table.iter_batches(batch_size=TABLE_BATCH,
                                         columns=[c for c in columns if c in names])
        else:
            source = pa.memory_map(path)
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # datasets writes the stream format
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            names = reader.schema.names
        for batch in batches:
            yield batch.num_rows, {c: batch.column(batch.schema.get_field_index(c)).to_pylist()
                                   for c in columns if c in names}
    except (pa.ArrowException, OSError) as e:
        what = "Parquet" if kind == "parquet" else "Arrow IPC"
        raise DataError(f"{path}: not a readable {what} file ({str(e).splitlines()[0]})") from None


def table_rows(path: str, kind: str, columns: list):
    """(where, row) for every row of a Parquet or Arrow file; row: {column: value} of those of
    `columns` the file has (a missing one is missing from every row, for the caller to name)."""
    first = 0
    for num_rows, values in _table_batches(path, kind, columns):
        for i in range(num_rows):
            yield f"{path}[row {first + i}]", {c: v[i] for c, v in values.items()}
        first += num_rows


def records(source: Source, columns: list, what: str = "records"):
    """(where, record) for every record of a record-format Source, file by file: JSONL lines as
    parsed, table rows as {column: value} (only `columns`)."""
    if source.kind not in RECORD_KINDS:
        raise DataError(f"{source.path}: {source.kind} files hold no {what}; give .jsonl, "
                        f".parquet, .arrow or a datasets directory")
    for path in source.files:
        if source.kind == "jsonl":
            with open(path, "rb") as f:
                yield from jsonl_objects(f, path)
        else:
            yield from table_rows(path, source.kind, columns)


class BadRows:
    """Bad rows of a source: each one counted, the first named in the error `check` raises."""

    def __init__(self, path: str):
        self.path, self.first, self.count = path, None, 0

    def add(self, error: DataError):
        self.first = self.first or str(error)
        self.count += 1

    def check(self):
        if self.count == 1:
            raise DataError(self.first)
        if self.count:
            raise DataError(f"{self.first} (and {self.count - 1} more bad rows in {self.path}; "
                            f"fix or remove them)")


def data_files(d) -> list:
    """Every file a DataConfig `d` reads (data.path or each of data.sources, then data.eval_path,
    then for SFT and preference data the files its chat template is read from), resolved: what
    the data of a run is (fingerprint.files_identity says what each one is now)."""
    paths = [(s.path, f"data.sources.{i}.path") for i, s in enumerate(d.sources)] or \
        [(d.path, "data.path")]
    if d.eval_path:
        paths.append((d.eval_path, "data.eval_path"))
    files = [f for path, key in paths for f in resolve(path, key).files]
    if d.format in ("sft", "preference"):  # a template edited in place changes every sequence
        beside = os.path.dirname(os.path.abspath(d.tokenizer))
        files += [os.path.join(beside, n) for n in CHAT_TEMPLATE_FILES
                  if os.path.isfile(os.path.join(beside, n))]
    return files
