"""Experiment tracking with Weights & Biases, optional: `--wandb.project NAME`.

    python train.py --wandb.project spikefix                      # online (needs a login)
    python train.py --wandb.project spikefix --wandb.mode offline  # RUN/wandb/; `wandb sync` later

W&B gets what metrics.jsonl gets, from process 0 only and from the values the loop has already
fetched (no extra host round trip): every scalar under its own name, a per-layer array as one
scalar per layer (`attn_logit_max/layer_3`). Also the full config, the spike report at the end and
the report's figures. One run directory is one W&B run (its id comes from the directory), so a
resumed run continues the same W&B run. A warm-started run carries its source ("RUN@STEP") in
the config and as the tag `warm-start`, so the two runs can be overlaid as in Marin's report.
If W&B cannot be reached at start, training goes on: one warning, and the W&B run is written
offline instead. `wandb` is imported only when a project is given.
"""

import dataclasses
import hashlib
import os
import pathlib
import sys
from typing import Literal


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    project: str = ""  # the W&B project; "" = no W&B
    name: str = ""  # the W&B run's display name; default the run directory's name
    mode: Literal["online", "offline"] = "online"
    timeout: int = 60  # seconds to wait for W&B at start before going offline

    def __post_init__(self):
        if self.timeout <= 0:
            raise ValueError(f"wandb.timeout must be positive, got {self.timeout}")


class Tracker:
    """A W&B run, or nothing (no project, or not process 0): every method is then a no-op."""

    def __init__(self, cfg: WandbConfig, run_dir: pathlib.Path, config: dict, tags: list[str],
                 is_main: bool):
        self.run = None
        if not cfg.project or not is_main:
            return
        os.environ.setdefault("WANDB_SILENT", "true")  # our own line says where it logs
        import wandb
        kwargs = dict(project=cfg.project, name=cfg.name or run_dir.absolute().name,
                      id=hashlib.sha1(str(run_dir.absolute()).encode()).hexdigest()[:16],
                      resume="allow", dir=run_dir, config=config, tags=tags)
        settings = wandb.Settings(init_timeout=cfg.timeout, silent=True, console="off")
        try:
            self.run = wandb.init(mode=cfg.mode, settings=settings, **kwargs)
        except Exception as e:  # unreachable, or not logged in: never stop training for it
            cause = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            print(f"warning: W&B is not reachable ({cause}); logging offline to {run_dir}/wandb "
                  "instead (`wandb sync` it later)", file=sys.stderr, flush=True)
            wandb.teardown()  # the failed start still holds the run's id
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        print(f"W&B: project {cfg.project}, run {self.run.id} ({self.run.settings.mode})")

    def log(self, metrics: dict, step: int) -> None:
        if self.run is None:
            return
        flat = {}
        for k, v in metrics.items():
            if isinstance(v, list):
                flat |= {f"{k}/layer_{i}": x for i, x in enumerate(v)}
            elif k != "step":
                flat[k] = v
        self.run.log(flat, step=step)

    def finish(self, report: str = "", figures: list[pathlib.Path] = ()) -> None:
        if self.run is None:
            return
        import wandb
        if report:
            self.run.summary["spike_report"] = report
        if figures:
            self.run.log({f"figures/{p.stem}": wandb.Image(str(p)) for p in figures})
        self.run.finish()
        self.run = None
