"""The spike story at CPU scale: one train.py / warmstart.py command per experiment.

    python experiments.py                  # all of them (~1 hour on 2 cores), then the results
    python experiments.py spiky qk-norm    # some of them
    python experiments.py --list           # the command each one runs

Every experiment is exactly the command `--list` prints, run in runs/exp/NAME (a finished one is
not run again). Afterwards the results -- one row per run, read from its metrics.jsonl -- go to
results/results.json, the figures to results/*.png, and the table into README.md between the
`results` markers. Nothing in the table is typed by hand.
"""

import dataclasses
import json
import math
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tyro

from report import plot, read_metrics, summary
from cli import UserError, command, parse
from train import PRESETS

RUNS, RESULTS = pathlib.Path("runs/exp"), pathlib.Path("results")
STORY, SWEEP = "spiky-long", "spiky"  # presets: the story runs, and the LR sweep (300 steps)
RESCUE_STEP = 500  # warm-start the spiky baseline here, halfway
LR_GRID = ["1e-3", "3e-3", "1e-2", "3e-2", "1e-1", "3e-1"]  # Wortsman et al.'s grid


def experiments() -> dict[str, list[str]]:
    """name -> command line."""
    def train(name, *flags, preset=STORY):
        return [sys.executable, "train.py", preset, *flags, "--run-dir", str(RUNS / name)]
    out = {
        "spiky": train("spiky"),
        "clip-0.2": train("clip-0.2", "--optim.max-grad-norm", "0.2"),
        "skip-step": train("skip-step", "--optim.skip-step"),
        "update-clip-norm": train("update-clip-norm", "--optim.update-clip", "norm"),
        "update-clip-rms": train("update-clip-rms", "--optim.update-clip", "rms"),
        "qk-norm": train("qk-norm", "--model.qk-norm"),
        "rescue": [sys.executable, "warmstart.py", "--from", str(RUNS / "spiky"), "--to",
                   str(RUNS / "rescue"), "--step", str(RESCUE_STEP), "--rewarmup-steps", "100"],
    }
    for lr in LR_GRID:
        for qk in (False, True):
            name = f"lr{lr}{'-qk' if qk else ''}"
            out[name] = train(name, "--optim.lr", lr, *(["--model.qk-norm"] if qk else []),
                              preset=SWEEP)
    return out


def finished(name: str) -> bool:
    run = RUNS / name
    if not (run / "metrics.jsonl").is_file():
        return False
    steps = json.loads((run / "config.json").read_text())["steps"]
    return int(read_metrics(run)["step"][-1]) + 1 >= steps


