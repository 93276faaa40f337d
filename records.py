"""What a run wrote, read back: metrics.jsonl (one record a step) and events.jsonl (the guard's
actions), and another trainer's log; each through one reader that checks what it reads and
refuses the rest in one line naming the file and the line, never a traceback.

    m = read_metrics("runs/story")     # {"loss": [steps], "attn_logit_max": [steps, layers], ...}
    events = read_events("runs/story")
    m = read_log("wandb_export.csv")   # {"step", "loss"} and the norms where the log has them
"""

import csv
import json
import math
import pathlib
import re
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


# ---------------------------------------------------------------------------------------------
# Other trainers' logs: a W&B or TensorBoard CSV export, JSON lines (Levanter's, anyone's), or
# nanoGPT's printed lines ("iter 100: loss 2.3456, time 12.3ms, mfu 1.2%")

# The names a column goes by, tried in order where no flag names it (TensorBoard's scalar
# export calls the value "Value"; W&B's prefixes the run's name: "my-run - train/loss").
NAMES = {"step": ("step", "_step", "global_step", "trainer/global_step", "iter", "iteration"),
         "loss": ("loss", "train/loss", "train_loss", "loss/train", "lm_loss", "value"),
         "grad_norm": ("grad_norm", "train/grad_norm", "optim/grad_norm", "grad/norm",
                       "gradient_norm"),
         "update_norm": ("update_norm", "optim/update_norm", "train/update_norm")}
NANOGPT = re.compile(r"^iter (\d+): loss ([^,\s]+)")


def column(header: list[str], key: str, named: str, path) -> str | None:
    """The header entry for `key`: the one `named`, or the first that NAMES[key] matches (a
    W&B export's "RUN - name"; never its __MIN / __MAX)."""
    if named:
        if named not in header:
            raise UserError(f"{path} has no column {named!r} (its columns: "
                            f"{', '.join(header)[:200]})")
        return named
    plain = {h.split(" - ")[-1].strip().lower(): h for h in header if "__" not in h}
    return next((plain[n] for n in NAMES[key] if n in plain), None)


def read_log(path: str | pathlib.Path, step_column: str = "", loss_column: str = "",
             grad_norm_column: str = "") -> dict[str, np.ndarray]:
    """Another trainer's log as the rules read it: {"step", "loss"} and "grad_norm" /
    "update_norm" where the log has them, sorted by step (a step logged again starts a new
    attempt, as read_metrics). CSV by its header, JSON lines by their keys, else nanoGPT's
    printed lines; the columns as NAMES guesses them or as the flags name them."""
    path = pathlib.Path(path)
    lines = read_lines(path, "is it a log?") if path.is_file() else None
    if lines is None:
        raise UserError(f"{path}: no such file or run directory")
    rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise UserError(f"{path} is empty")
    named = {"step": step_column, "loss": loss_column, "grad_norm": grad_norm_column}
    if rows[0][1].lstrip().startswith("{"):  # JSON lines
        records = []
        for n, line in rows:
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{n} is not JSON") from None
        header = list(dict.fromkeys(k for _, r in records if isinstance(r, dict) for k in r))
        table = [(n, r) for n, r in records if isinstance(r, dict)]
    elif NANOGPT.match(rows[0][1]) or any(NANOGPT.match(line) for _, line in rows):
        header = ["iter", "loss"]
        table = [(n, dict(zip(header, m.groups()))) for n, line in rows
                 if (m := NANOGPT.match(line))]
    else:  # CSV
        reader = csv.reader(line for _, line in rows)
        header = [h.strip() for h in next(reader)]
        table = [(n, dict(zip(header, cells))) for (n, _), cells in zip(rows[1:], reader)]
    cols = {k: column(header, k, named.get(k, ""), path) for k in NAMES}
    for key in ("step", "loss"):
        if cols[key] is None:
            raise UserError(f"{path}: no {key} column found among {', '.join(header)[:200]}: "
                            f"name it with --{key.replace('_', '-')}-column")
    by_step, top = {}, -1
    for n, row in table:
        if row.get(cols["loss"]) in (None, ""):  # (W&B leaves a metric's other steps blank)
            continue
        values = {}
        for key, col in cols.items():
            cell = row.get(col) if col else None
            if cell in (None, ""):
                continue
            try:
                values[key] = float(cell)
            except (TypeError, ValueError):
                raise UserError(f"{path}:{n}: {col} is {cell!r}, not a number") from None
        step = values["step"]
        if step != int(step) or step < 0:
            raise UserError(f"{path}:{n}: step {step:g} is not a step number")
        if step <= top:  # another attempt from `step` on
            by_step = {s: v for s, v in by_step.items() if s < step}
        by_step[int(step)], top = values, step
    if not by_step:
        raise UserError(f"{path} has no row with a loss")
    steps = sorted(by_step)
    out = {"step": np.array(steps, np.float64), "eval_step": [], "eval_loss": []}
    for key in ("loss", "grad_norm", "update_norm"):
        if all(key in by_step[s] for s in steps):
            out[key] = np.array([by_step[s][key] for s in steps], np.float64)
    return out
