"""The LR sweeps, from what is stored only (results/search.json, results/curves/): best and
break LR per arm (the widths rows' rules), so the LR sweep and its LR sensitivity, the widths,
the knobs (the distance best -> break in decades), how far each lever moves the break, and the
z-loss rows; each written between its markers in results/README.md by lab/experiments.py.

    python -m lab.experiments --widths --knobs --breaks --plot
"""

import math

import numpy as np

from lab import store
from lab.rows import (
    HARNESS_ROWS,
    KNOBS,
    KNOBS_COSTLY,
    LEVER_BREAKS,
    MACHINE_ROWS,
    SENSITIVITY_LRS,
    SWEEP,
    SWEEP_LRS,
    WIDTH_ROWS,
    ZLOSS_ROWS,
)
from lab.stats import bootstrap
from lab.store import group_cpu, lr_cpu, read_curve


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


def final_eval(name: str, m: dict) -> float:
    """A member's last held-out eval (NaN where it went non-finite): its stored curve's float32
    value, where the curve is stored; the record rounds to 4 decimals, where two LRs can tie."""
    if not m["finite"]:
        return math.nan
    member = f"lr{m['lr']:g}-seed{m['seed']}"
    if (store.SEED_CURVES / name / f"{member}.npz").is_file():
        curve = read_curve(name, member)
        if "eval_loss" in curve:
            return float(curve["eval_loss"][-1])
    return m["eval_loss"][-1]


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
            by_lr |= {lr: [dict(m, final=final_eval(name, m)) for m in ms]
                      for lr, ms in members_by_lr(record, name).items()}
    if not by_lr:
        return None
    lrs = sorted(by_lr)
    final = {lr: [m["final"] for m in by_lr[lr]] for lr in lrs}
    broke = {lr: [bool(m["shift_steps"]) or not m["finite"] for m in by_lr[lr]] for lr in lrs}
    means = [np.mean(final[lr]) if np.all(np.isfinite(final[lr])) else math.inf for lr in lrs]
    best = lrs[int(np.argmin(means))]
    brk = next((lr for lr in lrs if np.mean(broke[lr]) >= 0.5), None)
    seeds = [m["seed"] for m in by_lr[lrs[0]]]
    per_seed = [{lr: final[lr][i] if np.isfinite(final[lr][i]) else math.inf for lr in lrs}
                for i in range(len(seeds))]
    return {"lrs": lrs, "seeds": seeds, "final": final, "broke": broke, "best_lr": best,
            "bracketed": lrs[0] < best < lrs[-1],
            "cpu": " + ".join(dict.fromkeys(c for n in names if n in record["groups"]
                                            if (c := group_cpu(record["groups"][n])))) or "?",
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


# the distance's bound from the best LR's edge(): in the table, and in words
FLIP = {"": "", "<=": ">= ", ">=": "<= "}
AT = {"": "", "<=": "at least ", ">=": "at most "}


def edge(r: dict) -> str:
    """A best LR at its grid's lowest LR is an upper bound on the best (a lower LR may do better)
    and the distance a lower bound; at the highest the reverse. Added before the costly knobs'
    rows were tabled; the rule for best and break is the widths rows' as it was."""
    return "" if r["bracketed"] else "<=" if r["best_lr"] == r["lrs"][0] else ">="


D64, D128 = "d_model 64, ", "d_model 128, "  # a knob tried wider is set against that width
MUP = "muP (base width 32)"  # as it is; muP also against its base width, d_model 32 as it is


def knob_rows(record: dict) -> list[dict]:
    """When is QK-Norm necessary? Per knob (d_model 32's proxy as it is, then each of KNOBS)
    and arm run so far, its grid(): the distance best LR -> break LR in decades, and each
    seed's own distance (its break over its best; None where it did not break)."""
    rows = []
    for tag, names in [("as it is", ("width32", "width32-qk"))] + [
            (tag, (f"width32-{tag}", f"width32-{tag}-qk")) for tag in (*KNOBS, *KNOBS_COSTLY)] + [
            ("adamh (its LR an angle)", ("width32-adamh", "width32-adamh-qk")),
            (D64 + "as it is", ("width64", "width64-qk")),
            (D64 + "wd0", ("width64-wd0", "width64-wd0-qk")),
            (D64 + MUP, ("width64-mup", "width64-qk-mup")),
            (D128 + "as it is", ("width128", "width128-qk")),
            (D128 + MUP, ("width128-mup", "width128-qk-mup"))]:
        for qk, name in zip((False, True), names):
            if (r := grid(record, [name, f"{name}-high"])) is None:  # an arm's higher LRs too
                continue
            r["seed_decades"] = [math.log10(b / a) if b else None
                                 for a, b in zip(r["best_lr_seeds"], r["break_lr_seeds"])]
            rows.append({"knob": tag, "qk_norm": qk, "twin": names[1], **r})
    return rows


def show_lr(x, fmt="g") -> str:
    return "none in the grid" if x is None else format(x, fmt)


def knobs_markdown(record: dict) -> str:
    rows = knob_rows(record)
    if not rows:
        return "no knob run yet (python -m lab.experiments width32-b2.999 width32-b2.999-qk ...)"
    lines = ["| knob (d_model 32 unless named) | QK-Norm | best LR (each seed's) | break LR (each "
             "seed's) | best to break, decades (each seed's) | max attn logit at the break | "
             "trained on |", "|---" * 7 + "|"]
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
            f" | {r['cpu']} |")
    return "\n".join(lines + [""] + knobs_answer(rows) + machines_markdown(record))


