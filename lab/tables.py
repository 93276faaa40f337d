"""The tables of the story and its evidence, from what is stored only (results/search.json,
results/curves/): the levers from scratch, the loss-event mechanism, the 8-seed evidence
(report.py's event rules, lab/stats.py's episodes, bootstrap intervals), the parting step and the
probes; each written between its markers in results/README.md, its rows into results/results.json.
The LR sweeps' tables (best and break LR) are lab/breaks.py's.

    python -m lab.experiments --evidence --plot   # one table, its figure, results/README.md
"""

import json
import pathlib

import numpy as np

from cli import UserError, strict_json, written_whole
from lab import store
from lab.harness import fork_steps
from lab.rows import (
    ADAM_BEST_LR,
    EVIDENCE_GROUPS,
    EVIDENCE_SEEDS,
    LEVERS,
    README_ROWS,
    STORY,
    SWITCH_ROWS,
    TEACH8_ROWS,
    TUNE_ROWS,
    Group,
)
from lab.stats import (
    bootstrap,
    compare,
    episodes,
    first_match,
    held_out,
    mark_hard_batches,
    recovery,
    recovery_vs_twin,
    spliced,
    spread,
    survival,
)
from lab.store import cpu_label, group_cpu, read_curve, seed_curve
from report import find_shifts, find_spikes, spike_score

RESULTS = pathlib.Path("results")
ESCALATED_TO = {"qk-norm": "QK-Norm", "attn-gate": "the attention gate", "qk-clip": "QK-Clip"}

def update_readme(text: str, readme: pathlib.Path = pathlib.Path("results/README.md"),
                  part: str = "results", writer: str = "lab/experiments.py") -> None:
    """Replace the text between `part`'s markers in `readme`; a table the report does not
    carry (no markers: the earlier 3-seed rows) is printed only."""
    start, end = f"<!-- {part}: written by {writer} -->", f"<!-- /{part} -->"
    body = readme.read_text()
    if start not in body and end not in body:
        print(f"{text}\n({readme} carries no {part!r} table: printed only)")
        return
    if start not in body or end not in body:
        raise UserError(f"{readme} has one of the {start} ... {end} markers, not both")
    head, rest = body.split(start)
    readme.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


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


