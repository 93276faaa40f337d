"""Benchmarks that print figures, measured side by side in one run (never a timed test).

    python -m bench.bench                # ~18 minutes on 2 idle cores; writes bench/results.json
    python -m bench.bench --rounds 3     # quicker, noisier
    python -m bench.bench --story        # where the story preset's step time goes (~5 minutes);
                                         # writes bench/results-story.json
    python -m bench.bench --harness      # the harness per member-step (~10 minutes);
                                         # writes bench/results-harness.json
    python -m bench.bench --torch        # train.py's step beside eager PyTorch's, and the
                                         # projections' matmuls alone (~5 minutes); writes
                                         # bench/results-torch.json
    OMP_NUM_THREADS=1 taskset -c 0 python -m bench.bench --torch --out FILE
                                         # the same, both sides on one pinned core
    python -m bench.bench --accelerator  # one GPU: a 0.9B model at seq 4,096 in bf16 (~2 min);
                                         # writes bench/results-gpu.json
    python -m bench.bench --allocator    # glibc's malloc kept from unmapping the step's buffers,
                                         # against the default (~6 minutes); writes
                                         # bench/results-allocator.json

Run it alone: other processes on the CPU moved these figures by 11-40%. bench.py measures how
much CPU time other processes took during the run (/proc/stat) and warns when it was more than
5% of the machine.

Every timed variant runs in its own process (one process holding many compiled steps ran the
same step 5-12% slower), and the processes take turns: in each round every process times a few
steps while the others wait, so drift on the machine hits all alike. Figures are medians over
the rounds. One more process times the matmuls in the same turns: the 2048^3 peak and the step's
own matmul shapes (forward projections, input gradients, weight gradients over the B*T tokens).
An overhead is a ratio within one process: the default step and the variant, each with its own
state, timed one after the other (each first in every other round). Two processes running the
same step came out up to 9% apart, more than the overheads to be measured; the default step
paired with itself shows how close two identical steps come in one process.

1. Sequence scaling: tokens/s at seq 128 ... 1,024 with the same 4,096 tokens per step and model,
   for each attention form (attention.py); `auto` is the form model.attention picks here.
2. The step at seq 128: FLOP/s (model.flops_per_token) as a fraction of the 2048^3 matmul and of
   the step's own matmul mix; no host transfer in the step, no compile after the first.
3. Overheads, side by side in one process: QK-Norm; the spike machinery (skip-step +
   update-norm clip) vs plain AdamW + clip; per-layer instrumentation; an orbax checkpoint every
   100 steps; layers as a scan loop vs unrolled; and the default step against itself. Each is
   printed as the median of the rounds beside the rounds' range.
4. Memory: the compiled step's temporary buffers at seq 1,024 / 2,048 / 4,096 (batch 1), blockwise
   vs dense attention (XLA's memory_analysis; nothing is run).
5. Compile time of the train step at 4 and 24 layers, scan vs unrolled; warmstart.py's conversion.

--accelerator, on one GPU: every attention form against dense float32 on that device; the bf16
8192^3 matmul and the step's own matmul shapes on random operands; the step with cudnn, blockwise
and cudnn + QK-Norm attention, one after the other in one process.
"""

import contextlib
import dataclasses
import io
import itertools
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import attention as A
import checkpoint as C
import model as M
import optim as O
import train as T
import warmstart as W
from bench import peer
from cli import HEAP, command, entry_point, parse
from config import PRESETS, TrainConfig, config_from_dict, make_tx
from data import DataConfig
from distributed import MeshConfig, make_mesh
from lab import harness as S
from lab.rows import STORY
from lab.store import cpu_label, machine

SEQ_LENS = (128, 256, 512, 1024)
TOKENS_PER_STEP = 4096
MEMORY_SEQ_LENS = (1024, 2048, 4096)
CHECKPOINT_EVERY = 100


def plain_adamw(cfg: O.OptimConfig, total_steps: int, mask):
    return optax.with_extra_args_support(optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask),
        optax.scale_by_learning_rate(O.lr_schedule(cfg, total_steps))))


COMPILES = []  # XLA compilations seen while timing (there should be none after the first step)


def count_compile(event: str, duration_secs: float, **kwargs):
    if "backend_compile" in event:
        COMPILES.append(event)


def matmul_fn(kind: str):
    """The three shapes a projection's matmul takes in a train step, as XLA sees them."""
    return {"forward": lambda x, w: x @ w,  # [m, k] x [k, n]
            "input_grad": lambda dy, w: dy @ w.T,  # [m, n] x [k, n]^T
            "weight_grad": lambda x, dy: x.T @ dy}[kind]  # [m, k]^T x [m, n], over the tokens


def operand_shapes(kind, m, k, n) -> tuple:
    """The two operands' shapes of matmul_fn(kind) for an [m, k] x [k, n] projection."""
    return {"forward": ((m, k), (k, n)), "input_grad": ((m, n), (k, n)),
            "weight_grad": ((m, k), (m, n))}[kind]


def matmul_operands(kind, m, k, n, dtype=jnp.float32, key=None):
    """Constant operands, or normal random ones given a key (a GPU multiplies constants faster
    than data, so its rates are measured on random operands)."""
    shapes = operand_shapes(kind, m, k, n)
    if key is None:
        return [jnp.full(s, 0.5, dtype) for s in shapes]
    return [jax.random.normal(jax.random.fold_in(key, i), s, dtype) for i, s in enumerate(shapes)]


def projection_shapes(cfg) -> dict:
    """name -> (matmuls per step, m, k, n): the projections as model.py computes them, each
    as a forward, an input-gradient and a weight-gradient matmul."""
    m, tokens = cfg.model, cfg.data.batch_size * cfg.data.seq_len
    H, L = m.head_dim, m.n_layers
    proj = {"q": (L, m.d_model, m.n_heads * H), "k/v": (2 * L, m.d_model, m.n_kv_heads * H),
            "o": (L, m.n_heads * H, m.d_model), "gate/up": (2 * L, m.d_model, m.d_ff),
            "down": (L, m.d_ff, m.d_model), "head": (1, m.d_model, m.vocab_size)}
    return {f"{name}/{kind}": (count, tokens, k, n) for name, (count, k, n) in proj.items()
            for kind in ("forward", "input_grad", "weight_grad")}


