"""Train a Llama-style LM, sharded with jax.jit, checkpointed with orbax, resumable exactly.

    python train.py                          # the CPU default: a few minutes on a laptop
    python train.py tiny --steps 50          # a preset, then any flag (--help lists them all)
    python train.py marin-32b --dry-run --mesh.data 256 --mesh.model 4
    python train.py --resume runs/default    # continue a run with its stored config

Running the same command again in the same --run-dir resumes from the latest checkpoint and
continues exactly (bitwise, on CPU). Ctrl-C / SIGTERM saves a checkpoint before exiting; a
second Ctrl-C stops at once. Every mistake in the flags, the data or the run directory is one
line and exit status 2, before anything is written. (`jax.jit` with shardings is pjit.)
"""

import contextlib
import dataclasses
import functools
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import P

import guard
from attention import resolve
from checkpoint import (
    abstract_state,
    check_run_dir,
    checkpoint_manager,
    fresh_state,
    insert_new_leaves,
    per_device_bytes,
    restore_checkpoint,
    resume,
    run_lock,
    save_checkpoint,
    saved_steps,
    strict_json,
    write_config,
)
from cli import UserError, command, drop_torn_line, fmt_time
from config import (
    TrainConfig,
    check_escalation,
    effective,
    identity,
    load_config,
    make_tx,
    parse_config,
    resumed,
    train_on,
)
from data import TokenData, parse_ranges, token_unit
from distributed import (
    StopRequested,
    check_fits,
    checkpoint_failed,
    give_up,
    peak_tflops,
    peer_lost,
    peer_stopped,
    process_rows,
    say,
    setup_mesh,
    start_distributed,
)
from hf import load_hf
from model import activation_bytes, count_params, flops_per_token, logical_to_spec, loss_fn
from optim import lr_schedule, opt_metrics, per_layer_metrics
from report import acted, describe, final_report, read_events
from tracking import Tracker


def load_data(cfg: TrainConfig) -> TokenData:
    try:
        return TokenData(cfg.data, cfg.model.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# The train step

# loss_fn's statistics that are maxima (over a batch's slices too); the others are means
MAX_STATS = {"attn_logit_max", "attn_logit_max_per_head", "out_logit_max"}


def build_train_step(cfg: TrainConfig, tx):
    """The one train step, un-jitted: (state, tokens [B, T+1]) -> (new state, metrics). train.py
    jits it (make_train_step); lab/harness.py vmaps it over seeds and scans it over steps."""
    schedule = lr_schedule(cfg.optim, cfg.steps)
    clip = cfg.optim.qk_clip > 0  # QK-Clip reads each head's max logit on the batch

    def loss_and_grads(params, tokens_BT1, stats):
        """(loss, aux), gradients of the whole batch; with --microbatches k the gradient is
        summed over k slices of it in a lax.scan (gradient accumulation; slice j holds rows j,
        j + k, ..., so every slice splits over "data" as the batch does): the mean loss and
        gradient are the whole batch's, a max statistic the max over the slices."""
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        k = cfg.microbatches
        if k == 1:
            return grad_fn(params, tokens_BT1, cfg.model, **stats)
        B, T1 = tokens_BT1.shape
        slices_KBT1 = jnp.swapaxes(tokens_BT1.reshape(B // k, k, T1, out_sharding=P(
            BATCH[0], None, None)), 0, 1)  # (the step runs inside a mesh: train.py, the harness)

        def add(grads, tokens):
            (loss, aux), g = grad_fn(params, tokens, cfg.model, **stats)
            return jax.tree.map(jnp.add, grads, g), (loss, aux)
        grads, (loss_K, aux_K) = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params),
                                              slices_KBT1)
        aux = {key: jnp.max(v, axis=0) if key in MAX_STATS else jnp.mean(v, axis=0)
               for key, v in aux_K.items()}
        return (jnp.mean(loss_K), aux), jax.tree.map(lambda g: g / k, grads)

    def train_step(state, tokens_BT1):
        params = state["params"]
        stats = {"head_stats": True} if clip else {}
        (loss, aux), grads = loss_and_grads(params, tokens_BT1, stats)
        heads = {"attn_logit_max_per_head": aux.pop("attn_logit_max_per_head")} if clip else {}
        updates, opt_state = tx.update(grads, state["opt_state"], params, loss=loss,
                                       step=state["step"], **heads)
        if clip:  # heads over the threshold on this batch (clipped, unless nothing applied)
            aux["qk_clip_heads"] = jnp.sum(heads["attn_logit_max_per_head"] > cfg.optim.qk_clip)
        metrics = {"loss": loss, "lr": schedule(state["step"]), **aux,
                   **opt_metrics(opt_state, cfg.optim.max_grad_norm)}
        if cfg.per_layer_metrics:
            metrics |= per_layer_metrics(params, grads, updates, opt_state, cfg.spectral_metrics)
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
    tokens = cfg.data.batch_size // cfg.mesh.data // cfg.microbatches * cfg.data.seq_len
    act = activation_bytes(cfg.model, tokens, cfg.mesh.model)
    print(f"activations         {act / 2**30:.3f} GiB per device ({tokens:,} tokens a device "
          f"{'a microbatch ' if cfg.microbatches > 1 else ''}kept for the backward: a lower "
          f"bound, the backward's temporaries on top; --microbatches K divides it by K); "
          f"with the state {(act + per_device) / 2**30:.3f} GiB")


