"""The story search: which small regime learns first and then spikes? Every configuration tried,
with its outcome, goes to results/search.json.

    python search.py                     # run the groups not yet in results/search.json
    python search.py --list              # the groups and whether each is done
    python search.py --summary           # the table of outcomes (no training)
    python search.py --markdown          # the README's table of the search
    python search.py --levers            # the levers on the story regime (README table)
    python search.py --sweep             # the LR sweep and its LR sensitivity (README table)
    python search.py --plot              # results/search.png, levers.png, lr_sweep.png and
                                         # the three tables in results/README.md
    python search.py --evidence [--plot] # the 8-seed rates with intervals (results/evidence.png)
    python search.py --rerun story8 --seed 3   # train one stored member again, judge it alike

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
import math
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
    bootstrap,
    ema,
    episodes,
    find_shifts,
    find_spikes,
    machine,
    mark_hard_batches,
    pyplot,
    read_metrics,
    recovery,
    save_figure,
    spike_score,
    spliced,
    survival,
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
    fork: str = ""  # a mid-run arm: QK-Norm inserted into this group's runs (see fork_steps)
    snapshot_every: int = 0  # keep the stacked train state every N steps (a fork's source)
    # The guard on (GuardConfig fields): its rollbacks are the loop's, so each seed is a
    # train.py run (train.train, one after the other, resumable), its metrics.jsonl the curve.
    guard: tuple[tuple[str, object], ...] = ()

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
                                   guard=guarded)

    def settings(self) -> dict:
        d = dataclasses.asdict(self) | {"optim": dict(self.optim), "model": dict(self.model),
                                        "guard": dict(self.guard)}
        return {k: v for k, v in d.items() if k not in ("name", "lrs", "seeds", "compare_with")
                and (k not in ("optim", "model", "fork", "snapshot_every", "guard") or v)}


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


def lever(name: str, model: dict | None = None, **optim) -> Group:
    return dataclasses.replace(STORY, name=f"story-{name}", optim=tuple(optim.items()),
                               model=tuple((model or {}).items()),
                               compare_with=STORY.name + "-qk")


LEVERS = [
    lever("marin-32b", max_grad_norm=0.2, skip_step=True, update_clip="norm"),  # the three
    lever("clip-0.2", max_grad_norm=0.2),
    lever("skip-step", skip_step=True),
    lever("update-clip-norm", update_clip="norm"),
    lever("qk-clip-100", qk_clip=100.0),
    lever("softcap-50", model={"attn_softcap": 50.0}),  # Gemma 2's cap
    lever("zclip", grad_clip="zclip"),
    lever("update-clip-rms", update_clip="rms"),
    lever("muon", optimizer="muon", muon_head=True),  # (the variant run then: LM head on Muon)
]
GROUPS += LEVERS
# LR sensitivity as Wortsman et al. (2309.14322) define it: the story regime at each LR of a
# half-decade grid from 1e-3 to 1, with and without QK-Norm, one group per LR and arm (each
# recorded as it finishes), the LRs nearest the story's 5e-2 first.
SWEEP_LRS = (1e-1, 3e-2, 3e-1, 1.0, 1e-2, 3e-3, 1e-3)
SWEEP = [g for lr in SWEEP_LRS for base in [dataclasses.replace(STORY, name=f"story-lr{lr:g}",
                                                                lrs=(lr,))]
         for g in (base, twin(base))]
GROUPS += SWEEP
SWEEP_NAMES = {g.name for g in SWEEP}
# The evidence: the story regime over 8 seeds (init and data order both drawn from the seed),
# with train.py's own step (unrolled layers, the story preset's since then): the baseline
# (keeping its state every 250 steps, where a warm start can begin), its QK-Norm twin, the 32B's
# three levers, and QK-Norm inserted mid-run (fork_steps) with a 100-step re-warmup from 0.1x.
EVIDENCE_SEEDS = tuple(range(8))
EVIDENCE = dataclasses.replace(STORY, name="story8", seeds=EVIDENCE_SEEDS, snapshot_every=250)
EVIDENCE_GROUPS = [
    EVIDENCE, twin(EVIDENCE, snapshot_every=0),
    dataclasses.replace(LEVERS[0], name="story8-marin-32b", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk"),
    dataclasses.replace(EVIDENCE, name="story8-qk-inserted", qk_norm=True, fork="story8",
                        snapshot_every=0, compare_with="story8-qk",
                        optim=(("rewarmup_steps", 100), ("rewarmup_from_ratio", 0.1))),
]
# The guard with escalation to QK-Norm (train.py's loop, one seed after the other).
EVIDENCE_GROUPS.append(dataclasses.replace(EVIDENCE, name="story8-guard-escalate", snapshot_every=0,
                                           guard=(("escalate", "qk-norm"),),
                                           compare_with="story8-qk"))
# The references' tools over the same seeds (run after the four above): QK-Clip's signed max
# and no-growth rule, Muon with the references' split, MuonClip (Muon + QK-Clip, as K2).
EVIDENCE_GROUPS += [
    dataclasses.replace(lever(name, **optim), name=f"story8-{name}", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk")
    for name, optim in (("qk-clip-100", {"qk_clip": 100.0}), ("muon", {"optimizer": "muon"}),
                        ("muonclip-100", {"optimizer": "muon", "qk_clip": 100.0}))]
GROUPS += EVIDENCE_GROUPS
EVIDENCE_NAMES = {g.name for g in EVIDENCE_GROUPS}
COMPARE = {g.name: g.compare_with for g in GROUPS if g.compare_with}


# ---------------------------------------------------------------------------------------------
# The stacked trainer: train.py's own step, vmapped over seeds

def member_grid(g: Group) -> list[tuple[float, int]]:
    return [(lr, seed) for lr in g.lrs for seed in g.seeds]


# What a member's stored curve keeps of the step's metrics: the headline series in float32 (the
# event rules read them), the per-layer series in float16 (figures and early-warning signals).
CURVE_F32 = ("loss", "grad_norm", "update_norm", "attn_logit_max", "skipped")


def one_device_mesh():
    """The harness runs on one device: every member's state is whole there."""
    return make_mesh(MeshConfig(1, 1), jax.devices()[:1])