def compiled_matmuls(shapes: dict, dtype=jnp.float32, key=None, torch=False) -> dict:
    """name -> (compiled matmul, operands, FLOPs) for each name "<...>/<kind>": (count, m, k, n),
    compiled and run once; with torch, eager torch's matmuls on float32 constants instead."""
    fns = {}
    for name, (_, m, k, n) in shapes.items():
        kind = name.split("/")[-1]
        if torch:
            f = matmul_fn(kind)
            operands = [peer.torch.full(s, 0.5) for s in operand_shapes(kind, m, k, n)]
        else:
            f, operands = jax.jit(matmul_fn(kind)), matmul_operands(kind, m, k, n, dtype, key)
        jax.block_until_ready(f(*operands))
        fns[name] = (f, operands, 2 * m * k * n)
    return fns


def time_matmuls(fns, budget_s=0.15, rate_guess: float | None = 150e9) -> dict:
    """FLOP/s of each (f, operands, flops), timed for about budget_s each (the repetitions
    from rate_guess, or from one timed call)."""
    rates = {}
    for name, (f, args, flops) in fns.items():
        if rate_guess is None:
            t = time.perf_counter()
            f(*args).block_until_ready()
            reps = max(3, int(budget_s / (time.perf_counter() - t)))
        else:
            reps = max(1, int(budget_s * rate_guess / flops))
        t = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        rates[name] = flops * reps / (time.perf_counter() - t)
    return rates


