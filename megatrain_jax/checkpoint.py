"""Save and restore a StreamedEngine's training state with Orbax, straight from and into host RAM.

A checkpoint is one step of an `ocp.CheckpointManager` with two items:

    state   engine.state(): {"stages": {"params", "opt_state"}, "layers": [{...}, ...]}, fp32, host
    meta    JSON: {"step": int, ...} plus whatever the caller adds (the training loop adds the
            resolved config, the data position and the RNG seed)

Orbax writes each step into a temporary directory and renames it when complete, so a process killed
mid-save leaves no step that `all_steps()` / `latest_step()` report. Used from your own project:

    manager = checkpoint.make_manager("/ckpt", keep=3)
    checkpoint.save(manager, step, engine, {"my_key": 1})   # asynchronous by default
    checkpoint.wait(manager)                                # SaveError if the write failed
    meta = checkpoint.restore(manager, engine)              # latest step; meta["step"]
    manager.close()

A save refuses a state holding NaN or inf, and a failed write raises SaveError naming the step and
the OS error; either way the checkpoints committed before are untouched. (After a failed
asynchronous save Orbax leaves non-daemon threads waiting for up to its async timeout, which
delays the interpreter's exit: scripts exit with os._exit after reporting it, see cli.py.)

Host state sharded over processes (the engine's shard_host_state, engine/shard.py): every
process saves its rows, through Orbax's multi-process support (one manager per process, all
active, one commit): each leaf is wrapped, without a copy, as a global array over a mesh of the
processes' host devices whose shape is the leaf's rows zero-padded to a multiple of the compute
devices (meta "shard_devices"; "host_shards" is the number of processes that wrote, and
"logical_rows" the rows of each padded leaf; a replicated save adds none of these). A restore
reads each leaf at the engine's own padded (or, replicated, logical) shape: Orbax zero-pads or
cuts the rows, and the padding rows are zero, so a checkpoint moves between layouts and process
counts (2 sharded -> 1, 1 -> 2 sharded, sharded -> replicated).
"""

import functools
import json
import math
import os
import re
import tempfile
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from megatrain_jax.engine.store import path_str
from megatrain_jax.errors import CheckpointError, SaveError

_in_flight = weakref.WeakKeyDictionary()  # manager -> step of its last asynchronous save
_policies = weakref.WeakKeyDictionary()  # manager -> its _LatestAndKept


class _LatestAndKept:
    """Orbax's preservation policy of make_manager: the `keep` latest steps, and the one step
    keep_out_of_rotation names whatever its age."""

    def __init__(self, keep: int | None):
        self.latest, self.kept = ocp.checkpoint_managers.LatestN(keep), None

    def should_preserve(self, checkpoints, *, context) -> list:
        latest = self.latest.should_preserve(checkpoints, context=context)
        return [bool(new) or c.step == self.kept for new, c in zip(latest, checkpoints)]


def make_manager(directory, *, keep: int | None = None, async_save: bool = True,
                 write_bytes: int | None = None, sharded: bool = False) -> ocp.CheckpointManager:
    """A CheckpointManager with the two items of this layout, keeping the `keep` latest steps
    and the step keep_out_of_rotation names.

    async_save=False makes every `save` block until the checkpoint is committed (see `save`).
    write_bytes bounds the bytes Orbax writes at once (default: everything at once); it must exceed
    the largest array. Tensorstore copies what it writes, so this bounds a save's extra memory.
    sharded: the engine's host state is sharded over the processes (engine.shards): every
    process takes part in each save (its rows) and restore.
    """
    # Several processes (data parallel, replicated host state): every process holds the whole
    # state, so each manager works alone (no barrier with the others); only process 0 saves.
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                               barrier_sync_key_prefix=f"process{me}")
    several = jax.process_count() > 1
    if several:  # Orbax creates it only with every process taking part
        os.makedirs(directory, exist_ok=True)
    policy = _LatestAndKept(keep)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=async_save, create=not several,
        **({"multiprocessing_options": alone} if several and not sharded else {}))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state_handler = (ocp.StandardCheckpointHandler() if write_bytes is None else
                     ocp.StandardCheckpointHandler(save_concurrent_gb=write_bytes / 1e9))
    registry.add("state", ocp.args.StandardSave, state_handler)
    registry.add("state", ocp.args.StandardRestore, state_handler)
    # PyTreeRestore reads the same files and, unlike StandardRestore, restores a subtree
    # (ocp.PLACEHOLDER leaves are skipped): `restore` reads one unit at a time.
    registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler())
    registry.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
    # Orbax (tensorstore) needs an absolute path; run_dir is often relative.
    manager = ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                    handler_registry=registry)
    _policies[manager] = policy
    return manager


