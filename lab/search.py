"""The story search: which small regime learns first and then spikes? Its groups (lab/rows.py's
GROUPS) are trained by the harness (lab/harness.py); every group's outcome goes to
results/search.json.

    python -m lab.search               # run the search's groups not yet in results/search.json
    python -m lab.search --list        # the search's groups and whether each is done
    python -m lab.search --summary     # the table of outcomes, every group's (no training)
    python -m lab.search --markdown    # the README's table of the search
    python -m lab.search --plot        # results/search.png and the search's table

The story's other rows (the levers, the LR sweep, the evidence, ...) run from
python -m lab.experiments ROW. The outcome of each member is judged by report.py's fixed rules
(the one-step spike rule and the level-shift rule, at their defaults: never tuned here),
counted after its parting step: the last held-out eval at which the run is within 0.05 nats of
the QK-Norm run of the same settings (lab/stats.py's first_match).
"""

import dataclasses

import numpy as np
import tyro

from cli import UserError, command, entry_point, parse
from lab.figures import (
    plot,
)
from lab.harness import run
from lab.rows import (
    GROUPS,
    REGISTRY,
    SEARCH_NAMES,
)
from lab.stats import (
    first_match,
)
from lab.store import OUT, load
from lab.tables import update_readme

# ---------------------------------------------------------------------------------------------
# Outcomes


def judge(rows: list[dict]) -> list[dict]:
    """Per (baseline group, LR): the parting step, spikes after it per seed, the QK-Norm twin's
    spikes."""
    by = {(r["group"], r["lr"], r["seed"]): r for r in rows}
    verdicts = []
    for (group, lr, seed), r in sorted(by.items()):
        if group.endswith("-qk"):
            continue
        twin = by.get((REGISTRY[group].compare_with if group in REGISTRY
                       and REGISTRY[group].compare_with else group + "-qk", lr, seed))
        s1 = twin and first_match(r["eval_loss"], twin["eval_loss"], r["eval_step"])
        after = s1 if s1 is not None else 0
        verdicts.append({
            "group": group, "lr": lr, "seed": seed, "s1": s1,
            "spikes_after_s1": sum(s >= after for s in r["spike_steps"]),
            "shifts_after_s1": sum(s >= after for s in r["shift_steps"]),
            "qk_spikes": len(twin["spike_steps"]) if twin else None,
            "eval": r["eval_loss"][-1], "qk_eval": twin["eval_loss"][-1] if twin else None,
            "max_logit": r["max_attn_logit"],
        })
    return verdicts


def story_found(verdicts: list[dict], min_spikes: int = 3) -> list[tuple[str, float]]:
    """(group, LR) where every seed has a parting step and >= min_spikes spikes after it."""
    cells: dict = {}
    for v in verdicts:
        cells.setdefault((v["group"], v["lr"]), []).append(
            v["s1"] is not None and v["spikes_after_s1"] >= min_spikes)
    return [k for k, oks in cells.items() if len(oks) >= 3 and all(oks)]


def summary(rows: list[dict]) -> str:
    verdicts = judge(rows)
    # parted: the parting step; spikes and shifts are counted after it
    lines = [f"{'group':<24} {'lr':>7} {'seed':>4} {'parted':>6} {'spikes':>6} {'shifts':>6} "
             f"{'qk spikes':>9} {'held-out':>8} {'qk':>6} {'max logit':>9}"]
    for v in verdicts:
        lines.append(f"{v['group']:<24} {v['lr']:>7.1e} {v['seed']:>4} {str(v['s1']):>6} "
                     f"{v['spikes_after_s1']:>6} {v['shifts_after_s1']:>6} "
                     f"{str(v['qk_spikes']):>9} {v['eval']:>8.3f} "
                     f"{v['qk_eval'] if v['qk_eval'] is None else round(v['qk_eval'], 3)!s:>6} "
                     f"{v['max_logit']:>9.3g}")
    found = story_found(verdicts)
    lines.append("every seed learns, then has >= 3 one-step spikes after its parting step "
                 "(these runs): "
                 + (", ".join(f"{g} at LR {lr:g}" for g, lr in found) if found else "none"))
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """One table row per group and LR: settings, spikes and level shifts per seed (after the
    parting step where the group has a QK-Norm twin), held-out loss mean ± sd, the largest
    attention logit."""
    verdicts = {(v["group"], v["lr"], v["seed"]): v for v in judge(rows)}
    cells: dict = {}
    for r in rows:
        if r["group"] in SEARCH_NAMES:  # the other rows have their own tables
            cells.setdefault((r["group"], r["lr"]), []).append(r)
    lines = ["| group | β2 | ε | warmup | LR | spikes per seed | level shifts | parting step | "
             "held-out (nats/byte) | max attn logit | spike steps |", "|---" * 11 + "|"]
    for (group, lr), members in cells.items():
        m0 = members[0]
        v = [verdicts.get((group, lr, r["seed"])) for r in members]
        s1 = ", ".join(str(x["s1"]) if x and x["s1"] is not None else "—" for x in v)
        if group.endswith("-qk") or all(x is None or x["qk_spikes"] is None for x in v):
            s1 = "no twin run" if not group.endswith("-qk") else "(the twin)"
        evals = np.array([r["eval_loss"][-1] for r in members])
        logits = [r["max_attn_logit"] for r in members]
        lines.append(
            f"| {group} | {m0['b2']} | {m0['eps']:g} | {m0['warmup_steps']} | {lr:g} | "
            f"{', '.join(str(len(r['spike_steps'])) for r in members)} | "
            f"{', '.join(str(len(r['shift_steps'])) for r in members)} | {s1} | "
            f"{evals.mean():.3f} ± {evals.std(ddof=1):.3f} | "
            f"{min(logits):,.0f}–{max(logits):,.0f} | "
            f"{'; '.join(','.join(map(str, r['spike_steps'])) or '—' for r in members)} |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class SearchArgs:
    groups: tyro.conf.Positional[tuple[str, ...]] = ()  # groups to run (default: all not done)
    list: bool = False  # the groups and whether each is done
    summary: bool = False  # the table of outcomes (no training)
    markdown: bool = False  # the README's table of the search
    plot: bool = False  # results/search.png and the search's table in results/README.md


def main(argv: list[str]) -> int:
    """The search's own groups (the story's levers, LR sweep and evidence are lab/rows.py's
    rows: python -m lab.experiments ROW)."""
    args = parse(SearchArgs, argv, description=__doc__)
    unknown = set(args.groups) - {g.name for g in GROUPS}
    if unknown:
        name = sorted(unknown)[0]
        hint = (f"a row of lab/rows.py: python -m lab.experiments {name}" if name in REGISTRY
                else "python -m lab.search --list")
        raise UserError(f"unknown search group {name!r}; {hint}")
    groups = [g for g in GROUPS if not args.groups or g.name in args.groups]
    record = load()
    rows = [r for v in record["groups"].values() for r in v["members"]]
    if args.list:
        for g in groups:
            print(f"{g.name:<28} {'done' if g.name in record['groups'] else 'to run'}")
    elif args.summary:
        print(summary(rows))
    elif args.markdown:
        print(markdown(rows))
    elif args.plot:
        print(f"wrote {plot(record, OUT.parent)}")
        update_readme(markdown(rows), part="search", writer="lab/search.py")
        print(f"wrote the search's table in {OUT.parent}/README.md")
    else:
        run(groups, report=lambda rows: print(summary(rows), flush=True))
    return 0


if __name__ == "__main__":
    entry_point(command(main))
