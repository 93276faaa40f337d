"""Train a Llama-style LM, sharded with jax.jit, checkpointed with orbax, resumable exactly.

    python train.py                          # the CPU default: a few minutes on a laptop
    python train.py tiny --steps 50          # a preset, then any flag (--help lists them all)
    python train.py marin-32b --dry-run --mesh.data 256 --mesh.model 4

Running the same command again in the same --run-dir resumes from the latest checkpoint and
continues exactly (bitwise, on CPU). Ctrl-C / SIGTERM saves a checkpoint before exiting.

NOTE for readers looking for `pjit`: in current JAX, `jax.jit` with shardings *is* pjit;
`jax.experimental.pjit` is deprecated. The mesh uses explicit sharding (`AxisType.Explicit`).
"""

import dataclasses
import math
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import P

from checkpoint import (abstract_state, checkpoint_manager, fresh_state, per_device_bytes,
                        read_config, resume, save_checkpoint, strict_json, write_config)
from cli import UserError, command, parse
from data import DataConfig, TokenData
from distributed import (DistConfig, MeshConfig, check_fits, make_mesh, process_rows, say,
                         start_distributed)
from model import ModelConfig, count_params, decay_mask, flops_per_token, loss_fn
from optim import OptimConfig, lr_schedule, make_optimizer, opt_metrics
from report import event_report, read_metrics


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    dist: DistConfig = DistConfig()
    run_dir: str = "runs/default"
    steps: int = 400  # ~6 minutes on 2 CPU cores
    seed: int = 0  # parameter init
    log_every: int = 20  # progress line every this many steps (metrics.jsonl gets every step)
    eval_every: int = 200  # held-out loss every this many steps, and at the end
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    max_consecutive_nonfinite: int = 20  # stop after this many non-finite steps in a row
    per_layer_metrics: bool = True  # per-layer grad/update norms and q/k weight norms
    resume_step: int | None = None  # resume from this checkpoint instead of the latest
    dry_run: bool = False  # print sizes and per-device bytes, allocate nothing

    def __post_init__(self):
        for name in ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "max_consecutive_nonfinite"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.mesh.data <= 0 or self.mesh.model <= 0:
            raise ValueError("--mesh.data and --mesh.model must be positive")


# Settings that may change when a run directory is resumed: they do not change the math.
RESUMABLE = {"run_dir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
             "max_consecutive_nonfinite", "dry_run", "mesh.data", "mesh.model",
             "data.replace_batches", "data.eval_sequences", "per_layer_metrics", "resume_step",
             "dist.coordinator", "dist.num_processes", "dist.process_id", "dist.auto"}
# Names a config.json written by an earlier version may use, and what they are called now.
RENAMED = {"data.skip_steps": "data.replace_batches",
           "max_consecutive_skips": "max_consecutive_nonfinite"}

