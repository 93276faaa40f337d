"""The seeds harness: train.py's own step vmapped over seeds and scanned over steps, forks from
kept states, guarded rows run as train.py runs; what each records goes through lab/store.py.

    python -m lab.experiments ROW [ROW ...]   # train harness rows (lab/rows.py), record each

A *group* is train.py's own step (`train.build_train_step`, the LR inside the optimizer chain)
vmapped over *members* (seeds; one compiled step per LR of the group) and stepped `chunk`
steps at a time inside one `lax.scan`: one dispatch and one host read per chunk instead of per
step. Each member is the train.py run of its LR and seed (init and data order both drawn from
the seed), to float32 rounding: a test runs one beside train.py for 120 steps. Every member's
per-step curves are kept in results/curves/GROUP/seedN.npz (what is kept: store.curve_arrays),
its outcome (report.py's fixed rules) in results/search.json.
"""

import dataclasses
import functools
import hashlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import train as T
from checkpoint import init_state, insert_new_leaves
from cli import UserError, written_whole
from config import TrainConfig, load_checkpointed, make_tx
from data import TokenData, embedded_corpus
from distributed import MeshConfig, make_mesh
from export import restore_params
from lab import store
from lab.probe import PROBE_KEYS, probe
from lab.rows import REGISTRY, Group
from lab.store import (
    curve_arrays,
    load,
    machine,
    read_curve,
    read_npz,
    record_checksums,
    save_group,
)
from records import acted, read_metrics
from report import find_shifts, find_spikes


def member_grid(g: Group) -> list[tuple[float, int]]:
    return [(lr, seed) for lr in g.lrs for seed in g.seeds]


def machine_record() -> dict:
    """store.machine() and the device the harness trains on: its kind ("cpu", "NVIDIA H200")
    and JAX's default matmul precision (None: the platform's own, which on a GPU may be TF32
    for float32); and the data's sha256 (its first 16 digits). NOTE: every row trains on the
    embedded corpus, this Python's standard library: another Python version is other text
    (3.12.1's is 11.6 MB, 3.11.7's 12.1 MB)."""
    return machine() | {"device": jax.devices()[0].device_kind,
                        "matmul_precision": jax.config.jax_default_matmul_precision,
                        "corpus_sha256": hashlib.sha256(embedded_corpus()).hexdigest()[:16]}


def one_device_mesh():
    """The harness runs on one device: every member's state is whole there."""
    return make_mesh(MeshConfig(1, 1), jax.devices()[:1])


