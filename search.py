"""The seeds harness, and the story search: which small regime learns first and then spikes?
Every group trained, with its outcome, goes to results/search.json.

    python search.py                     # run the search's groups not yet in results/search.json
    python search.py --list              # the search's groups and whether each is done
    python search.py --summary           # the table of outcomes (no training)
    python search.py --markdown          # the README's table of the search
    python search.py --plot              # results/search.png and the search's table

The story's rows that this harness trains (the levers from scratch, the LR sweep, the 8-seed
evidence) are declared in experiments.py and run from there: python experiments.py ROW.

A *group* is train.py's own step (`train.build_train_step`, the LR inside the optimizer chain)
vmapped over *members* (seeds; one compiled step per LR of the group) and stepped `chunk`
steps at a time inside one `lax.scan`: one dispatch and one host read per chunk instead of per
step. Each member is the train.py run of its LR and seed (init and data order both drawn from
the seed), to float32 rounding: a test runs one beside train.py for 120 steps. Every member's
per-step curves are kept in results/curves/GROUP/seedN.npz.

The outcome of each member is judged by report.py's fixed rules (the one-step spike rule and the
level-shift rule, at their defaults: never tuned here; the episode rules for the evidence),
counted after the step S1 at which the run is compared with the QK-Norm run of the same group
settings.
"""

import dataclasses
import fcntl
import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import train as T
from checkpoint import init_state, insert_qk_norm
from cli import UserError, command, parse
from config import PRESETS, TrainConfig
from data import TokenData
from distributed import MeshConfig, make_mesh
from guard import GuardConfig
from report import (
    acted,
    ema,
    find_shifts,
    find_spikes,
    machine,
    pyplot,
    read_metrics,
    save_figure,
    update_readme,
)

OUT = pathlib.Path("results/search.json")
CURVES = pathlib.Path("results/search")  # the groups run before the evidence: GROUP.npz
SEED_CURVES = pathlib.Path("results/curves")  # since: GROUP/seedN.npz, one file per member


@dataclasses.dataclass(frozen=True)
class Group:
    """One compiled step: the settings every member shares, and the grid of LRs x seeds."""
    name: str
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    qk_norm: bool = False
    batch_size: int = 16
    seq_len: int = 128
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    z_loss_weight: float = 1e-4
    warmup_steps: int = 100
    steps: int = 2000
    lrs: tuple[float, ...] = (1e-2,)
    seeds: tuple[int, ...] = (0, 1, 2)
    optim: tuple[tuple[str, object], ...] = ()  # a lever: OptimConfig fields, (name, value)
    model: tuple[tuple[str, object], ...] = ()  # ...or ModelConfig fields
    compare_with: str = ""  # the QK-Norm group S1 is taken against (default: NAME-qk)
    # A mid-run arm from this group's kept states (see fork_steps): QK-Norm inserted where the
    # arm has it, else its settings (QK-Clip) switched on as a resume does.
    fork: str = ""
    snapshot_every: int = 0  # keep the stacked train state every N steps (a fork's source)
    # The guard on (GuardConfig fields): its rollbacks are the loop's, so each seed is a
    # train.py run (train.train, one after the other, resumable), its metrics.jsonl the curve.
    guard: tuple[tuple[str, object], ...] = ()
    spectral: bool = False  # log the q/k spectral entropy too (train.py --spectral-metrics)

    def config(self, lr: float | None = None) -> TrainConfig:
        """train.py's config of one member at `lr` (default: the group's first LR)."""
        base = PRESETS["story"]
        model = dataclasses.replace(
            base.model, d_model=self.d_model, d_ff=round(8 / 3 * self.d_model / 4) * 4,
            n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            qk_norm=self.qk_norm, z_loss_weight=self.z_loss_weight,
            **({"attention": "auto"} | dict(self.model)))
        optim = dataclasses.replace(base.optim, lr=self.lrs[0] if lr is None else lr,
                                    b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
                                    warmup_steps=self.warmup_steps, max_grad_norm=0.0,
                                    min_lr_ratio=1.0)
        optim = dataclasses.replace(optim, **dict(self.optim))
        data = dataclasses.replace(base.data, batch_size=self.batch_size, seq_len=self.seq_len,
                                   eval_sequences=64)
        guarded = GuardConfig(on=True, **dict(self.guard)) if self.guard else base.guard
        return dataclasses.replace(base, model=model, optim=optim, data=data, steps=self.steps,
                                   guard=guarded, spectral_metrics=self.spectral)

    def settings(self) -> dict:
        d = dataclasses.asdict(self) | {"optim": dict(self.optim), "model": dict(self.model),
                                        "guard": dict(self.guard)}
        return {k: v for k, v in d.items() if k not in ("name", "lrs", "seeds", "compare_with")
                and (k not in ("optim", "model", "fork", "snapshot_every", "guard", "spectral")
                     or v)}