def run(name: str, cmd: list[str]) -> int:
    if finished(name):
        print(f"[{name}] already finished in {RUNS / name}", flush=True)
        return 0
    if name == "rescue" and (RUNS / name).exists():
        raise UserError(f"{RUNS / name} holds an unfinished rescue: resume it with "
                        f"`python train.py --run-dir {RUNS / name}` and the flags in its "
                        "config.json, or remove it")
    RUNS.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    with open(RUNS / f"{name}.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    tail = (RUNS / f"{name}.log").read_text().strip().splitlines()[-1:]
    print(f"[{name}] exit {code}: {tail[0] if tail else ''}", flush=True)
    return code


def lr_sensitivity(rows: dict, qk: bool) -> float:
    """Wortsman et al.: mean over the LR grid of min(final loss, initial loss) - best final
    loss. A run that stopped early (diverged) counts at the initial loss."""
    finals = []
    for lr in LR_GRID:
        r = rows[f"lr{lr}{'-qk' if qk else ''}"]
        done = r["steps"] >= PRESETS[SWEEP].steps and math.isfinite(r["final_loss"])
        finals.append(min(r["final_loss"], r["initial_loss"]) if done else r["initial_loss"])
    return float(np.mean(finals) - min(finals))


def recovery_after_warm_start(rescue: dict, spiky: dict, start: int = RESCUE_STEP,
                              window: int = 20) -> int | None:
    """Steps after the warm start until the rescue's rolling-mean loss is back at the spiky
    run's rolling-mean loss just before it (the one-time penalty paid off); None if never."""
    def rolling(x):
        return np.convolve(x, np.ones(window) / window, mode="valid")  # [i] ends at i+window-1
    before = rolling(spiky["loss"][:start])[-1]
    after = rolling(rescue["loss"][rescue["step"] >= start])
    back = np.nonzero(after <= before)[0]
    return int(back[0]) + window - 1 if len(back) else None


def results() -> dict:
    rows, metrics = {}, {}
    for name in experiments():
        if (RUNS / name / "metrics.jsonl").is_file():
            metrics[name] = read_metrics(RUNS / name)
            rows[name] = summary(metrics[name]) | {
                "initial_loss": float(metrics[name]["loss"][0]) if name != "rescue" else
                math.nan}
    if "rescue" in rows and "spiky" in rows:
        rows["rescue"]["recovered_after"] = recovery_after_warm_start(metrics["rescue"],
                                                                      metrics["spiky"])
    grid = [f"lr{lr}{s}" for lr in LR_GRID for s in ("", "-qk")]
    if all(n in rows for n in grid):
        rows["lr_sensitivity"] = {"without_qk_norm": lr_sensitivity(rows, False),
                                  "with_qk_norm": lr_sensitivity(rows, True)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    story = [n for n in ("spiky", "clip-0.2", "skip-step", "update-clip-norm",
                         "update-clip-rms", "qk-norm", "rescue") if n in metrics]
    if story:
        plot({n: metrics[n] for n in story}, RESULTS, title="the spiky baseline, Marin's "
             "interventions, QK-Norm from scratch, and the QK-Norm rescue")
    return rows


def table(rows: dict) -> str:
    cmds = experiments()
    lines = ["| experiment | held-out loss (nats/byte) | final train loss | max attn logit "
             "(final) | spikes (never recovered) | skipped | command |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if name == "lr_sensitivity":
            continue
        extra = (f"; back at the pre-insertion loss after {r['recovered_after']} steps"
                 if r.get("recovered_after") is not None else
                 "; never back at the pre-insertion loss" if "recovered_after" in r else "")
        lines.append(f"| {name}{extra} | {r['eval_loss']:.3f} | {r['final_loss']:.3f} | "
                     f"{r['max_attn_logit']:,.0f} ({r['final_attn_logit']:,.0f}) | "
                     f"{r['spikes']} ({r['unrecovered_spikes']}) | {r['skipped_steps']} | "
                     f"`python {' '.join(cmds[name][1:])}` |")
    if {"spiky", "qk-norm", "rescue"} <= set(rows):
        base, qk, rescue = (rows[n]["eval_loss"] for n in ("spiky", "qk-norm", "rescue"))
        def vs(a, b):
            return f"{abs(a - b):.3f} {'below' if a < b else 'above'}"
        lines.append(f"\nThe rescue's held-out loss, {rescue:.3f}, is {vs(rescue, base)} the "
                     f"spiky baseline's ({base:.3f}) and {vs(rescue, qk)} QK-Norm from scratch "
                     f"({qk:.3f}); its largest attention logit after the insertion is "
                     f"{rows['rescue']['max_attn_logit']:,.0f} (the baseline ends at "
                     f"{rows['spiky']['final_attn_logit']:,.0f}).")
    if "lr_sensitivity" in rows:
        s = rows["lr_sensitivity"]
        lines.append(f"\nLR sensitivity over {{{', '.join(LR_GRID)}}} (Wortsman et al.: mean of "
                     "min(final, initial loss) − best final loss): "
                     f"**{s['without_qk_norm']:.3f}** without QK-Norm, "
                     f"**{s['with_qk_norm']:.3f}** with it.")
    return "\n".join(lines)


def update_readme(text: str, readme: pathlib.Path = pathlib.Path("README.md")) -> None:
    start, end = "<!-- results: written by experiments.py -->", "<!-- /results -->"
    body = readme.read_text()
    if start not in body or end not in body:
        raise UserError(f"{readme} lacks the {start} ... {end} markers")
    head, rest = body.split(start)
    readme.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")


@dataclasses.dataclass(frozen=True)
class Args:
    names: tyro.conf.Positional[tuple[str, ...]] = ()  # experiments to run (default: all)
    list: bool = False  # print the commands and stop
    jobs: int = 2  # experiments run side by side


@command
def main(argv: list[str]) -> int:
    args = parse(Args, argv, description=__doc__)
    cmds = experiments()
    unknown = [n for n in args.names if n not in cmds]
    if unknown:
        raise UserError(f"unknown experiment {unknown[0]!r}: choose from {', '.join(cmds)}")
    if args.list:
        for name, cmd in cmds.items():
            print(f"{name:<18} python {' '.join(cmd[1:])}")
        return 0
    chosen = [n for n in cmds if n in args.names or not args.names]
    first = [n for n in chosen if n != "rescue"]
    with ThreadPoolExecutor(args.jobs) as pool:
        codes = dict(zip(first, pool.map(lambda n: run(n, cmds[n]), first)))
    if "rescue" in chosen:
        codes["rescue"] = run("rescue", cmds["rescue"])
    rows = results()
    text = table(rows)
    print(text)
    update_readme(text)
    print(f"wrote {RESULTS}/results.json, {RESULTS}/overview.png, "
          f"{RESULTS}/attn_logits.png and the README table")
    failed = {n: c for n, c in codes.items() if c not in (0, 1)}  # 1: stopped, diverged
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