def train_members(cfg: TrainConfig, seeds, chunk: int = 50, eval_every: int = 250,
                  log=print, state=None, snapshot_at=(), snapshot=None,
                  progress: pathlib.Path | None = None) -> dict:
    """Train one member per seed (init seed and data seed both = the seed) with train.py's step
    (`build_train_step`), vmapped over the members and scanned `chunk` steps at a time: one
    dispatch and one host read per chunk. `state`: a stacked train state to go on from (a fork);
    `snapshot(step, state)` is called after each step in `snapshot_at`. `progress`: a file where
    the state and the metrics so far are saved at each held-out evaluation and read back on the
    next call, so a killed run goes on from its last evaluation (bitwise: the chunks after it
    are the same). Returns [M, steps, ...] arrays of every metric of the step, the held-out loss
    every `eval_every` steps (with lab/probe.py's per-layer figures then) and the seconds it
    took."""
    tx = make_tx(cfg)
    step_fn = T.build_train_step(cfg, tx)
    qk_clip = cfg.optim.qk_clip > 0

    def body(state, tokens_MBT1):
        new, metrics = jax.vmap(step_fn)(state, tokens_MBT1)
        if qk_clip:  # its rescale comes back sharded by head; the scan's carry keeps its type
            new = jax.tree.map(lambda p, p0: jax.reshard(p, jax.typeof(p0).sharding.spec),
                               new, state)
        metrics.pop("lr")  # the schedule's, the same for every member
        return new, metrics

    mesh = one_device_mesh()
    seeds_M = jnp.array(seeds)
    datas = [TokenData(dataclasses.replace(cfg.data, seed=s), cfg.model.vocab_size)
             for s in seeds]
    with jax.set_mesh(mesh):
        if state is None:
            state = jax.jit(jax.vmap(lambda s: init_state(cfg.model, s, tx)))(seeds_M)
        run_chunk = jax.jit(lambda s, t: jax.lax.scan(body, s, t), donate_argnums=0)
        eval_loss = jax.vmap(T.make_eval_step(cfg), in_axes=(0, None))  # train.py's
        probes = jax.vmap(lambda p, t: probe(p, probe_inputs(t), cfg.model), in_axes=(0, None))
        eval_fn = jax.jit(lambda p, t: {"eval_loss": eval_loss(p, t)} | probes(p, t))
        held_out = jnp.asarray(datas[0].held_out_batches())
        first = int(state["step"][0])
        out, evals, chunk_s, before = {}, [], [], 0.0
        if progress is not None and progress.exists():
            state, out, evals, chunk_s, before = read_progress(progress, state)
            log(f"  step {int(state['step'][0])}: read back from {progress}")
        t0 = time.time() - before
        c0 = int(state["step"][0])
        while c0 < cfg.steps:
            t = time.time()
            n = min(chunk, cfg.steps - c0, eval_every - c0 % eval_every,
                    *[s - c0 for s in snapshot_at if s > c0])
            tokens = np.stack([np.stack([d.batch(c0 + i) for d in datas]) for i in range(n)])
            state, metrics = run_chunk(state, tokens)
            for k, v in jax.device_get(metrics).items():  # [n, M, ...]
                out.setdefault(k, []).append(v)
            chunk_s.append((n, time.time() - t))  # batches, dispatch, compute, host read
            c0 += n
            if c0 % eval_every == 0 or c0 == cfg.steps:
                evals.append((c0, jax.device_get(eval_fn(state["params"], held_out))))
                if progress is not None and c0 < cfg.steps:
                    save_state(progress, state, progress_arrays(out, evals, chunk_s,
                                                                time.time() - t0))
                log(f"  step {c0}/{cfg.steps}: train "
                    + " ".join(f"{x:.2f}" for x in out["loss"][-1][-1])
                    + f" ({time.time() - t0:.0f} s)")
            if c0 in snapshot_at and snapshot is not None:
                snapshot(c0, state)
    arrays = {k: np.concatenate(v).swapaxes(0, 1) for k, v in out.items()}  # [M, steps, ...]
    arrays["first_step"] = np.int64(first)
    arrays["eval_step"] = np.array([s for s, _ in evals])
    for k in evals[0][1]:  # eval_loss [M, evals]; the probes [M, evals, L]
        arrays[k] = np.stack([e[k] for _, e in evals], axis=1)
    arrays["seconds"] = time.time() - t0
    arrays["chunk_seconds"] = np.array(chunk_s)  # [chunks, 2]: steps, seconds (the 1st compiles)
    return arrays


def progress_arrays(out: dict, evals: list, chunk_s: list, seconds: float) -> dict:
    """train_members' metrics so far, as arrays beside the state in its progress file."""
    return {**{f"progress/metric/{k}": np.concatenate(v) for k, v in out.items()},
            "progress/eval_step": np.array([s for s, _ in evals]),
            **{f"progress/eval/{k}": np.stack([e[k] for _, e in evals]) for k in evals[0][1]},
            "progress/chunk_seconds": np.array(chunk_s), "progress/seconds": np.float64(seconds)}


