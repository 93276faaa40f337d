"""Early warning: do the signals the papers name lead the story's level shifts?

    python -m lab.foresight                  # the table, from the 8-seed evidence's stored curves
    python -m lab.foresight --plot           # + results/foresight.png and results/README.md
    python -m lab.foresight --group story8-signals   # + the signals computed online in the step

Each signal is computed from a run's logged per-step metrics alone (the stored curves of
experiments.py's `story8` rows: no new training), per step, as the largest over the layers:

- `logit-growth`: log10 of the max attention logit now over 50 steps ago (Wortsman et al.,
  arXiv 2309.14322: attention-logit growth precedes the instability);
- `max-logit`: log10 of the max attention logit (the level, not its growth);
- `update-ratio`: the layer's update norm over its median of the previous 100 steps (Marin: the
  update spikes first, larger in the lower layers);
- `adam-ratio`: ||m|| / sqrt(||v||) of the layer over its median of the previous 100 steps (Marin
  #1368: the first moment outgrows the second; a norm-level proxy of m / sqrt(v), which the
  curves do not keep per element);
- `qk-growth`: log10 of ||W_q|| ||W_k|| now over 100 steps ago;
- online in the jitted step (train.py's per-layer metrics; stored by the groups that ran with
  them, `story8-signals` and its twin): `update/param`, the layer's update norm over its weight
  norm; `m/sqrt(v) rms`, the RMS of Adam's m / sqrt(v) over the layer's elements (the
  per-element form of `adam-ratio`); `qk-entropy-drop` (with `--spectral-metrics`): the fall
  of the q/k weights' spectral entropy over 100 steps (tracking.spectral_entropy);
- `step (control)`: the step itself. Episodes come late in a run and several signals grow with
  time, so a signal foresees an episode only where it does better than this control.

The events to predict are the baseline's level-shift episodes after the warmup (report.py's rules,
fixed). Per signal, over the seeds: the AUROC of "a level-shift episode starts within the next k
steps" (k = 50, 200, 500), every step after the warmup a sample, the baseline's and the QK-Norm
twin's steps pooled; and at one threshold, chosen on seeds 0-3 alone (the lowest that alarms at
most 0.5 times per 1,000 steps in the twin's seeds 0-3) and reported on seeds 4-7: the share of
episodes with an alarm in the 500 steps before them, the lead time of the first such alarm, and
the alarms per 1,000 steps in the twin's runs (where no episode comes). Intervals: 95% bootstrap
over the seeds.
"""

import dataclasses
import pathlib

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cli import command, entry_point, parse
from lab.stats import bootstrap, episodes
from lab.store import SEED_CURVES, read_curve
from lab.tables import update_readme
from report import find_shifts, find_spikes, pyplot, save_figure

BASE = "story8"  # the baseline whose episodes are predicted (--group; its twin: BASE-qk)
WARMUP = 1000  # the story preset's warmup: the signals are judged after it
HORIZONS = (50, 200, 500)
LOOKBACK = 500  # an alarm counts for an episode when it comes at most this many steps before it
MERGE = 20  # alarms within this many steps of the previous one are one alarm
TRAIN_SEEDS, TEST_SEEDS = (0, 1, 2, 3), (4, 5, 6, 7)
FALSE_ALARMS = 0.5  # per 1,000 steps in the twin's training seeds: the threshold's budget


def load_curve(group: str, seed: int) -> dict:
    return {k: v.astype(np.float64) for k, v in read_curve(group, f"seed{seed}").items()}


def trailing_median(x: np.ndarray, window: int = 100) -> np.ndarray:
    """[T, L] -> the median of each column over the `window` steps before each step (NaN first)."""
    out = np.full_like(x, np.nan)
    out[window:] = np.median(sliding_window_view(x[:-1], window, axis=0), axis=-1)[:len(x) - window]
    return out


def ago(x: np.ndarray, k: int) -> np.ndarray:
    out = np.full_like(x, np.nan)
    out[k:] = x[:-k]
    return out


