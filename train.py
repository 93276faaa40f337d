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
import pathlib
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import P

import guarded
from attention import resolve
from checkpoint import (
    abstract_state,
    check_corpus,
    check_run_dir,
    checkpoint_manager,
    fresh_state,
    per_device_bytes,
    resume,
    run_lock,
    saved_steps,
    write_config,
)
from cli import UserError, command, entry_point, fmt_time
from config import (
    TrainConfig,
    config_at,
    identity,
    load_config,
    make_tx,
    parse_config,
    resumed,
    train_on,
)
from data import TokenData, token_unit
from distributed import (
    StopRequested,
    activation_bytes,
    check_fits,
    give_up,
    peak_tflops,
    peer_lost,
    peer_stopped,
    say,
    setup_mesh,
    start_distributed,
)
from hf import load_hf
from loop import BATCH, Run, ended, run_loop, save, too_many_nonfinite
from model import count_params, flops_per_token, loss_fn
from optim import lr_schedule, opt_metrics
from report import final_report
from tracking import Log, per_layer_metrics


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

    def loss_and_grads(params, tokens_BT1, loss_options):
        """(loss, aux), gradients of the whole batch; with --microbatches k the gradient is
        summed over k slices of it in a lax.scan (gradient accumulation; slice j holds rows j,
        j + k, ..., so every slice splits over "data" as the batch does): the mean loss and
        gradient are the whole batch's, a max statistic the max over the slices."""
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        k = cfg.microbatches
        if k == 1:
            return grad_fn(params, tokens_BT1, cfg.model, **loss_options)
        B, T1 = tokens_BT1.shape
        slices_KBT1 = jnp.swapaxes(tokens_BT1.reshape(B // k, k, T1, out_sharding=P(
            BATCH[0], None, None)), 0, 1)  # (the step runs inside a mesh: train.py, the harness)

        def add(grads, tokens):
            (loss, aux), g = grad_fn(params, tokens, cfg.model, **loss_options)
            return jax.tree.map(jnp.add, grads, g), (loss, aux)
        grads, (loss_K, aux_K) = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, params),
                                              slices_KBT1)
        aux = {key: jnp.max(v, axis=0) if key in MAX_STATS else jnp.mean(v, axis=0)
               for key, v in aux_K.items()}
        return (jnp.mean(loss_K), aux), jax.tree.map(lambda g: g / k, grads)

    def train_step(state, tokens_BT1):
        params = state["params"]
        loss_options = {"head_stats": True} if clip else {}
        (loss, aux), grads = loss_and_grads(params, tokens_BT1, loss_options)
        heads = {"attn_logit_max_per_head": aux.pop("attn_logit_max_per_head")} if clip else {}
        updates, opt_state = tx.update(grads, state["opt_state"], params, loss=loss,
                                       step=state["step"], **heads)
        if clip:  # heads over the threshold on this batch (clipped, unless nothing applied)
            aux["qk_clip_heads"] = jnp.sum(heads["attn_logit_max_per_head"] > cfg.optim.qk_clip)
        metrics = {"loss": loss, "lr": schedule(state["step"]), **aux,
                   **opt_metrics(opt_state, cfg.optim.clip_norm)}
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
    rows = cfg.data.batch_size // cfg.mesh.data  # a device's rows of the batch

    def need(k: int) -> float:  # GiB a device: the state and a microbatch's activations
        act = activation_bytes(cfg.model, rows // k * cfg.data.seq_len, cfg.mesh.model)
        return (per_device + act) / 2**30
    k, act = cfg.microbatches, need(cfg.microbatches) - per_device / 2**30
    print(f"activations         {act:.3f} GiB per device ({rows // k * cfg.data.seq_len:,} "
          f"tokens a device {'a microbatch ' if k > 1 else ''}kept for the backward: a lower "
          f"bound, the backward's temporaries on top); with the state {need(k):.3f} GiB")
    gib = cfg.device_gib or (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0) / 2**30
    fits = [k for k in range(1, rows + 1) if rows % k == 0 and need(k) <= gib]

    def fewest(size: float) -> str:  # the fewest microbatches that fit `size` GiB
        k = next((k for k in range(1, rows + 1) if rows % k == 0 and need(k) <= size), None)
        return f"--microbatches {k}" if k else "more devices"
    print("verdict             " + (
        f"at least {need(1):.1f} GiB a device at --microbatches 1, by this lower bound; on 80 "
        f"GiB (H100): {fewest(80)}; on 141 GiB (H200): {fewest(141)} (--device-gib G for "
        "another)" if not gib else
        f"fits in {gib:g} GiB a device, by this lower bound" if cfg.microbatches in fits else
        f"does not fit in {gib:g} GiB a device; --microbatches {fits[0]} would "
        f"({need(fits[0]):.2f} GiB, by this lower bound)" if fits else
        f"does not fit in {gib:g} GiB a device, even one sequence at a time "
        f"({need(rows):.2f} GiB): more devices (--mesh.data, --mesh.model)"))


class Outcome(NamedTuple):
    """How a run ended: "done", "non-finite" (max_consecutive_nonfinite such steps in a row),
    "stopped" (the guard's verdict) or "signal" (saved after the step where it came), and the
    last step's record. main() turns it into the exit status."""
    why: str
    last: dict
    signal: int = 0

    @property
    def exit_code(self) -> int:
        return {"done": 0, "signal": 128 + self.signal}.get(self.why, 1)


def train(cfg: TrainConfig, devices=None) -> Outcome:
    """Train (or resume) in cfg.run_dir on `devices` (default: all). Raises UserError before
    writing anything if the config, data or run dir is bad."""
    if cfg.dry_run:
        dry_run(cfg)
        return Outcome("done", {})
    mesh = setup_mesh(cfg, devices or jax.devices())
    run_dir = pathlib.Path(cfg.run_dir)
    start = read_start(cfg, run_dir)
    lock = run_lock(run_dir, say) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock, jax.set_mesh(mesh):
        cfg, tx, data, state, mngr = set_up(start, run_dir, mesh)
        if (first := int(state["step"])) >= cfg.steps:  # a finished run, resumed
            say(f"{run_dir} is done (step {first} of {cfg.steps}): sample it with python "
                f"sample.py {run_dir}; {train_on(cfg, first)}"
                + (f"; nothing trains, so nothing goes to W&B (--wandb.project "
                   f"{cfg.wandb.project})" if cfg.wandb.project else ""))
            return Outcome("done", {})
        with StopRequested(run_dir) as stop:
            run = Run(run_dir, mesh, mngr, data, open_log(cfg, run_dir, first), stop,
                      lambda cfg, tx: (make_train_step(cfg, tx), make_eval_step(cfg)))
            # the loop's consumer: the guard (guarded.py), or the plain one
            why, last = guarded.drive(run, cfg, tx, state, start.user_cfg, start.events) \
                if cfg.guard.on else train_plainly(run, cfg, tx, state)
            return finish(run, why, last, first)


def train_plainly(run: Run, cfg: TrainConfig, tx, state) -> tuple[str, dict]:
    """The loop without the guard: to its end, or until too many non-finite steps in a row.
    Returns (why it stopped, the last step's record)."""
    last = {}
    for info in run_loop(run, cfg, tx, state):
        last = info.record
        if too_many_nonfinite(run, cfg):
            return "non-finite", last
    return ended(run), last


class Start(NamedTuple):
    """What a run starts from, read and checked before anything is written."""
    user_cfg: TrainConfig  # the config asked for (a resume: the stored one, as changed)
    cfg: TrainConfig  # the config at the checkpoint resumed (the guard's actions applied)
    events: list  # the guard's recorded actions up to that checkpoint...
    beyond: list  # ...and after it (a --resume-step went back past them)
    data: TokenData
    corpus: dict
    hf_params: dict | None


def read_start(cfg: TrainConfig, run_dir: pathlib.Path) -> Start:
    check_run_dir(run_dir, cfg.resume_step)
    stored, checkpoints = load_config(run_dir), saved_steps(run_dir)
    resume_at = cfg.resume_step if cfg.resume_step is not None else (checkpoints or [0])[-1]
    user_cfg = resumed(stored, cfg, resume_at) if stored is not None else cfg
    hf_params = load_hf(pathlib.Path(cfg.init_from_hf), cfg.model) if cfg.init_from_hf and \
        not checkpoints else None
    events, beyond = guarded.recorded(user_cfg, run_dir, resume_at, bool(checkpoints))
    cfg = config_at(user_cfg, events, resume_at)  # the checkpoint's shape
    data = load_data(cfg)
    if (corpus := data.corpus()) and checkpoints:  # a resume reads the text the run trained on
        check_corpus(run_dir, corpus)
    return Start(user_cfg, cfg, events, beyond, data, corpus, hf_params)


def set_up(start: Start, run_dir: pathlib.Path, mesh) -> tuple:
    """(cfg, tx, data, state, checkpoint manager): the checkpoint resumed (the guard's actions
    re-applied) or a fresh state; config.json written."""
    cfg, data, tx = start.cfg, start.data, make_tx(start.cfg)
    target = abstract_state(cfg.model, tx, mesh)
    mngr, state = resume(run_dir, target, cfg.keep_checkpoints, cfg.resume_step, say)
    if state is None:
        state = fresh(cfg, tx, target, start.hf_params, run_dir, data)
    if start.events or start.beyond:
        cfg, tx, data, state = guarded.reapply(cfg, tx, data, state, start.user_cfg,
                                               start.events, start.beyond, run_dir, mesh)
    say(identity(cfg))
    if jax.process_index() == 0:
        write_config(run_dir, dataclasses.asdict(start.user_cfg), start.corpus)
    return cfg, tx, data, state, mngr or checkpoint_manager(run_dir, cfg.keep_checkpoints)


def fresh(cfg: TrainConfig, tx, target, hf_params, run_dir, data) -> dict:
    """A new run's state: initialised, or the parameters of a Hugging Face folder (Adam's
    moments start at zero either way)."""
    state = fresh_state(cfg.model, cfg.seed, tx, target)
    if hf_params is not None:
        state["params"] = jax.tree.map(lambda x, t: jax.make_array_from_callback(
            x.shape, t.sharding, lambda i: x[i]), hf_params, target["params"])
    n = count_params(cfg.model)
    say(f"new run {run_dir}: {n / 1e6:.2f}M params, {cfg.steps} steps, mesh "
        f"{cfg.mesh.data}x{cfg.mesh.model} on {jax.process_count()} process(es), "
        f"{data.train.size:,} training tokens")
    if hf_params is not None:
        say(f"parameters from the Hugging Face folder {cfg.init_from_hf} "
            f"({len(jax.tree.leaves(hf_params))} tensors; Adam's moments at zero)")
    return state


def open_log(cfg: TrainConfig, run_dir: pathlib.Path, first: int) -> Log:
    """The metrics log, its MFU measured against a device's peak (said once)."""
    if cfg.steps < cfg.optim.warmup_steps:
        say(f"note: --steps {cfg.steps} ends inside the LR warmup ({cfg.optim.warmup_steps} "
            "steps): the run never reaches its peak LR")
    peak, source = peak_tflops(cfg.peak_tflops)  # a device's
    say(f"MFU against {peak:g} TFLOP/s a device ({source})" if peak else
        f"MFU: no peak known for {jax.devices()[0].device_kind} (--peak-tflops P shows it; "
        "bench/README.md has this CPU's matmul rate)")
    return Log(cfg, run_dir, first, flops_per_token(cfg.model, cfg.data.seq_len),
               peak * 1e12 * cfg.mesh.data * cfg.mesh.model)


def finish(run: Run, why: str, last: dict, first: int) -> Outcome:
    """After the loop: the saves waited for; a finished run reports, a stopped one says why."""
    if last and last["step"] > first:
        last["avg_tokens_per_s"] = run.log.average_tokens_per_s(last["step"])
    save(run)
    if why == "non-finite":
        print(f"stopping: {run.log.nonfinite} non-finite steps in a row (last at step "
              f"{last['step']}); parameters were left unchanged by them. Last checkpoint: step "
              f"{run.mngr.latest_step()} in {run.run_dir}", file=sys.stderr)
    elif why == "signal":
        say(f"saved step {last['step'] + 1} to {run.run_dir}; resume with the same command")
    if why != "done":
        run.log.tracker.finish()
    elif run.log.file:
        run.log.file.close()
        final_report(run.run_dir, token_unit(run.data.cfg.source), run.log.tracker)
    return Outcome(why, last, run.stop.signal or 0)


@command
def main(argv: list[str]) -> int:
    cfg = parse_config(argv, __doc__)
    start_distributed(cfg.dist)
    t0 = time.perf_counter()
    try:
        outcome = train(cfg)
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
    if outcome.why == "done" and outcome.last:
        say(done_line(cfg, outcome.last, time.perf_counter() - t0))
    return outcome.exit_code


def done_line(cfg: TrainConfig, last: dict, seconds: float) -> str:
    """The end line of a run (train.py's, warmstart.py's): where it got, what next."""
    return (f"done: step {last['step'] + 1}, held-out loss {last['eval_loss']:.4f} "
            f"nats/{token_unit(cfg.data.source)}, {last.get('avg_tokens_per_s', 0):.0f} "
            f"tokens/s on average, {fmt_time(seconds)} in all; checkpoint step "
            f"{last['step'] + 1} in {cfg.run_dir}. Sample: python sample.py {cfg.run_dir}; the "
            f"loss curve: python report.py {cfg.run_dir} --plot {cfg.run_dir}/figures; "
            f"{train_on(cfg, last['step'] + 1)}")


if __name__ == "__main__":
    entry_point(main)