def read_progress(path: pathlib.Path, like) -> tuple:
    """(state, metrics, evals, chunk seconds, seconds) from a progress file, the state placed as
    `like` is."""
    state, extra = load_state(path, like)
    if not {"progress/eval_step", "progress/eval/eval_loss", "progress/chunk_seconds",
            "progress/seconds"} <= extra.keys():
        raise UserError(f"{path} holds a state but not its metrics: remove it (the LR then "
                        "trains from its start)")
    state = jax.tree.map(lambda a, b: jax.device_put(a, b.sharding), state, like)
    out = {k.removeprefix("progress/metric/"): [v] for k, v in extra.items()
           if k.startswith("progress/metric/")}
    names = [k.removeprefix("progress/eval/") for k in extra if k.startswith("progress/eval/")]
    evals = [(s, {k: extra[f"progress/eval/{k}"][i] for k in names})
             for i, s in enumerate(extra["progress/eval_step"].tolist())]
    return (state, out, evals, [tuple(c) for c in extra["progress/chunk_seconds"]],
            float(extra["progress/seconds"]))


KEPT_KEYS = {"loss", "eval_step", "first_step", "seconds"}  # what a kept LR must hold at least


def train_group(g: Group, chunk: int = 50, eval_every: int = 250, log=print,
                keep: pathlib.Path | None = None) -> dict:
    """Train every member of `g` (one compiled step per LR, the seeds vmapped in it); returns
    per-member arrays in member_grid order. `keep`: a folder where each LR's arrays are saved as
    it finishes and read back on the next call, so a group killed after some LRs goes on from
    the next (a width of the proxy is hours)."""
    if keep is not None:
        open_keep(g, keep)
        found = sorted(p.name for p in keep.glob("lr*.npz"))
        if any(f"lr{lr:g}.npz" not in found for lr in g.lrs):
            # a group may span sessions and machines: each call that trains in `keep` leaves
            # its machine, and what it found kept there; never two corpora in one row
            line = {"machine": machine_record(), "kept": found,
                    "trains": [lr for lr in g.lrs if f"lr{lr:g}.npz" not in found]}
            corpus = line["machine"]["corpus_sha256"]
            other = {s["machine"].get("corpus_sha256", corpus) for s in read_sessions(keep)}
            if other - {corpus}:
                raise UserError(f"{keep} holds LRs of {g.name} trained on another corpus (sha256 "
                                f"{min(other - {corpus})}, this Python's standard library is "
                                f"{corpus}): go on under the Python they ran on, or remove the "
                                "folder to train the row anew")
            with open(keep / SESSIONS, "a") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")
    parts = []
    for lr in g.lrs:
        path = keep / f"lr{lr:g}.npz" if keep is not None else None
        if path is not None and path.exists():
            part = read_npz(path, f"remove it: LR {lr:g} of {g.name} is trained again")
            shape = (len(g.seeds), g.steps)
            if not KEPT_KEYS <= part.keys() or part["loss"].shape != shape:
                raise UserError(f"{path} is not LR {lr:g} of {g.name} (its loss is not [seeds, "
                                f"steps] = {list(shape)}): remove it to train that LR again")
            parts.append(part)
            log(f"{g.name} LR {lr:g}: read back from {path}")
            continue
        progress = keep / f"lr{lr:g}.progress.npz" if keep is not None else None
        parts.append(train_members(g.config(lr), g.seeds, chunk, eval_every,
                                   log=lambda s, lr=lr: log(f"{g.name} LR {lr:g}{s}"),
                                   progress=progress))
        if path is not None:
            with written_whole(path) as tmp:
                np.savez(tmp, **parts[-1])
            progress.unlink(missing_ok=True)
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
              if k not in ("eval_step", "seconds", "first_step", "chunk_seconds")}
    return arrays | {"eval_step": parts[0]["eval_step"], "first_step": parts[0]["first_step"],
                     "seconds": sum(p["seconds"] for p in parts)} | (
        {"sessions": read_sessions(keep)} if keep is not None else {})