def signals(c: dict) -> dict[str, np.ndarray]:
    """Every signal of a curve, [T] each: the largest over the layers."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log10(np.maximum(c["attn_logit_max"], 1e-6))
        adam = c["adam_mu_norm_per_layer"] / np.sqrt(c["adam_nu_norm_per_layer"])
        qk = np.log10(c["wq_norm"] * c["wk_norm"])
        out = {"logit-growth": logit - ago(logit, 50), "max-logit": logit,
               "update-ratio": c["update_norm_per_layer"]
               / trailing_median(c["update_norm_per_layer"]),
               "adam-ratio": adam / trailing_median(adam), "qk-growth": qk - ago(qk, 100),
               "step (control)": np.arange(len(c["loss"]), dtype=np.float64)}
        # online in the step (train.py's per-layer metrics, --spectral-metrics), where the
        # curves keep them (the groups run with them: story8-signals, story8-signals-qk)
        if "update_ratio_per_layer" in c:
            out["update/param"] = c["update_ratio_per_layer"]
        if "adam_ratio_rms_per_layer" in c:
            out["m/sqrt(v) rms"] = c["adam_ratio_rms_per_layer"]
        if "wq_entropy" in c:
            qk_entropy = np.concatenate([c["wq_entropy"], c["wk_entropy"]], axis=1)
            out["qk-entropy-drop"] = ago(qk_entropy, 100) - qk_entropy
        return {k: np.nanmax(np.where(np.isfinite(v), v, -np.inf), axis=1) if v.ndim > 1
                else v for k, v in out.items()}


def shift_onsets(c: dict) -> list[int]:
    """The steps at which the run's level-shift episodes start, after the warmup."""
    m = {"step": np.arange(len(c["loss"])), "loss": c["loss"], "update_norm": c["update_norm"]}
    eps = episodes([e.step for e in find_spikes(m)], [e.step for e in find_shifts(m)])
    return [e.start for e in eps if e.level_shift and e.start >= WARMUP]