class Log:
    """metrics.jsonl (process 0) and the progress line; counts non-finite steps in a row."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path, start: int):
        self.cfg, self.start, self.nonfinite = cfg, start, 0
        tags = (["warm-start", f"from {cfg.warm_started_from}"[-64:]] if cfg.warm_started_from
                else []) + ["init-from-hf"] * bool(cfg.init_from_hf)
        if (main := jax.process_index() == 0):
            drop_torn_line(run_dir / "metrics.jsonl", say)
        self.file = open(run_dir / "metrics.jsonl", "a") if main else None
        self.tracker = Tracker(cfg.wandb, run_dir, dataclasses.asdict(cfg), tags, main)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        peak, source = peak_tflops(cfg.peak_tflops)
        # model FLOPs a second the devices could do: MFU = achieved / this (PaLM's MFU)
        self.peak_flops = peak * 1e12 * cfg.mesh.data * cfg.mesh.model  # the mesh's devices
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        if main and start < cfg.steps:
            say(f"MFU against {peak:g} TFLOP/s a device ({source})" if peak else
                f"MFU: no peak known for {jax.devices()[0].device_kind} (--peak-tflops P shows "
                "it; bench/README.md has this CPU's matmul rate)")
        self.t_start = self.t_prev = time.perf_counter()
        self.t_first = None  # the first record's time: the average excludes the compile
        self.since = None  # (step, time) of the first record since the compile or a rollback

    def record(self, step: int, metrics: dict) -> dict:
        now = time.perf_counter()
        self.t_first, self.since = self.t_first or now, self.since or (step, now)
        m = {"step": step, **{k: (v.tolist() if v.ndim else v.item())
                              for k, v in jax.device_get(metrics).items()},
             "tokens_per_s": self.tokens_per_step / (now - self.t_prev)}
        self.t_prev = now
        if self.file:
            self.file.write(strict_json(m) + "\n")
            self.file.flush()
        self.tracker.log(m, step)
        if step % self.cfg.log_every == 0 or "eval_loss" in m:
            # rates over the steps since the first record after the compile or the last
            # rollback (none on that record itself): never a division by zero or negative ETA
            per_step = (now - self.since[1]) / (step - self.since[0]) if self.since and \
                step > self.since[0] else None
            eta = fmt_time(per_step * max(self.cfg.steps - step - 1, 0)) if per_step else "--"
            ev = f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
            rate = self.tokens_per_step / per_step if per_step else None  # tokens a second
            mfu = (f"MFU {self.flops_per_token * rate / self.peak_flops:.1%} | "
                   if rate and self.peak_flops else "")
            say(f"step {step:>6}/{self.cfg.steps} | loss {m['loss']:.4f}{ev} | "
                f"grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                f"logit max {max(m['attn_logit_max']):.1f} | "
                f"{(step + 1) * self.tokens_per_step / 1e6:.2f}M tok | "
                f"{f'{rate / 1e3:.1f}k' if rate else '--'} tok/s | {mfu}"
                f"{fmt_time(now - self.t_start)} | ETA {eta}", flush=True)
        finite = math.isfinite(m["loss"] + m["grad_norm"])
        self.nonfinite = 0 if finite else self.nonfinite + 1
        return m

    def average_tokens_per_s(self, last_step: int) -> float:
        return self.tokens_per_step * (last_step - self.start) / (self.t_prev - self.t_first)


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
    at = cfg.resume_step if cfg.resume_step is not None else (steps or [0])[-1]
    cfg = resumed(stored, cfg, at) if stored is not None else cfg
    check_escalation(cfg)
    hf_params = load_hf(pathlib.Path(cfg.init_from_hf), cfg.model) if cfg.init_from_hf and \
        not steps else None
    user_cfg, events = cfg, read_events(run_dir) if steps else []
    if beyond := next((e for e in events if e["event_step"] > cfg.steps), None):
        raise UserError(f"{run_dir}/events.jsonl records an event at step {beyond['event_step']}"
                        f" of a {cfg.steps}-step run; was the file edited? restore it")
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
            if hf_params is not None:
                say(f"parameters from the Hugging Face folder {cfg.init_from_hf} "
                    f"({len(jax.tree.leaves(hf_params))} tensors; Adam's moments at zero)")
        if later and jax.process_index() == 0:
            aside = guard.set_aside(run_dir, events, later, time.strftime("%Y%m%d-%H%M%S"))
            say(f"moved the guard's {len(later)} later action(s) aside to {aside}")
        if events:  # the guard's actions so far, re-applied
            cfg = effective(user_cfg, events)
            tx, data = make_tx(cfg), load_data(cfg)
            if guard.pending_insertion(events, int(state["step"])):
                state = insert_new_leaves(cfg, tx, state, mesh)
            say(f"guard: {len(acted(events))} recorded action(s) re-applied")
        say(identity(cfg))
        if jax.process_index() == 0:
            write_config(run_dir, dataclasses.asdict(user_cfg))
        mngr = mngr or checkpoint_manager(run_dir, cfg.keep_checkpoints)
        with StopRequested(run_dir) as stop:
            return run_loop(cfg, tx, state, data, mesh, mngr, run_dir, stop, user_cfg, events)


def guard_action(trigger, cfg, user_cfg, events: list, mngr, run_dir, mesh, log, held_out):
    """The guard's answer to `trigger` (guard.py), appended to `events` (the run's record, as
    every process holds it): None to go on as before, or (cfg, tx, state) to go on with from
    the rollback point. Exits on a "stop". `held_out(params)`: the held-out loss, which at a
    level shift is set against the kept checkpoint's before the event (a shift in the data)."""
    mngr.wait_until_finished()
    kept, e = guard.kept_before(cfg.guard, trigger, mngr.all_steps(), events), None
    if trigger.rule == "shift" and cfg.guard.data_fraction and kept:
        ref = restore_checkpoint(mngr, kept[-1], abstract_state(cfg.model, make_tx(cfg), mesh))
        e = guard.in_the_data(cfg.guard, trigger, held_out(ref["params"]), held_out(None),
                              kept[-1])
    e = e or guard.plan(cfg.guard, trigger, sorted(mngr.all_steps()), events)
    say(describe(e))
    log.tracker.log({"guard/event_step": e["event_step"], "guard/rollback_to":
                     e.get("rollback_to", -1), "guard/escalated": int("escalation" in e)},
                    trigger.step)
    for s in sorted(mngr.all_steps(), reverse=True):  # the bad path's checkpoints go first
        if e["action"] in ("rollback", "escalate") and s > e["rollback_to"]:
            mngr.delete(s)
    if jax.process_index() == 0:
        guard.record(run_dir, e)
    events.append(e)
    if e["action"] in ("go-on", "data"):
        return None
    if e["action"] == "stop":
        print(f"stopping: the guard's verdict at step {trigger.step}: {e['why']}. Last "
              f"checkpoint: step {mngr.latest_step()} in {run_dir}", file=sys.stderr)
        log.tracker.finish()
        sys.exit(1)
    r = e["rollback_to"]
    before = guard.effective_config(user_cfg, events, restored_at=r)
    state = restore_checkpoint(mngr, r, abstract_state(before.model, make_tx(before), mesh))
    tx = make_tx(new := guard.effective_config(user_cfg, events))
    if guard.pending_insertion(events, r):
        state = insert_new_leaves(new, tx, state, mesh)
    return new, tx, state