def open_keep(g: Group, keep: pathlib.Path) -> None:
    """`keep` as g's kept folder: made, with g's settings.json, or checked against it (a folder
    holding another g's LRs, or LRs of no known settings, is refused)."""
    keep.mkdir(parents=True, exist_ok=True)
    settings, stored = keep / "settings.json", json.dumps(g.settings(), sort_keys=True)
    if settings.exists() and not settings.is_file():
        raise UserError(f"{settings} is not a file: remove it to train {g.name} anew")
    if not settings.exists() and any(keep.glob("lr*.npz")):
        raise UserError(f"{keep} holds kept LRs but no settings.json (whose are they?): "
                        f"remove it to train {g.name} anew")
    if settings.exists() and settings.read_text() != stored:
        raise UserError(f"{keep} holds LRs of another {g.name}: remove it to train anew")
    if not settings.exists():
        settings.write_text(stored)


def keep_lr(g: Group, lr: float, log=print) -> None:
    """Train one LR of row `g` into its kept folder, unrecorded, so that a row's LRs can run in
    separate processes (lab/spread.py); `python -m lab.experiments ROW` then records the row from
    its kept LRs, training only those not kept."""
    if lr not in g.lrs:
        raise UserError(f"{g.name} has no LR {lr:g} (its LRs: "
                        f"{', '.join(f'{x:g}' for x in g.lrs)})")
    if g.fork or g.guard or g.snapshot_every:
        raise UserError(f"{g.name} is not an LR sweep (a fork, a guarded row or a fork's "
                        "source): run it whole, python -m lab.experiments ROW")
    train_group(dataclasses.replace(g, lrs=(lr,)), log=log, keep=SNAPSHOTS / g.name)


SESSIONS = "sessions.jsonl"  # in a kept folder: one line per train_group call that trained in it


def read_sessions(keep: pathlib.Path) -> list[dict]:
    """The machine of each train_group call that trained in `keep`, oldest first (none listed
    where the folder predates the list)."""
    if not (keep / SESSIONS).exists():
        return []
    try:
        return [json.loads(line) for line in (keep / SESSIONS).read_text().splitlines()]
    except (OSError, ValueError) as e:
        raise UserError(f"{keep / SESSIONS} cannot be read ({type(e).__name__}): the group's "
                        f"machines are unknown; remove {keep} to train it anew") from None


def train_guarded(g: Group, log=print) -> dict:
    """A guarded group: each seed a train.py run in runs/search/GROUP/seedN (train.train, so a
    killed group resumes where it stopped, and a finished run is read, not trained again), its
    metrics.jsonl (the last record of each step: the path the guard kept) as the member's
    arrays; `recomputed` counts the steps trained again after its rollbacks, `data_records`
    the level shifts the guard's data check let through."""
    per, t = [], time.perf_counter()
    for seed in g.seeds:
        base = g.config()
        cfg = dataclasses.replace(base, seed=seed, data=dataclasses.replace(base.data, seed=seed),
                                  run_dir=str(SNAPSHOTS / g.name / f"seed{seed}"))
        log(f"{g.name} seed {seed}: {cfg.run_dir}")
        T.train(cfg, devices=jax.devices()[:1])
        m = read_metrics(cfg.run_dir)
        lines = (pathlib.Path(cfg.run_dir) / "metrics.jsonl").read_text().count("\n")
        per.append({k: v for k, v in m.items() if k not in (
            "step", "lr", "tokens_per_s", "eval_step", "eval_loss", "guard_events")} | {
            "eval_loss": m["eval_loss"], "recomputed": np.array(lines - len(m["step"])),
            "guard_actions": np.array(len(acted(m.get("guard_events", [])))),
            "data_records": np.array(sum(e["action"] == "data"
                                         for e in m.get("guard_events", []))),
            "escalated_at": np.array(next((e["rollback_to"] for e in m.get("guard_events", [])
                                           if e.get("escalation")), -1))})
        per[-1]["eval_step"] = m["eval_step"] + 1  # logged at step N - 1: after N steps
        per[-1] |= probe_run(pathlib.Path(cfg.run_dir))
    arrays = {k: np.stack([p[k] for p in per]) for k in per[0] if k != "eval_step"}
    return arrays | {"eval_step": per[0]["eval_step"].astype(int), "first_step": 0,
                     "seconds": time.perf_counter() - t}