def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties half (the Mann-Whitney statistic)."""
    ok = np.isfinite(scores)
    s, y = scores[ok], labels[ok].astype(bool)
    if not y.any() or y.all():
        return float("nan")
    ranks = np.empty(len(s))
    order = np.argsort(s, kind="stable")
    ranks[order] = np.arange(1, len(s) + 1)
    for v in np.unique(s[np.diff(np.sort(s), prepend=np.nan) == 0]):  # ties: average ranks
        ranks[s == v] = ranks[s == v].mean()
    n1, n0 = y.sum(), (~y).sum()
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def labels_within(onsets: list[int], n: int, k: int) -> np.ndarray:
    """[n]: True at step t when an episode starts in (t, t + k]."""
    y = np.zeros(n, bool)
    for e in onsets:
        y[max(e - k, 0):e] = True
    return y


def alarms(signal: np.ndarray, threshold: float) -> list[int]:
    """The steps after the warmup where the signal rises above the threshold, an alarm within
    MERGE steps of the previous one merged into it."""
    above = np.nonzero(np.nan_to_num(signal[WARMUP:], nan=-np.inf) > threshold)[0] + WARMUP
    out: list[int] = []
    last = -np.inf
    for t in above:
        if t - last > MERGE:
            out.append(int(t))
        last = t
    return out


def alarm_rate(signal: np.ndarray, threshold: float) -> float:
    """Alarms per 1,000 steps after the warmup."""
    return 1000 * len(alarms(signal, threshold)) / max(len(signal) - WARMUP, 1)


def leads(signal: np.ndarray, threshold: float, onsets: list[int]) -> list[int | None]:
    """Per episode: steps from the first step above the threshold in the LOOKBACK steps before
    it (and after the previous episode) to its start; None where the signal stayed below."""
    above, out, prev = np.nan_to_num(signal, nan=-np.inf) > threshold, [], -1
    for e in onsets:
        lo = max(e - LOOKBACK, prev + 1, WARMUP)
        hits = np.nonzero(above[lo:e])[0]
        out.append(e - (lo + int(hits[0])) if len(hits) else None)
        prev = e
    return out


def precision(signal: np.ndarray, threshold: float, onsets: list[int]) -> tuple[int, int]:
    """(alarms followed by an episode start within LOOKBACK steps, all alarms)."""
    al = alarms(signal, threshold)
    return sum(any(0 < e - a <= LOOKBACK for e in onsets) for a in al), len(al)


def threshold_for(twin_signals: list[np.ndarray], budget: float = FALSE_ALARMS) -> float:
    """The threshold the twin's runs cross at most `budget` times per 1,000 steps on average:
    lowered from their largest value, quantile by quantile, until one more step down would
    exceed the budget (from below, a threshold the runs sit above all along would count as one
    long alarm)."""
    pooled = np.concatenate([s[WARMUP:] for s in twin_signals])
    best = float(np.nanmax(pooled))
    for q in 1 - np.logspace(-5, np.log10(0.5), 400):  # fine in the tail
        thr = float(np.nanquantile(pooled, q))
        if np.mean([alarm_rate(s, thr) for s in twin_signals]) > budget:
            break
        best = thr
    return best


def evaluate(base: dict[int, dict], twin: dict[int, dict]) -> list[dict]:
    """Per signal: the AUROCs (all seeds; bootstrap over seeds), the threshold from the
    training seeds and the test seeds' detection, lead times and false alarms."""
    sig_b = {s: signals(c) for s, c in base.items()}
    sig_t = {s: signals(c) for s, c in twin.items()}
    onsets = {s: shift_onsets(c) for s, c in base.items()}
    rows = []
    for name in next(iter(sig_b.values())):
        row = {"signal": name}
        for k in HORIZONS:  # the baseline's own steps: when, within the run, not which run
            per_seed = [(sig_b[s][name][WARMUP:len(sig_b[s][name]) - k],
                         labels_within(onsets[s], len(sig_b[s][name]), k)[
                             WARMUP:len(sig_b[s][name]) - k]) for s in base]
            row[f"auroc_{k}"] = auroc(np.concatenate([x for x, _ in per_seed]),
                                      np.concatenate([y for _, y in per_seed]))
            each = [auroc(x, y) for x, y in per_seed]
            row[f"auroc_{k}_ci"] = bootstrap([v for v in each if np.isfinite(v)])
        thr = threshold_for([sig_t[s][name] for s in TRAIN_SEEDS if s in sig_t])
        test = [s for s in TEST_SEEDS if s in base]
        lead = [x for s in test for x in leads(sig_b[s][name], thr, onsets[s])]
        hit = [x is not None for x in lead]
        row |= {"threshold": thr, "episodes": len(lead), "detected": sum(hit),
                "lead_median": float(np.median([x for x in lead if x is not None]))
                if any(hit) else float("nan"),
                "lead_range": (min(x for x in lead if x is not None),
                               max(x for x in lead if x is not None)) if any(hit) else None,
                "false_alarms": [alarm_rate(sig_t[s][name], thr) for s in test if s in sig_t],
                "baseline_alarms": [alarm_rate(sig_b[s][name], thr) for s in test],
                "followed": [sum(x) for x in zip(*[precision(sig_b[s][name], thr, onsets[s])
                                                    for s in test])]}
        row["false_alarms_ci"] = bootstrap(row["false_alarms"])
        rows.append(row)
    return rows


def chance(base: dict[int, dict]) -> float:
    """The share of the test seeds' steps after the warmup that lie in the LOOKBACK steps
    before an episode: what an alarm at a random step is "followed by an episode" at."""
    y = [labels_within(shift_onsets(base[s]), len(base[s]["loss"]), LOOKBACK)[WARMUP:]
         for s in TEST_SEEDS if s in base]
    return float(np.concatenate(y).mean())