def keep_out_of_rotation(manager: ocp.CheckpointManager, step: int | None):
    """Keeps checkpoint `step` whatever the manager's `keep` says (one step at a time: the one
    named before goes back into the rotation; None: none)."""
    _policies[manager].kept = step


def error_line(e: BaseException) -> str:
    """One line for an exception from Orbax/tensorstore; a wrapper that only points at
    tensorstore's spec dump gives way to its cause (the storage error itself)."""
    while ("See full TensorStore details" in str(e) or not str(e).strip()) and (
            e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    text = (str(e).split("See full TensorStore details")[0].strip().splitlines() or [""])[0]
    # tensorstore names the OS error by number ([os_error_code='27']) and, in some versions only,
    # by its text somewhere in a long line: lead with the OS's own words for it.
    code = re.search(r"os_error_code='?(\d+)", str(e))
    reason = os.strerror(int(code.group(1))) if code else ""
    if len(text) > 300:
        text = f"{text[:120]} ... {text[-160:]}"
    if reason and reason not in text:
        text = f"{reason}: {text}"
    return f"{type(e).__name__}: {text}".rstrip(": ")


def completed(manager) -> str:
    """The checkpoints complete in manager's directory, in words (for an error line)."""
    try:
        manager.reload()
        steps = manager.all_steps()
    except Exception:  # the directory itself may be what failed
        steps = []
    return (f"completed checkpoints: {', '.join(map(str, sorted(steps)))} (a run resumes from the "
            f"latest)" if steps else "no completed checkpoint")


def wait(manager: ocp.CheckpointManager):
    """Waits for an asynchronous save to be committed; its failure raises SaveError (one line)."""
    try:
        manager.wait_until_finished()
    except Exception as e:
        step = _in_flight.pop(manager, None)
        which = "an asynchronous save" if step is None else f"saving checkpoint step {step}"
        raise SaveError(f"{which} to {manager.directory} failed ({error_line(e)}); "
                        f"{completed(manager)}") from None
    _in_flight.pop(manager, None)


@jax.jit
def _all_finite(tree):
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _finite(tree) -> bool:
    leaves = jax.tree.leaves(tree)
    if any(isinstance(x, np.ndarray) for x in leaves):  # the disk tier's mapped files, by leaf
        return all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.inexact))
    return bool(_all_finite(tree))


def first_non_finite(state: dict) -> str | None:
    """The first part of an engine state ("stages/params", "layers/3/opt_state", ...) holding a
    NaN or an infinity, or None. One jitted reduction per part, run where the state lives (the
    host), so it reads the state once and copies nothing (the disk tier's: one leaf at a time)."""
    units = [("stages", state["stages"])]
    units += [(f"layers/{i}", unit) for i, unit in enumerate(state["layers"])]
    for name, unit in units:
        for part in ("params", "opt_state"):
            if not _finite(unit[part]):
                return f"{name}/{part}"
    return None