class GuardHook:
    """--guard in the loop: it judges each logged step (guard.py's Watch over the losses it has
    seen) and each checkpoint step (the prediction), and answers with what the loop goes on
    from after a rollback or an escalation, (cfg, tx, state), or None to go on as before."""

    def __init__(self, cfg, user_cfg, events: list, mngr, run_dir, mesh, log, start: int,
                 held_out):
        self.cfg, self.user_cfg, self.events = cfg, user_cfg, events
        self.act = functools.partial(guard_action, events=events, mngr=mngr, run_dir=run_dir,
                                     mesh=mesh, log=log)
        self.held_out = held_out  # params -> the held-out loss (None: the state's now)
        # the losses the guard saw, and the last step's metrics (a prediction a kill interrupted)
        self.seen, self.before = guard.history_before(run_dir, start, cfg.model.n_layers)
        self.watch = guard.Watch.replay(cfg.guard, self.seen, start, guard.watch_since(events))

    def resumed(self, start: int):
        """A prediction a kill kept from its record, made again (at a checkpoint step)."""
        t = guard.predicted(self.cfg.guard, self.events, start, self.before) \
            if start % self.cfg.checkpoint_every == 0 else None
        return t and self.act(t, self.cfg, self.user_cfg, held_out=None)

    def logged(self, last: dict):
        """The guard's answer to a logged step."""
        loss = last["loss"] if math.isfinite(last["grad_norm"]) else math.nan
        self.seen[last["step"]] = loss
        if not (trigger := self.watch.observe(last["step"], loss)):
            return None
        trigger = dataclasses.replace(trigger, max_logit=max(last["attn_logit_max"]))
        answer = self.act(trigger, self.cfg, self.user_cfg, held_out=self.held_out)
        if self.events[-1]["action"] == "data":
            self.watch.restart()  # the new level is the data's
        return answer

    def checkpointed(self, step: int, last: dict, final: bool):
        """At a checkpoint the watch starts again from what it has seen; then the prediction
        (not at the end, nor when stopping), escalated where the run stands."""
        self.watch = guard.Watch.replay(self.cfg.guard, self.seen, step,
                                        guard.watch_since(self.events))
        t = None if final else guard.predicted(self.cfg.guard, self.events, step, last)
        return t and self.act(t, self.cfg, self.user_cfg, held_out=self.held_out)

    def restarted(self, cfg, step: int):
        """The loop goes on from `step` with `cfg`: the watch from the losses before it."""
        self.cfg = cfg
        self.seen = {s: x for s, x in self.seen.items() if step - guard.SPAN <= s < step}
        self.watch = guard.Watch.replay(cfg.guard, self.seen, step, guard.watch_since(self.events))


