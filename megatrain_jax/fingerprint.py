"""The identity of data files: what a token cache was built from (sources/cache.py), and what a
run's checkpoints record and compare on resume, so that a corpus (or the chat template an SFT or
preference run renders it with) edited in place between a run and its resume is noticed
(train.py).

Each file is known by its size, its mtime and a hash of its head: cheap for any size, and a file
cut short, grown, or rewritten anywhere differs (an edit past the head at the same size changes
the mtime). A resume compares all three, as a cache does (it is rebuilt when any changed): a run
never goes on silently with data its token cache saw change. A file touched or copied over
itself without its mtime is refused too, naming the mtime; checkpoint.allow_changes=[data.path]
resumes with it.
"""

import datetime
import hashlib
import os

HEAD_BYTES = 1 << 20  # hashed from each file's start
# The files beside a tokenizer.json that its chat template is read from (chat.ChatTemplate): an
# SFT or preference run's data too. Checkpoints recorded them later than the data's own files,
# so a saved list without any of them is of a checkpoint from before, not of another template.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json")


def file_identity(path: str) -> dict:
    """{"file", "bytes", "mtime_ns", "head_sha256"} of the regular file `path`."""
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
        st = os.fstat(f.fileno())
    return {"file": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_sha256": head}


def files_identity(paths: list[str]) -> list[dict]:
    """file_identity of each of `paths`, in the given order."""
    return [file_identity(path) for path in paths]


def first_change(saved: list[dict], now: list[dict]) -> str | None:
    """How the files of `now` differ from `saved` (both files_identity's), in words, or None."""
    saved_by_file = {s["file"]: s for s in saved}
    template = lambda name: os.path.basename(name) in CHAT_TEMPLATE_FILES
    if not any(map(template, saved_by_file)):  # recorded before templates were
        now = [n for n in now if not template(n["file"])]
    now_by_file = {n["file"]: n for n in now}
    gone, new = (sorted(a.keys() - b.keys()) for a, b in ((saved_by_file, now_by_file),
                                                          (now_by_file, saved_by_file)))
    said = lambda name: f"{name} (of the chat template)" if template(name) else name
    if gone:
        return f"{said(gone[0])} is no longer read"
    if new:
        return f"{said(new[0])} is new"
    for name, was in saved_by_file.items():
        n = now_by_file[name]
        if n["bytes"] != was["bytes"]:
            return (f"{said(name)} is {n['bytes']:,} bytes, {was['bytes']:,} when the checkpoint "
                    f"was saved")
        if n["head_sha256"] != was["head_sha256"]:
            return (f"{said(name)}: its first {min(was['bytes'], HEAD_BYTES):,} bytes changed "
                    f"since the checkpoint was saved")
        if "mtime_ns" in was and n["mtime_ns"] != was["mtime_ns"]:  # older checkpoints: none
            return (f"{said(name)}: its mtime is {_when(n['mtime_ns'])}, "
                    f"{_when(was['mtime_ns'])} when the checkpoint was saved (the same size and "
                    f"first {min(was['bytes'], HEAD_BYTES):,} bytes: an edit past them, or the "
                    f"file touched or copied over)")
    return None


def _when(mtime_ns: int) -> str:
    when = datetime.datetime.fromtimestamp(mtime_ns / 1e9)
    return when.isoformat(sep=" ", timespec="milliseconds")