def twin(g: Group, **kw) -> Group:
    """The group's QK-Norm twin (the comparison the story needs)."""
    return dataclasses.replace(g, name=g.name + "-qk", qk_norm=True, **kw)


# The search, in the order it was run. The notes say why each group was tried. A QK-Norm twin
# ("-qk") runs once its baseline shows spikes worth comparing.
GROUPS = [
    # d_model 64 at moderate LRs (3e-2 collapses within ~100 steps), beta2 0.95, 2,000 steps.
    Group("d64-b2.95", lrs=(6e-3, 1e-2, 1.5e-2, 2e-2)),
    # A stale second moment (beta2 0.999) and a tiny eps (Molybog et al., Bai et al.).
    Group("d64-b2.999-eps1e-15", b2=0.999, eps=1e-15, lrs=(6e-3, 1e-2, 1.5e-2, 2e-2)),
    # The first group learned at every LR without an instability (logits up to 492; its few
    # spikes fell on the same steps at every LR of a data seed: hard batches). Learn first at
    # a low LR, then meet the LR that collapses a fresh model (3e-2) or more: a long warmup.
    Group("d64-b2.95-warmup1000", warmup_steps=1000, lrs=(3e-2, 5e-2)),
]
# QK-Norm twins: the comparison that decides S1 (queued before the warmup group).
GROUPS.insert(2, twin(GROUPS[1], lrs=(1e-2, 2e-2)))
# The two single-seed events came late (steps 646 and 1,882): longer runs, other seeds.
GROUPS += [
    Group("d64-b2.999-eps1e-15-4k", b2=0.999, eps=1e-15, lrs=(2e-2,), seeds=(3, 4, 5),
          steps=4000),
    Group("d64-b2.95-warmup1000-4k", warmup_steps=1000, lrs=(5e-2,), steps=4000),
]
# That group breaks late in every seed (level shifts that never come back): its QK-Norm twin.
GROUPS.append(twin(GROUPS[-1]))
# The story regime (train.py's `story` preset) is that group. The levers, from scratch on it,
# each compared with its QK-Norm twin (S1) and with it (the spikes and shifts after S1).
STORY = GROUPS[-2]
SEARCH_NAMES = {g.name for g in GROUPS}  # the search's own groups (experiments.py adds rows)


# Every group by name: the search's own, and the rows experiments.py registers (the levers, the
# LR sweep, the evidence), so that a fork finds its source and S1 its QK-Norm twin.
REGISTRY: dict[str, Group] = {}


def register(*groups: Group) -> None:
    REGISTRY.update({g.name: g for g in groups})


register(*GROUPS)


# ---------------------------------------------------------------------------------------------
# The stacked trainer: train.py's own step, vmapped over seeds

def member_grid(g: Group) -> list[tuple[float, int]]:
    return [(lr, seed) for lr in g.lrs for seed in g.seeds]


# What a member's stored curve keeps of the step's metrics: the headline series in float32 (the
# event rules read them), the per-layer series in float16 (figures and early-warning signals).
CURVE_F32 = ("loss", "grad_norm", "update_norm", "attn_logit_max", "skipped", "out_logit_max",
             "log_z")


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
    every `eval_every` steps and the seconds it took."""
    tx = T.make_tx(cfg)
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
        eval_fn = jax.jit(jax.vmap(T.make_eval_step(cfg), in_axes=(0, None)))  # train.py's
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
                evals.append((c0, np.asarray(eval_fn(state["params"], held_out))))
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
    arrays["eval_loss"] = np.stack([e for _, e in evals], axis=1)  # [M, evals]
    arrays["seconds"] = time.time() - t0
    arrays["chunk_seconds"] = np.array(chunk_s)  # [chunks, 2]: steps, seconds (the 1st compiles)
    return arrays


def progress_arrays(out: dict, evals: list, chunk_s: list, seconds: float) -> dict:
    """train_members' metrics so far, as arrays beside the state in its progress file."""
    return {**{f"progress/metric/{k}": np.concatenate(v) for k, v in out.items()},
            "progress/eval_step": np.array([s for s, _ in evals]),
            "progress/eval_loss": np.stack([e for _, e in evals]),
            "progress/chunk_seconds": np.array(chunk_s), "progress/seconds": np.float64(seconds)}


