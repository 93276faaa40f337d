"""Benchmarks that print figures, measured side by side in one run (never a timed test).

    python bench.py                 # CPU default preset; writes bench/results.json

1. This machine's limit: a 2048^3 float32 matmul through JAX, and the model's own projection
   shapes (tokens x d_model -> heads, ffw, vocab ...); the best of those is the target rate.
2. The CPU default's train step: tokens/s, achieved FLOP/s (6N per token + causal attention, as
   model.flops_per_token counts) and MFU against both rates; no device-to-host transfer in the
   step (jax.transfer_guard) and no compile after the first step (jax.monitoring).
3. Overheads, each measured side by side (interleaved repeats, medians): QK-Norm on vs off; the
   whole spike machinery (skip-step + update-norm clip) vs plain AdamW + clip; per-layer
   instrumentation on vs off; an orbax checkpoint every 100 steps vs never.
4. The layer loop: lax.scan vs unrolled (the cpu preset unrolls its 4 layers), step time side
   by side, and compile time of the train step at 4 and 24 layers for both: a scan's compile
   time does not grow with depth, an unrolled loop's does.
5. warmstart.py's conversion of a checkpoint (restore, carry, save) against a plain restore +
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
import jax.numpy as jnp
import numpy as np
import optax

import checkpoint as C
from config import PRESETS
from distributed import make_mesh
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
    target = C.abstract_state(cfg.model, tx, mesh)
    state = C.fresh_state(cfg.model, cfg.seed, tx, target)
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
    run.state = lambda: box["state"]
    return run


def matmul_rate(m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of a jitted float32 [m, k] @ [k, n], best of `repeats` timed batches."""
    a = jnp.ones((m, k), jnp.float32)
    b = jnp.ones((k, n), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    reps = max(1, int(2e9 / (2 * m * k * n)))  # ~2 GFLOP per timed batch
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(a, b)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return 2 * m * k * n / best


def bench_peak(cfg) -> dict:
    m, tokens = cfg.model, cfg.data.batch_size * cfg.data.seq_len
    H = m.head_dim
    shapes = {"q/o": (tokens, m.d_model, m.n_heads * H), "k/v": (tokens, m.d_model,
              m.n_kv_heads * H), "gate/up": (tokens, m.d_model, m.d_ff),
              "down": (tokens, m.d_ff, m.d_model), "head": (tokens, m.d_model, m.vocab_size)}
    rates = {name: matmul_rate(*shape) for name, shape in shapes.items()}
    return {"matmul_2048_flops": matmul_rate(2048, 2048, 2048),
            "projection_flops": rates, "best_projection_flops": max(rates.values())}


def bench_variants(cfg, repeats=5, n=4) -> dict:
    """Seconds per step of the default and of each variant, interleaved."""
    mask = M.decay_mask(cfg.model)
    variants = {
        "default": (cfg, None),
        "qk_norm": (dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                         qk_norm=True)), None),
        "no_per_layer_metrics": (dataclasses.replace(cfg, per_layer_metrics=False), None),
        "scan_layers": (dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, scan_layers=True)), None),
        "full_machinery": (dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, skip_step=True, update_clip="norm")), None),
        "plain_adamw": (cfg, plain_adamw(cfg.optim, cfg.steps, mask)),
    }
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(np.random.default_rng(0).integers(
            0, 256, (cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32),
            jax.NamedSharding(mesh, jax.P("data")))
        timers = {name: step_timer(c, tx or T.make_tx(c), mesh, tokens)
                  for name, (c, tx) in variants.items()}
        times = {name: [] for name in variants}
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits all alike
            for name, timer in timers.items():
                times[name].append(timer(n))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_checkpoint_cost(cfg) -> float:
    """Seconds an async orbax save of the train state costs the loop (blocking part + the
    time the next steps lose to the writer thread), measured on a loop with vs without one."""
    mesh = make_mesh(cfg.mesh)
    tx = T.make_tx(cfg)
    with tempfile.TemporaryDirectory() as tmp, jax.set_mesh(mesh):
        timer = step_timer(cfg, tx, mesh, jax.device_put(np.zeros(
            (cfg.data.batch_size, cfg.data.seq_len + 1), np.int32),
            jax.NamedSharding(mesh, jax.P("data"))))
        mngr = C.checkpoint_manager(pathlib.Path(tmp), cfg.keep_checkpoints)
        plain, saving = [], []
        for i in range(3):
            plain.append(timer(3) * 3)
            t = time.perf_counter()
            C.save_checkpoint(mngr, i, timer.state(), dataclasses.asdict(cfg))
            saving.append(time.perf_counter() - t + timer(3) * 3)
            mngr.wait_until_finished()
    return statistics.median(saving) - statistics.median(plain)


def compile_seconds(cfg) -> float:
    mesh = make_mesh(cfg.mesh)
    tx = T.make_tx(cfg)
    with jax.set_mesh(mesh):
        state = C.abstract_state(cfg.model, tx, mesh)
        tokens = jax.ShapeDtypeStruct((cfg.data.batch_size, cfg.data.seq_len + 1), jnp.int32,
                                      sharding=jax.NamedSharding(mesh, jax.P("data")))
        t = time.perf_counter()
        T.make_train_step(cfg, tx).lower(state, tokens).compile()
    return time.perf_counter() - t


def bench_warmstart(cfg, repeats=3):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        src = dataclasses.replace(cfg, run_dir=str(tmp / "src"))
        mesh = make_mesh(src.mesh)
        tx = T.make_tx(src)
        target = C.abstract_state(src.model, tx, mesh)
        with jax.set_mesh(mesh):
            state = C.fresh_state(src.model, src.seed, tx, target)
            C.write_config(tmp / "src", dataclasses.asdict(src))
            mngr = C.checkpoint_manager(tmp / "src", src.keep_checkpoints)
            C.save_checkpoint(mngr, 100, state, dataclasses.asdict(src))
            mngr.wait_until_finished()
        qk = W.target_config(src, W.WarmStartArgs(source="", to=""), 100, [])
        plain, convert, command = [], [], []
        for i in range(repeats):  # interleaved
            with jax.set_mesh(mesh):
                t = time.perf_counter()  # a plain restore builds its target too
                restored = C.restore_checkpoint(mngr, 100, C.abstract_state(src.model, tx, mesh))
                out = C.checkpoint_manager(tmp / f"plain{i}", src.keep_checkpoints)
                C.save_checkpoint(out, 100, restored, dataclasses.asdict(src))
                out.wait_until_finished()
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                W.convert_checkpoint(tmp / "src", 100, src, qk, mesh, tmp / f"surgery{i}")
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
    cfg = PRESETS["cpu"]
    r = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "cpu": cpu_name(), "jax": jax.__version__, "devices": str(jax.devices())},
         "preset": "cpu"}
    r["peak"] = peak = bench_peak(cfg)
    print(f"float32 matmul 2048^3: {peak['matmul_2048_flops'] / 1e9:.0f} GFLOP/s; the model's "
          "projection shapes: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in
                                            peak["projection_flops"].items()) + " GFLOP/s")
    r["step_s"] = steps = bench_variants(cfg)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    flops = M.flops_per_token(cfg.model, cfg.data.seq_len) * tokens / steps["default"]
    ckpt = bench_checkpoint_cost(cfg)
    r["train_step"] = {
        "tokens_per_s": tokens / steps["default"], "flops": flops,
        "flops_counted_as": "6N per token + 6 L T D (causal attention), model.flops_per_token",
        "mfu_vs_matmul_2048": flops / peak["matmul_2048_flops"],
        "mfu_vs_best_projection": flops / peak["best_projection_flops"],
        "compiles_after_first_step": 0,  # step_timer asserts it
        "device_to_host_transfers_in_step": 0}  # transfer_guard would have raised
    r["overheads"] = {
        "qk_norm": steps["qk_norm"] / steps["default"] - 1,
        "spike_machinery_vs_plain_adamw": steps["full_machinery"] / steps["plain_adamw"] - 1,
        "per_layer_instrumentation": steps["default"] / steps["no_per_layer_metrics"] - 1,
        "checkpoint_every_100_steps": ckpt / (100 * steps["default"]),
        "checkpoint_save_s": ckpt}
    r["overheads"]["scan_instead_of_unrolled"] = steps["scan_layers"] / steps["default"] - 1
    r["compile_s"] = {f"layers_{n}_{'scan' if scan else 'unrolled'}": compile_seconds(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n,
                                                           scan_layers=scan)))
        for n in (4, 24) for scan in (True, False)}
    r["warmstart"] = bench_warmstart(cfg)
    t, o, c, w = r["train_step"], r["overheads"], r["compile_s"], r["warmstart"]
    print(f"\ntrain step (preset cpu): {t['tokens_per_s']:,.0f} tokens/s, "
          f"{t['flops'] / 1e9:.0f} GFLOP/s = {t['mfu_vs_best_projection']:.0%} of the best "
          f"projection matmul, {t['mfu_vs_matmul_2048']:.0%} of the 2048^3 matmul; no "
          "recompilation and no host transfer in the step")
    print(f"overheads: QK-Norm {o['qk_norm']:+.1%}, spike machinery vs plain AdamW+clip "
          f"{o['spike_machinery_vs_plain_adamw']:+.1%}, per-layer instrumentation "
          f"{o['per_layer_instrumentation']:+.1%}, checkpoint every 100 steps "
          f"{o['checkpoint_every_100_steps']:+.1%} ({o['checkpoint_save_s']:.2f} s a save)")
    print(f"layers as a scan loop instead of unrolled: {o['scan_instead_of_unrolled']:+.1%} "
          "step time; compile " + ", ".join(f"{k} {v:.1f} s" for k, v in c.items()))
    print(f"warm-start conversion vs restore+save: {w['convert_s']:.2f} s vs "
          f"{w['restore_save_s']:.2f} s ({w['convert_over_restore_save']:.2f}x); the whole "
          f"command with its held-out loss report: {w['warmstart_command_s']:.2f} s")
    out = pathlib.Path("bench/results.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {out}")


def cpu_name() -> str:
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
