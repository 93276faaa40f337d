"""Train a Llama-style LM, sharded with jax.jit, checkpointed with orbax, resumable exactly.

    python train.py                          # the CPU default: a few minutes on a laptop
    python train.py tiny --steps 50          # a preset, then any flag (--help lists them all)
    python train.py marin-32b --dry-run --mesh.data 256 --mesh.model 4

Running the same command again in the same --run-dir resumes from the latest checkpoint and
continues exactly (bitwise, on CPU). Ctrl-C / SIGTERM saves a checkpoint before exiting.

NOTE for readers looking for `pjit`: in current JAX, `jax.jit` with shardings *is* pjit;
`jax.experimental.pjit` is deprecated. The mesh uses explicit sharding (`AxisType.Explicit`).
"""

import contextlib
import dataclasses
import io
import json
import math
import os
import pathlib
import re
import signal
import sys
import time

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import tyro
from jax import P
from jax.sharding import AxisType

from data import DataConfig, TokenData
from model import ModelConfig, count_params, flops_per_token, loss_fn, param_table
from model import decay_mask, init_params, logical_to_spec
from optim import OptimConfig, lr_schedule, make_optimizer, opt_metrics


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1  # batch split and FSDP over this axis
    model: int = 1  # tensor parallelism over heads / ffw / vocab


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Several processes (one per host, or per GPU): JAX's multi-controller runtime. Fields left
    unset come from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; with
    --dist.auto JAX detects them itself on SLURM, Open MPI, Cloud TPU and GKE."""
    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0  # 0: $JAX_NUM_PROCESSES, else 1 (a single process)
    process_id: int = -1  # -1: $JAX_PROCESS_ID
    auto: bool = False  # jax.distributed.initialize() with cluster auto-detection


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
    max_consecutive_skips: int = 20  # stop after this many non-finite steps in a row
    per_layer_metrics: bool = True  # per-layer grad/update norms and q/k weight norms
    resume_step: int | None = None  # resume from this checkpoint instead of the latest
    dry_run: bool = False  # print sizes and per-device bytes, allocate nothing

    def __post_init__(self):
        for name in ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "max_consecutive_skips"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.mesh.data <= 0 or self.mesh.model <= 0:
            raise ValueError("--mesh.data and --mesh.model must be positive")


# Settings that may change when a run directory is resumed: they do not change the math.
RESUMABLE = {"run_dir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
             "max_consecutive_skips", "dry_run", "mesh.data", "mesh.model", "data.skip_steps",
             "per_layer_metrics", "resume_step", "dist.coordinator", "dist.num_processes",
             "dist.process_id", "dist.auto"}

PRESETS = {
    "cpu": TrainConfig(model=ModelConfig(scan_layers=False)),  # 4 layers: unrolled is faster
    "tiny": TrainConfig(
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
        optim=OptimConfig(lr=1e-2, warmup_steps=5),
        data=DataConfig(seq_len=32, batch_size=8),
        run_dir="runs/tiny", steps=20, log_every=5, eval_every=10, checkpoint_every=10),
    # The spike experiments (experiments.py): a smaller model at a high LR, no QK-Norm, short
    # warmup, Marin's AdamW otherwise; ~1.5 minutes on 2 cores.
    "spiky": TrainConfig(
        model=ModelConfig(d_model=128, d_ff=344),
        optim=OptimConfig(lr=3e-2, warmup_steps=10, b2=0.99),
        data=DataConfig(batch_size=16),
        run_dir="runs/spiky", steps=300, log_every=50, eval_every=100, checkpoint_every=50,
        keep_checkpoints=10),
    # The same model run longer at a constant LR with the stale second moment of beta2 0.999 and
    # no gradient clipping: the story experiments (~3 minutes on 2 cores).
    "spiky-long": TrainConfig(
        model=ModelConfig(d_model=128, d_ff=344),
        optim=OptimConfig(lr=3e-2, warmup_steps=10, b2=0.999, max_grad_norm=0.0,
                          min_lr_ratio=1.0),
        data=DataConfig(batch_size=16),
        run_dir="runs/spiky-long", steps=1000, log_every=250, eval_every=500,
        checkpoint_every=250, keep_checkpoints=10),
    # The real Marin 32B shape and optimizer (REFERENCES.md); for --dry-run on a laptop.
    "marin-32b": TrainConfig(
        model=ModelConfig(vocab_size=128_256, d_model=5120, n_layers=64, n_heads=40,
                          n_kv_heads=8, d_ff=27_648, rope_theta=500_000.0, dtype="bfloat16"),
        optim=OptimConfig(lr=7e-4, weight_decay=0.05, warmup_steps=10_000, decay="linear",
                          decay_fraction=0.4, min_lr_ratio=0.1),
        data=DataConfig(seq_len=4096, batch_size=8192),
        mesh=MeshConfig(data=256, model=4),
        run_dir="runs/marin-32b", steps=160_000, checkpoint_every=1000, eval_every=1000),
}


class UserError(Exception):
    """A mistake in the command line, the data or the run directory: one line, exit 2."""


def parse_config(argv: list[str]) -> TrainConfig:
    """`[preset] [--flags]`: the preset (default "cpu") supplies the defaults the flags override."""
    name = argv[0] if argv and not argv[0].startswith("-") else "cpu"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    rest = argv[1:] if argv and argv[0] == name else argv
    return parse_flags(PRESETS[name], rest)


def parse_flags(default: TrainConfig, args: list[str]) -> TrainConfig:
    """tyro over TrainConfig with `default` as the defaults; a bad flag is a UserError."""
    return cli(TrainConfig, args, default=default,
               description=f"{__doc__}\nPresets: {', '.join(PRESETS)}.")


def cli(cls, args: list[str], **kwargs):
    """tyro.cli, with a parse error raised as a one-line UserError (--help still prints)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(cls, args=args, **kwargs)
    except SystemExit as e:
        if e.code:  # tyro draws a box around parse errors; a user error here is one line
            raise UserError(one_line(err.getvalue())) from None
        raise