def worker() -> None:
    """One variant in its own process: set up from a JSON line on stdin, then answer each
    line "n" with one timing; replies are the stdout lines that start with "@"."""
    def reply(value):
        print("@" + json.dumps(value), flush=True)
    spec = json.loads(sys.stdin.readline())
    jax.monitoring.register_event_duration_secs_listener(count_compile)
    if spec["kind"] in ("matmul", "torch_matmul"):
        fns = compiled_matmuls(spec["shapes"], torch=spec["kind"] == "torch_matmul")
        reply("ready")
        for _ in sys.stdin:
            reply(time_matmuls(fns))
        return
    if spec["kind"] == "torch":  # bench/peer.py's eager step
        cfg = config_from_dict(spec["config"])
        run = peer.timer(cfg, bench_tokens(cfg))
        reply({"first_step_s": run.first_step_s})
        for line in sys.stdin:
            reply(with_faults(run, int(line)) if spec.get("faults") else run(int(line)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if spec["kind"] == "step":
            timer = variant_timer(spec, pathlib.Path(tmp) / "a")
            reply({"first_step_s": timer.first_step_s})
            for line in sys.stdin:
                reply(with_faults(timer, int(line)) if spec.get("faults") else timer(int(line)))
            return
        # "pair": two variants side by side in this one process, alternately first
        a, b = (variant_timer(s, pathlib.Path(tmp) / n) for s, n in zip(spec["pair"], "ab"))
        reply({"first_step_s": a.first_step_s})
        for i, line in enumerate(sys.stdin):
            n = int(line)
            if i % 2:  # b first on odd turns: neither always runs right after the other
                tb, ta = b(n), a(n)
            else:
                ta, tb = a(n), b(n)
            reply([ta, tb])


def with_faults(run, n: int) -> dict:
    """run(n)'s seconds a step, with the minor page faults a step and this process's peak
    memory so far (getrusage)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = run(n)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_s": seconds, "faults_per_step": (usage.ru_minflt - before) / n,
            "peak_rss_mb": usage.ru_maxrss / 1024}


def bench_tokens(cfg) -> np.ndarray:
    """The one batch every timed step trains on, [B, T+1] random tokens (fixed RNG)."""
    return np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1)).astype(np.int32)


def variant_timer(spec: dict, tmp: pathlib.Path):
    """run(n) -> seconds per step over n steps of spec's variant, after one compiling step: its
    own state and compiled step; with "save", one async orbax save before the n steps (its
    blocking part and what the writer thread takes from those steps)."""
    cfg = config_from_dict(spec["config"])
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(bench_tokens(cfg), jax.NamedSharding(mesh, jax.P("data")))
        decayed = M.optimizer_layout(cfg.model)["decay_mask"]
        tx = plain_adamw(cfg.optim, cfg.steps, decayed) if spec["plain_adamw"] else make_tx(cfg)
        t = time.perf_counter()
        state = C.fresh_state(cfg.model, cfg.seed, tx, C.abstract_state(cfg.model, tx, mesh))
        step = T.make_train_step(cfg, tx)
        state, m = step(state, tokens)
        jax.block_until_ready(m)
        first_step_s = time.perf_counter() - t
    mngr = C.checkpoint_manager(tmp, 2) if spec["save"] else None
    saves = itertools.count()

    def run(n):
        nonlocal state, m
        seen = len(COMPILES)
        with jax.set_mesh(mesh):
            t = time.perf_counter()
            if mngr is not None:
                C.save_checkpoint(mngr, next(saves), state, spec["config"])
            with jax.transfer_guard("disallow"):  # raises on any implicit host<->device transfer
                for _ in range(n):
                    state, new = step(state, tokens)
                    if spec["read"]:  # as train.py's Log: step s-1's metrics once s is queued
                        jax.device_get(m)
                    m = new
                jax.block_until_ready(m)
            elapsed = (time.perf_counter() - t) / n
            if mngr is not None:
                mngr.wait_until_finished()
        assert len(COMPILES) == seen, "the train step recompiled after its first call"
        return elapsed
    run.first_step_s = first_step_s
    return run


class Worker:
    def __init__(self, name: str, spec: dict, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.bench", "--worker"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **(env or {})})
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()

    def wait_ready(self):
        self.ready = self.read()

    def read(self):
        for line in self.proc.stdout:
            if line.startswith("@"):
                return json.loads(line[1:])
        raise RuntimeError(f"bench worker {self.name} exited with status {self.proc.wait()}")

    def time(self, n: int):
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def cpu_busy_seconds() -> float:
    """CPU-seconds all processes on this machine have used since boot (/proc/stat)."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds of this process and of its finished (waited-for) children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def other_cpu(r: dict, wall: float, busy: float, own: float) -> None:
    """r["other_processes_cpu_fraction"]: the share of the machine's CPU other processes took
    since (wall, busy, own) were read; a warning above 5%."""
    other = (cpu_busy_seconds() - busy) - (own_cpu_seconds() - own)
    r["other_processes_cpu_fraction"] = other / ((time.perf_counter() - wall) * os.cpu_count())
    if r["other_processes_cpu_fraction"] > 0.05:
        print(f"WARNING: other processes used {r['other_processes_cpu_fraction']:.0%} of the "
              "CPU while the steps were timed: these figures are not from an idle machine")


def write_json(r: dict, out: str) -> None:
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {path}")


def step_spec(c, plain_adamw=False, save=False, read=False) -> dict:
    """A step variant for variant_timer (and a worker): config c, optionally with plain AdamW
    + clip instead of make_tx's chain, with an orbax save before each turn, or reading each
    step's metrics to the host as train.py's loop does."""
    return {"kind": "step", "config": dataclasses.asdict(c), "plain_adamw": plain_adamw,
            "save": save, "read": read}


def variant_specs(cfg, seq_lens) -> dict:
    """name -> worker spec: every attention form at every length, each in its own process; the
    overheads as pairs, each pair in one process (the default step against the variant)."""
    def pair(a, b):
        return {"kind": "pair", "pair": [a, b]}

    def at(seq, **model):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model),
                                   data=dataclasses.replace(cfg.data, seq_len=seq,
                                                            batch_size=TOKENS_PER_STEP // seq))
    specs = {f"{form}@{seq}": step_spec(at(seq, attention=form)) for seq in seq_lens
             for form in ("dense", "grouped", "blockwise")}
    seq = seq_lens[0]
    base = at(seq, attention=A.resolve("auto", cfg.model.dtype))
    specs.update({
        "qk_norm": pair(step_spec(base), step_spec(dataclasses.replace(
            base, model=dataclasses.replace(base.model, qk_norm=True)))),
        "per_layer_instrumentation": pair(step_spec(dataclasses.replace(
            base, per_layer_metrics=False)), step_spec(base)),
        "spike_machinery_vs_plain_adamw": pair(step_spec(base, plain_adamw=True), step_spec(
            dataclasses.replace(base, optim=dataclasses.replace(base.optim, skip_step=True,
                                                                update_clip="norm")))),
        "checkpoint": pair(step_spec(base), step_spec(base, save=True)),
        "scan_instead_of_unrolled": pair(step_spec(base), step_spec(dataclasses.replace(
            base, model=dataclasses.replace(base.model, scan_layers=True)))),
        # the default step against itself: how far apart two identical steps come out in one
        # process, the floor under every overhead above
        "same_step_twice": pair(step_spec(base), step_spec(base))})
    return specs


def run_rounds(cfg, seq_lens, rounds: int, steps_per_turn: int) -> dict:
    """Start one process per variant or pair (and one for the matmuls), then time them in
    turns."""
    specs = {"matmuls": {"kind": "matmul", "shapes": {
        "2048^3/forward": (1, 2048, 2048, 2048), **projection_shapes(cfg)}}}
    specs.update(variant_specs(cfg, seq_lens))
    workers = {}
    names = list(specs)
    for i in range(0, len(names), 2):  # two at a time: a compile keeps about one core busy
        print(f"  starting {', '.join(names[i:i + 2])} ({i + 1}/{len(names)}): compile and "
              "one step", flush=True)
        started = [Worker(name, specs[name]) for name in names[i:i + 2]]
        for w in started:
            w.wait_ready()
            workers[w.name] = w
    times = {name: [] for name in workers}
    try:
        for r in range(rounds):
            t = time.perf_counter()
            for name, w in workers.items():  # interleaved: drift hits every variant alike
                times[name].append(w.time(steps_per_turn))
            print(f"  round {r + 1}/{rounds}: {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        for w in workers.values():
            w.close()
    rates = times.pop("matmuls")
    pairs = {name: t for name, t in times.items() if specs[name]["kind"] == "pair"}
    return {"step_s": {name: statistics.median(t) for name, t in times.items()
                       if name not in pairs},
            # per pair: each round's variant / default time, and each round's difference
            "pair_ratios": {name: [b / a for a, b in t] for name, t in pairs.items()},
            "pair_differences_s": {name: [b - a for a, b in t] for name, t in pairs.items()},
            "matmul_flops": {k: statistics.median(r[k] for r in rates) for k in rates[0]},
            "first_step_s": {name: w.ready["first_step_s"] for name, w in workers.items()
                             if name != "matmuls"}}


def matmul_mix_rate(cfg, rates: dict) -> float:
    """The FLOP rate of the step's own matmuls: their FLOPs over the time they took alone."""
    shapes = projection_shapes(cfg)
    flops = sum(count * 2 * m * k * n for count, m, k, n in shapes.values())
    return flops / matmul_seconds(shapes, rates)["all"]


def matmul_seconds(shapes: dict, rates: dict) -> dict:
    """Seconds a step spends in the projections' matmuls of each kind (forward, input_grad,
    weight_grad) and in all of them, at the measured rates (each matmul timed alone)."""
    out = {}
    for name, (count, m, k, n) in shapes.items():
        for kind in (name.split("/")[-1], "all"):
            out[kind] = out.get(kind, 0.0) + count * 2 * m * k * n / rates[name]
    return out


def temp_memory(cfg, seq: int, form: str) -> int:
    """Bytes of temporary buffers XLA allocates for the compiled train step (batch 1)."""
    c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=form),
                            data=dataclasses.replace(cfg.data, seq_len=seq, batch_size=1))
    mesh = make_mesh(c.mesh)
    tx = make_tx(c)
    with jax.set_mesh(mesh):
        state = C.abstract_state(c.model, tx, mesh)
        tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32,
                                      sharding=jax.NamedSharding(mesh, jax.P("data")))
        compiled = T.make_train_step(c, tx).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def compile_seconds(cfg) -> float:
    mesh = make_mesh(cfg.mesh)
    tx = make_tx(cfg)
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
        tx = make_tx(src)
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
                W.convert_checkpoint(tmp / "src", 100, src, qk, mesh, tmp / f"surgery{i}", None)
                convert.append(time.perf_counter() - t)
            t = time.perf_counter()  # the whole command: + data, held-out losses, report
            with contextlib.redirect_stdout(io.StringIO()):  # its report, not bench's
                W.convert(W.WarmStartArgs(source=str(tmp / "src"), to=str(tmp / f"new{i}"),
                                          no_train=True), [])
            command.append(time.perf_counter() - t)
    p, c = statistics.median(plain), statistics.median(convert)
    return {"restore_save_s": p, "convert_s": c, "convert_over_restore_save": c / p,
            "warmstart_command_s": statistics.median(command)}


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    rounds: int = 7  # turns per variant (figures are medians over them)
    steps_per_turn: int = 3  # steps each process times in its turn
    story: bool = False  # where the story preset's step time goes (~5 minutes)
    harness: bool = False  # the harness per member-step (~10 minutes)
    against: str | None = None  # with --harness: an older checkout whose harness to time too
    accelerator: bool = False  # one GPU instead: a 0.9B model at seq 4,096 in bfloat16
    torch: bool = False  # train.py's step beside eager PyTorch's (bench/peer.py), ~3 minutes
    allocator: bool = False  # glibc malloc's settings against its default, ~6 minutes
    # the results file (default bench/results.json; bench/results-story.json with --story,
    # bench/results-gpu.json with --accelerator)
    out: str | None = None
    worker: bool = False  # internal: a timed variant's own process (bench.py starts them)
    harness_worker: bool = False  # internal: one of --harness's two pinned processes


