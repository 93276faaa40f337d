"""What a run records: metrics.jsonl and the progress line (`Log`), and Weights & Biases,
optional: `--wandb.project NAME`.

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
import math
import os
import pathlib
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from jax import P

from cli import drop_torn_line, fmt_time, strict_json


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


class Log:
    """metrics.jsonl (process 0) and the progress line; counts non-finite steps in a row."""

    def __init__(self, cfg, run_dir: pathlib.Path, start: int, flops_per_token: float,
                 peak_flops: float):
        """`peak_flops`: the model FLOPs a second the mesh's devices could do, 0 if unknown
        (MFU = achieved / this, PaLM's MFU)."""
        self.cfg, self.start, self.nonfinite = cfg, start, 0
        tags = (["warm-start", f"from {cfg.warm_started_from}"[-64:]] if cfg.warm_started_from
                else []) + ["init-from-hf"] * bool(cfg.init_from_hf)
        if (main := jax.process_index() == 0):
            drop_torn_line(run_dir / "metrics.jsonl", print)
        self.file = open(run_dir / "metrics.jsonl", "a") if main else None
        self.tracker = Tracker(cfg.wandb, run_dir, dataclasses.asdict(cfg), tags, main)
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        self.flops_per_token, self.peak_flops, self.main = flops_per_token, peak_flops, main
        self.t_start = self.t_prev = time.perf_counter()
        self.t_first = None  # the first record's time: the average excludes the compile
        self.since = None  # (step, time) of the first record since the compile or a rollback

    def record(self, step: int, metrics: dict) -> dict:
        now = time.perf_counter()
        self.t_first, self.since = self.t_first or now, self.since or (step, now)
        m = {"step": step, **{k: (v.tolist() if v.ndim else v.item())
                              for k, v in jax.device_get(metrics).items()},
             "tokens_per_s": self.tokens_per_step / (now - self.t_prev)}
        self.t_prev = now
        if self.file:
            self.file.write(strict_json(m) + "\n")
            self.file.flush()
        self.tracker.log(m, step)
        if step % self.cfg.log_every == 0 or "eval_loss" in m:
            # rates over the steps since the first record after the compile or the last
            # rollback (none on that record itself): never a division by zero or negative ETA
            per_step = (now - self.since[1]) / (step - self.since[0]) if self.since and \
                step > self.since[0] else None
            eta = fmt_time(per_step * max(self.cfg.steps - step - 1, 0)) if per_step else "--"
            ev = f" | eval {m['eval_loss']:.4f}" if "eval_loss" in m else ""
            rate = self.tokens_per_step / per_step if per_step else None  # tokens a second
            u = self.flops_per_token * rate / self.peak_flops if rate and self.peak_flops else 0
            mfu = f"MFU {u:.1%} | " if 0 < u < 10 else f"MFU {u:.2g}x the peak | " if u else ""
            line = (f"step {step:>6}/{self.cfg.steps} | loss {m['loss']:.4f}{ev} | "
                    f"grad {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                    f"logit max {max(m['attn_logit_max']):.1f} | "
                    f"{(step + 1) * self.tokens_per_step / 1e6:.2f}M tok | "
                    f"{f'{rate / 1e3:.1f}k' if rate else '--'} tok/s | {mfu}"
                    f"{fmt_time(now - self.t_start)} | ETA {eta}")
            if self.main:
                print(line, flush=True)
        finite = math.isfinite(m["loss"] + m["grad_norm"])
        self.nonfinite = 0 if finite else self.nonfinite + 1
        return m

    def restart(self) -> None:
        """After a rollback: no non-finite steps in a row, the rates measured anew."""
        self.nonfinite, self.since = 0, None

    def average_tokens_per_s(self, last_step: int) -> float:
        return self.tokens_per_step * (last_step - self.start) / (self.t_prev - self.t_first)


# ---------------------------------------------------------------------------------------------
# The per-layer metrics the jitted step adds (--per-layer-metrics, --spectral-metrics): cheap
# reductions of what moves before a spike

def per_layer_norms(tree: dict) -> jax.Array:
    """[L] L2 norms over the stacked per-layer leaves of a params-shaped tree."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=tuple(range(1, x.ndim)))
                        for x in jax.tree.leaves(tree["layers"])))


def per_layer_metrics(params, grads, updates, opt_state, spectral: bool = False) -> dict:
    """[L] per-layer norms of what moves before a spike (Marin: the update spikes first, in
    the lower layers): gradients, updates (and over the weights), q/k weights, Adam's moments
    and the RMS of m / sqrt(v) (Marin #1368), read from the optimizer state; with `spectral`,
    the q/k weights' spectral entropy."""
    out = {"grad_norm_per_layer": per_layer_norms(grads),
           "update_norm_per_layer": per_layer_norms(updates)}
    out["update_ratio_per_layer"] = out["update_norm_per_layer"] / per_layer_norms(params)
    out |= {f"{w}_norm": per_layer_norms({"layers": {w: params["layers"][w]}})
            for w in ("wq", "wk")}
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    if adam and jax.tree.leaves(adam[0].mu.get("layers", {})):  # (Muon: Adam has the norms)
        mu, nu = adam[0].mu, adam[0].nu
        out["adam_mu_norm_per_layer"] = per_layer_norms(mu)
        out["adam_nu_norm_per_layer"] = per_layer_norms(nu)
        ratio = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + 1e-8), mu, nu)
        count = sum(x[0].size for x in jax.tree.leaves(mu["layers"]))
        out["adam_ratio_rms_per_layer"] = per_layer_norms(ratio) / math.sqrt(count)
    if spectral:
        out |= {f"{w}_entropy": spectral_entropy(params["layers"][w]) for w in ("wq", "wk")}
    return out


def spectral_entropy(w) -> jax.Array:
    """[L] per stacked layer of w [L, D, ...]: the order-2 (Renyi) entropy of its spectrum
    over the log of its size (1 flat, 0 rank one), from the Gram matrix alone (sum p^2 =
    ||G||_F^2 / tr(G)^2; no SVD). arXiv 2606.28116 names its collapse on q/k an early warning."""
    w = w.reshape(w.shape[0], w.shape[1], -1).astype(jnp.float32)
    if jax.typeof(w).sharding.mesh.axis_names:  # (whole matrices)
        w = jax.sharding.reshard(w, P())
    gram = jnp.einsum("ldx,ldy->lxy", w, w)
    trace = jnp.trace(gram, axis1=1, axis2=2)
    purity = jnp.sum(jnp.square(gram), axis=(1, 2)) / jnp.square(trace)
    return -jnp.log(purity) / math.log(min(w.shape[1], w.shape[2]))