def read_progress(path: pathlib.Path, like) -> tuple:
    """(state, metrics, evals, chunk seconds, seconds) from a progress file, the state placed as
    `like` is."""
    state, extra = load_state(path, like)
    state = jax.tree.map(lambda a, b: jax.device_put(a, b.sharding), state, like)
    out = {k.removeprefix("progress/metric/"): [v] for k, v in extra.items()
           if k.startswith("progress/metric/")}
    evals = list(zip(extra["progress/eval_step"].tolist(), extra["progress/eval_loss"]))
    return (state, out, evals, [tuple(c) for c in extra["progress/chunk_seconds"]],
            float(extra["progress/seconds"]))


def train_group(g: Group, chunk: int = 50, eval_every: int = 250, log=print,
                keep: pathlib.Path | None = None) -> dict:
    """Train every member of `g` (one compiled step per LR, the seeds vmapped in it); returns
    per-member arrays in member_grid order. `keep`: a folder where each LR's arrays are saved as
    it finishes and read back on the next call, so a group killed after some LRs goes on from
    the next (a width of the proxy is hours)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        settings, stored = keep / "settings.json", json.dumps(g.settings(), sort_keys=True)
        if settings.exists() and settings.read_text() != stored:
            raise UserError(f"{keep} holds LRs of another {g.name}: remove it to train anew")
        settings.write_text(stored)
    parts = []
    for lr in g.lrs:
        path = keep / f"lr{lr:g}.npz" if keep is not None else None
        if path is not None and path.exists():
            with np.load(path) as f:
                parts.append(dict(f))
            log(f"{g.name} LR {lr:g}: read back from {path}")
            continue
        progress = keep / f"lr{lr:g}.progress.npz" if keep is not None else None
        parts.append(train_members(g.config(lr), g.seeds, chunk, eval_every,
                                   log=lambda s, lr=lr: log(f"{g.name} LR {lr:g}{s}"),
                                   progress=progress))
        if path is not None:
            np.savez(path.with_suffix(".partial.npz"), **parts[-1])
            path.with_suffix(".partial.npz").replace(path)
            progress.unlink(missing_ok=True)
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
              if k not in ("eval_step", "seconds", "first_step", "chunk_seconds")}
    return arrays | {"eval_step": parts[0]["eval_step"], "first_step": parts[0]["first_step"],
                     "seconds": sum(p["seconds"] for p in parts)}


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
    arrays = {k: np.stack([p[k] for p in per]) for k in per[0] if k != "eval_step"}
    return arrays | {"eval_step": per[0]["eval_step"].astype(int), "first_step": 0,
                     "seconds": time.perf_counter() - t}


def curve_arrays(a: dict) -> dict:
    """What a group's stored curves keep (CURVE_F32 in float32, the rest in float16)."""
    return {k: (v if k in CURVE_F32 or k in ("eval_step", "eval_loss", "first_step")
                else np.asarray(v, np.float16)) for k, v in a.items()
            if k not in ("seconds", "chunk_seconds")}


# ---------------------------------------------------------------------------------------------
# Outcomes

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
            src = np.load(SEED_CURVES / g.fork / f"seed{seed}.npz")
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
        } | ({"guard_actions": int(a["guard_actions"][i]), "recomputed_steps":
              int(a["recomputed"][i]), "escalated_at": int(a["escalated_at"][i]),
              "data_records": int(a["data_records"][i])} if "recomputed" in a else {}))
    return rows


def first_match(base: list[float], qk: list[float], steps: list[int], tol: float = 0.05):
    """The last eval step S1 at which the baseline's held-out loss is within `tol` of the
    QK-Norm run's (the baseline "learns like the QK-Norm run" up to S1); None if never."""
    ok = [s for s, b, q in zip(steps, base, qk) if abs(b - q) <= tol]
    return ok[-1] if ok else None