@command
def main(argv: list[str]) -> int:
    args = parse(BenchArgs, argv, description=__doc__, prog="python -m bench.bench")
    if args.worker:
        return worker()
    if args.harness:
        return harness_main(args)
    if args.accelerator:
        return accelerator_main(args)
    if args.story:
        return story_main(args)
    if args.torch:
        return torch_main(args)
    if args.allocator:
        return allocator_main(args)
    cfg = PRESETS["cpu"]
    load = os.getloadavg()[0]
    wall, busy, own = time.perf_counter(), cpu_busy_seconds(), own_cpu_seconds()
    r = {"machine": machine() | {"cpus": os.cpu_count(), "devices": str(jax.devices())},
         "preset": "cpu", "tokens_per_step": TOKENS_PER_STEP, "rounds": args.rounds}
    if load > 0.5:
        print(f"note: load average {load:.1f} at the start: let other work finish first")
    print(f"1/4 timing the step variants and the matmuls, each in its own process, in turns "
          f"({args.rounds} rounds)")
    timed = run_rounds(cfg, SEQ_LENS, args.rounds, args.steps_per_turn)
    steps, rates = timed["step_s"], timed["matmul_flops"]
    r.update(timed)

    seq0 = SEQ_LENS[0]
    auto = {seq: A.resolve("auto", cfg.model.dtype) for seq in SEQ_LENS}
    r["tokens_per_s"] = {f"{form}@{seq}": TOKENS_PER_STEP / steps[f"{form}@{seq}"]
                         for seq in SEQ_LENS for form in ("dense", "grouped", "blockwise")}
    r["tokens_per_s"].update({f"auto@{seq}": r["tokens_per_s"][f"{auto[seq]}@{seq}"]
                              for seq in SEQ_LENS})
    tps = r["tokens_per_s"]
    default = steps[f"{auto[seq0]}@{seq0}"]
    flops = M.flops_per_token(cfg.model, seq0) * TOKENS_PER_STEP / default
    mix = matmul_mix_rate(cfg, rates)
    r["train_step"] = {
        "attention": auto[seq0], "tokens_per_s": TOKENS_PER_STEP / default, "flops": flops,
        "flops_counted_as": "6N per token + 6 L T D (causal attention), model.flops_per_token",
        "matmul_2048_flops": rates["2048^3/forward"], "matmul_mix_flops": mix,
        "mfu_vs_matmul_2048": flops / rates["2048^3/forward"], "mfu_vs_matmul_mix": flops / mix,
        "compiles_after_first_step": 0,  # variant_timer asserts it
        "device_to_host_transfers_in_step": 0}  # transfer_guard would have raised
    r["targets"] = {
        "seq_1024_over_seq_128": tps[f"auto@{SEQ_LENS[-1]}"] / tps[f"auto@{seq0}"],
        "mfu_vs_matmul_mix": flops / mix}
    ratios = timed["pair_ratios"]
    median = {name: statistics.median(x) - 1 for name, x in ratios.items()}
    # a save's cost: the pair's step-time difference over the turn's steps
    ckpt_s = statistics.median(timed["pair_differences_s"]["checkpoint"]) * args.steps_per_turn
    floor = [abs(x - 1) for x in ratios["same_step_twice"]]
    r["overheads"] = {
        **{name: median[name] for name in ("qk_norm", "spike_machinery_vs_plain_adamw",
                                           "per_layer_instrumentation",
                                           "scan_instead_of_unrolled")},
        f"checkpoint_every_{CHECKPOINT_EVERY}_steps": ckpt_s / (CHECKPOINT_EVERY * default),
        "checkpoint_save_s": ckpt_s,
        "same_step_twice": median["same_step_twice"],
        "same_step_twice_largest_round": max(floor)}
    other = (cpu_busy_seconds() - busy) - (own_cpu_seconds() - own)
    r["other_processes_cpu_fraction"] = other / ((time.perf_counter() - wall) * os.cpu_count())

    print("2/4 compiling for memory (seq " + ", ".join(map(str, MEMORY_SEQ_LENS)) + ")")
    r["temp_memory_bytes"] = {f"{form}@{seq}": temp_memory(cfg, seq, form)
                              for form in ("blockwise", "dense") for seq in MEMORY_SEQ_LENS}
    mem = r["temp_memory_bytes"]
    r["targets"]["blockwise_memory_growth_per_doubling"] = max(
        mem[f"blockwise@{b}"] / mem[f"blockwise@{a}"]
        for a, b in zip(MEMORY_SEQ_LENS, MEMORY_SEQ_LENS[1:]))
    print("3/4 compile times: 4 and 24 layers, scan and unrolled")
    r["compile_s"] = {f"layers_{n}_{'scan' if scan else 'unrolled'}": compile_seconds(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n,
                                                           scan_layers=scan)))
        for n in (4, 24) for scan in (True, False)}
    print("4/4 warm-start conversion")
    r["warmstart"] = bench_warmstart(cfg)
    report(r)
    out = pathlib.Path(args.out or "bench/results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {out}")