def train_members(cfg: TrainConfig, seeds, chunk: int = 50, eval_every: int = 250,
                  log=print, state=None, snapshot_at=(), snapshot=None) -> dict:
    """Train one member per seed (init seed and data seed both = the seed) with train.py's step
    (`build_train_step`), vmapped over the members and scanned `chunk` steps at a time: one
    dispatch and one host read per chunk. `state`: a stacked train state to go on from (a fork);
    `snapshot(step, state)` is called after each step in `snapshot_at`. Returns [M, steps, ...]
    arrays of every metric of the step, the held-out loss every `eval_every` steps and the
    seconds it took."""
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
        out: dict = {}
        evals, t0, chunk_s = [], time.time(), []
        c0 = first
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


def train_group(g: Group, chunk: int = 50, eval_every: int = 250, log=print) -> dict:
    """Train every member of `g` (one compiled step per LR, the seeds vmapped in it); returns
    per-member arrays in member_grid order."""
    parts = [train_members(g.config(lr), g.seeds, chunk, eval_every,
                           log=lambda s, lr=lr: log(f"{g.name} LR {lr:g}{s}"))
             for lr in g.lrs]
    arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
              if k not in ("eval_step", "seconds", "first_step", "chunk_seconds")}
    return arrays | {"eval_step": parts[0]["eval_step"], "first_step": parts[0]["first_step"],
                     "seconds": sum(p["seconds"] for p in parts)}


def train_guarded(g: Group, log=print) -> dict:
    """A guarded group: each seed a train.py run in runs/search/GROUP/seedN (train.train, so a
    killed group resumes where it stopped, and a finished run is read, not trained again), its
    metrics.jsonl (the last record of each step: the path the guard kept) as the member's
    arrays; `recomputed` counts the steps trained again after its rollbacks."""
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
            "guard_actions": np.array(len(m.get("guard_events", []))),
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
              int(a["recomputed"][i]), "escalated_at": int(a["escalated_at"][i])}
             if "recomputed" in a else {}))
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
        twin = by.get((COMPARE.get(group, group + "-qk"), lr, seed))
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
        if r["group"] not in SWEEP_NAMES | EVIDENCE_NAMES:  # these have their own tables
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


def lever_rows(record: dict) -> list[dict]:
    """The story baseline, its QK-Norm twin and each lever run so far: per seed the one-step
    spikes and level shifts after the baseline's S1 of that seed, the held-out loss at the end,
    the skipped steps; and the held-out mean and sd over seeds."""
    groups = record["groups"]
    base = {m["seed"]: m for m in groups.get(STORY.name, {}).get("members", [])}
    twin_ = {m["seed"]: m for m in groups.get(STORY.name + "-qk", {}).get("members", [])}
    s1 = {s: first_match(base[s]["eval_loss"], twin_[s]["eval_loss"], base[s]["eval_step"])
          for s in base if s in twin_}
    rows = []
    for name in [STORY.name, STORY.name + "-qk", *(g.name for g in LEVERS)]:
        if name not in groups:
            continue
        members = sorted(groups[name]["members"], key=lambda m: m["seed"])
        after = [s1.get(m["seed"]) or 0 for m in members]
        evals = np.array([m["eval_loss"][-1] for m in members])
        rows.append({"group": name, "seeds": [m["seed"] for m in members], "s1": after,
                     "spikes": [sum(x >= a for x in m["spike_steps"])
                                for m, a in zip(members, after)],
                     "shifts": [sum(x >= a for x in m["shift_steps"])
                                for m, a in zip(members, after)],
                     "skipped": [m.get("skipped_steps", 0) for m in members],
                     "eval": evals.tolist(), "eval_mean": float(evals.mean()),
                     "eval_sd": float(evals.std(ddof=1)) if len(evals) > 1 else 0.0,
                     "max_logit": [m["max_attn_logit"] for m in members],
                     "spike_score": spike_score_means(name)})
    return rows