def lever_rows(record: dict) -> list[dict]:
    """The story baseline, its QK-Norm twin and each lever run so far: per seed the one-step spikes
    and level shifts after the baseline's parting step in that seed, the held-out loss at the end,
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
    if not (store.CURVES / f"{group}.npz").is_file():
        return None
    curves = read_curve("", group)
    return {key: float(np.mean([spike_score(x, 128, 6.0) for x in curves[key]]))
            for key in ("loss", "grad_norm")}


def levers_markdown(record: dict) -> str:
    rows = lever_rows(record)
    if not rows:
        return "no lever run yet"
    base = rows[0]
    lines = ["| run (3 seeds, from scratch) | spikes after the parting step | level shifts "
             "after it | held-out (nats/byte) | vs baseline | max attn logit | skipped steps | "
             "spike score loss / grad norm (6σ/128) |", "|---" * 8 + "|"]
    for r in rows:
        d = r["eval_mean"] - base["eval_mean"]
        same = compare({"eval_loss": spread(r["eval"])}, {"eval_loss": spread(base["eval"])})
        vs = "—" if r is base else f"{d:+.3f}" + (
            " (within the spread)" if same == "no measurable difference" else "")
        name = {STORY.name: "baseline", STORY.name + "-qk": "QK-Norm"}.get(
            r["group"], r["group"].removeprefix("story-"))
        lines.append(f"| {name} | {', '.join(map(str, r['spikes']))} | "
                     f"{', '.join(map(str, r['shifts']))} | {r['eval_mean']:.3f} ± "
                     f"{r['eval_sd']:.3f} | {vs} | {min(r['max_logit']):,.0f}–"
                     f"{max(r['max_logit']):,.0f} | {', '.join(map(str, r['skipped']))} | "
                     + (f"{r['spike_score']['loss']:.2%} / {r['spike_score']['grad_norm']:.2%} |"
                        if r["spike_score"] else "— |"))
    return "\n".join(lines)


def judged(g: Group, seed: int, base: str, twin: str, curve: dict | None = None,
           s1: int | None = None) -> dict:
    """One member judged by the episode rules: its curve (a fork's spliced onto its source's), the
    parting step (the baseline's last eval within 0.05 of the twin's; `s1` fixes it instead), the
    episodes from it (a fork's from its fork step) with the twin's hard-batch control, each shift's
    recovery. `curve`: judge this curve instead of the stored one (a rerun)."""
    m = curve or seed_curve(g.name, seed)
    first = m["first_step"]
    if first:
        m = spliced(seed_curve(g.fork, seed), m, first) | {
            "eval_step": m["eval_step"], "eval_loss": m["eval_loss"]}
    b, t = seed_curve(base, seed), seed_curve(twin, seed)
    if s1 is None:
        s1 = int(first_match(list(b["eval_loss"]), list(t["eval_loss"]),
                             list(b["eval_step"])) or 0)
    after = max(s1, first)
    spikes = [e for e in find_spikes(m) if e.step >= after]
    shifts = [e for e in find_shifts(m) if e.step >= after]
    eps = episodes([e.step for e in spikes], [e.step for e in shifts])
    if g.name != twin:
        twin_shifts = [e.step for e in find_shifts(t)]
        eps = mark_hard_batches(eps, t["loss"], twin_shifts)
    steps = len(m["loss"]) - after
    rec = [recovery(m["loss"], e.step, e.pre_level) for e in shifts]
    rec_twin = [recovery_vs_twin(m["loss"], t["loss"], e.step) for e in shifts] \
        if g.name != twin else []
    return {"seed": seed, "s1": s1, "from": after, "steps": steps, "episodes": eps,
            "recoveries": rec, "recoveries_twin": rec_twin, "old_spikes": len(spikes),
            "old_shifts": len(shifts), "old_never": sum(e.recovered_after is None for e in shifts),
            "eval": held_out(m["eval_step"], m["eval_loss"], g.steps),
            "eval_last": float(m["eval_loss"][-1]),
            "max_logit": float(np.nanmax(m["attn_logit_max"][after:]))}


def evidence_rows(record: dict, base: str = "story8", twin: str = "story8-qk",
                  s1: int | None = None, only=None) -> list[dict]:
    """Per evidence group run so far (`only`: these names): group_row of its seeds, each
    judged() after the parting step (`s1`: fixed at that step instead)."""
    if base not in record["groups"] or twin not in record["groups"]:
        return []
    rows = []
    for g in EVIDENCE_GROUPS:
        if g.name not in record["groups"] or (only is not None and g.name not in only):
            continue
        seeds = sorted(m["seed"] for m in record["groups"][g.name]["members"])
        rows.append(group_row(g, record, [judged(g, s, base, twin, s1=s1) for s in seeds]))
    return rows


def cell(r: dict, key: str, fmt: str = "{:.2f}") -> str:
    """A row's figure as its mean [95% interval]."""
    lo, hi = r[key]["ci"]
    return f"{fmt.format(r[key]['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"

def group_row(g: Group, record: dict, per: list[dict]) -> dict:
    """One table row from its members judged (judged()): the rates per 1,000 steps (NaN for a
    seed with no step left), the share of seeds with a shift not back by the end, held-out and
    max logit, each with its mean and bootstrap 95% interval over seeds."""
    seeds = [p["seed"] for p in per]
    k = np.array([1000 / p["steps"] if p["steps"] else np.nan for p in per])
    stats = {
        "level_shift_episodes": k * [sum(e.level_shift for e in p["episodes"]) for p in per],
        "episodes": k * [len(p["episodes"]) for p in per],
        "instability_episodes": k * [sum(not e.hard_batch for e in p["episodes"])
                                     for p in per],
        "with_shift": [float(any(e.level_shift for e in p["episodes"])) for p in per],
        "hard_batches": [sum(bool(e.hard_batch) for e in p["episodes"]) for p in per],
        "unrecovered": [float(any(not ok for _, ok in p["recoveries"])) for p in per],
        "unrecovered_twin": [float(any(not ok for _, ok in p["recoveries_twin"]))
                             for p in per],
        "eval": [p["eval"] for p in per],
        "eval_last": [p["eval_last"] for p in per],
        "max_logit": [p["max_logit"] for p in per],
        "old_spikes": [p["old_spikes"] for p in per],
        "old_shifts": [p["old_shifts"] for p in per],
        "old_never": [p["old_never"] for p in per]}
    members = sorted((m for m in record["groups"][g.name]["members"] if m["seed"] in seeds),
                     key=lambda m: m["seed"])
    guarded = {k: [m[k] for m in members] for k in ("guard_actions", "recomputed_steps",
                                                      "escalated_at", "data_records")
               if k in members[0]}
    guarded |= {"run_steps": g.steps} if guarded else {}
    return {"group": g.name, "seeds": seeds, "per_seed": per, "guard": guarded,
            "cpu": group_cpu(record["groups"][g.name]) or "?",
            **{key: {"values": [float(x) for x in v], "mean": float(np.mean(v)),
                     "ci": bootstrap(v)} for key, v in stats.items()},
            "survival": survival([r for p in per for r in p["recoveries"]]),
            "survival_twin": survival([r for p in per for r in p["recoveries_twin"]]),
            **{f"censored{k}": sorted(n for p in per for n, ok in p[f"recoveries{k}"]
                                      if not ok) for k in ("", "_twin")}}



def switch_rows(record: dict) -> list[dict]:
    """The switch's 2 x 3, its control and QK-Norm inserted (lab/rows.py, SWITCH_ROWS), the
    source itself and its QK-Norm twin: each a group_row of the seeds that fork (fork_steps),
    every event counted from that seed's fork step, the hard-batch control from the twin."""
    src, twin = SWITCH_ROWS[0].name, SWITCH_ROWS[1].name
    if src not in record["groups"] or twin not in record["groups"]:
        return []
    starts = fork_steps(SWITCH_ROWS[2])
    return [group_row(g, record, [judged(g, s, src, twin, s1=at) for s, at in starts.items()])
            for g in SWITCH_ROWS if g.name in record["groups"]]


def switch_label(g: Group) -> str:
    """A switch row in words: what changed at the fork."""
    optim = dict(g.optim)
    if optim.get("optimizer") == "adamh":
        radius = {"switch": "grown", "init": "initial"}[optim.get("hyperball_radius", "switch")]
        matched = " (matched)" if g.name.endswith("matched") else ""
        return f"AdamH {g.lrs[0]:.2g}{matched}, {radius} norms"
    if g.fork:
        return "QK-Norm inserted" if g.qk_norm else "Adam, re-warmup alone (control)"
    return "QK-Norm from scratch (twin)" if g.qk_norm else "the source, unchanged"


def switch_markdown(record: dict) -> str:
    """The switch table: per row the seeds with a level shift after the fork (and how many steps
    after it their first one starts), held-out (mean [95% bootstrap interval] over the seeds
    that fork) and the max attention logit after the fork (the mean), the CPU it ran on."""
    rows = switch_rows(record)
    if not rows:
        return "the switch's source and its QK-Norm twin have not both run yet"

    by = {g.name: g for g in SWITCH_ROWS}
    lines = ["| from the fork step | seeds with a level shift | held-out | max attn logit, mean |",
             "|---" * 4 + "|"]
    for r in rows:
        shifted = round(sum(r["with_shift"]["values"]))
        first = [min(e.start for e in p["episodes"] if e.level_shift) - p["from"]
                 for p in r["per_seed"] if any(e.level_shift for e in p["episodes"])]
        span = sorted({min(first), max(first)}) if first else []
        when = f" ({'-'.join(map(str, span))} steps in)" if first else ""
        lines.append(f"| {switch_label(by[r['group']])} | {shifted} of {len(r['seeds'])}{when} "
                     f"| {cell(r, 'eval', '{:.3f}')} | "
                     f"{r['max_logit']['mean']:,.0f} |")
    steps = ", ".join(f"{p['from']}" for p in rows[0]["per_seed"])
    cpus = sorted({cpu_label(record["groups"][r["group"]]["machine"]) for r in rows})
    return ("\n".join(lines) + f"\n\nFork steps (seeds {', '.join(map(str, rows[0]['seeds']))}): "
            f"{steps}. Ran on: {'; '.join(cpus)}.")

def s1_markdown(record: dict, groups=("story8", "story8-qk", "story8-marin-32b",
                                       "story8-rerun")) -> str:
    """The rates' dependence on the parting step (it sits at its rule's edge): the level-shift
    episodes per 1,000 steps with the parting step by its rule, fixed at 0 and at 1,000; and each
    seed's held-out gap to its QK-Norm twin at step 1,000, before any event."""
    by = {s1: {r["group"]: r for r in evidence_rows(record, s1=s1, only=groups)}
          for s1 in (None, 0, 1000)}
    lines = ["| row | level-shift episodes / 1k steps, counted from: the parting step | step 0 "
             "| step 1,000 |",
             "|---" * 4 + "|"]
    for g in groups:
        if g not in by[None]:
            continue
        cells = []
        for s1 in (None, 0, 1000):
            v = by[s1][g]["level_shift_episodes"]
            cells.append(f"{v['mean']:.2f} [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]")
        lines.append(f"| {g} | {' | '.join(cells)} |")
    gaps, before = [], []
    for p in by[None]["story8"]["per_seed"]:
        b, t = seed_curve("story8", p["seed"]), seed_curve("story8-qk", p["seed"])
        gap = b["eval_loss"] - t["eval_loss"]
        gaps.append(float(gap[list(b["eval_step"]).index(1000)]))
        first = min((e.start for e in p["episodes"] if e.level_shift), default=None)
        if first is not None:  # the gap at the last eval before the first level shift
            i = max(i for i, x in enumerate(b["eval_step"]) if x <= first)
            end = held_out(b["eval_step"], gap, len(b["loss"]))  # the held-out figures' gap
            before.append((p["seed"], float(gap[i]), end))
    lines.append(f"\nHeld-out at step 1,000, the baseline minus its QK-Norm twin, per seed: "
                 f"{', '.join(f'{x:+.3f}' for x in gaps)} ({sum(x > 0 for x in gaps)} of "
                 f"{len(gaps)} behind). In the seeds with a level shift, the gap at the last "
                 "eval before the first one against the gap at the end (the held-out figure's: "
                 "the mean over the last 1,000 steps' evals): "
                 + ", ".join(f"seed {s} {a:+.3f} of {z:+.3f}" for s, a, z in before) + ".")
    return "\n".join(lines)


def probe_markdown(record: dict) -> str:
    """The gate rows' own figures (lab/probe.py, at the last held-out eval; per layer 0..L-1,
    the mean over seeds, and the seeds' range of the mean over layers): the attention sink
    (mass on the window's first token), the gate's weight norm and its mean value."""
    rows = [g for g in EVIDENCE_GROUPS if g.name in record["groups"]
            and "final_probe_sink" in record["groups"][g.name]["members"][0]]
    if not rows:
        return "no probed row run yet (python -m lab.experiments story8-gate)"
    lines = [f"| row ({len(EVIDENCE_SEEDS)} seeds, at step 4,000) | attention on the first token, "
             "per layer (mean over layers: seeds' range) | gate weight norm, per layer | gate's "
             "mean value, per layer |", "|---" * 4 + "|"]
    for g in rows:
        ms = record["groups"][g.name]["members"]
        cells = []
        for key in ("final_probe_sink", "final_probe_gate_norm", "final_probe_gate_mean"):
            if "gate" in key and "attn_gate" not in dict(g.model) and (
                    dict(g.guard).get("escalate") != "attn-gate"):
                cells.append("— (no gate)")
                continue
            v = np.array([m[key] for m in ms], float)  # [seeds, layers]; NaN: no gate there
            gated = int(np.sum(np.isfinite(v[:, 0])))
            cells.append("/".join(f"{x:.3f}" for x in np.nanmean(v, 0)) + (
                f" ({gated} gated seeds)" if gated < len(ms) else "") + (
                f" ({v.mean(1).min():.3f}-{v.mean(1).max():.3f})" if key.endswith("sink")
                else ""))
        seeds = "" if len(ms) == len(EVIDENCE_SEEDS) else f" ({len(ms)} seeds)"
        lines.append(f"| {g.label or g.name}{seeds} | {' | '.join(cells)} |")
    return "\n".join(lines)


def teach_markdown(record: dict, groups=tuple(g.name for g in TEACH8_ROWS)) -> str:
    """The `teach` preset's rows (the README's recipe) from the record: per row the seeds with a
    level shift anywhere in the run and each seed's first, held-out (the mean of the last
    1,000 steps' evals, from the float32 curves as stored) and the max attention logit, each
    mean with its 95% interval."""
    lines = ["| row | seeds with a level shift | first shift, per seed | held-out (nats/byte) | "
             "max attn logit |", "|---" * 5 + "|"]
    for name in groups:
        if name not in record["groups"]:
            continue
        g = record["groups"][name]
        ms = sorted(g["members"], key=lambda m: m["seed"])
        first = [min(m["shift_steps"], default=None) for m in ms]
        cells = []
        curves = [read_curve(name, f"seed{m['seed']}") for m in ms]  # float32, as stored
        for v, fmt in (([held_out(c["eval_step"], c["eval_loss"], m["steps"])
                         for c, m in zip(curves, ms)], "{:.3f}"),
                       ([m["max_attn_logit"] for m in ms], "{:,.0f}")):
            lo, hi = bootstrap(v)
            cells.append(f"{fmt.format(np.mean(v))} [{fmt.format(lo)}, {fmt.format(hi)}]")
        lines.append(f"| {name} | {sum(f is not None for f in first)} of {len(ms)} | "
                     f"{', '.join('—' if f is None else f'{f:,}' for f in first)} | "
                     f"{' | '.join(cells)} |")
    cpus = sorted({group_cpu(record["groups"][n]) or "?" for n in groups
                   if n in record["groups"]})
    return "\n".join(lines) + f"\n\nRan on: {'; '.join(cpus)}."


def tune_markdown(record: dict) -> str:
    """Best against best: the tuning rows recorded so far (lab/rows.py, TUNE_ROWS), one line per
    optimizer, angle and the other leaves' Adam LR, without and with QK-Norm: the held-out (the
    mean of the last 1,000 steps' evals) as the seeds' mean (range), and how many seeds had a
    level shift where any did; Adam at its best LR (the LR sweep's rows, 3 seeds); each arm's
    best by the declared rule (the lowest mean held-out); then the 8-seed rows, mean [95%
    interval], and their differences paired by seed (the rows share the evidence's seeds):
    QK-Norm's change under each optimizer, and each bounded row's from Adam with QK-Norm at its
    best."""
    def held(name):  # each member's held-out
        return [held_out(m["eval_step"], m["eval_loss"], m["steps"])
                for m in record["groups"][name]["members"]]

    def paired(a, b):  # a's held-out minus b's, seed by seed
        seeds = [[m["seed"] for m in record["groups"][n]["members"]] for n in (a, b)]
        assert seeds[0] == seeds[1], (a, b, seeds)
        d = np.subtract(held(a), held(b))
        lo, hi = bootstrap(d)
        return f"{np.mean(d):+.3f} [{lo:+.3f}, {hi:+.3f}]"

    def text(name, interval=False):
        ms, h = record["groups"][name]["members"], held(name)
        shifting = sum(bool(m["shift_steps"]) for m in ms)
        spread = "[{:.3f}, {:.3f}]".format(*bootstrap(h)) if interval else \
            f"({min(h):.3f}-{max(h):.3f})"
        return f"{np.mean(h):.3f} {spread}" + (f", {shifting} of {len(ms)} shift" * bool(shifting))

    rows: dict[tuple, dict[bool, str]] = {}
    best: dict[tuple, tuple[float, str]] = {}
    eight: dict[str, dict[bool, str]] = {}  # an 8-seed row's optimizer -> its arms' groups
    for g in TUNE_ROWS:
        if g.name not in record["groups"]:
            continue
        optim = dict(g.optim)
        what = (f"{optim['optimizer']} {g.lrs[0]:g}" if "optimizer" in optim
                else f"adam {g.lrs[0]:g}")
        if "optimizer" not in optim and len(g.seeds) <= 3:
            continue  # Adam's own LR sweep: its lines below
        if len(g.seeds) > 3:
            what += f" / {optim['adam_lr']:g}" if "adam_lr" in optim else ""
            eight.setdefault(what, {})[g.qk_norm] = g.name
            continue
        key = (optim["optimizer"], g.lrs[0], optim["adam_lr"])
        rows.setdefault(key, {})[g.qk_norm] = text(g.name)
        arm = (optim["optimizer"], g.qk_norm)
        if np.mean(held(g.name)) < best.get(arm, (np.inf,))[0]:
            best[arm] = (float(np.mean(held(g.name))), f"{what} / {optim['adam_lr']:g}")
    lines = ["| optimizer, angle | Adam LR, other leaves | no QK-Norm | QK-Norm |",
             "|---" * 4 + "|"]
    lines += [f"| {opt} {a:g} | {lr:g} | {arms.get(False, '')} | {arms.get(True, '')} |"
              for (opt, a, lr), arms in sorted(rows.items())]
    said = []  # each optimizer's best per arm (its figures are the table's), once if shared
    for opt in dict.fromkeys(o for o, _ in sorted(best)):
        arms = {qk: best[opt, qk][1] for qk in (False, True) if (opt, qk) in best}
        said.append(arms[False] if len(arms) == 2 and len(set(arms.values())) == 1 else ", ".join(
            f"{a} ({'QK-Norm' if qk else 'no QK-Norm'})" for qk, a in arms.items()))
    sweep = []  # Adam at its best LR and below it: the LR sweep's rows
    for lr in (3e-4, ADAM_BEST_LR):
        names = [f"story-lr{lr:g}{qk}" for qk in ("", "-qk")]
        if any(name in record["groups"] for name in names):
            sweep += names
            lines.append(f"| Adam {lr:g} (`{names[0]}`) | | " + " | ".join(
                text(name) if name in record["groups"] else "" for name in names) + " |")
    ran = [n for n in dict.fromkeys([g.name for g in TUNE_ROWS] + sweep) if n in record["groups"]]
    machines = {n: record["groups"][n].get("machine") for n in ran}
    cpus = sorted({cpu_label(m) for m in machines.values() if m and "cpu_family" in m})
    unknown = [n for n, m in machines.items() if not (m and "cpu_family" in m)]
    cpus += [f"{', '.join(f'`{n}`' for n in unknown)}: CPU not recorded"] * bool(unknown)
    adam = eight.get(f"adam {ADAM_BEST_LR:g}", {}).get(True)
    said8 = []
    for what, arms in eight.items():
        parts = [f"{what} " + ", ".join(f"{'QK-Norm ' * qk}{text(name, interval=True)}"
                                        for qk, name in sorted(arms.items()))]
        if len(arms) == 2:
            parts.append(f"QK-Norm adds {paired(arms[True], arms[False])}")
        if adam and not what.startswith("adam "):
            parts.append("from Adam QK-Norm " + ", ".join(
                f"{'QK-Norm ' * qk}{paired(name, adam)}" for qk, name in sorted(arms.items())))
        said8.append("; ".join(parts))
    calm = all(not m["shift_steps"] for name in ran for m in record["groups"][name]["members"])
    return ("\n".join(lines) + "\n\n" + "No seed of these rows had a level shift. " * calm +
            f"Best (angle / Adam LR), both arms unless named: {'; '.join(said) or 'none'}. "
            f"8 seeds (differences paired): {'; '.join(said8) or 'not run yet'}. "
            f"Ran on: {'; '.join(cpus) or 'none yet'}.")


def evidence_json(rows: list[dict]) -> list[dict]:
    """The evidence rows as results.json keeps them: per row its seeds, the CPU and every
    figure (each seed's value, the mean, its 95% interval), the guard's counts."""
    keep = ("group", "seeds", "cpu", "guard")
    return [{k: r[k] for k in keep} | {k: v for k, v in r.items()
                                       if isinstance(v, dict) and "values" in v}
            for r in rows]


def readme_summary(rows: list[dict]) -> str:
    """The README's evidence table: the rows of README_ROWS that have run, four figures each."""
    by = {r["group"]: r for r in rows}

    lines = ["| the story, 8 seeds a row (95% intervals) | seeds with a level shift | level-shift "
             "episodes / 1k steps | held-out (nats/byte) | max attn logit |", "|---" * 5 + "|"]
    for name, label in README_ROWS:
        if (r := by.get(name)) is None:
            continue
        n, shifted = len(r["seeds"]), round(sum(r["with_shift"]["values"]))
        rate = cell(r, "level_shift_episodes", "{:.2f}") if shifted else "0"
        lines.append(f"| {label}{f' ({n} seeds)' if n != 8 else ''} | {shifted} of {n} | {rate} "
                     f"| {cell(r, 'eval', '{:.3f}')} | {cell(r, 'max_logit', '{:,.0f}')} |")
    return "\n".join(lines)


def evidence_markdown(rows: list[dict]) -> str:
    """The evidence table (rates per 1,000 steps after the parting step, mean [95% bootstrap
    interval] over seeds), each row with shifts in its recovery table, the guard's counts. A row
    whose every figure equals an earlier row's (the same curves trained again) is named, not
    repeated."""
    if not rows:
        return "the 8-seed baseline and its QK-Norm twin have not both run yet"

    def name(r):
        return r["group"]
    keys = ("level_shift_episodes", "episodes", "eval", "eval_last", "max_logit")
    same, kept = {}, []
    for r in rows:
        twin = next((k for k in kept if all(k[x]["values"] == r[x]["values"] for x in keys)),
                    None)
        if twin is None:
            kept.append(r)
        else:
            same.setdefault(twin["group"], []).append(name(r))
    lines = ["| row | seeds | with a level shift | level-shift episodes / 1k steps | all "
             "episodes / 1k steps (hard batches) | a shift not back at the end | held-out "
             "(the last eval) | max attn logit |", "|---" * 8 + "|"]
    for r in kept:
        twin = r["group"] == "story8-qk"
        lines.append(
            f"| {name(r)} | {len(r['seeds'])} | {cell(r, 'with_shift', '{:.0%}')} | "
            f"{cell(r, 'level_shift_episodes')} | {cell(r, 'episodes')} "
            f"({'—' if twin else int(sum(r['hard_batches']['values']))}) | "
            f"{'—' if twin else cell(r, 'unrecovered_twin', '{:.0%}')} | "
            f"{cell(r, 'eval', '{:.3f}')} ({np.mean(r['eval_last']['values']):.3f}) | "
            f"{cell(r, 'max_logit', '{:,.0f}')} |")
    if same:
        lines.append("\nThe same curves, every figure equal: "
                     + "; ".join(f"{', '.join(v)} = {k}" for k, v in same.items()) + ".")
    shifted = [r for r in kept if any(p["recoveries_twin"] for p in r["per_seed"])]
    ks = [x["k"] for x in rows[0]["survival_twin"]]
    lines += ["\nRecovery: the share of level shifts not back (the glossary's) k steps later; "
              "in brackets the shifts still followed:\n",
              "| row | shifts; censored (their follow-up, steps) | "
              + " | ".join(f"k = {k}" for k in ks) + " |", "|---" * (2 + len(ks)) + "|"]

    def share(x):
        return "—" if not x["at_risk"] else f"{x['share_not_back']:.0%} ({x['at_risk']})"
    for r in shifted:
        n = sum(len(p["recoveries_twin"]) for p in r["per_seed"])
        c = r["censored_twin"]
        lines.append(f"| {name(r)} | {n}; {len(c)}"
                     + (f" ({', '.join(map(str, c))})" if c else "") + " | "
                     + " | ".join(share(x) for x in r["survival_twin"]) + " |")
    guarded = {g.name: dict(g.guard) for g in EVIDENCE_GROUPS if g.guard}
    for r in kept:
        if r.get("guard"):
            gd = r["guard"]
            share = [x / gd["run_steps"] for x in gd["recomputed_steps"]]
            at = [s for s in gd["escalated_at"] if s >= 0]
            lines.append(
                f"\n{name(r)}: {np.mean(gd['guard_actions']):.1f} guard actions a seed "
                f"({min(gd['guard_actions'])}-{max(gd['guard_actions'])}); "
                f"{np.mean(share):.1%} of the steps recomputed ({min(share):.1%}-"
                f"{max(share):.1%}); escalated to {ESCALATED_TO[guarded[r['group']]['escalate']]} "
                f"in {len(at)} of {len(gd['escalated_at'])} seeds"
                + (f", steps {min(at):,}-{max(at):,}" if at else "")
                + (f"; the data's shifts: {sum(gd['data_records'])}"
                   if "data_records" in gd else "") + ".")
    cpus = sorted({r["cpu"] for r in rows})
    lines.append(f"\nRan on: {'; '.join(cpus)}. Intervals: 95% percentile bootstrap over seeds "
                 "(10,000 resamples, fixed RNG).")
    return "\n".join(lines)


def write_results_json(part: dict) -> None:
    """results/results.json with `part`'s keys (re)written and the other keys kept: the
    train.py rows and the width sweep are written by different commands."""
    path = RESULTS / "results.json"
    RESULTS.mkdir(exist_ok=True)
    try:
        out = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: damaged): restore it "
                        f"(git checkout {path}) and run the same command again") from None
    if not isinstance(out, dict):
        raise UserError(f"{path} is not the results record (a JSON object): restore it "
                        f"(git checkout {path})")
    with written_whole(path) as tmp:
        tmp.write_text(strict_json(out | part, indent=1) + "\n")


