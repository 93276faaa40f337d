"""The run's configuration: TrainConfig (model, optim, data, mesh, dist and the loop's
settings), the presets, and the config.json round trip.

    cfg = PRESETS["tiny"]                           # then train.py's flags override it
    cfg = load_config(run_dir)                       # what a run directory holds, checked
    check_same_run(cfg, new_cfg)                     # a UserError naming every difference

Every value is checked when a config is built, from flags or from config.json: a wrong type, a
NaN, an infinity or a value out of range is a UserError before anything is written.
"""

import dataclasses
import math
import pathlib
import types
import typing

import numpy as np
import tyro

import guard
from checkpoint import read_config, saved_steps
from cli import UserError, parse
from compat import RENAMED
from data import DataConfig, parse_ranges
from distributed import DistConfig, MeshConfig, say
from guard import GuardConfig
from hyperball import beta2_for_batch
from model import ModelConfig, nest, optimizer_layout
from optim import OptimConfig, lr_schedule, make_optimizer
from records import acted, read_events
from tracking import WandbConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    dist: DistConfig = DistConfig()
    wandb: WandbConfig = WandbConfig()  # optional experiment tracking (tracking.py)
    guard: GuardConfig = GuardConfig()  # `--guard`: roll back, replace the data, escalate
    run_dir: str = "runs/default"  # checkpoints, config.json, metrics.jsonl; a run there resumes
    steps: int = 400  # the run's length (the cpu preset's 400: a few minutes on 2 CPU cores)
    seed: int = 0  # parameter init
    log_every: int = 20  # progress line every this many steps (metrics.jsonl gets every step)
    eval_every: int = 200  # held-out loss every this many steps, and at the end
    checkpoint_every: int = 200  # steps between checkpoints (and at the end, and on Ctrl-C)
    keep_checkpoints: int = 3  # checkpoints kept in the run directory, the latest ones
    max_consecutive_nonfinite: int = 20  # stop after this many non-finite steps in a row
    # gradient accumulation (nanoGPT's gradient_accumulation_steps): the batch's gradient as
    # the sum over this many slices of it, one after another, so memory holds one slice's
    # activations; the same step to float rounding
    microbatches: int = 1
    per_layer_metrics: bool = True  # per-layer grad/update norms and q/k weight norms
    # MFU in the progress line against this many TFLOP/s a device (0: the device's datasheet
    # figure where distributed.PEAK_TFLOPS knows it; none on a CPU)
    peak_tflops: float = 0.0
    spectral_metrics: bool = False  # with them, the q/k weights' spectral entropy per layer
    resume_step: int | None = None  # resume from this checkpoint instead of the latest
    dry_run: bool = False  # print sizes and per-device bytes, allocate nothing
    device_gib: float = 0.0  # a device's memory, for --dry-run's verdict (0: the device's own)
    init_from_hf: str = ""  # start from the weights of a Hugging Face Llama / Qwen3 folder
    # "RUN@STEP": set by warmstart.py, the checkpoint it converted (not a flag to give)
    warm_started_from: tyro.conf.Suppress[str] = ""

    def __post_init__(self):
        for name in ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "max_consecutive_nonfinite", "microbatches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        rows = self.data.batch_size // self.microbatches
        if self.microbatches > 1 and (self.data.batch_size % self.microbatches
                                      or rows % max(self.mesh.data, 1)):
            raise ValueError(f"--microbatches {self.microbatches}: the batch of "
                             f"{self.data.batch_size} must split into that many slices whose "
                             f"rows divide over --mesh.data {self.mesh.data}")
        if not 0 <= self.peak_tflops < math.inf:
            raise ValueError(f"--peak-tflops must be >= 0, got {self.peak_tflops}")
        if not 0 <= self.device_gib < math.inf:
            raise ValueError(f"--device-gib must be >= 0, got {self.device_gib}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        past = [r for r in parse_ranges(self.data.replace_batches, "replace_batches")
                if r.stop > self.steps]
        if past:
            raise ValueError(f"--data.replace-batches {past[0].start}:{past[0].stop} reaches "
                             f"past the last step ({self.steps}): end it at --steps or before")
        if self.optim.qk_clip > 0 and self.model.qk_norm:
            raise ValueError("--optim.qk-clip rescales the q/k weights, whose scale QK-Norm "
                             "normalises away: use one or the other")
        if self.model.param == "mup" and self.optim.optimizer in ("adamh", "muonh"):
            raise ValueError("--model.param mup scales Adam's LR per parameter; Hyperball's step "
                             "is an angle on each matrix's sphere: use --optim.optimizer adamw")
        if self.model.param == "mup" and self.optim.optimizer == "muon":
            raise ValueError("--model.param mup scales Adam's LR per parameter (MuAdam); Muon "
                             "scales its own updates: use --optim.optimizer adamw with muP")
        if self.mesh.data <= 0 or self.mesh.model <= 0:
            raise ValueError("--mesh.data and --mesh.model must be positive")


