"""Train a Llama-style LM, sharded with jax.jit, checkpointed with orbax, resumable exactly.

    python train.py                          # the CPU default: a few minutes on a laptop
    python train.py tiny --steps 50          # a preset, then any flag (--help lists them all)
    python train.py marin-32b --dry-run --mesh.data 256 --mesh.model 4
    python train.py --resume runs/default    # continue a run with its stored config

Running the same command again in the same --run-dir resumes from the latest checkpoint and
continues exactly (bitwise, on CPU). Ctrl-C / SIGTERM saves a checkpoint before exiting; a
second Ctrl-C stops at once. Every mistake in the flags, the data or the run directory is one
line and exit status 2, before anything is written.

NOTE for readers looking for `pjit`: in current JAX, `jax.jit` with shardings *is* pjit;
`jax.experimental.pjit` is deprecated. The mesh uses explicit sharding (`AxisType.Explicit`).
"""

import contextlib
import dataclasses
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import P
from jax.experimental import multihost_utils

import guard
from attention import check_platform, resolve
from checkpoint import (
    abstract_state,
    carry,
    check_run_dir,
    checkpoint_manager,
    drop_torn_line,
    fresh_state,
    init_new_leaves,
    per_device_bytes,
    restore_checkpoint,
    resume,
    run_lock,
    save_checkpoint,
    saved_steps,
    strict_json,
    write_config,
)
from cli import UserError, command, parse
from config import PRESETS, TrainConfig, check_escalation, check_same_run, load_config
from data import TokenData, parse_ranges, token_unit
from distributed import (
    StopRequested,
    check_fits,
    checkpoint_failed,
    give_up,
    make_mesh,
    peer_stopped,
    process_rows,
    say,
    start_distributed,
)
from export import load_hf
from model import count_params, decay_mask, flops_per_token, logical_to_spec, loss_fn
from optim import lr_schedule, make_optimizer, opt_metrics
from report import acted, describe, event_report, plot, read_events, read_metrics
from tracking import Tracker


def parse_config(argv: list[str]) -> TrainConfig:
    """`[preset] [--flags]`: the preset (default "cpu") supplies the defaults the flags override.
    `--resume RUN [--flags]` (or `RUN [--flags]`): the config stored in the run directory RUN
    does, so a run continues without its preset and flags retyped."""
    if "--resume" in argv or (argv and argv[0] not in PRESETS and pathlib.Path(argv[0]).is_dir()):
        i = argv.index("--resume") + 1 if "--resume" in argv else 0
        if i >= len(argv):
            raise UserError("--resume needs a run directory: --resume RUN")
        run, rest = pathlib.Path(argv[i]), argv[:max(i - 1, 0)] + argv[i + 1:]
        stored = load_config(run)
        if stored is None:
            raise UserError(f"--resume {run}: no config.json there; give a train.py run directory")
        return parse_flags(dataclasses.replace(stored, run_dir=str(run), resume_step=None,
                                               dry_run=False), rest)
    name = argv[0] if argv and not argv[0].startswith("-") else "cpu"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    rest = argv[1:] if argv and argv[0] == name else argv
    return parse_flags(PRESETS[name], rest)


def parse_flags(default: TrainConfig, args: list[str]) -> TrainConfig:
    """tyro over TrainConfig with `default` as the defaults; a bad flag is a UserError.
    `--guard` alone is `--guard.on`."""
    args = ["--guard.on" if a == "--guard" else a for a in args]
    cfg = parse(TrainConfig, args, default=default,
                description=f"{__doc__}\nPresets: {', '.join(PRESETS)}.")
    given = [a.split("=")[0] for a in args if a.startswith("--guard.") and a != "--guard.on"]
    if given and not cfg.guard.on:
        raise UserError(f"{given[0]} is a setting of the guard, which is off: add --guard")
    return cfg


def setup_mesh(cfg: TrainConfig, devices) -> jax.sharding.Mesh:
    """The mesh of cfg.mesh over `devices`, once the model and batch are known to fit on it."""
    check_fits(cfg.mesh, cfg.model, cfg.data.batch_size, len(devices))
    try:
        check_platform(cfg.model.attention, devices[0].platform)
    except ValueError as e:
        raise UserError(str(e)) from None
    return make_mesh(cfg.mesh, devices)