def probe_inputs(held_out):
    """The held-out batches [n, B, T + 1] as lab/probe.py reads them: the inputs, [n * B, T]."""
    return held_out[..., :-1].reshape(-1, held_out.shape[-1] - 1)


def probe_run(run_dir: pathlib.Path) -> dict:
    """lab/probe.py's figures of a train.py run's last checkpoint (the model as the guard left
    it) on the held-out batches the harness probes, each [1, L]: at the end only. The gate's
    are NaN where the run has no gate (a seed the guard never escalated)."""
    cfg, step = load_checkpointed(run_dir, None)
    params = restore_params(run_dir, step, cfg)
    t = TokenData(cfg.data, cfg.model.vocab_size).held_out_batches()
    with jax.set_mesh(one_device_mesh()):
        out = jax.jit(lambda p, t: probe(p, t, cfg.model))(params, probe_inputs(t))
    no_gate = cfg.model.attn_gate == "none"
    return {k: np.asarray(v, np.float32)[None] * (np.nan if no_gate and "gate" in k else 1)
            for k, v in out.items()}


def outcomes(g: Group, members: list[tuple[float, int, dict, int]]) -> list[dict]:
    """Per member (lr, seed, arrays, index): report.py's events (steps counted from 0; a fork's
    on its source's curve up to the fork, then its own: the detectors armed), held-out, max
    logit."""
    rows = []
    for lr, seed, a, i in members:
        first = int(a["first_step"])
        loss = a["loss"][i].astype(np.float64)
        update = a["update_norm"][i]
        if first:
            src = read_curve(g.fork, f"seed{seed}")
            loss = np.concatenate([src["loss"][:first].astype(np.float64), loss])
            update = np.concatenate([src["update_norm"][:first], update])
        m = {"step": np.arange(len(loss)), "loss": loss, "update_norm": update}
        spikes, shifts = find_spikes(m), find_shifts(m)
        rows.append({
            "group": g.name, "lr": lr, "seed": seed, **g.settings(), "first_step": first,
            "eval_step": a["eval_step"].tolist(),
            "eval_loss": [round(float(x), 4) for x in a["eval_loss"][i]],
            "spike_steps": [s.step for s in spikes if s.step >= first],
            "shift_steps": [s.step for s in shifts if s.step >= first],
            "max_attn_logit": float(np.nanmax(a["attn_logit_max"][i])),
            "skipped_steps": int(np.sum(a["skipped"][i])) if "skipped" in a else 0,
            "final_loss_100": float(np.nanmean(loss[-100:])),
            "finite": bool(np.all(np.isfinite(loss))),
        } | {f"final_{k}": [round(float(x), 4) for x in a[k][i][-1]]  # per layer, at the end
             for k in PROBE_KEYS if k in a} | (
            {"guard_actions": int(a["guard_actions"][i]), "recomputed_steps":
             int(a["recomputed"][i]), "escalated_at": int(a["escalated_at"][i]),
             "data_records": int(a["data_records"][i])} if "recomputed" in a else {}))
    return rows


# A fork's source keeps its stacked train state here (not under results/: ~20 MB a snapshot).
SNAPSHOTS = pathlib.Path("runs/search")