def one_line(tyro_message: str) -> str:
    """tyro's boxed error (a title line, the message, a help pointer) as one line."""
    lines = [line.strip(" │╭╮╰╯─-") for line in tyro_message.splitlines()]
    lines = [line for line in lines if line and not line.startswith("For full helptext")]
    text = " ".join(" ".join(lines[1:] or lines).split())
    return re.sub(r"Error parsing (--\S+|[\w.]+): ", lambda m: m[1] + ": " if m[1][0] == "-"
                  else "", text)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_from_dict(d: dict) -> TrainConfig:
    subs = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "mesh": MeshConfig,
            "dist": DistConfig}
    return TrainConfig(**{k: subs[k](**v) if k in subs else v for k, v in d.items()})


# ---------------------------------------------------------------------------------------------
# Processes, mesh and sharded state

def start_distributed(cfg: DistConfig) -> None:
    """Join the other processes of a multi-process run (before any JAX device is touched); a
    single process does nothing. Every process then sees all devices of all processes."""
    if cfg.auto:
        jax.distributed.initialize()
        return
    env = os.environ
    n = cfg.num_processes or int(env.get("JAX_NUM_PROCESSES", 1))
    if n <= 1:
        return
    coordinator = cfg.coordinator or env.get("JAX_COORDINATOR_ADDRESS", "")
    pid = cfg.process_id if cfg.process_id >= 0 else int(env.get("JAX_PROCESS_ID", -1))
    if not coordinator or not 0 <= pid < n:
        raise UserError(f"a {n}-process run needs --dist.coordinator HOST:PORT and "
                        f"--dist.process-id in [0, {n}) (or JAX_COORDINATOR_ADDRESS and "
                        "JAX_PROCESS_ID)")
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid)


def say(*args, **kwargs) -> None:
    """print, on process 0 only."""
    if jax.process_index() == 0:
        print(*args, **kwargs)


def check_fits(cfg: TrainConfig, n_devices: int | None) -> None:
    """Raise UserError if the mesh cannot hold this model and batch."""
    m, d, mdl = cfg.model, cfg.mesh.data, cfg.mesh.model
    if n_devices is not None and d * mdl != n_devices:
        raise UserError(f"mesh {d}x{mdl} needs {d * mdl} devices but {n_devices} are present: "
                        "set --mesh.data and --mesh.model so their product is the device count")
    checks = [("data.batch_size", cfg.data.batch_size, "mesh.data", d),
              ("model.d_model", m.d_model, "mesh.data", d),
              ("model.n_kv_heads", m.n_kv_heads, "mesh.model", mdl),
              ("model.d_ff", m.d_ff, "mesh.model", mdl),
              ("model.vocab_size", m.vocab_size, "mesh.model", mdl)]
    for name, value, axis, size in checks:
        if value % size:
            raise UserError(f"{name}={value} is not divisible by {axis}={size}: "
                            f"change one of them")


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    return jax.make_mesh((cfg.data, cfg.model), ("data", "model"),
                         axis_types=(AxisType.Explicit, AxisType.Explicit), devices=devices)


