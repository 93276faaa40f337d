"""Every row of the story: the train.py rows (`Experiment`: one train.py / warmstart.py command
per seed) and the harness groups (`Group`: one compiled step vmapped over seeds, lab/harness.py),
each declared once, with its label and the figure panel it is drawn in. `REGISTRY` holds every
group by name (the search's own, the levers, the LR sweep, the evidence, the widths, the z-loss
and knob rows), built here without import side effects, so that a fork finds its source and a
row its QK-Norm twin whichever command runs.

    python -m lab.experiments --list   # every row and whether it has run
"""

import dataclasses

from config import PRESETS, TrainConfig
from guard import GuardConfig


@dataclasses.dataclass(frozen=True)
class Group:
    """One compiled step: the settings every member shares, and the grid of LRs x seeds."""
    name: str
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    qk_norm: bool = False
    batch_size: int = 16
    seq_len: int = 128
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    z_loss_weight: float = 1e-4
    warmup_steps: int = 100
    steps: int = 2000
    lrs: tuple[float, ...] = (1e-2,)
    seeds: tuple[int, ...] = (0, 1, 2)
    optim: tuple[tuple[str, object], ...] = ()  # a lever: OptimConfig fields, (name, value)
    model: tuple[tuple[str, object], ...] = ()  # ...or ModelConfig fields
    compare_with: str = ""  # the QK-Norm group the parting step is taken against (default: NAME-qk)
    label: str = ""  # its row in the README's evidence table ("": not there)
    # A mid-run arm from this group's kept states (see fork_steps): QK-Norm inserted where the
    # arm has it, else its settings (QK-Clip) switched on as a resume does.
    fork: str = ""
    snapshot_every: int = 0  # keep the stacked train state every N steps (a fork's source)
    # The guard on (GuardConfig fields): its rollbacks are the loop's, so each seed is a
    # train.py run (train.train, one after the other, resumable), its metrics.jsonl the curve.
    guard: tuple[tuple[str, object], ...] = ()
    spectral: bool = False  # log the q/k spectral entropy too (train.py --spectral-metrics)
    cpu: str = ""  # the CPU model it must train on, as /proc/cpuinfo names it ("": any)

    def config(self, lr: float | None = None) -> TrainConfig:
        """train.py's config of one member at `lr` (default: the group's first LR)."""
        base = PRESETS["story"]
        model = dataclasses.replace(
            base.model, d_model=self.d_model, d_ff=round(8 / 3 * self.d_model / 4) * 4,
            n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            qk_norm=self.qk_norm, z_loss_weight=self.z_loss_weight,
            **({"attention": "auto"} | dict(self.model)))
        optim = dataclasses.replace(base.optim, lr=self.lrs[0] if lr is None else lr,
                                    b2=self.b2, eps=self.eps, weight_decay=self.weight_decay,
                                    warmup_steps=self.warmup_steps, max_grad_norm=0.0,
                                    min_lr_ratio=1.0)
        optim = dataclasses.replace(optim, **dict(self.optim))
        data = dataclasses.replace(base.data, batch_size=self.batch_size, seq_len=self.seq_len,
                                   eval_sequences=64)
        guarded = GuardConfig(on=True, **dict(self.guard)) if self.guard else base.guard
        return dataclasses.replace(base, model=model, optim=optim, data=data, steps=self.steps,
                                   guard=guarded, spectral_metrics=self.spectral)

    def settings(self) -> dict:
        d = dataclasses.asdict(self) | {"optim": dict(self.optim), "model": dict(self.model),
                                        "guard": dict(self.guard)}
        return {k: v for k, v in d.items()
                if k not in ("name", "lrs", "seeds", "compare_with", "label")
                and (k not in ("optim", "model", "fork", "snapshot_every", "guard", "spectral")
                     or v)}


def twin(g: Group, **kw) -> Group:
    """The group's QK-Norm twin (the comparison the story needs)."""
    return dataclasses.replace(g, name=g.name + "-qk", qk_norm=True, **kw)


# The search, in the order it was run. The notes say why each group was tried. A QK-Norm twin
# ("-qk") runs once its baseline shows spikes worth comparing.
GROUPS = [
    # d_model 64 at moderate LRs (3e-2 collapses within ~100 steps), beta2 0.95, 2,000 steps.
    Group("d64-b2.95", lrs=(6e-3, 1e-2, 1.5e-2, 2e-2)),
    # A stale second moment (beta2 0.999) and a tiny eps (Molybog et al., Bai et al.).
    Group("d64-b2.999-eps1e-15", b2=0.999, eps=1e-15, lrs=(6e-3, 1e-2, 1.5e-2, 2e-2)),
    # The first group learned at every LR without an instability (logits up to 492; its few
    # spikes fell on the same steps at every LR of a data seed: hard batches). Learn first at
    # a low LR, then meet the LR that collapses a fresh model (3e-2) or more: a long warmup.
    Group("d64-b2.95-warmup1000", warmup_steps=1000, lrs=(3e-2, 5e-2)),
]
# QK-Norm twins: the comparison that decides the parting step (queued before the warmup group).
GROUPS.insert(2, twin(GROUPS[1], lrs=(1e-2, 2e-2)))
# The two single-seed events came late (steps 646 and 1,882): longer runs, other seeds.
GROUPS += [
    Group("d64-b2.999-eps1e-15-4k", b2=0.999, eps=1e-15, lrs=(2e-2,), seeds=(3, 4, 5),
          steps=4000),
    Group("d64-b2.95-warmup1000-4k", warmup_steps=1000, lrs=(5e-2,), steps=4000),
]
# That group breaks late in every seed (level shifts that never come back): its QK-Norm twin.
GROUPS.append(twin(GROUPS[-1]))
# The story regime (train.py's `story` preset) is that group. The levers, from scratch on it,
# each compared with its QK-Norm twin (the spikes and shifts after their parting step).
STORY = GROUPS[-2]
SEARCH_NAMES = {g.name for g in GROUPS}  # the search's own groups (the rows below add theirs)


