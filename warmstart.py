"""Insert QK-Norm into a run's checkpoint, keep the optimizer state, re-warm the LR, train on.

    python warmstart.py --from runs/story --to runs/rescued
    python warmstart.py --from runs/story --to runs/gated --insert attn-gate
    python warmstart.py --from runs/story --to runs/rescued --step before-shift --rewarmup-steps 100
    python warmstart.py --from runs/default --to runs/more --insert none --steps 800

(the last: a decayed run trained on, the re-warmup alone, over --rewarmup-steps: 1,000 by
default, fewer for a short run). Any train.py flag may follow (--steps 5000,
--optim.max-grad-norm 0.2); --no-train converts and stops.

What Marin did for its 32B at step 80,000: the same model plus QK-Norm, the whole train state
restored from the old checkpoint (step, Adam moments and count, skip/clip histories), the new norm
scales at 1 with zero moments, the LR re-warmed from 0.1 x peak to peak over 1,000 steps.

The target config is the source's `config.json` with `model.qk_norm` on, a re-warmup starting at
the checkpoint's step, and any train.py flag given after these (`--steps`, `--optim.*`,
`--mesh.*`, `--data.replace-batches A:B`, ...). NEW_RUN gets that config and a checkpoint at the
same step holding the converted state; training then continues there exactly as a plain resume
would; after a kill, the same warmstart.py command resumes it. The source run directory is
only read.

The new scales start with zero moments under the carried Adam count t, so Adam's bias
correction (1 - beta^t, ~1 late in a run) does not lift them: their first update is
(1 - b1) / sqrt(1 - b2) x lr per element, 0.45 lr at beta2 0.95 and 3.2 lr at 0.999, where a
fresh Adam takes 1 lr (a test measures it on the applied step). After k steps the ratio is
(1 - b1^k) / sqrt(1 - b2^k): at beta2 0.95, about 1 from the 10th step on, so the scales
under-step briefly, inside the re-warmup that starts at 0.1 lr anyway; the story's rescue
(beta2 0.95) is run so, and no correction is applied. At beta2 0.999 they would over-step for
hundreds of steps (3.2 lr, then ~1/sqrt(1 - 0.999^k)); not measured on a rescue here.
"""

import dataclasses
import pathlib
import shutil
import sys
import time
from typing import Annotated, Literal

import jax
import tyro

import checkpoint
import train
from checkpoint import carry, init_new_leaves, onto_radius
from cli import UserError, command, entry_point, parse
from config import (
    TrainConfig,
    check_same_run,
    load_checkpointed,
    load_config,
    make_tx,
    parse_flags,
)
from distributed import setup_mesh
from loop import put_held_out
from optim import lr_schedule
from records import read_metrics
from report import find_shifts


@dataclasses.dataclass(frozen=True)
class WarmStartArgs:
    source: Annotated[str, tyro.conf.arg(name="from")]  # run directory to convert (read only)
    to: str  # new run directory (must not exist, or be empty; or hold this warm start: resumed)
    # the checkpoint to convert: a step, "before-shift" (the last checkpoint at least --margin
    # steps before the first level shift report.py finds in the run), or the latest
    step: int | Literal["before-shift"] | None = None
    margin: int = 100  # --step before-shift: this many steps before the shift, at least
    rewarmup_steps: int = 1000  # Marin: 1,000
    rewarmup_from_ratio: float = 0.1  # Marin: from 0.1 x peak
    # what to insert: QK-Norm (Marin's rescue), the attention gate (Marin's form: exactly 1 at
    # insertion, so the model's output is unchanged), both, or none: the same model with the LR
    # re-warmed, Marin's way of training on a run whose LR has decayed (--steps beyond it)
    insert: Literal["qk-norm", "attn-gate", "qk-norm+attn-gate", "none"] = "qk-norm"
    no_train: tyro.conf.FlagCreatePairsOff[bool] = False  # convert and stop
    verbose: tyro.conf.FlagCreatePairsOff[bool] = False  # list every carried leaf too