def load_data(cfg: TrainConfig) -> TokenData:
    try:
        return TokenData(cfg.data, cfg.model.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None


def make_tx(cfg: TrainConfig):
    return make_optimizer(cfg.optim, cfg.steps, decay_mask(cfg.model))


def insert_qk_norm(cfg: TrainConfig, state: dict, mesh) -> dict:
    """The warm start's carry in process: `state` (a run without QK-Norm) in cfg's state, the
    new norm scales at 1 with zero moments, every other leaf kept."""
    tx = make_tx(cfg)
    target = abstract_state(cfg.model, tx, mesh)
    return carry(state, target, init_new_leaves(cfg, tx, target))[0]


# ---------------------------------------------------------------------------------------------
# The train step

def per_layer_norms(tree: dict) -> jax.Array:
    """[L] L2 norms over the stacked per-layer leaves of a params-shaped tree."""
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
          for x in jax.tree.leaves(tree["layers"])]
    return jnp.sqrt(sum(sq))


def per_layer_metrics(params, grads, updates, opt_state) -> dict:
    """[L] per-layer norms of what moves before a spike (Marin: update spikes first, larger in
    the lower layers; Adam's first moment doubled while the second stayed flat): gradients,
    updates, q/k weights, and Adam's moments, read from the optimizer state (no recompute)."""
    out = {"grad_norm_per_layer": per_layer_norms(grads),
           "update_norm_per_layer": per_layer_norms(updates)}
    out |= {f"{w}_norm": per_layer_norms({"layers": {w: params["layers"][w]}})
            for w in ("wq", "wk")}
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    if adam and jax.tree.leaves(adam[0].mu.get("layers", {})):  # (Muon: Adam has the norms)
        out["adam_mu_norm_per_layer"] = per_layer_norms(adam[0].mu)
        out["adam_nu_norm_per_layer"] = per_layer_norms(adam[0].nu)
    return out


def build_train_step(cfg: TrainConfig, tx):
    """The one train step, un-jitted: (state, tokens [B, T+1]) -> (new state, metrics). train.py
    jits it (make_train_step); search.py vmaps it over seeds and scans it over steps."""
    schedule = lr_schedule(cfg.optim, cfg.steps)

    clip = cfg.optim.qk_clip > 0  # QK-Clip reads each head's max logit on the batch

    def train_step(state, tokens_BT1):
        params = state["params"]
        stats = {"head_stats": True} if clip else {}
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BT1,
                                                                        cfg.model, **stats)
        heads = {"attn_logit_max_per_head": aux.pop("attn_logit_max_per_head")} if clip else {}
        updates, opt_state = tx.update(grads, state["opt_state"], params, loss=loss,
                                       step=state["step"], **heads)
        if clip:  # heads over the threshold on this batch (clipped, unless nothing applied)
            aux["qk_clip_heads"] = jnp.sum(heads["attn_logit_max_per_head"] > cfg.optim.qk_clip)
        metrics = {"loss": loss, "lr": schedule(state["step"]), **aux,
                   **opt_metrics(opt_state, cfg.optim.max_grad_norm)}
        if cfg.per_layer_metrics:
            metrics |= per_layer_metrics(params, grads, updates, opt_state)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, metrics

    return train_step


def make_train_step(cfg: TrainConfig, tx):
    return jax.jit(build_train_step(cfg, tx), donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    """(params, tokens [C, B, T+1]) -> the mean cross-entropy (nats/token; nats/byte for byte
    data) over all C batches, in one jitted pass (lax.map: one batch in memory at a time)."""
    return jax.jit(lambda params, tokens_CBT1: jnp.mean(jax.lax.map(
        lambda tokens_BT1: loss_fn(params, tokens_BT1, cfg.model)[1]["ce"], tokens_CBT1)))


BATCH = logical_to_spec(("batch", "seq"))  # a token batch [B, T+1]
BATCHES = P(None, *BATCH)  # [C, B, T+1]: C batches, each split as BATCH


def put_held_out(data: TokenData, mesh, rows: slice = slice(None)) -> jax.Array:
    """The held-out set on the mesh, each batch split over "data" like a training batch."""
    C, _, T1 = (local := data.held_out_batches(rows)).shape
    return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, BATCHES),
                                                  local, (C, data.cfg.batch_size, T1))


# ---------------------------------------------------------------------------------------------
# The loop

