"""Statistics over seeds: the rules the story's rates are counted by (fixed before the 8-seed
runs were read), the bootstrap, spread. Pure NumPy; report.py finds the events, these decide what
an event means.

- An episode: events (spike starts and shift starts) within EPISODE_GAP steps of the one
  before are one episode (2982, 2983 and 2984 are one event, not three).
- A hard batch: an episode whose first step is a step where the stable twin (the same data
  order, with QK-Norm) also jumps, its loss >= HARD_SIGMA standard deviations above the mean
  of its previous HARD_WINDOW steps, or (a level-shift episode) where the twin has a level
  shift of its own within EPISODE_GAP steps. Only the others count as instability.
- Recovery: a level shift is back at the first step where the smoothed loss lies within
  max(RECOVERY_TOL nats, the noise of the smoothed loss) of the level before it; a shift not
  back by the run's end is right-censored there, not "never": recovery is reported as a
  survival table (survival()).
- Recovery against the twin (issue 53, fixed before recomputing): the shift's own end is what
  the rule above measures, so every "recovered" step is where the shift rule's event ends. The
  counterfactual is the stable twin (QK-Norm, same seed, same data): a shift is back at the first
  step where the smoothed gap to the twin (baseline minus twin, each a RECOVERY_SMOOTH-step
  trailing mean) is within max(RECOVERY_TOL, its noise) of its mean over the RECOVERY_WINDOW
  steps before the shift; not back by the end, censored there (recovery_vs_twin()).
- The held-out figure (issue 53, fixed before recomputing): the mean of the evaluations in the
  run's last HELD_OUT_LAST steps (at the story's 250-step evals: 3,250 to 4,000), not the last
  eval alone, which moves by 0.03 between two evals at a constant LR (held_out()). A fork's
  evals count from its fork step.
- A mid-run arm (QK-Norm inserted, QK-Clip switched on) is judged on the spliced curve: its
  source's steps up to the insertion, then its own, events counted from the insertion on, so
  the detectors are armed at its first step (spliced()).
"""

import dataclasses
import math

import numpy as np

from report import smoothed


def first_match(base: list[float], qk: list[float], steps: list[int], tol: float = 0.05):
    """The parting step: the last eval step at which the baseline's held-out loss is within `tol`
    of the QK-Norm run's (the baseline "learns like the QK-Norm run" up to it); None if never."""
    ok = [s for s, b, q in zip(steps, base, qk) if abs(b - q) <= tol]
    return ok[-1] if ok else None


EPISODE_GAP = 20
HARD_SIGMA, HARD_WINDOW = 3.0, 50
RECOVERY_TOL = 0.05


@dataclasses.dataclass(frozen=True)
class Episode:
    start: int  # the first event's step
    end: int  # the last event's step
    spikes: int  # one-step spikes in it
    shifts: int  # level shifts in it
    hard_batch: bool | None = None  # the twin jumped there too (None: no twin to ask)

    @property
    def level_shift(self) -> bool:
        return self.shifts > 0


def episodes(spike_steps, shift_steps, gap: int = EPISODE_GAP) -> list[Episode]:
    """Events within `gap` steps of the previous event merged into one episode."""
    events = sorted([(int(s), "spike") for s in spike_steps]
                    + [(int(s), "shift") for s in shift_steps])
    out: list[list] = []
    for step, kind in events:
        if out and step - out[-1][-1][0] <= gap:
            out[-1].append((step, kind))
        else:
            out.append([(step, kind)])
    return [Episode(start=e[0][0], end=e[-1][0], spikes=sum(k == "spike" for _, k in e),
                    shifts=sum(k == "shift" for _, k in e)) for e in out]


def jumps(loss: np.ndarray, sigma: float = HARD_SIGMA, window: int = HARD_WINDOW) -> np.ndarray:
    """Boolean per step: the loss lies >= `sigma` standard deviations (ddof 1) above the mean
    of the previous `window` finite steps (False before there are `window` of them); a
    non-finite loss after that counts as a jump."""
    x = np.asarray(loss, np.float64)
    out = np.zeros(len(x), bool)
    hist: list[float] = []
    for i, v in enumerate(x):
        if len(hist) >= window:
            h = np.array(hist[-window:])
            out[i] = not math.isfinite(v) or v >= h.mean() + sigma * h.std(ddof=1)
        if math.isfinite(v):
            hist.append(v)
    return out


def mark_hard_batches(eps: list[Episode], twin_loss: np.ndarray, twin_shift_steps,
                      gap: int = EPISODE_GAP) -> list[Episode]:
    """Each episode with `hard_batch` set against the stable twin's loss (the same steps)."""
    twin_jumps = jumps(twin_loss)
    out = []
    for e in eps:
        hard = bool(e.start < len(twin_jumps) and twin_jumps[e.start])
        if e.level_shift:
            hard = hard or any(abs(s - e.start) <= gap for s in twin_shift_steps)
        out.append(dataclasses.replace(e, hard_batch=hard))
    return out


def recovery(loss: np.ndarray, shift_step: int, pre_level: float, smooth: int = 20,
             window: int = 100, tol: float = RECOVERY_TOL) -> tuple[int, bool]:
    """(steps, recovered) of a level shift starting at `shift_step` above `pre_level`: the
    steps until the `smooth`-step mean is back within max(tol, its noise) of pre_level, where
    its noise is the standard deviation of the loss over the `window` steps before the shift
    over sqrt(smooth); or, not back by the end, the steps observed (censored)."""
    x = np.asarray(loss, np.float64)
    before = x[max(shift_step - window, 0):shift_step]
    before = before[np.isfinite(before)]
    noise = np.std(before, ddof=1) / math.sqrt(smooth) if len(before) > 1 else 0.0
    s = smoothed(x, smooth)
    back = np.nonzero(s[shift_step + 1:] <= pre_level + max(tol, noise))[0]
    if len(back):
        return int(back[0]) + 1, True
    return len(x) - 1 - shift_step, False


