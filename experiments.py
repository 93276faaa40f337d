"""The spike story at CPU scale, over seeds: one train.py / warmstart.py command per run.

    python experiments.py                  # everything (~2 hours on 2 cores), then the results
    python experiments.py baseline rescue --seeds 0,1,2 --jobs 1
    python experiments.py --list           # the command of every run
    python experiments.py --results-only   # tables and figures from the runs already made
    python experiments.py story8 story8-qk # harness rows: 8 seeds in one vmapped step (search.py)
    python experiments.py --evidence --plot  # the 8-seed rates with intervals, figure, README
    python experiments.py --rerun story8 --seed 3   # one stored member again: inside its row?
    python experiments.py --widths         # best and break LR per width (Wortsman's proxy)
    python experiments.py --zloss          # z-loss off against on at d_model 32 (its §3.2)

These are the story's runs that need train.py itself: the baseline and everything started from
its checkpoints (or from another run's), the guard, and the 32B's configuration with QK-Norm
inserted into it. The harness rows (the levers from scratch, the LR sweep, the 8-seed evidence)
are declared here too and trained by search.py's vmapped harness. Every train.py run is
exactly the command `--list` prints, in runs/exp/NAME-sSEED; a finished run is not run again,
so an interrupted suite resumes where it stopped. The seed sets both the initialisation (--seed)
and the data order (--data.seed). Some runs depend on others: the rescues warm-start from a
checkpoint of their source run, and the "replace-batches" runs rewind their source to its last
checkpoint before its largest loss event and go on with the batches before that event replaced;
they run once their sources are done.

Afterwards the results -- per run, read from its metrics.jsonl, then mean and spread over the
seeds -- go to results/results.json (with the machine and each run's wall time), the figures to
results/*.png, and the tables into results/README.md between the `results` markers. Nothing in
the tables is typed by hand. An intervention is called better or worse than the baseline only
where the difference of the means exceeds the sum of the two standard deviations over seeds.
"""

import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tyro

import search
from checkpoint import saved_steps, strict_json
from cli import UserError, command, parse
from config import PRESETS
from report import (
    bootstrap,
    compare,
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
    seed_curves,
    spike_score,
    spliced,
    spread,
    summary,
    survival,
    update_readme,
)
from search import (
    STORY,
    Group,
    first_match,
    load,
    register,
    train_members,
    twin,
)

