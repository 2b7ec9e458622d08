"""The files a data path names, and their records.

A path is a file, a glob (`data/*.parquet`, `data/**/*.txt`) or a directory of shards, all of one
format. A directory is read at its top level: its subfolders holding data files are named in the
run's log, with the glob that reads them. A glob's `**` follows links to folders, each real
folder once: a link back to a folder above it (a loop) is named, not followed, and a file
reached by two paths is read once.

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
import fnmatch
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
    (a KINDS value or "text"); `skipped`: the files of a directory left out as no data file;
    `subfolders`: (folder, the data files under it) of a directory's subfolders, not read;
    `links`: (link, its folder, why) of the links to folders a glob did not follow."""
    path: str
    files: tuple
    kind: str
    key: str = "data.path"
    skipped: tuple = ()
    subfolders: tuple = ()
    links: tuple = ()

    def matched(self) -> str | None:
        """What a glob or directory matched, for the run's log (None for a file named as is)."""
        if self.files == (self.path,):
            return None
        base = self.path if os.path.isdir(self.path) else _split_glob(self.path)[0]
        rel = lambda f: os.path.relpath(f, base)
        names = lambda paths: _some([rel(f) for f in paths])
        count = f"{len(self.files)} {self.kind} file{'s' if len(self.files) > 1 else ''}"
        line = f"{self.key}={self.path}: {count} ({names(self.files)})"
        if self.skipped:
            line += (f"; left out {names(self.skipped)} (not {', '.join(DATA_EXTENSIONS[:-1])} "
                     f"or {DATA_EXTENSIONS[-1]})")
        if self.subfolders:
            line += f"; {_subfolders_note(self.path, self.subfolders, self.key)}"
        for link, target, why in self.links:
            line += f"; not followed: {rel(link)} -> {target} ({why})"
        return line


def _subfolders_note(directory: str, subfolders: tuple, key: str) -> str:
    """What a directory's subfolders hold that is not read, and the glob that reads it."""
    count = sum(len(files) for _, files in subfolders)
    folders = _some([os.path.basename(d) + "/" for d, _ in subfolders])
    every_level = os.path.join(directory, "**", "*" + os.path.splitext(subfolders[0][1][0])[1])
    return (f"left out subfolders {folders} ({count} data file{'s' if count > 1 else ''} under "
            f"{'them' if len(subfolders) > 1 else 'it'}; a directory is read at its top level: "
            f"{key}='{every_level}' reads every level)")


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
    """(the data files of `directory`, in name order, the other files left out, (subfolder, data
    files under it) of its subfolders that hold any: a directory is read at its top level)."""
    if os.path.isfile(os.path.join(directory, "state.json")):
        return _datasets_files(directory), [], []
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
    shown = [os.path.join(directory, n) for n in names if not n.startswith((".", "_"))]
    found = [f for f in shown if os.path.isfile(f)]
    files = [f for f in found if os.path.splitext(f)[1].lower() in DATA_EXTENSIONS]
    skipped = [f for f in found if f not in files]
    subfolders = [(d, under) for d in shown
                  if os.path.isdir(d) and (under := _data_files_under(d, directory))]
    if not files:
        left = f"; left out {_some([os.path.basename(f) for f in skipped])}" if skipped else ""
        if subfolders:
            left += f"; {_subfolders_note(directory, tuple(subfolders), key)}"
        raise DataError(f"{key}={directory}: the directory holds no data file (none ends in "
                        f"{', '.join(DATA_EXTENSIONS)}){left}")
    return files, skipped, subfolders


def _data_files_under(folder: str, directory: str) -> tuple:
    """The data files under `folder`, a subfolder of `directory` (a link back into it: none)."""
    files = _walk(folder, entered={os.path.realpath(directory)})[0]
    return tuple(f for f in files if os.path.splitext(f)[1].lower() in DATA_EXTENSIONS)


def _walk(root: str, entered: set | None = None) -> tuple:
    """(every file under `root`, in sorted depth-first order, [(link, its real folder, why)] of
    the links to folders not followed). Links to folders are followed, each real folder entered
    once (`entered`: real folders taken as entered already): a link to a folder above it (a
    loop) or to one already entered is named instead. Hidden entries are left out, as a glob's
    wildcards leave them."""
    files, links, entered = [], [], set(entered or ())

    def visit(folder: str):
        real = os.path.realpath(folder)
        entered.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                target = os.path.realpath(entry.path)
                if target not in entered:
                    visit(entry.path)
                elif real == target or real.startswith(target + os.sep):
                    links.append((entry.path, target, "a loop: a link to a folder above it"))
                else:
                    links.append((entry.path, target, "a folder already read"))
            elif entry.is_file():
                files.append(entry.path)

    visit(root)
    return files, links


MAGIC = "*?["


def _split_glob(pattern: str) -> tuple:
    """(the folder a glob starts from: its leading components with no wildcard, the components
    of the rest of it)."""
    parts = pattern.split(os.sep)
    plain = next(i for i, part in enumerate(parts + ["*"]) if any(c in part for c in MAGIC))
    root = os.sep.join(parts[:plain]) or ("/" if pattern.startswith(os.sep) else ".")
    return root, parts[plain:]


def _matches(parts: list, pattern: list) -> bool:
    """Whether path components `parts` match glob components `pattern` (`**`: any number)."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and \
        _matches(parts[1:], pattern[1:])


def _glob(pattern: str) -> tuple:
    """(the files `pattern` matches, sorted, each real file once; the links to folders `**` did
    not follow, as _walk names them). A pattern without `**` is Python's glob; with it, the
    folders under its root are walked (_walk), as glob's recursive `**` would, but never round a
    loop of links."""
    links = []
    if "**" not in pattern.split(os.sep):
        found = sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
    else:
        root, rest = _split_glob(pattern)
        walked, links = _walk(root) if os.path.isdir(root) else ([], [])
        if root == ".":  # as glob names them: "a/b.txt", not "./a/b.txt"
            walked = [f[2:] for f in walked]
            links = [(link[2:], target, why) for link, target, why in links]
        found = sorted(f for f in walked
                       if _matches(os.path.relpath(f, root).split(os.sep), rest))
    files, seen = [], set()
    for f in found:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            files.append(f)
    return files, links


def resolve(path: str, key: str = "data.path") -> Source:
    """The Source that `path` (a file, glob or directory; the config key `key`) names. Raises
    DataError for a glob that matches nothing, an empty directory, shards of more than one
    format, or a file that cannot be read."""
    if not path:
        raise DataError(f"{key} is empty; give a file, a glob or a directory of shards")
    skipped, subfolders, links = [], [], []
    if any(c in path for c in MAGIC):
        files, links = _glob(path)
        if not files:
            raise DataError(f"{key}={path}: the glob matches no file")
    elif os.path.isdir(path):
        files, skipped, subfolders = _directory_files(path, key)
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
    return Source(path, tuple(files), kinds[0], key, tuple(skipped), tuple(subfolders),
                  tuple(links))


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
