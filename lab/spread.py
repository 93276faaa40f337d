"""Harness rows spread over the cores, one process pinned to each (a row repeats bitwise only
with the same cores and CPU model): whole rows, each core's one after the other (`python -m
lab.experiments ROW ...` deals them), or a row's LRs, each in a process of its own (`python -m
lab.spread ROW ... --jobs N`, for a machine with more cores than rows). An LR trains into its
row's kept folder (`python -m lab.experiments ROW@LR`); every row whose LRs are all kept is then
recorded as `python -m lab.experiments ROW` records it (its curves and results/search.json, each
process's machine under `sessions`).

    python -m lab.spread width128-mup width128-qk-mup --jobs 13   # on 13 cores or more
    python -m lab.spread width128-mup --jobs 6 --deadline 3600   # no LR starts after an hour;
                                                                 # one running then is stopped

An LR stopped at the deadline keeps its progress (each held-out evaluation) and goes on from
there the next time; a row with an LR missing is not recorded, and the same command goes on.

NOTE: on one accelerator use a few unpinned processes, float32 matmuls at full precision, and
this record's corpus (Python 3.11's standard library; SPIKEFIX_STDLIB names a copy of it):

    JAX_DEFAULT_MATMUL_PRECISION=highest XLA_FLAGS=--xla_gpu_autotune_level=0 \
    SPIKEFIX_STDLIB=/path/to/python3.11 python -m lab.spread ROW ... --jobs 5 --no-pin

Measured on an NVIDIA H200 (16 Intel Xeon cores, JAX 0.11.2) with those flags, 5 unpinned
`python -m lab.experiments ROW@LR` at a time: 26 LRs of 8 rows in 621 s (two calls), an LR of
width128-mup (3 seeds, 4,000 steps) in 173-191 s, of the d_model 32 and 64 rows in 52-103 s.
One process alone, default flags: 85-93 s a width128-mup LR, ~75 s of it start and compile;
16 processes pinned to a core each had not reached their first evaluation (step 250) in 390 s.
"""

import dataclasses
import math
import os
import pathlib
import subprocess
import sys
import time

import tyro

from cli import UserError, command, entry_point, parse
from lab.harness import SNAPSHOTS, open_keep
from lab.rows import HARNESS_ROWS, Group
from lab.store import load

# ---------------------------------------------------------------------------------------------
# Harness rows on every core (python -m lab.experiments ROW ...): one process pinned to each,
# its rows one after the other


def core_queues(groups: list[Group], cores: int) -> list[list[str]]:
    """The rows not yet recorded, dealt to at most `cores` queues, the longest first (members x
    steps x width): each to the queue with the least work so far, a fork after its source in
    the source's queue."""
    done = load()["groups"]
    todo = [g for g in groups if g.name not in done]
    queues: list[list[Group]] = [[] for _ in range(min(cores, len(todo)))]
    work = [0.0] * len(queues)

    def cost(g: Group) -> float:
        return len(g.lrs) * len(g.seeds) * g.steps * g.batch_size * g.d_model ** 2

    for g in sorted(todo, key=cost, reverse=True):
        src = next((i for i, q in enumerate(queues) if g.fork in {x.name for x in q}), None)
        i = src if src is not None else work.index(min(work))
        queues[i].append(g)
        work[i] += cost(g)
    for q in queues:  # a fork after its source (a stable sort: the rest keep their order)
        q.sort(key=lambda g: g.fork in {x.name for x in q})
    return [[g.name for g in q] for q in queues if q]


def pinned_command(core: int, module: str, args: list[str]) -> list[str]:
    """`python -m MODULE ARGS` pinned to `core` from its first line, before JAX starts its
    threads (no fork of this process, which may hold JAX's)."""
    return [sys.executable, "-c", f"import os, runpy, sys; os.sched_setaffinity(0, {{{core}}}); "
            f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', "
            "alter_sys=True)", *args]


def run_pinned(queues: list[list[str]], cores: list[int]) -> None:
    """One `python -m lab.experiments ROWS` per queue, pinned to its own core, its output in
    runs/logs/; a line here as each process prints a step or records a row."""
    logs = pathlib.Path("runs/logs")
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for core, rows in zip(cores, queues):
        log = logs / f"core{core}-{rows[0]}.log"
        procs.append((core, rows, log, subprocess.Popen(
            pinned_command(core, "lab.experiments", rows), stdout=log.open("w"),
            stderr=subprocess.STDOUT)))
        print(f"core {core}: {' '.join(rows)} (log: {log})", flush=True)
    last = {}
    while any(p.poll() is None for *_, p in procs):
        time.sleep(10)
        for core, _, log, _p in procs:
            lines = log.read_text().splitlines() or [""]
            if lines[-1] != last.get(core):
                last[core] = lines[-1]
                print(f"core {core}: {lines[-1]}", flush=True)
    failed = [(core, log) for core, _, log, p in procs if p.returncode]
    for core, log in failed:
        print(f"core {core} ended with an error: see {log}", file=sys.stderr)
    if failed:
        raise UserError(f"{len(failed)} of {len(procs)} row processes failed; each kept what it "
                        "recorded, and the same command goes on with the rest")