def save(manager: ocp.CheckpointManager, step: int, engine, meta: dict | None = None):
    """Writes the engine's state as checkpoint `step`; `meta` must be JSON-able.

    Refuses (SaveError) a state that is not finite, so a checkpoint never holds NaN; an I/O failure
    raises SaveError too, at this call or, for an asynchronous save, at the next `save` or `wait`.

    With an asynchronous manager this returns once Orbax holds the state and the files are written
    in the background while training goes on. The checkpoint is still the state as of `step`: on the
    CPU backend Orbax takes zero-copy numpy views of the host arrays, and XLA will not donate (reuse
    in place) a buffer that a view still references, so the next steps' optimizer updates write
    fresh buffers while the old ones are being written. The price is memory: every unit updated
    while the save is in flight keeps its old state alive until the write finishes (measured in
    docs/benchmarks.md). A synchronous manager copies nothing and keeps nothing extra.

    With the disk tier (engine.disk_tier), the state is the tier's files mapped read-only, which
    the next step rewrites: the save is then synchronous whatever the manager, and Orbax reads the
    files as it writes (file-backed pages, never the whole state in anonymous RAM).
    """
    state = engine.state()  # waits for pending host updates: the state is exactly as of `step`
    bad = first_non_finite(state)
    if bad is not None:
        raise SaveError(f"refusing to save checkpoint step {step}: {bad} is not finite (NaN or "
                        f"inf); the checkpoints in {manager.directory} are kept as they were")
    wait(manager)  # an earlier asynchronous save's failure is reported as such
    layout = {}  # replicated: meta as the caller gave it
    if getattr(engine, "shards", None) is not None:  # every process saves its rows
        state = jax.tree.map(functools.partial(_as_global, _host_mesh(engine)), state)
        logical = _shapes(engine.state_shapes())
        padded = {p: _saved_shape(s, engine.shards.size) for p, s in logical.items()}
        layout = {"host_shards": jax.process_count(), "shard_devices": engine.shards.size,
                  # the leaves whose rows were padded, and their own rows (cut_padding)
                  "logical_rows": {p: s[0][0] for p, s in logical.items() if padded[p] != s}}
    elif jax.process_count() > 1:  # Orbax saves no process-local jax.Array there: their views
        state = jax.tree.map(np.asarray, state)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave({**(meta or {}), **layout, "step": step}))
    try:  # force: the caller decides when to save, not Orbax's interval policy
        manager.save(step, force=True, args=args)
        if getattr(engine, "disk_tier", None) is not None:
            manager.wait_until_finished()
    except Exception as e:
        raise SaveError(f"saving checkpoint step {step} to {manager.directory} failed "
                        f"({error_line(e)}); {completed(manager)}") from None
    _in_flight[manager] = step


def _host_mesh(engine) -> Mesh:
    """The sharded layout's mesh over every process's host device (axis "proc"), in process
    order: process p's part of a leaf is the p-th block of its padded rows (engine/shard.py
    puts process p's devices after process p - 1's in the mesh)."""
    me, processes = jax.process_index(), jax.process_count()
    if processes == 1:
        return Mesh(np.array([engine.host_device]), ("proc",))
    hosts = [min((d for d in jax.devices("cpu") if d.process_index == p), key=lambda d: d.id)
             for p in range(processes)]
    if engine.host_device != hosts[me] or engine.shards.first != me * engine.shards.local:
        raise CheckpointError(f"process {me}: a sharded checkpoint needs the host state on the "
                              f"process's first CPU device and its devices in process order")
    return Mesh(np.array(hosts), ("proc",))


def _global_like(x, mesh: Mesh):
    """(global shape, sharding) of a local shard leaf x: its rows one block of the whole (0-d
    leaves, optax counts, are the same everywhere: replicated)."""
    if np.ndim(x) == 0:
        return (), NamedSharding(mesh, PartitionSpec())
    shape = (x.shape[0] * mesh.size,) + tuple(x.shape[1:])
    return shape, NamedSharding(mesh, PartitionSpec("proc"))


def _saved_shape(logical, multiple: int):
    """(shape, dtype) as a save by `multiple` devices wrote it: axis 0 zero-padded to a multiple
    of them (None: absent)."""
    if logical is None or not logical[0]:
        return logical
    shape, dtype = logical
    return (math.ceil(shape[0] / multiple) * multiple,) + shape[1:], dtype


def _as_global(mesh: Mesh, x):
    """This process's host array x as its block of a global array (no copy)."""
    shape, sharding = _global_like(x, mesh)
    return jax.make_array_from_single_device_arrays(shape, sharding, [x])


def check_writable(directory, what: str = "", error=CheckpointError):
    """Raises `error` (CheckpointError) if no file can be created in `directory` (tried for real:
    a permission check alone is wrong for root and for read-only mounts); its line begins with
    `what` (default: "checkpoint directory DIRECTORY")."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise error(f"{what or f'checkpoint directory {directory}'} is not writable "
                    f"({e.strerror or e})") from None


def _shapes(tree) -> dict:
    return {path_str(p): (tuple(x.shape), np.dtype(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _moments_recast(path: str, saved, current) -> bool:
    """Whether optimizer state `path` differs from the engine's only in its float dtype, float32
    against bfloat16 (a resume that changed optimizer.state_dtype, which the train command refuses
    unless checkpoint.allow_changes names it): restored, it is cast to the engine's dtype."""
    moments = {np.dtype(np.float32), np.dtype(jnp.bfloat16)}
    return ("/opt_state/" in f"/{path}/" and saved is not None and current is not None
            and saved[0] == current[0] and {saved[1], current[1]} == moments)