def report(r: dict) -> None:
    t, o, c, w, g = r["train_step"], r["overheads"], r["compile_s"], r["warmstart"], r["targets"]
    tps, mem = r["tokens_per_s"], r["temp_memory_bytes"]
    print(f"\ntokens/s, {r['tokens_per_step']:,} tokens per step (preset cpu's model):")
    print(f"{'seq':>6} " + "".join(f"{f:>11}" for f in ("dense", "grouped", "blockwise", "auto")))
    for seq in SEQ_LENS:
        print(f"{seq:>6} " + "".join(f"{tps[f'{f}@{seq}']:>11,.0f}"
                                     for f in ("dense", "grouped", "blockwise", "auto")))
    print(f"seq {SEQ_LENS[-1]} / seq {SEQ_LENS[0]} (auto): {g['seq_1024_over_seq_128']:.2f}x "
          "(target >= 0.65x)")
    print(f"\ntrain step at seq {SEQ_LENS[0]} ({t['attention']} attention): "
          f"{t['tokens_per_s']:,.0f} tokens/s, {t['flops'] / 1e9:.0f} GFLOP/s = "
          f"{t['mfu_vs_matmul_mix']:.0%} of its own matmul mix ({t['matmul_mix_flops'] / 1e9:.0f}"
          f" GFLOP/s; target >= 70%), {t['mfu_vs_matmul_2048']:.0%} of the 2048^3 matmul "
          f"({t['matmul_2048_flops'] / 1e9:.0f} GFLOP/s); no recompilation, no host transfer")
    print("overheads, each against the default step in the same process: the median of the "
          "rounds (and their range; a target finer than the range is not resolved here)")
    rows = {"qk_norm": ("QK-Norm", "<= 3%"),
            "spike_machinery_vs_plain_adamw": ("spike machinery vs plain AdamW+clip", "<= 3%"),
            "per_layer_instrumentation": ("per-layer instrumentation", "<= 5%"),
            "scan_instead_of_unrolled": ("layers as a scan loop instead of unrolled", ""),
            "same_step_twice": ("the default step against itself (the floor)", "")}
    for name, (what, target) in rows.items():
        rounds = r["pair_ratios"][name]
        print(f"  {what:<44} {o[name]:+6.1%}  ({min(rounds) - 1:+.1%} .. {max(rounds) - 1:+.1%})"
              + (f"  target {target}" if target else ""))
    print(f"  {f'a checkpoint every {CHECKPOINT_EVERY} steps':<44} "
          f"{o[f'checkpoint_every_{CHECKPOINT_EVERY}_steps']:+6.1%}  ({o['checkpoint_save_s']:.2f}"
          " s a save)  target <= 5%")
    print("temporary memory of the compiled step, batch 1: " + ", ".join(
        f"seq {seq} blockwise {mem[f'blockwise@{seq}'] / 2**20:.0f} MiB / dense "
        f"{mem[f'dense@{seq}'] / 2**20:.0f} MiB" for seq in MEMORY_SEQ_LENS)
        + f"; blockwise grows {g['blockwise_memory_growth_per_doubling']:.2f}x per doubling "
        "(target <= 2.3x)")
    print("compile: " + ", ".join(f"{k} {v:.1f} s" for k, v in c.items()))
    print(f"warm-start conversion vs restore+save: {w['convert_s']:.2f} s vs "
          f"{w['restore_save_s']:.2f} s ({w['convert_over_restore_save']:.2f}x); the whole "
          f"command with its held-out loss report: {w['warmstart_command_s']:.2f} s")
    busy = r["other_processes_cpu_fraction"]
    if busy > 0.05:
        print(f"WARNING: other processes used {busy:.0%} of the CPU while the steps were "
              "timed: these figures are not from an idle machine")
    else:
        print(f"other processes used {max(busy, 0):.1%} of the CPU while the steps were timed")


# ---------------------------------------------------------------------------------------------
# bench.py --accelerator: one GPU chip, in the 16-bit compute dtype it trains in

# ~0.9B parameters at Marin's sequence length: 32,768 tokens a step, batch 8 x seq 4,096. The
# vocabulary is a BPE-sized 32,768 (the tokens are random: a speed benchmark).
ACCELERATOR = TrainConfig(
    model=M.ModelConfig(vocab_size=32_768, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                        d_ff=5632, rope_theta=500_000.0, dtype="bfloat16"),
    data=DataConfig(seq_len=4096, batch_size=8), steps=1000)
# The forms' check: a small model, several key blocks (blockwise loops), on the same device.
CHECK = M.ModelConfig(vocab_size=1024, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4,
                      d_ff=1376, qk_norm=True, attention_block=256)
CHECK_SHAPE = (2, 1024)  # batch, seq
PEAK = 8192  # the peak matmul: PEAK^3


def form_errors(model_cfg: M.ModelConfig, dtype: str) -> dict:
    """form -> relative error of the loss, the gradients and the max |attention logit| in
    `dtype`, against the dense form in float32 (errors relative to the largest reference value:
    a 16-bit dtype rounds at about 4e-3)."""
    forms = [f for f in A.FORMS if f != "auto"
             and (f != "cudnn" or jax.default_backend() == "gpu")]
    B, T = CHECK_SHAPE
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, model_cfg.vocab_size)
    params = M.init_params(model_cfg, jax.random.key(1))

    def run(form, dt):
        c = dataclasses.replace(model_cfg, attention=form, dtype=dt)
        f = jax.jit(jax.value_and_grad(lambda p: M.loss_fn(p, tokens, c), has_aux=True))
        (loss, aux), grads = f(params)
        return jax.device_get((loss, aux["attn_logit_max"], grads))

    def rel(x, ref):
        x, ref = np.concatenate([np.ravel(a) for a in x]), np.concatenate(
            [np.ravel(a) for a in ref])
        return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))

    with jax.set_mesh(make_mesh(MeshConfig())):
        ref = run("dense", "float32")
        errors = {}
        for form in forms:
            try:
                loss, logit_max, grads = run(form, dtype)
            except Exception as e:  # reported, and the benchmark goes on
                errors[form] = {"error": str(e)[:2000]}
                continue
            errors[form] = {"loss": rel([loss], [ref[0]]), "attn_logit_max": rel(
                [logit_max], [ref[1]]), "grads": rel(jax.tree.leaves(grads),
                                                     jax.tree.leaves(ref[2]))}
    return errors


def accelerator_steps(cfg: TrainConfig, rounds: int, steps_per_turn: int) -> dict:
    """Each variant's step in turn, in this process (a GPU step does not share cores with the
    other compiled steps): seconds per step (median of the rounds), compile + first step, and
    the device's peak memory so far."""
    base = dataclasses.replace(cfg.model, attention=A.resolve("auto", cfg.model.dtype))
    variants = {base.attention: base, "blockwise": dataclasses.replace(base,
                                                                        attention="blockwise"),
                f"{base.attention}+qk_norm": dataclasses.replace(base, qk_norm=True)}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in variants.items():
            print(f"  {name}: compile and one step", flush=True)
            try:
                timer = variant_timer(step_spec(dataclasses.replace(cfg, model=model)),
                                      pathlib.Path(tmp) / name)
                times = [timer(steps_per_turn) for _ in range(rounds)]
            except Exception as e:  # one variant failing (out of memory) leaves the others
                print(f"  {name} failed: {e}", flush=True)
                out[name] = {"error": str(e)[:2000]}
                continue
            stats = jax.local_devices()[0].memory_stats() or {}
            out[name] = {"step_s": statistics.median(times), "rounds_s": times,
                         "first_step_s": timer.first_step_s,
                         "peak_bytes_in_use": stats.get("peak_bytes_in_use")}
            print(f"  {name}: {out[name]['step_s']:.3f} s a step", flush=True)
            del timer  # frees its state before the next variant's
    return out