RUNS, RESULTS = pathlib.Path("runs/exp"), pathlib.Path("results")
STORY_PRESET = "story"  # the preset (train.py)
REWARMUP = 100
REPLACED = 20  # replace-batches: the batches of this many steps before the event


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One row of the results: how its runs are made, what it is compared with, where it is
    drawn. Adding a lever is adding one of these."""
    name: str
    flags: tuple[str, ...] = ()  # train.py flags on top of the preset
    preset: str = STORY_PRESET
    baseline: str | None = "baseline"  # the row its held-out loss is compared with
    panels: tuple[str, ...] = ("rescue",)  # the figures (PANELS) it is drawn in
    # How its runs start: "train" from scratch; "rescue": QK-Norm inserted by warmstart.py into
    # `source` at the first checkpoint after its first event (start_step); "switch": `source`
    # resumed from that checkpoint with `flags` added (a setting a resume may switch on,
    # QK-Clip); "replace": `source` rewound to its last
    # checkpoint before its largest loss event and run on with the batches of the REPLACED
    # steps before the event replaced (Marin: "we tried skipping the problematic step").
    start: str = "train"
    source: str = ""


LOGITS = "logits"  # a row drawn in attn_logits_per_layer.png (its first seed's layers)
EXPERIMENTS = [
    Experiment("baseline", baseline=None, panels=("rescue", LOGITS)),
    # Mid-run, after the baseline's first level shift: QK-Norm inserted, QK-Clip switched on;
    # the batches before its largest event replaced
    Experiment("rescue", panels=("rescue", LOGITS), start="rescue", source="baseline"),
    Experiment("qk-clip-switched-on", ("--optim.qk-clip", "100"), start="switch",
               source="baseline"),
    Experiment("replace-batches", start="replace", source="baseline"),
    # The guard (guard.py): rollback and data replacement only, then with escalation to QK-Norm
    Experiment("guard", ("--guard",)),
    Experiment("guard-escalate", ("--guard", "--guard.escalate", "qk-norm"),
               panels=("rescue", LOGITS)),
    # The 32B's configuration (clip 0.2, skip-step, update-norm clip), then QK-Norm inserted
    Experiment("marin-32b", ("--optim.max-grad-norm", "0.2", "--optim.skip-step",
                             "--optim.update-clip", "norm"), panels=("marin-32b",)),
    Experiment("rescue-marin-32b", baseline="marin-32b", panels=("marin-32b",), start="rescue",
               source="marin-32b"),
]
BY_NAME = {e.name: e for e in EXPERIMENTS}
NAMES = list(BY_NAME)
# The figures: name -> (file, title); each draws the rows that name it in `panels`.
PANELS = {
    "rescue": ("qk_norm_and_rescue.png", "the baseline; QK-Norm inserted and QK-Clip switched "
               "on after its first level shift,\nthe batches before its largest event "
               "replaced; the guard (rollback; rollback, then QK-Norm)"),
    "marin-32b": ("marin_32b_and_rescue.png", "the 32B's configuration (clip 0.2, skip-step, "
                  "update-norm clip);\nQK-Norm inserted into it after its first level shift"),
}


# ---------------------------------------------------------------------------------------------
# The harness's rows (search.py trains them: train.py's own step vmapped over seeds, or for a
# guarded row train.py's loop per seed). Adding a lever is one row here.

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
# LR sensitivity as Wortsman et al. (2309.14322) define it: the story regime at each LR of a
# half-decade grid from 1e-3 to 1, with and without QK-Norm, one group per LR and arm (each
# recorded as it finishes), the LRs nearest the story's 5e-2 first.
SWEEP_LRS = (1e-1, 3e-2, 3e-1, 1.0, 1e-2, 3e-3, 1e-3)
SWEEP = [g for lr in SWEEP_LRS for base in [dataclasses.replace(STORY, name=f"story-lr{lr:g}",
                                                                lrs=(lr,))]
         for g in (base, twin(base))]
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
# The guard with escalation to QK-Norm (train.py's loop, one seed after the other); with the
# data check on (the story has no data shift: every "data" record is a shift let through); and
# acting before the break, when the max logit passes 100 at a checkpoint step (predict).
EVIDENCE_GROUPS += [dataclasses.replace(EVIDENCE, name=f"story8-guard-{tag}",
                                        snapshot_every=0, compare_with="story8-qk",
                                        guard=(("escalate", "qk-norm"), *more))
                    for tag, more in (("escalate", ()),
                                      ("escalate-data", (("data_fraction", 0.5),)),
                                      ("predict", (("predict", "max-logit"),)),
                                      # (its one-step spikes left alone: no rollback at all?)
                                      ("predict-only", (("predict", "max-logit"),
                                                        ("spikes", False))))]
# The references' tools over the same seeds (run after the four above): QK-Clip's signed max
# and no-growth rule, Muon with the references' split, MuonClip (Muon + QK-Clip, as K2).
EVIDENCE_GROUPS += [
    dataclasses.replace(lever(name, **optim), name=f"story8-{name}", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk")
    for name, optim in (("qk-clip-100", {"qk_clip": 100.0}), ("muon", {"optimizer": "muon"}),
                        ("muonclip-100", {"optimizer": "muon", "qk_clip": 100.0}))]
# The baseline again with the final code (story8 predates a refactor of attention.py that moved
# its float rounding: its steps part from step 1-21 on): a rerun of the row as a whole, and
# the source of QK-Clip 100 switched on mid-run at the same rule's step (no re-warmup: a
# resume's switch).
EVIDENCE_GROUPS += [
    dataclasses.replace(EVIDENCE, name="story8-rerun"),
    dataclasses.replace(EVIDENCE, name="story8-qk-clip-switched", fork="story8-rerun",
                        snapshot_every=0, compare_with="story8-qk", optim=(("qk_clip", 100.0),))]
# The baseline and its twin once more, with every early-warning signal computed online in the
# step (foresight.py --group story8-signals): the update/weight ratio and m / sqrt(v) per layer,
# the q/k spectral entropy.
EVIDENCE_GROUPS += [g for base in [dataclasses.replace(EVIDENCE, name="story8-signals",
                                                       snapshot_every=0, spectral=True)]
                    for g in (base, twin(base))]
# The other levers alone, over the same seeds (queued after those).
EVIDENCE_GROUPS += [dataclasses.replace(g, name=g.name.replace("story-", "story8-"),
                                        seeds=EVIDENCE_SEEDS, compare_with="story8-qk")
                    for g in LEVERS if g.name in ("story-clip-0.2", "story-skip-step",
                                                  "story-update-clip-norm", "story-softcap-50",
                                                  "story-zclip", "story-update-clip-rms")]
# Wortsman et al.'s small-scale proxy across widths (2309.14322, Fig. 1): does the break come
# closer to the best LR as the model grows? d_model 32, 64, 128 at the story's depth, head_dim
# 16 (the heads scale with the width, two query heads per KV head), the same data, tokens and
# schedule; per width and arm one group over the LR grid (one compiled step per LR): ~1 h an
# arm on one core at d_model 32, ~2.5 h at 64, ~7 h at 128. The best LR fell from 3e-3 at
# d_model 32 to 1e-3 at 64, so 128 also runs 1e-4 to keep its best bracketed. LR sensitivity
# is taken over the paper's range, 3e-4 to 3e-1 (its §2.2: three decades), at every width; the
# grid goes on to 1 to find where both arms break.
WIDTHS = (32, 64, 128)
WIDTH_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
SENSITIVITY_LRS = WIDTH_LRS[:-1]
WIDTH_ROWS = [g for d in WIDTHS for base in [dataclasses.replace(
    STORY, name=f"width{d}", d_model=d, n_heads=d // 16, n_kv_heads=d // 32,
    lrs=(1e-4, *WIDTH_LRS) if d == 128 else WIDTH_LRS, seeds=(0, 1, 2),
    compare_with=f"width{d}-qk")] for g in (base, twin(base))]
# The second instability (Wortsman et al. §3.2, output-logit divergence): d_model 32 around its
# break (0.1, 0.3, 1), z-loss off against on (1e-4), with and without QK-Norm; the step reports
# the output logits' max |logit| and mean log Z. ~20 min a group on one core (AMD EPYC).
ZLOSS_ROWS = [g for z in (0.0, 1e-4) for base in [dataclasses.replace(
    WIDTH_ROWS[0], name=f"zloss{z:g}-width32", lrs=(0.1, 0.3, 1.0), z_loss_weight=z,
    compare_with=f"zloss{z:g}-width32-qk")] for g in (base, twin(base))]
# When is QK-Norm necessary? The knobs the 32B had that a small run does not, each an LR sweep
# of the d_model 32 proxy without and with QK-Norm, judged by the widths rows' rules (best LR:
# the lowest mean held-out; break LR: the lowest LR with a level shift in >= half the seeds;
# the distance in decades, its spread the range of the seeds' own break/best over the seeds).
# The grid brackets d_model 32's best (3e-3) and break (0.3; 1 with QK-Norm). Adam's beta2 as
# in most recipes (0.999; the proxy's 0.95), Marin's epsilon (1e-15), no weight decay.
KNOB_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
KNOBS = {"b2.999": {"b2": 0.999}, "eps1e-15": {"eps": 1e-15}, "wd0": {"weight_decay": 0.0}}
KNOB_ROWS = [g for tag, knob in KNOBS.items() for base in [dataclasses.replace(
    WIDTH_ROWS[0], name=f"width32-{tag}", lrs=KNOB_LRS, compare_with=f"width32-{tag}-qk",
    **knob)] for g in (base, twin(base))]
HARNESS_ROWS = {g.name: g for g in (*LEVERS, *SWEEP, *EVIDENCE_GROUPS, *WIDTH_ROWS, *ZLOSS_ROWS,
                                    *KNOB_ROWS)}
register(*HARNESS_ROWS.values())


def run_dir(name: str, seed: int) -> pathlib.Path:
    return RUNS / f"{name}-s{seed}"


def train_cmd(name: str, seed: int, preset: str, flags: list[str]) -> list[str]:
    return [sys.executable, "train.py", preset, *flags, "--seed", str(seed), "--data.seed",
            str(seed), "--run-dir", str(run_dir(name, seed))]


def largest_event(run: pathlib.Path) -> int | None:
    """The step of a finished run's largest loss event (a spike or a level shift), if any."""
    m = read_metrics(run)
    events = [(s.height, s.step) for s in find_spikes(m) + find_shifts(m)]
    return max(events)[1] if events else None


def command_for(name: str, seed: int) -> list[str] | None:
    """The command of run (name, seed); None where it does not apply (no event to act on).
    Runs that depend on another are resolved only once that one has finished."""
    e = BY_NAME[name]
    if e.start == "train":
        return train_cmd(name, seed, e.preset, list(e.flags))
    src = run_dir(e.source, seed)
    if e.start == "replace":
        event = largest_event(src)
        if event is None:
            return None
        source = BY_NAME[e.source]
        span = f"{max(event - REPLACED, 0)}:{event}"
        return train_cmd(name, seed, source.preset, [*source.flags, "--data.replace-batches",
                                                     span])
    step = start_step(e, src)
    if step is None:
        return None
    if e.start == "switch":
        return [sys.executable, "train.py", "--resume", str(run_dir(name, seed)), *e.flags]
    return [sys.executable, "warmstart.py", "--from", str(src), "--to",
            str(run_dir(name, seed)), "--step", str(step), "--rewarmup-steps", str(REWARMUP)]


