"""What a run wrote, read back: metrics.jsonl (one record a step) and events.jsonl (the guard's
actions), each through one reader that checks what it reads and refuses the rest in one line
naming the file and the line, never a traceback.

    m = read_metrics("runs/story")     # {"loss": [steps], "attn_logit_max": [steps, layers], ...}
    events = read_events("runs/story")
"""

import json
import math
import pathlib
import sys

import numpy as np

from cli import UserError


def read_lines(path: pathlib.Path, fix: str = "was the file edited?") -> list[str]:
    """A text file's lines; bytes that are not UTF-8, or a file that cannot be read, are one
    line naming the file (and the line where the damage is)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line} is not UTF-8 text; {fix}") from None


def read_metrics(run: str | pathlib.Path) -> dict[str, np.ndarray]:
    """One array per metric, indexed by step, from a run's metrics.jsonl: the last attempt's.
    A record of a step at or before one already read (a rollback, a resume from an earlier
    checkpoint) starts a new attempt, and the earlier attempt's records from that step on are
    dropped: a restore is not a rise (Marin's alerting, PR #8568). Per-layer metrics are
    [steps, layers]."""
    path = pathlib.Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl there; give a train.py run directory")
    by_step, top = {}, -1
    lines = read_lines(path)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a last line cut off by a crash mid-write
                print(f"note: {path}:{n} is cut off (a crash mid-write?); skipped it",
                      file=sys.stderr)
                continue
            raise UserError(f"{path}:{n} is not a metrics record; was the file edited?") from None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UserError(f"{path}:{n}: step {step!r} is not a step number; was the file "
                            "edited?")
        if step <= top:  # another attempt from `step` on
            by_step = {s: x for s, x in by_step.items() if s < step}
        by_step[step], top = record, step
    if not by_step:
        raise UserError(f"{path} is empty: the run has not finished a step yet")
    records = [by_step[s] for s in sorted(by_step)]
    if not all("loss" in r for r in records):
        raise UserError(f"{path} has records without a loss: not a train.py metrics file")
    keys = [k for k in records[0] if all(k in r for r in records)]
    out = {}
    for k in keys:
        try:
            out[k] = np.array([np.nan if r[k] is None else r[k] for r in records],
                              dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"{path}: {k!r} is not a number in every record; was the file "
                            "edited?") from None
    if "eval_loss" not in out:
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        out["eval_step"], out["eval_loss"] = (np.array(x, dtype=np.float64)
                                              for x in zip(*evals)) if evals else ([], [])
    if (path.parent / "events.jsonl").is_file():  # the spike guard's actions (guard.py)
        out["guard_events"] = read_events(path.parent)
    return out


def read_events(run_dir: pathlib.Path) -> list[dict]:
    """The guard's record, each line checked (a file in the user's run directory, like
    config.json: a bad one is a UserError naming the line, never a traceback)."""
    path = pathlib.Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    fix = ("restore the file (the guard re-applies what it records), or move the run's "
           "checkpoints after the line's step aside")
    if not path.is_file():
        raise UserError(f"{path} exists and is not a file: move it away (the guard's record "
                        "is a file)")
    lines, out = read_lines(path, fix), []
    for n, line in enumerate(lines, 1):
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            if n < len(lines):  # only a last line may be torn (a kill mid-write): dropped
                raise UserError(f"{path}:{n} is not JSON; was the file edited? {fix}") from None
            continue
        if problem := event_problem(e):
            raise UserError(f"{path}:{n}: {problem}; was the file edited? {fix}")
        out.append(e)
    return out


def event_problem(e) -> str | None:
    """What is wrong with one record of events.jsonl (None: nothing)."""
    def whole(key, low=0):
        return isinstance(e.get(key), int) and not isinstance(e[key], bool) and e[key] >= low
    if not isinstance(e, dict):
        return "not a guard record (a JSON object)"
    if e.get("action") not in ("rollback", "escalate", "stop", "go-on", "data"):
        return f"unknown action {e.get('action')!r}"
    def number(key):
        return isinstance(e.get(key), (int, float)) and not isinstance(e[key], bool)
    if not whole("event_step"):
        return "no event_step"
    named = whole("trigger_step") and isinstance(e.get("rule"), str)  # what describe() prints
    if e["action"] in ("stop", "go-on", "data") and not named:
        return "a record needs its rule and trigger_step"
    if e["action"] in ("stop", "go-on") and not isinstance(e.get("why"), str):
        return f"a {e['action']} record needs its why"
    if e["action"] == "data" and not (all(number(k) for k in ("rise", "held_out_before",
                                                              "held_out_now"))
                                      and whole("checked_at")):
        return "a data record needs its rise, held_out_before, held_out_now and checked_at"
    if e["action"] in ("stop", "go-on", "data"):
        return None

    ahead = e.get("rule") != "predict"  # (a prediction acts where the run stands)
    if not (whole("rollback_to") and whole("replaced_until", e.get("rollback_to", 0) + ahead)
            and whole("extra_steps")):
        return "a rollback record needs rollback_to < replaced_until and extra_steps"
    if e["rollback_to"] > e["event_step"]:
        return "a rollback goes back: its rollback_to is after its event_step"
    if "rewarm_steps" in e and not whole("rewarm_steps"):
        return f"rewarm_steps {e['rewarm_steps']!r} is not a step count"
    escalation = e.get("escalation")
    if (e["action"] == "escalate") != (escalation is not None):
        return "an escalate record names its escalation, a rollback none"
    if escalation not in (None, "qk-norm", "qk-clip", "attn-gate"):
        return f"unknown escalation {escalation!r}"
    if escalation == "qk-clip" and not (isinstance(e.get("qk_clip"), (int, float))
                                        and 0 < e["qk_clip"] < math.inf):
        return "a qk-clip escalation needs its threshold qk_clip > 0"
    if not named:
        return "a record needs its rule and trigger_step"
    if e["rule"] == "predict" and not number("max_logit"):
        return "a predict record needs its max_logit"
    return None


def acted(events: list[dict]) -> list[dict]:
    """The events that rolled the run back (the others only said why they did not)."""
    return [e for e in events if e["action"] in ("rollback", "escalate")]