def accelerator_main(args) -> int:
    if jax.default_backend() == "cpu":
        print("error: bench.py --accelerator needs a GPU or TPU, and JAX sees only the CPU: "
              "run plain `python -m bench.bench` here", file=sys.stderr)
        return 2
    cfg, dtype = ACCELERATOR, jnp.dtype(ACCELERATOR.model.dtype)
    out = pathlib.Path(args.out or f"bench/results-{jax.default_backend()}.json")
    device = jax.local_devices()[0]
    r = {"machine": {"device": device.device_kind, "platform": platform.platform(),
                     "jax": jax.__version__, "devices": str(jax.devices())},
         "config": dataclasses.asdict(cfg),
         "params": M.count_params(cfg.model)}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=2) + "\n")

    print(f"1/3 every attention form in {cfg.model.dtype} against dense float32 "
          f"(seq {CHECK_SHAPE[1]}, GQA, QK-Norm)", flush=True)
    r["form_errors"] = form_errors(CHECK, cfg.model.dtype)
    for form, e in r["form_errors"].items():
        print(f"  {form:>10}: " + (f"failed: {e['error']}" if "error" in e else
              f"loss {e['loss']:.1e}, gradients {e['grads']:.1e}, max logit "
              f"{e['attn_logit_max']:.1e}"), flush=True)
    save()
    print(f"2/3 {cfg.model.dtype} matmuls: {PEAK}^3 and the step's own shapes", flush=True)
    fns = compiled_matmuls({"peak/forward": (1, PEAK, PEAK, PEAK), **projection_shapes(cfg)},
                           dtype, jax.random.key(0))
    fns["peak/constant_operands"] = (fns["peak/forward"][0], matmul_operands(
        "forward", PEAK, PEAK, PEAK, dtype), 2 * PEAK**3)
    rates = [time_matmuls(fns, 0.3, None) for _ in range(3)]
    r["peak_matmul"] = f"{PEAK}^3"
    r["matmul_flops"] = {k: statistics.median(x[k] for x in rates) for k in rates[0]}
    del fns
    peak, mix = r["matmul_flops"]["peak/forward"], matmul_mix_rate(cfg, r["matmul_flops"])
    print(f"  {PEAK}^3: {peak / 1e12:.0f} TFLOP/s (constant operands "
          f"{r['matmul_flops']['peak/constant_operands'] / 1e12:.0f}); the step's mix "
          f"{mix / 1e12:.0f} TFLOP/s", flush=True)
    save()
    tokens = cfg.data.batch_size * cfg.data.seq_len
    print(f"3/3 the train step: {r['params'] / 1e9:.2f}B parameters, seq {cfg.data.seq_len}, "
          f"{tokens:,} tokens a step, {cfg.model.dtype}", flush=True)
    steps = accelerator_steps(cfg, args.rounds, args.steps_per_turn)
    r["steps"] = steps
    save()
    steps = {name: s for name, s in steps.items() if "error" not in s}
    for name, s in steps.items():
        model = dataclasses.replace(cfg.model, qk_norm=name.endswith("qk_norm"))
        flops = M.flops_per_token(model, cfg.data.seq_len) * tokens / s["step_s"]
        s.update(tokens_per_s=tokens / s["step_s"], flops=flops, mfu_vs_matmul=flops / peak,
                 mfu_vs_matmul_mix=flops / mix)
    first = next(iter(r["steps"]))
    if {first, f"{first}+qk_norm"} <= set(steps):
        r["overheads"] = {"qk_norm": steps[f"{first}+qk_norm"]["step_s"]
                          / steps[first]["step_s"] - 1}
    save()
    print(f"\n{device.device_kind}, {cfg.model.dtype}; the {PEAK}^3 matmul {peak / 1e12:.0f} "
          f"TFLOP/s, the step's matmul mix {mix / 1e12:.0f} TFLOP/s")
    for name, s in steps.items():
        mem = s["peak_bytes_in_use"]
        print(f"  {name:>16}: {s['tokens_per_s']:>9,.0f} tokens/s, {s['flops'] / 1e12:.0f} "
              f"TFLOP/s = {s['mfu_vs_matmul']:.0%} of the {PEAK}^3 matmul, "
              f"{s['mfu_vs_matmul_mix']:.0%} of the mix; compile + first step "
              f"{s['first_step_s']:.0f} s" + (f"; peak memory {mem / 2**30:.0f} GiB so far"
                                              if mem else ""))
    if "overheads" in r:
        print(f"QK-Norm overhead {r['overheads']['qk_norm']:+.1%} (target <= 3%)")
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# bench.py --story: where the story preset's step time goes

STORY_STEPS_PER_TURN = 50  # a story step is ~1/15 of a cpu-preset step


