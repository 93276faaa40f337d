"""The training loop, a generator (as Levanter's `training_steps`): train.py's plain run and
guarded.py's guard both consume it, and each decides when to stop.

    for info in run_loop(run, cfg, tx, state):
        if too_many_nonfinite(run, cfg):
            break

It yields each step's record once it has read it: step s-1's, after step s is dispatched, so
the device never waits on the host. At a checkpoint step it reads step s (the save waits for
step s anyway), yields it, saves, and yields that it saved: a caller that stops on the record
stops before the checkpoint is written. It never stops early itself.
"""

import dataclasses
from typing import NamedTuple

import jax
from jax import P

from checkpoint import save_checkpoint
from config import TrainConfig
from data import TokenData
from distributed import StopRequested, checkpoint_failed, process_rows
from model import logical_to_spec
from tracking import Log

BATCH = logical_to_spec(("batch", "seq"))  # a token batch [B, T+1]
BATCHES = P(None, *BATCH)  # [C, B, T+1]: C batches, each split as BATCH


def put_held_out(data: TokenData, mesh, rows: slice = slice(None)) -> jax.Array:
    """The held-out set on the mesh, each batch split over "data" like a training batch."""
    C, _, T1 = (local := data.held_out_batches(rows)).shape
    return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, BATCHES),
                                                  local, (C, data.cfg.batch_size, T1))


class Run:
    """What lives across the loop's restarts (the guard's rollbacks): the run directory, its
    checkpoints, data, log and stop flag, and the compiled steps, one pair per (model, optim)
    config, so that going back to a step compiles nothing. `compile_steps(cfg, tx)` gives the
    pair (train.py's jitted train and eval steps)."""

    def __init__(self, run_dir, mesh, mngr, data: TokenData, log: Log, stop: StopRequested,
                 compile_steps):
        self.run_dir, self.mesh, self.mngr, self.data, self.log, self.stop = \
            run_dir, mesh, mngr, data, log, stop
        self.batch_sharding = jax.NamedSharding(mesh, BATCH)
        self.rows = process_rows(self.batch_sharding, data.cfg.batch_size)
        self.eval_tokens = put_held_out(data, mesh, self.rows)
        self.compile_steps, self.compiled = compile_steps, {}

    def compiled_steps(self, cfg: TrainConfig, tx) -> tuple:
        """(train_step, eval_step) for cfg's model and optimizer, compiled once."""
        if (key := (cfg.model, cfg.optim)) not in self.compiled:
            self.compiled[key] = self.compile_steps(cfg, tx)
        return self.compiled[key]

    def batch(self, step: int) -> jax.Array:
        """Step `step`'s token batch [B, T+1], split over "data" (this process's rows)."""
        return jax.make_array_from_process_local_data(self.batch_sharding,
                                                      self.data.batch(step, self.rows))

    def held_out(self, cfg: TrainConfig, tx, params) -> float:
        """The held-out loss of `params` (a host read: it waits for them)."""
        return float(self.compiled_steps(cfg, tx)[1](params, self.eval_tokens))

    def rolled_back(self, cfg: TrainConfig) -> None:
        """After a rollback: the batches cfg replaces drawn afresh, the log's counts restarted."""
        self.data.replace_batches(cfg.data.replace_batches)
        self.log.restart()


class StepInfo(NamedTuple):
    """What the loop yields: a step's record once read ("logged"), or a checkpoint written
    after it ("saved"; `final` at the run's end or a signal), and the train state now."""
    kind: str
    record: dict
    state: dict
    final: bool = False


def run_loop(run: Run, cfg: TrainConfig, tx, state):
    """Train from the state's step to cfg.steps, yielding a StepInfo for each step read and
    each checkpoint saved; after the step where SIGINT / SIGTERM came it saves and ends."""
    train_step, eval_step = run.compiled_steps(cfg, tx)
    step, pending = int(state["step"]), None
    while step < cfg.steps:
        # batch and step: dispatched, not waited for
        state, metrics = train_step(state, run.batch(step))
        done = step + 1
        # eval: the held-out loss every eval_every steps and after the last
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics["eval_loss"] = eval_step(state["params"], run.eval_tokens)
        # log step s-1: read only now that step s is dispatched (reading step s's would make
        # the host wait while the device idles)
        if pending is not None:
            yield StepInfo("logged", run.log.record(*pending), state)
        pending = (step, metrics)
        # checkpoint: step s read (the save waits for it anyway) and yielded first, then
        # saved; stop after the step where a signal came
        stopping = run.stop.requested(step)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping:
            record, pending = run.log.record(*pending), None
            yield StepInfo("logged", record, state)
            save(run, done, cfg, state)
            yield StepInfo("saved", record, state, final=done == cfg.steps or stopping)
        if stopping:
            return
        step += 1


def too_many_nonfinite(run: Run, cfg: TrainConfig) -> bool:
    return run.log.nonfinite >= cfg.max_consecutive_nonfinite


def ended(run: Run) -> str:
    """Why a loop that ran out ended: "signal" (saved after the step where it came) or "done"."""
    return "signal" if run.stop.signal else "done"


def save(run: Run, step=None, cfg=None, state=None) -> None:
    """Save a checkpoint (asynchronously), or with no step wait for the saves in flight; a
    failed write ends the run on every process (distributed.checkpoint_failed)."""
    try:
        if step is None:
            run.mngr.wait_until_finished()
        else:
            save_checkpoint(run.mngr, step, state, dataclasses.asdict(cfg))
    except Exception as e:
        checkpoint_failed(e, run.run_dir)