# Settings that may change when a run directory is resumed: they do not change the math.
RESUMABLE = {"run_dir", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
             "microbatches", "peak_tflops", "device_gib",
             "max_consecutive_nonfinite", "dry_run", "mesh.data", "mesh.model",
             "data.replace_batches", "data.eval_sequences", "per_layer_metrics", "resume_step",
             "spectral_metrics", "dist.coordinator", "dist.num_processes", "dist.process_id",
             "dist.auto", "dist.timeout", "wandb.project", "wandb.name", "wandb.mode",
             "wandb.timeout",
             "model.attention", "model.attention_block"}  # same math, another implementation

PRESETS = {
    "cpu": TrainConfig(model=ModelConfig(scan_layers=False)),  # 4 layers: unrolled is faster
    # The cpu model at a real length: seq 1,024 (4,096 tokens a step, as cpu), where `auto`
    # attention is the blockwise form (O(T) memory). ~4 minutes on 2 cores.
    "cpu-long": TrainConfig(
        model=ModelConfig(scan_layers=False),
        optim=OptimConfig(warmup_steps=30),
        data=DataConfig(seq_len=1024, batch_size=4, eval_sequences=32),
        run_dir="runs/cpu-long", steps=150, log_every=10, eval_every=75, checkpoint_every=75),
    "tiny": TrainConfig(
        model=ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
        optim=OptimConfig(lr=1e-2, warmup_steps=5),
        data=DataConfig(seq_len=32, batch_size=8),
        run_dir="runs/tiny", steps=20, log_every=5, eval_every=10, checkpoint_every=10),
    # The story (lab/rows.py): d_model 64 (d_ff 172), 4 layers, beta2 0.95, no clipping, no
    # QK-Norm, a 1,000-step linear warmup to a constant LR 5e-2, 4,000 steps: the regime
    # lab/search.py found, and results/README.md's evidence trains.
    "story": TrainConfig(
        model=ModelConfig(d_model=64, d_ff=172, scan_layers=False),  # 4 layers: unrolled
        optim=OptimConfig(lr=5e-2, warmup_steps=1000, b2=0.95, weight_decay=0.1,
                          max_grad_norm=0.0, min_lr_ratio=1.0),
        data=DataConfig(batch_size=16, eval_sequences=64),
        run_dir="runs/story", steps=4000, log_every=250, eval_every=250,
        checkpoint_every=250, keep_checkpoints=20),
    # The story told in 15 minutes (README's recipe): the story's model, a 600-step warmup to LR
    # 0.12, 1,500 steps, a checkpoint every 100 (where a warm start can begin); picked by
    # lab/rows.py's TEACH_SCREEN, by a rule fixed before it ran.
    "teach": TrainConfig(
        model=ModelConfig(d_model=64, d_ff=172, scan_layers=False),
        optim=OptimConfig(lr=0.12, warmup_steps=600, b2=0.95, weight_decay=0.1,
                          max_grad_norm=0.0, min_lr_ratio=1.0),
        data=DataConfig(batch_size=16, eval_sequences=64),
        run_dir="runs/teach", steps=1500, log_every=100, eval_every=250,
        checkpoint_every=100, keep_checkpoints=20),
    # The real Marin 32B shape and optimizer (Marin's exp1295_32b); for --dry-run on a laptop.
    "marin-32b": TrainConfig(
        model=ModelConfig(vocab_size=128_256, d_model=5120, n_layers=64, n_heads=40,
                          n_kv_heads=8, d_ff=27_648, rope_theta=500_000.0, dtype="bfloat16"),
        # configured for 1,000,000 steps, warmup 0.01, decay 0.4: the LR held at 7e-4 through
        # every step it trained
        optim=OptimConfig(lr=7e-4, weight_decay=0.05, warmup_steps=10_000, decay="linear",
                          decay_fraction=0.4, min_lr_ratio=0.1),
        data=DataConfig(seq_len=4096, batch_size=8192),
        mesh=MeshConfig(data=256, model=4),
        run_dir="runs/marin-32b", steps=1_000_000, checkpoint_every=1000, eval_every=1000),
}