PRESETS = {
    "cpu": TrainConfig(model=ModelConfig(scan_layers=False)),  # 4 layers: unrolled is faster
    "tiny": TrainConfig(
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
        optim=OptimConfig(lr=1e-2, warmup_steps=5),
        data=DataConfig(seq_len=32, batch_size=8),
        run_dir="runs/tiny", steps=20, log_every=5, eval_every=10, checkpoint_every=10),
    # The spike experiments (experiments.py) run at d_model 64 (d_ff 172): a high, constant LR
    # 3e-2 after a 10-step warmup, Adam's beta2 0.999 (a stale second moment) and no gradient
    # clipping, no QK-Norm: the baseline of the story (~2 minutes on 2 cores).
    "spiky-long": TrainConfig(
        model=ModelConfig(d_model=64, d_ff=172),
        optim=OptimConfig(lr=3e-2, warmup_steps=10, b2=0.999, max_grad_norm=0.0,
                          min_lr_ratio=1.0),
        data=DataConfig(batch_size=16),
        run_dir="runs/spiky-long", steps=600, log_every=100, eval_every=300,
        checkpoint_every=100, keep_checkpoints=10),
    # The LR sweep: the same model, beta2 0.99, clipping at 1, cosine decay; 100 steps.
    "spiky": TrainConfig(
        model=ModelConfig(d_model=64, d_ff=172),
        optim=OptimConfig(lr=3e-2, warmup_steps=10, b2=0.99),
        data=DataConfig(batch_size=16),
        run_dir="runs/spiky", steps=100, log_every=50, eval_every=100, checkpoint_every=100),
    # Looking for Marin's "Bad Spike" (a rise that does not settle back): spiky-long longer,
    # with Adam's eps 1e-15 and neither weight decay nor z-loss (Molybog et al. 2304.13013:
    # a tiny eps lets time-correlated gradients blow up Adam's update). ~4 minutes on 2 cores.
    "bad-spike": TrainConfig(
        model=ModelConfig(d_model=64, d_ff=172, z_loss_weight=0.0),
        optim=OptimConfig(lr=3e-2, warmup_steps=10, b2=0.999, eps=1e-15, weight_decay=0.0,
                          max_grad_norm=0.0, min_lr_ratio=1.0),
        data=DataConfig(batch_size=16),
        run_dir="runs/bad-spike", steps=1500, log_every=250, eval_every=500,
        checkpoint_every=100, keep_checkpoints=20),
    # The real Marin 32B shape and optimizer (Marin's exp1295_32b); for --dry-run on a laptop.
    "marin-32b": TrainConfig(
        model=ModelConfig(vocab_size=128_256, d_model=5120, n_layers=64, n_heads=40,
                          n_kv_heads=8, d_ff=27_648, rope_theta=500_000.0, dtype="bfloat16"),
        optim=OptimConfig(lr=7e-4, weight_decay=0.05, warmup_steps=10_000, decay="linear",
                          decay_fraction=0.4, min_lr_ratio=0.1),
        data=DataConfig(seq_len=4096, batch_size=8192),
        mesh=MeshConfig(data=256, model=4),
        run_dir="runs/marin-32b", steps=160_000, checkpoint_every=1000, eval_every=1000),
}


def parse_config(argv: list[str]) -> TrainConfig:
    """`[preset] [--flags]`: the preset (default "cpu") supplies the defaults the flags override."""
    name = argv[0] if argv and not argv[0].startswith("-") else "cpu"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    rest = argv[1:] if argv and argv[0] == name else argv
    return parse_flags(PRESETS[name], rest)


def parse_flags(default: TrainConfig, args: list[str]) -> TrainConfig:
    """tyro over TrainConfig with `default` as the defaults; a bad flag is a UserError."""
    return parse(TrainConfig, args, default=default,
                 description=f"{__doc__}\nPresets: {', '.join(PRESETS)}.")


