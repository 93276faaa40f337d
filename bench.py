"""Benchmarks that print figures, measured side by side in one run (never a timed test).

    python bench.py                 # CPU default preset; writes bench/results.json

1. Train-step time of the whole spike machinery (skip-step + rolling update-norm clip + the
   per-step optimizer metrics) against plain AdamW + global-norm clip, interleaved; and a check
   that the step makes no device-to-host transfer and compiles once.
2. warmstart.py's conversion of a checkpoint (restore, carry, save) against a plain restore +
   save of the same one; and the whole warmstart.py command (adds the held-out loss report).
"""

import dataclasses
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

import jax
import numpy as np
import optax

import model as M
import optim as O
import train as T
import warmstart as W


def plain_adamw(cfg: O.OptimConfig, total_steps: int, mask):
    return optax.with_extra_args_support(optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(O.lr_schedule(cfg, total_steps))))


COMPILES = []  # XLA compilations seen while timing (there should be none after the first step)


def count_compile(event: str, duration_secs: float, **kwargs):
    if "backend_compile" in event:
        COMPILES.append(event)


def step_timer(cfg, tx, mesh, tokens):
    """A function that times n steps (seconds per step), after one compiling step."""
    target = T.abstract_state(cfg, tx, mesh)
    state = T.fresh_state(cfg, tx, target)
    step = T.make_train_step(cfg, tx)
    state, m = step(state, tokens)
    jax.block_until_ready(m)
    box = {"state": state}

    def run(n):
        s = box["state"]
        seen = len(COMPILES)
        t = time.perf_counter()
        with jax.transfer_guard("disallow"):  # raises on any implicit host<->device transfer
            for _ in range(n):
                s, m = step(s, tokens)
            jax.block_until_ready(m)
        box["state"] = s
        elapsed = time.perf_counter() - t
        assert len(COMPILES) == seen, "the train step recompiled after its first call"
        return elapsed / n
    return run


def bench_machinery(cfg, repeats=5, n=5):
    mesh = T.make_mesh(cfg.mesh)
    full_cfg = dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, skip_step=True, update_clip="norm"))
    mask = M.decay_mask(cfg.model)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(np.random.default_rng(0).integers(
            0, 256, (cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32),
            jax.NamedSharding(mesh, jax.P("data")))
        plain = step_timer(cfg, plain_adamw(cfg.optim, cfg.steps, mask), mesh, tokens)
        full = step_timer(full_cfg, O.make_optimizer(full_cfg.optim, cfg.steps, mask),
                                     mesh, tokens)
        times = {"plain": [], "full": []}
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits both
            times["plain"].append(plain(n))
            times["full"].append(full(n))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    return {"plain_step_s": med["plain"], "full_step_s": med["full"],
            "machinery_overhead": med["full"] / med["plain"] - 1,
            "tokens_per_s_full": tokens_per_step / med["full"],
            "compiles_after_first_step": 0,  # step_timer asserts it
            "device_to_host_transfers_in_step": 0}  # transfer_guard would have raised


def bench_warmstart(cfg, repeats=3):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        src = dataclasses.replace(cfg, run_dir=str(tmp / "src"))
        mesh = T.make_mesh(src.mesh)
        tx = O.make_optimizer(src.optim, src.steps, M.decay_mask(src.model))
        target = T.abstract_state(src, tx, mesh)
        with jax.set_mesh(mesh):
            state = T.fresh_state(src, tx, target)
            T.make_writable(tmp / "src", src)
            mngr = T.checkpoint_manager(tmp / "src", src)
            T.save_checkpoint(mngr, 100, state, src)
            mngr.wait_until_finished()
        qk = W.target_config(src, W.WarmStartArgs(source="", to=""), 100, [])
        plain, convert, command = [], [], []
        for i in range(repeats):  # interleaved
            with jax.set_mesh(mesh):
                t = time.perf_counter()  # a plain restore builds its target too
                restored = T.restore_checkpoint(mngr, 100, T.abstract_state(src, tx, mesh))
                out = T.checkpoint_manager(tmp / f"plain{i}", src)
                T.save_checkpoint(out, 100, restored, src)
                out.wait_until_finished()
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                W.convert_checkpoint(mngr, 100, src, qk, mesh, tmp / f"surgery{i}")
                convert.append(time.perf_counter() - t)
            t = time.perf_counter()  # the whole command: + data, held-out losses, report
            W.convert(W.WarmStartArgs(source=str(tmp / "src"), to=str(tmp / f"new{i}"),
                                      no_train=True), [])
            command.append(time.perf_counter() - t)
    p, c = statistics.median(plain), statistics.median(convert)
    return {"restore_save_s": p, "convert_s": c, "convert_over_restore_save": c / p,
            "warmstart_command_s": statistics.median(command)}


def main():
    jax.monitoring.register_event_duration_secs_listener(count_compile)
    cfg = T.PRESETS["cpu"]
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "jax": jax.__version__, "devices": str(jax.devices())},
               "preset": "cpu"}
    results["machinery"] = bench_machinery(cfg)
    m = results["machinery"]
    print(f"\nspike machinery vs plain AdamW+clip: {m['full_step_s'] * 1e3:.0f} ms vs "
          f"{m['plain_step_s'] * 1e3:.0f} ms per step ({m['machinery_overhead']:+.1%}); "
          "no recompilation and no host transfer in the step")
    results["warmstart"] = bench_warmstart(cfg)
    w = results["warmstart"]
    print(f"\nwarm-start conversion vs restore+save: {w['convert_s']:.2f} s vs "
          f"{w['restore_save_s']:.2f} s ({w['convert_over_restore_save']:.2f}x); the whole "
          f"command with its held-out loss report: {w['warmstart_command_s']:.2f} s")
    out = pathlib.Path("bench/results.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