def _first_difference(saved: dict, current: dict, prefix: str = ""):
    """The first key (dotted) whose value differs between two nested dicts, with both values."""
    for key in list(current) + [k for k in saved if k not in current]:
        a, b = saved.get(key, "<missing>"), current.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            found = _first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def unreadable(manager, step: int, e: Exception | str, *,
               older: str = "move it out of {directory} and run again to resume from step {step}"
               ) -> CheckpointError:
    """The CheckpointError for a damaged checkpoint `step`: the cause in one line, and what to do
    with the newest older step (`older`, formatted with its step and the directory)."""
    steps = [s for s in manager.all_steps() if s < step]
    hint = (older.format(step=steps[-1], directory=manager.directory) +
            f" (complete steps before it: {', '.join(map(str, steps))})" if steps else
            "no older checkpoint")
    return CheckpointError(f"checkpoint step {step} in {manager.directory} is unreadable or "
                           f"damaged ({e if isinstance(e, str) else error_line(e)}); {hint}")


def resolve_step(manager: ocp.CheckpointManager, step: int | None = None) -> int | None:
    """`step` if it is a complete checkpoint, the latest one when step is None (None if none)."""
    manager.reload()  # the directory may have changed since the manager was made
    steps = manager.all_steps()
    if step is None:
        return max(steps) if steps else None
    if step not in steps:
        raise CheckpointError(f"no checkpoint at step {step} in {manager.directory} (complete "
                              f"steps: {', '.join(map(str, steps)) or 'none'})")
    return step


def read_meta(manager: ocp.CheckpointManager, step: int, **hint) -> tuple:
    """(meta, metadata of the saved state tree) of checkpoint `step`; reads no array. A damaged
    one raises `unreadable(manager, step, ..., **hint)`."""
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        tree = manager.item_metadata(step)["state"]
    except Exception as e:  # orbax/tensorstore raise many types for a damaged directory
        raise unreadable(manager, step, e, **hint) from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise unreadable(manager, step, "its meta item is missing or not a checkpoint's", **hint)
    if tree is None or not jax.tree.leaves(tree):  # e.g. state/_METADATA deleted
        raise unreadable(manager, step, "the metadata of its saved state is missing", **hint)
    return meta, tree


def restore(manager: ocp.CheckpointManager, engine, step: int | None = None,
            model_config: dict | None = None, config_key: str = "config.model") -> dict:
    """Loads checkpoint `step` (default: the latest complete one) into the engine; returns its meta.

    Every array is read straight into the engine's host memory (abstract targets carrying the host
    sharding): nothing is materialised on the accelerator. Before anything is loaded, the saved
    shapes are compared with the engine's and, if `model_config` is given, with the saved meta at
    `config_key` (dotted): the first difference raises CheckpointError and the engine is untouched.
    """
    step = resolve_step(manager, step)
    if step is None:
        raise CheckpointError(f"no complete checkpoint in {manager.directory}")
    meta, tree_metadata = read_meta(manager, step)
    saved_shapes = _shapes(tree_metadata)

    where = f"checkpoint step {step} in {manager.directory}"
    if model_config is not None:
        saved = meta
        for key in config_key.split("."):
            saved = saved.get(key, {}) if isinstance(saved, dict) else {}
        diff = _first_difference(saved, json.loads(json.dumps(model_config)), config_key + ".")
        if diff:
            raise CheckpointError(f"{where} does not match this config: {diff[0]} is {diff[1]!r} "
                                  f"in the checkpoint, {diff[2]!r} now")
    current = engine.state()
    sharded = getattr(engine, "shards", None) is not None
    # Compared as logical shapes: a sharded save padded axis 0 to a multiple of its devices.
    current_shapes = _shapes(engine.state_shapes() if sharded else current)
    padded = functools.partial(_saved_shape, multiple=meta.get("shard_devices", 1))
    # The disk tier's state is mapped numpy: it is restored into host arrays, then its files.
    sharding = lambda x: getattr(x, "sharding", None) or engine.host_sharding
    paths = list(current_shapes) + [p for p in saved_shapes if p not in current_shapes]
    paths.sort(key=lambda p: "/opt_state/" in p)  # name a parameter before its optimizer state
    for path in paths:
        a, b = saved_shapes.get(path), current_shapes.get(path)
        if _moments_recast(path, a, padded(b)):
            continue  # optimizer.state_dtype changed, as the resume allowed: read and cast
        if a != padded(b):
            show = lambda s: "absent" if s is None else f"shape {s[0]} {s[1]}"
            raise CheckpointError(f"{where} does not match this model: {path} has "
                                  f"{show(a)} in the checkpoint, {show(b)} in the model")

    # One unit at a time, each straight into host memory (the targets carry the engine's host
    # sharding): the restore needs one unit's state on top of the engine's, not a second model.
    skip = lambda tree: jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)
    units = [("stages", current["stages"])] + list(enumerate(current["layers"]))
    mesh = _host_mesh(engine) if sharded else None
    for which, unit in units:
        target = {"stages": skip(current["stages"]),
                  "layers": [skip(layer) for layer in current["layers"]]}
        if sharded:  # each process reads its rows of the engine's padded shape
            like = lambda x: _global_like(x, mesh)
        else:
            like = lambda x: (x.shape, sharding(x))
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(like(x)[0], x.dtype, sharding=like(x)[1]), unit)
        if which == "stages":
            target["stages"] = abstract
        else:
            target["layers"][which] = abstract
        restore_args = jax.tree.map(
            lambda x: ocp.PLACEHOLDER if x is ocp.PLACEHOLDER else _restore_args(x), target)
        loaded = _read_unit(manager, step, which, target, restore_args)
        # This process's block (sharded), or the saved rows cut to the model's (replicated, read
        # as numpy with several processes: a sharded save's padding rows are cut off here).
        mine = lambda r, x: (r.addressable_data(0) if sharded else
                             r[:x.shape[0]] if np.ndim(x) and r.shape != x.shape else r)
        engine.load_unit(which, jax.tree.map(mine, loaded, unit))
    return meta


