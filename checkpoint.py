"""The run directory and the sharded train state: config.json, metrics.jsonl, orbax checkpoints.

    target = abstract_state(model_cfg, tx, mesh)           # shapes + shardings, nothing allocated
    mngr, state = resume(run_dir, target, keep=3)           # the latest checkpoint, or None
    state = state or fresh_state(model_cfg, seed, tx, target)
    save_checkpoint(mngr, step, state, config)              # async; config is a plain dict

A run directory holds one run:

    config.json      the full config, written once the config, data and directory are checked
    metrics.jsonl    one JSON object per step (strict JSON: a non-finite number is written null)
    checkpoints/N/   orbax: the train state after N steps, plus JSON metadata
    superseded-*/    checkpoints that --resume-step moved out of the way (never deleted)
    lock             the PID of the process writing the run (an OS lock: one writer at a time)

The train state is {"step", "params", "opt_state"}. Every leaf's sharding comes from the
parameter table in model.py: a parameter, and any optimizer leaf that mirrors one (Adam's moments),
takes the parameter's spec; everything else is replicated.
"""

import contextlib
import fcntl
import json
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax import P
from jax.experimental import multihost_utils

import compat
from cli import UserError, written_whole
from hyperball import HyperballState, matrix_norm
from model import ModelConfig, init_params, logical_to_spec, param_table

# ---------------------------------------------------------------------------------------------
# The sharded train state

def init_state(cfg: ModelConfig, seed: int, tx) -> dict:
    params = init_params(cfg, jax.random.key(seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_specs(cfg: ModelConfig, abstract) -> dict:
    """Every state leaf's PartitionSpec, from the parameter table: a param, and any optimizer
    leaf that mirrors one (Adam's mu and nu end in the param's path and shape), takes the
    param's spec; everything else (counts, histories, scalars) is replicated."""
    table = {tuple(k.split("/")): s for k, s in param_table(cfg).items()}

    def spec(path, leaf):
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        for i in range(len(names)):
            s = table.get(names[i:])
            if s is not None and s.shape == leaf.shape:
                return logical_to_spec(s.axes)
        return P()
    return jax.tree_util.tree_map_with_path(spec, abstract)


def abstract_state(cfg: ModelConfig, tx, mesh) -> dict:
    """ShapeDtypeStructs carrying the target shardings: the orbax restore target, and the
    out_shardings of init. Allocates nothing."""
    shapes = jax.eval_shape(lambda: init_state(cfg, 0, tx))
    specs = state_specs(cfg, shapes)
    return jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                          sharding=jax.NamedSharding(mesh, p)),
                        shapes, specs)


def fresh_state(cfg: ModelConfig, seed: int, tx, target) -> dict:
    """A new train state, created directly in the shardings `target` (abstract_state) carries."""
    shardings = jax.tree.map(lambda s: s.sharding, target)
    return jax.jit(lambda: init_state(cfg, seed, tx), out_shardings=shardings)()


def carry(source_state, target, init_new) -> tuple[dict, list, list, list]:
    """Fill the target state by key path: every leaf present in both is the source's, leaves
    only the target has take their fresh values from `init_new(keys)`. `target` is the
    target's abstract state (shapes, dtypes, shardings). Returns (state, carried, new,
    dropped), the last three as (path, shape) lists. A carried leaf whose shape or dtype
    differs is a UserError."""
    key = jax.tree_util.keystr
    src = {key(p): x for p, x in jax.tree_util.tree_leaves_with_path(source_state)}
    want = {key(p): x for p, x in jax.tree_util.tree_leaves_with_path(target)}
    for k, old in src.items():
        if k in want and (old.shape != want[k].shape or old.dtype != want[k].dtype):
            raise UserError(f"leaf {k} is {old.dtype}{list(old.shape)} in the source but "
                            f"{want[k].dtype}{list(want[k].shape)} in the target: only added "
                            "leaves can change; keep the shapes of the source config")
    fresh = init_new([k for k in want if k not in src])

    def fill(path, t):
        if key(path) in fresh:
            return fresh[key(path)]
        old = src[key(path)]
        return jax.reshard(old, t.sharding) if old.sharding != t.sharding else old

    state = jax.tree_util.tree_map_with_path(fill, target)
    carried = [(k, x.shape) for k, x in want.items() if k in src]
    new = [(k, x.shape) for k, x in want.items() if k not in src]
    dropped = [(k, x.shape) for k, x in src.items() if k not in want]
    return state, carried, new, dropped