def parse_args(argv: list[str]) -> tuple[WarmStartArgs, list[str]]:
    try:
        return parse(WarmStartArgs, argv, return_unknown_args=True, description=__doc__)
    except UserError as e:
        raise UserError(f"{e} (usage: warmstart.py --from RUN --to NEW_RUN [--step S] "
                        "[--rewarmup-steps K] [--rewarmup-from-ratio R] [--no-train] [--verbose] "
                        "[train.py flags])") from None


def target_config(source: TrainConfig, args: WarmStartArgs, step: int,
                  overrides: list[str]) -> TrainConfig:
    """Source config + what --insert adds + re-warmup at `step`, then the user's train.py
    flags."""
    try:
        optim = dataclasses.replace(source.optim, rewarmup_start=step,
                                    rewarmup_steps=args.rewarmup_steps,
                                    rewarmup_from_ratio=args.rewarmup_from_ratio)
    except ValueError as e:  # the re-warmup flags, range-checked by OptimConfig
        raise UserError(str(e)) from None
    model = dataclasses.replace(source.model, qk_norm=source.model.qk_norm or "qk-norm" in
                                args.insert)
    if "attn-gate" in args.insert:
        model = dataclasses.replace(model, attn_gate="headwise", attn_gate_form="marin")
    default = dataclasses.replace(source, model=model,
                                  optim=optim, run_dir=args.to, resume_step=None,
                                  warm_started_from=f"{args.source}@{step}")
    return parse_flags(default, overrides, train.__doc__)


def load_source(run: pathlib.Path, step: int | None, insert: str = "qk-norm"
                ) -> tuple[TrainConfig, int]:
    """(config, step) of a source run directory's checkpoint (default: the latest)."""
    stored = load_config(run)
    if stored is not None and "attn-gate" in insert and stored.model.attn_gate != "none":
        raise UserError(f"--from {run} already has an attention gate: nothing to insert; "
                        "resume it with train.py instead")
    if "qk-norm" not in insert:
        cfg, step = load_checkpointed(run, step, flag="--from ")  # with what the guard did
        if "attn-gate" in insert and cfg.model.attn_gate != "none":
            raise UserError(f"--from {run} has an attention gate at step {step} (its guard "
                            "inserted it; events.jsonl): nothing to insert; resume it with "
                            "train.py instead")
        return cfg, step
    if stored is not None and stored.model.qk_norm:  # said first: no checkpoint would help
        raise UserError(f"--from {run} already has QK-Norm (model.qk_norm is true): nothing to "
                        "insert; resume it with train.py instead")
    cfg, step = load_checkpointed(run, step, flag="--from ")  # with what the guard did
    if cfg.model.qk_norm:
        raise UserError(f"--from {run} has QK-Norm at step {step} (its guard inserted it; "
                        "events.jsonl): nothing to insert; resume it with train.py instead")
    if cfg.optim.qk_clip > 0:
        raise UserError(f"--from {run} runs QK-Clip at step {step}, whose rescale QK-Norm "
                        "normalises away: warmstart.py does not insert QK-Norm beside it")
    if "attn-gate" in insert and cfg.model.attn_gate != "none":
        raise UserError(f"--from {run} has an attention gate at step {step} (its guard "
                        "inserted it; events.jsonl): insert qk-norm alone")
    return cfg, step