def _read_unit(manager: ocp.CheckpointManager, step: int, which, target, restore_args):
    """Unit `which` ("stages" or a layer index) of checkpoint `step`, read into `target` (the
    state's tree, ocp.PLACEHOLDER where nothing is read); a failure is named as `unreadable`."""
    try:
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args)))["state"]
    except Exception as e:
        raise unreadable(manager, step, e) from None
    return state["stages"] if which == "stages" else state["layers"][which]


def _restore_args(x):
    """Straight into the host device's memory, rows zero-padded or cut to the target's (a sharded
    save's padding; strict=False); with several processes and a replicated state (where Orbax
    restores no process-local jax.Array) as numpy, which load_unit puts there."""
    if jax.process_count() > 1 and not isinstance(x.sharding, NamedSharding):
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype)
    return ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype,
                                strict=False)


def largest_unit_bytes(engine) -> int:
    """Bytes of the largest unit's state (params + optax state): a `write_bytes` of one layer."""
    state = engine.state()
    return max(sum(x.nbytes for x in jax.tree.leaves(unit))
               for unit in [state["stages"], *state["layers"]])


def cut_padding(meta: dict, path: str, x):
    """Leaf `path` (path_str's spelling) read as saved, with a sharded save's zero padding rows
    cut off: its logical rows."""
    rows = meta.get("logical_rows", {}).get(path)
    return x if rows is None else x[:rows]


def read_params(manager: ocp.CheckpointManager, step: int, tree_metadata, which,
                meta: dict | None = None) -> dict:
    """The parameters of one unit ("stages" or a layer index) of checkpoint `step` as numpy
    arrays, read alone: the optimizer state and the other units are never read (to sample from a
    run, or export it, a unit at a time). `tree_metadata` and `meta` are read_meta's (meta: to
    cut a sharded save's padding rows off)."""
    tree = getattr(tree_metadata, "tree", tree_metadata)  # a TreeMetadata wraps the plain tree
    prefix = "stages/params/" if which == "stages" else f"layers/{which}/params/"
    target = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        if path_str(p).startswith(prefix) else ocp.PLACEHOLDER, tree)
    restore_args = jax.tree.map(lambda leaf: ocp.PLACEHOLDER if leaf is ocp.PLACEHOLDER
                                else ocp.RestoreArgs(restore_type=np.ndarray), target)
    unit = _read_unit(manager, step, which, target, restore_args)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: cut_padding(meta or {}, prefix + path_str(p), x), unit["params"])