def judge(rows: list[dict]) -> list[dict]:
    """Per (baseline group, LR): S1, spikes after S1 per seed, the QK-Norm twin's spikes."""
    by = {(r["group"], r["lr"], r["seed"]): r for r in rows}
    verdicts = []
    for (group, lr, seed), r in sorted(by.items()):
        if group.endswith("-qk"):
            continue
        twin = by.get((REGISTRY[group].compare_with if group in REGISTRY
                       and REGISTRY[group].compare_with else group + "-qk", lr, seed))
        s1 = twin and first_match(r["eval_loss"], twin["eval_loss"], r["eval_step"])
        after = s1 if s1 is not None else 0
        verdicts.append({
            "group": group, "lr": lr, "seed": seed, "s1": s1,
            "spikes_after_s1": sum(s >= after for s in r["spike_steps"]),
            "shifts_after_s1": sum(s >= after for s in r["shift_steps"]),
            "qk_spikes": len(twin["spike_steps"]) if twin else None,
            "eval": r["eval_loss"][-1], "qk_eval": twin["eval_loss"][-1] if twin else None,
            "max_logit": r["max_attn_logit"],
        })
    return verdicts


def story_found(verdicts: list[dict], min_spikes: int = 3) -> list[tuple[str, float]]:
    """(group, LR) where every seed has an S1 and >= min_spikes spikes after it."""
    cells: dict = {}
    for v in verdicts:
        cells.setdefault((v["group"], v["lr"]), []).append(
            v["s1"] is not None and v["spikes_after_s1"] >= min_spikes)
    return [k for k, oks in cells.items() if len(oks) >= 3 and all(oks)]


def summary(rows: list[dict]) -> str:
    verdicts = judge(rows)
    lines = [f"{'group':<24} {'lr':>7} {'seed':>4} {'S1':>5} {'spikes>S1':>9} {'shifts':>6} "
             f"{'qk spikes':>9} {'held-out':>8} {'qk':>6} {'max logit':>9}"]
    for v in verdicts:
        lines.append(f"{v['group']:<24} {v['lr']:>7.1e} {v['seed']:>4} {str(v['s1']):>5} "
                     f"{v['spikes_after_s1']:>9} {v['shifts_after_s1']:>6} "
                     f"{str(v['qk_spikes']):>9} {v['eval']:>8.3f} "
                     f"{v['qk_eval'] if v['qk_eval'] is None else round(v['qk_eval'], 3)!s:>6} "
                     f"{v['max_logit']:>9.3g}")
    found = story_found(verdicts)
    lines.append("every seed learns, then has >= 3 one-step spikes after S1 (these runs): "
                 + (", ".join(f"{g} at LR {lr:g}" for g, lr in found) if found else "none"))
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """One table row per group and LR: settings, spikes and level shifts per seed (after S1
    where the group has a QK-Norm twin), held-out loss mean ± sd, the largest attention logit."""
    verdicts = {(v["group"], v["lr"], v["seed"]): v for v in judge(rows)}
    cells: dict = {}
    for r in rows:
        if r["group"] in SEARCH_NAMES:  # the rows experiments.py adds have their own tables
            cells.setdefault((r["group"], r["lr"]), []).append(r)
    lines = ["| group | β2 | ε | warmup | LR | spikes per seed | level shifts | S1 (vs QK-Norm) | "
             "held-out (nats/byte) | max attn logit | spike steps |", "|---" * 11 + "|"]
    for (group, lr), members in cells.items():
        m0 = members[0]
        v = [verdicts.get((group, lr, r["seed"])) for r in members]
        s1 = ", ".join(str(x["s1"]) if x and x["s1"] is not None else "—" for x in v)
        if group.endswith("-qk") or all(x is None or x["qk_spikes"] is None for x in v):
            s1 = "no twin run" if not group.endswith("-qk") else "(the twin)"
        evals = np.array([r["eval_loss"][-1] for r in members])
        logits = [r["max_attn_logit"] for r in members]
        lines.append(
            f"| {group} | {m0['b2']} | {m0['eps']:g} | {m0['warmup_steps']} | {lr:g} | "
            f"{', '.join(str(len(r['spike_steps'])) for r in members)} | "
            f"{', '.join(str(len(r['shift_steps'])) for r in members)} | {s1} | "
            f"{evals.mean():.3f} ± {evals.std(ddof=1):.3f} | "
            f"{min(logits):,.0f}–{max(logits):,.0f} | "
            f"{'; '.join(','.join(map(str, r['spike_steps'])) or '—' for r in members)} |")
    return "\n".join(lines)


