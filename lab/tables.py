"""The tables, from what is stored only (results/search.json, results/curves/): the levers, the
LR sweep and its LR sensitivity, the widths (best and break LR), the z-loss rows, the 8-seed
evidence (report.py's event rules, lab/stats.py's episodes, bootstrap intervals); each written
between its markers in results/README.md, its rows into results/results.json.

    python -m lab.experiments --evidence --plot   # one table, its figure, results/README.md
"""

import json
import math
import pathlib

import numpy as np

from checkpoint import strict_json
from cli import UserError, written_whole
from lab import harness
from lab.harness import read_curve, seed_curve
from lab.rows import (
    EVIDENCE_GROUPS,
    EVIDENCE_SEEDS,
    KNOBS,
    KNOBS_COSTLY,
    LEVER_BREAKS,
    LEVERS,
    SENSITIVITY_LRS,
    STORY,
    SWEEP,
    SWEEP_LRS,
    WIDTH_ROWS,
    ZLOSS_ROWS,
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
from report import find_shifts, find_spikes, spike_score

RESULTS = pathlib.Path("results")
ESCALATED_TO = {"qk-norm": "QK-Norm", "attn-gate": "the attention gate", "qk-clip": "QK-Clip"}

def update_readme(text: str, readme: pathlib.Path = pathlib.Path("results/README.md"),
                  part: str = "results", writer: str = "lab/experiments.py") -> None:
    """Replace the text between `part`'s markers in results/README.md."""
    start, end = f"<!-- {part}: written by {writer} -->", f"<!-- /{part} -->"
    body = readme.read_text()
    if start not in body or end not in body:
        raise UserError(f"{readme} lacks the {start} ... {end} markers")
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
    if not (harness.CURVES / f"{group}.npz").is_file():
        return None
    curves = read_curve("", group)
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


def sweep_rows(record: dict) -> list[dict]:
    """The LR sweep so far, one row per LR and arm: each seed's held-out loss at the end (NaN
    where the run went non-finite), its initial train loss, spikes, level shifts, max logit."""
    rows = []
    for g in sorted(SWEEP, key=lambda g: (g.lrs[0], g.qk_norm)):
        if g.name not in record["groups"]:
            continue
        members = sorted(record["groups"][g.name]["members"], key=lambda m: m["seed"])
        first = read_curve("", g.name)["loss"][:, 0]
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


def grid(record: dict, names) -> dict | None:
    """One arm over an LR grid, its groups' members (`names`, run so far) pooled by LR: per LR
    the seeds' held-out loss at the end (NaN where the run went non-finite) and whether each
    had a level shift (or went non-finite); the best LR (the lowest mean held-out), whether the
    grid brackets it, the break LR (the lowest LR with a level shift in at least half the
    seeds), their distance in decades, each seed's own best and break LR (their spread over
    seeds) and the max attention logit per LR; None before any has run."""
    by_lr: dict = {}
    for name in names:
        if name in record["groups"]:
            by_lr |= members_by_lr(record, name)
    if not by_lr:
        return None
    lrs = sorted(by_lr)
    final = {lr: [m["eval_loss"][-1] if m["finite"] else math.nan for m in by_lr[lr]]
             for lr in lrs}
    broke = {lr: [bool(m["shift_steps"]) or not m["finite"] for m in by_lr[lr]] for lr in lrs}
    means = [np.mean(final[lr]) if np.all(np.isfinite(final[lr])) else math.inf for lr in lrs]
    best = lrs[int(np.argmin(means))]
    brk = next((lr for lr in lrs if np.mean(broke[lr]) >= 0.5), None)
    seeds = [m["seed"] for m in by_lr[lrs[0]]]
    per_seed = [{lr: final[lr][i] if np.isfinite(final[lr][i]) else math.inf for lr in lrs}
                for i in range(len(seeds))]
    return {"lrs": lrs, "seeds": seeds, "final": final, "broke": broke, "best_lr": best,
            "bracketed": lrs[0] < best < lrs[-1],
            "cpu": record["groups"][next(n for n in names if n in record["groups"])].get(
                "machine", {}).get("cpu"),
            "break_lr": brk, "decades": math.log10(brk / best) if brk else None,
            "best_lr_seeds": [min(f, key=f.get) for f in per_seed],
            "break_lr_seeds": [next((lr for lr in lrs if broke[lr][i]), None)
                               for i in range(len(seeds))],
            "max_logit": {lr: max(m["max_attn_logit"] for m in by_lr[lr]) for lr in lrs}}


def width_rows(record: dict) -> list[dict]:
    """Per width and arm run so far: its grid() and Wortsman's LR sensitivity per seed over
    the LRs run in his range (SENSITIVITY_LRS)."""
    rows = []
    for g in WIDTH_ROWS:
        if (r := grid(record, [g.name])) is None:
            continue
        lrs, final = r["lrs"], r["final"]
        initial = [float(read_curve(g.name, f"lr{lrs[0]:g}-seed{s}")["loss"][0])
                   for s in r["seeds"]]  # the first step's train loss
        sens = [lr_sensitivity({lr: final[lr][i] for lr in lrs if lr in SENSITIVITY_LRS},
                               initial[i])
                for i in range(len(r["seeds"]))]
        rows.append({"width": g.d_model, "qk_norm": g.qk_norm,
                     **{k: v for k, v in r.items() if k != "seeds"},
                     "sensitivity": sens, "initial": float(np.mean(initial))})
    return rows


def widths_markdown(record: dict) -> str:
    rows = width_rows(record)
    if not rows:
        return "no width of the proxy run yet (python -m lab.experiments width32 width32-qk ...)"
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


# "Within half a decade" on the half-decade grid: the break at the grid's next LR above the best
# (its steps are log10(3) = 0.48 and log10(10/3) = 0.52 decades). Fixed before any knob ran.
HALF_DECADE = 0.53


FLIP = {"": "", "<=": ">= ", ">=": "<= "}  # the distance's bound, from the best LR's


def edge(r: dict) -> str:
    """A best LR at its grid's lowest LR is an upper bound on the best (a lower LR may do better)
    and the distance a lower bound; at the highest the reverse. Added before the costly knobs'
    rows were tabled; the rule for best and break is the widths rows' as it was."""
    return "" if r["bracketed"] else "<=" if r["best_lr"] == r["lrs"][0] else ">="


D64 = "d_model 64, "  # a knob tried one width up is compared with that width as it is
MUP = "muP (base width 32)"  # and muP also with its base width, d_model 32 as it is


def knob_rows(record: dict) -> list[dict]:
    """When is QK-Norm necessary? Per knob (d_model 32's proxy as it is, then each of KNOBS)
    and arm run so far, its grid(): the distance best LR -> break LR in decades, and each
    seed's own distance (its break over its best; None where it did not break)."""
    rows = []
    for tag, names in [("as it is", ("width32", "width32-qk"))] + [
            (tag, (f"width32-{tag}", f"width32-{tag}-qk")) for tag in (*KNOBS, *KNOBS_COSTLY)] + [
            (D64 + "as it is", ("width64", "width64-qk")),
            (D64 + "wd0", ("width64-wd0", "width64-wd0-qk")),
            (D64 + MUP, ("width64-mup", "width64-qk-mup"))]:
        for qk, name in zip((False, True), names):
            if (r := grid(record, [name])) is None:
                continue
            r["seed_decades"] = [math.log10(b / a) if b else None
                                 for a, b in zip(r["best_lr_seeds"], r["break_lr_seeds"])]
            rows.append({"knob": tag, "qk_norm": qk, **r})
    return rows


def show_lr(x, fmt="g") -> str:
    return "none in the grid" if x is None else format(x, fmt)


def knobs_markdown(record: dict) -> str:
    rows = knob_rows(record)
    if not rows:
        return "no knob run yet (python -m lab.experiments width32-b2.999 width32-b2.999-qk ...)"
    lines = ["| knob (d_model 32 unless named) | QK-Norm | best LR (each seed's) | break LR (each "
             "seed's) | best to break, decades (each seed's) | max attn logit at the break |",
             "|---" * 6 + "|"]
    for r in rows:
        seeds = ", ".join("—" if d is None else f"{d:.1f}" for d in r["seed_decades"])
        e = edge(r)
        lines.append(
            f"| {r['knob']} | {'yes' if r['qk_norm'] else 'no'} | {e and e + ' '}{r['best_lr']:g} "
            f"({', '.join(format(x, 'g') for x in r['best_lr_seeds'])}) | "
            f"{show_lr(r['break_lr'])} "
            f"({', '.join('none' if x is None else format(x, 'g') for x in r['break_lr_seeds'])})"
            f" | {'—' if r['decades'] is None else FLIP[e] + format(r['decades'], '.1f')} "
            f"({seeds}) | "
            f"{'—' if r['break_lr'] is None else format(r['max_logit'][r['break_lr']], ',.0f')}"
            " |")
    return "\n".join(lines + [""] + knobs_answer(rows))


def knobs_answer(rows: list[dict]) -> list[str]:
    """The issue's goal, read off the rows: a knob under which the baseline breaks within half a
    decade of its own best LR while QK-Norm does not; else how far each knob narrows the
    baseline's distance against the proxy as it is."""
    by = {(r["knob"], r["qk_norm"]): r for r in rows}
    out = []
    for (knob, qk), r in by.items():
        if qk or knob.endswith("as it is"):
            continue
        base = by.get((D64 + "as it is" if knob.startswith(D64) else "as it is", False))
        twin = by.get((knob, True))
        # a best at the grid's lowest LR leaves only a lower bound on the distance: not "within"
        near = r["decades"] is not None and r["decades"] <= HALF_DECADE and edge(r) != "<="
        twin_ok = twin is not None and (twin["decades"] is None or twin["decades"] > HALF_DECADE)
        at = {"": "", "<=": "at least ", ">=": "at most "}
        moved = (at[edge(r)] + f"{r['decades'] - base['decades']:+.1f} decades against the "
                 "proxy as it is"
                 if base and base["decades"] is not None and r["decades"] is not None else
                 "not comparable (a break outside a grid)")
        gap = "nowhere in the grid" if r["decades"] is None else (
            at[edge(r)] + f"{r['decades']:.1f} decades above its best LR"
            + (" (its best at the grid's edge)" if edge(r) else ""))
        qk = "QK-Norm's arm has not run" if twin is None else "with QK-Norm " + (
            "no break in the grid" if twin["decades"] is None else
            at[edge(twin)] + f"{twin['decades']:.1f} decades")
        verdict = ". **Within half a decade while QK-Norm is not.**" if near and twin_ok else "."
        out.append(f"- {knob}: the baseline breaks {gap} ({moved}); {qk}{verdict}")
        if knob.endswith(MUP) and (b32 := by.get(("as it is", False))) and base:
            same = [k for k in ("best_lr", "break_lr") if r[k] == b32[k]]
            out.append(f"  muP's transfer: best LR {show_lr(r['best_lr'])} and break "
                       f"{show_lr(r['break_lr'])}, against its base width's (d_model 32) "
                       f"{b32['best_lr']:g} and {show_lr(b32['break_lr'])} and the standard "
                       f"d_model 64's {base['best_lr']:g} and {show_lr(base['break_lr'])}: "
                       f"{' and '.join(k[:-3] for k in same) or 'neither'} as at the base "
                       "width.")
    return out


def lever_break_rows(record: dict) -> list[dict]:
    """How far each lever moves the break (LEVER_BREAKS, d_model 32): its break LR over its
    groups pooled (a break at the grid's lowest LR reads as "<=", none as "> the highest"), as
    a ratio to the baseline's, and each seed's against the same seed's."""
    rows = []
    base = grid(record, LEVER_BREAKS["baseline"])
    for label, names in LEVER_BREAKS.items():
        if (r := grid(record, names)) is None:
            continue
        brk, lrs = r["break_lr"], r["lrs"]
        bound = "<=" if brk == lrs[0] else ">" if brk is None else "="
        value = lrs[-1] if brk is None else brk
        ratio = seeds = None
        if base and base["break_lr"]:
            ratio = value / base["break_lr"]
            seeds = [None if b is None or x is None else x / b
                     for x, b in zip(r["break_lr_seeds"], base["break_lr_seeds"])]
        rows.append({"lever": label, "groups": list(names), "lrs": lrs, "break_lr": brk,
                     "bound": bound, "value": value, "ratio": ratio, "seed_ratios": seeds,
                     "break_lr_seeds": r["break_lr_seeds"],
                     "max_logit": r["max_logit"], "cpu": r["cpu"]})
    return rows


def lever_breaks_markdown(record: dict, rows: list[dict] | None = None) -> str:
    rows = lever_break_rows(record) if rows is None else rows
    if not rows:
        return "no lever's break run yet"
    lines = ["| lever (d_model 32, 3 seeds) | LRs run | break LR (each seed's) | x the baseline's "
             "(each seed's) |", "|---" * 4 + "|"]
    for r in rows:
        brk = ("none" if r["bound"] == ">" else "") + \
            {"=": "", "<=": "<= ", ">": f" up to {r['value']:g}"}[r["bound"]] + \
            ("" if r["bound"] == ">" else format(r["value"], "g"))
        each = ", ".join("none" if x is None else format(x, "g") for x in r["break_lr_seeds"])
        ratio = "—" if r["ratio"] is None else (
            {"=": "", "<=": "<= ", ">": "> "}[r["bound"]] + f"{r['ratio']:.2g}"
            + f" ({', '.join('—' if x is None else format(x, '.2g') for x in r['seed_ratios'])})")
        lines.append(f"| {r['lever']} | {', '.join(format(x, 'g') for x in r['lrs'])} | "
                     f"{brk} ({each}) | {ratio} |")
    return "\n".join(lines)


def lever_breaks_top(record: dict) -> str:
    """The README's cut of the lever table: the baseline and the levers whose pooled break moved
    (a ratio other than 1), then the names of those that left it where the baseline's is."""
    rows = lever_break_rows(record)
    moved = [r for r in rows if r["lever"] == "baseline" or r["ratio"] != 1]
    same = [r["lever"] for r in rows if r not in moved]
    text = lever_breaks_markdown(record, moved)
    return text + (f"\n\nThe break where the baseline's is (x1): {', '.join(same)}; every row "
                   "with its LRs in results/README.md." if same else "")


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
            curves = [read_curve(g.name, f"lr{lr:g}-seed{m['seed']}") for m in ms]
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
        return "no z-loss group run yet (python -m lab.experiments zloss0-width32 ...)"
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


def judged(g: Group, seed: int, base: str, twin: str, curve: dict | None = None,
           s1: int | None = None) -> dict:
    """One member judged by the episode rules: its curve (a fork's spliced onto its source's),
    S1 (the baseline's last eval within 0.05 of the twin's; `s1` fixes it instead), the
    episodes from S1 (a fork's from its fork step) with the twin's hard-batch control, each
    shift's recovery. `curve`: judge this curve instead of the stored one (a rerun)."""
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
    """Per evidence group run so far (`only`: these names): per seed judged() (`s1`: S1 fixed
    at that step); the rates per 1,000 steps (NaN for a seed with no step left after S1), the
    share of seeds with a shift not back by the end, held-out and max logit, each with its mean
    and bootstrap 95% interval over seeds."""
    if base not in record["groups"] or twin not in record["groups"]:
        return []
    rows = []
    for g in EVIDENCE_GROUPS:
        if g.name not in record["groups"] or (only is not None and g.name not in only):
            continue
        seeds = sorted(m["seed"] for m in record["groups"][g.name]["members"])
        per = [judged(g, s, base, twin, s1=s1) for s in seeds]
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
        members = sorted(record["groups"][g.name]["members"], key=lambda m: m["seed"])
        guarded = {k: [m[k] for m in members] for k in ("guard_actions", "recomputed_steps",
                                                          "escalated_at", "data_records")
                   if k in members[0]}
        guarded |= {"run_steps": g.steps} if guarded else {}
        rows.append({"group": g.name, "seeds": seeds, "per_seed": per, "guard": guarded,
                     "cpu": record["groups"][g.name].get("machine", {}).get("cpu", "?"),
                     **{key: {"values": [float(x) for x in v], "mean": float(np.mean(v)),
                              "ci": bootstrap(v)} for key, v in stats.items()},
                     "survival": survival([r for p in per for r in p["recoveries"]]),
                     "survival_twin": survival([r for p in per for r in p["recoveries_twin"]]),
                     **{f"censored{k}": sorted(n for p in per for n, ok in p[f"recoveries{k}"]
                                               if not ok) for k in ("", "_twin")}})
    return rows


def s1_markdown(record: dict, groups=("story8", "story8-qk", "story8-marin-32b",
                                       "story8-rerun")) -> str:
    """The rates' dependence on S1 (issue: S1 sits at its rule's edge): the level-shift episodes
    per 1,000 steps with S1 by its rule, fixed at 0 and at 1,000; and each seed's held-out gap
    to its QK-Norm twin at step 1,000, before any event."""
    by = {s1: {r["group"]: r for r in evidence_rows(record, s1=s1, only=groups)}
          for s1 in (None, 0, 1000)}
    lines = ["| row | level-shift episodes / 1k steps: S1 by its rule | S1 = 0 | S1 = 1,000 |",
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


def evidence_json(rows: list[dict]) -> list[dict]:
    """The evidence rows as results.json keeps them: per row its seeds, the CPU and every
    figure (each seed's value, the mean, its 95% interval), the guard's counts."""
    keep = ("group", "seeds", "cpu", "guard")
    return [{k: r[k] for k in keep} | {k: v for k, v in r.items()
                                       if isinstance(v, dict) and "values" in v}
            for r in rows]


def readme_summary(rows: list[dict]) -> str:
    """The README's evidence table: the evidence rows with a label that have run, in their
    order, four figures each."""
    by = {r["group"]: r for r in rows}

    def cell(r, key, fmt):
        lo, hi = r[key]["ci"]
        return f"{fmt.format(r[key]['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"
    lines = ["| row (8 seeds; 95% bootstrap intervals) | seeds with a level shift | level-shift "
             "episodes / 1k steps | held-out (nats/byte) | max attn logit |", "|---" * 5 + "|"]
    for g in EVIDENCE_GROUPS:
        if not g.label or (r := by.get(g.name)) is None:
            continue
        label = g.label
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
             "steps (hard batches in all) | seeds with a shift not back at the end: to its own "
             "level / against the twin | held-out (nats/byte): the last 1,000 steps' evals "
             "(the last eval alone) | max attn logit | old rules: spikes, shifts, \"never\" per "
             "seed |", "|---" * 10 + "|"]
    for r in rows:
        twin = r["group"] == "story8-qk"
        lines.append(
            f"| {name.get(r['group'], r['group'].removeprefix('story8-'))} | {len(r['seeds'])} | "
            f"{cell(r, 'with_shift', '{:.0%}')} | {cell(r, 'level_shift_episodes')} | "
            f"{'(the twin)' if twin else cell(r, 'instability_episodes')} | "
            f"{cell(r, 'episodes')} ({'—' if twin else int(sum(r['hard_batches']['values']))}) | "
            f"{cell(r, 'unrecovered', '{:.0%}')} / "
            f"{'—' if twin else cell(r, 'unrecovered_twin', '{:.0%}')} | "
            f"{cell(r, 'eval', '{:.3f}')} ({np.mean(r['eval_last']['values']):.3f}) | "
            f"{cell(r, 'max_logit', '{:,.0f}')} | "
            f"{np.mean(r['old_spikes']['values']):.1f}, {np.mean(r['old_shifts']['values']):.1f}, "
            f"{np.mean(r['old_never']['values']):.1f} |")
    lines.append("\nRecovery of the level shifts, share not back after k steps (at risk; a "
                 "shift whose run ended first is censored): by the old rule, back within "
                 "max(0.05 nats, the smoothed loss's noise) of the level before (the shift's own "
                 "end), against the rule fixed since, back where the smoothed gap to the QK-Norm "
                 "twin (same seed, same data) closes to within max(0.05, its noise) of the gap "
                 "before the shift:\n")
    ks = [x["k"] for x in rows[0]["survival"]]
    lines += ["| run | shifts; censored (their follow-up, steps): own level / vs twin | "
              + " | ".join(f"k = {k}: own level / vs twin" for k in ks) + " |",
              "|---" * (2 + len(ks)) + "|"]

    def share(x):
        return "—" if not x["at_risk"] else f"{x['share_not_back']:.0%} ({x['at_risk']})"
    for r in rows:
        if r["group"] == "story8-qk":
            continue
        n = sum(len(p["recoveries_twin"]) for p in r["per_seed"])
        cens = [f"{len(c)}" + (f" ({', '.join(map(str, c))})" if c else "")
                for c in (r["censored"], r["censored_twin"])]
        lines.append(f"| {name.get(r['group'], r['group'].removeprefix('story8-'))} | {n}; "
                     f"{cens[0]} / {cens[1]} | "
                     + " | ".join(f"{share(a)} / {share(b)}" for a, b in
                                  zip(r["survival"], r["survival_twin"])) + " |")
    guarded = {g.name: dict(g.guard) for g in EVIDENCE_GROUPS if g.guard}
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
                f"escalated to {ESCALATED_TO[guarded[r['group']]['escalate']]} "
                f"in {len(at)} of {len(gd['escalated_at'])} seeds"
                + (f" (from steps {', '.join(f'{s:,}' for s in sorted(at))})" if at else "")
                + (f"; level shifts taken as the data's: {sum(gd['data_records'])} "
                   f"({', '.join(map(str, gd['data_records']))} per seed)"
                   if "data_records" in gd else "") + ".")
    cpus = sorted({r["cpu"] for r in rows})
    lines.append(f"\nRan on: {'; '.join(cpus)}. Intervals: 95% percentile bootstrap over seeds "
                 "(10,000 resamples, fixed RNG). A difference is called only where two "
                 "intervals do not overlap.")
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