def convert_checkpoint(src_run: pathlib.Path, step: int, src_cfg: TrainConfig,
                       cfg: TrainConfig, mesh, dst_run: pathlib.Path, corpus: dict | None):
    """The surgery: restore the source state onto `mesh`, carry it into cfg's state, save it to
    dst_run at the same step. Returns (source state, converted state, carried, new, dropped).
    Everything is written to DST.converting/ first and renamed to dst_run only once the
    checkpoint is complete: a conversion killed half-way leaves no run that could start over
    from random parameters under the warm-started config."""
    src_tx, tx = make_tx(src_cfg), make_tx(cfg)
    src_mngr = checkpoint.checkpoint_manager(src_run, read_only=True)
    try:  # restored straight onto the target mesh, whatever mesh wrote it
        source = checkpoint.restore_checkpoint(
            src_mngr, step, checkpoint.abstract_state(src_cfg.model, src_tx, mesh))
    except Exception as e:
        raise checkpoint.unreadable(src_run, step, e, "pick another with --step") from None
    target = checkpoint.abstract_state(cfg.model, tx, mesh)
    state, carried, new, dropped = carry(source, target,
                                         init_new_leaves(cfg, tx, target, source["params"]))
    state = onto_radius(cfg, state, new)
    partial = converting(dst_run)
    if partial.exists():  # what a killed conversion left (check_target made sure it is ours)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / MARK).write_text(f"{src_run}@{step}\n")
    checkpoint.write_config(partial, dataclasses.asdict(cfg), corpus)
    mngr = checkpoint.checkpoint_manager(partial, cfg.keep_checkpoints)
    checkpoint.save_checkpoint(mngr, step, state, dataclasses.asdict(cfg))
    mngr.wait_until_finished()
    if dst_run.exists():
        dst_run.rmdir()  # empty (checked before)
    (partial / MARK).unlink()
    partial.rename(dst_run)
    return source, state, carried, new, dropped


# The file a conversion writes first into NEW_RUN.converting/: a folder without it is not one
# that warmstart.py wrote, and is never removed.
MARK = "warmstart-converting"


def before_shift(run: pathlib.Path, margin: int) -> int:
    """The last checkpoint of `run` at least `margin` steps before the first level shift that
    report.py's rule finds in its metrics, said in one line; a run without a shift, or without
    a checkpoint that early, is a UserError naming what it has."""
    if margin < 0:
        raise UserError(f"--margin must be >= 0, got {margin}")
    if not (shifts := find_shifts(read_metrics(run))):
        raise UserError(f"--from {run}: report.py's level-shift rule finds no shift in its "
                        "metrics: give --step S")
    first, saved = shifts[0].step, checkpoint.saved_steps(run)
    if not (early := [s for s in saved if s <= first - margin]):
        raise UserError(f"--from {run}: its first level shift is at step {first}, and no "
                        f"checkpoint lies {margin} steps before it (the earliest: "
                        f"{saved[0] if saved else 'none'}): give a smaller --margin or --step S")
    print(f"{run}: the first level shift is at step {first}; warm-starting from the "
          f"checkpoint at step {early[-1]}, {first - early[-1]} steps before it")
    return early[-1]


def converting(dst_run: pathlib.Path) -> pathlib.Path:
    return dst_run.with_name(dst_run.name + ".converting")


def check_target(args: WarmStartArgs, cfg: TrainConfig, step: int) -> bool:
    """Refuse what cannot work before anything is written; True if --to already holds this
    very warm start (the same command run again, after a kill): then it is resumed."""
    src_run, dst_run = pathlib.Path(args.source).resolve(), pathlib.Path(args.to).resolve()
    partial = converting(dst_run)
    if partial.exists() and not (partial / MARK).is_file():
        raise UserError(f"{partial} exists and was not written by warmstart.py: move it away, "
                        "or choose another --to")
    if blocked := next((d for d in dst_run.parents if d.exists() and not d.is_dir()), None):
        raise UserError(f"--to {args.to} lies under {blocked}, which is a file: choose a "
                        "directory")
    if dst_run == src_run or src_run in dst_run.parents:
        raise UserError(f"--to {args.to} lies inside --from {args.source}: choose a directory "
                        "outside the source run")
    if dst_run.exists() and (not dst_run.is_dir() or any(dst_run.iterdir())):
        stored = load_config(dst_run) if dst_run.is_dir() else None
        if stored is None or not checkpoint.saved_steps(dst_run):
            raise UserError(f"--to {args.to} exists and is not empty: choose a new directory")
        check_same_run(stored, cfg)  # the same command: resume; else say what differs
        return True
    if "qk-norm" in args.insert and not cfg.model.qk_norm:
        raise UserError("warmstart.py inserts QK-Norm: do not pass --model.no-qk-norm")
    if "attn-gate" in args.insert and cfg.model.attn_gate == "none":
        raise UserError("warmstart.py inserts the attention gate: do not pass "
                        "--model.attn-gate none")
    if cfg.steps <= step:
        raise UserError(f"--steps {cfg.steps} does not go beyond the checkpoint's step {step}: "
                        f"give --steps greater than {step}")
    return False


