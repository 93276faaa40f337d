"""The laboratory's runner: every row of lab/rows.py, trained and tabled. Run from the
repository root:

    python -m lab.experiments                    # the train.py rows (~2 hours on 2 cores), results
    python -m lab.experiments baseline rescue --seeds 0,1,2 --jobs 1
    python -m lab.experiments --list             # every row: its command, or whether it has run
    python -m lab.experiments --results-only     # tables and figures from the runs already made
    python -m lab.experiments story8 story8-qk   # harness rows: seeds in one vmapped step,
                                                 # one process pinned to each core
    python -m lab.experiments width128-mup@0.01  # one LR of a row, kept (lab/spread.py)
    python -m lab.experiments --evidence --plot  # the 8-seed rates with intervals, figure, README
    python -m lab.experiments --rerun story8 --seed 3   # one stored member again: inside its row?
    python -m lab.experiments --widths           # best and break LR per width (Wortsman's proxy)
    python -m lab.experiments --zloss            # z-loss off against on at d_model 32 (its §3.2)

The train.py rows need train.py itself: the baseline and everything started from its
checkpoints (or from another run's), the guard, and the 32B's configuration with QK-Norm
inserted into it. Every such run is exactly the command `--list` prints, in runs/exp/NAME-sSEED;
a finished run is not run again, so an interrupted suite resumes where it stopped. The seed sets
both the initialisation (--seed) and the data order (--data.seed). Some runs depend on others:
the rescues warm-start from a checkpoint of their source run, and the "replace-batches" runs
rewind their source to its last checkpoint before its largest loss event and go on with the
batches before that event replaced; they run once their sources are done. Their results -- per
run, read from its metrics.jsonl, then mean and spread over the seeds -- go to
results/results.json (with the machine and each run's wall time), the figures to results/*.png,
and the table into results/README.md between the `results` markers.

The harness rows (the levers from scratch, the LR sweep, the 8-seed evidence, the widths, the
knobs) are trained by lab/harness.py and tabled by lab/tables.py (the story's evidence) and
lab/breaks.py (best and break LR) from the stored curves. Nothing in a table is typed by hand.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tyro

from checkpoint import saved_steps
from cli import UserError, command, entry_point, parse
from config import PRESETS
from lab import harness, search, store
from lab.breaks import (
    knob_rows,
    knobs_markdown,
    lever_break_rows,
    lever_breaks_markdown,
    lever_breaks_top,
    sweep_markdown,
    width_rows,
    widths_markdown,
    zloss_markdown,
    zloss_rows,
)
from lab.figures import (
    figures,
    plot_evidence,
    plot_levers,
    plot_sweep,
    plot_widths,
    plot_zloss,
)
from lab.harness import train_members
from lab.rows import (
    BY_NAME,
    EVIDENCE_GROUPS,
    EXPERIMENTS,
    HARNESS_ROWS,
    NAMES,
    REPLACED,
    REWARMUP,
    STORY,
    Experiment,
    Group,
    twin,
)
from lab.spread import core_queues, run_pinned
from lab.stats import (
    compare,
    spread,
)
from lab.store import cpu_label, layer_max, load, machine, read_curve, same_bits
from lab.tables import (
    RESULTS,
    evidence_json,
    evidence_markdown,
    evidence_rows,
    judged,
    levers_markdown,
    mechanism,
    mechanism_table,
    probe_markdown,
    readme_summary,
    s1_markdown,
    switch_markdown,
    teach_markdown,
    tune_markdown,
    update_readme,
    write_results_json,
)
from records import read_metrics
from report import find_shifts, find_spikes, summary

RUNS = pathlib.Path("runs/exp")


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
# The evidence: rates with intervals over seeds, from the stored curves only (report.py's rules)


RERUN_KEYS = ("level_shift_episodes", "instability_episodes", "episodes", "unrecovered",
              "unrecovered_twin", "eval", "max_logit")


def first_parting(stored: np.ndarray, again: np.ndarray) -> int | None:
    """The first step at which two float32 loss curves differ in a bit (None: equal over the
    shorter of the two; NaN equals NaN)."""
    n = min(len(stored), len(again))
    x, y = (np.asarray(c[:n], np.float32).view(np.uint32) for c in (stored, again))
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if len(diff) else None


def rerun_member(g: Group, seed: int, steps: int | None = None, log=print) -> tuple[dict, dict]:
    """Train `g`'s members again as the row trained them (every seed in one vmapped step, on
    this machine) for `steps` steps (default all; the harness's LR is constant after warmup,
    so a shorter probe takes the same steps), and set `seed`'s loss against its stored curve:
    ({"parts_at": the first step that differs in a bit or None, "compared": steps, "others":
    the other seeds' parts_at}, the member's arrays)."""
    cfg = g.config() if steps is None else dataclasses.replace(g.config(), steps=steps)
    a = train_members(cfg, g.seeds, log=log)
    member = {k: v if k in ("eval_step", "first_step", "seconds", "chunk_seconds")
              else v[g.seeds.index(seed)] for k, v in a.items()}
    stored = {s: read_curve(g.name, f"seed{s}")["loss"] for s in g.seeds}
    return ({"parts_at": first_parting(stored[seed], member["loss"]),
             "compared": min(len(stored[seed]), len(member["loss"])),
             "others": {s: first_parting(stored[s], a["loss"][i])
                        for i, s in enumerate(g.seeds) if s != seed}}, member)


def rerun(name: str, seed: int, steps: int | None = None, log=print) -> dict:
    """One stored member of an evidence row trained again the way its row was (rerun_member),
    and, over the whole run, judged by the same rules against a prediction for one new seed:
    the stored seeds' range (for a new draw from the same seeds' distribution, the chance to
    fall inside the range of n is (n - 1) / (n + 1): 7 in 9 for 8 seeds); a 0/1 figure
    ("unrecovered") as the count of seeds with it."""
    g = next((x for x in EVIDENCE_GROUPS if x.name == name), None)
    record = load()
    if g is None or name not in record["groups"]:
        raise UserError(f"--rerun {name}: not an evidence row that has run; "
                        "python -m lab.experiments --list")
    if g.fork:
        raise UserError(f"--rerun {name}: a mid-run row starts from its source's kept state; "
                        f"rerun {g.fork} instead")
    if g.guard:
        raise UserError(f"--rerun {name}: a guarded row's seeds are train.py runs (its loop's "
                        f"rollbacks and escalations), not the vmapped step; rerun seed {seed} "
                        f"with train.py, as runs/search/{name}/seed{seed}/config.json says")
    if seed not in g.seeds:
        raise UserError(f"--rerun {name} --seed {seed}: the row's seeds are {list(g.seeds)}")
    if steps is not None and not 0 < steps <= g.steps:
        raise UserError(f"--rerun-steps must be in 1..{g.steps}, got {steps}")
    bits, a = rerun_member(g, seed, steps, log)
    out = {"bits": bits, "figures": []}
    if steps is not None and steps < g.steps:
        return out  # a probe: its figures are not the run's
    n = len(a["loss"])
    curve = {"step": np.arange(n), "loss": a["loss"].astype(np.float64),
             "update_norm": a["update_norm"].astype(np.float64),
             "attn_logit_max": layer_max(a["attn_logit_max"]), "eval_step": a["eval_step"],
             "eval_loss": a["eval_loss"], "first_step": 0}
    p = judged(g, seed, "story8", "story8-qk", curve)
    k = 1000 / p["steps"]
    value = {"level_shift_episodes": k * sum(e.level_shift for e in p["episodes"]),
             "instability_episodes": k * sum(not e.hard_batch for e in p["episodes"]),
             "episodes": k * len(p["episodes"]),
             "unrecovered": float(any(not ok for _, ok in p["recoveries"])),
             "unrecovered_twin": float(any(not ok for _, ok in p["recoveries_twin"])),
             "eval": p["eval"], "max_logit": p["max_logit"]}
    row = next(r for r in evidence_rows(record) if r["group"] == name)
    for key in RERUN_KEYS:
        vals = row[key]["values"]
        out["figures"].append((key, value[key], (min(vals), max(vals)),
                               min(vals) <= value[key] <= max(vals), sum(vals)))
    return out


# ---------------------------------------------------------------------------------------------
# The train.py rows' results: per run from its metrics.jsonl, then over seeds

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
    = the run's metrics arrays (records.read_metrics)."""
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
    knobs: bool = False  # when is QK-Norm necessary: best -> break distance per knob, d_model 32
    breaks: bool = False  # how far each lever moves the break LR, d_model 32
    plot: bool = False  # with a table flag: its figure, and the table into results/README.md
    rerun: str = ""  # train one stored member of this evidence row again (with --seed)
    seed: int = 0  # the seed --rerun trains again
    rerun_steps: int | None = None  # --rerun: only this many steps (a probe of the bits)
    slim: bool = False  # rewrite the stored curves to what they keep now (store.curve_arrays)
    # harness rows run as one process pinned to each of this many cores (default: every core
    # this process may use), each process's rows one after the other: a row repeats bitwise
    # only with the same core count and CPU model (results/search.json records both)
    cores: int | None = None


