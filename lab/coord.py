"""The coordinate check, microsoft/mup's own validation of muP (Yang et al., Tensor Programs V,
2203.03466, §D / the package's coord_check): train the widths rows' model at d_model 32, 64
and 128 for a few steps at one LR, with the standard parametrisation and with muP (base width
32), and read the size of each coordinate as the steps go: every layer's activation RMS (the
residual stream after each block), the attention logits' max and the output logits' RMS. Under
muP they stay the same size as the width grows; under the standard parametrisation the ones the
LR moves grow with it.

    python -m lab.coord          # results/coord_check.json and results/coord_check.png

The rules, fixed before it was first run: LR 1e-2 (the widths grid's step above the best), 10
steps at that LR from step 0 (no warmup, as mup's checks), seeds 0, 1, 2 (their mean), the
widths rows' batch; a coordinate "stays" where its value at d_model 128
is within 20% of its value at 32 after the 10th step (TOLERANCE), and "grows" where it is more
than 20% larger.
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import model as M
import train as T
from checkpoint import init_state
from cli import command, entry_point, parse, written_whole
from config import make_tx
from data import TokenData
from lab.harness import one_device_mesh
from lab.rows import WIDTH_ROWS
from report import pyplot, save_figure

LR, STEPS, SEEDS, BASE = 1e-2, 10, (0, 1, 2), 32
TOLERANCE = 0.2
OUT = pathlib.Path("results/coord_check.json")


def coordinates(params, tokens_BT, cfg: M.ModelConfig) -> dict[str, float]:
    """The forward pass of model.forward, restated to read its coordinates on the way: the RMS
    of the residual stream after each block, the attention logits' max over the layers, the
    output logits' RMS."""
    x = M.scaled_embedding(params["embed"][tokens_BT], cfg)
    out, logit_max = {}, []
    for layer in range(cfg.n_layers):
        p = jax.tree.map(lambda a, i=layer: a[i], params["layers"])
        a, stats = M.attention(M.rms_norm(x, p["attn_norm"], cfg.norm_eps), p, cfg)
        x = x + a
        x = x + M.mlp(M.rms_norm(x, p["mlp_norm"], cfg.norm_eps), p)
        out[f"layer {layer} activation RMS"] = jnp.sqrt(jnp.mean(x * x))
        logit_max.append(stats["attn_logit_max"])
    logits = M.readout_input(M.rms_norm(x, params["final_norm"], cfg.norm_eps), cfg) \
        @ params["head"]
    out["attention logit max"] = jnp.max(jnp.stack(logit_max))
    out["output logit RMS"] = jnp.sqrt(jnp.mean(logits * logits))
    return out


def check(width: int, param: str, log=print) -> dict[str, list[float]]:
    """One width and parametrisation: each coordinate after each of STEPS steps, the mean over
    SEEDS."""
    g = next(r for r in WIDTH_ROWS if r.d_model == width and not r.qk_norm)
    cfg = g.config(LR)
    cfg = dataclasses.replace(cfg, steps=STEPS, model=dataclasses.replace(
        cfg.model, param=param, mup_base_width=BASE, attention="dense"),
        optim=dataclasses.replace(cfg.optim, warmup_steps=0))
    tx = make_tx(cfg)
    step = jax.jit(T.build_train_step(cfg, tx))
    read = jax.jit(lambda p, t: coordinates(p, t, cfg.model))
    runs = []
    with jax.set_mesh(one_device_mesh()):
        for seed in SEEDS:
            data = TokenData(dataclasses.replace(cfg.data, seed=seed), cfg.model.vocab_size)
            state, seen = init_state(cfg.model, seed, tx), {}
            for s in range(STEPS):
                tokens = jnp.asarray(data.batch(s))
                state, _ = step(state, tokens)
                for k, v in read(state["params"], tokens[:, :-1]).items():
                    seen.setdefault(k, []).append(float(v))
            runs.append(seen)
    log(f"d_model {width}, {param}: " + ", ".join(f"{k} {np.mean([r[k][-1] for r in runs]):.3g}"
                                                  for k in runs[0]))
    return {k: np.mean([r[k] for r in runs], axis=0).tolist() for k in runs[0]}


def verdicts(record: dict) -> dict[str, dict[str, str]]:
    """Per parametrisation and coordinate: "stays" (d_model 128's value after the last step
    within TOLERANCE of 32's), "grows" (more than TOLERANCE above) or "shrinks"."""
    out = {}
    for param, widths in record.items():
        out[param] = {}
        for k in widths["32"]:
            r = widths["128"][k][-1] / widths["32"][k][-1]
            out[param][k] = ("stays" if abs(r - 1) <= TOLERANCE else
                             "grows" if r > 1 else "shrinks") + f" (x{r:.2f})"
    return out


def plot(record: dict, out: pathlib.Path) -> pathlib.Path:
    plt = pyplot()
    keys = list(record["standard"]["32"])
    fig, axes = plt.subplots(2, len(keys), figsize=(2.6 * len(keys), 5.4), squeeze=False)
    for row, param in enumerate(("standard", "mup")):
        for ax, k in zip(axes[row], keys):
            widths = sorted(record[param], key=int)
            for t in range(STEPS):
                ax.plot([int(w) for w in widths], [record[param][w][k][t] for w in widths],
                        color=plt.cm.viridis(t / (STEPS - 1)), lw=1, marker="o", ms=3)
            ax.set_xscale("log", base=2)
            ax.set_xticks([int(w) for w in widths], widths)
            ax.set_title(f"{'muP' if param == 'mup' else 'standard'}: {k}", fontsize=8)
            ax.set_xlabel("d_model")
            ax.grid(alpha=0.3)
        axes[row, 0].set_ylabel(f"{'muP' if param == 'mup' else 'standard'} (colour: step 1-10)")
    fig.suptitle(f"coordinate check: Adam LR {LR:g}, steps 1-{STEPS}, mean of seeds "
                 f"{', '.join(map(str, SEEDS))} (muP's base width {BASE})", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, out, dpi=80)


@dataclasses.dataclass(frozen=True)
class CoordArgs:
    pass  # no flags: the rules are the constants above


@command
def main(argv: list[str]) -> int:
    parse(CoordArgs, argv, description=__doc__, prog="python -m lab.coord")
    record = {param: {str(w): check(w, param) for w in (32, 64, 128)}
              for param in ("standard", "mup")}
    with written_whole(OUT) as tmp:
        tmp.write_text(json.dumps({"rules": {"lr": LR, "steps": STEPS, "seeds": SEEDS,
                                             "base": BASE, "tolerance": TOLERANCE},
                                   "coordinates": record, "verdicts": verdicts(record)},
                                  indent=1) + "\n")
    for param, v in verdicts(record).items():
        print(f"{param}: " + "; ".join(f"{k} {x}" for k, x in v.items()))
    print(f"wrote {OUT} and {plot(record, OUT.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    entry_point(main)