def run_loop(cfg, tx, state, data, mesh, mngr, run_dir, stop, user_cfg=None, events=()) -> dict:
    """Train from the state's step to cfg.steps, phase by phase as nanoGPT's loop does, saving
    and exiting after the step where `stop` (a StopRequested) saw a signal. With
    --guard, its hook judges each logged step and may answer with a point to go on from (a
    rollback, an escalation): the loop goes on from there with what the guard changed."""
    batch_sharding = jax.NamedSharding(mesh, BATCH)
    rows = process_rows(batch_sharding, cfg.data.batch_size)
    eval_tokens = put_held_out(data, mesh, rows)
    step = start = int(state["step"])
    if start >= cfg.steps:  # a finished run, resumed: nothing to train
        say(f"{run_dir} is done (step {start} of {cfg.steps}): sample it with python sample.py "
            f"{run_dir}; {train_on(cfg, start)}"
            + (f"; nothing trains, so nothing goes to W&B (--wandb.project "
               f"{cfg.wandb.project})" if cfg.wandb.project else ""))
        return {}
    if cfg.steps < cfg.optim.warmup_steps:
        say(f"note: --steps {cfg.steps} ends inside the LR warmup ({cfg.optim.warmup_steps} "
            "steps): the run never reaches its peak LR")
    log = Log(cfg, run_dir, start)
    train_step, eval_step = make_train_step(cfg, tx), make_eval_step(cfg)
    hook = GuardHook(cfg, user_cfg or cfg, list(events), mngr, run_dir, mesh, log, start,
                     lambda p: float(eval_step(state["params"] if p is None else p, eval_tokens))
                     ) if cfg.guard.on else None
    goto, prev, last = hook and hook.resumed(start), None, {}
    while step < cfg.steps or goto:
        if goto:  # the guard rolled back or escalated: go on from its point, with its changes
            (new, tx, state), goto, prev = goto, None, None
            data.replaced = parse_ranges(new.data.replace_batches, "replace_batches")
            if (new.model, new.optim) != (cfg.model, cfg.optim):  # a new step function
                train_step, eval_step = make_train_step(new, tx), make_eval_step(new)
            cfg, step = new, int(state["step"])
            hook.restarted(cfg, step)
            log.nonfinite, log.since = 0, None
            continue
        # batch and step: dispatched, not waited for
        tokens = jax.make_array_from_process_local_data(batch_sharding, data.batch(step, rows))
        state, metrics = train_step(state, tokens)
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics["eval_loss"] = eval_step(state["params"], eval_tokens)
        # log: step s-1's metrics are read only now, after step s is dispatched (reading step
        # s's would make the host wait while the device idles); the guard judges the step
        if prev is not None:
            last, prev = log.record(*prev), None
            if hook and (goto := hook.logged(last)):
                continue
            if log.nonfinite >= cfg.max_consecutive_nonfinite:
                stop_nonfinite(log, last, mngr, run_dir)
        prev = (step, metrics)
        # checkpoint (the guard sees the step first), and stop when a signal asked to
        stopping = stop.requested(step)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or stopping:
            if hook:
                last, prev = log.record(*prev), None
                if goto := hook.logged(last):
                    continue
            save(mngr, run_dir, done, cfg, state)
            if hook and (goto := hook.checkpointed(done, last, done == cfg.steps or stopping)):
                continue  # escalated where it stands
        if stopping:
            break
        step += 1
    if prev is not None:
        last = log.record(*prev)
    if last and last["step"] > start:
        last["avg_tokens_per_s"] = log.average_tokens_per_s(last["step"])
    save(mngr, run_dir)
    if stop.signal:
        say(f"saved step {last['step'] + 1} to {run_dir}; resume with the same command")
        log.tracker.finish()
        sys.exit(128 + stop.signal)
    if log.file:
        log.file.close()
        final_report(run_dir, token_unit(cfg.data.source), log.tracker)
    return last