def init_state(cfg: TrainConfig, tx) -> dict:
    params = init_params(cfg.model, jax.random.key(cfg.seed))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_specs(cfg: ModelConfig, abstract_state) -> dict:
    """Every state leaf's PartitionSpec, from the parameter table: a param, and any optimizer
    leaf that mirrors one (Adam's mu and nu end in the param's path and shape), takes the
    param's spec; everything else (counts, histories, scalars) is replicated."""
    table = {tuple(k.split("/")): s for k, s in param_table(cfg).items()}

    def spec(path, leaf):
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        for i in range(len(names)):
            s = table.get(names[i:])
            if s is not None and s.shape == leaf.shape:
                return logical_to_spec(s.axes)
        return P()
    return jax.tree_util.tree_map_with_path(spec, abstract_state)


def abstract_state(cfg: TrainConfig, tx, mesh) -> dict:
    """ShapeDtypeStructs carrying the target shardings: the orbax restore target, and the
    out_shardings of init. Allocates nothing."""
    shapes = jax.eval_shape(lambda: init_state(cfg, tx))
    specs = state_specs(cfg.model, shapes)
    return jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                          sharding=jax.NamedSharding(mesh, p)),
                        shapes, specs)


def fresh_state(cfg: TrainConfig, tx, target) -> dict:
    """A new train state, created directly in the shardings `target` (abstract_state) carries."""
    shardings = jax.tree.map(lambda s: s.sharding, target)
    return jax.jit(lambda: init_state(cfg, tx), out_shardings=shardings)()


def per_device_bytes(cfg: TrainConfig, tx) -> tuple[int, int]:
    """(total, per-device) bytes of params + optimizer state for cfg.mesh, by arithmetic on the
    shapes and specs: needs neither the devices nor the memory."""
    shapes = jax.eval_shape(lambda: init_state(cfg, tx))
    sizes = {"data": cfg.mesh.data, "model": cfg.mesh.model}
    total = per_device = 0
    for s, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(state_specs(cfg.model, shapes))):
        total += math.prod(s.shape) * s.dtype.itemsize
        shard = [dim // (sizes[a] if a else 1) for dim, a in
                 zip(s.shape, tuple(spec) + (None,) * (len(s.shape) - len(spec)))]
        per_device += math.prod(shard) * s.dtype.itemsize
    return total, per_device


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
        updates, opt_state = tx.update(grads, state["opt_state"], params, loss=loss)
        metrics = {"loss": loss, "lr": schedule(state["step"]), **aux,
                   **opt_metrics(opt_state, cfg.optim)}
        if cfg.per_layer_metrics:  # Marin saw update spikes larger in the lower layers
            metrics["grad_norm_per_layer"] = per_layer_norms(grads)
            metrics["update_norm_per_layer"] = per_layer_norms(updates)
            metrics["wq_norm"] = per_layer_norms({"layers": {"wq": params["layers"]["wq"]}})
            metrics["wk_norm"] = per_layer_norms({"layers": {"wk": params["layers"]["wk"]}})
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_step(cfg: TrainConfig):
    return jax.jit(lambda params, tokens: loss_fn(params, tokens, cfg.model)[1]["ce"])


# ---------------------------------------------------------------------------------------------
# Run directory: config.json, metrics.jsonl, checkpoints/

def checkpoint_manager(run_dir: pathlib.Path, cfg: TrainConfig, read_only: bool = False
                       ) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints,
                                           enable_async_checkpointing=True,
                                           create=not read_only, read_only=read_only)
    return ocp.CheckpointManager(run_dir.absolute() / "checkpoints", options=options)


def save_checkpoint(mngr, step: int, state, cfg: TrainConfig) -> None:
    meta = {"step": step, "config": dataclasses.asdict(cfg), "time": time.time()}
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                             meta=ocp.args.JsonSave(meta)), force=True)