def story_main(args) -> int:
    """The story preset's step (d_model 64, 16 x 128 tokens: a few GFLOP, so dispatch, host
    reads and bookkeeping could weigh), timed eight ways in this one process: the compiled step
    alone (no host read), without the per-layer metrics, with the q/k spectral entropy too,
    reading each step's metrics to the host as train.py's loop does, with the attention gate
    headwise and elementwise (six timers in turns, medians of the rounds); the whole train.py loop
    (batches, the metrics file, evals and checkpoints every 250 steps); the search harness per
    member-step (search.py: 3 seeds in one vmapped step, 50 steps a dispatch)."""
    jax.monitoring.register_event_duration_secs_listener(count_compile)
    cfg = PRESETS["story"]
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} at the start: let other work finish first")
    wall, busy, own = time.perf_counter(), cpu_busy_seconds(), own_cpu_seconds()
    n = STORY_STEPS_PER_TURN
    variants = {"step alone": step_spec(cfg),
                "without per-layer metrics": step_spec(dataclasses.replace(
                    cfg, per_layer_metrics=False)),
                "with the q/k spectral entropy too": step_spec(dataclasses.replace(
                    cfg, spectral_metrics=True)),
                "reading the metrics each step": step_spec(cfg, read=True),
                **{f"with the attention gate ({gate}, Marin's form)": step_spec(
                    dataclasses.replace(cfg, model=dataclasses.replace(
                        cfg.model, attn_gate=gate, attn_gate_form="marin")))
                   for gate in ("headwise", "elementwise")}}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"1/3 the compiled step, {len(variants)} ways in turns ({args.rounds} rounds of "
              f"{n} steps)", flush=True)
        timers = {name: variant_timer(spec, pathlib.Path(tmp) / str(i))
                  for i, (name, spec) in enumerate(variants.items())}
        rounds = {name: [] for name in timers}
        for r in range(args.rounds):
            order = list(timers) if r % 2 == 0 else list(timers)[::-1]
            for name in order:
                rounds[name].append(timers[name](n))
        del timers
        steps = 500
        print(f"2/3 the train.py loop: {steps} steps of `python train.py story`", flush=True)
        run = dataclasses.replace(cfg, steps=steps, run_dir=f"{tmp}/run")
        with contextlib.redirect_stdout(io.StringIO()):
            last = T.train(run).last
        loop_s = run.data.batch_size * run.data.seq_len / last["avg_tokens_per_s"]
    print("3/3 the search harness: 3 seeds, 50 and 350 steps (the difference: 300 steps, "
          "no compile)", flush=True)
    seconds = [S.train_group(dataclasses.replace(STORY, steps=k), eval_every=k,
                             log=lambda _: None)["seconds"] for k in (50, 350)]
    harness_s = (seconds[1] - seconds[0]) / (300 * len(STORY.seeds))
    other = (cpu_busy_seconds() - busy) - (own_cpu_seconds() - own)
    r = {"machine": machine() | {"cpus": os.cpu_count()},
         "preset": "story", "steps_per_turn": n, "rounds_s": rounds,
         "step_s": {name: statistics.median(t) for name, t in rounds.items()},
         "train_loop_step_s": loop_s, "harness_member_step_s": harness_s,
         "flops_per_step": M.flops_per_token(cfg.model, cfg.data.seq_len)
         * cfg.data.batch_size * cfg.data.seq_len,
         "other_processes_cpu_fraction": other / ((time.perf_counter() - wall) * os.cpu_count())}
    print(f"\nthe story preset's step ({r['flops_per_step'] / 1e9:.1f} GFLOP), ms a step "
          f"(medians of {args.rounds} rounds; their range):")
    for name, t in rounds.items():
        print(f"  {name:<48} {statistics.median(t) * 1e3:6.1f}  "
              f"({min(t) * 1e3:.1f} .. {max(t) * 1e3:.1f})")
    print(f"  {'the whole train.py loop':<48} {loop_s * 1e3:6.1f}")
    print(f"  {'the search harness, per member-step':<48} {harness_s * 1e3:6.1f}")
    if r["other_processes_cpu_fraction"] > 0.05:
        print(f"WARNING: other processes used {r['other_processes_cpu_fraction']:.0%} of the "
              "CPU while the steps were timed: these figures are not from an idle machine")
    out = pathlib.Path(args.out or "bench/results-story.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# bench.py --torch: train.py's step beside the eager PyTorch a user would write instead

TORCH_STEPS = {"cpu": 3, "story": 30}  # steps a turn: ~2 s each


GEMM_NAME = "gemm 2048^3/forward"
GEMM = {GEMM_NAME: (0, 2048, 2048, 2048)}  # the kernel's rate beside the step's own shapes


def torch_main(args) -> int:
    """train.py's step (reading each step's metrics, as its loop does) and bench/peer.py's eager
    torch step of the same model, optimizer and batch, on the cpu and story presets: each in its
    own process, taking turns; tokens/s of each and their ratio per round, medians; train.py's
    step also with glibc's own heap (ALLOCATORS; torch has it too). Beside them, what limits the
    ratio: each side's page faults a step and peak memory, the step's projection matmuls and a
    2048^3 matmul timed alone in each framework, and the CPU exactly."""
    if peer.torch is None:
        print("--torch: skipped, torch is not installed (its CPU wheel: pip install torch "
              "--index-url https://download.pytorch.org/whl/cpu)")
        return 0
    wall, busy, own = time.perf_counter(), cpu_busy_seconds(), own_cpu_seconds()
    r = {"machine": machine() | {"cpus": os.cpu_count(), "torch": peer.torch.__version__,
                                 "torch_threads": peer.torch.get_num_threads()},
         "rounds": args.rounds}
    for preset, n in TORCH_STEPS.items():
        cfg = PRESETS[preset]
        tokens = cfg.data.batch_size * cfg.data.seq_len
        print(f"{preset}: compiling train.py's step and torch's first step", flush=True)
        shapes = projection_shapes(cfg) | GEMM  # GEMM counts 0 matmuls a step: its rate alone
        spec = step_spec(cfg, read=True) | {"faults": True}
        sides = {"train.py": Worker("train.py", spec),  # its heap kept, as every entry point's
                 "train.py, glibc's heap": Worker("train.py, glibc's heap", spec,
                                                  ALLOCATORS["default"]),
                 "torch": Worker("torch", {"kind": "torch", "config": dataclasses.asdict(cfg),
                                           "faults": True}, ALLOCATORS["default"])}
        workers = [*sides.values(), Worker("xla matmuls", {"kind": "matmul", "shapes": shapes}),
                   Worker("torch matmuls", {"kind": "torch_matmul", "shapes": shapes})]
        for w in workers:
            w.wait_ready()
        rounds, matmul_rounds = [], []
        try:
            for i in range(args.rounds):  # alternately first
                order = workers if i % 2 == 0 else workers[::-1]
                rounds.append({w.name: w.time(n) for w in order})
                matmul_rounds.append([matmul_seconds(shapes, rounds[-1][k])
                                      | {"gemm": rounds[-1][k][GEMM_NAME]}
                                      for k in ("xla matmuls", "torch matmuls")])
        finally:
            for w in workers:
                w.close()
        kinds = ("forward", "input_grad", "weight_grad", "all")
        mm = {side: {kind: statistics.median(x[j][kind] for x in matmul_rounds) for kind in kinds}
              for j, side in enumerate(("xla", "torch"))}
        gemm = {side: statistics.median(x[j]["gemm"] for x in matmul_rounds)
                for j, side in enumerate(("xla", "torch"))}
        r[preset] = {"projection_matmuls_s": mm, "gemm_2048_flops": gemm, "tokens": tokens}
        for side in sides:
            ratio = [x["torch"]["step_s"] / x[side]["step_s"] for x in rounds]  # tokens/s ratio
            r[preset][side] = {k: statistics.median(x[side][k] for x in rounds)
                               for k in ("step_s", "faults_per_step", "peak_rss_mb")} | {
                "rounds_s": [x[side]["step_s"] for x in rounds],
                "ratio_to_torch": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)]}
            f = r[preset][side]
            print(f"  {side}: {f['step_s'] * 1e3:.1f} ms a step ({tokens / f['step_s']:,.0f} tok/s"
                  f"), {f['ratio_to_torch']:.2f}x torch's tokens/s (rounds {min(ratio):.2f}-"
                  f"{max(ratio):.2f}); {f['faults_per_step']:,.0f} page faults a step, peak "
                  f"{f['peak_rss_mb']:,.0f} MB", flush=True)
        print("  the projections' matmuls alone, ms a step, " + "; ".join(
            f"{kind}: XLA {mm['xla'][kind] * 1e3:.1f}, torch {mm['torch'][kind] * 1e3:.1f}"
            for kind in kinds), flush=True)
        print(f"  float32 2048^3 matmul: XLA {gemm['xla'] / 1e9:.0f} GFLOP/s, torch "
              f"{gemm['torch'] / 1e9:.0f} ({cpu_label(r['machine'])})", flush=True)
    other_cpu(r, wall, busy, own)
    write_json(r, args.out or "bench/results-torch.json")
    return 0