def markdown(rows: list[dict], n_onsets: int, n_seeds: int, at_chance: float) -> str:
    lines = [f"Level-shift episodes after the warmup: {n_onsets} in {n_seeds} baseline seeds. "
             "AUROC: of \"an episode starts within k steps\", over the baseline's steps after "
             "the warmup (seeds pooled; 95% interval over the seeds with an episode). The "
             "threshold: chosen on seeds 0-3 for at most 0.5 alarms per 1,000 steps in the "
             "QK-Norm twin; on seeds 4-7, the episodes with the signal above it in the 500 "
             "steps before, the lead, the alarms per 1,000 steps (twin, baseline) and those "
             f"followed by an episode within 500 steps (at random: {at_chance:.0%}).\n",
             "| signal | AUROC k=50 | k=200 | k=500 | threshold | detected (seeds 4-7) | lead "
             "median (range), steps | alarms / 1k steps, QK-Norm | alarms / 1k steps, "
             "baseline | alarms followed by an episode |",
             "|---" * 10 + "|"]

    def ci(r, k):
        lo, hi = r[f"auroc_{k}_ci"]
        return f"{r[f'auroc_{k}']:.2f} [{lo:.2f}, {hi:.2f}]"
    for r in rows:
        lead = (f"{r['lead_median']:.0f} ({r['lead_range'][0]}-{r['lead_range'][1]})"
                if r["lead_range"] else "—")
        lo, hi = r["false_alarms_ci"]
        lines.append(f"| {r['signal']} | {ci(r, 50)} | {ci(r, 200)} | {ci(r, 500)} | "
                     f"{r['threshold']:.3g} | {r['detected']} of {r['episodes']} | {lead} | "
                     f"{np.mean(r['false_alarms']):.2f} [{lo:.2f}, {hi:.2f}] | "
                     f"{np.mean(r['baseline_alarms']):.2f} | "
                     f"{r['followed'][0]} of {r['followed'][1]} |")
    return "\n".join(lines)


def plot(base: dict[int, dict], rows: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Each signal against the step for two baseline seeds, the level-shift episodes marked,
    the chosen threshold dotted."""
    plt = pyplot()
    seeds = [s for s in base if shift_onsets(base[s])][:2] or list(base)[:2]
    fig, axes = plt.subplots(len(rows), len(seeds), figsize=(5 * len(seeds), 1.9 * len(rows)),
                             squeeze=False, sharex=True)
    for j, s in enumerate(seeds):
        sig, onsets = signals(base[s]), shift_onsets(base[s])
        for i, r in enumerate(rows):
            ax = axes[i, j]
            ax.plot(sig[r["signal"]], lw=0.6, color="C0")
            ax.axhline(r["threshold"], color="C3", ls=":", lw=0.9)
            for e in onsets:
                ax.axvline(e, color="k", lw=0.8, alpha=0.6)
            ax.set_ylabel(r["signal"], fontsize=8)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"baseline seed {s}: level-shift episodes (black), threshold "
                             "(red dotted)", fontsize=8)
        axes[-1, j].set_xlabel("step")
    return save_figure(fig, path, dpi=80)


@dataclasses.dataclass(frozen=True)
class Args:
    plot: bool = False  # results/foresight[-GROUP].png and the table into results/README.md
    group: str = BASE  # the baseline's stored curves (its twin: GROUP-qk)


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    base = {s: load_curve(args.group, s) for s in (*TRAIN_SEEDS, *TEST_SEEDS)}
    twin = {s: load_curve(f"{args.group}-qk", s) for s in base}
    rows = evaluate(base, twin)
    text = markdown(rows, sum(len(shift_onsets(c)) for c in base.values()), len(base),
                    chance(base))
    print(text)
    if args.plot:
        name = "foresight" if args.group == BASE else f"foresight-{args.group}"
        print(f"wrote {plot(base, rows, SEED_CURVES.parent / f'{name}.png')}")
        update_readme(text, part=name, writer="lab/foresight.py")
    return 0


if __name__ == "__main__":
    entry_point(main)