def dry_run(cfg: TrainConfig) -> None:
    check_fits(cfg.mesh, cfg.model, cfg.data.batch_size, None)
    total, per_device = per_device_bytes(cfg.model, make_tx(cfg), dataclasses.asdict(cfg.mesh))
    n = count_params(cfg.model)
    print(f"parameters          {n:,} ({n / 1e9:.2f}B)")
    print(f"FLOPs per token     {flops_per_token(cfg.model, cfg.data.seq_len):.3e} "
          "(6N + causal attention)")
    form = resolve(cfg.model.attention, cfg.model.dtype, softcap=cfg.model.attn_softcap)
    print(f"attention           {form} ({cfg.model.attention} on {jax.default_backend()})")
    print(f"params + opt state  {total / 2**30:.2f} GiB total, {per_device / 2**30:.3f} GiB "
          f"per device on a {cfg.mesh.data}x{cfg.mesh.model} (data x model) mesh")


class Log:
    """metrics.jsonl (process 0) and the progress line; counts non-finite steps in a row."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path, start: int):
        self.cfg, self.start, self.nonfinite = cfg, start, 0
        tags = (["warm-start", f"from {cfg.warm_started_from}"[-64:]] if cfg.warm_started_from
                else []) + ["init-from-hf"] * bool(cfg.init_from_hf)
        self.tracker = Tracker(cfg.wandb, run_dir, dataclasses.asdict(cfg), tags,
                               jax.process_index() == 0)
        self.file = None
        if jax.process_index() == 0:
            drop_torn_line(run_dir / "metrics.jsonl", say)
            self.file = open(run_dir / "metrics.jsonl", "a")
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        self.t_start = self.t_prev = time.perf_counter()
        self.t_first = None  # the first record's time: the average excludes the compile
        self.shown = (start - 1, self.t_start)  # the step and time of the last progress line
        self.lines = 0  # progress lines printed (the first one's time includes the compile)

    def record(self, step: int, metrics: dict) -> dict:
        now = time.perf_counter()
        self.t_first = self.t_first or now
        m = {"step": step, **{k: (v.tolist() if v.ndim else v.item())
                              for k, v in jax.device_get(metrics).items()},
             "tokens_per_s": self.tokens_per_step / (now - self.t_prev)}
        self.t_prev = now
        if self.file:
            self.file.write(strict_json(m) + "\n")
            self.file.flush()
        self.tracker.log(m, step)
        if step % self.cfg.log_every == 0 or "eval_loss" in m:
            # rates over the steps since the last line (the first line's include the compile;
            # a rollback restarts the count): never a division by zero, never a negative ETA
            done = max(step - self.shown[0], 1)
            per_step = (now - self.shown[1]) / done
            eta = fmt_time(per_step * max(self.cfg.steps - step - 1, 0)) if self.lines else "--"
            self.lines += 1
            rate = self.tokens_per_step / per_step
            self.shown = (step, now)
            ev = f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
            seen = (step + 1) * self.tokens_per_step
            say(f"step {step:>6}/{self.cfg.steps} | loss {m['loss']:.4f}{ev} | "
                f"grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                f"logit max {max(m['attn_logit_max']):.1f} | {seen / 1e6:.2f}M tok | "
                f"{rate / 1e3:.1f}k tok/s | {fmt_time(now - self.t_start)} | ETA {eta}",
                flush=True)
        finite = math.isfinite(m["loss"] + m["grad_norm"])
        self.nonfinite = 0 if finite else self.nonfinite + 1
        return m

    def average_tokens_per_s(self, last_step: int) -> float:
        return self.tokens_per_step * (last_step - self.start) / (self.t_prev - self.t_first)


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


def train(cfg: TrainConfig, devices=None) -> dict:
    """Train (or resume) in cfg.run_dir on `devices` (default: all); returns the last step's
    metrics. Raises UserError before writing anything if the config, data or run dir is bad."""
    if cfg.dry_run:
        dry_run(cfg)
        return {}
    mesh = setup_mesh(cfg, devices or jax.devices())
    run_dir = pathlib.Path(cfg.run_dir)
    check_run_dir(run_dir, cfg.resume_step)
    stored, steps = load_config(run_dir), saved_steps(run_dir)
    if stored is not None:
        taken = cfg.resume_step if cfg.resume_step is not None else (steps or [0])[-1]
        check_same_run(stored, cfg, taken)
        if cfg.optim.qk_clip == stored.optim.qk_clip:  # the step a switch was made at stays
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
                cfg.optim, qk_clip_start=stored.optim.qk_clip_start))
        else:  # switched on (or off) from here on
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                     qk_clip_start=taken))
            say(f"QK-Clip threshold {stored.optim.qk_clip:g} -> {cfg.optim.qk_clip:g} from "
                f"step {taken} on (a switch the run's config records)")
    check_escalation(cfg)
    hf_params = load_hf(pathlib.Path(cfg.init_from_hf), cfg.model) if cfg.init_from_hf and \
        not steps else None
    user_cfg, events = cfg, read_events(run_dir) if steps else []
    at = cfg.resume_step if cfg.resume_step is not None else (steps or [0])[-1]
    events, later = guard.split_at(events, at)  # (later: a --resume-step went back past them)
    cfg = effective(user_cfg, events, restored_at=at)  # the checkpoint's shape
    data = load_data(cfg)
    tx = make_tx(cfg)
    target = abstract_state(cfg.model, tx, mesh)
    lock = run_lock(run_dir, say) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock, jax.set_mesh(mesh):
        mngr, state = resume(run_dir, target, cfg.keep_checkpoints, cfg.resume_step, say)
        if state is None:
            state = fresh_state(cfg.model, cfg.seed, tx, target)
            if hf_params is not None:  # (Adam's moments start at zero either way)
                state["params"] = jax.tree.map(lambda x, t: jax.make_array_from_callback(
                    x.shape, t.sharding, lambda i: x[i]), hf_params, target["params"])
            n = count_params(cfg.model)
            say(f"new run {run_dir}: {n / 1e6:.2f}M params, {cfg.steps} steps, "
                f"mesh {cfg.mesh.data}x{cfg.mesh.model} on {jax.process_count()} process(es), "
                f"{data.train.size:,} training tokens")
        if later and jax.process_index() == 0:
            aside = guard.set_aside(run_dir, events, later, time.strftime("%Y%m%d-%H%M%S"))
            say(f"moved the guard's {len(later)} later action(s) aside to {aside}")
        if events:  # the guard's actions so far, re-applied
            cfg = effective(user_cfg, events)
            if guard.pending_insertion(events, int(state["step"])):
                state = insert_qk_norm(cfg, state, mesh)
            tx, data = make_tx(cfg), load_data(cfg)
            say(f"guard: {len(acted(events))} recorded action(s) re-applied")
        say(identity(cfg))
        if jax.process_index() == 0:
            write_config(run_dir, dataclasses.asdict(user_cfg))
        mngr = mngr or checkpoint_manager(run_dir, cfg.keep_checkpoints)
        return run_loop(cfg, tx, state, data, mesh, mngr, run_dir, user_cfg, events)


def effective(user_cfg: TrainConfig, events: list, restored_at: int | None = None):
    """guard.effective_config, with a setting that cannot go beside what the guard did (QK-Clip
    switched on by a resume after it inserted QK-Norm) a UserError."""
    try:
        return guard.effective_config(user_cfg, events, restored_at)
    except ValueError as e:
        done = ", ".join(f"{x['escalation']} at step {x['rollback_to']}" for x in acted(events)
                         if x.get("escalation"))
        raise UserError(f"the guard escalated this run ({done}; events.jsonl): {e}") from None


def identity(cfg: TrainConfig) -> str:
    """The run in three lines: the model, the optimizer and its levers, the data."""
    m, o, d = cfg.model, cfg.optim, cfg.data
    levers = [x for x, on in (("QK-Norm", m.qk_norm), (f"QK-Clip {o.qk_clip:g}", o.qk_clip),
                              (f"grad clip {o.max_grad_norm:g}", o.max_grad_norm),
                              ("skip-step", o.skip_step), (f"update clip {o.update_clip}",
                                                           o.update_clip != "off"),
                              ("guard", cfg.guard.on)) if on]
    return (f"model: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} "
            f"heads, vocab {m.vocab_size}, seed {cfg.seed}\n"
            f"optim: {o.optimizer}, LR {o.lr:g} (warmup {o.warmup_steps}), beta2 {o.b2:g}; "
            f"levers: {', '.join(levers) or 'none'}\n"
            f"data: {d.source or 'the embedded corpus'}, batch {d.batch_size} x {d.seq_len}, "
            f"seed {d.seed}; {cfg.steps} steps")


def losses_before(run_dir: pathlib.Path, start: int) -> dict[int, float]:
    """{step: loss} of the guard.SPAN steps before `start`, from metrics.jsonl (process 0's,
    sent to every process: each must take the same decisions)."""
    steps_losses = np.full((2, guard.SPAN), -1.0)
    if jax.process_index() == 0 and start and (run_dir / "metrics.jsonl").is_file():
        m = read_metrics(run_dir)
        keep = (m["step"] < start) & (m["step"] >= start - guard.SPAN)
        n = int(keep.sum())
        loss = np.where(np.isfinite(m["grad_norm"]), m["loss"], np.nan)  # as the loop sees it
        steps_losses[:, :n] = m["step"][keep], loss[keep]
    if jax.process_count() > 1:
        steps_losses = multihost_utils.broadcast_one_to_all(steps_losses)
    return {int(s): float(x) for s, x in steps_losses.T if s >= 0}


def guard_action(trigger, cfg, user_cfg, events: list, mngr, run_dir, mesh, log):
    """The guard's answer to `trigger` (guard.py), appended to `events` (the run's record, as
    every process holds it): None to go on as before, or (cfg, tx, state) to go on with from
    the rollback point. Exits on a "stop"."""
    mngr.wait_until_finished()
    e = guard.plan(cfg.guard, trigger, sorted(mngr.all_steps()), events)
    say(describe(e))
    log.tracker.log({"guard/event_step": e["event_step"], "guard/rollback_to":
                     e.get("rollback_to", -1), "guard/escalated": int("escalation" in e)},
                    trigger.step)
    if e["action"] in ("rollback", "escalate"):  # the bad path's checkpoints go first
        for s in sorted(mngr.all_steps(), reverse=True):
            if s > e["rollback_to"]:
                mngr.delete(s)
    if jax.process_index() == 0:
        guard.record(run_dir, e)
    events.append(e)
    if e["action"] == "go-on":
        return None
    if e["action"] == "stop":
        print(f"stopping: the guard's verdict at step {trigger.step}: {e['why']}. Last "
              f"checkpoint: step {mngr.latest_step()} in {run_dir}", file=sys.stderr)
        log.tracker.finish()
        sys.exit(1)
    r = e["rollback_to"]
    before = guard.effective_config(user_cfg, events, restored_at=r)
    state = restore_checkpoint(mngr, r, abstract_state(before.model, make_tx(before), mesh))
    new = guard.effective_config(user_cfg, events)
    if guard.pending_insertion(events, r):
        state = insert_qk_norm(new, state, mesh)
    return new, make_tx(new), state


def run_loop(cfg, tx, state, data, mesh, mngr, run_dir, user_cfg=None, events=()) -> dict:
    train_step, eval_step = make_train_step(cfg, tx), make_eval_step(cfg)
    batch_sharding = jax.NamedSharding(mesh, BATCH)
    rows = process_rows(batch_sharding, cfg.data.batch_size)

    def put(tokens):
        return jax.make_array_from_process_local_data(batch_sharding, tokens)

    eval_tokens = put_held_out(data, mesh, rows)
    start = int(state["step"])
    if start >= cfg.steps:  # a finished run, resumed: nothing to train
        say(f"{run_dir} is done (step {start} of {cfg.steps}): sample it with python sample.py "
            f"{run_dir}, or train on with python train.py --resume {run_dir} --steps N")
        return {}
    stop = StopRequested(run_dir)
    log = Log(cfg, run_dir, start)
    prev, last = None, {}

    def checkpoint(step=None):  # save step's state (async), or wait for the saves to finish
        try:
            if step is None:
                mngr.wait_until_finished()
            else:
                save_checkpoint(mngr, step, state, dataclasses.asdict(cfg))
        except Exception as e:
            checkpoint_failed(e, run_dir)

    watch, seen, events = None, {}, list(events)  # the guard, the losses it saw, its record
    if cfg.guard.on:  # its view of the steps before `start` (after a resume)
        seen = losses_before(run_dir, start)
        watch = guard.Watch.replay(cfg.guard, seen, start, guard.escalation_step(events))

    def record(step_metrics):  # log a step; with the guard on, the guard's answer to it
        last = log.record(*step_metrics)
        if watch is None:
            return last, None
        loss = last["loss"] if math.isfinite(last["grad_norm"]) else math.nan
        seen[last["step"]] = loss
        trigger = watch.observe(last["step"], loss)
        return last, trigger and guard_action(trigger, cfg, user_cfg or cfg, events, mngr,
                                              run_dir, mesh, log)

    def go_back(acted):  # go on from the guard's rollback point with what it changed
        new_cfg, new_tx, new_state = acted
        data.replaced = parse_ranges(new_cfg.data.replace_batches, "replace_batches")
        steps = (train_step, eval_step)
        if (new_cfg.model, new_cfg.optim) != (cfg.model, cfg.optim):  # a new step function
            steps = make_train_step(new_cfg, new_tx), make_eval_step(new_cfg)
        at = int(new_state["step"])
        kept = {s: x for s, x in seen.items() if at - guard.SPAN <= s < at}
        log.nonfinite, log.shown = 0, (at - 1, time.perf_counter())
        return (new_cfg, new_tx, new_state, *steps, at, kept,
                guard.Watch.replay(new_cfg.guard, kept, at, guard.escalation_step(events)))

    step = start
    while step < cfg.steps:
        state, metrics = train_step(state, put(data.batch(step, rows)))  # dispatch: async
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics["eval_loss"] = eval_step(state["params"], eval_tokens)
        # NOTE: step s-1's metrics are read only now, after step s is dispatched: reading step
        # s's would make the host wait for the device, which would then idle while the host
        # logs and builds the next batch.
        if prev is not None:
            (last, acted), prev = record(prev), None
            if acted:
                cfg, tx, state, train_step, eval_step, step, seen, watch = go_back(acted)
                continue
            if log.nonfinite >= cfg.max_consecutive_nonfinite:
                checkpoint()
                print(f"stopping: {log.nonfinite} non-finite steps in a row (last at step "
                      f"{last['step']}); parameters were left unchanged by them. Last "
                      f"checkpoint: step {mngr.latest_step()} in {run_dir}", file=sys.stderr)
                log.tracker.finish()
                sys.exit(1)
        prev = (step, metrics)
        stopping = stop.requested(step)
        saving = done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping
        if saving and watch is not None:  # the guard sees a step before its state is saved
            (last, acted), prev = record(prev), None
            if acted:
                cfg, tx, state, train_step, eval_step, step, seen, watch = go_back(acted)
                continue
            watch = guard.Watch.replay(cfg.guard, seen, done, guard.escalation_step(events))
        if saving:
            checkpoint(done)
        if stopping:
            break
        step += 1
    if prev is not None:
        last = log.record(*prev)
    if last and last["step"] > start:
        last["avg_tokens_per_s"] = log.average_tokens_per_s(last["step"])
    checkpoint()
    if stop.signal:
        say(f"saved step {last['step'] + 1} to {run_dir}; resume with the same command")
        log.tracker.finish()
        sys.exit(128 + stop.signal)
    if log.file:
        log.file.close()
        try:  # the run is saved; a report that cannot be made is a note, not a failure
            metrics = read_metrics(run_dir)
            print(text := event_report(metrics, str(run_dir)))
            figures = plot({run_dir.name: metrics}, run_dir / "figures",
                           unit=token_unit(cfg.data.source)) if log.tracker.run else []
            log.tracker.finish(text, figures)
        except UserError as e:
            print(f"note: no spike report: {e}", file=sys.stderr)
    return last


@command
def main(argv: list[str]) -> int:
    cfg = parse_config(argv)
    start_distributed(cfg.dist)
    t0 = time.perf_counter()
    try:
        last = train(cfg)
    except jax.errors.JaxRuntimeError:  # a collective cut off by a process that stopped
        if peer := peer_stopped():
            give_up(f"error: {peer}; process {jax.process_index()} stops too", code=1)
        raise
    if last:
        say(f"done: step {last['step'] + 1}, held-out loss {last['eval_loss']:.4f} "
            f"nats/{token_unit(cfg.data.source)}, {last.get('avg_tokens_per_s', 0):.0f} "
            f"tokens/s on average, {fmt_time(time.perf_counter() - t0)} in all; checkpoint "
            f"step {last['step'] + 1} in {cfg.run_dir}. Sample: python sample.py "
            f"{cfg.run_dir}; train on: python train.py --resume {cfg.run_dir} --steps N")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