def spike_score_means(group: str) -> dict[str, float] | None:
    """OLMo-core's spike score (6 sigma over the last 128 steps, report.py) of the loss and the
    grad norm, as the mean over the group's members, from its curves; None without them."""
    path = CURVES / f"{group}.npz"
    if not path.is_file():
        return None
    curves = np.load(path)
    return {key: float(np.mean([spike_score(x, 128, 6.0) for x in curves[key]]))
            for key in ("loss", "grad_norm")}


def levers_markdown(record: dict) -> str:
    rows = lever_rows(record)
    if not rows:
        return "no lever run yet"
    base = rows[0]
    lines = ["| run (3 seeds, from scratch) | spikes after S1 | level shifts after S1 | "
             "held-out (nats/byte) | vs baseline | max attn logit | skipped steps | spike score "
             "loss / grad norm (6σ/128) |", "|---" * 8 + "|"]
    for r in rows:
        d = r["eval_mean"] - base["eval_mean"]
        vs = ("—" if r is base else f"{d:+.3f}" + (" (within the spread)" if abs(d) <=
                                                     r["eval_sd"] + base["eval_sd"] else ""))
        name = {STORY.name: "baseline", STORY.name + "-qk": "QK-Norm"}.get(
            r["group"], r["group"].removeprefix("story-"))
        lines.append(f"| {name} | {', '.join(map(str, r['spikes']))} | "
                     f"{', '.join(map(str, r['shifts']))} | {r['eval_mean']:.3f} ± "
                     f"{r['eval_sd']:.3f} | {vs} | {min(r['max_logit']):,.0f}–"
                     f"{max(r['max_logit']):,.0f} | {', '.join(map(str, r['skipped']))} | "
                     + (f"{r['spike_score']['loss']:.2%} / {r['spike_score']['grad_norm']:.2%} |"
                        if r["spike_score"] else "— |"))
    return "\n".join(lines)


def sweep_rows(record: dict) -> list[dict]:
    """The LR sweep so far, one row per LR and arm: each seed's held-out loss at the end (NaN
    where the run went non-finite), its initial train loss, spikes, level shifts, max logit."""
    rows = []
    for g in sorted(SWEEP, key=lambda g: (g.lrs[0], g.qk_norm)):
        if g.name not in record["groups"]:
            continue
        members = sorted(record["groups"][g.name]["members"], key=lambda m: m["seed"])
        first = np.load(CURVES / f"{g.name}.npz")["loss"][:, 0]
        rows.append({"lr": g.lrs[0], "qk_norm": g.qk_norm, "seeds": [m["seed"] for m in members],
                     "final": [m["eval_loss"][-1] if m["finite"] else math.nan
                               for m in members],
                     "initial": [float(x) for x in first],
                     "spikes": [len(m["spike_steps"]) for m in members],
                     "shifts": [len(m["shift_steps"]) for m in members],
                     "max_logit": [m["max_attn_logit"] for m in members]})
    return rows


def lr_sensitivity(finals: dict[str, float], initial: float) -> float:
    """Wortsman et al. (2309.14322): mean over the LR grid of min(final loss, initial loss)
    minus the best final loss; a run that did not finish counts at the initial loss."""
    clipped = [min(f, initial) if math.isfinite(f) else initial for f in finals.values()]
    return float(np.mean(clipped) - min(clipped))


def both_arms(rows: list[dict]) -> list[float]:
    """The LRs the sweep has finished with and without QK-Norm."""
    return sorted({r["lr"] for r in rows if r["qk_norm"]}
                  & {r["lr"] for r in rows if not r["qk_norm"]})


def sensitivity(rows: list[dict]) -> dict[bool, list[float]] | None:
    """Wortsman et al.'s LR sensitivity per seed, without and with QK-Norm, over the LRs both
    arms have finished (None before two such LRs)."""
    lrs = both_arms(rows)
    if len(lrs) < 2:
        return None
    by = {(r["lr"], r["qk_norm"]): r for r in rows}
    return {qk: [lr_sensitivity({lr: by[lr, qk]["final"][i] for lr in lrs},
                                by[lrs[0], qk]["initial"][i])
                 for i in range(len(by[lrs[0], qk]["seeds"]))] for qk in (False, True)}