def machine_rows(record: dict) -> list[dict]:
    """The cells trained on an accelerator and again on a CPU (rows.MACHINE_ROWS, "ROW-cpu"): per
    cell and machine, the seeds with a level shift (or non-finite), the held-out loss at the end
    and the max attention logit, by the widths rows' rules."""
    out = []
    for g in MACHINE_ROWS:
        src = g.name.removesuffix("-cpu")
        if g.name not in record["groups"] or src not in record["groups"]:
            continue
        for lr in g.lrs:
            for name in (src, g.name):
                ms = members_by_lr(record, name)[lr]
                entry = record["groups"][name]
                row_cpu = group_cpu(entry) or "?"  # one machine, or which of several not kept
                out.append({"row": src, "lr": lr, "machine": lr_cpu(entry, lr) or (
                    row_cpu if " + " not in row_cpu else f"{row_cpu} (which, not recorded)"),
                            "shifted": sum(bool(m["shift_steps"]) or not m["finite"] for m in ms),
                            "seeds": len(ms), "final": [m["eval_loss"][-1] for m in ms],
                            "max_logit": max(m["max_attn_logit"] for m in ms)})
    return out


def machines_markdown(record: dict) -> list[str]:
    rows = machine_rows(record)
    if not rows:
        return []
    lines = ["", "The same cells on two machines (each a draw; the same rules):", "",
             "| row | LR | trained on | seeds with a level shift | held-out at the end, each seed "
             "| max attn logit |", "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['lr']:g} | {r['machine']} | {r['shifted']} of "
                     f"{r['seeds']} | {', '.join(f'{x:.3f}' for x in r['final'])} | "
                     f"{r['max_logit']:,.0f} |")
    return lines


def knobs_answer(rows: list[dict]) -> list[str]:
    """The issue's goal, read off the rows: a knob under which the baseline breaks within half a
    decade of its own best LR while QK-Norm does not; else how far each knob narrows the
    baseline's distance against the proxy as it is."""
    by = {(r["knob"], r["qk_norm"]): r for r in rows}
    out = []
    for (knob, qk), r in by.items():
        if qk or knob.endswith("as it is"):
            continue
        width = knob[:knob.index(", ") + 2] if ", " in knob else ""  # "d_model 64, " or ""
        base = by.get((width + "as it is", False))
        twin = by.get((knob, True))
        # a best at the grid's lowest LR leaves only a lower bound on the distance: not "within"
        near = r["decades"] is not None and r["decades"] <= HALF_DECADE and edge(r) != "<="
        twin_ok = twin is not None and (twin["decades"] is None or twin["decades"] > HALF_DECADE)
        moved = (AT[edge(r)] + f"{r['decades'] - base['decades']:+.1f} against "
                 f"{width[:-2] or 'the proxy'}"
                 if base and base["decades"] is not None and r["decades"] is not None else
                 "not comparable (a break outside a grid)")
        gap = "nowhere in the grid" if r["decades"] is None else (  # "at least": a best at the
            AT[edge(r)] + f"{r['decades']:.1f} decades above its best LR")  # grid's edge ("<=")
        qk = ("QK-Norm's arm " + ("has not run" if r["twin"] in HARNESS_ROWS else
                                  "is not declared")) if twin is None else "with QK-Norm " + (
            "no break in the grid" if twin["decades"] is None else
            AT[edge(twin)] + f"{twin['decades']:.1f} decades")
        verdict = ". **Within half a decade while QK-Norm is not.**" if near and twin_ok else "."
        out.append(f"- {knob}: the baseline breaks {gap} ({moved}); {qk}{verdict}")
        if knob.endswith(MUP) and (b32 := by.get(("as it is", False))) and base:
            same = [k for k in ("best_lr", "break_lr") if r[k] == b32[k]]
            out.append(f"  muP's transfer: best LR {show_lr(r['best_lr'])} and break "
                       f"{show_lr(r['break_lr'])}, against its base width's (d_model 32) "
                       f"{b32['best_lr']:g} and {show_lr(b32['break_lr'])} and the standard "
                       f"{width[:-2]}'s {base['best_lr']:g} and {show_lr(base['break_lr'])}: "
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
                "cpu": group_cpu(record["groups"][g.name]),
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
