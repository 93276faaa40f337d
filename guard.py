"""The spike guard (`train.py --guard`): what Marin did by hand over weeks, done by the loop.

    python train.py story --guard                              # roll back, skip the data
    python train.py story --guard --guard.escalate qk-norm    # ...and insert QK-Norm on relapse
    python train.py story --guard --guard.escalate qk-norm --guard.predict max-logit  # before

The loop hands every step's loss and grad norm (the values it already reads for the log) to a
`Watch`, which applies report.py's rules online: the one-step spike rule, the level-shift rule,
and a non-finite step. On a trigger the loop

1. rolls back to the last kept checkpoint at least `margin` steps before the event (PaLM
   restarted ~100 steps before a spike; the state in memory is dropped, no recompilation),
2. replaces the batches from that checkpoint to the trigger by other batches, as
   `--data.replace-batches` does, so the run never trains on them again (PaLM skipped 200-500),
3. re-warms the LR from the rollback point if `rewarm_steps` > 0,
4. and at the `relapses`-th trigger within `within` steps escalates instead: inserts QK-Norm in
   process (the warm start's carry: every leaf kept, the new scales at 1 with zero moments,
   the LR re-warmed over `escalate_rewarm_steps`), or switches QK-Clip on, or stops.

With `--guard.predict max-logit` it also acts before any loss event: at a checkpoint step
where the last step's largest attention logit is above `--guard.predict-above`, it escalates
where the run stands (the checkpoint just saved is the rollback point: nothing is replaced or
computed again). The logit is the signal that led the story's level shifts best (lab/foresight.py;
Wortsman et al., arXiv 2309.14322: attention-logit growth precedes the instability).

It never rolls back past an escalation (the model changed there), and its watch forgets the
losses before one (the insertion's one-time bump is no relapse). A window replaced again draws
new batches (data.py: one more stream per window holding the step), so a relapse is not
replayed as it was. After `max_actions` rollbacks it stops: the guard cannot help that run.

Every action is one line of the run directory's events.jsonl, written before the run goes on
from the rollback point: the replaced windows and escalations are part of the run from then on,
and a resume re-applies them (`effective_config`). The order of an action makes a kill at any
point safe: the checkpoints after the rollback point are deleted first, then the event is
recorded. A kill before the record resumes on the old path, meets the same trigger (the run is
deterministic) and takes the same action; a kill after it resumes on the new path. A checkpoint
at a step after an escalation holds the escalated state; the checkpoint at the escalation's own
step still holds the plain one, and the insertion is repeated on a resume from it.

On several processes every process sees the same replicated loss and grad norm and takes the
same decision; process 0 writes the record.
"""

import dataclasses
import json
import math
import os
import pathlib
from collections import deque

import jax
import numpy as np
from jax.experimental import multihost_utils
from tyro.conf import FlagCreatePairsOff

from cli import drop_torn_line, written_whole
from records import acted, read_metrics
from report import ShiftRule, SpikeRule