def restore_checkpoint(mngr, step: int, target) -> dict:
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))
    return restored["state"]


def check_run_dir(run_dir: pathlib.Path, cfg: TrainConfig) -> None:
    """A run directory holds one run: its config.json must agree with the flags given."""
    path = run_dir / "config.json"
    if not path.exists():
        if run_dir.exists() and not run_dir.is_dir():
            raise UserError(f"--run-dir {run_dir} exists and is not a directory")
        return
    try:
        stored = flatten(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable ({e}): fix it or use a new --run-dir") from None
    given = flatten(dataclasses.asdict(cfg))
    diffs = [f"{k} (run has {stored.get(k)!r}, flags give {given.get(k)!r})"
             for k in sorted(set(stored) | set(given))
             if k not in RESUMABLE and stored.get(k) != given.get(k)]
    if diffs:
        raise UserError(f"{run_dir} holds a run with a different config: {'; '.join(diffs)}. "
                        "Pass the same flags to resume, or use a new --run-dir")


def make_writable(run_dir: pathlib.Path, cfg: TrainConfig) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "config.json.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        tmp.replace(run_dir / "config.json")
    except OSError as e:
        raise UserError(f"cannot write to --run-dir {run_dir}: {e.strerror}; "
                        "choose a writable directory") from None


def to_host(metrics: dict) -> dict:
    """Device metrics -> JSON-ready floats and lists."""
    return {k: (v.tolist() if v.ndim else v.item()) for k, v in jax.device_get(metrics).items()}


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


# ---------------------------------------------------------------------------------------------
# The loop

def dry_run(cfg: TrainConfig) -> None:
    tx = make_optimizer(cfg.optim, cfg.steps, decay_mask(cfg.model))
    check_fits(cfg, None)
    total, per_device = per_device_bytes(cfg, tx)
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


def train(cfg: TrainConfig, devices=None) -> dict:
    """Train (or resume) in cfg.run_dir on `devices` (default: all); returns the last step's
    metrics. Raises UserError before writing anything if the config, data or run dir is bad."""
    if cfg.dry_run:
        dry_run(cfg)
        return {}
    devices = devices or jax.devices()
    check_fits(cfg, len(devices))
    run_dir = pathlib.Path(cfg.run_dir)
    check_run_dir(run_dir, cfg)
    try:
        data = TokenData(cfg.data, cfg.model.vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    mesh = make_mesh(cfg.mesh, devices)
    tx = make_optimizer(cfg.optim, cfg.steps, decay_mask(cfg.model))
    target = abstract_state(cfg, tx, mesh)
    saved = (run_dir / "checkpoints").is_dir()
    mngr = checkpoint_manager(run_dir, cfg) if saved else None
    steps_saved = list(mngr.all_steps()) if saved else []
    if cfg.resume_step is not None and cfg.resume_step not in steps_saved:
        raise UserError(f"no checkpoint at step {cfg.resume_step} in {run_dir}; "
                        f"saved steps: {steps_saved or 'none'}")
    start = cfg.resume_step if cfg.resume_step is not None else max(steps_saved, default=None)

    with jax.set_mesh(mesh):
        if start is not None:
            try:
                state = restore_checkpoint(mngr, start, target)
            except Exception as e:  # a damaged checkpoint: name it, never start fresh over it
                older = [s for s in steps_saved if s < start]
                hint = (f"resume from an older one with --resume-step {older[-1]}" if older
                        else "no older checkpoint exists")
                raise UserError(f"checkpoint at step {start} in {run_dir} is unreadable "
                                f"({type(e).__name__}): {hint}") from None
            say(f"resumed {run_dir} at step {start}")
            later = [s for s in steps_saved if s > start]
            if later:  # --resume-step went back: keep the later checkpoints, out of the way
                aside = run_dir / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}"
                aside.mkdir()
                for s in later:
                    (run_dir / "checkpoints" / str(s)).rename(aside / str(s))
                say(f"moved the later checkpoints {later} aside to {aside}")
                mngr = checkpoint_manager(run_dir, cfg)
        else:
            state = fresh_state(cfg, tx, target)
            n = count_params(cfg.model)
            say(f"new run {run_dir}: {n / 1e6:.2f}M params, {cfg.steps} steps, "
                f"mesh {cfg.mesh.data}x{cfg.mesh.model} on {jax.process_count()} process(es), "
                f"{data.train.size:,} training tokens")
        if jax.process_index() == 0:
            make_writable(run_dir, cfg)
        mngr = mngr or checkpoint_manager(run_dir, cfg)
        return run_loop(cfg, tx, state, data, mesh, mngr, run_dir)


def run_loop(cfg, tx, state, data, mesh, mngr, run_dir) -> dict:
    train_step, eval_step = make_train_step(cfg, tx), make_eval_step(cfg)
    batch_sharding = jax.NamedSharding(mesh, P("data"))
    rows = process_rows(batch_sharding, cfg.data.batch_size)

    def put(tokens):
        return jax.make_array_from_process_local_data(batch_sharding, tokens)

    eval_tokens = put(data.eval_batch(rows))
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    stop = StopRequested()
    log = open(run_dir / "metrics.jsonl", "a") if jax.process_index() == 0 else None
    start = int(state["step"])
    prev, last, consecutive_skips, t_first = None, {}, 0, None
    t_start = t_prev = time.perf_counter()
    shown = (start - 1, t_start)  # the step and time of the last progress line

    def record(step, metrics):  # called with step s-1's metrics after step s is dispatched
        nonlocal t_prev, consecutive_skips, t_first, shown
        now = time.perf_counter()
        t_first = t_first or now  # throughput is averaged from here: the compile is excluded
        m = {"step": step, **to_host(metrics), "tokens_per_s": tokens_per_step / (now - t_prev)}
        t_prev = now
        if log:
            log.write(json.dumps(m) + "\n")
            log.flush()
        if step % cfg.log_every == 0 or "eval_loss" in m:
            done = step + 1 - start
            eta = (now - t_start) / done * (cfg.steps - step - 1)
            rate = tokens_per_step * (step - shown[0]) / (now - shown[1])  # since the last line
            shown = (step, now)
            ev = f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
            say(f"step {step:>6}/{cfg.steps} | loss {m['loss']:.4f}{ev} | "
                f"grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                f"logit max {max(m['attn_logit_max']):.1f} | "
                f"{rate / 1e3:.1f}k tok/s | ETA {fmt_time(eta)}", flush=True)
        consecutive_skips = consecutive_skips + 1 if not math.isfinite(m["loss"] + m[
            "grad_norm"]) else 0
        return m

    for step in range(start, cfg.steps):
        state, metrics = train_step(state, put(data.batch(step, rows)))
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            metrics["eval_loss"] = eval_step(state["params"], eval_tokens)
        if prev is not None:
            last = record(*prev)
            if consecutive_skips >= cfg.max_consecutive_skips:
                mngr.wait_until_finished()
                print(f"stopping: {consecutive_skips} non-finite steps in a row (last at step "
                      f"{prev[0]}); parameters were left unchanged by them. Last checkpoint: "
                      f"step {mngr.latest_step()} in {run_dir}", file=sys.stderr)
                sys.exit(1)
        prev = (step, metrics)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps or stop.signal:
            save_checkpoint(mngr, done, state, cfg)
        if stop.signal:
            break
    if prev is not None:
        last = record(*prev)
        if last["step"] > start:
            last["avg_tokens_per_s"] = tokens_per_step * (last["step"] - start) / (t_prev - t_first)
    mngr.wait_until_finished()
    if stop.signal:
        print(f"saved step {prev[0] + 1} to {run_dir}; resume with the same command")
        sys.exit(128 + stop.signal)
    if log:
        log.close()
        from report import find_spikes, read_metrics, spike_table  # report.py imports train
        print(spike_table(find_spikes(read_metrics(run_dir)), str(run_dir)))
    return last


def process_rows(sharding, batch_size: int) -> slice:
    """This process's rows of the global batch: those its own devices hold under `sharding`
    (all of them on one process)."""
    rows = [i[0] for i in sharding.addressable_devices_indices_map((batch_size, 1)).values()]
    return slice(min(r.start or 0 for r in rows), max(r.stop or batch_size for r in rows))


def main(argv: list[str]) -> int:
    try:
        cfg = parse_config(argv)
        start_distributed(cfg.dist)
        last = train(cfg)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if last:
        say(f"done: step {last['step'] + 1}, held-out loss {last['eval_loss']:.4f} "
            f"nats/token, {last.get('avg_tokens_per_s', 0):.0f} tokens/s on average")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