STORY_PRESET = "story"  # the preset (train.py)
REWARMUP = 100
REPLACED = 20  # replace-batches: the batches of this many steps before the event


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One row of the results: how its runs are made, what it is compared with, where it is
    drawn. Adding a lever is adding one of these."""
    name: str
    flags: tuple[str, ...] = ()  # train.py flags on top of the preset
    preset: str = STORY_PRESET
    baseline: str | None = "baseline"  # the row its held-out loss is compared with
    panels: tuple[str, ...] = ()  # LOGITS: drawn in attn_logits_per_layer.png
    # How its runs start: "train" from scratch; "rescue": QK-Norm inserted by warmstart.py into
    # `source` at the first checkpoint after its first event (start_step); "switch": `source`
    # resumed from that checkpoint with `flags` added (a setting a resume may switch on,
    # QK-Clip); "replace": `source` rewound to its last
    # checkpoint before its largest loss event and run on with the batches of the REPLACED
    # steps before the event replaced (Marin: "we tried skipping the problematic step").
    start: str = "train"
    source: str = ""


LOGITS = "logits"  # a row drawn in attn_logits_per_layer.png (its first seed's layers)
EXPERIMENTS = [
    Experiment("baseline", baseline=None, panels=(LOGITS,)),
    # Mid-run, after the baseline's first level shift: QK-Norm inserted, QK-Clip switched on;
    # the batches before its largest event replaced
    Experiment("rescue", panels=(LOGITS,), start="rescue", source="baseline"),
    Experiment("qk-clip-switched-on", ("--optim.qk-clip", "100"), start="switch",
               source="baseline"),
    Experiment("replace-batches", start="replace", source="baseline"),
    # The guard (guard.py): rollback and data replacement only, then with escalation to QK-Norm
    Experiment("guard", ("--guard",)),
    Experiment("guard-escalate", ("--guard", "--guard.escalate", "qk-norm"), panels=(LOGITS,)),
    # The 32B's configuration (clip 0.2, skip-step, update-norm clip), then QK-Norm inserted
    Experiment("marin-32b", ("--optim.max-grad-norm", "0.2", "--optim.skip-step",
                             "--optim.update-clip", "norm")),
    Experiment("rescue-marin-32b", baseline="marin-32b", start="rescue", source="marin-32b"),
]
BY_NAME = {e.name: e for e in EXPERIMENTS}
NAMES = list(BY_NAME)


# ---------------------------------------------------------------------------------------------
# The harness's rows (lab/harness.py trains them: train.py's own step vmapped over seeds, or for a
# guarded row train.py's loop per seed). Adding a lever is one row here.

def lever(name: str, model: dict | None = None, **optim) -> Group:
    return dataclasses.replace(STORY, name=f"story-{name}", optim=tuple(optim.items()),
                               model=tuple((model or {}).items()),
                               compare_with=STORY.name + "-qk")


LEVERS = [
    lever("marin-32b", max_grad_norm=0.2, skip_step=True, update_clip="norm"),  # the three
    lever("clip-0.2", max_grad_norm=0.2),
    lever("skip-step", skip_step=True),
    lever("update-clip-norm", update_clip="norm"),
    lever("qk-clip-100", qk_clip=100.0),
    lever("softcap-50", model={"attn_softcap": 50.0}),  # Gemma 2's cap
    lever("zclip", grad_clip="zclip"),
    lever("update-clip-rms", update_clip="rms"),
    # (stored as run then, with the LM head on Muon too: its settings in results/search.json
    # say muon_head; the trainer no longer offers that variant, so this row is not run again)
    lever("muon", optimizer="muon"),
]
# LR sensitivity as Wortsman et al. (2309.14322) define it: the story regime at each LR of a
# half-decade grid from 1e-3 to 1, with and without QK-Norm, one group per LR and arm (each
# recorded as it finishes), the LRs nearest the story's 5e-2 first.
SWEEP_LRS = (1e-1, 3e-2, 3e-1, 1.0, 1e-2, 3e-3, 1e-3)
SWEEP = [g for lr in SWEEP_LRS for base in [dataclasses.replace(STORY, name=f"story-lr{lr:g}",
                                                                lrs=(lr,))]
         for g in (base, twin(base))]
# The evidence: the story regime over 8 seeds (init and data order both drawn from the seed),
# with train.py's own step (unrolled layers, the story preset's since then): the baseline
# (keeping its state every 250 steps, where a warm start can begin), its QK-Norm twin, the 32B's
# three levers, and QK-Norm inserted mid-run (fork_steps) with a 100-step re-warmup from 0.1x.
EVIDENCE_SEEDS = tuple(range(8))
EVIDENCE = dataclasses.replace(STORY, name="story8", seeds=EVIDENCE_SEEDS, snapshot_every=250,
                               label="baseline")
EVIDENCE_GROUPS = [
    EVIDENCE, twin(EVIDENCE, snapshot_every=0, label="QK-Norm from scratch"),
    dataclasses.replace(LEVERS[0], name="story8-marin-32b", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk", label="the 32B's levers together"),
    dataclasses.replace(EVIDENCE, name="story8-qk-inserted", qk_norm=True, fork="story8",
                        snapshot_every=0, compare_with="story8-qk",
                        optim=(("rewarmup_steps", 100), ("rewarmup_from_ratio", 0.1)),
                        label="QK-Norm inserted mid-run"),
]
# The guard with escalation to QK-Norm (train.py's loop, one seed after the other); with the
# data check on (the story has no data shift: every "data" record is a shift let through); and
# acting before the break, when the max logit passes 100 at a checkpoint step (predict).
EVIDENCE_GROUPS += [dataclasses.replace(EVIDENCE, name=f"story8-guard-{tag}",
                                        snapshot_every=0, compare_with="story8-qk",
                                        guard=(("escalate", "qk-norm"), *more), label=label)
                    for tag, more, label in (
                        ("escalate", (), "the guard, escalating to QK-Norm (train.py)"),
                        ("escalate-data", (("data_fraction", 0.5),),
                         "the same, with its data check"),
                        ("predict", (("predict", "max-logit"),),
                         "the guard, predicting: max logit > 100 at a checkpoint"),
                        # (its one-step spikes left alone: no rollback at all?)
                        ("predict-only", (("predict", "max-logit"), ("spikes", False)),
                         "the same, its spike rule off"))]
# The references' tools over the same seeds (run after the four above): QK-Clip's signed max
# and no-growth rule, Muon with the references' split, MuonClip (Muon + QK-Clip, as K2).
EVIDENCE_GROUPS += [
    dataclasses.replace(lever(name, **optim), name=f"story8-{name}", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk", label=label)
    for name, optim, label in (
        ("qk-clip-100", {"qk_clip": 100.0}, "QK-Clip 100 from scratch"),
        ("muon", {"optimizer": "muon"}, "Muon (LM head on AdamW) from scratch"),
        ("muonclip-100", {"optimizer": "muon", "qk_clip": 100.0},
         "MuonClip (Muon + QK-Clip 100)"))]
# The baseline again with the final code (story8 predates a refactor of attention.py that moved
# its float rounding: its steps part from step 1-21 on): a rerun of the row as a whole, and
# the source of QK-Clip 100 switched on mid-run at the same rule's step (no re-warmup: a
# resume's switch).
EVIDENCE_GROUPS += [
    dataclasses.replace(EVIDENCE, name="story8-rerun", label="the baseline again, final code"),
    dataclasses.replace(EVIDENCE, name="story8-qk-clip-switched", fork="story8-rerun",
                        snapshot_every=0, compare_with="story8-qk", optim=(("qk_clip", 100.0),),
                        label="QK-Clip 100 switched on mid-run (from the rerun above)")]
# The baseline and its twin once more, with every early-warning signal computed online in the
# step (python -m lab.foresight --group story8-signals): the update/weight ratio and
# m / sqrt(v) per layer, the q/k spectral entropy.
EVIDENCE_GROUPS += [g for base in [dataclasses.replace(EVIDENCE, name="story8-signals",
                                                       snapshot_every=0, spectral=True, label="")]
                    for g in (base, twin(base))]
# The other levers alone, over the same seeds (queued after those).
EVIDENCE_GROUPS += [
    dataclasses.replace(lever(name, model, **optim), name=f"story8-{name}", seeds=EVIDENCE_SEEDS,
                        compare_with="story8-qk", label=label)
    for name, model, optim, label in (
        ("clip-0.2", None, {"max_grad_norm": 0.2}, "gradient clipping 0.2 alone"),
        ("skip-step", None, {"skip_step": True}, "skip-step (OLMo 2) alone"),
        ("update-clip-norm", None, {"update_clip": "norm"}, "update-norm clipping alone"),
        ("softcap-50", {"attn_softcap": 50.0}, {}, "soft-cap 50 (Gemma 2)"),
        ("zclip", None, {"grad_clip": "zclip"}, "ZClip alone"),
        ("update-clip-rms", None, {"update_clip": "rms"}, "update-RMS clipping alone"))]
# The attention gate Marin kept (Marin's form: 2 * sigmoid, zero init, headwise), over the same
# seeds: from scratch without QK-Norm and with it, inserted mid-run (exactly 1 at insertion),
# and as the guard's escalation. The insertion forks from story8-probed: the baseline trained
# again with this code, one niced pinned core, AMD EPYC, its states kept every 250 steps and
# the probes of lab/probe.py read at each held-out eval (the no-gate side of the sink). Its
# curves are story8's bit for bit (all 4,000 steps, all 8 seeds; story8-rerun's it parts from
# at steps 1-21), so its forks are story8-qk-inserted's: QK-Norm and the gate inserted at the
# same steps of the same runs.
GATE = (("attn_gate", "headwise"), ("attn_gate_form", "marin"))
EVIDENCE_GROUPS += [
    dataclasses.replace(EVIDENCE, name="story8-probed",
                        label="the baseline trained again (story8 bit for bit, probed)"),
    dataclasses.replace(EVIDENCE, name="story8-gate", snapshot_every=0, model=GATE,
                        compare_with="story8-qk", label="the attention gate from scratch"),
    dataclasses.replace(EVIDENCE, name="story8-gate-qk", snapshot_every=0, model=GATE,
                        qk_norm=True, label="the gate with QK-Norm from scratch"),
    dataclasses.replace(EVIDENCE, name="story8-gate-inserted", fork="story8-probed", model=GATE,
                        snapshot_every=0, compare_with="story8-qk",
                        optim=(("rewarmup_steps", 100), ("rewarmup_from_ratio", 0.1)),
                        label="the gate inserted mid-run"),
    dataclasses.replace(EVIDENCE, name="story8-guard-escalate-gate", snapshot_every=0,
                        compare_with="story8-qk", guard=(("escalate", "attn-gate"),),
                        label="the guard, escalating to the gate (train.py)")]
# Wortsman et al.'s small-scale proxy across widths (2309.14322, Fig. 1): does the break come
# closer to the best LR as the model grows? d_model 32, 64, 128 at the story's depth, head_dim
# 16 (the heads scale with the width, two query heads per KV head), the same data, tokens and
# schedule; per width and arm one group over the LR grid (one compiled step per LR): ~1 h an
# arm on one core at d_model 32, ~2.5 h at 64, ~7 h at 128. The best LR fell from 3e-3 at
# d_model 32 to 1e-3 at 64, so 128 also runs 1e-4 to keep its best bracketed. LR sensitivity
# is taken over the paper's range, 3e-4 to 3e-1 (its §2.2: three decades), at every width; the
# grid goes on to 1 to find where both arms break.
WIDTHS = (32, 64, 128)
WIDTH_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
SENSITIVITY_LRS = WIDTH_LRS[:-1]
WIDTH_ROWS = [g for d in WIDTHS for base in [dataclasses.replace(
    STORY, name=f"width{d}", d_model=d, n_heads=d // 16, n_kv_heads=d // 32,
    lrs=(1e-4, *WIDTH_LRS) if d == 128 else WIDTH_LRS, seeds=(0, 1, 2),
    compare_with=f"width{d}-qk")] for g in (base, twin(base))]
# The second instability (Wortsman et al. §3.2, output-logit divergence): d_model 32 around its
# break (0.1, 0.3, 1), z-loss off against on (1e-4), with and without QK-Norm; the step reports
# the output logits' max |logit| and mean log Z. ~20 min a group on one core (AMD EPYC).
ZLOSS_ROWS = [g for z in (0.0, 1e-4) for base in [dataclasses.replace(
    WIDTH_ROWS[0], name=f"zloss{z:g}-width32", lrs=(0.1, 0.3, 1.0), z_loss_weight=z,
    compare_with=f"zloss{z:g}-width32-qk")] for g in (base, twin(base))]
# When is QK-Norm necessary? The knobs the 32B had that a small run does not, each an LR sweep
# of the d_model 32 proxy without and with QK-Norm, judged by the widths rows' rules (best LR:
# the lowest mean held-out; break LR: the lowest LR with a level shift in >= half the seeds;
# the distance in decades, its spread the range of the seeds' own break/best over the seeds).
# The grid brackets d_model 32's best (3e-3) and break (0.3; 1 with QK-Norm). Adam's beta2 as
# in most recipes (0.999; the proxy's 0.95), Marin's epsilon (1e-15), no weight decay.
KNOB_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
KNOBS = {"b2.999": {"b2": 0.999}, "eps1e-15": {"eps": 1e-15}, "wd0": {"weight_decay": 0.0},
         # bfloat16 compute (the 32B's; Wortsman et al. 2304.13013 tie low precision to
         # instability): XLA:CPU runs the proxy's step at float32's speed (41.2 against 40.6 ms)
         "bf16": {"model": (("dtype", "bfloat16"),)}}
# The costlier knobs on a narrower grid, the LRs run middle first (a stop keeps the bracket):
# the batch x4 (64 sequences: the 32B's 32Mi tokens a step against the 8B's 4-12Mi; 4x the
# compute an LR) and twice the steps (8,000, the warmup as it is). d_model 64 without weight
# decay: the one knob that moved the distance at 32 (2.0 -> 1.0 decade), one width up.
COSTLY_LRS = (1e-2, 3e-2, 1e-1, 3e-3, 3e-1)
KNOBS_COSTLY = {"b64": {"batch_size": 64}, "8k": {"steps": 8000}}
KNOB_ROWS = [g for tag, knob, lrs in [*[(t, k, KNOB_LRS) for t, k in KNOBS.items()],
                                      *[(t, k, COSTLY_LRS) for t, k in KNOBS_COSTLY.items()]]
             for base in [dataclasses.replace(WIDTH_ROWS[0], name=f"width32-{tag}", lrs=lrs,
                                              compare_with=f"width32-{tag}-qk", **knob)]
             for g in (base, twin(base))]
# The batch x4 keeps LR 0.1 free of level shifts in 3 of 3 seeds (max logit 95-295; the proxy
# at batch 16: 11,500 and seed 1 shifts), so its break may lie above the costly grid's top:
# LR 1 declared once 0.01-0.1 had run, before 0.3 (the knob table pools it with width32-b64).
KNOB_ROWS.append(dataclasses.replace(next(g for g in KNOB_ROWS if g.name == "width32-b64"),
                                     name="width32-b64-high", lrs=(1.0,)))
KNOB_ROWS += [g for base in [dataclasses.replace(
    WIDTH_ROWS[2], name="width64-wd0", weight_decay=0.0, lrs=(3e-3, 1e-2, 3e-2, 1e-1, 1e-3),
    compare_with="width64-wd0-qk")] for g in (base, twin(base))]
# The QK-Norm arms of those three stop below QK-Norm's break (1 at d_model 32 and 64, the widths
# rows): each goes on to bracket it, declared before any of the three arms ran.
KNOB_ROWS += [dataclasses.replace(g, name=f"{g.name}-high", lrs=lrs) for g in KNOB_ROWS
              for name, lrs in (("width32-b64-qk", (1.0, 3.0)), ("width32-8k-qk", (1.0, 3.0)),
                                ("width64-wd0-qk", (0.3, 1.0))) if g.name == name]
# How far each lever moves the break, d_model 32: each lever's break LR (the widths rows' rule)
# as a ratio to the baseline's (width32: 0.3), each seed's against the same seed's. The grids
# bracket each lever's break where the literature puts it: QK-Norm's sat at width32-qk's top (1),
# so its arm goes on to 3 and 10; QK-Norm + the soft-cap (Rybakov et al. 2410.16682: 1.5x QK-Norm
# alone) from 0.3; the soft-cap alone (Gemma 2's 50), QK-Clip (100, as the evidence rows) and
# Scaled Embed (Takase et al. 2312.16903) around the baseline's break. A lever's break below
# its grid reads "<= its lowest LR", above it "> its highest". LEVER_BREAKS pools each lever's
# groups over LRs.
WIDTH32 = WIDTH_ROWS[0]
BREAK_ROWS = [
    dataclasses.replace(WIDTH32, name="width32-qk-high", qk_norm=True, lrs=(3.0, 10.0),
                        compare_with="width32-qk"),
    dataclasses.replace(WIDTH32, name="width32-qk-softcap50", qk_norm=True,
                        model=(("attn_softcap", 50.0),), lrs=(0.3, 1.0, 3.0, 10.0),
                        compare_with="width32-qk"),
    dataclasses.replace(WIDTH32, name="width32-softcap50", model=(("attn_softcap", 50.0),),
                        lrs=(0.03, 0.1, 0.3, 1.0), compare_with="width32-qk"),
    # (declared on a misreading: the runner's log counts level shifts after the parting step only,
    # none at 1; by the table's rule, any level shift, the soft-cap breaks at 0.3 and these LRs add
    # only that 3 and 10 break too)
    dataclasses.replace(WIDTH32, name="width32-softcap50-high", model=(("attn_softcap", 50.0),),
                        lrs=(3.0, 10.0), compare_with="width32-qk"),
    dataclasses.replace(WIDTH32, name="width32-qk-clip100", optim=(("qk_clip", 100.0),),
                        lrs=(0.03, 0.1, 0.3, 1.0, 3.0), compare_with="width32-qk"),
    dataclasses.replace(WIDTH32, name="width32-embed-scale", model=(("embed_scale", True),),
                        lrs=(0.03, 0.1, 0.3, 1.0), compare_with="width32-qk"),
]
BREAK_ROWS.append(dataclasses.replace(WIDTH32, name="width32-gate", model=GATE,
                                      lrs=WIDTH_LRS, compare_with="width32-qk"))
LEVER_BREAKS = {"baseline": ("width32",), "QK-Norm": ("width32-qk", "width32-qk-high"),
                "the attention gate": ("width32-gate",),
                "QK-Norm + soft-cap 50": ("width32-qk-softcap50",),
                "soft-cap 50": ("width32-softcap50", "width32-softcap50-high"),
                "QK-Clip 100": ("width32-qk-clip100",),
                "Scaled Embed": ("width32-embed-scale",)}
# Does muP remove the need for QK-Norm? (marin #1570.) The widths rows under --model.param mup,
# base width 32 (where muP is the standard model: width32 and width32-qk are its d_model 32
# rows), judged by the widths rows' rules: does the best LR transfer, does the break stay put?
# The LRs that bracket the base width's best (3e-3) and break (0.3) and the standard width's
# (64: 1e-3, 0.1; 128: 1e-3, 3e-2), 1e-3 to 0.3; QK-Norm's arm on to 1, its break at both
# standard widths: ~18 min an LR at d_model 64, ~47 min at 128 (one core, AMD EPYC).
MUP_ROWS = [dataclasses.replace(g, name=f"{g.name}-mup",
                                model=(("param", "mup"), ("mup_base_width", 32)),
                                compare_with=f"width{g.d_model}-qk-mup" if not g.qk_norm else "",
                                lrs=WIDTH_LRS[1:] if g.qk_norm else WIDTH_LRS[1:-1])
            for g in WIDTH_ROWS if g.d_model > 32 and (not g.qk_norm or g.d_model == 128)]
# Trained on an NVIDIA H200 (JAX 0.11.2, float32 matmuls at "highest" precision, Python 3.11's
# library as the corpus through SPIKEFIX_STDLIB): the six QK-Norm arms of the batch x4, 8,000
# steps and d_model 64 without weight decay, and width128-mup's and -qk-mup's LRs from 0.1. A run
# on another machine is another draw: the cell each answer rests on most trains again on one
# pinned CPU core, judged by the same rules (breaks.py's machine_rows): the batch x4's QK-Norm
# break (0.3, 2 of 3 seeds shift on the H200) and muP's d_model 128 below its break (0.1: none
# shifts, the break at 0.3 with max logits 3.1-3.7e5). A cell's verdict survives when the CPU's
# seeds give the H200's (a break: a level shift in at least half the seeds), whatever the count.
# Declared before either ran. Then, once width128-qk-mup was recorded: its top LR (1), where by
# that rule QK-Norm under muP has no break (1 of 3 seeds shifts; held-out 3.0-3.6 at the end).
MACHINE_ROWS = [dataclasses.replace(g, name=f"{g.name}-cpu", lrs=lrs, compare_with="")
                for g in (*KNOB_ROWS, *MUP_ROWS)
                for name, lrs in (("width32-b64-qk", (0.3,)), ("width128-mup", (0.1,)),
                                  ("width128-qk-mup", (1.0,)))
                if g.name == name]
# The teaching regime (a preset a reader runs in 15 minutes): the story's model, a shorter
# warmup to the story's LR or above, 1,500 steps, so that a level shift comes early and in
# nearly every seed. The rules, fixed before any of these runs: report.py's level-shift rule at
# its defaults (the table's rule). The screen (3 seeds an LR, no twin): a candidate is an
# (warmup, LR) whose 3 seeds all shift within the 1,500 steps; of those, the one whose latest
# first shift comes earliest (ties: the lower LR). The candidate then runs 8 seeds with its
# QK-Norm twin; it becomes the preset where >= 7 of 8 seeds shift and none of the twin's, on
# each of the two CPU models (AMD EPYC, Intel Xeon), and the recipe fits 15 minutes on 2 cores.
TEACH_SCREEN = [Group(f"teach-w{w}", warmup_steps=w, steps=1500, lrs=lrs, seeds=(0, 1, 2))
                for w, lrs in ((300, (5e-2, 8e-2, 1.2e-1)), (600, (8e-2, 1.2e-1)))]
# The screen's outcome (results/search.json, Intel Xeon): every seed shifts at warmup 300 / LR
# 8e-2 (first shifts by 768) and 0.12 (by 1,322), warmup 600 / 8e-2 (by 961) and 0.12 (by 561);
# none at 300 / 5e-2. By the rule: warmup 600, LR 0.12, its 8 seeds and QK-Norm twin next.
TEACH8 = dataclasses.replace(TEACH_SCREEN[1], name="teach8", lrs=(0.12,), seeds=EVIDENCE_SEEDS)
# The second CPU model: teach8 and its twin again on an AMD EPYC (teach8 ran on an Intel Xeon),
# the same seeds and rules; declared before either ran.
TEACH8_ROWS = [TEACH8, twin(TEACH8)]
TEACH8_ROWS += [dataclasses.replace(g, name=g.name.replace("teach8", "teach8-epyc"),
                                    cpu="AMD EPYC") for g in TEACH8_ROWS]
TEACH_ROWS = [*TEACH_SCREEN, *TEACH8_ROWS]
# After the 32B: Hyperball (AdamH), declared before any of these runs. On the story regime (8
# seeds, its rules as they stand): AdamH's angle a step by Levanter's AdamHConfig rule,
# sqrt(Adam's LR x weight decay) = sqrt(5e-2 x 0.1) = 0.07, the embedding and norms on Adam at
# the story's 5e-2; the same with QK-Norm; the story at beta2 from the batch (the hero run's
# rule, marin #5951: 0.9999 for 2,048 tokens); and AdamH switched on mid-run at
# story8-qk-inserted's forks (the same steps, the same 100-step re-warmup from 0.1x), each
# matrix's radius its norm at the switch.
ADAMH = (("optimizer", "adamh"), ("adam_lr", 0.05))
REWARM = (("rewarmup_steps", 100), ("rewarmup_from_ratio", 0.1))
HYPERBALL_ROWS = [dataclasses.replace(EVIDENCE, name=name, qk_norm=qk, lrs=lrs, optim=optim,
                                      fork=fork, snapshot_every=0, compare_with="story8-qk",
                                      label=label)
                  for name, qk, lrs, optim, fork, label in (
                      ("story8-adamh", False, (0.07,), ADAMH, "", "AdamH, no QK-Norm"),
                      ("story8-adamh-qk", True, (0.07,), ADAMH, "", "AdamH with QK-Norm"),
                      ("story8-b2-batch", False, (5e-2,), (("b2_rule", "batch"),), "",
                       "beta2 from the batch (0.9999), no QK-Norm"),
                      ("story8-adamh-switched", False, (0.07,), ADAMH + REWARM, "story8",
                       "AdamH switched on mid-run"))]
# The switch needs its source's kept states (runs/search/, not committed), and story8's forks
# are bitwise only on the CPU model it ran on (AMD EPYC). On another model: the baseline trained
# again there with its states kept ("-xeon": an Intel Xeon), then QK-Norm inserted and AdamH
# switched on at the same forks of those runs (fork_steps' rule, the same re-warmup), so the
# two rescues compare on the same runs. Declared before any of the three ran.
XEON = dataclasses.replace(EVIDENCE, name="story8-xeon", label="")
HYPERBALL_ROWS += [XEON, dataclasses.replace(
    EVIDENCE, name="story8-xeon-qk-inserted", qk_norm=True, fork=XEON.name, snapshot_every=0,
    compare_with="story8-qk", optim=REWARM, label="QK-Norm inserted mid-run (Xeon's forks)"),
    dataclasses.replace(HYPERBALL_ROWS[3], name="story8-xeon-adamh-switched", fork=XEON.name,
                        label="AdamH switched on mid-run (Xeon's forks)")]
EVIDENCE_GROUPS += HYPERBALL_ROWS  # judged by the story's rules, in its tables
# The break under AdamH at d_model 32 (3 seeds, the knob table's rules), with and without
# QK-Norm: the angle in half decades from 1e-3 to 1, around Levanter's rule at width32's best
# Adam LR (sqrt(3e-3 x 0.1) = 0.017); the other leaves on Adam at that best LR. A best LR at the
# grid's edge gets the next half decade beyond it, declared then.
HYPERBALL_ROWS += [dataclasses.replace(WIDTH32, name=f"width32-adamh{'-qk' * qk}", qk_norm=qk,
                                       optim=(("optimizer", "adamh"), ("adam_lr", 3e-3)),
                                       lrs=(1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
                                       compare_with="" if qk else "width32-adamh-qk")
                   for qk in (False, True)]
# Best against best, from scratch (declared before any of these ran). AdamH tuned at the
# story's width: the angle on a half-decade grid around Levanter's rule sqrt(LR x wd) at Adam's
# best LR at d_model 64 (1e-3 with and without QK-Norm, the widths rows: 0.01) and at the
# story's LR (0.07), the other leaves on Adam at that best LR, with and without QK-Norm, 3
# seeds, one group per angle and arm (each recorded as it ends), the angles nearest 0.01 first.
# The rule: an arm's best angle has the lowest mean held-out over its seeds; a best at the
# grid's edge gets the next half decade beyond it. Next, at each arm's best angle, the other
# leaves' LR at 3e-4 and 3e-3 (the same rule picks the pair); then 8 seeds at each arm's best
# pair, beside Adam and Adam with QK-Norm at their own best LR (8 seeds, below).
TUNE_ANGLES = (1e-2, 3e-2, 3e-3, 1e-1)
ADAM_BEST_LR = 1e-3


def tune_row(opt: str, a: float, qk: bool, adam_lr: float = ADAM_BEST_LR) -> Group:
    """One tuning row: the story at angle a under opt, the other leaves on Adam at adam_lr (its
    best LR unless named: "-adam<lr>")."""
    name = f"{opt}{'-qk' * qk}-a{a:g}" + (f"-adam{adam_lr:g}" if adam_lr != ADAM_BEST_LR else "")
    return dataclasses.replace(STORY, name=f"d64-{name}", qk_norm=qk, lrs=(a,),
                               optim=(("optimizer", opt), ("adam_lr", adam_lr)),
                               compare_with="" if qk or adam_lr != ADAM_BEST_LR
                               else f"d64-{opt}-qk-a{a:g}")


TUNE_ROWS = [tune_row("adamh", a, qk) for a in TUNE_ANGLES for qk in (False, True)]
# AdamH with QK-Norm had its best at the grid's edge (3e-3: 1.854 against 1.873 at 1e-2), so
# by the rule its next half decade, declared then:
TUNE_ROWS += [tune_row("adamh", 1e-3, True)]
# It gave 1.919, so 3e-3 is that arm's best, bracketed; its other leaves' LR next, declared then:
TUNE_ROWS += [tune_row("adamh", 3e-3, True, lr) for lr in (3e-4, 3e-3)]
# Without QK-Norm, 3e-3 gave 1.963 against 1.968 at 1e-2: its best at the edge, so 1e-3 next:
TUNE_ROWS += [tune_row("adamh", 1e-3, False)]
# It gave 2.097, so 3e-3 is that arm's best, bracketed; its other leaves' LR next, declared then:
TUNE_ROWS += [tune_row("adamh", 3e-3, False, lr) for lr in (3e-3, 3e-4)]
# The other leaves at 3e-3 gave 1.604 and, with QK-Norm, 1.546 (1.963 and 1.854 at 1e-3): the
# best at that grid's edge in both arms, so 1e-2 next, declared then:
TUNE_ROWS += [tune_row("adamh", 3e-3, qk, 1e-2) for qk in (True, False)]
# 1e-2 gave 1.475 and, with QK-Norm, 1.493: the edge again, so 3e-2 next (declared then):
TUNE_ROWS += [tune_row("adamh", 3e-3, qk, 3e-2) for qk in (True, False)]
# 3e-2 gave 1.470 and, with QK-Norm, 1.491 (1.475 and 1.493 at 1e-2): the edge by the rule
# (within the seeds' ranges), so 1e-1 next (declared then):
TUNE_ROWS += [tune_row("adamh", 3e-3, qk, 0.1) for qk in (True, False)]
# Adam's own best LR (1e-3) is its sweep's lowest, so by the same rule 3e-4 next, with and
# without QK-Norm (declared then; the sweep's rows' form, 3 seeds):
ADAM_BELOW = [dataclasses.replace(STORY, name="story-lr0.0003", lrs=(3e-4,))]
TUNE_ROWS += [g for base in ADAM_BELOW for g in (base, twin(base))]
# MuonH, the hero run's, the same way (declared then, before any MuonH row ran; it replaces
# MuonH's rows first declared beside AdamH's, none of which ran): AdamH's other leaves' LR
# moved its held-out more than its angle did, so MuonH's other leaves take AdamH's best so far
# (3e-2); the angle on the same grid, 1e-2 first (the hero's 0.02 lies within a half decade),
# both arms, by the same rule.
MUONH_ADAM_LR = 3e-2
TUNE_ROWS += [tune_row("muonh", a, qk, MUONH_ADAM_LR) for a in TUNE_ANGLES for qk in (False, True)]


def best8(name: str, lr: float, optim: tuple = ()) -> list[Group]:
    """8 seeds at an arm's best (the evidence's seeds), without and with QK-Norm."""
    base = dataclasses.replace(EVIDENCE, name=name, lrs=(lr,), optim=optim, snapshot_every=0,
                               compare_with=f"{name}-qk", label="")
    return [base, twin(base, compare_with="")]


TUNE_ROWS += best8("story8-adam-best", ADAM_BEST_LR)
# The other leaves at 1e-1 gave 1.524 and, with QK-Norm, 1.496: 3e-2 is both arms' best,
# bracketed, and 3e-3 their best angle (bracketed at the other leaves' 1e-3, not swept again at
# 3e-2). Adam at 3e-4 gave 1.502 and 1.478: 1e-3 is Adam's best in both arms, bracketed. So, by
# the rule, 8 seeds at AdamH's best pair in each arm (declared then):
TUNE_ROWS += best8("story8-adamh-best", 3e-3, (("optimizer", "adamh"), ("adam_lr", 3e-2)))
# MuonH's angle 3e-3 (next by the rule; declared before it ran) decides MuonH's best in each arm:
# where 3e-3 loses to 1e-2, 1e-2 is that arm's best, bracketed (3e-2 lost already), and 8 seeds
# run there (MuonH's other leaves at 3e-2, as in its sweep); where 3e-3 wins, 1e-3 comes next.
# Without QK-Norm 3e-3 gave 1.437 against 1.499 at 1e-2: the grid's edge, so 1e-3 (declared then):
TUNE_ROWS += [tune_row("muonh", 1e-3, False, MUONH_ADAM_LR)]
# With QK-Norm 3e-3 gave 1.451 against 1.511 at 1e-2: the edge too, so 1e-3 (declared then):
TUNE_ROWS += [tune_row("muonh", 1e-3, True, MUONH_ADAM_LR)]
# Without QK-Norm 1e-3 gave 1.532: 3e-3 is that arm's best, bracketed, so 8 seeds there (declared
# then; the QK-Norm arm's when its 1e-3 has run):
MUONH_BEST = (("optimizer", "muonh"), ("adam_lr", MUONH_ADAM_LR))
TUNE_ROWS += best8("story8-muonh-best", 3e-3, MUONH_BEST)[:1]
# With QK-Norm 1e-3 gave 1.530: 3e-3 is that arm's best too, bracketed, so its twin (declared then):
TUNE_ROWS += best8("story8-muonh-best", 3e-3, MUONH_BEST)[1:]
HYPERBALL_ROWS += TUNE_ROWS
# The switch, as a 2 x 3 with its control (declared before any of these ran; its events counted
# from the fork step). Its source first, on one CPU model exactly (the forks are bitwise only
# there): the story baseline with its states kept, then its QK-Norm twin, which gives the
# parting step and the hard-batch control on the same bits. At the source's forks (fork_steps'
# rule), each with the 100-step re-warmup from 0.1x: AdamH, the other leaves on Adam at the
# story's LR, with each matrix's radius {its norm at the switch, its norm at init (the matrix
# rescaled onto it at the switch)} x the angle {0.07, 0.01, matched}; the control, Adam kept
# with the same re-warmup alone; and QK-Norm inserted. The matched angle, declared once the
# source is stored, by this rule: Adam's relative step per layer (update_ratio_per_layer,
# |dW| / |W|) averaged over the layers, the 100 steps before each seed's fork, and the seeds.
SWITCH_CPU = "AMD EPYC (family 25, model 1, stepping 1)"
SWITCH_SRC = dataclasses.replace(EVIDENCE, name="story8-switch-src", cpu=SWITCH_CPU,
                                 compare_with="story8-switch-src-qk", label="")
SWITCH_ROWS = [SWITCH_SRC, twin(SWITCH_SRC, snapshot_every=0, compare_with="")]
SWITCH_ROWS += [dataclasses.replace(SWITCH_SRC, name=name, fork=SWITCH_SRC.name, snapshot_every=0,
                                    lrs=lrs, optim=optim, qk_norm=qk)
                for name, lrs, optim, qk in [
                    *[(f"story8-switch-adamh-{radius}-a{angle:g}", (angle,),
                       ADAMH + REWARM + (("hyperball_radius", radius),), False)
                      for radius in ("switch", "init") for angle in (0.07, 0.01)],
                    ("story8-switch-control", (5e-2,), REWARM, False),
                    ("story8-switch-qk-inserted", (5e-2,), REWARM, True)]]
# The matched angle, declared once the source was stored: lab/harness.py's adam_relative_step
# on its curves (0.0235: Adam's steps were 0.021-0.027 of each layer's norm), to two digits.
MATCHED_ANGLE = 0.024
SWITCH_ROWS += [dataclasses.replace(SWITCH_SRC, name=f"story8-switch-adamh-{radius}-matched",
                                    fork=SWITCH_SRC.name, snapshot_every=0, lrs=(MATCHED_ANGLE,),
                                    optim=ADAMH + REWARM + (("hyperball_radius", radius),))
                for radius in ("switch", "init")]
HYPERBALL_ROWS += SWITCH_ROWS
# The README's six rows of the evidence (lab/tables.py:readme_summary), in its order.
README_ROWS = (("story8", "baseline (no QK-Norm)"), ("story8-qk", "QK-Norm from scratch"),
               ("story8-marin-32b", "the 32B's levers: clip 0.2, skip-step, update clip"),
               ("story8-qk-inserted", "QK-Norm inserted mid-run"),
               ("story8-adamh", "AdamH at one untuned angle (0.07), no QK-Norm"),
               ("story8-b2-batch", "Adam's β2 from the batch (0.9999), no QK-Norm"))
HARNESS_ROWS = {g.name: g for g in (*LEVERS, *SWEEP, *EVIDENCE_GROUPS, *WIDTH_ROWS, *ZLOSS_ROWS,
                                    *KNOB_ROWS, *BREAK_ROWS, *MUP_ROWS, *MACHINE_ROWS,
                                    *TEACH_ROWS, *HYPERBALL_ROWS)}



# Every group by name: the search's own and every row above.
REGISTRY: dict[str, Group] = {g.name: g for g in GROUPS} | HARNESS_ROWS