def init_new_leaves(cfg, tx, target, carried_params=None):
    """`keys -> {key: fresh value}` for some leaves of a new train state, computed alone (XLA
    drops the rest of the init) and placed in the shardings `target` carries. New optimizer
    leaves are initialised on `carried_params` where given (the parameters the state goes on
    with): Adam's moments are zeros either way, a Hyperball radius is the norm at the switch
    (with --optim.hyperball-radius init, at init: onto_radius then moves the matrix there)."""
    def init_new(keys):
        if not keys:
            return {}
        shardings = {jax.tree_util.keystr(p): x.sharding
                     for p, x in jax.tree_util.tree_leaves_with_path(target)}

        def init(carried):
            state = init_state(cfg.model, cfg.seed, tx)
            if carried is not None and cfg.optim.hyperball_radius == "switch":
                kept = {jax.tree_util.keystr(p): x
                        for p, x in jax.tree_util.tree_leaves_with_path(carried)}
                params = jax.tree_util.tree_map_with_path(
                    lambda p, x: kept.get(jax.tree_util.keystr(p), x), state["params"])
                state["opt_state"] = tx.init(params)
            leaves = jax.tree_util.tree_leaves_with_path(state)
            return {k: x for p, x in leaves if (k := jax.tree_util.keystr(p)) in keys}
        return jax.jit(init, out_shardings={k: shardings[k] for k in keys})(carried_params)
    return init_new


def insert_new_leaves(cfg, tx, state: dict, mesh) -> dict:
    """The warm start's carry in process: `state` in the state of cfg, which adds parameters
    (QK-Norm's scales, the attention gate), and its optimizer `tx`: the new leaves at their
    init (the scales at 1, Marin's gate at 0) with zero moments, every other leaf kept."""
    target = abstract_state(cfg.model, tx, mesh)
    state, _, new, _ = carry(state, target, init_new_leaves(cfg, tx, target, state["params"]))
    return onto_radius(cfg, state, new)


def onto_radius(cfg, state: dict, new: list) -> dict:
    """After a switch to Hyperball (its radii among the `new` leaves) with
    --optim.hyperball-radius init: each matrix on a sphere rescaled onto its radius, its norm at
    init (per stacked layer); otherwise the state as it is."""
    if cfg.optim.hyperball_radius != "init" or not any(".radius" in k for k, _ in new):
        return state
    (hyper,) = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(
        x, HyperballState)) if isinstance(s, HyperballState)]

    def onto(w, r):
        def per_layer(x):
            return x.reshape(x.shape + (1,) * (w.ndim - x.ndim))
        return jnp.where(per_layer(r) > 0, w * (per_layer(r) / per_layer(matrix_norm(w))), w)
    return {**state, "params": jax.tree.map(onto, state["params"], hyper.radius)}


def per_device_bytes(cfg: ModelConfig, tx, mesh_sizes: dict[str, int]) -> tuple[int, int]:
    """(total, per-device) bytes of params + optimizer state on a mesh of `mesh_sizes`
    ({"data": 256, "model": 4}), by arithmetic on the shapes and specs: needs neither the
    devices nor the memory."""
    shapes = jax.eval_shape(lambda: init_state(cfg, 0, tx))
    total = per_device = 0
    for s, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(state_specs(cfg, shapes))):
        total += math.prod(s.shape) * s.dtype.itemsize
        shard = [dim // (mesh_sizes[a] if a else 1) for dim, a in
                 zip(s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec)))]
        per_device += math.prod(shard) * s.dtype.itemsize
    return total, per_device


# ---------------------------------------------------------------------------------------------
# config.json and metrics.jsonl

def read_config(run_dir: pathlib.Path) -> dict | None:
    """The stored config of a run directory as a dict; None if it holds no config.json."""
    path = run_dir / "config.json"
    if not path.exists():
        if run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"{run_dir} exists and is not a directory")
        return None
    try:
        stored = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable: not a spikefix config ({e})") from None
    if not isinstance(stored, dict):
        raise UserError(f"{path} is not a spikefix config (a JSON object of settings)")
    return stored


# config.json's identity record: the text the run trains on ("corpus", TokenData.corpus), and
# this key, which says the file carries it (a run written before the record has neither).
IDENTITY = {"identity": 1}


def write_config(run_dir: pathlib.Path, config: dict, corpus: dict | None = None) -> None:
    """config.json, written whole (a temporary file renamed into place); with `corpus`, the
    run's identity record too."""
    config = config | ({"corpus": corpus} | IDENTITY if corpus is not None else {})
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to --run-dir {run_dir}: {e.strerror}; "
                        "choose a writable directory") from None
    with written_whole(run_dir / "config.json", f"cannot write to --run-dir {run_dir}: choose "
                       "a writable directory") as tmp:
        tmp.write_text(json.dumps(config, indent=2))


