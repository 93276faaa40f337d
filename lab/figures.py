"""The figures, one per question, from what is stored only (results/*.png): the train.py rows'
(seeds as a mean line over a band), the search's, the levers', the LR sweep's, the widths', the
z-loss rows' and the 8-seed evidence's.

    python -m lab.experiments --widths --plot     # a table's figure with it
"""

import math
import pathlib

import numpy as np

from lab.breaks import sweep_rows, width_rows, zloss_rows
from lab.rows import EXPERIMENTS, LEVERS, LOGITS, SEARCH_NAMES, STORY
from lab.stats import bootstrap, ema
from lab.store import read_curve, seed_curve
from lab.tables import mechanism
from report import (
    pyplot,
    save_figure,
)


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
            curves = read_curve("", name)["loss"]
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


def figures(metrics: dict, rows: dict, out: pathlib.Path) -> list[pathlib.Path]:
    plt = pyplot()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3
    paths = []

    def save(fig, name):
        paths.append(save_figure(fig, out / name, dpi=100))

    def drawn_in(panel):
        return [e.name for e in EXPERIMENTS if panel in e.panels and e.name in metrics]

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
            for y in read_curve("", group)["loss"]:
                ax.plot(ema(y.astype(np.float64)), style, color=color, lw=0.7)
        curves = read_curve("", name)["loss"]
        for i, m in enumerate(record["groups"][name]["members"]):
            y = ema(curves[i].astype(np.float64))
            c = colors[m["seed"] % len(colors)]
            ax.plot(y, color=c, lw=1.0, label=f"seed {m['seed']}")
            ax.plot(m["shift_steps"], y[m["shift_steps"]], "x", color=c, ms=7)
        ax.set_title(name.removeprefix("story-"), fontsize=9)
        ax.set_ylim(1.4, 2.8)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("train loss, EMA 20\n(nats/byte)", fontsize=8)
        ax.tick_params(labelbottom=True, labelleft=True, labelsize=7)
    for ax in axes.flat[len(done):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("each lever from scratch on the story regime (colour, one line per seed; "
                 "crosses: level shifts)\nagainst the baseline (grey) and QK-Norm (dashed): "
                 "train loss, EMA 20, nats/byte", fontsize=10)
    return save_figure(fig, out / "levers.png", dpi=75)


def plot_evidence(rows: list[dict], out: pathlib.Path) -> pathlib.Path:
    """results/evidence.png: per seed, the baseline's train loss (raw, faint; EMA 20, bold)
    against its QK-Norm twin's and, where it ran, QK-Norm inserted mid-run (from its step);
    the baseline's episodes after its parting step marked: level shifts (x), one-step spikes (o),
    hard batches (open grey squares: the twin jumped there too); the insertion step (dash-dot)."""
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
            ax.axvline(f["first_step"], color="C2", lw=0.8, ls="-.")  # its own bump follows
        y = ema(b["loss"])
        for e in p["episodes"]:  # hard batches grey squares, apart from the instabilities
            style = (("s", 6, "0.45") if e.hard_batch else
                     ("x", 9, "C3") if e.level_shift else ("o", 5, "C1"))
            ax.plot(e.start, y[e.start] + 0.08, style[0], ms=style[1], color=style[2],
                    mfc="none" if e.hard_batch else style[2], mew=1.5)
        ax.axvline(p["s1"], color="0.6", lw=0.8, ls=":")
        ax.set_title(f"seed {seed} (parts at {p['s1']})", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats/byte)")
        ax.set_ylim(1.2, 2.8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper right")
    for ax in axes.flat[n:]:
        ax.axis("off")
    fig.suptitle(f"the story regime, {n} seeds: the baseline (blue; raw faint, EMA 20 bold)\n"
                 "against its QK-Norm twin (dashed); the parting step (dotted): its last held-out "
                 "eval within 0.05 nats of the twin's;\nQK-Norm inserted (green, dash-dot line: "
                 "the insertion step);\nepisodes after it, marked just above the curve: x level "
                 "shift, filled o one-step spike, open grey square a hard batch (the twin jumped "
                 "there too)", fontsize=10)
    return save_figure(fig, out / "evidence.png", dpi=80)