def start_step(e: Experiment, src: pathlib.Path) -> int | None:
    """The checkpoint of `src` a "rescue" or "switch" run starts from: the first one after the
    first level shift, or where the run has none, after its first spike past the warmup (None:
    no event)."""
    m, cfg = read_metrics(src), PRESETS[e.preset]
    events = find_shifts(m) or [s for s in find_spikes(m) if s.step >= cfg.optim.warmup_steps]
    if not events:
        return None
    return (events[0].step // cfg.checkpoint_every + 1) * cfg.checkpoint_every


def from_step(m: dict, step: int) -> dict:
    """A run's metrics (read_metrics) from `step` on."""
    keep, evals = m["step"] >= step, np.asarray(m["eval_step"]) >= step
    return {k: v[keep] if isinstance(v, np.ndarray) and len(v) == len(keep) else v
            for k, v in m.items()} | {"eval_step": np.asarray(m["eval_step"])[evals],
                                      "eval_loss": np.asarray(m["eval_loss"])[evals]}


def rewound_to(e: Experiment, src: pathlib.Path) -> int | None:
    """The checkpoint of `src` a "replace" or "switch" run resumes from: the last one at or
    before its first replaced step (the switch's step)."""
    first = start_step(e, src) if e.start == "switch" else max(largest_event(src) - REPLACED, 0)
    steps = [s for s in saved_steps(src) if s <= first]
    return steps[-1] if steps else None


def rewind(name: str, seed: int) -> None:
    """Start a "replace" or "switch" run (name, seed) from a copy of its source: config.json,
    the last checkpoint at or before the first replaced step (the switch's step), and the
    metrics before it. train.py then resumes there (the replaced steps are a RESUMABLE
    setting, QK-Clip a SWITCHABLE one); a start from scratch would repeat the source's steps
    bit for bit."""
    e = BY_NAME[name]
    src, run = run_dir(e.source, seed), run_dir(name, seed)
    step = rewound_to(e, src)
    if step is None:
        return
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / str(step), run / "checkpoints" / str(step))
    shutil.copy(src / "config.json", run / "config.json")
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(x for x in lines
                                               if json.loads(x)["step"] < step))


def finished(run: pathlib.Path) -> bool:
    """The run reached its last step, or stopped on a run of non-finite steps (exit 1)."""
    if not (run / "metrics.jsonl").is_file() or not (run / "config.json").is_file():
        return False
    steps = json.loads((run / "config.json").read_text())["steps"]
    done = pathlib.Path(f"{run}.done")
    try:
        last = int(read_metrics(run)["step"][-1])
    except UserError:  # no complete step yet
        return False
    return last + 1 >= steps or (done.is_file() and json.loads(done.read_text())["exit"] == 1)