def sweep_markdown(record: dict) -> str:
    rows = sweep_rows(record)
    if not rows:
        return "no LR of the sweep run yet"

    def mean_sd(x):
        x = np.asarray(x)
        return (f"{np.mean(x):.3f} ± {np.std(x, ddof=1):.3f}" if np.all(np.isfinite(x))
                else f"non-finite in {int(np.sum(~np.isfinite(x)))} of {len(x)} seeds")
    lines = ["| LR | QK-Norm | held-out at the end (nats/byte) | spikes per seed | level shifts | "
             "max attn logit |", "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r['lr']:g} | {'yes' if r['qk_norm'] else 'no'} | "
                     f"{mean_sd(r['final'])} | {', '.join(map(str, r['spikes']))} | "
                     f"{', '.join(map(str, r['shifts']))} | {min(r['max_logit']):,.0f}–"
                     f"{max(r['max_logit']):,.0f} |")
    sens = sensitivity(rows)
    if sens:
        lrs = sorted({r["lr"] for r in rows})
        done = both_arms(rows)
        lines.append(
            f"\nLR sensitivity (Wortsman et al.: the mean over the LRs of min(final, initial "
            f"loss) minus the best final loss; a non-finite run counts at the initial loss) over "
            f"the LRs {', '.join(f'{x:g}' for x in done)}"
            + ("" if len(done) == len(SWEEP_LRS) else f" ({len(done)} of the {len(SWEEP_LRS)}"
               f" LRs of the grid; {', '.join(f'{x:g}' for x in lrs if x not in done) or 'none'}"
               " run in one arm only)")
            + f", mean ± sd over seeds: **{np.mean(sens[False]):.3f} ± "
            f"{np.std(sens[False], ddof=1):.3f}** without QK-Norm, **{np.mean(sens[True]):.3f} "
            f"± {np.std(sens[True], ddof=1):.3f}** with it.")
    return "\n".join(lines)


