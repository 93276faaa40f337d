"""The guard's run-time (`train.py --guard`): it consumes the training loop (loop.py).

guard.py holds the guard's rules: the watch over the losses, the plan for a trigger, the record.
This file runs them. `drive` shows a `Judge` each step the loop reads and each checkpoint it
writes. On a trigger the judge decides, and records the decision in the order that makes a
kill safe: the bad path's checkpoints are deleted, then the event is recorded, then the run acts
on it. To go on as before (a one-off, or a shift the data check lets through) the loop just goes
on. To go back (a rollback, an escalation) or to stop, `drive` leaves the loop, restores the
rollback point, inserts what an escalation adds, and starts a fresh loop with the changed
config. The compiled steps, the log and its timers live across the restarts (loop.Run).
"""

import dataclasses
import math
import sys
import time

import jax

import guard
from checkpoint import abstract_state, insert_new_leaves, restore_checkpoint
from cli import UserError
from config import TrainConfig, config_at, make_tx
from data import TokenData
from distributed import say
from loop import ended, run_loop, too_many_nonfinite
from records import acted, read_events
from report import describe


def check_escalation(cfg: TrainConfig) -> None:
    """A UserError, before anything is written, for a guard escalation this run could not carry
    out (checked on the config asked for; once the guard has escalated, the run's effective
    config has what it escalated to)."""
    escalate, m, o = cfg.guard.escalate, cfg.model, cfg.optim
    if not cfg.guard.on or escalate in ("stop", "none"):
        return
    what, has, conflicts, instead = {
        "qk-norm": ("inserts QK-Norm", m.qk_norm, {"--optim.qk-clip": o.qk_clip > 0}, "qk-clip"),
        "qk-clip": ("switches QK-Clip on", o.qk_clip > 0, {
            "--model.qk-norm": m.qk_norm,
            f"--optim.optimizer {o.optimizer} (QK-Clip moves weights off their sphere)":
                o.hyperball}, "qk-norm"),
        "attn-gate": ("inserts the attention gate", m.attn_gate != "none", {}, "qk-norm"),
    }[escalate]
    beside = [flag for flag, on in conflicts.items() if on]
    if has or beside:
        raise UserError(f"--guard.escalate {escalate} {what}, which this run "
                        + ("already has" if has else f"cannot take beside {beside[0]}")
                        + f": escalate to {instead}, stop or none")


def recorded(cfg: TrainConfig, run_dir, at: int, resuming: bool) -> tuple[list, list]:
    """(the guard's recorded actions a resume from the checkpoint at `at` goes on with, those
    after it: a --resume-step went back past them); checked before anything is written."""
    check_escalation(cfg)
    events = read_events(run_dir) if resuming else []
    if beyond := next((e for e in events if e["event_step"] > cfg.steps), None):
        raise UserError(f"{run_dir}/events.jsonl records an event at step {beyond['event_step']}"
                        f" of a {cfg.steps}-step run; was the file edited? restore it")
    return guard.split_at(events, at)


def reapply(cfg: TrainConfig, tx, data: TokenData, state, user_cfg: TrainConfig, events: list,
            beyond: list, run_dir, mesh) -> tuple:
    """(cfg, tx, data, state) of a resumed run with the guard's recorded actions applied (its
    replaced windows, re-warmups and escalations; an insertion its checkpoint predates is made
    again); the actions after the resumed checkpoint are moved aside."""
    if beyond and jax.process_index() == 0:
        aside = guard.set_aside(run_dir, events, beyond, time.strftime("%Y%m%d-%H%M%S"))
        say(f"moved the guard's {len(beyond)} later action(s) aside to {aside}")
    if events:
        cfg = config_at(user_cfg, events)
        tx, data = make_tx(cfg), TokenData(cfg.data, cfg.model.vocab_size)
        if guard.pending_insertion(events, int(state["step"])):
            state = insert_new_leaves(cfg, tx, state, mesh)
        say(f"guard: {len(acted(events))} recorded action(s) re-applied")
    return cfg, tx, data, state