# What each preset is for (train.py --help)
PRESET_USES = {
    "cpu": "the default: d_model 256, 4 layers, 400 steps, a few minutes on 2 CPU cores",
    "cpu-long": "the cpu model at seq 1,024 (blockwise attention), ~4 minutes",
    "tiny": "d_model 64, 2 layers, 20 steps: the tests' model, seconds",
    "story": "the spike story: d_model 64, a 1,000-step warmup to LR 5e-2; breaks in level "
             "shifts without QK-Norm (~8 minutes)",
    "teach": "the story in 15 minutes: LR 0.12 after a 600-step warmup, 1,500 steps; shifts "
             "by step ~700 without QK-Norm (~2 minutes)",
    "marin-32b": "the real Marin 32B shape and optimizer, for --dry-run",
}
USAGE = ("Presets (the first word; the flags override it): "
         + "; ".join(f"{k}: {v}" for k, v in PRESET_USES.items())
         + ".\n--resume RUN (or RUN as the first word): go on with RUN's config.json, the flags "
           "that may change on a resume after it.")


def flatten(d: dict, prefix: str = "") -> dict:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}"""
    return {k2: v2 for k, v in d.items() for k2, v2 in
            (flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}


def config_from_dict(d: dict) -> TrainConfig:
    """A TrainConfig from its asdict() form, as config.json stores it (older names renamed)."""
    subs = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig, "mesh": MeshConfig,
            "dist": DistConfig, "wandb": WandbConfig, "guard": GuardConfig}
    nested = nest({RENAMED.get(k, k): v for k, v in flatten(d).items()}, sep=".")
    for key, value in flatten(nested).items():
        check_type(key, value)
    cfg = TrainConfig(**{k: subs[k](**v) if k in subs else v for k, v in nested.items()})
    missing = [k for k in ("model", "optim", "data", "steps") if k not in nested]
    if missing:  # every version wrote these: a config.json without them is not a run's
        raise ValueError(f"it has no {', '.join(missing)}")
    return cfg


def check_type(key: str, value) -> None:
    """Raise TypeError unless `value` fits the type TrainConfig declares for "optim.lr" etc.
    (a config.json edited by hand, or from elsewhere, may hold anything)."""
    cls, *path = TrainConfig, *key.split(".")
    for name in path:
        hints = typing.get_type_hints(cls)
        if name not in hints:
            raise TypeError(f"unknown setting {key!r}")
        cls = hints[name]
    options = typing.get_args(cls) if typing.get_origin(cls) in (typing.Union,
                                                                 types.UnionType) else (cls,)
    for t in options:
        if typing.get_origin(t) is typing.Literal:
            ok = value in typing.get_args(t)
        elif t is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif t is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, t if t is not type(None) else type(None))
        if ok:
            return
    raise TypeError(f"{key} is {value!r}, not a {cls}")


def load_config(run_dir: pathlib.Path) -> TrainConfig | None:
    """The config stored in a run directory; None if it has none."""
    stored = read_config(run_dir)
    try:  # (its "corpus", the text it was trained on, is checked apart: checkpoint.check_corpus)
        return None if stored is None else config_from_dict(
            {k: v for k, v in stored.items() if k not in ("corpus", "identity")})
    except (ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{run_dir}/config.json is not a spikefix config ({e})") from None


def make_tx(cfg: TrainConfig):
    """The run's optimizer chain (optim.make_optimizer), laid out on its model's parameters."""
    return make_optimizer(applied_optim(cfg), cfg.steps, **optimizer_layout(cfg.model))


def applied_optim(cfg: TrainConfig) -> OptimConfig:
    """cfg.optim as the optimizer applies it: with --optim.b2-rule batch, beta2 from the batch's
    tokens (hyperball.beta2_for_batch: 0.9999 for the story's 2,048, 0.95 for the 32B's 33.5M)."""
    if cfg.optim.b2_rule == "fixed":
        return cfg.optim
    return dataclasses.replace(cfg.optim, b2=beta2_for_batch(cfg.data.batch_size
                                                             * cfg.data.seq_len))


def load_checkpointed(run_dir: pathlib.Path, step: int | None, flag: str = "",
                      purpose: str = "") -> tuple[TrainConfig, int]:
    """(config, step) of a train.py run directory's checkpoint: `step`, or the latest. A
    UserError if it has no config or no such checkpoint; `flag` ("--from ") and `purpose`
    (" to sample from") name what the command wanted in the message."""
    cfg = load_config(run_dir)
    if cfg is None:
        raise UserError(f"{flag}{run_dir}: no config.json there; give a train.py run directory")
    steps = saved_steps(run_dir)
    if not steps:
        raise UserError(f"{flag}{run_dir} has no checkpoint{purpose}: train it first")
    if step is not None and step not in steps:
        raise UserError(f"{flag}{run_dir} has no checkpoint at step {step}; it has {steps}")
    step = steps[-1] if step is None else step
    # a run the guard escalated: its checkpoints after the escalation hold the escalated model
    return config_at(cfg, guard.split_at(read_events(run_dir), step)[0], step), step


# Settings that change the math, which a resume may still change on purpose: QK-Clip
# switched on mid-run (the rescue without new parameters); train.py records the step.
SWITCHABLE = {"optim.qk_clip", "optim.qk_clip_start"}


def check_same_run(stored: TrainConfig, cfg: TrainConfig, taken: int = 0) -> None:
    """A run directory holds one run: its config must agree with the flags, but for RESUMABLE.
    `--steps` may change too where that changes no step already taken (`taken` of them): the
    LR schedule must give the same value at every one of them (a constant schedule, or a
    warmup-stable-decay one whose decay has not begun)."""
    def settings(c: TrainConfig) -> dict:  # a default compares equal to the value it stands for
        return flatten(dataclasses.asdict(c)) | {"optim.max_grad_norm": c.optim.clip_norm}
    old, new = settings(stored), settings(cfg)
    diffs = [f"{k} (run has {old.get(k)!r}, flags give {new.get(k)!r})"
             for k in sorted(set(old) | set(new))
             if k not in RESUMABLE | SWITCHABLE and old.get(k) != new.get(k)]
    if diffs == [f"steps (run has {stored.steps}, flags give {cfg.steps})"]:
        if cfg.steps <= taken:
            raise UserError(f"{cfg.run_dir} has taken {taken} steps already: give --steps "
                            f"greater than {taken}")
        t = np.arange(taken)
        if np.array_equal(lr_schedule(stored.optim, stored.steps)(t),
                          lr_schedule(cfg.optim, cfg.steps)(t)):
            return
        diffs[0] += (f": the LR schedule of {cfg.steps} steps differs from the run's at steps "
                     f"already taken (only a constant schedule, or one whose decay has not "
                     f"begun by step {taken}, can be extended)")
    if diffs:
        raise UserError(f"{cfg.run_dir} holds a run with a different config: {'; '.join(diffs)}"
                        ". Pass the same flags to resume, or use a new --run-dir")


def train_on(cfg: TrainConfig, taken: int) -> str:
    """The command that trains a run on past its last step: raising --steps on a resume, where
    the LR schedule of twice the steps gives the same LR at every step taken (a constant
    schedule, or one whose decay has not begun); else, the LR having decayed, the warm start
    with nothing inserted: the same state, the LR re-warmed from 0.1x over the run's warmup to
    the longer schedule (Marin's way of extending a run)."""
    t = np.arange(taken)
    more = 2 * cfg.steps
    if np.array_equal(lr_schedule(cfg.optim, cfg.steps)(t), lr_schedule(cfg.optim, more)(t)):
        return f"train on: python train.py --resume {cfg.run_dir} --steps {more}"
    return (f"train on (its LR has decayed: re-warmed): python warmstart.py --from "
            f"{cfg.run_dir} --to {cfg.run_dir}-longer --insert none --rewarmup-steps "
            f"{max(cfg.optim.warmup_steps, 1)} --steps {more}")


# ---------------------------------------------------------------------------------------------
# train.py's command line, and the run it describes

def parse_config(argv: list[str], description: str = "") -> TrainConfig:
    """`[preset] [--flags]`: the preset (default "cpu") supplies the defaults the flags override.
    `--resume RUN [--flags]` (or `RUN [--flags]`): the config stored in the run directory RUN
    does, so a run continues without its preset and flags retyped."""
    if "--resume" in argv or (argv and argv[0] not in PRESETS and pathlib.Path(argv[0]).is_dir()):
        i = argv.index("--resume") + 1 if "--resume" in argv else 0
        if i >= len(argv):
            raise UserError("--resume needs a run directory: --resume RUN")
        run, rest = pathlib.Path(argv[i]), argv[:max(i - 1, 0)] + argv[i + 1:]
        stored = load_config(run)
        if stored is None:
            raise UserError(f"--resume {run}: no config.json there; give a train.py run directory")
        return parse_flags(dataclasses.replace(stored, run_dir=str(run), resume_step=None,
                                               dry_run=False), rest, description)
    name = argv[0] if argv and not argv[0].startswith("-") else "cpu"
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    rest = argv[1:] if argv and argv[0] == name else argv
    return parse_flags(PRESETS[name], rest, description)


def parse_flags(default: TrainConfig, args: list[str], description: str = "") -> TrainConfig:
    """tyro over TrainConfig with `default` as the defaults; a bad flag is a UserError.
    `--guard` alone is `--guard.on`."""
    args = ["--guard.on" if a == "--guard" else a for a in args]
    cfg = parse(TrainConfig, args, default=default, description=f"{description}\n" + USAGE)
    given = [a.split("=")[0] for a in args if a.startswith("--guard.") and a != "--guard.on"]
    if given and not cfg.guard.on:
        raise UserError(f"{given[0]} is a setting of the guard, which is off: add --guard")
    flags, o = {a.split("=")[0] for a in args}, cfg.optim
    for names, off, what in (  # a flag that changes nothing where it was given
            ("attn-gate-form", cfg.model.attn_gate == "none",
             "the attention gate, which is off: add --model.attn-gate headwise"),
            ("mup-base-width", cfg.model.param != "mup",
             "muP, which is off: add --model.param mup"),
            ("adam-lr", not o.hyperball, "adamh and muonh (the LR of their other leaves): add "
             "--optim.optimizer adamh or muonh"),
            ("muon-momentum", o.optimizer not in ("muon", "muonh"), "Muon: add --optim.optimizer "
             "muon or muonh"),
            ("b2", o.b2_rule == "batch", "a fixed beta2, which --optim.b2-rule batch replaces: "
             "give one of the two"),
            ("weight-decay", o.hyperball, f"Adam's decay, which --optim.optimizer {o.optimizer} "
             "does not apply (each matrix stays on its sphere): drop it"),
            ("zclip-alpha zclip-z zclip-warmup", o.grad_clip != "zclip",
             "ZClip, which is off: add --optim.grad-clip zclip"),
            ("skip-window skip-sigma skip-patience", not o.skip_step,
             "the skip rule, which is off: add --optim.skip-step"),
            ("update-clip-window update-clip-sigma", o.update_clip != "norm",
             "the update-norm clip, which is off: add --optim.update-clip norm"),
            ("update-rms-threshold", o.update_clip != "rms",
             "the update-RMS clip, which is off: add --optim.update-clip rms")):
        section = "model" if names in ("attn-gate-form", "mup-base-width") else "optim"
        given = [f"--{section}.{n}" for n in names.split() if f"--{section}.{n}" in flags]
        if given and off:
            raise UserError(f"{given[0]} is a setting of {what}")
    return cfg


def config_at(cfg: TrainConfig, events: list, step: int | None = None) -> TrainConfig:
    """The config a run had at `step`: `cfg` (config.json's, or a resume's flags) with the
    guard's recorded actions applied (events.jsonl: replaced windows, re-warmups,
    escalations). At a checkpoint `step`, only the escalations that checkpoint holds (the shape
    of its state); with none, all of them (the run as it goes on). A setting that cannot go
    beside what the guard did (QK-Clip switched on after it inserted QK-Norm) is a UserError."""
    try:
        return guard.effective_config(cfg, events, step)
    except ValueError as e:
        done = ", ".join(f"{x['escalation']} at step {x['rollback_to']}" for x in acted(events)
                         if x.get("escalation"))
        back = [x["rollback_to"] for x in acted(events) if x.get("escalation")]
        how = (f". To go on, warm-start a new run from the checkpoint it rolled back to: python "
               f"warmstart.py --from RUN --to NEW --step {max(back)} --insert none, with a "
               "--guard.escalate the run can take") if back else ""
        raise UserError(f"the guard escalated this run ({done}; events.jsonl): {e}{how}") \
            from None


def identity(cfg: TrainConfig) -> str:
    """The run in three lines: the model, the optimizer and its levers, the data."""
    m, o, d = cfg.model, applied_optim(cfg), cfg.data
    levers = [x for x, on in (("QK-Norm", m.qk_norm), (f"QK-Clip {o.qk_clip:g}", o.qk_clip),
                              (f"grad clip {o.clip_norm:g}", o.clip_norm),
                              ("skip-step", o.skip_step), (f"update clip {o.update_clip}",
                                                           o.update_clip != "off"),
                              (f"attention gate ({m.attn_gate}, {m.attn_gate_form})",
                               m.attn_gate != "none"),
                              ("Scaled Embed", m.embed_scale),
                              (f"muP (base width {m.mup_base_width})", m.param == "mup"),
                              (f"{cfg.microbatches} microbatches", cfg.microbatches > 1),
                              ("guard", cfg.guard.on)) if on]
    return (f"model: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} "
            f"heads, vocab {m.vocab_size}, seed {cfg.seed}\n"
            f"optim: {o.optimizer}, LR {o.lr:g} (warmup {o.warmup_steps}), beta2 {o.b2:g}"
            f"{' (from the batch)' if o.b2_rule == 'batch' else ''}; "
            f"levers: {', '.join(levers) or 'none'}\n"
            f"data: {d.source or 'the embedded corpus'}, batch {d.batch_size} x {d.seq_len}, "
            f"seed {d.seed}; {cfg.steps} steps")


def resumed(stored: TrainConfig, cfg: TrainConfig, taken: int) -> TrainConfig:
    """cfg for a resume at step `taken` of the run `stored` describes (check_same_run first): a
    QK-Clip threshold that changes is a switch from `taken` on (said once), else the step
    of the last switch stays."""
    check_same_run(stored, cfg, taken)
    if cfg.microbatches != stored.microbatches:
        say(f"--microbatches {stored.microbatches} -> {cfg.microbatches}: the same step to float "
            "rounding, so the run no longer repeats bit for bit")
    if cfg.optim.qk_clip == stored.optim.qk_clip:
        return dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, qk_clip_start=stored.optim.qk_clip_start))
    say(f"QK-Clip threshold {stored.optim.qk_clip:g} -> {cfg.optim.qk_clip:g} from step "
        f"{taken} on (a switch the run's config records)")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, qk_clip_start=taken))