def convert(args: WarmStartArgs, overrides: list[str], devices=None) -> TrainConfig:
    """Write NEW_RUN with the converted checkpoint; print what happened. Returns its config.
    If NEW_RUN already holds this warm start, writes nothing (train.train resumes it)."""
    src_run, dst_run = pathlib.Path(args.source), pathlib.Path(args.to)
    wanted = before_shift(src_run, args.margin) if args.step == "before-shift" else args.step
    src_cfg, step = load_source(src_run, wanted, args.insert)
    cfg = target_config(src_cfg, args, step, overrides)
    if check_target(args, cfg, step):
        print(f"{dst_run} already holds this warm start (from {src_run} at step {step}): "
              "resuming it")
        return cfg
    mesh = setup_mesh(cfg, devices or jax.devices())
    data = train.load_data(cfg)
    if cfg.data.source == src_cfg.data.source:  # the same name must be the same text
        checkpoint.check_corpus(src_run, data.corpus(), what="this warm start")
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        source, state, carried, new, dropped = convert_checkpoint(src_run, step, src_cfg, cfg,
                                                                  mesh, dst_run, data.corpus())
        seconds = time.perf_counter() - t0
        tokens = put_held_out(data, mesh)
        loss_before = float(train.make_eval_step(src_cfg)(source["params"], tokens))
        loss_after = float(train.make_eval_step(cfg)(state["params"], tokens))

    shown = ((carried, "carried"),) * args.verbose + ((new, "NEW"), (dropped, "dropped"))
    if any(rows for rows, _ in shown):
        print(f"{'leaf':<64} {'shape':<20} status")
    for rows, status in shown:
        for key, shape in rows:
            print(f"{key:<64} {str(list(shape)):<20} {status}")
    lr_before = float(lr_schedule(src_cfg.optim, src_cfg.steps)(step))
    lr_after = float(lr_schedule(cfg.optim, cfg.steps)(step))
    print(f"\n{len(carried)} leaves carried, {len(new)} new, {len(dropped)} dropped; step {step}")
    print(f"LR at step {step}: {lr_before:.3e} before, {lr_after:.3e} after (re-warmed linearly "
          f"to the schedule over {cfg.optim.rewarmup_steps} steps)")
    added = [k.rsplit("['", 1)[-1].rstrip("']") for k, _ in new if k.startswith("['params']")]
    what = f"{', '.join(added)} added" if added else "no parameter added"
    print(f"held-out loss: {loss_before:.4f} before, {loss_after:.4f} with {what} "
          f"({loss_after - loss_before:+.4f})")
    print(f"wrote {dst_run} (restore, carry, save: {seconds:.2f}s)")
    if step + cfg.optim.rewarmup_steps > cfg.steps:
        print(f"warning: the re-warmup ({cfg.optim.rewarmup_steps} steps from step {step}) "
              f"ends after the last step ({cfg.steps}): the LR never gets back to the schedule",
              file=sys.stderr)
    return cfg


@command
def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    t0 = time.perf_counter()
    cfg = convert(args, overrides)
    if args.no_train:
        return 0
    outcome = train.train(cfg)
    if outcome.why == "done" and outcome.last:  # (a finished one run again trains nothing)
        print(train.done_line(cfg, outcome.last, time.perf_counter() - t0))
    return outcome.exit_code


if __name__ == "__main__":
    entry_point(main)
