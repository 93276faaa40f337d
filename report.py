"""Spike report and figures from run directories' metrics.jsonl, or from any trainer's log.

    python report.py runs/story                              # the spike and level-shift tables
    python report.py runs/story runs/qk --plot figures/      # + PNG figures, the runs overlaid
    python report.py wandb_export.csv nanogpt.log            # another trainer's log (records.py)

Two kinds of event, each with its own rule:

A loss spike (sharp, one step) starts at a step whose loss lies above the mean of the previous
`--rule.window` steps by more than `--rule.sigma` standard deviations and `--rule.min-height`
nats (a non-finite loss always counts); it lasts until the loss falls back under that
threshold. For each spike the table gives the step, the height above the pre-spike mean, whether
the update norm (Adam's step before the learning rate, before any update clipping) spiked by the
same rule at or before it and how many steps earlier ("update spikes always preceded loss
spikes", Marin), and how many steps the loss took to come back to its pre-spike mean ("never"
if it did not). train.py prints both tables at the end of every run.

A level shift (slow, many steps; Marin's "Bad Spike", whose loss "didn't recover to the same
plateau") starts where the smoothed loss (the mean of the last `--shift.smooth` steps) lies
`--shift.rise` nats above the mean loss of the `--shift.window` steps before, and
counts only if it stays `--shift.margin` above that level for `--shift.hold` steps. The one-step
rule cannot see these: their rise spreads over 5-30 steps while per-step noise is ~0.1 nats.
"""

import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
import tyro

from cli import UserError, command, entry_point, parse
from data import token_unit
from records import acted, read_log, read_metrics


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    window: int = 50  # steps of history the threshold is computed from
    sigma: float = 4.0  # a spike lies this many standard deviations above the mean...
    min_height: float = 0.1  # ...and at least this many nats above it
    lookback: int = 20  # an update-norm spike this many steps before a loss spike preceded it

    def __post_init__(self):
        if not (self.window >= 4 and 0 < self.sigma < math.inf
                and 0 <= self.min_height < math.inf and self.lookback >= 0):  # NaN fails
            raise UserError("the spike rule needs --window >= 4, --sigma > 0, "
                            "--min-height >= 0 and --lookback >= 0")


@dataclasses.dataclass(frozen=True)
class Spike:
    step: int  # first step above the threshold
    peak_step: int
    height: float  # peak loss - pre-spike mean (nats; inf for a non-finite loss)
    pre_level: float  # mean loss over the window before the spike
    length: int  # steps above the threshold
    update_lead: int | None  # steps from the update-norm spike to the loss spike (0 = same step)
    recovered_after: int | None  # steps until the loss was back at pre_level; None: never


@dataclasses.dataclass(frozen=True)
class ShiftRule:
    """A level shift: the smoothed loss rises `rise` nats above the mean loss of the `window`
    steps before, and stays `margin` above it for at least `hold` steps (the "Bad Spike" of
    Marin's 32B: a rise that did not settle back to the same plateau)."""
    smooth: int = 20  # the smoothed loss: the mean of the last `smooth` steps
    window: int = 100  # the pre-event level: the mean loss of this many steps before
    rise: float = 0.1  # an event starts this many nats above that level...
    margin: float = 0.05  # ...and lasts while the smoothed loss stays this far above it,
    hold: int = 50  # for at least this many steps

    def __post_init__(self):
        if min(self.smooth, self.window, self.hold) < 1 or not 0 <= self.margin <= self.rise \
                or not self.rise < math.inf:
            raise UserError("the level-shift rule needs --shift.smooth, --shift.window and "
                            "--shift.hold >= 1 and 0 <= --shift.margin <= --shift.rise")


@dataclasses.dataclass(frozen=True)
class Shift:
    step: int  # first step whose smoothed loss lies `rise` above the pre-event level
    pre_level: float  # the mean loss of the window before
    height: float  # highest smoothed loss during the event - pre_level
    length: int  # steps the smoothed loss stayed `margin` above pre_level
    recovered_after: int | None  # steps until the smoothed loss was back at pre_level; None: never