def execute(name: str, seed: int) -> int:
    """Run (name, seed) unless it has finished; its output goes to runs/exp/NAME-sSEED.log,
    its exit status and wall time to NAME-sSEED.done."""
    run = run_dir(name, seed)
    if finished(run):
        return 0
    cmd = command_for(name, seed)
    if cmd is None:
        print(f"[{run.name}] nothing to do: its source run has no event of the kind it acts on",
              flush=True)
        return 0
    start = BY_NAME[name].start
    if start == "rescue" and run.exists():
        raise UserError(f"{run} holds an unfinished warm start: remove it and run again")
    if start in ("replace", "switch") and not run.exists():
        rewind(name, seed)
    RUNS.mkdir(parents=True, exist_ok=True)
    print(f"[{run.name}] python {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with open(f"{run}.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    pathlib.Path(f"{run}.done").write_text(json.dumps(
        {"exit": code, "seconds": round(time.perf_counter() - t, 1)}) + "\n")
    tail = pathlib.Path(f"{run}.log").read_text().strip().splitlines()[-1:]
    print(f"[{run.name}] exit {code}: {tail[0] if tail else ''}", flush=True)
    return code


def run_all(names: list[str], seeds: list[int], jobs: int) -> dict:
    """Independent runs first, then those that read their results, `jobs` at a time."""
    codes = {}
    sources = {BY_NAME[n].source for n in names if BY_NAME[n].source}
    first = [(e.name, s) for e in EXPERIMENTS if e.start == "train"
             and (e.name in names or e.name in sources) for s in seeds]
    first.sort(key=lambda ns: -PRESETS[BY_NAME[ns[0]].preset].steps)  # the longest first
    later = [(n, s) for n in names if BY_NAME[n].start != "train" for s in seeds]
    with ThreadPoolExecutor(jobs) as pool:
        for batch in (first, later):
            codes |= dict(zip(batch, pool.map(lambda ns: execute(*ns), batch)))
    return codes


# ---------------------------------------------------------------------------------------------
# Results: per run, then mean and spread over seeds

STATS = ("eval_loss", "final_loss", "spikes", "shifts", "max_attn_logit", "final_attn_logit",
         "skipped_steps")


def recovery_after_warm_start(rescue: dict, source: dict, start: int,
                              window: int = 20) -> int | None:
    """Steps after the warm start until the rescue's rolling-mean train loss is back at the
    source run's rolling-mean loss just before it (the one-time penalty paid off)."""
    def rolling(x):
        return np.convolve(x, np.ones(window) / window, mode="valid")  # [i] ends at i+window-1
    before = rolling(source["loss"][source["step"] < start])[-1]
    after = rolling(rescue["loss"][rescue["step"] >= start])
    back = np.nonzero(after <= before)[0]
    return int(back[0]) + window - 1 if len(back) else None


def caught_up(m: dict, seed: int, start: int, tol: float = 0.05) -> int | None:
    """The first held-out eval from `start` on at which the run is within `tol` nats of QK-Norm
    from scratch at the same step (the story regime's QK-Norm twin in results/search.json,
    same seed), or None if it never is."""
    path = RESULTS / "search.json"
    if not path.is_file():
        return None
    twin_row = json.loads(path.read_text())["groups"].get(twin(STORY).name, {})
    mine = [x for x in twin_row.get("members", []) if x["seed"] == seed]
    if not mine:
        return None
    qk = dict(zip(mine[0]["eval_step"], mine[0]["eval_loss"]))  # after N steps: step N
    for step, loss in zip(m["eval_step"], m["eval_loss"]):  # logged at step N - 1
        done = int(step) + 1
        if done > start and done in qk and loss <= qk[done] + tol:
            return done
    return None


def collect(seeds: list[int]) -> tuple[dict, dict]:
    """(rows, metrics): rows[name] = per-seed summaries and their spread; metrics[name][seed]
    = the run's metrics arrays (report.read_metrics)."""
    rows, metrics = {}, {}
    for name in NAMES:
        runs = {s: run_dir(name, s) for s in seeds if finished(run_dir(name, s))}
        if not runs:
            continue
        metrics[name] = {s: read_metrics(r) for s, r in runs.items()}
        e = BY_NAME[name]
        if e.start in ("switch", "replace"):  # its own steps: it holds its source's before
            metrics[name] = {s: from_step(m, rewound_to(e, run_dir(e.source, s)) or 0)
                             for s, m in metrics[name].items()}
        per_seed = {}
        for s, m in metrics[name].items():
            row = summary(m)
            done = pathlib.Path(f"{runs[s]}.done")
            row["wall_s"] = json.loads(done.read_text())["seconds"] if done.is_file() else None
            if "guard_events" in m:  # what the guard did, and what it cost
                acted = [x for x in m["guard_events"] if "rollback_to" in x]
                row["guard_actions"] = len(acted)
                row["extra_steps"] = sum(x["extra_steps"] for x in acted)
                row["escalated_at"] = next((x["rollback_to"] for x in acted
                                            if x.get("escalation")), None)
                row["caught_up_at"] = row["escalated_at"] and caught_up(m, s, row["escalated_at"])
            if e.start == "replace":
                row["rewound_to"] = int(m["step"][0])
            if e.start in ("rescue", "switch"):
                at = int(m["step"][0])
                row["warm_start_step"] = at
                row["recovered_after"] = recovery_after_warm_start(m, metrics[e.source][s], at)
                row["caught_up_at"] = caught_up(m, s, at)  # within 0.05 of QK-Norm from scratch
            per_seed[s] = row
        rows[name] = {"seeds": per_seed,
                      **{k: spread([r[k] for r in per_seed.values()]) for k in STATS}}
    return rows, metrics


def per_seed(row: dict, key: str) -> str:
    return ", ".join("never" if r[key] is None else f"{r[key]:g}" for r in row["seeds"].values())


def logit(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def table(rows: dict, seeds: list[int]) -> str:
    lines = [f"Seeds {', '.join(map(str, seeds))}: held-out loss as mean ± standard deviation; "
             "spikes, level shifts and skipped steps per seed; the largest attention logit as "
             "the range over seeds.", "",
             "| experiment | held-out loss (nats/byte) | vs its baseline | loss spikes | level "
             "shifts | max attn logit: over the run; at the end | skipped | command (seed 0) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        base = BY_NAME[name].baseline
        vs = compare(r, rows[base]) if base in rows else ""
        extra = ""
        if BY_NAME[name].start in ("rescue", "switch"):
            what = "warm start" if BY_NAME[name].start == "rescue" else "switched on"
            extra = (f"; {what} at step {per_seed(r, 'warm_start_step')}, train loss back at "
                     f"its level before after {per_seed(r, 'recovered_after')} steps")
        if BY_NAME[name].start == "replace":
            extra = (f"; rewound to step {per_seed(r, 'rewound_to')}, the {REPLACED} batches "
                     "before its largest event replaced; events counted from there")
        if all("caught_up_at" in x for x in r["seeds"].values()):
            extra += (f"; within 0.05 of QK-Norm from scratch from step "
                      f"{per_seed(r, 'caught_up_at')}")
        if all("guard_actions" in x for x in r["seeds"].values()):
            extra += (f"; guard rollbacks {per_seed(r, 'guard_actions')}, steps computed again "
                     f"{per_seed(r, 'extra_steps')}, escalated at {per_seed(r, 'escalated_at')}")
        cmd = command_for(name, min(r["seeds"]))
        if len(r["seeds"]) < len(seeds):  # the others had no event to act on
            extra += f" ({len(r['seeds'])} of {len(seeds)} seeds)"
        lines.append(
            f"| {name}{extra} | {r['eval_loss']['mean']:.3f} ± {r['eval_loss']['std']:.3f} | "
            f"{vs} | {per_seed(r, 'spikes')} | {per_seed(r, 'shifts')} | "
            f"{logit(r['max_attn_logit']['min'])}–{logit(r['max_attn_logit']['max'])}; "
            f"{logit(r['final_attn_logit']['min'])}–{logit(r['final_attn_logit']['max'])} | "
            f"{per_seed(r, 'skipped_steps')} | `python {' '.join(cmd[1:]) if cmd else '-'}` |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures: one per question, seeds as a mean line over a band

def figures(metrics: dict, rows: dict, out: pathlib.Path) -> list[pathlib.Path]:
    plt = pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3
    paths = []

    def save(fig, name):
        paths.append(save_figure(fig, out / name, dpi=100))

    def panels(names, title, name):
        fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2, 2]})
        for run, color in zip([n for n in names if n in metrics], colors):
            seed_curves(axes[0], metrics[run], "loss", color, run)
            seed_curves(axes[1], metrics[run], "update_norm", color, run, log=True, raw=False)
            seed_curves(axes[2], metrics[run], "attn_logit_max", color, run, log=True,
                        raw=False)
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("train loss (nats/byte)")
        axes[0].set_title(title, fontsize=10)
        axes[0].legend(fontsize=8, ncol=2)
        lo = min(np.nanmin(ema(m["loss"])[50:]) for n in names if n in metrics
                 for m in metrics[n].values())
        axes[0].set_ylim(lo - 0.1, lo + 1.4)
        axes[1].set_ylabel("log10 update norm")
        axes[2].set_ylabel("log10 max |attn logit|")
        axes[2].set_xlabel("step")
        save(fig, name)

    seeds = f"{len(next(iter(metrics.values())))} seeds"
    def drawn_in(panel):
        return [e.name for e in EXPERIMENTS if panel in e.panels and e.name in metrics]

    for panel, (file, title) in PANELS.items():
        names = drawn_in(panel)
        if not names:
            continue
        panels(names, f"{title}\n{seeds}: the mean's EMA, a band from the lowest to the highest "
               "seed's", file)

    grid = drawn_in(LOGITS)
    if grid:
        fig, axes = plt.subplots(1, len(grid), figsize=(3 * len(grid), 2.8), sharey=True,
                                 squeeze=False)
        for ax, name in zip(axes[0], grid):
            m = metrics[name][min(metrics[name])]
            for layer in range(m["attn_logit_max"].shape[1]):
                ax.semilogy(m["step"], m["attn_logit_max"][:, layer], lw=0.9,
                            label=f"layer {layer}")
            ax.set_title(f"{name} (seed {min(metrics[name])})", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("max |attn logit|")
        axes[0][0].legend(fontsize=7)
        save(fig, "attn_logits_per_layer.png")

    events = mechanism(metrics.get("baseline", {}))
    if events:  # one bar group per event: how far each layer's norms moved, at the event
        keys = (("update", "update norm"), ("mu", "Adam first moment m"),
                ("nu", "Adam second moment v"), ("logit", "max attn logit"))
        fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.1 * len(keys)), sharex=True)
        x = np.arange(len(events))
        L = len(events[0]["update"])
        for ax, (key, label) in zip(axes, keys):
            for layer in range(L):
                ax.bar(x + (layer - (L - 1) / 2) * 0.8 / L, [e[key][layer] for e in events],
                       0.8 / L, color=colors[layer], label=f"layer {layer}")
            ax.axhline(1, color="k", lw=0.6)
            ax.set_yscale("log")
            ax.set_ylabel(f"{label}\nx pre-event", fontsize=8)
            ax.grid(alpha=0.3, axis="y")
        axes[0].legend(fontsize=7, ncol=L)
        axes[0].set_title("the baseline's loss events: each layer's norm at the event (max over "
                          "its +-5 steps) over its mean 100-20 steps before", fontsize=9)
        axes[-1].set_xticks(x, [f"s{e['seed']} {e['kind']}\n{e['step']}" for e in events],
                            fontsize=7)
        save(fig, "mechanism.png")
    return paths


