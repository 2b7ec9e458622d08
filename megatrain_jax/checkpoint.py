"""Save and restore a StreamedEngine's training state with Orbax, straight from and into host RAM.

A checkpoint is one step of an `ocp.CheckpointManager` with two items:

    state   engine.state(): {"stages": {"params", "opt_state"}, "layers": [{...}, ...]}, fp32, host
    meta    JSON: {"step": int, ...} plus whatever the caller adds (the training loop adds the
            resolved config, the data position and the RNG seed)

Orbax writes each step into a temporary directory and renames it when complete, so a process killed
mid-save leaves no step that `all_steps()` / `latest_step()` report. Used from your own project:

    manager = checkpoint.make_manager("/ckpt", keep=3)
    checkpoint.save(manager, step, engine, {"my_key": 1})   # asynchronous by default
    meta = checkpoint.restore(manager, engine)              # latest step; meta["step"]
    manager.close()                                         # waits for a save in flight
"""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model."""


def make_manager(directory, *, keep: int | None = None, async_save: bool = True,
                 write_bytes: int | None = None) -> ocp.CheckpointManager:
    """A CheckpointManager with the two items of this layout, keeping the `keep` latest steps.

    async_save=False makes every `save` block until the checkpoint is committed (see `save`).
    write_bytes bounds the bytes Orbax writes at once (default: everything at once); it must exceed
    the largest array. Tensorstore copies what it writes, so this bounds a save's extra memory.
    """
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           create=True)
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
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 handler_registry=registry)


def save(manager: ocp.CheckpointManager, step: int, engine, meta: dict | None = None):
    """Writes the engine's state as checkpoint `step`; `meta` must be JSON-able.

    With an asynchronous manager this returns once Orbax holds the state and the files are written
    in the background while training goes on. The checkpoint is still the state as of `step`: on the
    CPU backend Orbax takes zero-copy numpy views of the host arrays, and XLA will not donate (reuse
    in place) a buffer that a view still references, so the next steps' optimizer updates write
    fresh buffers while the old ones are being written. The price is memory: every unit updated
    while the save is in flight keeps its old state alive until the write finishes (measured in
    docs/benchmarks.md). A synchronous manager copies nothing and keeps nothing extra.
    """
    state = engine.state()  # waits for pending host updates: the state is exactly as of `step`
    manager.save(step, force=True,  # the caller decides when to save, not Orbax's interval policy
                 args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         meta=ocp.args.JsonSave({**(meta or {}), "step": step})))


def path_str(path) -> str:
    """Orbax's metadata spells namedtuple fields as dict keys; name both alike: a/b/0/mu/wq."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _shapes(tree) -> dict:
    return {path_str(p): (tuple(x.shape), np.dtype(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


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


def _unreadable(manager, step: int, e: Exception) -> CheckpointError:
    older = [s for s in manager.all_steps() if s < step]
    hint = (f"resume from an older one with checkpoint.resume_step={older[-1]} (complete steps: "
            f"{', '.join(map(str, older))})" if older else "no older checkpoint to resume from")
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return CheckpointError(f"checkpoint step {step} in {manager.directory} is unreadable "
                           f"({type(e).__name__}: {first_line}); {hint}")


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


def read_meta(manager: ocp.CheckpointManager, step: int) -> tuple:
    """(meta, metadata of the saved state tree) of checkpoint `step`; reads no array."""
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return meta, manager.item_metadata(step)["state"]
    except Exception as e:  # orbax/tensorstore raise many types for a damaged directory
        raise _unreadable(manager, step, e) from None


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
    current_shapes = _shapes(current)
    paths = list(current_shapes) + [p for p in saved_shapes if p not in current_shapes]
    paths.sort(key=lambda p: "/opt_state/" in p)  # name a parameter before its optimizer state
    for path in paths:
        a, b = saved_shapes.get(path), current_shapes.get(path)
        if a != b:
            show = lambda s: "absent" if s is None else f"shape {s[0]} {s[1]}"
            raise CheckpointError(f"{where} does not match this model: {path} has "
                                  f"{show(a)} in the checkpoint, {show(b)} in the model")

    # One unit at a time, each straight into host memory (the targets carry the engine's host
    # sharding): the restore needs one unit's state on top of the engine's, not a second model.
    skip = lambda tree: jax.tree.map(lambda _: ocp.PLACEHOLDER, tree)
    units = [("stages", current["stages"])] + list(enumerate(current["layers"]))
    for which, unit in units:
        target = {"stages": skip(current["stages"]),
                  "layers": [skip(layer) for layer in current["layers"]]}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                unit)
        if which == "stages":
            target["stages"] = abstract
        else:
            target["layers"][which] = abstract
        restore_args = jax.tree.map(
            lambda x: ocp.PLACEHOLDER if x is ocp.PLACEHOLDER else ocp.ArrayRestoreArgs(
                sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), target)
        try:
            state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args)))["state"]
        except Exception as e:
            raise _unreadable(manager, step, e) from None
        engine.load_unit(which, state["stages"] if which == "stages" else state["layers"][which])
    return meta


def largest_unit_bytes(engine) -> int:
    """Bytes of the largest unit's state (params + optax state): a `write_bytes` of one layer."""
    state = engine.state()
    return max(sum(x.nbytes for x in jax.tree.leaves(unit))
               for unit in [state["stages"], *state["layers"]])