def save_state(path: pathlib.Path, state, extra: dict | None = None) -> None:
    """A (stacked) train state as one .npz, a leaf per key path, with `extra` arrays beside it;
    written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
    with written_whole(path) as tmp:
        np.savez(tmp, **(extra or {}),
                 **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


def load_state(path: pathlib.Path, like) -> tuple[dict, dict]:
    """(the state save_state wrote, in the structure of `like`; the other arrays), no pickle. A
    leaf missing or of another shape is a UserError (the file is another run's)."""
    arrays = read_npz(path, "remove it: the run goes on from its last complete save")
    flat, tree = jax.tree_util.tree_flatten_with_path(like)
    keys = [jax.tree_util.keystr(p) for p, _ in flat]
    if any(k not in arrays or arrays[k].shape != x.shape for k, (_, x) in zip(keys, flat)):
        raise UserError(f"{path} holds another run's state: remove it to train anew")
    return (jax.tree_util.tree_unflatten(tree, [jnp.asarray(arrays.pop(k)) for k in keys]),
            arrays)


def save_snapshot(group: str, step: int, state) -> None:
    save_state(SNAPSHOTS / group / f"step-{step}.npz", state)


def load_snapshot(group: str, step: int, like) -> dict:
    """The stacked state `group` kept at `step`, in the structure of `like` (no pickle)."""
    path = SNAPSHOTS / group / f"step-{step}.npz"
    if not path.is_file():
        raise UserError(f"{path} is missing: run python -m lab.experiments {group} first (it "
                        "keeps its state every 250 steps there)")
    return load_state(path, like)[0]


def fork_steps(g: Group) -> dict[int, int]:
    """seed -> the step a fork of g.fork starts from: the first 250-step boundary after the
    source seed's first level shift, or where it has none, after its first one-step spike past
    the warmup (lab/experiments.py's rule for the train.py rescues); seeds with neither are left
    out, and so are those whose boundary is the run's end. Read from the source's stored
    curves."""
    src = REGISTRY[g.fork]
    out = {}
    for seed in g.seeds:
        c = read_curve(src.name, f"seed{seed}")
        m = {"step": np.arange(len(c["loss"])), "loss": c["loss"].astype(np.float64),
             "update_norm": c["update_norm"]}
        events = find_shifts(m) or [e for e in find_spikes(m) if e.step >= g.warmup_steps]
        at = (events[0].step // src.snapshot_every + 1) * src.snapshot_every if events else None
        if at is not None and at < g.steps:  # (an event in the last 250 steps: no room left)
            out[seed] = at
    return out


def adam_relative_step(g: Group) -> float:
    """The angle a step that matches Adam's own step at g's forks: the source's relative step
    per layer (update_ratio_per_layer, |dW| / |W| of each layer's leaves) averaged over the
    layers, the 100 steps before each seed's fork step (fork_steps), and the seeds. Read from
    the source's stored curves (lab/store.py keeps that series for it)."""
    return float(np.mean([np.mean(read_curve(g.fork, f"seed{s}")["update_ratio_per_layer"][
        at - 100:at].astype(np.float64)) for s, at in fork_steps(g).items()]))


def member(stacked, i: int):
    """Member i of a stacked (vmapped) pytree."""
    return jax.tree.map(lambda x: x[i], stacked)


def train_fork(g: Group, log=print) -> dict:
    """Each seed of g.fork from its fork step on with g's settings: QK-Norm or the attention
    gate inserted where g has it (train.py's in-process carry, as the guard's escalation and
    warmstart.py do: every leaf kept, the new ones at their init with zero moments), else the
    state as kept, with QK-Clip
    acting from the fork step as after `--resume RUN --optim.qk-clip T`; a re-warmup from
    that step where g sets `rewarmup_steps`; then on to g.steps. Returns per-member arrays
    that start at the fork step (`first_step` per member)."""
    starts = fork_steps(g)
    src = REGISTRY[g.fork]
    for at in set(starts.values()):  # all there before anything trains
        if not (SNAPSHOTS / src.name / f"step-{at}.npz").is_file():
            raise UserError(f"{SNAPSHOTS / src.name}/step-{at}.npz is missing: {src.name} keeps "
                            f"its state there every {src.snapshot_every} steps as it trains, and "
                            "runs/ is not committed; train it again here first (take its entry "
                            "out of results/search.json, then python -m lab.experiments "
                            f"{src.name})")
    src_cfg = src.config()
    src_tx = make_tx(src_cfg)
    mesh = one_device_mesh()
    with jax.set_mesh(mesh):
        like = jax.eval_shape(jax.vmap(lambda s: init_state(src_cfg.model, s, src_tx)),
                              jnp.array(src.seeds))
    parts = {}
    for at in sorted(set(starts.values())):
        seeds = tuple(s for s in g.seeds if starts.get(s) == at)
        cfg = g.config()
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, rewarmup_start=at if "rewarmup_steps" in dict(g.optim) else -1,
            qk_clip_start=at if cfg.optim.qk_clip > 0 else 0))
        tx = make_tx(cfg)
        adds = (cfg.model.qk_norm and not src_cfg.model.qk_norm) or (
            cfg.model.attn_gate != src_cfg.model.attn_gate) or (  # leaves the source lacks
            cfg.optim.optimizer != src_cfg.optim.optimizer)  # (a Hyperball radius: at the fork)
        carry = functools.partial(insert_new_leaves, cfg, tx, mesh=mesh) \
            if adds else (lambda state: state)
        with jax.set_mesh(mesh):
            stacked = load_snapshot(src.name, at, like)
            members = [carry(member(stacked, src.seeds.index(s))) for s in seeds]
            state = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        log(f"{g.name}: seeds {', '.join(map(str, seeds))} from step {at}")
        parts[at] = (seeds, train_members(cfg, seeds, state=state,
                                          log=lambda s, at=at: log(f"{g.name} from {at}{s}")))
    return {"parts": parts}