ESCALATIONS = ("none", "qk-norm", "qk-clip", "attn-gate", "stop")
INSERTIONS = ("qk-norm", "attn-gate")  # escalations that add parameters (inserted in process)
PREDICTORS = ("none", "max-logit")
SPIKE_RULE, SHIFT_RULE = SpikeRule(), ShiftRule()  # report.py's rules at their defaults
SPAN = 200  # steps of loss history the watch is rebuilt from (> the rules' 120)


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    # `--guard`: watch the loss, roll back on a spike, a level shift, a NaN
    on: FlagCreatePairsOff[bool] = False
    spikes: bool = True  # act on one-step loss spikes (report.py's rule, its defaults)
    shifts: bool = True  # act on level shifts (report.py's rule, its defaults)
    margin: int = 20  # roll back to a checkpoint at least this many steps before the event
    rewarm_steps: int = 0  # after a rollback, re-warm the LR over this many steps (0: no)
    # at a relapse: "qk-norm", "qk-clip", "attn-gate" (Marin's gate: exactly 1 when inserted),
    # "stop", or "none" (roll back only)
    escalate: str = "none"
    relapses: int = 2  # escalate at this many triggers (the first included)...
    within: int = 2000  # ...whose events lie within this many steps
    escalate_rewarm_steps: int = 100  # the LR re-warmup after an escalation (Marin: 1,000)
    qk_clip: float = 100.0  # QK-Clip's threshold where `escalate` is "qk-clip" (Kimi K2: 100)
    too_far: str = "stop"  # no kept checkpoint before the event: "stop", or "go-on" unguarded
    max_actions: int = 20  # stop after this many rollbacks (a guard that cannot help)
    # At a level shift, a held-out rise below this fraction of the train loss's rise means the
    # data shifted (Marin's cooldown shuffle): recorded as "data", no rollback (in_the_data).
    # Off (0) by default; results/README.md's guard section measures what 0.5 lets through.
    data_fraction: float = 0.0
    # "max-logit": before any event, escalate where the run stands (no rollback) at a
    # checkpoint step whose last step's max attention logit is above --guard.predict-above
    predict: str = "none"
    # the logit it acts above: lab/foresight.py's threshold on the evidence's seeds 0-3 (10^1.99),
    # rounded; the QK-Norm runs stay near 50
    predict_above: float = 100.0

    def __post_init__(self):
        if self.escalate not in ESCALATIONS:
            raise ValueError(f"--guard.escalate must be one of {', '.join(ESCALATIONS)}, "
                             f"got {self.escalate!r}")
        if self.too_far not in ("stop", "go-on"):
            raise ValueError(f"--guard.too-far must be stop or go-on, got {self.too_far!r}")
        for name, low in (("margin", 0), ("rewarm_steps", 0), ("escalate_rewarm_steps", 0),
                          ("relapses", 1), ("within", 1), ("max_actions", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"--guard.{name.replace('_', '-')} must be >= {low}, got "
                                 f"{getattr(self, name)}")
        if not 0 < self.qk_clip < math.inf:
            raise ValueError(f"--guard.qk-clip must be positive, got {self.qk_clip}")
        if not 0 <= self.data_fraction <= 1:  # a share of the train loss's rise
            raise ValueError(f"--guard.data-fraction is a fraction of the loss's rise, in [0, 1]"
                             f", got {self.data_fraction}")
        if self.data_fraction and not self.shifts:
            raise ValueError("--guard.data-fraction judges level shifts, which --guard.no-shifts "
                             "leaves alone: drop one of the two")
        if self.predict not in PREDICTORS:
            raise ValueError(f"--guard.predict must be one of {', '.join(PREDICTORS)}, got "
                             f"{self.predict!r}")
        if self.predict != "none" and not (self.on and self.escalate in ("qk-norm", "qk-clip",
                                                                         "attn-gate")):
            raise ValueError("--guard.predict acts by escalating: it needs --guard and "
                             "--guard.escalate qk-norm, qk-clip or attn-gate")
        if not 0 < self.predict_above < math.inf:
            raise ValueError(f"--guard.predict-above must be positive, got {self.predict_above}")


@dataclasses.dataclass(frozen=True)
class Trigger:
    rule: str  # "spike", "shift", "non-finite" or "predict"
    event: int  # the event's first step (a prediction's: the checkpoint step it acts at)
    step: int  # the step whose metrics fired it (a level shift is known `hold` steps late)
    loss: float
    rise: float = math.nan  # a level shift's: the smoothed loss above the level before
    max_logit: float = math.nan  # the largest attention logit at `step` (the record keeps it)


class Watch:
    """report.py's rules, one step at a time: the spike rule's threshold over the last `window`
    non-spike losses, the level-shift rule's smoothed loss against the mean of the `window`
    steps before, held `hold` steps. A test checks it fires where find_spikes / find_shifts
    find the first event of a series."""

    def __init__(self, spikes=True, shifts=True, spike=SPIKE_RULE, shift=SHIFT_RULE):
        self.spikes, self.shifts, self.rule, self.shift = spikes, shifts, spike, shift
        self.history = deque(maxlen=spike.window)  # losses the spike threshold is taken over
        self.recent = deque(maxlen=shift.smooth + shift.window)  # the last losses, NaN kept
        self.candidate = None  # (first step, pre-event level) of a rise not yet held long enough

    def observe(self, step: int, loss: float) -> Trigger | None:
        if not math.isfinite(loss):
            self.recent.append(math.nan)
            return Trigger("non-finite", step, step, loss)
        fired = None
        if len(self.history) >= self.rule.window // 2:
            h = np.array(self.history)
            if loss > h.mean() + max(self.rule.sigma * h.std(ddof=1), self.rule.min_height):
                fired = Trigger("spike", step, step, loss) if self.spikes else None
        if fired is None:
            self.history.append(loss)
        self.recent.append(loss)
        return fired or (self.level_shift(step, loss) if self.shifts else None)

    def level_shift(self, step: int, loss: float) -> Trigger | None:
        r, x = self.shift, np.array(self.recent)
        if len(x) < r.smooth + r.window:
            return None
        smooth = np.nanmean(x[-r.smooth:])
        if self.candidate is not None:
            start, pre = self.candidate
            if not smooth >= pre + r.margin:
                self.candidate = None
            elif step - start >= r.hold:
                self.candidate = None
                return Trigger("shift", start, step, loss, float(smooth - pre))
            return None
        pre = float(np.nanmean(x[-r.window - 1:-1]))
        if smooth >= pre + r.rise:
            self.candidate = (step, pre)
        return None

    def restart(self) -> None:
        """Forget the losses seen (after a shift in the data: its level is the new normal)."""
        self.history.clear()
        self.recent.clear()
        self.candidate = None

    @classmethod
    def replay(cls, cfg: GuardConfig, seen: dict[int, float], before: int,
               since: int = 0) -> "Watch":
        """The watch as the loop has it at step `before`: the SPAN losses before it replayed,
        in step order (the same after an in-process rollback and after a resume), none from
        before `since` (an escalation: the model changed there, and its history restarts)."""
        w = cls(cfg.spikes, cfg.shifts)
        for s in sorted(seen):
            if max(before - SPAN, since) <= s < before:
                w.observe(s, seen[s])
        return w


# ---------------------------------------------------------------------------------------------
# The record: events.jsonl

def record(run_dir: pathlib.Path, event: dict) -> None:
    """Append one event and make it durable before the run acts on it."""
    path = pathlib.Path(run_dir) / "events.jsonl"
    drop_torn_line(path, announce=lambda _: None)  # a kill mid-write's last line goes first
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


def effective_config(cfg, events: list[dict], restored_at: int | None = None):
    """cfg with the recorded actions applied: every replaced window, the latest re-warmup, the
    escalations. With `restored_at`, only escalations before that step (those a checkpoint at
    that step already holds): the shape of the state to restore."""
    windows = [cfg.data.replace_batches] if cfg.data.replace_batches else []
    model, optim = cfg.model, cfg.optim
    for e in acted(events):
        if e["replaced_until"] > e["rollback_to"]:  # (a prediction replaces nothing)
            windows.append(f"{e['rollback_to']}:{e['replaced_until']}")
        if e.get("rewarm_steps"):
            optim = dataclasses.replace(optim, rewarmup_start=e["rollback_to"],
                                        rewarmup_steps=e["rewarm_steps"])
        if e.get("escalation") and (restored_at is None or e["rollback_to"] < restored_at):
            if e["escalation"] == "qk-norm":
                model = dataclasses.replace(model, qk_norm=True)
            elif e["escalation"] == "attn-gate":
                model = dataclasses.replace(model, attn_gate="headwise", attn_gate_form="marin")
            elif e["escalation"] == "qk-clip":
                optim = dataclasses.replace(optim, qk_clip=e["qk_clip"],
                                            qk_clip_start=e["rollback_to"])
    data = dataclasses.replace(cfg.data, replace_batches=",".join(windows))
    return dataclasses.replace(cfg, model=model, optim=optim, data=data)


def split_at(events: list[dict], at: int) -> tuple[list[dict], list[dict]]:
    """(the actions a resume from the checkpoint at step `at` goes on with, those after it):
    a rollback to a step after `at` (or a record of a later event) lies on the path that
    `--resume-step at` leaves."""
    def step(e):
        return e["rollback_to"] if e["action"] in ("rollback", "escalate") else e["event_step"]
    return [e for e in events if step(e) <= at], [e for e in events if step(e) > at]


def set_aside(run_dir: pathlib.Path, kept: list[dict], later: list[dict],
              stamp: str) -> pathlib.Path:
    """Move the actions of the path a --resume-step left (`later`) into
    events.superseded-STAMP.jsonl (kept, never deleted); events.jsonl keeps `kept`."""
    path = pathlib.Path(run_dir) / "events.jsonl"
    aside = path.with_name(f"events.superseded-{stamp}.jsonl")
    aside.write_text("".join(json.dumps(e) + "\n" for e in later))
    with written_whole(path) as tmp:
        tmp.write_text("".join(json.dumps(e) + "\n" for e in kept))
    return aside


def escalation_step(events: list[dict]) -> int:
    """The step the run escalated at (0 if it has not): it never rolls back past it, and its
    watch forgets the losses before it (the insertion's one-time bump is no relapse)."""
    return max((e["rollback_to"] for e in acted(events) if e.get("escalation")), default=0)


def watch_since(events: list[dict]) -> int:
    """The first step whose loss the watch holds: after the escalation, and after the last
    shift found in the data."""
    return max([escalation_step(events)]
               + [e["trigger_step"] + 1 for e in events if e["action"] == "data"])


def in_the_data(cfg: GuardConfig, trigger: Trigger, held_before: float, held_now: float,
                checked_at: int) -> dict | None:
    """The "data" record of a level shift whose held-out loss (now, against the kept
    checkpoint at `checked_at`, before the event) rose less than cfg.data_fraction of the
    train loss's rise; None where it rose with it (an instability: plan() acts)."""
    if trigger.rule != "shift" or not cfg.data_fraction or not math.isfinite(trigger.rise):
        return None
    if held_now - held_before >= cfg.data_fraction * trigger.rise:
        return None
    return {"rule": "shift", "event_step": trigger.event, "trigger_step": trigger.step,
            "loss": trigger.loss, "action": "data", "rise": trigger.rise,
            "held_out_before": held_before, "held_out_now": held_now, "checked_at": checked_at}


def pending_insertion(events: list[dict], restored_at: int) -> bool:
    """Whether the checkpoint at `restored_at` predates an escalation that inserts parameters
    (QK-Norm, the attention gate) at its own step (the insertion is then repeated on it)."""
    return any(e.get("escalation") in INSERTIONS and e["rollback_to"] == restored_at
               for e in events)


def kept_before(cfg: GuardConfig, trigger: Trigger, kept, events: list[dict]) -> list[int]:
    """The kept checkpoint steps a rollback for `trigger` may go to, oldest first: at least
    cfg.margin steps before the event, none before the escalation."""
    return sorted(s for s in kept if escalation_step(events) <= s <= trigger.event - cfg.margin)


def plan(cfg: GuardConfig, trigger: Trigger, kept: list[int], events: list[dict]) -> dict:
    """The action for `trigger`, given the kept checkpoint steps and the events so far: a dict
    that becomes the event's record ("action": "rollback", "escalate", "stop" or "go-on")."""
    e = {"rule": trigger.rule, "event_step": trigger.event, "trigger_step": trigger.step,
         "loss": None if not math.isfinite(trigger.loss) else trigger.loss,
         **({"max_logit": trigger.max_logit} if math.isfinite(trigger.max_logit) else {})}
    if trigger.rule == "predict":  # before any event: escalate where the run stands
        return e | {"action": "escalate", "rollback_to": trigger.event,
                    "replaced_until": trigger.event, "extra_steps": 0,
                    "escalation": cfg.escalate, "rewarm_steps": cfg.escalate_rewarm_steps,
                    **({"qk_clip": cfg.qk_clip} if cfg.escalate == "qk-clip" else {})}
    floor, before = escalation_step(events), kept_before(cfg, trigger, kept, events)
    events = acted(events)
    escalated = any(x.get("escalation") for x in events)
    if len(events) >= cfg.max_actions:
        return e | {"action": "stop", "why": f"{cfg.max_actions} rollbacks already"}
    if not before:
        return e | {"action": cfg.too_far, "why": f"no kept checkpoint in steps {floor}-"
                    f"{trigger.event - cfg.margin} (kept: {kept or 'none'}"
                    + (f"; the run escalated at step {floor}" if floor else "") + ")"}
    recent = [x for x in events if trigger.event - x["event_step"] < cfg.within]
    relapse = len(recent) + 1 >= cfg.relapses
    escalation = cfg.escalate if relapse and not escalated and cfg.escalate != "none" else None
    if escalation == "stop":
        return e | {"action": "stop", "why": f"{len(recent) + 1} triggers within {cfg.within} "
                    "steps"}
    r = before[-1]
    e |= {"action": "escalate" if escalation else "rollback", "rollback_to": r,
          "replaced_until": trigger.step + 1, "extra_steps": trigger.step + 1 - r}
    if escalation:
        return e | {"escalation": escalation, "rewarm_steps": cfg.escalate_rewarm_steps,
                    **({"qk_clip": cfg.qk_clip} if escalation == "qk-clip" else {})}
    return e | ({"rewarm_steps": cfg.rewarm_steps} if cfg.rewarm_steps else {})


def predicted(cfg: GuardConfig, events: list[dict], step: int, metrics: dict) -> Trigger | None:
    """The prediction at checkpoint step `step`, from the last step's logged metrics (step - 1):
    a trigger where its largest attention logit is above cfg.predict_above and the run has not
    escalated yet. Read at checkpoint steps only, so that a resume from one can read it again
    from metrics.jsonl (a kill between the checkpoint and the record changes nothing)."""
    if cfg.predict == "none" or escalation_step(events) or not metrics:
        return None
    v = float(np.max(metrics["attn_logit_max"]))
    return Trigger("predict", step, step - 1, float(metrics["loss"]), max_logit=v) \
        if v > cfg.predict_above else None


def history_before(run_dir: pathlib.Path, start: int, layers: int) -> tuple[dict, dict]:
    """({step: loss} of the SPAN steps before `start`, the metrics the predictor reads of step
    start - 1 ({} if not logged)), from metrics.jsonl (process 0's, sent to every process: each
    must take the same decisions)."""
    rows = np.full((2 + layers, SPAN), -1.0)
    if jax.process_index() == 0 and start and (run_dir / "metrics.jsonl").is_file():
        m = read_metrics(run_dir)
        keep = (m["step"] < start) & (m["step"] >= start - SPAN)
        n = int(keep.sum())
        loss = np.where(np.isfinite(m["grad_norm"]), m["loss"], np.nan)  # as the loop sees it
        rows[:2, :n] = m["step"][keep], loss[keep]
        rows[2:, :n] = m["attn_logit_max"][keep].T
    if jax.process_count() > 1:
        rows = multihost_utils.broadcast_one_to_all(rows)
    seen = {int(s): float(x) for s, x in rows[:2].T if s >= 0}
    last = [i for i in range(SPAN) if rows[0, i] == start - 1]
    return seen, ({"loss": rows[1, last[0]], "attn_logit_max": rows[2:, last[0]]} if last
                  else {})