def harness_tables(args: Args) -> None:
    """--levers, --sweep, --evidence (with --plot: figures and results/README.md), --rerun."""
    record = load()
    if args.rerun:
        ran = record["groups"].get(args.rerun, {}).get("machine", {})
        now = machine()
        print(f"rerunning {args.rerun} (its seeds vmapped in one step, as the row ran) on "
              f"{now['cpu']}, {len(now['affinity'])} core(s) {now['affinity']}; the row ran on "
              f"{ran.get('cpu', '?')}, {ran.get('cores', '?')} core(s)"
              + (f" {ran['affinity']}" if "affinity" in ran else " (its pinning not recorded)")
              + ". It repeats bitwise only where CPU, ISA, cores and JAX all match (taskset -c 0 "
              "for a row run on one pinned core): "
              + (f"here {', '.join(diff)} differ." if (diff := same_bits(ran, now)) else
                 "here they do."))
        out = rerun(args.rerun, args.seed, args.rerun_steps)
        at, n = out["bits"]["parts_at"], out["bits"]["compared"]
        print(f"  seed {args.seed}: " + (f"bitwise the stored curve over all {n} steps"
                                         if at is None else
                                         f"parts from the stored curve at step {at} of {n}"))
        print("  the row's other seeds: " + ", ".join(
            f"{s} {'bitwise' if x is None else f'parts at {x}'}"
            for s, x in out["bits"]["others"].items()))
        for key, v, span, inside, count in out["figures"]:
            print(f"  {key:<22} {v:10.3f}   " + (
                f"{count:.0f} of {len(record['groups'][args.rerun]['seeds'])} stored seeds "
                "had it" if key == "unrecovered" else
                f"the stored seeds' range [{span[0]:.3f}, {span[1]:.3f}] "
                f"{'inside' if inside else 'OUTSIDE'}"))
        return
    evidence = evidence_rows(record) if args.evidence else []
    if evidence and args.plot:
        update_readme(readme_summary(evidence), pathlib.Path("README.md"), "evidence-summary")
        write_results_json({"evidence": evidence_json(evidence)})
        update_readme(s1_markdown(record), part="s1")
        update_readme(probe_markdown(record), part="probes")
        update_readme(teach_markdown(record), part="teach")
        update_readme(tune_markdown(record), part="adamh-tune")
        update_readme(switch_markdown(record), part="switch")
        print(f"wrote the 8-seed rows in {RESULTS}/results.json ('evidence')")
    if args.breaks and args.plot:
        update_readme(lever_breaks_top(record), pathlib.Path("README.md"), "lever-breaks")
    for flag, text, part, figure in (
            (args.levers, levers_markdown, "levers", plot_levers),
            (args.sweep, sweep_markdown, "lr-sweep", plot_sweep),
            (args.evidence, lambda r: evidence_markdown(evidence), "evidence",
             lambda r, out: plot_evidence(evidence, out)),
            (args.widths, widths_markdown, "widths", plot_widths),
            (args.zloss, zloss_markdown, "zloss", plot_zloss),
            (args.knobs, knobs_markdown, "knobs", None),
            (args.breaks, lever_breaks_markdown, "lever-breaks", None)):
        if not flag:
            continue
        print(table := text(record))
        if args.plot:
            if figure:
                print(f"wrote {figure(record, RESULTS)}")
            update_readme(table, part=part)
            print(f"wrote the table in {RESULTS}/README.md")
            if rows := {"widths": width_rows, "zloss": zloss_rows, "knobs": knob_rows,
                        "lever-breaks": lever_break_rows}.get(part):
                key = {"widths": "widths", "zloss": "widths_zloss", "knobs": "knobs",
                       "lever-breaks": "lever_breaks"}[part]
                write_results_json({key: rows(record)})
                print(f"wrote the rows in {RESULTS}/results.json ({key!r})")


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    if (args.seed or args.rerun_steps is not None) and not args.rerun:
        raise UserError("--seed and --rerun-steps go with --rerun ROW (python -m lab.experiments "
                        "--rerun story8 --seed 3)")
    if args.slim:
        store.slim_curves()
        return 0
    if any((args.levers, args.sweep, args.evidence, args.widths, args.zloss, args.knobs,
            args.breaks, args.rerun)):
        harness_tables(args)
        return 0
    names = list(args.names)
    cpu = cpu_label(machine())
    for name in names:  # a row declared for one CPU (a second draw of a row) trains there
        g = HARNESS_ROWS.get(name.partition("@")[0])
        if g is not None and g.cpu and g.cpu not in cpu:
            raise UserError(f"{name} is declared for an {g.cpu}; this machine is {cpu}: run it "
                            "there")
    if any("@" in n for n in names):  # ROW@LR: one LR of a harness row, kept, not recorded
        for row, _, lr in (n.partition("@") for n in names):
            if row not in HARNESS_ROWS or not lr:
                raise UserError(f"{row}@{lr}: ROW@LR takes a harness row and one of its LRs, "
                                "each name so (python -m lab.experiments --list)")
            try:
                value = float(lr)
            except ValueError:
                raise UserError(f"{row}@{lr}: {lr!r} is no number") from None
            harness.keep_lr(HARNESS_ROWS[row], value, log=lambda s: print(s, flush=True))
        return 0
    unknown = [n for n in names if n not in NAMES and n not in HARNESS_ROWS]
    if unknown:
        raise UserError(f"unknown row {unknown[0]!r}: train.py rows {', '.join(NAMES)}; "
                        f"harness rows: python -m lab.experiments --list")
    groups = [HARNESS_ROWS[n] for n in names if n in HARNESS_ROWS]
    names = [n for n in names if n in BY_NAME]
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds takes integers like 0,1,2, got {args.seeds!r}") from None
    if args.jobs < 1:
        raise UserError("--jobs must be at least 1")
    chosen = names or ([] if groups else NAMES)
    if args.list:
        done = load()["groups"]
        for name in chosen:
            for seed in seeds:
                cmd = (command_for(name, seed) if BY_NAME[name].start == "train" else None)
                print(f"{run_dir(name, seed).name:<26} python {' '.join(cmd[1:])}" if cmd else
                      f"{run_dir(name, seed).name:<26} (decided once its source run is done)")
        for g in groups or HARNESS_ROWS.values():
            print(f"{g.name:<26} (harness, seeds {','.join(map(str, g.seeds))}) "
                  f"{'done' if g.name in done else 'to run'}")
        return 0
    cores = sorted(os.sched_getaffinity(0))
    if args.cores is not None and not 1 <= args.cores <= len(cores):
        raise UserError(f"--cores must be in 1..{len(cores)} (this process may use cores "
                        f"{cores}), got {args.cores}")
    queues = core_queues(groups, args.cores or len(cores))
    if len(queues) > 1:  # one pinned process per core; each records its rows as they end
        run_pinned(queues, cores)
    elif groups:  # the harness; results/search.json and results/curves/ as each ends
        harness.run(groups, report=lambda rows: print(search.summary(rows), flush=True))
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
    entry_point(main)