def smoothed(loss: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over the last n steps (fewer at the start); non-finite steps left out."""
    ok = np.isfinite(loss)
    csum = np.concatenate([[0.0], np.cumsum(np.where(ok, loss, 0.0))])
    cnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.maximum(np.arange(len(loss)) + 1 - n, 0)
    hi = np.arange(len(loss)) + 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return (csum[hi] - csum[lo]) / (cnt[hi] - cnt[lo])


def find_shifts(m: dict[str, np.ndarray], rule: ShiftRule = ShiftRule()) -> list[Shift]:
    steps, s = m["step"].astype(int), smoothed(m["loss"], rule.smooth)
    shifts, t = [], rule.smooth + rule.window
    while t < len(s):
        pre = np.nanmean(m["loss"][t - rule.window:t])
        if not s[t] >= pre + rule.rise:
            t += 1
            continue
        end = t
        while end < len(s) and not s[end] < pre + rule.margin:  # NaN counts as above
            end += 1
        if end - t >= rule.hold:
            back = np.nonzero(s[t:] <= pre)[0]
            shifts.append(Shift(step=int(steps[t]), pre_level=float(pre),
                                height=float(np.nanmax(s[t:end]) - pre), length=end - t,
                                recovered_after=int(steps[t + back[0]] - steps[t]) if len(back)
                                else None))
        t = max(end, t + 1)
    return shifts


def outliers(x: np.ndarray, rule: SpikeRule, min_height: float = 0.0
             ) -> list[tuple[int, int, float]]:
    """(start, end, mean before) for each index range where x lies above its rolling
    threshold. Steps inside a range are kept out of the history; a range longer than the
    window ends there, and its values join the history (the threshold follows the loss)."""
    history, ranges, start, thr, mean = [], [], None, math.inf, 0.0
    for i, v in enumerate(x):
        if start is None:
            armed = len(history) >= rule.window // 2
            if armed:
                h = np.array(history[-rule.window:])
                mean, thr = h.mean(), h.mean() + max(rule.sigma * h.std(ddof=1), min_height)
            if (armed and not math.isfinite(v)) or v > thr:
                start = i
                continue
            if math.isfinite(v):  # before there is a level to measure from, a NaN is no spike
                history.append(v)
        elif (math.isfinite(v) and v <= thr) or i - start >= rule.window:
            ranges.append((start, i, mean))
            if i - start >= rule.window:  # above for a whole window: its values join the history
                history.extend(y for y in x[start:i] if math.isfinite(y))
            if math.isfinite(v):
                history.append(v)
            start = None
    if start is not None:
        ranges.append((start, len(x), mean))
    return ranges


def find_spikes(m: dict[str, np.ndarray], rule: SpikeRule = SpikeRule()) -> list[Spike]:
    """The loss spikes of a run's metrics (read_metrics), with lead and recovery."""
    steps, loss = m["step"].astype(int), m["loss"]
    update_starts = []
    if "update_norm" in m:  # over the applied steps only: a skipped step's update is 0
        applied = np.nonzero(m["update_norm"] > 0)[0]
        update_starts = [applied[s] for s, _, _ in
                         outliers(np.log(m["update_norm"][applied]), rule)]
    spikes = []
    for start, end, pre in outliers(loss, rule, rule.min_height):
        peak = start + int(np.nanargmax(np.where(np.isfinite(loss[start:end]),
                                                 loss[start:end], np.inf)))
        leads = [start - u for u in update_starts if 0 <= start - u <= rule.lookback]
        back = [i for i in range(start + 1, len(loss)) if loss[i] <= pre]
        spikes.append(Spike(step=int(steps[start]), peak_step=int(steps[peak]),
                            height=float(loss[peak] - pre), pre_level=float(pre),
                            length=end - start, update_lead=max(leads) if leads else None,
                            recovered_after=int(steps[back[0]] - steps[start]) if back
                            else None))
    return spikes


def spike_table(spikes: list[Spike], name: str = "") -> str:
    head = f"{len(spikes)} loss spike{'s' * (len(spikes) != 1)}" + (f" in {name}" if name else "")
    if not spikes:
        return head
    rows = [f"{'step':>7} {'height':>8} {'pre-spike':>9} {'steps up':>8} "
            f"{'update spike first':>18} {'recovered after':>15}"]
    for s in spikes:
        lead = ("no" if s.update_lead is None else "same step" if s.update_lead == 0
                else f"{s.update_lead} steps")
        back = "never" if s.recovered_after is None else f"{s.recovered_after} steps"
        rows.append(f"{s.step:>7} {s.height:>8.3f} {s.pre_level:>9.3f} {s.length:>8} "
                    f"{lead:>18} {back:>15}")
    return head + ":\n" + "\n".join(rows)


def shift_table(shifts: list[Shift], name: str = "") -> str:
    head = (f"{len(shifts)} level shift{'s' * (len(shifts) != 1)} of the smoothed loss"
            + (f" in {name}" if name else ""))
    if not shifts:
        return head
    rows = [f"{'step':>7} {'height':>8} {'pre-level':>9} {'steps up':>8} {'recovered after':>15}"]
    for s in shifts:
        back = "never" if s.recovered_after is None else f"{s.recovered_after} steps"
        rows.append(f"{s.step:>7} {s.height:>8.3f} {s.pre_level:>9.3f} {s.length:>8} {back:>15}")
    return head + ":\n" + "\n".join(rows)


# The OLMo 2 spike score (arXiv 2501.00656, section 3.2): the share of steps whose value lies
# more than 7 standard deviations above the mean of the previous 1,000 values; OLMo-core's
# stability monitor uses 6 over the previous 128. Both are reported per metric (loss, gradient
# norm), as (window, sigma) -> the score. OLMo-core's logged score is neither: a step counts if
# its loss or its grad norm spikes, over all steps (olmo_core_spike_score, reported beside).
SPIKE_SCORES = ((1000, 7.0), (128, 6.0))


def spike_flags(x: np.ndarray, window: int, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """(spiked, scored) per step: scored where the step has `window` finite values before it,
    spiked where it also lies more than `sigma` standard deviations (of those values) above
    their mean; a non-finite value counts as a spike and stays out of the later history."""
    x = np.asarray(x, np.float64)
    ok = np.isfinite(x)
    finite = np.where(ok, x, 0.0)
    n = np.concatenate([[0], np.cumsum(ok)])
    s1 = np.concatenate([[0.0], np.cumsum(finite)])
    s2 = np.concatenate([[0.0], np.cumsum(finite ** 2)])
    spiked, scored = np.zeros(len(x), bool), np.zeros(len(x), bool)
    for i in range(len(x)):
        lo = np.searchsorted(n, n[i] - window, side="left") if n[i] >= window else -1
        if lo < 0:
            continue  # not `window` finite values before step i yet
        count = n[i] - n[lo]
        mean = (s1[i] - s1[lo]) / count
        std = np.sqrt(max((s2[i] - s2[lo]) / count - mean ** 2, 0.0) * count / (count - 1))
        scored[i] = True
        spiked[i] = (not ok[i]) or x[i] > mean + sigma * std
    return spiked, scored


def spike_score(x: np.ndarray, window: int, sigma: float) -> float:
    """The share of the scored steps that spiked (spike_flags); NaN if none is scored."""
    spiked, scored = spike_flags(x, window, sigma)
    return spiked.sum() / scored.sum() if scored.any() else math.nan


def either_spike_rate(loss, grad_norm, window: int = 128, sigma: float = 6.0,
                      last: int = 10_000) -> tuple[float, float]:
    """spikefix's combined rate: a step counts if its loss or its grad norm spikes by
    spike_flags (Bessel's std, a non-finite value a spike); over the steps scored for both, and
    over the last `last` of them. Not OLMo-core's score: olmo_core_spike_score is."""
    a, sa = spike_flags(loss, window, sigma)
    b, sb = spike_flags(grad_norm, window, sigma)
    scored = np.nonzero(sa & sb)[0]
    if not len(scored):
        return math.nan, math.nan
    hit = (a | b)[scored]
    return float(hit.mean()), float(hit[-last:].mean())


def olmo_core_spike_score(loss, grad_norm=None, window: int = 128, sigma: float = 6.0,
                          rolling: int = 10_000) -> tuple[float, float]:
    """OLMo-core's logged score as its StabilityMonitorCallback computes it: a step counts where
    its loss or its grad norm is above mean + sigma * std of the previous `window` values (the
    population std; never before `window` values, nor where that std < 1e-10); every value
    joins the history, spiked or not, and a NaN in it hides spikes for `window` steps. Returns
    ("SpikeScore (total)": counted steps over all steps, NaN before `window` steps;
    "SpikeScore": over the last `rolling` steps, NaN before that many)."""
    def spiked(x):
        x, out = np.asarray(x, np.float64), np.zeros(len(x), bool)
        if len(x) > window:
            h = np.lib.stride_tricks.sliding_window_view(x, window)[:-1]  # the history of x[w:]
            mean, std = h.mean(axis=1), h.std(axis=1)
            with np.errstate(invalid="ignore"):
                out[window:] = (std >= 1e-10) & (x[window:] > mean + sigma * std)
        return out
    hit = spiked(loss) | (spiked(grad_norm) if grad_norm is not None else False)
    n = len(hit)
    return (float(hit.sum() / n) if n >= window else math.nan,
            float(hit[-rolling:].sum() / rolling) if n >= rolling else math.nan)


def spike_scores(m: dict[str, np.ndarray]) -> dict[str, float]:
    """{"spike_score_loss_7s1000": ..., "spike_score_grad_norm_6s128": ..., and OLMo-core's
    logged "spike_score_olmo_core_6s128" (on the CE, as OLMo-core reads it)} for a run."""
    out = {f"spike_score_{key}_{sigma:g}s{window}": spike_score(m[key], window, sigma)
           for key in ("loss", "grad_norm") if key in m for window, sigma in SPIKE_SCORES}
    if "loss" in m and "grad_norm" in m:
        out["spike_score_olmo_core_6s128"] = olmo_core_spike_score(m.get("ce", m["loss"]),
                                                                   m["grad_norm"])[0]
    return out


def final_report(run_dir: pathlib.Path, unit: str, tracker) -> None:
    """The end of a train.py run: the event tables printed, and with a tracker (tracking.py)
    that logs, handed to it with the figures. The run is saved by then: a report that cannot
    be made is a note, not a failure."""
    try:
        metrics = read_metrics(run_dir)
        print(text := event_report(metrics, str(run_dir)))
        figures = plot({run_dir.name: metrics}, run_dir / "figures", unit=unit) \
            if tracker.run else []
        tracker.finish(text, figures)
    except UserError as e:
        print(f"note: no spike report: {e}", file=sys.stderr)


def describe(e: dict) -> str:
    head = f"guard: {e['rule']} at step {e['event_step']} (seen at {e['trigger_step']})"
    if e["action"] in ("stop", "go-on"):
        return f"{head}: {e['action']} ({e['why']})"
    if e["action"] == "data":
        return (f"{head}: in the data (train loss +{e['rise']:.3f}, held-out "
                f"{e['held_out_before']:.4f} at step {e['checked_at']} -> "
                f"{e['held_out_now']:.4f}): no rollback")
    text = (f"{head}: max logit {e['max_logit']:.0f}, acted there, no rollback"
            if e["rule"] == "predict" else f"{head}: rolled back to step {e['rollback_to']}, "
            f"batches {e['rollback_to']}-{e['replaced_until'] - 1} replaced")
    if e.get("escalation"):
        text += f", escalated to {e['escalation']}"
    if e.get("rewarm_steps"):
        text += f", LR re-warmed over {e['rewarm_steps']} steps"
    return text


def events_table(events: list[dict]) -> str:
    extra = sum(e["extra_steps"] for e in acted(events))
    return "\n".join([f"{len(events)} guard action{'s' * (len(events) != 1)} "
                      f"({extra} steps computed again)", *map(describe, events)])


def event_report(m: dict[str, np.ndarray], name: str = "", rule: SpikeRule = SpikeRule(),
                 shift: ShiftRule = ShiftRule()) -> str:
    """Both tables for one run's metrics, and its OLMo 2 spike scores."""
    scores = ", ".join(f"{k.removeprefix('spike_score_')} {v:.2%}"
                       for k, v in spike_scores(m).items() if math.isfinite(v))
    guarded = ""
    if m.get("guard_events"):  # the events of the path the run took (rolled-back steps gone)
        guarded = "\n" + events_table(m["guard_events"])
    return (spike_table(find_spikes(m, rule), name) + "\n"
            + shift_table(find_shifts(m, shift), name)
            + (f"\nspike scores (share of steps; per metric OLMo 2's 7s1000 and OLMo-core's "
               f"6s128 rule, and OLMo-core's logged score, loss or grad norm): {scores}"
               if scores else "")
            + guarded)


def summary(m: dict[str, np.ndarray], rule: SpikeRule = SpikeRule(),
            shift: ShiftRule = ShiftRule()) -> dict:
    """One row of a results table: final losses, largest attention logit, events, skips."""
    spikes, shifts = find_spikes(m, rule), find_shifts(m, shift)
    logits = m.get("attn_logit_max", np.zeros((1, 1)))
    return {"steps": int(m["step"][-1]) + 1,
            "final_loss": float(np.mean(m["loss"][-20:])),
            "eval_loss": float(m["eval_loss"][-1]) if len(m["eval_loss"]) else math.nan,
            "max_attn_logit": float(np.nanmax(logits)),
            "final_attn_logit": float(np.max(logits[-1])),
            "spikes": len(spikes),
            "unrecovered_spikes": sum(s.recovered_after is None for s in spikes),
            "shifts": len(shifts),
            "unrecovered_shifts": sum(s.recovered_after is None for s in shifts),
            "events": sorted([(s.step, "spike") for s in spikes]
                             + [(s.step, "shift") for s in shifts]),
            "skipped_steps": int(np.sum(m.get("skipped", 0))),
            **spike_scores(m)}


# ---------------------------------------------------------------------------------------------
# Figures

def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed); imported on first use."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: pathlib.Path, dpi: int) -> pathlib.Path:
    """The figure written to `path` (a folder it cannot write to, or a full disk, is one line)."""
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    finally:
        pyplot().close(fig)
    return path


def shift_spans(m: dict, shift: ShiftRule = ShiftRule()) -> list[tuple[int, int]]:
    """(first step, last step) of each level shift find_shifts sees: from its start to where
    the loss is back at its level before, or to the run's end."""
    end = int(m["step"][-1])
    return [(s.step, end if s.recovered_after is None else min(s.step + s.recovered_after, end))
            for s in find_shifts(m, shift)]


def plot(runs: dict[str, dict], out: pathlib.Path, rule: SpikeRule = SpikeRule(),
         title: str = "", unit: str = "", shift: ShiftRule = ShiftRule()) -> list[pathlib.Path]:
    """Two PNGs: an overview (loss with each level shift shaded and each spike marked, grad and
    update norm, the largest attention logit, LR, and skipped steps where any was skipped; the
    runs overlaid, a warm start's spliced source thin and dashed) and the max attention logit
    of every layer, one panel per run. `unit`: "byte" or "token" (what the loss is per).
    Returns their paths."""
    plt = pyplot()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write figures to {out}: {e.strerror}") from None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    skips = any(np.nansum(m.get("skipped", 0)) > 0 for m in runs.values())
    fig, axes = plt.subplots(4 + skips, 1, figsize=(10, 11 + 2 * skips), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2, 1] + [1] * skips})
    guarded = warm = False
    for (name, m), color in zip(runs.items(), colors * 9):
        if "inserted_at" in m:  # a warm start, its source's steps before it spliced in
            warm = True
            axes[0].axvline(m["inserted_at"], color=color, lw=1.2, ls=":")
        x, own = m["step"], m["step"] >= m.get("inserted_at", 0)
        axes[0].plot(x[~own], m["loss"][~own], color=color, lw=0.5, ls="--", alpha=0.5)
        axes[0].plot(x[own], m["loss"][own], color=color, lw=0.6, alpha=0.8,
                     label=f"{name}: train")
        for i, (a, b) in enumerate(shift_spans(m, shift)):
            axes[0].axvspan(a, b, color=color, alpha=0.12, lw=0,
                            label=f"{name}: level shift" if i == 0 else None)
        if len(m["eval_loss"]):
            axes[0].plot(m["eval_step"], m["eval_loss"], "o", color=color, ms=7, mec="black",
                         zorder=3, label=f"{name}: held out")
        spikes = find_spikes(m, rule)
        idx = [int(np.searchsorted(x, s.peak_step)) for s in spikes]
        axes[0].plot(x[idx], np.minimum(m["loss"][idx], 1e3), "v", color=color, ms=9, mfc="none",
                     label=f"{name}: spike" if idx else None)
        for e in m.get("guard_events", []):  # the guard's rollbacks: where the run went back to
            if "rollback_to" in e:
                guarded = True
                axes[0].axvline(e["rollback_to"], color=color, lw=0.8,
                                ls="-." if e.get("escalation") else "--")
        if "grad_norm" in m:  # (another trainer's log may have the loss alone)
            axes[1].semilogy(x, m["grad_norm"], color=color, lw=0.8)
        if "update_norm" in m:
            axes[1].semilogy(x, m["update_norm"] / np.nanmedian(m["update_norm"]),
                             color=color, lw=0.8, ls=":")
        if "attn_logit_max" in m:
            axes[2].semilogy(x, np.max(m["attn_logit_max"], axis=1), color=color, lw=1)
        if "lr" in m:
            axes[3].plot(x, m["lr"], color=color, lw=1)
        if skips and "skipped" in m:
            axes[4].plot(x, np.cumsum(m["skipped"]), color=color, lw=1)
    axes[0].set_ylabel(f"loss (nats/{unit})" if unit else "loss (nats)")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_title(title or f"{', '.join(runs)}: loss (shaded: level shifts; triangles: "
                      "spikes" + ("; dashed: where the guard rolled back to, dash-dot: where it "
                                  "escalated" if guarded else "")
                      + ("; dotted: a warm start's insertion, its source thin and dashed before "
                         "it" if warm else "") + ")", fontsize=9)
    axes[1].set_ylabel("norm (log)")
    axes[1].set_title("grad norm before clipping (solid); update norm / its median (dotted)",
                      fontsize=9)
    axes[2].set_ylabel("max |q.k| (log)")
    axes[2].set_title("largest attention logit over layers", fontsize=9)
    axes[3].set_ylabel("LR")
    if skips:
        axes[4].set_ylabel("steps skipped")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    paths = [save_figure(fig, out / "overview.png", dpi=90)]

    runs = {name: m for name, m in runs.items() if "attn_logit_max" in m}
    if not runs:
        return paths
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3.2), sharey=True,
                             squeeze=False)
    for ax, (name, m) in zip(axes[0], runs.items()):
        logits = m["attn_logit_max"]
        for layer in range(logits.shape[1]):
            ax.semilogy(m["step"], logits[:, layer], lw=0.9, label=f"layer {layer}")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("max |attention logit|")
    axes[0][0].legend(fontsize=7)
    return paths + [save_figure(fig, out / "attn_logits.png", dpi=90)]