def mechanism(runs: dict[int, dict]) -> list[dict]:
    """Per loss event (one-step spike or level shift) of each seed's run: the update-norm
    spike's lead (report.py), and per layer how far the update norm, Adam's moments m and v
    (norms read from the optimizer state) and the max attention logit moved: the max over the
    event's +-5 steps over the mean of the window 100 to 20 steps before. `first_layer`: the
    layer whose update norm first exceeded 1.5x that mean in the 20 steps up to the event."""
    out = []
    for seed, m in sorted(runs.items()):
        if "adam_mu_norm_per_layer" not in m:
            continue
        events = [(s.step, "spike", s.update_lead) for s in find_spikes(m)] + \
            [(s.step, "shift", None) for s in find_shifts(m)]
        for step, kind, lead in sorted(events):
            if step < 100 or step + 6 > len(m["step"]):
                continue
            pre, at = slice(step - 100, step - 20), slice(step - 5, step + 6)
            ratio = {key: (m[name][at].max(0) / m[name][pre].mean(0)).round(2).tolist()
                     for key, name in (("update", "update_norm_per_layer"),
                                       ("mu", "adam_mu_norm_per_layer"),
                                       ("nu", "adam_nu_norm_per_layer"),
                                       ("logit", "attn_logit_max"))}
            u = m["update_norm_per_layer"]
            above = u[step - 20:step + 1] > 1.5 * u[pre].mean(0)
            firsts = [int(np.argmax(above[:, i])) if above[:, i].any() else 99
                      for i in range(u.shape[1])]
            out.append({"seed": seed, "kind": kind, "step": step,
                        "update_lead": None if lead is None else int(lead),
                        "first_layer": int(np.argmin(firsts)) if min(firsts) < 99 else None,
                        **ratio})
    return out