def check_corpus(run_dir: pathlib.Path, corpus: dict, what: str = "this resume") -> None:
    """A UserError where the run in run_dir was trained on other text than `corpus`
    (TokenData.corpus, as config.json records it), naming both and the way on. A run written
    before the record is trusted, and said so; one that has lost it is refused."""
    config = read_config(run_dir) or {}
    stored = config.get("corpus")
    if not isinstance(stored, dict) and IDENTITY.items() <= config.items():
        raise UserError(f"{run_dir}/config.json has lost its record of the text the run trained "
                        "on (its \"corpus\"); was it edited? Restore it")
    if not isinstance(stored, dict):
        print(f"note: {run_dir} was written before runs recorded their text: {what} reads "
              f"{corpus['source']} unchecked", flush=True)
        return
    if stored.get("sha256") == corpus["sha256"]:
        return
    way = ("set SPIKEFIX_STDLIB to a copy of the standard library it was trained on"
           if stored.get("source", "").startswith("the embedded corpus") else
           f"restore {stored.get('source')} as it was, or train a new run on the new data")
    tokens = stored.get("tokens")
    raise UserError(f"{run_dir} was trained on {stored.get('source')} ("
                    f"{f'{tokens:,}' if isinstance(tokens, int) else '?'} "
                    f"tokens, sha256 {stored.get('sha256')}); {what} would read "
                    f"{corpus['source']} ({corpus['tokens']:,} tokens, sha256 "
                    f"{corpus['sha256']}): other text. {way[0].upper() + way[1:]}")


# ---------------------------------------------------------------------------------------------
# Orbax checkpoints

class Manager(ocp.CheckpointManager):
    """orbax's manager, except that it never asks JAX's preemption sync point itself. The
    sync point's protocol needs each process to pass it steps in increasing order (it agrees
    on max(last step passed) + 1, and a process that already passed that step never stops);
    orbax asks it at every save for the saved step and again, later, from its finalize thread,
    which moves a process's last step back and can leave one process stopping at a step the
    other has passed (a 2-process run that hangs). train.py asks it once per step, in order."""

    def reached_preemption(self, step: int) -> bool:
        return False


def checkpoint_manager(run_dir: pathlib.Path, keep: int = 3, read_only: bool = False
                       ) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(  # (read-only: what orbax would set, and warn of)
        preservation_policy=ocp.checkpoint_managers.LatestN(None if read_only else keep),
        save_interval_steps=0 if read_only else 1, enable_async_checkpointing=True,
        create=not read_only, read_only=read_only)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
        registry.add("state", args, ocp.StandardCheckpointHandler())
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("meta", args, ocp.JsonCheckpointHandler())
    return Manager(run_dir.absolute() / "checkpoints", options=options,
                   handler_registry=registry)


def saved_steps(run_dir: pathlib.Path) -> list[int]:
    """The steps of the complete checkpoints in a run directory, oldest first."""
    if not (run_dir / "checkpoints").is_dir():
        return []
    return sorted(checkpoint_manager(run_dir, read_only=True).all_steps())


def save_checkpoint(mngr, step: int, state, config: dict) -> None:
    meta = {"step": step, "config": config, "time": time.time()}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)), force=True)


def restore_checkpoint(mngr, step: int, target) -> dict:
    """The train state saved at `step`, restored straight into the shardings `target` carries
    (whatever mesh wrote it). A checkpoint in an earlier layout of the state is mapped onto
    today's leaf by leaf (compat.py)."""
    def restore(item):
        return mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(item)))["state"]
    stored = mngr.item_metadata(step)["state"]
    want = {names(p): t for p, t in jax.tree_util.tree_leaves_with_path(target)}
    stored_names = [names(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored)]
    if set(stored_names) == set(want):
        return restore(target)
    have = {} if compat.is_layout_3(stored_names) else {
        n: compat.current_leaf(n, set(want)) for n in stored_names}
    mapped = {n for n in have.values() if n is not None}
    missing = {n for n in set(want) - mapped if not compat.starts_at_zero(n)}
    if not have or mapped - set(want) or missing:
        raise OtherModel(sorted(set(stored_names) - set(want)))
    replicated = jax.NamedSharding(next(iter(want.values())).sharding.mesh, P())
    item = jax.tree_util.tree_map_with_path(  # the stored layout, in the target's shardings
        lambda p, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=want[have[names(p)]].sharding
                                          if have[names(p)] else replicated), stored)
    by_name = {have[names(p)]: x for p, x in jax.tree_util.tree_leaves_with_path(restore(item))}
    return jax.tree_util.tree_map_with_path(  # a leaf added since starts at zero
        lambda p, t: by_name[names(p)] if names(p) in by_name else
        jnp.zeros(t.shape, t.dtype, device=t.sharding), target)


class OtherModel(ValueError):
    """A checkpoint whose leaves are not the train state's: it holds another model."""

    def __init__(self, extra: list):
        self.extra = extra
        super().__init__(f"the checkpoint has leaves the train state lacks: {extra[:3]}")