def with_source(run: pathlib.Path, m: dict) -> dict:
    """A warm-started run's metrics with its source's steps before the insertion spliced in
    (config.json's warm_started_from, "RUN@STEP"), and "inserted_at": STEP; the run's own
    metrics where it is no warm start or its source's metrics.jsonl is gone (said)."""
    try:
        spec = json.loads((run / "config.json").read_text()).get("warm_started_from") or ""
        source, step = spec.rsplit("@", 1)
        src = read_metrics(source)
    except (OSError, ValueError, AttributeError):
        return m
    except UserError as e:
        print(f"note: {run} was warm-started from {spec}, whose curve cannot be read ({e}): "
              "drawn from the insertion on", file=sys.stderr)
        return m
    out, keep, evals = dict(m), src["step"] < int(step), ("eval_step", "eval_loss")
    if all(k in m and k in src for k in evals):  # the held-out evaluations up to the insertion
        before = np.asarray(src["eval_step"]) < int(step)
        out |= {k: np.concatenate([np.asarray(src[k])[before], m[k]]) for k in evals}
    out |= {k: np.concatenate([src[k][keep], v]) for k, v in m.items() if k in src and k not in
            evals and isinstance(v, np.ndarray) and len(v) == len(m["step"])}
    return out | {"inserted_at": int(step)}