def flatten(d: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}"""
    return {k2: v2 for k, v in d.items() for k2, v2 in
            (flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}


def config_from_dict(d: dict) -> TrainConfig:
    """A TrainConfig from its asdict() form, as config.json stores it (older names renamed)."""
    subs = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "mesh": MeshConfig,
            "dist": DistConfig}
    nested: dict = {}
    for key, value in flatten(d).items():
        *parents, leaf = RENAMED.get(key, key).split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return TrainConfig(**{k: subs[k](**v) if k in subs else v for k, v in nested.items()})


def load_config(run_dir: pathlib.Path) -> TrainConfig | None:
    """The config stored in a run directory; None if it has none."""
    stored = read_config(run_dir)
    try:
        return None if stored is None else config_from_dict(stored)
    except (ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{run_dir}/config.json is not a spikefix config ({e})") from None


def check_same_run(stored: TrainConfig, cfg: TrainConfig) -> None:
    """A run directory holds one run: its config must agree with the flags, but for RESUMABLE."""
    old, new = flatten(dataclasses.asdict(stored)), flatten(dataclasses.asdict(cfg))
    diffs = [f"{k} (run has {old.get(k)!r}, flags give {new.get(k)!r})"
             for k in sorted(set(old) | set(new))
             if k not in RESUMABLE and old.get(k) != new.get(k)]
    if diffs:
        raise UserError(f"{cfg.run_dir} holds a run with a different config: {'; '.join(diffs)}"
                        ". Pass the same flags to resume, or use a new --run-dir")


def setup_mesh(cfg: TrainConfig, devices) -> jax.sharding.Mesh:
    """The mesh of cfg.mesh over `devices`, once the model and batch are known to fit on it."""
    check_fits(cfg.mesh, cfg.model, cfg.data.batch_size, len(devices))
    return make_mesh(cfg.mesh, devices)


def load_data(cfg: TrainConfig) -> TokenData:
    try:
        return TokenData(cfg.data, cfg.model.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None


def make_tx(cfg: TrainConfig):
    return make_optimizer(cfg.optim, cfg.steps, decay_mask(cfg.model))


# ---------------------------------------------------------------------------------------------
# The train step

def per_layer_norms(tree: dict) -> jax.Array:
    """[L] L2 norms over the stacked per-layer leaves of a params-shaped tree."""
    sq = [jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
          for x in jax.tree.leaves(tree["layers"])]
    return jnp.sqrt(sum(sq))


def make_train_step(cfg: TrainConfig, tx):
    schedule = lr_schedule(cfg.optim, cfg.steps)

    def train_step(state, tokens_BT1):
        params = state["params"]
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens_BT1,
                                                                        cfg.model)
        updates, opt_state = tx.update(grads, state["opt_state"], params, loss=loss,
                                       step=state["step"])
        metrics = {"loss": loss, "lr": schedule(state["step"]), **aux,
                   **opt_metrics(opt_state, cfg.optim)}
        if cfg.per_layer_metrics:  # Marin saw update spikes larger in the lower layers
            metrics["grad_norm_per_layer"] = per_layer_norms(grads)
            metrics["update_norm_per_layer"] = per_layer_norms(updates)
            metrics |= {f"{w}_norm": per_layer_norms({"layers": {w: params["layers"][w]}})
                        for w in ("wq", "wk")}
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    """(params, tokens [C, B, T+1]) -> the mean cross-entropy (nats/token; nats/byte for byte
    data) over all C batches, in one jitted pass (lax.map: one batch in memory at a time)."""
    return jax.jit(lambda params, tokens_CBT1: jnp.mean(jax.lax.map(
        lambda tokens_BT1: loss_fn(params, tokens_BT1, cfg.model)[1]["ce"], tokens_CBT1)))


def put_held_out(data: TokenData, mesh, rows: slice = slice(None)) -> jax.Array:
    """The held-out set on the mesh, each batch split over "data" like a training batch."""
    C, _, T1 = (local := data.held_out_batches(rows)).shape
    return jax.make_array_from_process_local_data(jax.NamedSharding(mesh, P(None, "data")),
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
    print(f"params + opt state  {total / 2**30:.2f} GiB total, {per_device / 2**30:.3f} GiB "
          f"per device on a {cfg.mesh.data}x{cfg.mesh.model} (data x model) mesh")


class StopRequested:
    """SIGINT / SIGTERM set a flag; the loop saves a checkpoint at the next step boundary."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step...",
              flush=True)