# ---------------------------------------------------------------------------------------------
# A row's LRs, each in a process of its own (python -m lab.spread)

@dataclasses.dataclass(frozen=True)
class Args:
    rows: tyro.conf.Positional[tuple[str, ...]]  # harness rows, their LRs run in this order
    jobs: int = 2  # LR processes at a time
    deadline: float = 0.0  # seconds from the start: no LR starts later, one running is stopped
    logs: str = "runs/logs"  # one log per LR: ROW@LR.log
    pin: bool = True  # each process on a core of its own (off on an accelerator: see NOTE)


def kept(row: str, lr: float) -> bool:
    return (SNAPSHOTS / row / f"lr{lr:g}.npz").exists()


def experiment(name: str, core: int | None) -> list[str]:
    """`python -m lab.experiments NAME`, pinned to `core` unless it is None."""
    return ([sys.executable, "-m", "lab.experiments", name] if core is None
            else pinned_command(core, "lab.experiments", [name]))


def run_spread(names: list[str], jobs: int, deadline: float, logs: pathlib.Path,
               cores: list[int] | None = None, log=print,
               argv=experiment) -> dict[str, int | None]:
    """The command `argv(name, core)` for each of `names`, `jobs` at a time, each on a free
    core of `cores` (None: unpinned), its output in logs/NAME.log; none starts after `deadline`
    seconds (0: no deadline), and one running then is stopped. Returns each name's exit status
    (None: stopped, or not started)."""
    logs.mkdir(parents=True, exist_ok=True)
    # on an accelerator each process would otherwise take 75% of its memory at its start
    env = os.environ | {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    t0, todo, running, codes = time.time(), list(names), {}, dict.fromkeys(names)
    while todo or running:
        late = deadline and time.time() - t0 > deadline
        for name, (p, _) in list(running.items()):
            if p.poll() is not None:
                codes[name] = p.returncode
                log(f"{name}: {'done' if p.returncode == 0 else f'failed ({p.returncode})'} "
                    f"at {time.time() - t0:.0f} s")
                del running[name]
            elif late:
                p.terminate()
                p.wait()
                log(f"{name}: stopped at the deadline ({deadline:g} s), its progress kept")
                del running[name]
        if late:
            break
        while todo and len(running) < jobs:
            name = todo.pop(0)
            core = None if cores is None else min(
                set(cores) - {c for _, c in running.values()})
            with open(logs / f"{name}.log", "w") as out:  # the child holds its own copy
                running[name] = (subprocess.Popen(argv(name, core), stdout=out,
                                                  stderr=subprocess.STDOUT, env=env), core)
        time.sleep(1)
    for name in todo:
        log(f"{name}: not started (the deadline)")
    return codes


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    unknown = [r for r in args.rows if r not in HARNESS_ROWS]
    if unknown:
        raise UserError(f"unknown harness row {unknown[0]!r}: python -m lab.experiments --list")
    if not args.rows:
        raise UserError("name the harness rows to spread (python -m lab.spread ROW [ROW ...])")
    if args.jobs < 1 or not 0 <= args.deadline < math.inf:
        raise UserError("--jobs must be at least 1 and --deadline a number of seconds >= 0 "
                        "(0: none)")
    rows = [HARNESS_ROWS[r] for r in args.rows if r not in load()["groups"]]
    for g in rows:  # settings.json written once, before N processes would each write it
        open_keep(g, SNAPSHOTS / g.name)
    names = [f"{g.name}@{lr:g}" for g in rows for lr in g.lrs if not kept(g.name, lr)]
    cores = sorted(os.sched_getaffinity(0))
    pinned = args.pin and args.jobs <= len(cores)  # a CPU row repeats bitwise only so pinned
    print(f"{len(names)} LRs of {len(rows)} rows, {args.jobs} at a time"
          + (", each pinned to a core of its own" if pinned else ""), flush=True)
    codes = run_spread(names, args.jobs, args.deadline, pathlib.Path(args.logs),
                       cores if pinned else None, log=lambda s: print(s, flush=True))
    whole = [g.name for g in rows if all(kept(g.name, lr) for lr in g.lrs)]
    if whole and subprocess.run([sys.executable, "-m", "lab.experiments", *whole]).returncode:
        raise UserError(f"recording {', '.join(whole)} failed (above); their LRs stay kept")
    print(f"recorded: {', '.join(whole) or 'none'}; not whole: "
          f"{', '.join(g.name for g in rows if g.name not in whole) or 'none'}")
    return 1 if any(c not in (0, None) for c in codes.values()) else 0


if __name__ == "__main__":
    entry_point(main)