@dataclasses.dataclass(frozen=True)
class ReportArgs:
    # run directories, or logs: a CSV (a W&B or TensorBoard export), JSON lines, nanoGPT's
    # printed lines
    runs: tyro.conf.Positional[tuple[str, ...]]
    plot: str = ""  # write PNG figures into this folder
    step_column: str = ""  # a log's step column, where its name is not one records.py knows
    loss_column: str = ""  # ...its loss column
    grad_norm_column: str = ""  # ...its gradient-norm column
    rule: SpikeRule = SpikeRule()
    shift: ShiftRule = ShiftRule()


@command
def main(argv: list[str]) -> int:
    args = parse(ReportArgs, argv, description=__doc__)
    if not args.runs:
        raise UserError("give at least one run directory: report.py RUN [RUN ...]")
    paths = list(dict.fromkeys(args.runs))  # (a run named twice is reported once)
    columns = (args.step_column, args.loss_column, args.grad_norm_column)
    runs = {name: read_metrics(r) if pathlib.Path(r).is_dir() else read_log(r, *columns)
            for name, r in zip(labels(paths), paths)}
    for name, m in runs.items():
        print(event_report(m, name, args.rule, args.shift))
    if args.plot:
        units = {run_unit(pathlib.Path(r)) if pathlib.Path(r).is_dir() else "" for r in paths}
        runs = {name: with_source(pathlib.Path(r), m) for (name, m), r in zip(runs.items(),
                                                                            paths)}
        for path in plot(runs, pathlib.Path(args.plot), args.rule, shift=args.shift,
                         unit=units.pop() if len(units) == 1 else ""):
            print(f"wrote {path}")
    return 0


def labels(paths: list[str]) -> list[str]:
    """Each run's name: the shortest end of its path that no other run's shares ("run", or
    "a/run" and "b/run" for two runs named "run")."""
    parts = [pathlib.Path(p).resolve().parts for p in paths]

    def distinct(i: int) -> str:
        p = parts[i]
        for k in range(1, len(p) + 1):
            if all(q[-k:] != p[-k:] for j, q in enumerate(parts) if j != i):
                return "/".join(p[-k:])
        return paths[i]
    return [distinct(i) for i in range(len(paths))]


def run_unit(run: pathlib.Path) -> str:
    """What one token of a run's data is ("byte" or "token", from its config.json's
    data.source); "" where the run has no readable config."""
    try:
        source = json.loads((run / "config.json").read_text()).get("data", {}).get("source", "")
        return token_unit(source if isinstance(source, str) else "")
    except (OSError, ValueError, AttributeError):
        return ""


if __name__ == "__main__":
    entry_point(main)