def run(groups: list[Group], report=None) -> None:
    """Train and record each group not yet in results/search.json; `report(members)` after each."""
    for g in groups:
        if g.name in load()["groups"]:
            continue
        print(f"{g.name}: {len(member_grid(g))} members, {g.steps} steps", flush=True)
        sessions = []  # a kept row's: the machine of each call that trained some of it
        if g.fork:
            parts = train_fork(g, log=lambda s: print(s, flush=True))["parts"]
            members = [(g.lrs[0], s, a, i) for seeds, a in parts.values()
                       for i, s in enumerate(seeds)]
            seconds = sum(a["seconds"] for _, a in parts.values())
        elif g.guard:
            a = train_guarded(g, log=lambda s: print(s, flush=True))
            members = [(g.lrs[0], s, a, i) for i, s in enumerate(g.seeds)]
            seconds = a["seconds"]
        else:
            log = functools.partial(print, flush=True)
            if g.snapshot_every:  # a fork's source: its state kept every snapshot_every steps
                a = train_members(g.config(), g.seeds, log=log, snapshot_at=range(
                    g.snapshot_every, g.steps, g.snapshot_every),
                    snapshot=functools.partial(save_snapshot, g.name))
            else:  # LR by LR, each kept as it finishes (its progress at each evaluation)
                a = train_group(g, log=log, keep=SNAPSHOTS / g.name)
                sessions = a.pop("sessions")
            members = [(lr, s, a, i) for i, (lr, s) in enumerate(member_grid(g))]
            seconds = a["seconds"]
        (store.SEED_CURVES / g.name).mkdir(parents=True, exist_ok=True)
        written = []
        for lr, seed, a, i in members:  # one file per member
            tag = f"seed{seed}" if len(g.lrs) == 1 else f"lr{lr:g}-seed{seed}"
            written.append(store.SEED_CURVES / g.name / f"{tag}.npz")
            with written_whole(written[-1]) as tmp:
                np.savez_compressed(tmp, **curve_arrays(g.name, {
                    k: v[i] if k not in ("eval_step", "first_step", "seconds", "chunk_seconds")
                    else v for k, v in a.items()}))
        record_checksums(store.SEED_CURVES, written)
        save_group(g.name, {"settings": g.settings(), "lrs": list(g.lrs),
                            "seeds": sorted({s for _, s, _, _ in members}),
                            "seconds": round(seconds), "machine": machine_record(),
                            "members": outcomes(g, members)}
                   | ({"sessions": sessions} if sessions else {}))
        for path in (*(SNAPSHOTS / g.name).glob("lr*.npz"),  # recorded: the kept LRs go
                     SNAPSHOTS / g.name / SESSIONS):
            path.unlink(missing_ok=True)
        if report is not None:  # every member recorded so far
            report([r for v in load()["groups"].values() for r in v["members"]])