def plot(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/search.png: for each group with a QK-Norm twin, one panel per LR the two share:
    each seed's train loss (EMA, span 20) without QK-Norm (solid) and with it (dashed), the
    one-step spikes as dots and the level shifts as crosses on the run without."""
    plt = pyplot()
    pairs = [(g, lr) for g, v in record["groups"].items()
             if g + "-qk" in record["groups"] and g in SEARCH_NAMES
             for lr in v["lrs"] if lr in record["groups"][g + "-qk"]["lrs"]]
    fig, axes = plt.subplots(len(pairs), 1, figsize=(9, 3.2 * len(pairs)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (group, lr) in zip(axes[:, 0], pairs):
        for name, style in ((group, "-"), (group + "-qk", "--")):
            curves = np.load(CURVES / f"{name}.npz")["loss"]
            for i, m in enumerate(record["groups"][name]["members"]):
                if m["lr"] != lr:
                    continue
                y = ema(curves[i].astype(np.float64))
                c = colors[m["seed"] % len(colors)]
                ax.plot(y, style, color=c, lw=1.0, label=f"seed {m['seed']}"
                        + (" QK-Norm" if name.endswith("-qk") else ""))
                if style == "-":
                    ax.plot(m["spike_steps"], y[m["spike_steps"]], "o", color=c, ms=4)
                    ax.plot(m["shift_steps"], y[m["shift_steps"]], "x", color=c, ms=7)
        ax.set_title(f"{group}, LR {lr:g}: train loss (EMA 20) without QK-Norm (solid), with "
                     "it (dashed);\ndots: one-step spikes, crosses: level shifts", fontsize=9)
        ax.set_ylabel("nats/byte")
        ax.set_ylim(1.2, 2.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("step")
    return save_figure(fig, out / "search.png", dpi=100)


def load() -> dict:
    return json.loads(OUT.read_text()) if OUT.exists() else {"machine": {}, "groups": {}}


def save_group(name: str, entry: dict) -> None:
    """Add one group's record to results/search.json, under a lock: several search.py processes
    (one per core) may finish groups at the same time."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = load()
        record["groups"][name] = entry
        tmp = OUT.with_suffix(".json.partial")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(OUT)


# A fork's source keeps its stacked train state here (not under results/: ~20 MB a snapshot).
SNAPSHOTS = pathlib.Path("runs/search")


def save_state(path: pathlib.Path, state, extra: dict | None = None) -> None:
    """A (stacked) train state as one .npz, a leaf per key path, with `extra` arrays beside it;
    written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
    np.savez(path.with_suffix(".partial.npz"), **(extra or {}),
             **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
    path.with_suffix(".partial.npz").replace(path)


def load_state(path: pathlib.Path, like) -> tuple[dict, dict]:
    """(the state save_state wrote, in the structure of `like`; the other arrays), no pickle. A
    leaf missing or of another shape is a UserError (the file is another run's)."""
    with np.load(path) as f:
        arrays = dict(f)
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
        raise UserError(f"{path} is missing: run python experiments.py {group} first (it keeps its "
                        "state every 250 steps there)")
    return load_state(path, like)[0]


def fork_steps(g: Group) -> dict[int, int]:
    """seed -> the step a fork of g.fork starts from: the first 250-step boundary after the
    source seed's first level shift, or where it has none, after its first one-step spike past
    the warmup (experiments.py's rule for the train.py rescues); seeds with neither are left
    out, and so are those whose boundary is the run's end. Read from the source's stored
    curves."""
    src = REGISTRY[g.fork]
    out = {}
    for seed in g.seeds:
        c = np.load(SEED_CURVES / src.name / f"seed{seed}.npz")
        m = {"step": np.arange(len(c["loss"])), "loss": c["loss"].astype(np.float64),
             "update_norm": c["update_norm"]}
        events = find_shifts(m) or [e for e in find_spikes(m) if e.step >= g.warmup_steps]
        at = (events[0].step // src.snapshot_every + 1) * src.snapshot_every if events else None
        if at is not None and at < g.steps:  # (an event in the last 250 steps: no room left)
            out[seed] = at
    return out


def member(stacked, i: int):
    """Member i of a stacked (vmapped) pytree."""
    return jax.tree.map(lambda x: x[i], stacked)


def train_fork(g: Group, log=print) -> dict:
    """Each seed of g.fork from its fork step on with g's settings: QK-Norm inserted where g
    has it (train.py's in-process carry, as the guard's escalation and warmstart.py do: every
    leaf kept, the new scales at 1 with zero moments), else the state as kept, with QK-Clip
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
                            "out of results/search.json, then python experiments.py "
                            f"{src.name})")
    src_cfg = src.config()
    src_tx = T.make_tx(src_cfg)
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
        tx = T.make_tx(cfg)
        carry = functools.partial(insert_qk_norm, cfg, tx, mesh=mesh) \
            if cfg.model.qk_norm and not src_cfg.model.qk_norm else (lambda state: state)
        with jax.set_mesh(mesh):
            stacked = load_snapshot(src.name, at, like)
            members = [carry(member(stacked, src.seeds.index(s))) for s in seeds]
            state = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
        log(f"{g.name}: seeds {', '.join(map(str, seeds))} from step {at}")
        parts[at] = (seeds, train_members(cfg, seeds, state=state,
                                          log=lambda s, at=at: log(f"{g.name} from {at}{s}")))
    return {"parts": parts}


def run(groups: list[Group]) -> None:
    for g in groups:
        if g.name in load()["groups"]:
            continue
        print(f"{g.name}: {len(member_grid(g))} members, {g.steps} steps", flush=True)
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
            members = [(lr, s, a, i) for i, (lr, s) in enumerate(member_grid(g))]
            seconds = a["seconds"]
        (SEED_CURVES / g.name).mkdir(parents=True, exist_ok=True)
        for lr, seed, a, i in members:  # one file per member
            tag = f"seed{seed}" if len(g.lrs) == 1 else f"lr{lr:g}-seed{seed}"
            np.savez_compressed(SEED_CURVES / g.name / f"{tag}.npz", **curve_arrays(
                {k: v[i] if k not in ("eval_step", "first_step", "seconds", "chunk_seconds")
                 else v for k, v in a.items()}))
        save_group(g.name, {"settings": g.settings(), "lrs": list(g.lrs),
                            "seeds": sorted({s for _, s, _, _ in members}),
                            "seconds": round(seconds), "machine": machine(),
                            "members": outcomes(g, members)})
        for path in (SNAPSHOTS / g.name).glob("lr*.npz"):  # recorded: the kept LRs go
            path.unlink()
        rows = [r for v in load()["groups"].values() for r in v["members"]]
        print(summary(rows), flush=True)


@dataclasses.dataclass(frozen=True)
class SearchArgs:
    groups: tyro.conf.Positional[tuple[str, ...]] = ()  # groups to run (default: all not done)
    list: bool = False  # the groups and whether each is done
    summary: bool = False  # the table of outcomes (no training)
    markdown: bool = False  # the README's table of the search
    plot: bool = False  # results/search.png and the search's table in results/README.md


def main(argv: list[str]) -> int:
    """The search's own groups (the story's levers, LR sweep and evidence are experiments.py's
    rows: python experiments.py ROW)."""
    args = parse(SearchArgs, argv, description=__doc__)
    unknown = set(args.groups) - {g.name for g in GROUPS}
    if unknown:
        name = sorted(unknown)[0]
        hint = (f"a row of experiments.py: python experiments.py {name}" if name in REGISTRY
                else "python search.py --list")
        raise UserError(f"unknown search group {name!r}; {hint}")
    groups = [g for g in GROUPS if not args.groups or g.name in args.groups]
    record = load()
    rows = [r for v in record["groups"].values() for r in v["members"]]
    if args.list:
        for g in groups:
            print(f"{g.name:<28} {'done' if g.name in record['groups'] else 'to run'}")
    elif args.summary:
        print(summary(rows))
    elif args.markdown:
        print(markdown(rows))
    elif args.plot:
        print(f"wrote {plot(record, OUT.parent)}")
        update_readme(markdown(rows), part="search", writer="search.py")
        print(f"wrote the search's table in {OUT.parent}/README.md")
    else:
        run(groups)
    return 0


if __name__ == "__main__":
    sys.exit(command(main)(sys.argv[1:]))