class Log:
    """metrics.jsonl (process 0) and the progress line; counts non-finite steps in a row."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path, start: int):
        self.cfg, self.start, self.nonfinite = cfg, start, 0
        self.file = open(run_dir / "metrics.jsonl", "a") if jax.process_index() == 0 else None
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        self.t_start = self.t_prev = time.perf_counter()
        self.t_first = None  # the first record's time: the average excludes the compile
        self.shown = (start - 1, self.t_start)  # the step and time of the last progress line

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
        if step % self.cfg.log_every == 0 or "eval_loss" in m:
            eta = (now - self.t_start) / (step + 1 - self.start) * (self.cfg.steps - step - 1)
            rate = self.tokens_per_step * (step - self.shown[0]) / (now - self.shown[1])
            self.shown = (step, now)
            ev = f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
            say(f"step {step:>6}/{self.cfg.steps} | loss {m['loss']:.4f}{ev} | "
                f"grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                f"logit max {max(m['attn_logit_max']):.1f} | "
                f"{rate / 1e3:.1f}k tok/s | ETA {fmt_time(eta)}", flush=True)
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
    stored = load_config(run_dir)
    if stored is not None:
        check_same_run(stored, cfg)
    data = load_data(cfg)
    tx = make_tx(cfg)
    target = abstract_state(cfg.model, tx, mesh)
    with jax.set_mesh(mesh):
        mngr, state = resume(run_dir, target, cfg.keep_checkpoints, cfg.resume_step, say)
        if state is None:
            state = fresh_state(cfg.model, cfg.seed, tx, target)
            n = count_params(cfg.model)
            say(f"new run {run_dir}: {n / 1e6:.2f}M params, {cfg.steps} steps, "
                f"mesh {cfg.mesh.data}x{cfg.mesh.model} on {jax.process_count()} process(es), "
                f"{data.train.size:,} training tokens")
        if jax.process_index() == 0:
            write_config(run_dir, dataclasses.asdict(cfg))
        mngr = mngr or checkpoint_manager(run_dir, cfg.keep_checkpoints)
        return run_loop(cfg, tx, state, data, mesh, mngr, run_dir)


def run_loop(cfg, tx, state, data, mesh, mngr, run_dir) -> dict:
    train_step, eval_step = make_train_step(cfg, tx), make_eval_step(cfg)
    batch_sharding = jax.NamedSharding(mesh, P("data"))
    rows = process_rows(batch_sharding, cfg.data.batch_size)

    def put(tokens):
        return jax.make_array_from_process_local_data(batch_sharding, tokens)

    eval_tokens = put_held_out(data, mesh, rows)
    stop = StopRequested()
    start = int(state["step"])
    log = Log(cfg, run_dir, start)
    prev, last = None, {}
    for step in range(start, cfg.steps):
        state, metrics = train_step(state, put(data.batch(step, rows)))  # dispatch: async
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics["eval_loss"] = eval_step(state["params"], eval_tokens)
        # NOTE: step s-1's metrics are read only now, after step s is dispatched: reading step
        # s's would make the host wait for the device, which would then idle while the host
        # logs and builds the next batch.
        if prev is not None:
            last = log.record(*prev)
            if log.nonfinite >= cfg.max_consecutive_nonfinite:
                mngr.wait_until_finished()
                print(f"stopping: {log.nonfinite} non-finite steps in a row (last at step "
                      f"{prev[0]}); parameters were left unchanged by them. Last checkpoint: "
                      f"step {mngr.latest_step()} in {run_dir}", file=sys.stderr)
                sys.exit(1)
        prev = (step, metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or stop.signal:
            save_checkpoint(mngr, done, state, dataclasses.asdict(cfg))
        if stop.signal:
            break
    if prev is not None:
        last = log.record(*prev)
        if last["step"] > start:
            last["avg_tokens_per_s"] = log.average_tokens_per_s(last["step"])
    mngr.wait_until_finished()
    if stop.signal:
        print(f"saved step {prev[0] + 1} to {run_dir}; resume with the same command")
        sys.exit(128 + stop.signal)
    if log.file:
        log.file.close()
        print(event_report(read_metrics(run_dir), str(run_dir)))
    return last


@command
def main(argv: list[str]) -> int:
    cfg = parse_config(argv)
    start_distributed(cfg.dist)
    last = train(cfg)
    if last:
        say(f"done: step {last['step'] + 1}, held-out loss {last['eval_loss']:.4f} "
            f"nats/token, {last.get('avg_tokens_per_s', 0):.0f} tokens/s on average")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