def save(mngr, run_dir, step=None, cfg=None, state=None) -> None:
    """Save a checkpoint (asynchronously), or with no step wait for the saves in flight; a
    failed write ends the run on every process (distributed.checkpoint_failed)."""
    try:
        if step is None:
            mngr.wait_until_finished()
        else:
            save_checkpoint(mngr, step, state, dataclasses.asdict(cfg))
    except Exception as e:
        checkpoint_failed(e, run_dir)


def stop_nonfinite(log, last: dict, mngr, run_dir) -> None:
    save(mngr, run_dir)
    print(f"stopping: {log.nonfinite} non-finite steps in a row (last at step {last['step']}); "
          f"parameters were left unchanged by them. Last checkpoint: step {mngr.latest_step()} "
          f"in {run_dir}", file=sys.stderr)
    log.tracker.finish()
    sys.exit(1)


@command
def main(argv: list[str]) -> int:
    cfg = parse_config(argv, __doc__)
    start_distributed(cfg.dist)
    t0 = time.perf_counter()
    try:
        last = train(cfg)
    except Exception as e:  # a collective cut off by a process that stopped
        if isinstance(e, jax.errors.JaxRuntimeError) and (peer := peer_stopped()):
            give_up(f"error: {peer}; process {jax.process_index()} stops too", code=1)
        # ...or died (gloo's error comes as a JaxRuntimeError, or through orbax's sync as a
        # ValueError): ended here at once, before JAX's exit barrier
        if lost := peer_lost(e):
            give_up(f"error: process {jax.process_index()}: another process of the run is gone "
                    f"({lost}); this one stops too. The same command on every process resumes "
                    "from the last checkpoint", code=1)  # waits for it, then aborts in C++
        raise
    if last:
        say(done_line(cfg, last, time.perf_counter() - t0))
    return 0


def done_line(cfg: TrainConfig, last: dict, seconds: float) -> str:
    """The end line of a run (train.py's, warmstart.py's): where it got, what next."""
    return (f"done: step {last['step'] + 1}, held-out loss {last['eval_loss']:.4f} "
            f"nats/{token_unit(cfg.data.source)}, {last.get('avg_tokens_per_s', 0):.0f} "
            f"tokens/s on average, {fmt_time(seconds)} in all; checkpoint step "
            f"{last['step'] + 1} in {cfg.run_dir}. Sample: python sample.py {cfg.run_dir}; the "
            f"loss curve: python report.py {cfg.run_dir} --plot {cfg.run_dir}/figures; "
            f"{train_on(cfg, last['step'] + 1)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