# ---------------------------------------------------------------------------------------------
# bench.py --allocator: XLA:CPU allocates each step's buffers with glibc's malloc, which maps
# buffers this large afresh and unmaps them when freed, so every step faults its pages in again.
# Every entry point keeps them in the heap (cli.keep_heap); against glibc's own settings, and
# transparent huge pages, each set before the process starts.

ALLOCATORS = {
    "default": {HEAP: "default"},  # glibc's own settings
    "heap-kept": {},  # the program's own: cli.keep_heap
    "huge-pages": {HEAP: "default", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
ALLOCATOR_PRESETS = {"cpu": 3, "story": 20, "cpu-long": 2}  # steps a turn


def allocator_main(args) -> int:
    """Train.py's step (reading each step's metrics) under each allocator setting, each in its
    own process, taking turns: seconds a step, page faults a step and the process's peak
    resident memory, medians over the rounds, each setting's ratio to the default per round."""
    wall, busy, own = time.perf_counter(), cpu_busy_seconds(), own_cpu_seconds()
    r = {"machine": machine(), "rounds": args.rounds, "allocators": ALLOCATORS}
    for preset, n in ALLOCATOR_PRESETS.items():
        cfg = PRESETS[preset]
        print(f"{preset}: compiling the step in {len(ALLOCATORS)} processes", flush=True)
        workers = [Worker(name, step_spec(cfg, read=True) | {"faults": True}, env)
                   for name, env in ALLOCATORS.items()]
        for w in workers:
            w.wait_ready()
        rounds = []
        try:
            for i in range(args.rounds):  # the order turns every round
                order = workers[i % len(workers):] + workers[:i % len(workers)]
                rounds.append({w.name: w.time(n) for w in order})
        finally:
            for w in workers:
                w.close()
        r[preset] = {}
        for name in ALLOCATORS:
            ratio = [x["default"]["step_s"] / x[name]["step_s"] for x in rounds]
            r[preset][name] = {
                "step_s": statistics.median(x[name]["step_s"] for x in rounds),
                "faults_per_step": statistics.median(x[name]["faults_per_step"] for x in rounds),
                "peak_rss_mb": max(x[name]["peak_rss_mb"] for x in rounds),
                "speedup": statistics.median(ratio), "speedup_range": [min(ratio), max(ratio)]}
            f = r[preset][name]
            print(f"  {name:<10} {f['step_s'] * 1e3:7.1f} ms a step, {f['speedup']:.3f}x the "
                  f"default (rounds {min(ratio):.3f}-{max(ratio):.3f}), "
                  f"{f['faults_per_step']:,.0f} faults a step, peak {f['peak_rss_mb']:,.0f} MB",
                  flush=True)
    print(f"on {cpu_label(r['machine'])}")
    other_cpu(r, wall, busy, own)
    write_json(r, args.out or "bench/results-allocator.json")
    return 0


# ---------------------------------------------------------------------------------------------
# bench.py --harness: the search harness's time per member-step

HARNESS_STEPS = 150  # 3 chunks of 50: the first compiles, the other two are timed


def harness_member_step(members: int, scan: bool) -> float:
    """Seconds per member-step of search.train_members on the story preset: the median chunk
    after the compile (batches, dispatch, compute and the host read of the metrics)."""
    g = dataclasses.replace(STORY, steps=HARNESS_STEPS, seeds=tuple(range(members)),
                            model=(("scan_layers", scan),))
    a = S.train_members(g.config(), g.seeds, chunk=50, eval_every=10**9, log=lambda _: None)
    return statistics.median(s / n for n, s in a["chunk_seconds"][1:]) / members


# An older search.py's train_group on its story group, run inside that checkout (its imports are
# its own modules): 50 and 200 steps, the difference (150 steps) has no compile.
OLDER_HARNESS = """
import dataclasses, json, search
g = search.STORY
secs = [search.train_group(dataclasses.replace(g, steps=k), eval_every=k, log=lambda _: None)
        ["seconds"] for k in (50, 200)]
print(json.dumps((secs[1] - secs[0]) / (150 * len(g.seeds))))
"""


def older_harness_member_step(checkout: pathlib.Path) -> float:
    if not (checkout / "search.py").is_file():
        raise SystemExit(f"error: --against {checkout}: no search.py there")
    out = subprocess.run([sys.executable, "-c", OLDER_HARNESS], cwd=checkout, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def harness_main(args) -> int:
    """The harness per member-step, side by side in this run: 3, 8 and 16 members with the
    story preset's unrolled layers, 8 with scanned ones; two processes of 8 members, each
    pinned to one core (their combined rate); and, with --against CHECKOUT, an older checkout's
    harness (its own modules, in a process of its own)."""
    if args.harness_worker:
        print(json.dumps(harness_member_step(8, False)))
        return 0
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} at the start: let other work finish first")
    busy, own, wall = cpu_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    r = {"machine": machine() | {"cpus": os.cpu_count()},
         "member_step_s": {}}
    for members, scan in ((3, False), (8, False), (16, False), (8, True)):
        key = f"{members} members, {'scanned' if scan else 'unrolled'}"
        print(f"  {key} ...", flush=True)
        r["member_step_s"][key] = harness_member_step(members, scan)
    print("  2 processes of 8 members, one core each ...", flush=True)
    procs = [subprocess.Popen(["taskset", "-c", str(i), sys.executable, "-m", "bench.bench",
                               "--harness", "--harness-worker"], stdout=subprocess.PIPE, text=True)
             for i in range(2)]
    each = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    r["member_step_s"]["2 pinned processes x 8 members (combined)"] = 1 / sum(1 / x for x in each)
    if args.against:
        r["member_step_s"][f"older harness ({args.against}, its story group)"] = \
            older_harness_member_step(pathlib.Path(args.against))
    print(f"\nthe search harness on the story preset, ms per member-step ({r['machine']['cpu']}):")
    for k, v in r["member_step_s"].items():
        print(f"  {k:<56} {v * 1e3:6.1f}")
    other_cpu(r, wall, busy, own)
    write_json(r, args.out or "bench/results-harness.json")
    return 0


if __name__ == "__main__":
    entry_point(main)