def plot_sweep(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/lr_sweep.png: held-out loss at the end against the LR, without and with
    QK-Norm (mean over seeds, bars from the lowest to the highest seed); the max logit."""
    plt = pyplot()
    rows = sweep_rows(record)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for qk, color, label in ((False, "C0", "without QK-Norm"), (True, "C1", "with QK-Norm")):
        arm = [r for r in rows if r["qk_norm"] == qk]
        x = [r["lr"] for r in arm]
        for ax, key in zip(axes, ("final", "max_logit")):
            ys = [np.asarray(r[key], dtype=np.float64) for r in arm]
            y = np.array([np.nanmean(v) if np.any(np.isfinite(v)) else np.nan for v in ys])
            err = np.array([[m - np.nanmin(v), np.nanmax(v) - m] if np.isfinite(m)
                            else [0, 0] for m, v in zip(y, ys)]).T.reshape(2, -1)
            ax.errorbar(x, y, yerr=err, color=color, marker="o", capsize=3, label=label)
    axes[0].set_ylabel("held-out loss at step 4,000 (nats/byte)")
    axes[1].set_ylabel("max |attn logit| over the run")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # the decades only
        ax.set_xlabel("peak learning rate")
        ax.grid(alpha=0.3)
        ax.axvline(STORY.lrs[0], color="0.5", ls=":", label=f"the story's LR, {STORY.lrs[0]:g}")
    axes[0].legend(fontsize=8)
    axes[0].set_title("the story regime's LR sweep (3 seeds; bars: lowest to highest seed)",
                      fontsize=9)
    return save_figure(fig, out / "lr_sweep.png", dpi=100)


def plot_levers(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/levers.png: per lever, each seed's train loss (EMA 20) beside the baseline's
    (grey) and QK-Norm's (dashed); level shifts as crosses."""
    plt = pyplot()
    done = [g.name for g in LEVERS if g.name in record["groups"]]
    cols = 3
    fig, axes = plt.subplots(-(-len(done) // cols), cols, figsize=(12, 2.8 * -(-len(done) // cols)),
                             squeeze=False, sharex=True, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, done):
        for group, style, color in ((STORY.name, "-", "0.6"), (STORY.name + "-qk", "--", "0.3")):
            for y in np.load(CURVES / f"{group}.npz")["loss"]:
                ax.plot(ema(y.astype(np.float64)), style, color=color, lw=0.7)
        curves = np.load(CURVES / f"{name}.npz")["loss"]
        for i, m in enumerate(record["groups"][name]["members"]):
            y = ema(curves[i].astype(np.float64))
            c = colors[m["seed"] % len(colors)]
            ax.plot(y, color=c, lw=1.0, label=f"seed {m['seed']}")
            ax.plot(m["shift_steps"], y[m["shift_steps"]], "x", color=c, ms=7)
        ax.set_title(name.removeprefix("story-"), fontsize=9)
        ax.set_ylim(1.4, 2.8)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(done):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("each lever from scratch on the story regime (colour, one line per seed; "
                 "crosses: level shifts)\nagainst the baseline (grey) and QK-Norm (dashed): "
                 "train loss, EMA 20, nats/byte", fontsize=10)
    return save_figure(fig, out / "levers.png", dpi=75)


def plot(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/search.png: for each group with a QK-Norm twin, one panel per LR the two share:
    each seed's train loss (EMA, span 20) without QK-Norm (solid) and with it (dashed), the
    one-step spikes as dots and the level shifts as crosses on the run without."""
    plt = pyplot()
    pairs = [(g, lr) for g, v in record["groups"].items()
             if g + "-qk" in record["groups"] and g not in SWEEP_NAMES
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


# ---------------------------------------------------------------------------------------------
# The evidence: rates with intervals over seeds, from the stored curves only (report.py's rules)

def seed_curve(group: str, seed: int) -> dict:
    """A member's stored curve as report.py reads a run: per-step arrays indexed by "step"
    (a fork's start at its fork step), and its evals."""
    c = np.load(SEED_CURVES / group / f"seed{seed}.npz")
    first = int(c["first_step"])
    n = len(c["loss"])
    return {"step": np.arange(first, first + n), "loss": c["loss"].astype(np.float64),
            "update_norm": c["update_norm"].astype(np.float64),
            "grad_norm": c["grad_norm"].astype(np.float64),
            "attn_logit_max": c["attn_logit_max"], "eval_step": c["eval_step"],
            "eval_loss": c["eval_loss"], "first_step": first}


def judged(g: Group, seed: int, base: str, twin: str, curve: dict | None = None) -> dict:
    """One member judged by the episode rules: its curve (a fork's spliced onto its source's),
    S1 (the baseline's last eval within 0.05 of the twin's), the episodes from S1 (a fork's
    from its fork step) with the twin's hard-batch control, each shift's recovery. `curve`:
    judge this curve instead of the stored one (a rerun)."""
    m = curve or seed_curve(g.name, seed)
    first = m["first_step"]
    if first:
        m = spliced(seed_curve(g.fork, seed), m, first) | {
            "eval_step": m["eval_step"], "eval_loss": m["eval_loss"]}
    b, t = seed_curve(base, seed), seed_curve(twin, seed)
    s1 = int(first_match(list(b["eval_loss"]), list(t["eval_loss"]), list(b["eval_step"])) or 0)
    after = max(s1, first)
    spikes = [e for e in find_spikes(m) if e.step >= after]
    shifts = [e for e in find_shifts(m) if e.step >= after]
    eps = episodes([e.step for e in spikes], [e.step for e in shifts])
    if g.name != twin:
        twin_shifts = [e.step for e in find_shifts(t)]
        eps = mark_hard_batches(eps, t["loss"], twin_shifts)
    steps = len(m["loss"]) - after
    rec = [recovery(m["loss"], e.step, e.pre_level) for e in shifts]
    return {"seed": seed, "s1": s1, "from": after, "steps": steps, "episodes": eps,
            "recoveries": rec, "old_spikes": len(spikes), "old_shifts": len(shifts),
            "old_never": sum(e.recovered_after is None for e in shifts),
            "eval": float(m["eval_loss"][-1]),
            "max_logit": float(np.nanmax(m["attn_logit_max"][after:]))}


def evidence_rows(record: dict, base: str = "story8", twin: str = "story8-qk") -> list[dict]:
    """Per evidence group run so far: per seed judged(); the rates per 1,000 steps, the share of
    seeds with a shift not back by the end, held-out and max logit, each with its mean and
    bootstrap 95% interval over seeds."""
    if base not in record["groups"] or twin not in record["groups"]:
        return []
    rows = []
    for g in EVIDENCE_GROUPS:
        if g.name not in record["groups"]:
            continue
        seeds = sorted(m["seed"] for m in record["groups"][g.name]["members"])
        per = [judged(g, s, base, twin) for s in seeds]
        k = 1000 / np.array([p["steps"] for p in per])
        stats = {
            "level_shift_episodes": k * [sum(e.level_shift for e in p["episodes"]) for p in per],
            "episodes": k * [len(p["episodes"]) for p in per],
            "instability_episodes": k * [sum(not e.hard_batch for e in p["episodes"])
                                         for p in per],
            "with_shift": [float(any(e.level_shift for e in p["episodes"])) for p in per],
            "hard_batches": [sum(bool(e.hard_batch) for e in p["episodes"]) for p in per],
            "unrecovered": [float(any(not ok for _, ok in p["recoveries"])) for p in per],
            "eval": [p["eval"] for p in per],
            "max_logit": [p["max_logit"] for p in per],
            "old_spikes": [p["old_spikes"] for p in per],
            "old_shifts": [p["old_shifts"] for p in per],
            "old_never": [p["old_never"] for p in per]}
        members = sorted(record["groups"][g.name]["members"], key=lambda m: m["seed"])
        guarded = {k: [m[k] for m in members] for k in ("guard_actions", "recomputed_steps",
                                                          "escalated_at") if k in members[0]}
        guarded |= {"run_steps": g.steps} if guarded else {}
        rows.append({"group": g.name, "seeds": seeds, "per_seed": per, "guard": guarded,
                     "cpu": record["groups"][g.name].get("machine", {}).get("cpu", "?"),
                     **{key: {"values": [float(x) for x in v], "mean": float(np.mean(v)),
                              "ci": bootstrap(v)} for key, v in stats.items()},
                     "survival": survival([r for p in per for r in p["recoveries"]])})
    return rows


def evidence_markdown(rows: list[dict]) -> str:
    """The evidence table (rates per 1,000 steps after S1, mean [95% bootstrap interval] over
    seeds), the old rules' counts beside it, and each row's recovery survival table."""
    if not rows:
        return "the 8-seed baseline and its QK-Norm twin have not both run yet"

    def cell(r, key, fmt="{:.2f}"):
        lo, hi = r[key]["ci"]
        return f"{fmt.format(r[key]['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"
    name = {"story8": "baseline", "story8-qk": "QK-Norm from scratch"}
    lines = ["| run | seeds | seeds with a level-shift episode | level-shift episodes / 1k "
             "steps | instability episodes / 1k steps (not a hard batch) | all episodes / 1k "
             "steps (hard batches in all) | seeds with a shift not back at the end | held-out "
             "(nats/byte) | max attn logit | old rules: spikes, shifts, \"never\" per seed |",
             "|---" * 10 + "|"]
    for r in rows:
        twin = r["group"] == "story8-qk"
        lines.append(
            f"| {name.get(r['group'], r['group'].removeprefix('story8-'))} | {len(r['seeds'])} | "
            f"{cell(r, 'with_shift', '{:.0%}')} | {cell(r, 'level_shift_episodes')} | "
            f"{'(the twin)' if twin else cell(r, 'instability_episodes')} | "
            f"{cell(r, 'episodes')} ({'—' if twin else int(sum(r['hard_batches']['values']))}) | "
            f"{cell(r, 'unrecovered', '{:.0%}')} | "
            f"{cell(r, 'eval', '{:.3f}')} | {cell(r, 'max_logit', '{:,.0f}')} | "
            f"{np.mean(r['old_spikes']['values']):.1f}, {np.mean(r['old_shifts']['values']):.1f}, "
            f"{np.mean(r['old_never']['values']):.1f} |")
    lines.append("\nRecovery of the level shifts (back within max(0.05 nats, the smoothed loss's "
                 "noise) of the level before; a shift whose run ended first is censored), share "
                 "not back after k steps (at risk):\n")
    lines += ["| run | " + " | ".join(f"k = {x['k']}" for x in rows[0]["survival"]) + " |",
              "|---" * (1 + len(rows[0]["survival"])) + "|"]
    for r in rows:
        lines.append(f"| {name.get(r['group'], r['group'].removeprefix('story8-'))} | "
                     + " | ".join("—" if not x["at_risk"] else
                                  f"{x['share_not_back']:.0%} ({x['at_risk']})"
                                  for x in r["survival"]) + " |")
    for r in rows:
        if r.get("guard"):
            gd = r["guard"]
            share = [x / gd["run_steps"] for x in gd["recomputed_steps"]]
            at = [s for s in gd["escalated_at"] if s >= 0]
            lines.append(
                f"\n{name.get(r['group'], r['group'].removeprefix('story8-'))}: "
                f"{np.mean(gd['guard_actions']):.1f} guard actions per seed "
                f"({min(gd['guard_actions'])}-{max(gd['guard_actions'])}), steps computed again "
                f"{min(share):.1%}-{max(share):.1%} of the run's (mean {np.mean(share):.1%}); "
                f"escalated to QK-Norm in {len(at)} of {len(gd['escalated_at'])} seeds"
                + (f" (from steps {', '.join(f'{s:,}' for s in sorted(at))})" if at else "")
                + ".")
    cpus = sorted({r["cpu"] for r in rows})
    lines.append(f"\nRan on: {'; '.join(cpus)}. Intervals: 95% percentile bootstrap over seeds "
                 "(10,000 resamples, fixed RNG). A difference is called only where two "
                 "intervals do not overlap.")
    return "\n".join(lines)


def plot_evidence(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """results/evidence.png: per seed, the baseline's train loss (raw, faint; EMA 20, bold)
    against its QK-Norm twin's and, where it ran, QK-Norm inserted mid-run (from its step);
    the baseline's episodes after S1 marked: level shifts (x), one-step spikes (o), hard
    batches (open o: the twin jumped there too)."""
    plt = pyplot()
    by = {r["group"]: r for r in rows}
    base = by["story8"]
    n = len(base["seeds"])
    cols = 4
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(14, 3.0 * -(-n // cols)),
                             squeeze=False, sharey=True)
    for ax, p in zip(axes.flat, base["per_seed"]):
        seed = p["seed"]
        b = seed_curve("story8", seed)
        ax.plot(b["step"], b["loss"], color="C0", lw=0.3, alpha=0.35)
        ax.plot(b["step"], ema(b["loss"]), color="C0", lw=1.1, label="baseline")
        t = seed_curve("story8-qk", seed)
        ax.plot(t["step"], ema(t["loss"]), "--", color="0.25", lw=1.0, label="QK-Norm")
        if "story8-qk-inserted" in by and seed in by["story8-qk-inserted"]["seeds"]:
            f = seed_curve("story8-qk-inserted", seed)
            ax.plot(f["step"], ema(f["loss"]), color="C2", lw=1.0,
                    label=f"QK-Norm inserted at {f['first_step']}")
        y = ema(b["loss"])
        for e in p["episodes"]:
            style = ("x", 8, "C3") if e.level_shift else ("o", 4, "C1")
            ax.plot(e.start, y[e.start], style[0], ms=style[1], color=style[2],
                    mfc="none" if e.hard_batch else style[2])
        ax.axvline(p["s1"], color="0.6", lw=0.8, ls=":")
        ax.set_title(f"seed {seed} (S1 {p['s1']})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats/byte)")
        ax.set_ylim(1.2, 2.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    for ax in axes.flat[n:]:
        ax.axis("off")
    fig.suptitle(f"the story regime, {n} seeds: the baseline (blue; raw faint, EMA 20 bold) "
                 "against its QK-Norm twin (dashed); S1 (dotted): the baseline's last held-out "
                 "eval within 0.05 nats of the twin's;\nepisodes after S1: x level shift, "
                 "o one-step spike, open o a hard batch (the twin jumped there too)", fontsize=10)
    return save_figure(fig, out / "evidence.png", dpi=80)


RERUN_KEYS = ("level_shift_episodes", "instability_episodes", "episodes", "unrecovered", "eval",
              "max_logit")


def rerun(name: str, seed: int, log=print) -> list[tuple[str, float, tuple, tuple, bool, bool]]:
    """Train one stored member again (group `name`, `seed`; on this machine, alone in its
    compiled step) and judge it by the same rules: per figure (value, the row's 95% interval of
    the mean, the seeds' range, inside the interval, inside the range)."""
    g = next((x for x in EVIDENCE_GROUPS if x.name == name), None)
    record = load()
    if g is None or name not in record["groups"]:
        raise UserError(f"--rerun {name}: not an evidence row that has run; python search.py "
                        "--list")
    if g.fork:
        raise UserError(f"--rerun {name}: a mid-run row starts from its source's kept state; "
                        f"rerun {g.fork} instead")
    if seed not in g.seeds:
        raise UserError(f"--rerun {name} --seed {seed}: the row's seeds are {list(g.seeds)}")
    a = train_members(g.config(), (seed,), log=log)
    n = len(a["loss"][0])
    curve = {"step": np.arange(n), "loss": a["loss"][0].astype(np.float64),
             "update_norm": a["update_norm"][0].astype(np.float64),
             "attn_logit_max": a["attn_logit_max"][0], "eval_step": a["eval_step"],
             "eval_loss": a["eval_loss"][0], "first_step": 0}
    p = judged(g, seed, "story8", "story8-qk", curve)
    k = 1000 / p["steps"]
    value = {"level_shift_episodes": k * sum(e.level_shift for e in p["episodes"]),
             "instability_episodes": k * sum(not e.hard_batch for e in p["episodes"]),
             "episodes": k * len(p["episodes"]),
             "unrecovered": float(any(not ok for _, ok in p["recoveries"])),
             "eval": p["eval"], "max_logit": p["max_logit"]}
    row = next(r for r in evidence_rows(record) if r["group"] == name)
    out = []
    for key in RERUN_KEYS:
        lo, hi = row[key]["ci"]
        vals = row[key]["values"]
        out.append((key, value[key], (lo, hi), (min(vals), max(vals)), lo <= value[key] <= hi,
                    min(vals) <= value[key] <= max(vals)))
    return out


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


def save_snapshot(group: str, step: int, state) -> None:
    path = SNAPSHOTS / group / f"step-{step}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(state))
    np.savez(path.with_suffix(".partial.npz"),
             **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
    path.with_suffix(".partial.npz").replace(path)


def load_snapshot(group: str, step: int, like) -> dict:
    """The stacked state `group` kept at `step`, in the structure of `like` (no pickle)."""
    path = SNAPSHOTS / group / f"step-{step}.npz"
    if not path.is_file():
        raise UserError(f"{path} is missing: run python search.py {group} first (it keeps its "
                        "state every 250 steps there)")
    with np.load(path) as f:
        arrays = dict(f)
    flat, tree = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(tree, [jnp.asarray(arrays[jax.tree_util.keystr(p)])
                                               for p, _ in flat])


def fork_steps(g: Group) -> dict[int, int]:
    """seed -> the step a fork of g.fork starts from: the first 250-step boundary after the
    source seed's first level shift, or where it has none, after its first one-step spike past
    the warmup (experiments.py's rule for the train.py rescues); seeds with neither are left
    out, and so are those whose boundary is the run's end. Read from the source's stored
    curves."""
    src = next(x for x in GROUPS if x.name == g.fork)
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
    """QK-Norm inserted into each seed of g.fork at its fork step (train.py's in-process carry,
    as the guard's escalation and warmstart.py do: every leaf kept, the new scales at 1 with
    zero moments), a re-warmup from that step, then on to g.steps. Returns per-member arrays
    that start at the fork step (`first_step` per member)."""
    starts = fork_steps(g)
    src = next(x for x in GROUPS if x.name == g.fork)
    for at in set(starts.values()):  # all there before anything trains
        if not (SNAPSHOTS / src.name / f"step-{at}.npz").is_file():
            raise UserError(f"{SNAPSHOTS / src.name}/step-{at}.npz is missing: {src.name} keeps "
                            f"its state there every {src.snapshot_every} steps as it trains, and "
                            "runs/ is not committed; train it again here first (take its entry "
                            "out of results/search.json, then python search.py "
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
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, rewarmup_start=at))
        tx = T.make_tx(cfg)
        with jax.set_mesh(mesh):
            stacked = load_snapshot(src.name, at, like)
            members = [insert_qk_norm(cfg, tx, member(stacked, src.seeds.index(s)), mesh)
                       for s in seeds]
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
            snap = functools.partial(save_snapshot, g.name)
            a = train_group(g, log=lambda s: print(s, flush=True)) if not g.snapshot_every \
                else train_members(g.config(), g.seeds, log=lambda s: print(s, flush=True),
                                   snapshot_at=range(g.snapshot_every, g.steps,
                                                     g.snapshot_every), snapshot=snap)
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
        rows = [r for v in load()["groups"].values() for r in v["members"]]
        print(summary(rows), flush=True)


@dataclasses.dataclass(frozen=True)
class SearchArgs:
    groups: tyro.conf.Positional[tuple[str, ...]] = ()  # groups to run (default: all not done)
    list: bool = False  # the groups and whether each is done
    summary: bool = False  # the table of outcomes (no training)
    markdown: bool = False  # the README's table of the search
    levers: bool = False  # the levers on the story regime
    sweep: bool = False  # the LR sweep and its LR sensitivity
    evidence: bool = False  # the 8-seed rates with intervals (with --plot: figure, README)
    plot: bool = False  # the figures and tables into results/
    rerun: str = ""  # rerun one stored member of this evidence group (with --seed)
    seed: int = 0  # the seed --rerun trains again


def main(argv: list[str]) -> int:
    args = parse(SearchArgs, argv, description=__doc__)
    unknown = set(args.groups) - {g.name for g in GROUPS}
    if unknown:
        raise UserError(f"unknown group {sorted(unknown)[0]!r}; python search.py --list")
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
    elif args.levers:
        print(levers_markdown(record))
    elif args.sweep:
        print(sweep_markdown(record))
    elif args.rerun:
        print(f"rerunning {args.rerun} seed {args.seed} on {machine()['cpu']} (the row ran on "
              f"{record['groups'].get(args.rerun, {}).get('machine', {}).get('cpu', '?')})")
        for key, v, ci, span, in_ci, in_span in rerun(args.rerun, args.seed):
            print(f"  {key:<22} {v:10.3f}   row mean's 95% interval [{ci[0]:.3f}, {ci[1]:.3f}]"
                  f" {'inside' if in_ci else 'OUTSIDE'}; seeds' range [{span[0]:.3f}, "
                  f"{span[1]:.3f}] {'inside' if in_span else 'OUTSIDE'}")
    elif args.evidence:
        ev = evidence_rows(record)
        print(evidence_markdown(ev))
        if args.plot and ev:
            print(f"wrote {plot_evidence(ev, OUT.parent)}")
            update_readme(evidence_markdown(ev), part="evidence", writer="search.py")
    elif args.plot:  # the figures, and the tables into results/README.md
        print(f"wrote {plot(record, OUT.parent)}")
        if any(g.name in record["groups"] for g in LEVERS):
            print(f"wrote {plot_levers(record, OUT.parent)}")
        update_readme(levers_markdown(record), part="levers", writer="search.py")
        if any(g.name in record["groups"] for g in SWEEP):
            print(f"wrote {plot_sweep(record, OUT.parent)}")
        update_readme(sweep_markdown(record), part="lr-sweep", writer="search.py")
        update_readme(markdown(rows), part="search", writer="search.py")
        print(f"wrote the levers', the LR sweep's and the search's tables in "
              f"{OUT.parent}/README.md")
    else:
        run(groups)
    return 0


if __name__ == "__main__":
    sys.exit(command(main)(sys.argv[1:]))
