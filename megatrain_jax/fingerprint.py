"""The identity of a run's data files, saved with each checkpoint and compared on resume, so that
a corpus edited in place between a run and its resume is noticed (train.py).

Each file is known by its size and a hash of its head: cheap for any size, and a file cut short,
grown, or rewritten at its start differs. Takes a list of files, so a data source of several
shards passes them all.
"""

import hashlib
import os

HEAD_BYTES = 1 << 20  # hashed from each file's start


def files_identity(paths: list[str]) -> list[dict]:
    """[{"file", "bytes", "head_sha256"}] of each of `paths` (regular files), in the given order."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
        out.append({"file": os.path.abspath(path), "bytes": os.path.getsize(path),
                    "head_sha256": head})
    return out


def first_change(saved: list[dict], now: list[dict]) -> str | None:
    """How the files of `now` differ from `saved` (both files_identity's), in words, or None."""
    saved_by_file = {s["file"]: s for s in saved}
    now_by_file = {n["file"]: n for n in now}
    gone, new = (sorted(a.keys() - b.keys()) for a, b in ((saved_by_file, now_by_file),
                                                          (now_by_file, saved_by_file)))
    if gone:
        return f"{gone[0]} is no longer read"
    if new:
        return f"{new[0]} is new"
    for name, was in saved_by_file.items():
        n = now_by_file[name]
        if n["bytes"] != was["bytes"]:
            return f"{name} is {n['bytes']:,} bytes, {was['bytes']:,} when the checkpoint was saved"
        if n["head_sha256"] != was["head_sha256"]:
            return (f"{name}'s first {min(was['bytes'], HEAD_BYTES):,} bytes changed since the "
                    f"checkpoint was saved")
    return None