class Judge:
    """The guard over the loop: sees() answers True where the loop must be left (the guard
    goes on from another point, a rollback or an escalation, or stops); stopped() says which,
    and go_on() gives what a fresh loop runs with."""

    def __init__(self, run, cfg: TrainConfig, tx, user_cfg: TrainConfig, events: list,
                 start: int):
        self.run, self.cfg, self.tx, self.user_cfg, self.events = run, cfg, tx, user_cfg, events
        self.watched = 0  # logged steps judged by this process (a replayed step again)
        # the losses the guard saw, and the last step's metrics (a prediction a kill interrupted)
        self.seen, self.before = guard.history_before(run.run_dir, start, cfg.model.n_layers)
        self.watch = guard.Watch.replay(cfg.guard, self.seen, start, guard.watch_since(events))

    def decide(self, trigger: guard.Trigger, params) -> bool:
        """The guard's answer to `trigger`, recorded (deleting the bad path's checkpoints first)
        and appended to the events; True where the loop must return. `params`: the state now,
        whose held-out loss a level shift sets against the kept checkpoint's before the event
        (a shift in the data)."""
        cfg, run, e = self.cfg, self.run, None
        run.mngr.wait_until_finished()
        kept = guard.kept_before(cfg.guard, trigger, run.mngr.all_steps(), self.events)
        if trigger.rule == "shift" and cfg.guard.data_fraction and kept:
            ref = restore_checkpoint(run.mngr, kept[-1],
                                     abstract_state(cfg.model, make_tx(cfg), run.mesh))
            e = guard.in_the_data(cfg.guard, trigger, self.held_out(ref["params"]),
                                  self.held_out(params), kept[-1])
        e = e or guard.plan(cfg.guard, trigger, sorted(run.mngr.all_steps()), self.events)
        say(describe(e))
        run.log.tracker.log({"guard/event_step": e["event_step"], "guard/rollback_to":
                             e.get("rollback_to", -1), "guard/escalated": int("escalation" in e)},
                            trigger.step)
        for s in sorted(run.mngr.all_steps(), reverse=True):  # the bad path's checkpoints first
            if e["action"] in ("rollback", "escalate") and s > e["rollback_to"]:
                run.mngr.delete(s)
        if jax.process_index() == 0:
            guard.record(run.run_dir, e)
        self.events.append(e)
        return e["action"] not in ("go-on", "data")

    def held_out(self, params) -> float:
        return self.run.held_out(self.cfg, self.tx, params)

    def resumed(self, start: int) -> bool:
        """A prediction a kill kept from its record, made again (at a checkpoint step)."""
        t = guard.predicted(self.cfg.guard, self.events, start, self.before) \
            if start % self.cfg.checkpoint_every == 0 else None
        return bool(t) and self.decide(t, None)

    def sees(self, info) -> bool:
        """One StepInfo of the loop: a step read, or a checkpoint written."""
        if info.kind == "logged":
            return self.logged(info.record, info.state["params"])
        return self.checkpointed(info.record["step"] + 1, info.record, info.final)

    def logged(self, last: dict, params) -> bool:
        """A logged step: the watch over its loss (NaN where the step was non-finite)."""
        loss = last["loss"] if math.isfinite(last["grad_norm"]) else math.nan
        self.seen[last["step"]], self.watched = loss, self.watched + 1
        if not (trigger := self.watch.observe(last["step"], loss)):
            return False
        trigger = dataclasses.replace(trigger, max_logit=max(last["attn_logit_max"]))
        back = self.decide(trigger, params)
        if self.events[-1]["action"] == "data":
            self.watch.restart()  # the new level is the data's
        return back

    def checkpointed(self, step: int, last: dict, final: bool) -> bool:
        """At a checkpoint the watch starts again from what it has seen; then the prediction
        (not at the end, nor when stopping), escalated where the run stands."""
        self.watch = guard.Watch.replay(self.cfg.guard, self.seen, step,
                                        guard.watch_since(self.events))
        t = None if final else guard.predicted(self.cfg.guard, self.events, step, last)
        return bool(t) and self.decide(t, None)

    def stopped(self) -> bool:
        """The last event is a "stop": said on stderr."""
        e, run = self.events[-1], self.run
        if e["action"] == "stop":
            print(f"stopping: the guard's verdict at step {e['trigger_step']}: {e['why']}. "
                  f"Last checkpoint: step {run.mngr.latest_step()} in {run.run_dir}",
                  file=sys.stderr)
        return e["action"] == "stop"

    def go_on(self) -> tuple:
        """(cfg, tx, state) a fresh loop goes on with after the last event: its rollback point
        restored, what an escalation inserts inserted."""
        e, run = self.events[-1], self.run
        r = e["rollback_to"]
        before = config_at(self.user_cfg, self.events, r)
        state = restore_checkpoint(run.mngr, r, abstract_state(before.model, make_tx(before),
                                                              run.mesh))
        tx = make_tx(cfg := config_at(self.user_cfg, self.events))
        if guard.pending_insertion(self.events, r):
            state = insert_new_leaves(cfg, tx, state, run.mesh)
        run.rolled_back(cfg)
        # the watch goes on from the losses before the rollback point
        self.cfg, self.tx = cfg, tx
        self.seen = {s: x for s, x in self.seen.items() if r - guard.SPAN <= s < r}
        self.watch = guard.Watch.replay(cfg.guard, self.seen, r, guard.watch_since(self.events))
        return cfg, tx, state


def drive(run, cfg: TrainConfig, tx, state, user_cfg: TrainConfig,
          events: list) -> tuple[str, dict]:
    """Run the loop with the guard watching, a fresh loop from each point the guard goes on
    from, until it ends for another reason; returns (that reason, the last step's record)."""
    judge = Judge(run, cfg, tx, user_cfg, list(events), int(state["step"]))
    judged, last = judge.resumed(int(state["step"])), {}
    while True:
        if judged and judge.stopped():
            return "stopped", last
        if judged:
            cfg, tx, state = judge.go_on()
        judged = False
        for info in run_loop(run, cfg, tx, state):
            last = info.record
            if judge.sees(info):
                judged = True
                break
            if too_many_nonfinite(run, cfg):
                return "non-finite", last
        if not judged:
            if ended(run) == "done":
                say(f"guard: {judge.watched:,} steps watched, {len(judge.events)} event(s) "
                    f"({len(acted(judge.events))} acted on) in {run.run_dir}/events.jsonl")
            return ended(run), last