RECOVERY_SMOOTH, RECOVERY_WINDOW = 20, 100


def recovery_vs_twin(loss: np.ndarray, twin_loss: np.ndarray, shift_step: int,
                     smooth: int = RECOVERY_SMOOTH, window: int = RECOVERY_WINDOW,
                     tol: float = RECOVERY_TOL) -> tuple[int, bool]:
    """(steps, recovered) of a level shift at `shift_step` judged against the stable twin: the
    smoothed gap (loss minus twin_loss, each a `smooth`-step trailing mean) opens past max(tol,
    its noise) above its mean over the `window` steps before the shift (its noise: the raw
    gap's standard deviation there over sqrt(smooth)); the steps from the shift until it is
    back within that, or (0, True) where it never opens (the twin moved with it); not back by
    the end, the steps observed (censored). A non-finite loss is not back."""
    x, t = np.asarray(loss, np.float64), np.asarray(twin_loss, np.float64)
    n = min(len(x), len(t))
    gap = smoothed(x[:n], smooth) - smoothed(t[:n], smooth)
    raw = (x[:n] - t[:n])[max(shift_step - window, 0):shift_step]
    raw = raw[np.isfinite(raw)]
    before = gap[max(shift_step - window, 0):shift_step]
    pre = float(np.mean(before[np.isfinite(before)])) if np.isfinite(before).any() else np.nan
    noise = np.std(raw, ddof=1) / math.sqrt(smooth) if len(raw) > 1 else 0.0
    with np.errstate(invalid="ignore"):
        within = gap <= pre + max(tol, noise)
    away = np.nonzero(~within[shift_step:])[0]  # the gap first opens (NaN: open)
    if not len(away):
        return 0, True  # the twin moved with it: the gap never opened
    back = np.nonzero(within[shift_step + away[0]:])[0]
    if len(back):
        return int(away[0] + back[0]), True
    return n - 1 - shift_step, False


HELD_OUT_LAST = 1000


def held_out(eval_step, eval_loss, steps: int, last: int = HELD_OUT_LAST) -> float:
    """The held-out figure: the mean of the evals at steps > steps - `last` (a run's last
    `last` steps); the last eval where none falls there."""
    s, v = np.asarray(eval_step), np.asarray(eval_loss, np.float64)
    keep = s > steps - last
    return float(np.mean(v[keep])) if keep.any() else float(v[-1])


def survival(recoveries: list[tuple[int, bool]], at=(100, 250, 500, 1000)) -> list[dict]:
    """The share of level shifts not back after k steps, for each k in `at`, among those still
    observed (at risk) at k: a shift back within k steps counts as back; one censored before k
    (the run ended first) is left out of k's share."""
    rows = []
    for k in at:
        back = sum(ok and steps <= k for steps, ok in recoveries)
        out = sum(steps >= k and not (ok and steps <= k) for steps, ok in recoveries)
        n = back + out
        rows.append({"k": k, "at_risk": n, "not_back": out,
                     "share_not_back": out / n if n else math.nan})
    return rows


def spliced(source: dict, arm: dict, at: int) -> dict:
    """A mid-run arm's curve as its detectors see it: `source`'s steps before `at`, then the
    arm's from `at` on (both dicts of per-step arrays with a "step" key)."""
    keep = source["step"] < at
    return {k: np.concatenate([source[k][keep], arm[k][arm["step"] >= at]])
            for k in arm if k in source and np.ndim(arm[k]) >= 1
            and len(arm[k]) == len(arm["step"])}


def bootstrap(values, n: int = 10_000, seed: int = 0, stat=np.mean) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of `stat` over `values` (the seeds), resampled
    `n` times with a fixed RNG seed (the same interval on every rerun of the script)."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return (math.nan, math.nan)
    idx = np.random.default_rng(seed).integers(0, len(v), size=(n, len(v)))
    draws = stat(v[idx], axis=1)
    return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def spread(values: list[float]) -> dict:
    v = np.array(values, dtype=np.float64)
    return {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
            "min": float(np.min(v)), "max": float(np.max(v)), "n": len(v),
            "ci": list(bootstrap(v))}


def compare(a: dict, b: dict, key: str = "eval_loss") -> str:
    """How a differs from b over seeds (two spread()s), by the one rule of every table: a
    difference is called only where the two 95% bootstrap intervals of the mean do not
    overlap. (With 3 seeds an interval is about the seeds' range: "all of a's seeds below all
    of b's", no more.)"""
    d = a[key]["mean"] - b[key]["mean"]
    (lo_a, hi_a), (lo_b, hi_b) = a[key]["ci"], b[key]["ci"]
    if hi_a >= lo_b and hi_b >= lo_a:
        return "no measurable difference"
    return f"{'better' if d < 0 else 'worse'} ({d:+.3f})"


def ema(x: np.ndarray, span: int = 20) -> np.ndarray:
    """Exponential moving average (weight 2/(span+1) on the newest step); NaN steps skipped."""
    out, acc, a = np.empty(len(x)), np.nan, 2 / (span + 1)
    for i, v in enumerate(x):
        if np.isfinite(v):
            acc = v if np.isnan(acc) else (1 - a) * acc + a * v
        out[i] = acc
    return out