def unreadable(run_dir: pathlib.Path, step: int, error: Exception, hint: str) -> UserError:
    """The one line for a checkpoint that cannot be restored as the config says. A checkpoint
    with QK-Norm scales the config lacks is a guarded run whose record is gone."""
    where = f"checkpoint at step {step} in {run_dir}"
    if isinstance(error, OtherModel) and any("q_norm" in n for n in error.extra):
        return UserError(f"{where} holds QK-Norm scales its config.json lacks: the guard "
                         f"inserted them, and its record {run_dir}/events.jsonl is missing or "
                         "emptied; restore that file (or use --resume-step from before the "
                         "escalation)")
    return UserError(f"{where} is unreadable ({type(error).__name__}): {hint}")


def names(path) -> tuple[str, ...]:
    """A key path as plain names: ("opt_state", "0", "inner_state", "1", "mu", "embed")."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_run_dir(run_dir: pathlib.Path, resume_step: int | None = None) -> None:
    """Raise UserError, before anything is written, if run_dir cannot hold a run's checkpoints
    or has no checkpoint at `resume_step`."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir} exists and is not a directory: use another --run-dir")
    if (run_dir / "checkpoints").exists() and not (run_dir / "checkpoints").is_dir():
        raise UserError(f"{run_dir}/checkpoints exists and is not a directory: move it away, "
                        "or use another --run-dir")
    for name in ("metrics.jsonl", "config.json"):
        if (run_dir / name).exists() and not (run_dir / name).is_file():
            raise UserError(f"{run_dir}/{name} exists and is not a file: move it away, or use "
                            "another --run-dir")
    if run_dir.is_dir() and not (run_dir / "config.json").exists():
        theirs = sorted(p.name for p in run_dir.iterdir() if p.name != "lock")
        if theirs:  # a folder of someone's files: its `lock` or metrics.jsonl is not ours
            raise UserError(f"--run-dir {run_dir} holds {theirs[0]!r} and no config.json: it is "
                            "not a train.py run; choose a new or empty directory")
    if resume_step is not None and resume_step not in (steps := saved_steps(run_dir)):
        raise UserError(f"no checkpoint at step {resume_step} in {run_dir}; "
                        f"saved steps: {steps or 'none'}")


@contextlib.contextmanager
def run_lock(run_dir: pathlib.Path, announce=print):
    """Hold run_dir/lock while the block runs: one writer per run directory. An OS lock (flock)
    that the OS releases when its process ends, however it ends, so a lock file left by a dead
    process is never in the way (it is announced and taken over). A UserError names the
    holder's PID. Creates run_dir; the file is left empty on a clean exit."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        f = open(run_dir / "lock", "a+")
    except OSError as e:
        raise UserError(f"cannot write to --run-dir {run_dir}: {e.strerror}; "
                        "choose a writable directory") from None
    with f:
        f.seek(0)
        holder = f.read().strip()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{run_dir} is in use by another process (PID {holder or '?'}): "
                            "wait for it to end, or use another --run-dir") from None
        if holder and holder != str(os.getpid()):
            announce(f"process {holder} ended without releasing {run_dir}/lock; taking it over")
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:  # an empty lock file: the last writer ended cleanly
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def resume(run_dir: pathlib.Path, target, keep: int, resume_step: int | None = None,
           announce=print) -> tuple[ocp.CheckpointManager | None, dict | None]:
    """(manager, state) restored from the latest checkpoint of run_dir, or from `resume_step`;
    (None, None) if there is none. Going back with `resume_step` moves the later checkpoints
    aside to superseded-TIME/, never deleting them (process 0 does it; the others wait). A
    damaged checkpoint is a UserError naming an older one to fall back to: the run never
    starts fresh over it."""
    check_run_dir(run_dir, resume_step)
    steps = saved_steps(run_dir)
    if not steps:
        return None, None
    start = resume_step if resume_step is not None else steps[-1]
    mngr = checkpoint_manager(run_dir, keep)
    try:
        state = restore_checkpoint(mngr, start, target)
    except Exception as e:  # a damaged checkpoint: name it, never start fresh over it
        older = [s for s in steps if s < start]
        hint = (f"resume from an older one with --resume-step {older[-1]}" if older
                else "no older checkpoint exists")
        raise unreadable(run_dir, start, e, hint) from None
    announce(f"resumed {run_dir} at step {start}")
    later = [s for s in steps if s > start]
    if later:  # --resume-step went back: keep the later checkpoints, out of the way
        if jax.process_index() == 0:
            aside = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir()
            for s in later:
                (run_dir / "checkpoints" / str(s)).rename(aside / str(s))
            announce(f"moved the later checkpoints {later} aside to {aside}")
        if jax.process_count() > 1:  # the others read the directory only once it is done
            multihost_utils.sync_global_devices("spikefix: later checkpoints moved aside")
        mngr = checkpoint_manager(run_dir, keep)
    return mngr, state


