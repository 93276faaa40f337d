"""The spike story at CPU scale, over seeds: one train.py / warmstart.py command per run.

    python experiments.py                  # everything (~2 hours on 2 cores), then the results
    python experiments.py baseline rescue --seeds 0,1,2 --jobs 1
    python experiments.py --list           # the command of every run
    python experiments.py --results-only   # tables and figures from the runs already made

These are the story's runs that need train.py itself: the baseline and everything started from
its checkpoints (or from another run's), the guard, and the 32B's configuration with QK-Norm
inserted into it; the levers from scratch run in search.py's vmapped harness. Every run is
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
    compare,
    ema,
    find_shifts,
    find_spikes,
    machine,
    pyplot,
    read_metrics,
    save_figure,
    seed_curves,
    spread,
    summary,
    update_readme,
)

RUNS, RESULTS = pathlib.Path("runs/exp"), pathlib.Path("results")
STORY = "story"  # the preset (train.py)
REWARMUP = 100
REPLACED = 20  # replace-batches: the batches of this many steps before the event


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One row of the results: how its runs are made, what it is compared with, where it is
    drawn. Adding a lever is adding one of these."""
    name: str
    flags: tuple[str, ...] = ()  # train.py flags on top of the preset
    preset: str = STORY
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
    twin = json.loads(path.read_text())["groups"].get(search.twin(search.STORY).name, {})
    mine = [x for x in twin.get("members", []) if x["seed"] == seed]
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
    (RESULTS / "results.json").write_text(strict_json(out, indent=1) + "\n")
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
    names: tyro.conf.Positional[tuple[str, ...]] = ()  # experiments to run (default: all)
    seeds: str = "0,1,2"  # every experiment runs once per seed
    jobs: int = 2  # runs side by side
    list: bool = False  # print the command of every run and stop
    runs_only: bool = False  # make the runs, not the results
    results_only: bool = False  # tables and figures from the runs already made


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    names = list(args.names)
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise UserError(f"unknown experiment {unknown[0]!r}: choose from {', '.join(NAMES)}")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds takes integers like 0,1,2, got {args.seeds!r}") from None
    if args.jobs < 1:
        raise UserError("--jobs must be at least 1")
    chosen = names or NAMES
    if args.list:
        for name in chosen:
            for seed in seeds:
                cmd = (command_for(name, seed) if BY_NAME[name].start == "train" else None)
                print(f"{run_dir(name, seed).name:<26} python {' '.join(cmd[1:])}" if cmd else
                      f"{run_dir(name, seed).name:<26} (decided once its source run is done)")
        return 0
    codes = {}
    if not args.results_only:
        t = time.perf_counter()
        codes = run_all(chosen, seeds, args.jobs)
        print(f"runs done in {(time.perf_counter() - t) / 60:.1f} min", flush=True)
    if args.runs_only:
        return 0
    write_results(seeds)
    failed = {n: c for n, c in codes.items() if c not in (0, 1)}  # 1: stopped, non-finite
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