def mechanism_table(events: list[dict]) -> str:
    if not events:
        return ""
    lines = ["| seed | event | step | update-norm spike first | first layer over 1.5x | "
             "update norm x | m x | v x | max logit x (per layer 0..) |", "|---" * 9 + "|"]
    for e in events:
        lead = "—" if e["update_lead"] is None else f"{e['update_lead']} steps"
        lines.append(f"| {e['seed']} | {e['kind']} | {e['step']} | {lead} | "
                     f"{'—' if e['first_layer'] is None else e['first_layer']} | "
                     + " | ".join("/".join(f"{x:.1f}" for x in e[k])
                                  for k in ("update", "mu", "nu", "logit")) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The harness rows' tables and figures: the levers, the LR sweep

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
    path = search.CURVES / f"{group}.npz"
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
        first = np.load(search.CURVES / f"{g.name}.npz")["loss"][:, 0]
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
    """Wortsman et al.'s LR sensitivity per seed, without and with QK-Norm, over the LRs of his
    range (SENSITIVITY_LRS) both arms have finished (None before two such LRs)."""
    lrs = [lr for lr in both_arms(rows) if lr in SENSITIVITY_LRS]
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
        grid = [x for x in sorted(SWEEP_LRS) if x in SENSITIVITY_LRS]
        done = [x for x in both_arms(rows) if x in SENSITIVITY_LRS]
        lines.append(
            f"\nLR sensitivity (Wortsman et al.: the mean over the LRs of min(final, initial "
            f"loss) minus the best final loss; a non-finite run counts at the initial loss) over "
            f"the LRs {', '.join(f'{x:g}' for x in done)}, those of the grid in his range, "
            f"3e-4 to 3e-1"
            + ("" if len(done) == len(grid) else f" ({len(done)} of its {len(grid)}; "
               f"{', '.join(f'{x:g}' for x in grid if x not in done)} not run in both arms)")
            + f", mean ± sd over seeds: **{np.mean(sens[False]):.3f} ± "
            f"{np.std(sens[False], ddof=1):.3f}** without QK-Norm, **{np.mean(sens[True]):.3f} "
            f"± {np.std(sens[True], ddof=1):.3f}** with it.")
    return "\n".join(lines)


def members_by_lr(record: dict, name: str) -> dict[float, list[dict]]:
    """A harness group's members per LR, each LR's in seed order."""
    by_lr: dict = {}
    for m in sorted(record["groups"][name]["members"], key=lambda m: m["seed"]):
        by_lr.setdefault(m["lr"], []).append(m)
    return by_lr


def width_rows(record: dict) -> list[dict]:
    """Per width and arm run so far: per LR the seeds' held-out loss at the end (NaN where the
    run went non-finite) and whether each had a level shift (or went non-finite); the best LR
    (the lowest mean held-out), whether the grid brackets it, the break LR (the lowest LR with a
    level shift in at least half the seeds), their distance in decades, each seed's own best
    and break LR (their spread over seeds), and Wortsman's LR sensitivity per seed over the LRs
    run in his range (SENSITIVITY_LRS)."""
    rows = []
    for g in WIDTH_ROWS:
        if g.name not in record["groups"]:
            continue
        by_lr = members_by_lr(record, g.name)
        lrs = sorted(by_lr)
        final = {lr: [m["eval_loss"][-1] if m["finite"] else math.nan for m in by_lr[lr]]
                 for lr in lrs}
        broke = {lr: [bool(m["shift_steps"]) or not m["finite"] for m in by_lr[lr]]
                 for lr in lrs}
        means = [np.mean(final[lr]) if np.all(np.isfinite(final[lr])) else math.inf
                 for lr in lrs]
        best = lrs[int(np.argmin(means))]
        brk = next((lr for lr in lrs if np.mean(broke[lr]) >= 0.5), None)
        seeds = [m["seed"] for m in by_lr[lrs[0]]]
        per_seed = [{lr: final[lr][i] if np.isfinite(final[lr][i]) else math.inf for lr in lrs}
                    for i in range(len(seeds))]
        initial = [float(np.load(search.SEED_CURVES / g.name / f"lr{lrs[0]:g}-seed{s}.npz")
                         ["loss"][0]) for s in seeds]  # the first step's train loss
        sens = [lr_sensitivity({lr: final[lr][i] for lr in lrs if lr in SENSITIVITY_LRS},
                               initial[i])
                for i in range(len(seeds))]
        rows.append({"width": g.d_model, "qk_norm": g.qk_norm, "lrs": lrs, "final": final,
                     "broke": broke, "best_lr": best,
                     "bracketed": lrs[0] < best < lrs[-1],
                     "cpu": record["groups"][g.name].get("machine", {}).get("cpu"),
                     "break_lr": brk, "decades": math.log10(brk / best) if brk else None,
                     "best_lr_seeds": [min(f, key=f.get) for f in per_seed],
                     "break_lr_seeds": [next((lr for lr in lrs if broke[lr][i]), None)
                                        for i in range(len(seeds))],
                     "sensitivity": sens, "initial": float(np.mean(initial)),
                     "max_logit": {lr: max(m["max_attn_logit"] for m in by_lr[lr])
                                   for lr in lrs}})
    return rows


def widths_markdown(record: dict) -> str:
    rows = width_rows(record)
    if not rows:
        return "no width of the proxy run yet (python experiments.py width32 width32-qk ...)"
    lines = ["| d_model | QK-Norm | best LR (each seed's) | bracketed | break LR: level shifts "
             "in >= half the seeds (each seed's first) | best to break, decades | "
             "LR sensitivity, mean [95% interval] |", "|---" * 7 + "|"]
    for r in rows:
        lo, hi = bootstrap(r["sensitivity"])
        lines.append(
            f"| {r['width']} | {'yes' if r['qk_norm'] else 'no'} | {r['best_lr']:g} "
            f"({', '.join(format(x, 'g') for x in r['best_lr_seeds'])}) | "
            f"{'yes' if r['bracketed'] else 'no: at the edge of the grid'} | "
            f"{'none in the grid' if r['break_lr'] is None else format(r['break_lr'], 'g')} "
            f"({', '.join('none' if x is None else format(x, 'g') for x in r['break_lr_seeds'])})"
            f" | {'—' if r['decades'] is None else format(r['decades'], '.1f')} | "
            f"{np.mean(r['sensitivity']):.3f} [{lo:.3f}, {hi:.3f}] |")
    return "\n".join(lines + [""] + widths_answer(rows))


def widths_answer(rows: list[dict]) -> list[str]:
    """The issue's three questions, read off the rows (a break beyond the grid counts as above
    it): does the break LR fall as the width grows, does the best-to-break distance shrink,
    does QK-Norm move the break LR up at every width?"""
    def brk(r):
        return math.inf if r["break_lr"] is None else r["break_lr"]

    def show(x, fmt):
        return "none" if x in (None, math.inf) else format(x, fmt)
    out = []
    for qk in (False, True):
        arm = sorted((r for r in rows if r["qk_norm"] == qk), key=lambda r: r["width"])
        if len(arm) < 2:
            continue
        gaps = [math.inf if r["decades"] is None else r["decades"] for r in arm]
        falls = all(brk(b) < brk(a) for a, b in zip(arm, arm[1:]))
        shrinks = all(b < a for a, b in zip(gaps, gaps[1:]))
        by_width = ", ".join(f"{r['width']}: {show(r['break_lr'], 'g')}" for r in arm)
        out.append(
            f"- {'with' if qk else 'without'} QK-Norm: the break LR by width {by_width} "
            f"({'falls' if falls else 'does not fall'} at every step); best to break in "
            f"decades {', '.join(show(x, '.1f') for x in gaps)} "
            f"({'shrinks' if shrinks else 'does not shrink'} at every step).")
    pairs: dict = {}
    for r in rows:
        pairs.setdefault(r["width"], {})[r["qk_norm"]] = r
    both = [w for w in sorted(pairs) if len(pairs[w]) == 2]
    if both:
        up = [w for w in both if brk(pairs[w][True]) > brk(pairs[w][False])]
        out.append(f"- QK-Norm moves the break LR up at {len(up)} of {len(both)} widths "
                   f"({', '.join(map(str, up)) or 'none'}).")
    return out


def zloss_rows(record: dict) -> list[dict]:
    """Per z-loss group run so far and LR (Wortsman et al. §3.2): the seeds' held-out loss at
    the end (NaN where the run went non-finite), how many had a level shift or went non-finite,
    and from the stored curves the largest |output logit| over the run and the mean log Z over
    the last 100 finite steps; the largest attention logit."""
    rows = []
    for g in ZLOSS_ROWS:
        if g.name not in record["groups"]:
            continue
        for lr, ms in sorted(members_by_lr(record, g.name).items()):
            curves = [np.load(search.SEED_CURVES / g.name / f"lr{lr:g}-seed{m['seed']}.npz")
                      for m in ms]
            log_z = [c["log_z"][np.isfinite(c["log_z"])][-100:] for c in curves]
            rows.append({
                "z_loss": g.z_loss_weight, "qk_norm": g.qk_norm, "lr": lr,
                "seeds": [m["seed"] for m in ms],
                "cpu": record["groups"][g.name].get("machine", {}).get("cpu"),
                "final": [m["eval_loss"][-1] if m["finite"] else math.nan for m in ms],
                "broke": sum(bool(m["shift_steps"]) or not m["finite"] for m in ms),
                "out_logit_max": [float(np.nanmax(c["out_logit_max"])) for c in curves],
                "log_z_end": [float(np.mean(z)) if len(z) else math.nan for z in log_z],
                "max_attn_logit": [m["max_attn_logit"] for m in ms]})
    return rows


def finite_mean(xs: list[float]) -> str:
    """The mean of the finite values, or a dash when there are none."""
    f = [x for x in xs if math.isfinite(x)]
    return f"{np.mean(f):.2f}" if f else "—"


def zloss_markdown(record: dict) -> str:
    rows = zloss_rows(record)
    if not rows:
        return "no z-loss group run yet (python experiments.py zloss0-width32 ...)"
    lines = ["| z-loss | QK-Norm | LR | held-out at the end, mean (lowest, highest seed) | "
             "level shift or non-finite | max \\|output logit\\| | log Z, last 100 steps "
             "(mean over seeds) | max \\|attn logit\\| |", "|---" * 8 + "|"]
    for r in rows:
        f = np.asarray(r["final"])
        held = (f"{np.mean(f):.3f} ({np.min(f):.3f}, {np.max(f):.3f})" if np.all(np.isfinite(f))
                else f"{int(np.sum(~np.isfinite(f)))} of {len(f)} non-finite")
        lines.append(f"| {r['z_loss']:g} | {'yes' if r['qk_norm'] else 'no'} | {r['lr']:g} | "
                     f"{held} | {r['broke']} of {len(f)} | {np.nanmax(r['out_logit_max']):.3g} | "
                     f"{finite_mean(r['log_z_end'])} | {np.nanmax(r['max_attn_logit']):.3g} |")
    return "\n".join(lines + [""] + zloss_answer(rows))


def zloss_answer(rows: list[dict]) -> list[str]:
    """Per arm: z-loss off minus on in held-out loss at the end, paired by seed and LR (pairs
    with a non-finite run left out), mean with its 95% bootstrap interval, and the largest
    |output logit| and the range of log Z at the end, off and on."""
    out = []
    for qk in (False, True):
        off = {r["lr"]: r for r in rows if r["qk_norm"] == qk and r["z_loss"] == 0}
        on = {r["lr"]: r for r in rows if r["qk_norm"] == qk and r["z_loss"] > 0}
        pairs = [a - b for lr in sorted(off.keys() & on.keys())
                 for s, a in zip(off[lr]["seeds"], off[lr]["final"])
                 for t, b in zip(on[lr]["seeds"], on[lr]["final"])
                 if s == t and math.isfinite(a) and math.isfinite(b)]
        if not pairs:
            continue
        lo, hi = bootstrap(pairs)
        out.append(f"- {'with' if qk else 'without'} QK-Norm: held-out, z-loss off minus on "
                   f"({len(pairs)} seed-and-LR pairs): mean {np.mean(pairs):+.3f} [{lo:+.3f}, "
                   f"{hi:+.3f}], {sum(d < 0 for d in pairs)} of {len(pairs)} lower without it; "
                   f"off: {output_logits(off.values())}; on: {output_logits(on.values())}.")
    return out


def output_logits(rows) -> str:
    """The largest |output logit| and the range of log Z at the end over these z-loss rows."""
    z = [v for r in rows for v in r["log_z_end"] if math.isfinite(v)]
    top = max(np.nanmax(r["out_logit_max"]) for r in rows)
    return f"max |output logit| {top:.3g}" + (f", log Z at the end {min(z):.2f} to {max(z):.2f}"
                                               if z else "")


def plot_zloss(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/zloss.png: held-out loss at the end and the largest |output logit| against the
    LR, z-loss off (solid) and on (dashed), without and with QK-Norm (colour); mean over the
    finite seeds; the logit axis is logarithmic where they span more than a decade."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    rows = zloss_rows(record)
    for (z, qk) in sorted({(r["z_loss"], r["qk_norm"]) for r in rows}):
        arm = [r for r in rows if (r["z_loss"], r["qk_norm"]) == (z, qk)]
        label = f"z-loss {z:g}{', QK-Norm' if qk else ''}"
        for ax, key in zip(axes, ("final", "out_logit_max")):
            y = [np.mean(v) if len(v := [x for x in r[key] if math.isfinite(x)]) else np.nan
                 for r in arm]
            ax.plot([r["lr"] for r in arm], y, "--" if z else "-", color=f"C{int(qk)}",
                    marker="o", ms=3, label=label)
    axes[0].set_ylabel("held-out loss at the end (nats/byte)")
    axes[1].set_ylabel("max |output logit| over the run")
    logits = [x for r in rows for x in r["out_logit_max"] if math.isfinite(x)]
    if max(logits) > 10 * min(logits):
        axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[0].set_title("d_model 32 around its break: z-loss off and on (3 seeds)", fontsize=9)
    return save_figure(fig, out / "zloss.png", dpi=100)


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


def plot_widths(record: dict, out: pathlib.Path) -> pathlib.Path:
    """results/widths.png, Wortsman et al.'s Fig. 1 at CPU scale: per width, held-out loss at
    the end and the max attention logit against the LR, without QK-Norm (solid) and with it
    (dashed); mean over seeds (a non-finite run leaves its LR out); crosses: LRs where at least
    half the seeds had a level shift or went non-finite. The loss axis ends at the loss before
    training (the cap of Wortsman's LR sensitivity); a mean above it is drawn on that edge as a
    triangle. Third panel: LR sensitivity per width and arm, mean over seeds with its 95%
    bootstrap interval."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    rows = width_rows(record)
    widths = sorted({r["width"] for r in rows})
    top = max(r["initial"] for r in rows)
    for r in rows:
        color = f"C{widths.index(r['width'])}"
        style = "--" if r["qk_norm"] else "-"
        label = f"d_model {r['width']}{', QK-Norm' if r['qk_norm'] else ''}"
        for ax, y in zip(axes, ([np.mean(r["final"][lr]) for lr in r["lrs"]],
                                [r["max_logit"][lr] for lr in r["lrs"]])):
            ax.plot(r["lrs"], y, style, color=color, marker="o", ms=3, label=label)
            broke = [(lr, v) for lr, v in zip(r["lrs"], y) if np.mean(r["broke"][lr]) >= 0.5
                     and np.isfinite(v)]
            if broke:
                ax.plot(*zip(*broke), "x", color=color, ms=8)
        above = [lr for lr in r["lrs"] if np.mean(r["final"][lr]) > top]
        if above:
            axes[0].plot(above, [top] * len(above), "^", color=color, ms=7, clip_on=False)
    for qk, style in ((False, "-"), (True, "--")):
        arm = sorted((r for r in rows if r["qk_norm"] == qk), key=lambda r: r["width"])
        mean = [np.mean(r["sensitivity"]) for r in arm]
        ci = np.array([bootstrap(r["sensitivity"]) for r in arm]).reshape(-1, 2)
        axes[2].errorbar([r["width"] for r in arm], mean, yerr=np.abs(ci.T - mean),
                         fmt=style, marker="o", capsize=3, color="k" if qk else "0.5",
                         label="with QK-Norm" if qk else "without QK-Norm")
    axes[0].set_ylim(top=top)
    axes[0].set_ylabel("held-out loss at the end (nats/byte)")
    axes[1].set_ylabel("max |attn logit| over the run")
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xticks(widths, [str(w) for w in widths])
    axes[2].set_xlabel("d_model")
    axes[2].set_ylabel("LR sensitivity, LRs 3e-4 to 3e-1 (nats/byte)")
    axes[2].legend(fontsize=7)
    axes[0].legend(fontsize=7)
    axes[0].set_title("LR sweep per width (3 seeds; x: level shifts in >= half the seeds)",
                      fontsize=9)
    return save_figure(fig, out / "widths.png", dpi=100)


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
            for y in np.load(search.CURVES / f"{group}.npz")["loss"]:
                ax.plot(ema(y.astype(np.float64)), style, color=color, lw=0.7)
        curves = np.load(search.CURVES / f"{name}.npz")["loss"]
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


# ---------------------------------------------------------------------------------------------
# The evidence: rates with intervals over seeds, from the stored curves only (report.py's rules)

def seed_curve(group: str, seed: int) -> dict:
    """A member's stored curve as report.py reads a run: per-step arrays indexed by "step"
    (a fork's start at its fork step), and its evals."""
    c = np.load(search.SEED_CURVES / group / f"seed{seed}.npz")
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
                                                          "escalated_at", "data_records")
                   if k in members[0]}
        guarded |= {"run_steps": g.steps} if guarded else {}
        rows.append({"group": g.name, "seeds": seeds, "per_seed": per, "guard": guarded,
                     "cpu": record["groups"][g.name].get("machine", {}).get("cpu", "?"),
                     **{key: {"values": [float(x) for x in v], "mean": float(np.mean(v)),
                              "ci": bootstrap(v)} for key, v in stats.items()},
                     "survival": survival([r for p in per for r in p["recoveries"]])})
    return rows


# The README's summary of the evidence, in this order, under these names.
README_ROWS = (
    ("story8", "baseline"), ("story8-qk", "QK-Norm from scratch"),
    ("story8-marin-32b", "the 32B's levers together"),
    ("story8-qk-inserted", "QK-Norm inserted mid-run"),
    ("story8-qk-clip-100", "QK-Clip 100 from scratch"),
    ("story8-muon", "Muon (LM head on AdamW) from scratch"),
    ("story8-muonclip-100", "MuonClip (Muon + QK-Clip 100)"),
    ("story8-clip-0.2", "gradient clipping 0.2 alone"),
    ("story8-skip-step", "skip-step (OLMo 2) alone"),
    ("story8-update-clip-norm", "update-norm clipping alone"),
    ("story8-update-clip-rms", "update-RMS clipping alone"),
    ("story8-zclip", "ZClip alone"),
    ("story8-softcap-50", "soft-cap 50 (Gemma 2)"),
    ("story8-guard-escalate", "the guard, escalating to QK-Norm (train.py)"),
    ("story8-guard-escalate-data", "the same, with its data check"),
    ("story8-guard-predict", "the guard, predicting: max logit > 100 at a checkpoint"),
    ("story8-guard-predict-only", "the same, its spike rule off"),
    ("story8-qk-clip-switched", "QK-Clip 100 switched on mid-run (from the rerun below)"),
    ("story8-rerun", "the baseline again, final code"))


def readme_summary(rows: list[dict]) -> str:
    """The README's evidence table: README_ROWS that have run, four figures each."""
    by = {r["group"]: r for r in rows}

    def cell(r, key, fmt):
        lo, hi = r[key]["ci"]
        return f"{fmt.format(r[key]['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"
    lines = ["| row (8 seeds; 95% bootstrap intervals) | seeds with a level shift | level-shift "
             "episodes / 1k steps | held-out (nats/byte) | max attn logit |", "|---" * 5 + "|"]
    for group, label in README_ROWS:
        if (r := by.get(group)) is None:
            continue
        n, shifted = len(r["seeds"]), round(sum(r["with_shift"]["values"]))
        rate = cell(r, "level_shift_episodes", "{:.2f}") if shifted else "0"
        lines.append(f"| {label}{f' ({n} seeds)' if n != 8 else ''} | {shifted} of {n} | {rate} "
                     f"| {cell(r, 'eval', '{:.3f}')} | {cell(r, 'max_logit', '{:,.0f}')} |")
    return "\n".join(lines)


def evidence_markdown(rows: list[dict]) -> str:
    """The evidence table (rates per 1,000 steps after S1, mean [95% bootstrap interval] over
    seeds), the old rules' counts beside it, and each row's recovery survival table."""
    if not rows:
        return "the 8-seed baseline and its QK-Norm twin have not both run yet"

    def cell(r, key, fmt="{:.2f}"):
        lo, hi = r[key]["ci"]
        return f"{fmt.format(r[key]['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"
    name = {"story8": "baseline", "story8-qk": "QK-Norm from scratch",
            "story8-rerun": "baseline again (final code)"}
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
                + (f"; level shifts taken as the data's: {sum(gd['data_records'])} "
                   f"({', '.join(map(str, gd['data_records']))} per seed)"
                   if "data_records" in gd else "") + ".")
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
        raise UserError(f"--rerun {name}: not an evidence row that has run; python experiments.py "
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


def write_results_json(part: dict) -> None:
    """results/results.json with `part`'s keys (re)written and the other keys kept: the
    train.py rows and the width sweep are written by different commands."""
    path = RESULTS / "results.json"
    RESULTS.mkdir(exist_ok=True)
    out = json.loads(path.read_text()) if path.exists() else {}
    path.with_suffix(".partial").write_text(strict_json(out | part, indent=1) + "\n")
    path.with_suffix(".partial").replace(path)


def write_results(seeds: list[int]) -> None:
    rows, metrics = collect(seeds)
    if not rows:
        raise UserError(f"no finished runs in {RUNS}: run the experiments first")
    RESULTS.mkdir(exist_ok=True)
    wall = [r["wall_s"] for row in rows.values() if "seeds" in row
            for r in row["seeds"].values() if r["wall_s"]]
    events = mechanism(metrics.get("baseline", {}))
    out = {"machine": machine(), "seeds": seeds, "runs_wall_s_total": sum(wall), "rows": rows,
           "baseline_events": events}
    write_results_json(out)
    paths = figures(metrics, rows, RESULTS)
    text = table(rows, seeds)
    if events:
        text += ("\n\nThe baseline's loss events, per layer (0 = lowest): each norm at the event "
                 "over its level before (results/mechanism.png).\n\n" + mechanism_table(events))
    print(text)
    update_readme(text)
    print(f"wrote {RESULTS}/results.json, {', '.join(map(str, paths))} and the table in "
          f"{RESULTS}/README.md")


@dataclasses.dataclass(frozen=True)
class Args:
    names: tyro.conf.Positional[tuple[str, ...]] = ()  # rows to run (default: the train.py rows)
    seeds: str = "0,1,2"  # every train.py row runs once per seed (a harness row has its own)
    jobs: int = 2  # train.py runs side by side
    list: bool = False  # every row: its command(s), or whether the harness row has run
    runs_only: bool = False  # make the runs, not the results
    results_only: bool = False  # tables and figures from the runs already made
    levers: bool = False  # the levers from scratch (harness rows), their table
    sweep: bool = False  # the LR sweep and its LR sensitivity
    evidence: bool = False  # the 8-seed rates with intervals
    widths: bool = False  # Wortsman's proxy across widths: best and break LR per width
    zloss: bool = False  # the output-logit divergence at d_model 32: z-loss off against on
    plot: bool = False  # with a table flag: its figure, and the table into results/README.md
    rerun: str = ""  # train one stored member of this evidence row again (with --seed)
    seed: int = 0  # the seed --rerun trains again


def harness_tables(args: Args) -> None:
    """--levers, --sweep, --evidence (with --plot: figures and results/README.md), --rerun."""
    record = load()
    if args.rerun:
        print(f"rerunning {args.rerun} seed {args.seed} on {machine()['cpu']} (the row ran on "
              f"{record['groups'].get(args.rerun, {}).get('machine', {}).get('cpu', '?')})")
        for key, v, ci, span, in_ci, in_span in rerun(args.rerun, args.seed):
            print(f"  {key:<22} {v:10.3f}   row mean's 95% interval [{ci[0]:.3f}, {ci[1]:.3f}]"
                  f" {'inside' if in_ci else 'OUTSIDE'}; seeds' range [{span[0]:.3f}, "
                  f"{span[1]:.3f}] {'inside' if in_span else 'OUTSIDE'}")
        return
    evidence = evidence_rows(record) if args.evidence else []
    if evidence and args.plot:
        update_readme(readme_summary(evidence), pathlib.Path("README.md"), "evidence-summary")
    for flag, text, part, figure in (
            (args.levers, levers_markdown, "levers", plot_levers),
            (args.sweep, sweep_markdown, "lr-sweep", plot_sweep),
            (args.evidence, lambda r: evidence_markdown(evidence), "evidence",
             lambda r, out: plot_evidence(evidence, out)),
            (args.widths, widths_markdown, "widths", plot_widths),
            (args.zloss, zloss_markdown, "zloss", plot_zloss)):
        if not flag:
            continue
        print(table := text(record))
        if args.plot:
            if figure:
                print(f"wrote {figure(record, RESULTS)}")
            update_readme(table, part=part)
            print(f"wrote the table in {RESULTS}/README.md")
            if rows := {"widths": width_rows, "zloss": zloss_rows}.get(part):
                key = "widths" if part == "widths" else "widths_zloss"
                write_results_json({key: rows(record)})
                print(f"wrote the rows in {RESULTS}/results.json ({key!r})")


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    if args.levers or args.sweep or args.evidence or args.widths or args.zloss or args.rerun:
        harness_tables(args)
        return 0
    names = list(args.names)
    unknown = [n for n in names if n not in NAMES and n not in HARNESS_ROWS]
    if unknown:
        raise UserError(f"unknown row {unknown[0]!r}: train.py rows {', '.join(NAMES)}; "
                        f"harness rows: python experiments.py --list")
    harness = [HARNESS_ROWS[n] for n in names if n in HARNESS_ROWS]
    names = [n for n in names if n in BY_NAME]
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds takes integers like 0,1,2, got {args.seeds!r}") from None
    if args.jobs < 1:
        raise UserError("--jobs must be at least 1")
    chosen = names or ([] if harness else NAMES)
    if args.list:
        done = load()["groups"]
        for name in chosen:
            for seed in seeds:
                cmd = (command_for(name, seed) if BY_NAME[name].start == "train" else None)
                print(f"{run_dir(name, seed).name:<26} python {' '.join(cmd[1:])}" if cmd else
                      f"{run_dir(name, seed).name:<26} (decided once its source run is done)")
        for g in harness or HARNESS_ROWS.values():
            print(f"{g.name:<26} (harness, seeds {','.join(map(str, g.seeds))}) "
                  f"{'done' if g.name in done else 'to run'}")
        return 0
    if harness:  # search.py's harness; results/search.json and results/curves/ as each ends
        search.run(harness)
    codes = {}
    if chosen and not args.results_only:
        t = time.perf_counter()
        codes = run_all(chosen, seeds, args.jobs)
        print(f"runs done in {(time.perf_counter() - t) / 60:.1f} min", flush=True)
    if args.runs_only or not chosen:
        return 0
    write_results(seeds)
    failed = {n: c for n, c in codes.items() if c not in (0, 1)}  # 1: stopped, non-finite
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
