"""The laboratory's tests (lab/): the rules over seeds, the rows, the vmapped harness, the tables
and figures on planted members. Run with the rest of the suite by `pytest` (pytest.ini's
testpaths); alone: `pytest lab/`.
"""

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import checkpoint as C
import config as CF
import records as RC
import report as R
import train as T
from lab import breaks as BR
from lab import experiments as EX
from lab import figures as FG
from lab import foresight as F
from lab import harness as H
from lab import rows as RW
from lab import search as SE
from lab import spread as SP
from lab import stats as ST
from lab import store as STO
from lab import tables as TB

# ---------------------------------------------------------------------------------------------
# lab/stats.py: episodes, hard batches, recovery, survival, splicing, the bootstrap

def test_events_within_20_steps_are_one_episode_and_a_shift_makes_it_a_level_shift_episode():
    eps = ST.episodes([100, 110, 125, 300, 600], [305, 1000])
    assert [(e.start, e.end, e.spikes, e.shifts) for e in eps] == [
        (100, 125, 3, 0), (300, 305, 1, 1), (600, 600, 1, 0), (1000, 1000, 0, 1)]
    assert [e.level_shift for e in eps] == [False, True, False, True]
    assert len(ST.episodes([100, 121], [])) == 2  # 21 steps apart: two


def test_an_episode_where_the_stable_twin_jumps_too_is_a_hard_batch():
    steps = np.arange(700)
    twin = 2.0 + 0.01 * np.where(steps % 2, 1.0, -1.0)  # sd 0.01: 3 sigma is 0.03
    twin[200] += 0.1  # a hard batch: the stable twin jumps there too
    twin[260] += 0.02  # under 3 sigma: no jump
    assert list(np.nonzero(ST.jumps(twin))[0]) == [200]
    twin_shift_steps = [410]
    eps = ST.mark_hard_batches(ST.episodes([200, 260], [400, 600]), twin, twin_shift_steps)
    assert [(e.start, e.hard_batch) for e in eps] == [(200, True), (260, False), (400, True),
                                                      (600, False)]
    assert ST.episodes([1], [])[0].hard_batch is None  # no twin asked


def test_a_shift_back_within_the_tolerance_is_recovered_and_one_not_back_is_censored():
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.01 * rng.standard_normal(1000)
    loss[300:500] += 0.3  # a level shift...
    loss[500:] += 0.03  # ...back to 0.03 above the level before: within 0.05
    m = {"step": np.arange(1000), "loss": loss}
    (shift,) = R.find_shifts(m)
    assert shift.recovered_after is None  # the old rule: never back (it asks for the level)
    steps, ok = ST.recovery(loss, shift.step, shift.pre_level)
    assert ok and 500 - shift.step <= steps <= 520 - shift.step
    held = loss.copy()
    held[500:] += 0.3  # never back: censored at the run's end
    assert ST.recovery(held, shift.step, shift.pre_level) == (999 - shift.step, False)
    noisy = 2.0 + 0.5 * rng.standard_normal(1000)  # noise 0.5/sqrt(20) = 0.11 > 0.05
    noisy[600:] += 0.1
    assert ST.recovery(noisy, 600, 2.0)[1]  # within the smoothed loss's own noise at once


def test_recovery_against_the_twin_asks_whether_the_gap_closes_not_whether_the_shift_ends():
    """A baseline that trails its twin by 0.1, shifts up by 0.5 at step 500 and comes down to
    trail it by 0.3 (the shift's own level "back" under the old rule, 0.05 of the level before
    it at a falling twin) is not back against the twin: censored at the end; one that comes
    down to trail it by 0.1 again is back where the gap closes."""
    rng = np.random.default_rng(0)
    n = 1000
    twin = np.linspace(2.0, 1.5, n) + 0.005 * rng.standard_normal(n)
    stuck = twin + 0.1 + np.where(np.arange(n) >= 500, 0.5, 0.0)
    stuck[700:] = twin[700:] + 0.3
    assert ST.recovery_vs_twin(stuck, twin, 500) == (n - 1 - 500, False)
    back = stuck.copy()
    back[700:] = twin[700:] + 0.1
    steps, ok = ST.recovery_vs_twin(back, twin, 500)
    assert ok and 200 <= steps <= 220
    shared = np.where(np.arange(n) >= 500, 0.5, 0.0)  # the twin shifts with it: never apart
    assert ST.recovery_vs_twin(twin + 0.1 + shared, twin + shared, 500) == (0, True)
    nan = back.copy()
    nan[500:] = np.nan  # diverged: never back
    assert ST.recovery_vs_twin(nan, twin, 500) == (499, False)


def test_the_held_out_figure_is_the_mean_of_the_last_1000_steps_evals():
    steps = np.arange(250, 4001, 250)
    loss = np.linspace(3.0, 1.5, len(steps))
    assert ST.held_out(steps, loss, 4000) == pytest.approx(np.mean(loss[-4:]))
    assert ST.held_out([4000], [1.7], 4000) == 1.7  # a fork from 3,750: its one eval
    assert ST.held_out([1000], [1.9], 4000) == 1.9  # none in the window: the last eval


def test_the_survival_table_leaves_censored_shifts_out_once_their_run_has_ended():
    rows = ST.survival([(50, True), (300, True), (200, False), (800, False)], at=(100, 250, 500,
                                                                               1000))
    assert [(r["k"], r["at_risk"], r["not_back"]) for r in rows] == [
        (100, 4, 3), (250, 3, 2), (500, 3, 1), (1000, 2, 0)]
    assert rows[0]["share_not_back"] == 0.75


def test_a_mid_run_arm_is_judged_on_its_source_curve_up_to_the_insertion():
    src = {"step": np.arange(100), "loss": np.full(100, 2.0), "update_norm": np.ones(100)}
    arm = {"step": np.arange(50, 100), "loss": np.full(50, 1.0), "update_norm": np.ones(50),
           "eval_loss": np.array([1.0])}
    m = ST.spliced(src, arm, 50)
    assert list(m) == ["step", "loss", "update_norm"]
    assert list(m["step"]) == list(range(100)) and m["loss"][49] == 2.0 and m["loss"][50] == 1.0
    # a spike 3 steps after the insertion is seen: the history before it is the source's
    rng = np.random.default_rng(0)
    src["loss"] = 2.0 + 0.01 * rng.standard_normal(100)
    arm["loss"] = src["loss"][50:].copy()
    arm["loss"][3] += 1.0
    assert [s.step for s in R.find_spikes(ST.spliced(src, arm, 50))] == [53]
    assert R.find_spikes(arm | {"step": np.arange(50)}) == []  # the arm alone: unarmed


def test_the_bootstrap_interval_is_fixed_and_holds_the_mean():
    v = [1.0, 2.0, 3.0, 4.0, 10.0]
    lo, hi = ST.bootstrap(v)
    assert lo < np.mean(v) < hi and (lo, hi) == ST.bootstrap(v)
    assert ST.bootstrap([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert all(np.isnan(ST.bootstrap([1.0])))


# ---------------------------------------------------------------------------------------------
# lab/rows.py and lab/experiments.py: the rows, the train.py rows' runs and results

def test_the_teach_preset_is_the_teach8_row_that_was_measured():
    """The README's recipe trains `python train.py teach`: its model, optimizer, data and steps
    are the stored teach8 row's (8 of 8 seeds shift), and its checkpoints fall every 100 steps,
    so a warm start can begin before a shift at step ~400."""
    row, preset = RW.TEACH8.config(), CF.PRESETS["teach"]
    assert (row.model, row.optim, row.data, row.steps) == (
        preset.model, preset.optim, preset.data, preset.steps)
    assert RW.twin(RW.TEACH8).config().model == dataclasses.replace(preset.model, qk_norm=True)
    assert preset.checkpoint_every == 100 and preset.keep_checkpoints * 100 >= preset.steps


def test_a_row_records_its_cpu_exactly_and_a_rerun_names_what_differs():
    """Two CPUs sold under one name give other bits: the record keeps /proc/cpuinfo's family,
    model, stepping and the ISA flags XLA:CPU can use; same_bits names each field of a rerun's
    machine that differs (a field an older record lacks, as not recorded)."""
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\n"
               "stepping\t: 1\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw ht\n\n"
               "processor\t: 1\nmodel name\t: AMD EPYC\n")
    got = STO.cpu_identity(cpuinfo)
    assert got == {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17",
                   "cpu_stepping": "1", "isa": ["avx", "avx2", "avx512bw", "avx512f", "fma",
                                                "sse4_2"]}
    assert STO.cpu_label(got) == "AMD EPYC (family 25, model 17, stepping 1)"
    now = got | {"affinity": [0], "jax": "0.10.2"}
    assert STO.same_bits(now, now) == []
    older = {"cpu": "AMD EPYC", "affinity": [0], "jax": "0.10.2"}  # (before the exact record)
    assert STO.same_bits(older, now) == ["cpu_family (not recorded)", "cpu_model (not recorded)",
                                         "cpu_stepping (not recorded)", "isa (not recorded)"]
    assert STO.same_bits(now | {"cpu_model": "1"}, now) == ["cpu_model"]


def test_a_row_declared_for_another_cpu_model_is_refused_before_it_trains(monkeypatch, capsys):
    """teach8-epyc and its twin are teach8's runs again (the same settings, seeds and rules) on
    an AMD EPYC; on another CPU model the command says so in one line and trains nothing."""
    for name, of in (("teach8-epyc", RW.TEACH8), ("teach8-epyc-qk", RW.twin(RW.TEACH8))):
        row = RW.HARNESS_ROWS[name]
        assert row.cpu == "AMD EPYC" and dataclasses.replace(row, name=of.name, cpu="") == of
    xeon = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_family": "6", "cpu_model": "143",
            "cpu_stepping": "8"}
    monkeypatch.setattr(EX, "machine", lambda: xeon)
    monkeypatch.setattr(EX.harness, "run", lambda *a, **k: pytest.fail("it trained"))
    monkeypatch.setattr(EX.harness, "keep_lr", lambda *a, **k: pytest.fail("it trained"))
    for argv in (["teach8-epyc", "--cores", "1"], ["teach8-epyc@0.12"]):  # ROW@LR too
        assert EX.main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: {argv[0]} is declared for an AMD EPYC; this machine is Intel(R) Xeon(R) "
            "Processor (family 6, model 143, stepping 8): run it there"]
    # a row declared for one CPU exactly refuses another of the same name
    epyc = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "cpu_stepping": "1"}
    monkeypatch.setattr(EX, "machine", lambda: epyc)
    assert RW.HARNESS_ROWS["story8-switch-src"].cpu == RW.SWITCH_CPU
    assert EX.main(["story8-switch-src"]) == 2 and "model 17" in capsys.readouterr().err


def test_each_experiment_row_names_its_baseline_source_and_figure(tmp_path):
    """Adding a lever is one row: its baseline, its source and its panels are declared on it,
    and the table and the figures follow the rows (no list of names elsewhere)."""
    for e in RW.EXPERIMENTS:
        assert e.baseline is None or RW.BY_NAME[e.baseline].start == "train", e.name
        assert set(e.panels) <= {RW.LOGITS}, e.name
        assert e.start == "train" or RW.BY_NAME[e.source].start == "train", e.name
    rng = np.random.default_rng(0)

    def run(level):
        n = 120
        return {"step": np.arange(n, dtype=float), "loss": level + 0.01 * rng.standard_normal(n),
                "update_norm": np.ones(n), "attn_logit_max": np.ones((n, 2)),
                "eval_step": np.array([n - 1.0]), "eval_loss": np.array([level])}
    metrics = {"baseline": {s: run(2.0 + 0.01 * s) for s in (0, 1, 2)},
               "guard": {s: run(1.5 + 0.01 * s) for s in (0, 1, 2)},
               "marin-32b": {s: run(2.0 - 0.01 * s) for s in (0, 1, 2)}}
    rows = {name: {"seeds": {s: R.summary(m) for s, m in runs.items()},
                   **{k: ST.spread([R.summary(m)[k] for m in runs.values()]) for k in EX.STATS}}
            for name, runs in metrics.items()}
    text = EX.table(rows, [0, 1, 2])
    assert "| guard | 1.510 ± 0.010 | better (-0.500) |" in text
    assert "| marin-32b | 1.990 ± 0.010 | no measurable difference |" in text
    paths = FG.figures(metrics, rows, tmp_path)
    assert [p.name for p in paths] == ["attn_logits_per_layer.png"]


def test_the_mechanism_of_an_event_is_read_per_layer_against_the_level_before():
    rng = np.random.default_rng(0)
    n, L, event = 400, 3, 300
    loss = 2.0 + 0.01 * rng.standard_normal(n)
    loss[event:] += 0.5  # a level shift at 300
    ones = np.ones((n, L))
    upd, mu = ones.copy(), ones.copy()
    upd[event - 3:, 1] = 2.0  # layer 1's update norm doubles 3 steps before the loss moves
    mu[event:, 2] = 4.0  # layer 2's first moment x4 at the event
    m = {"step": np.arange(n), "loss": loss, "update_norm_per_layer": upd,
         "adam_mu_norm_per_layer": mu, "adam_nu_norm_per_layer": ones,
         "attn_logit_max": ones}
    (e,) = [x for x in TB.mechanism({7: m}) if x["kind"] == "shift"]
    shift = R.find_shifts(m)[0].step  # 304: the smoothed loss is 0.1 up 4 steps after the jump
    assert (e["seed"], e["step"], e["first_layer"]) == (7, shift, 1)
    assert e["update"] == [1.0, 2.0, 1.0] and e["mu"] == [1.0, 1.0, 4.0] and e["nu"] == [1.0] * 3
    assert f"| 7 | shift | {shift} |" in TB.mechanism_table([e])


def test_a_rescue_catches_up_at_the_first_eval_within_005_of_qk_norm_at_that_step(
        tmp_path, monkeypatch):
    twin = {"seed": 1, "eval_step": [250, 500, 750], "eval_loss": [2.0, 1.8, 1.7]}
    (tmp_path / "search.json").write_text(json.dumps(
        {"groups": {"d64-b2.95-warmup1000-4k-qk": {"members": [twin]}}}))
    monkeypatch.setattr(EX, "RESULTS", tmp_path)
    m = {"eval_step": np.array([249, 499, 749]), "eval_loss": np.array([1.9, 1.9, 1.74])}
    assert EX.caught_up(m, 1, 0) == 250  # train.py logs the eval after N steps at step N - 1
    assert EX.caught_up(m, 1, 250) == 750  # 1.9 > 1.8 + 0.05 at 500
    assert EX.caught_up(m, 2, 0) is None  # no twin of that seed


def test_lr_sensitivity_recovery_and_the_spread_rule():
    finals = {"1e-3": 2.5, "1e-2": 2.0, "3e-2": 2.2, "1e-1": 6.0, "3e-1": np.nan}
    # 1e-1 ends above the initial loss and 3e-1 diverged: both count at the initial 5.5
    assert BR.lr_sensitivity(finals, 5.5) == pytest.approx(np.mean([2.5, 2.0, 2.2, 5.5, 5.5])
                                                           - 2.0)
    spiky = {"step": np.arange(300.0), "loss": np.full(300, 2.0)}
    rescue = {"step": np.arange(150.0, 300.0), "loss": np.r_[np.full(30, 2.5), np.full(120, 1.9)]}
    # the 20-step mean first reaches 2.0 with 3 of its steps at 2.5: (3 x 2.5 + 17 x 1.9) / 20
    assert EX.recovery_after_warm_start(rescue, spiky, start=150) == 46
    assert EX.recovery_after_warm_start({**rescue, "loss": rescue["loss"] + 1}, spiky,
                                       start=150) is None
    # a difference is called only where the two bootstrap intervals of the mean do not overlap
    # (with 3 seeds the percentile interval is the seeds' range: each seed alone is drawn in
    # 1 of 27 resamples, more than 2.5%)
    base = {"eval_loss": ST.spread([2.0, 2.1, 2.2])}
    assert base["eval_loss"]["ci"] == [2.0, 2.2]
    assert ST.compare({"eval_loss": ST.spread([1.96, 1.98, 2.0])}, base) == \
        "no measurable difference"  # the ranges touch at 2.0
    assert ST.compare({"eval_loss": ST.spread([1.9, 1.95, 1.98])}, base) == "better (-0.157)"
    assert ST.compare({"eval_loss": ST.spread([1.7, 1.75, 1.8])}, base) == "better (-0.350)"
    assert ST.compare({"eval_loss": ST.spread([2.5, 2.6, 2.7])}, base) == "worse (+0.500)"


def test_a_warm_start_begins_after_the_first_level_shift_or_else_the_first_spike_past_warmup(
        tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.01 * rng.standard_normal(2000)
    loss[600] = loss[1300] = 4.0  # one-step spikes: in the warmup (1,000 steps) and after it
    monkeypatch.setattr(EX, "read_metrics", lambda src: {"step": np.arange(2000.0),
                                                        "loss": loss})
    rescue = RW.BY_NAME["rescue-marin-32b"]
    assert EX.start_step(rescue, tmp_path) == 1500  # no shift: the spike at 1,300, every 250
    loss[1700:] += 0.5  # a level shift comes first in the rule's order
    assert EX.start_step(rescue, tmp_path) == 1750
    loss[:] = 2.0 + 0.01 * rng.standard_normal(2000)
    loss[600] = 4.0
    assert EX.start_step(rescue, tmp_path) is None  # only a spike inside the warmup


def test_a_replace_run_resumes_at_the_last_checkpoint_before_the_replaced_batches(
        tmp_path, monkeypatch):
    monkeypatch.setattr(EX, "saved_steps", lambda src: [250, 500, 750, 1000])
    monkeypatch.setattr(EX, "largest_event", lambda src: 770)
    replace = RW.BY_NAME["replace-batches"]
    assert EX.rewound_to(replace, tmp_path) == 750  # batches 750:770 replaced
    monkeypatch.setattr(EX, "largest_event", lambda src: 765)
    assert EX.rewound_to(replace, tmp_path) == 500  # 745:765: the checkpoint at 750 is too late
    monkeypatch.setattr(EX, "largest_event", lambda src: 10)
    assert EX.rewound_to(replace, tmp_path) is None  # no checkpoint before: nothing to rewind
    monkeypatch.setattr(EX, "start_step", lambda e, src: 1000)
    assert EX.rewound_to(RW.BY_NAME["qk-clip-switched-on"], tmp_path) == 1000


# ---------------------------------------------------------------------------------------------
# lab/harness.py: the vmapped step, kept LRs, forks, guarded rows

@pytest.mark.slow
def test_a_search_member_is_the_train_py_run_of_its_lr_and_seed(tmp_path):
    """The harness vmaps train.py's own step over seeds (one compiled step per LR): for 120 steps
    each member's losses and held-out losses are those of the plain train.py run with that LR
    and seed, to float32 rounding: vmapped matmuls add in another order. Measured on this model:
    at LR 3e-3 the losses agree within 3e-7 relative for 300 steps; at 1e-2 and 2e-2 (a
    chaotic regime for d_model 32) they part past 1e-4 at steps 35 and 33 and past 1e-2 at
    steps 44 and 55: rounding, amplified, as between two CPU models."""
    g = RW.Group("test", d_model=32, n_layers=2, steps=120, warmup_steps=20, lrs=(1e-3, 3e-3),
                 seeds=(0, 1), batch_size=8, seq_len=32)
    arrays = H.train_group(g, chunk=50, eval_every=60, log=lambda s: None)
    assert arrays["loss"].shape == (4, 120) and arrays["attn_logit_max"].shape == (4, 120, 2)
    lr, seed = H.member_grid(g)[3]  # (3e-3, seed 1): the second along both axes of the grid
    base = g.config(lr)
    cfg = dataclasses.replace(base, run_dir=str(tmp_path / "m3"), seed=seed, eval_every=60,
                              data=dataclasses.replace(base.data, seed=seed))
    T.train(cfg, devices=jax.devices()[:1])
    m = RC.read_metrics(cfg.run_dir)
    np.testing.assert_allclose(arrays["loss"][3], m["loss"], rtol=1e-5)
    np.testing.assert_allclose(arrays["grad_norm"][3], m["grad_norm"], rtol=2e-3)
    np.testing.assert_allclose(arrays["eval_loss"][3], m["eval_loss"], rtol=1e-5)
    for other in (1, 2):  # the same seed at the other LR, the same LR with the other seed
        assert not np.allclose(arrays["loss"][3], arrays["loss"][other], rtol=1e-3)


def test_a_group_killed_after_one_lr_goes_on_from_the_next(tmp_path, monkeypatch):
    """A width of the proxy is hours of LRs: each LR's arrays are kept as it finishes, and the
    next call reads them back and trains only the LRs left; another group's LRs are refused."""
    g = RW.Group("kept", d_model=32, n_layers=2, steps=4, lrs=(1e-3, 3e-3), seeds=(0, 1))
    trained = []

    def fake(cfg, seeds, *args, **kw):
        trained.append(cfg.optim.lr)
        if len(trained) == 2:
            raise KeyboardInterrupt  # killed during the second LR
        return {"loss": np.full((2, 4), cfg.optim.lr), "eval_step": np.array([4]),
                "first_step": np.int64(0), "seconds": 1.5}

    monkeypatch.setattr(H, "train_members", fake)
    with pytest.raises(KeyboardInterrupt):
        H.train_group(g, log=lambda s: None, keep=tmp_path)
    a = H.train_group(g, log=lambda s: None, keep=tmp_path)
    assert trained == [1e-3, 3e-3, 3e-3]  # the first LR was not trained again
    np.testing.assert_array_equal(a["loss"][:, 0], [1e-3, 1e-3, 3e-3, 3e-3])
    assert a["seconds"] == 3.0
    with pytest.raises(H.UserError, match="another kept"):
        H.train_group(dataclasses.replace(g, steps=8), log=lambda s: None, keep=tmp_path)


def test_a_rows_lrs_trained_apart_are_recorded_with_each_processs_machine(tmp_path,
                                                                           monkeypatch):
    """A d_model 128 row spans sessions, machines, or processes (lab/spread.py: ROW@LR): one LR
    trained alone is kept, unrecorded; recording the row then trains only the LRs not kept and
    lists each call's machine (and what it found kept) under `sessions`, whose CPU models or
    accelerators the tables name (group_cpu); an LR trained on another corpus (the embedded
    one is the running Python's standard library) is refused; the kept folder is emptied once
    the row is recorded."""
    g = RW.Group("spanned", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, steps=8,
                 warmup_steps=4, lrs=(1e-3, 1e-2), seeds=(0,), batch_size=8, seq_len=32)
    monkeypatch.setattr(STO, "OUT", tmp_path / "search.json")
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path / "curves")
    monkeypatch.setattr(H, "SNAPSHOTS", tmp_path / "kept")
    real, trained = H.train_members, []

    def counted(cfg, *args, **kw):
        trained.append(cfg.optim.lr)
        return real(cfg, *args, **kw)
    monkeypatch.setattr(H, "train_members", counted)
    H.keep_lr(g, 1e-2, log=lambda s: None)
    assert trained == [1e-2] and STO.load()["groups"] == {}
    with pytest.raises(H.UserError, match="has no LR 0.005"):
        H.keep_lr(g, 5e-3)
    sessions = tmp_path / "kept" / "spanned" / "sessions.jsonl"
    line = sessions.read_text()  # an LR kept under another Python (its corpus): not mixed in
    sessions.write_text(line.replace(H.machine_record()["corpus_sha256"], "0" * 16))
    with pytest.raises(H.UserError, match="another corpus"):
        H.keep_lr(g, 1e-3)
    sessions.write_text(line)
    alone = H.train_group(dataclasses.replace(g, lrs=(1e-2,)), log=lambda s: None,
                          keep=tmp_path / "kept" / "spanned")  # all kept: it trains nothing,
    assert trained == [1e-2] and len(alone["sessions"]) == 1  # and is no session
    H.run([g])
    entry = STO.load()["groups"]["spanned"]
    assert trained == [1e-2, 1e-3] and [m["lr"] for m in entry["members"]] == [1e-3, 1e-2]
    assert [s["kept"] for s in entry["sessions"]] == [[], ["lr0.01.npz"]]
    assert [s["trains"] for s in entry["sessions"]] == [[1e-2], [1e-3]]  # each LR's machine
    assert STO.lr_cpu(entry, 1e-3) == H.machine_record()["cpu"] and STO.lr_cpu(entry, 3.0) is None
    assert entry["sessions"][1]["machine"] == entry["machine"] == H.machine_record()
    assert entry["machine"]["device"] == "cpu"
    assert sorted(p.name for p in (tmp_path / "kept" / "spanned").iterdir()) == ["settings.json"]
    one, two = ({"machine": {"cpu": c}} for c in ("AMD EPYC", "Intel Xeon"))
    gpu = {"machine": {"cpu": "Intel Xeon", "device": "NVIDIA H200"}}
    assert STO.group_cpu({**two, "sessions": [one, one, two, gpu]}) \
        == "AMD EPYC + Intel Xeon + NVIDIA H200"
    assert STO.group_cpu(two) == "Intel Xeon" and STO.group_cpu({}) is None


def test_spread_runs_n_at_a_time_each_on_a_free_core_and_stops_at_the_deadline(tmp_path):
    """lab/spread.py's scheduler: at most `jobs` commands at once, none on a core a running one
    holds; none starts after the deadline, and one running then is stopped (None), as is one
    never started."""
    seconds = {"a": 0.1, "b": 0.1, "slow": 60, "c": 0.1, "late": 0.1, "slow2": 60, "never": 0.1}
    cores = {}

    def argv(name, core):  # each command writes when it started and, if it ends, when
        cores[name], at = core, tmp_path / f"{name}.times"
        return [sys.executable, "-c", f"import time; f = open({str(at)!r}, 'w'); "
                f"f.write(f'{{time.time()}} '); f.flush(); time.sleep({seconds[name]}); "
                "f.write(f'{time.time()}')"]
    codes = SP.run_spread(list(seconds), jobs=2, deadline=3.5, logs=tmp_path / "logs",
                          cores=[5, 7], log=lambda s: None, argv=argv)
    assert codes == {"a": 0, "b": 0, "slow": None, "c": 0, "late": 0, "slow2": None,
                     "never": None}
    spans = {n: [float(x) for x in (tmp_path / f"{n}.times").read_text().split()] + [math.inf]
             for n in cores}
    assert "never" not in cores and sorted(cores) == sorted(set(seconds) - {"never"})
    for n, (t0, *_) in spans.items():
        beside = [m for m, (u0, u1, *_) in spans.items() if m != n and u0 <= t0 < u1]
        assert len(beside) <= 1 and all(cores[m] != cores[n] for m in beside), (n, beside)
    assert set(cores.values()) == {5, 7} and (tmp_path / "logs" / "a.log").exists()


def test_damaged_kept_arrays_and_records_are_one_line_each(tmp_path, monkeypatch):
    """What the harness wrote and reads back, damaged, is a UserError naming the file: a kept
    LR truncated, empty or without its loss; a kept folder without its settings.json, or whose
    settings.json is a folder; a stored curve truncated or missing; search.json truncated or
    holding no groups. Nothing is trained or rewritten on the way."""
    g = RW.Group("kept", d_model=32, n_layers=1, steps=4, lrs=(1e-3,), seeds=(0, 1))
    keep = tmp_path / "kept"
    keep.mkdir()
    (keep / "settings.json").write_text(json.dumps(g.settings(), sort_keys=True))
    whole = {k: np.zeros((2, 4)) for k in ("loss", "update_norm", "attn_logit_max")} | {
        "eval_step": np.array([4]), "eval_loss": np.zeros((2, 1)), "first_step": np.int64(0),
        "seconds": np.float64(1.0)}
    np.savez(keep / "lr0.001.npz", **whole)
    blob = (keep / "lr0.001.npz").read_bytes()
    for damage, message in ((blob[:len(blob) // 2], "cannot be read"), (b"", "cannot be read"),
                            (None, "is not LR 0.001 of kept")):
        if damage is None:
            np.savez(keep / "lr0.001.npz", **{k: v for k, v in whole.items() if k != "loss"})
        else:
            (keep / "lr0.001.npz").write_bytes(damage)
        with pytest.raises(H.UserError, match=message):
            H.train_group(g, keep=keep, log=lambda s: None)
    (keep / "settings.json").unlink()
    with pytest.raises(H.UserError, match="no settings.json"):
        H.train_group(g, keep=keep, log=lambda s: None)
    (keep / "settings.json").mkdir()
    with pytest.raises(H.UserError, match="is not a file"):
        H.train_group(g, keep=keep, log=lambda s: None)
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    (tmp_path / "row").mkdir()
    (tmp_path / "row" / "seed0.npz").write_bytes(blob[:100])
    with pytest.raises(H.UserError, match="seed0.npz cannot be read"):
        STO.read_curve("row", "seed0")
    with pytest.raises(H.UserError, match="seed1.npz is missing"):
        STO.read_curve("row", "seed1")
    monkeypatch.setattr(STO, "OUT", tmp_path / "search.json")
    for text, message in (('{"groups": {"a": ', "cannot be read"), ("{}", "no groups")):
        (tmp_path / "search.json").write_text(text)
        with pytest.raises(H.UserError, match=message):
            STO.load()


def test_an_lr_killed_between_evaluations_goes_on_from_the_last_one_bitwise(tmp_path):
    """An LR of d_model 128 is ~46 minutes on one core: its state and metrics are kept at each
    held-out evaluation, and a killed LR goes on from there; every array then equals the
    uninterrupted run's bit for bit, and the progress file goes once the LR's arrays are kept."""
    g = RW.Group("resumed", d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, steps=12,
                 warmup_steps=4, lrs=(1e-2,), seeds=(0, 1), batch_size=8, seq_len=32)
    quiet = dict(chunk=3, eval_every=6, log=lambda s: None)
    whole = H.train_members(g.config(1e-2), g.seeds, **quiet)

    def killed(line):  # dies as it reports its first evaluation (kept just before)
        if "step 6/12" in line:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        H.train_group(g, keep=tmp_path, **{**quiet, "log": killed})
    assert (tmp_path / "lr0.01.progress.npz").exists() and not (tmp_path / "lr0.01.npz").exists()
    lines = []
    again = H.train_group(g, keep=tmp_path, **{**quiet, "log": lines.append})
    assert any("step 6: read back from" in x for x in lines)  # not trained from 0
    for k in ("loss", "grad_norm", "attn_logit_max", "eval_loss", "eval_step", "probe_sink"):
        np.testing.assert_array_equal(again[k], whole[k], err_msg=k)
    assert whole["probe_sink"].shape == (2, 2, 1)  # members, evaluations, layers
    assert np.all((whole["probe_sink"] > 0) & (whole["probe_sink"] < 1))
    assert not (tmp_path / "lr0.01.progress.npz").exists() and (tmp_path / "lr0.01.npz").exists()


def test_a_rerun_trains_the_rows_members_together_and_finds_where_it_parts(tmp_path,
                                                                          monkeypatch):
    """--rerun trains a stored member the way its row was trained (every seed in one vmapped
    step): on the same machine it is the stored curve bit for bit; where the stored curve holds
    another value at step 7 the rerun says it parts there. A guarded row is refused in one
    line (its seeds are train.py runs), a probe longer than the row too."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    g = RW.Group("probe", d_model=32, n_layers=1, steps=10, warmup_steps=4, lrs=(1e-2,),
                 seeds=(0, 1), batch_size=8, seq_len=32)
    a = H.train_members(g.config(), g.seeds, eval_every=5, log=lambda s: None)
    (tmp_path / "probe").mkdir()
    for s in g.seeds:
        np.savez(tmp_path / "probe" / f"seed{s}.npz", loss=a["loss"][s])
    bits, member = EX.rerun_member(g, 1, log=lambda s: None)
    assert bits == {"parts_at": None, "compared": 10, "others": {0: None}}
    np.testing.assert_array_equal(member["loss"], a["loss"][1])
    moved = a["loss"][1].copy()
    moved[7] = np.nextafter(moved[7], np.float32(np.inf))  # one float32 ulp
    np.savez(tmp_path / "probe" / "seed1.npz", loss=moved)
    assert EX.rerun_member(g, 1, steps=9, log=lambda s: None)[0] == {
        "parts_at": 7, "compared": 9, "others": {0: None}}
    assert EX.first_parting(np.array([1.0, np.nan]), np.array([1.0, np.nan])) is None
    monkeypatch.setattr(STO, "OUT", tmp_path / "search.json")
    (tmp_path / "search.json").write_text(json.dumps({"groups": {
        g.name: {"members": []} for g in RW.EVIDENCE_GROUPS}}))
    with pytest.raises(EX.UserError, match="guarded row's seeds are train.py runs"):
        EX.rerun("story8-guard-predict", 5)
    with pytest.raises(EX.UserError, match="--rerun-steps must be in 1..4000"):
        EX.rerun("story8", 5, steps=5000)


def test_a_guarded_group_is_its_train_py_runs_and_a_second_run_reads_them(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(H, "SNAPSHOTS", tmp_path)
    g = RW.Group("guarded", d_model=32, n_layers=2, steps=12, warmup_steps=4, seeds=(0, 1),
                 batch_size=8, seq_len=32, guard=(("escalate", "qk-norm"),))
    assert g.config().guard.on and g.config().guard.escalate == "qk-norm"
    a = H.train_guarded(g, log=lambda s: None)
    assert a["loss"].shape == (2, 12) and a["attn_logit_max"].shape == (2, 12, 2)
    for i, seed in enumerate(g.seeds):
        m = RC.read_metrics(tmp_path / "guarded" / f"seed{seed}")
        np.testing.assert_array_equal(a["loss"][i], m["loss"])
        assert C.read_config(tmp_path / "guarded" / f"seed{seed}")["seed"] == seed
    assert list(a["eval_step"]) == [12] and a["recomputed"].tolist() == [0, 0]
    assert not np.array_equal(a["loss"][0], a["loss"][1])
    # lab/probe.py's figures of each run's last checkpoint: the sink a share of the attention,
    # the gate's NaN (no escalation happened, so no gate); the seeds' sinks differ
    assert a["probe_sink"].shape == (2, 1, 2) and np.all((a["probe_sink"] > 0)
                                                         & (a["probe_sink"] < 1))
    assert np.isnan(a["probe_gate_norm"]).all() and np.isnan(a["probe_gate_mean"]).all()
    assert not np.array_equal(a["probe_sink"][0], a["probe_sink"][1])
    files = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("metrics.jsonl")}
    again = H.train_guarded(g, log=lambda s: None)  # finished: read back, not trained again
    np.testing.assert_array_equal(again["loss"], a["loss"])
    assert files == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("metrics.jsonl")}


def test_a_fork_starts_at_the_boundary_after_the_first_event_and_needs_room(tmp_path,
                                                                           monkeypatch):
    """QK-Norm inserted mid-run starts at the first 250-step boundary after the source seed's
    first level shift, or else after its first spike past the warmup; a seed whose boundary is
    the run's end, or with no event, is left out."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    rng = np.random.default_rng(0)
    (tmp_path / "story8").mkdir()
    for seed, (spike, shift) in enumerate([(None, 1960), (1500, None), (None, 3890),
                                           (None, None), (500, None)]):
        loss = 2.0 + 0.01 * rng.standard_normal(4000)
        if spike:
            loss[spike] += 1.0
        if shift:
            loss[shift:] += 0.3
        np.savez(tmp_path / "story8" / f"seed{seed}.npz", loss=loss, update_norm=np.ones(4000))
    fork = dataclasses.replace(RW.EVIDENCE_GROUPS[3], seeds=(0, 1, 2, 3, 4))
    assert H.fork_steps(fork) == {0: 2000, 1: 1750}  # 3,890: no room; none; 500: in warmup


def test_a_qk_clip_fork_switches_it_on_at_the_fork_step_as_a_resume_does(tmp_path,
                                                                         monkeypatch):
    """A fork without QK-Norm carries the kept state as it is and acts with QK-Clip from the
    fork step on: its steps are those of one run with `qk_clip_start` at that step, whose steps
    before it are the source's (each to float32 rounding: the compiled programs differ). A
    fork that inserts the attention gate (the parameters sharded as the harness's steps take
    them) starts at the source's loss: the gate is exactly 1 there."""
    monkeypatch.setattr(H, "SNAPSHOTS", tmp_path)
    src = RW.Group("src", d_model=32, n_layers=1, steps=30, warmup_steps=5, lrs=(1e-2,),
                   seeds=(0, 1), batch_size=8, seq_len=32, snapshot_every=15)
    fork = dataclasses.replace(src, name="fork", fork="src", snapshot_every=0,
                               optim=(("qk_clip", 0.5),))  # below every head's max: it acts
    monkeypatch.setitem(RW.REGISTRY, "src", src)
    monkeypatch.setattr(H, "fork_steps", lambda g: {0: 15, 1: 15})
    quiet = dict(eval_every=15, log=lambda s: None)
    a = H.train_members(src.config(), src.seeds, snapshot_at=(15,),
                         snapshot=functools.partial(H.save_snapshot, "src"), **quiet)
    seeds, f = H.train_fork(fork, log=lambda s: None)["parts"][15]
    cfg = fork.config()
    one = H.train_members(dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, qk_clip_start=15)), src.seeds, **quiet)
    assert seeds == (0, 1) and int(f["first_step"]) == 15 and f["loss"].shape == (2, 15)
    np.testing.assert_allclose(one["loss"][:, :15], a["loss"][:, :15], rtol=1e-6)
    # (rounding, amplified over the fork's 15 steps: 1.7e-5 relative at its last step under
    # the suite's XLA flags; QK-Clip's effect, below, is past 1e-3)
    np.testing.assert_allclose(f["loss"], one["loss"][:, 15:], rtol=1e-4)
    assert (f["qk_clip_heads"].sum(axis=1) > 0).all()  # it clipped heads after the fork
    assert not np.allclose(f["loss"][:, 1:], a["loss"][:, 16:], rtol=1e-3)  # and it mattered
    gated = dataclasses.replace(fork, name="gated", optim=(), model=RW.GATE)
    _, g = H.train_fork(gated, log=lambda s: None)["parts"][15]
    np.testing.assert_allclose(g["loss"][:, 0], a["loss"][:, 15], rtol=1e-6)
    assert np.isfinite(g["probe_gate_mean"]).all() and (g["probe_gate_norm"] > 0).all()


# ---------------------------------------------------------------------------------------------
# lab/search.py: the story search's verdicts

def test_the_search_judges_s1_and_the_spikes_after_it_by_the_fixed_rules():

    def row(group, seed, evals, spikes):
        return {"group": group, "lr": 0.01, "seed": seed, "eval_step": [250, 500, 750, 1000],
                "eval_loss": evals, "spike_steps": spikes, "shift_steps": [],
                "max_attn_logit": 10.0}
    rows = []
    for seed in (0, 1, 2):
        rows.append(row("g", seed, [2.0, 1.80, 1.75, 1.9], [100, 800, 900, 950]))
        rows.append(row("g-qk", seed, [2.0, 1.78, 1.60, 1.5], [100]))
    verdicts = SE.judge(rows)
    # the last eval within 0.05 nats of the QK-Norm run: step 500; the spike at 100 is before
    assert [(v["s1"], v["spikes_after_s1"], v["qk_spikes"]) for v in verdicts] == \
        [(500, 3, 1)] * 3
    assert SE.story_found(verdicts) == [("g", 0.01)]
    rows[0]["spike_steps"] = [800, 900]  # seed 0: 2 spikes after the parting step, short of 3
    assert SE.story_found(SE.judge(rows)) == []


# ---------------------------------------------------------------------------------------------
# lab/tables.py, lab/breaks.py and lab/figures.py: every table from the stored curves

def test_the_levers_count_events_after_the_baselines_s1_of_each_seed():

    def member(seed, evals, spikes, shifts=()):
        return {"seed": seed, "eval_step": [250, 500, 750], "eval_loss": evals,
                "spike_steps": spikes, "shift_steps": list(shifts), "max_attn_logit": 9.0}
    lever = RW.LEVERS[1].name
    record = {"groups": {
        RW.STORY.name: {"members": [member(0, [2.0, 1.8, 1.9], [100, 600], [700]),
                                    member(1, [2.0, 1.9, 2.0], [600, 700])]},
        RW.STORY.name + "-qk": {"members": [member(0, [2.0, 1.78, 1.6], []),
                                            member(1, [2.0, 1.7, 1.6], [600])]},
        lever: {"members": [member(0, [2.0, 1.8, 1.7], [100, 550]),
                            member(1, [2.0, 1.8, 1.7], [200])]}}}
    rows = TB.lever_rows(record)
    # the parting step: the baseline's last eval within 0.05 of QK-Norm's, per seed (500 and 250);
    # every row counts its events from the baseline's parting step in that seed
    assert [r["s1"] for r in rows] == [[500, 250]] * 3
    assert [(r["spikes"], r["shifts"]) for r in rows] == [([1, 2], [1, 0]), ([0, 1], [0, 0]),
                                                         ([1, 0], [0, 0])]
    assert "| clip-0.2 | 1, 0 | 0, 0 | 1.700 ± 0.000 |" in TB.levers_markdown(record)


def test_the_matched_angle_is_adams_relative_step_before_the_forks():
    """The switch's matched angle (lab/rows.py), declared once its source was stored, is the
    declared rule's figure on the stored curves to two digits, and both matched rows run it."""
    assert RW.MATCHED_ANGLE == float(f"{H.adam_relative_step(RW.SWITCH_ROWS[2]):.2g}")
    matched = [g for g in RW.SWITCH_ROWS if g.name.endswith("-matched")]
    assert len(matched) == 2 and {g.lrs for g in matched} == {(RW.MATCHED_ANGLE,)}


def test_the_switch_table_counts_each_row_from_its_seeds_fork_step(monkeypatch):
    """switch_rows on stored rows of the same shape (the Intel Xeon's source, AdamH switched on
    and QK-Norm inserted at its forks), two of its seeds: every row, the source's included, is
    judged on the seeds that fork and counts events from that seed's fork step, so the source's
    row is what the forks would have been without the change."""
    record = STO.load()
    rows = [H.REGISTRY[n] for n in ("story8-xeon", "story8-qk", "story8-xeon-adamh-switched",
                                    "story8-xeon-qk-inserted")]
    starts = {0: 2750, 3: 2500}  # (fork_steps' for these two seeds)
    monkeypatch.setattr(TB, "SWITCH_ROWS", rows)
    monkeypatch.setattr(TB, "fork_steps", lambda g: starts)
    got = TB.switch_rows(record)
    assert [r["group"] for r in got] == [g.name for g in rows]
    for r in got:
        assert {p["seed"]: p["from"] for p in r["per_seed"]} == starts
        assert all(e.start >= p["from"] for p in r["per_seed"] for e in p["episodes"])
    for p in got[0]["per_seed"]:  # the source's max logit: from its fork step on, not before
        c = STO.seed_curve("story8-xeon", p["seed"])
        assert p["max_logit"] == float(np.nanmax(c["attn_logit_max"][starts[p["seed"]]:]))
    assert [round(sum(r["with_shift"]["values"])) for r in got] == [2, 0, 1, 0]


def test_the_evidence_counts_episodes_by_the_fixed_rules_from_the_stored_curves(
        tmp_path, monkeypatch):
    """Planted curves for 3 seeds: after the parting step (500) a hard batch at 520 (the QK-Norm
    twin jumps there too), a spike of the baseline's own at 700, a level shift at 800 that is not
    back at the end (censored), QK-Norm inserted at 750 into the baseline (spliced: its detectors
    see the baseline's steps before 750)."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    rng = np.random.default_rng(0)

    def write(group, seed, loss, first=0, evals=(2.0, 1.9, 1.9)):
        (tmp_path / group).mkdir(exist_ok=True)
        n = len(loss)
        np.savez(tmp_path / group / f"seed{seed}.npz", loss=loss, update_norm=np.ones(n),
                 grad_norm=np.ones(n), attn_logit_max=np.ones((n, 2)),
                 eval_step=np.array([250, 500, 1000]), eval_loss=np.array(evals),
                 first_step=np.int64(first))
    for seed in (0, 1, 2):
        twin = 2.0 + 0.02 * rng.standard_normal(1000)
        base = twin + 0.01
        twin[520] += 1.0
        base[520] += 1.0
        base[700] += 1.0
        base[800:] += 0.3
        write("story8", seed, base, evals=(2.0, 1.9, 2.2))
        write("story8-qk", seed, twin)
        write("story8-qk-inserted", seed, twin[750:].copy(), first=750)
    record = {"groups": {g: {"members": [{"seed": s} for s in (0, 1, 2)]}
                         for g in ("story8", "story8-qk", "story8-qk-inserted")}}
    rows = {r["group"]: r for r in TB.evidence_rows(record)}
    base = rows["story8"]
    assert [(e.start, e.level_shift, e.hard_batch) for e in base["per_seed"][0]["episodes"]] \
        == [(520, False, True), (700, False, False), (800, True, False)]
    assert base["episodes"]["mean"] == pytest.approx(3 / 500 * 1000)  # 3 in the 500 after it
    assert base["instability_episodes"]["mean"] == pytest.approx(2 / 500 * 1000)
    assert base["level_shift_episodes"]["mean"] == pytest.approx(1 / 500 * 1000)
    assert base["unrecovered"]["mean"] == 1.0
    assert base["survival"][0] == {"k": 100, "at_risk": 3, "not_back": 3, "share_not_back": 1.0}
    assert base["survival"][2]["at_risk"] == 0  # censored: the runs ended 199 steps after
    inserted = rows["story8-qk-inserted"]
    assert [p["from"] for p in inserted["per_seed"]] == [750] * 3
    assert inserted["episodes"]["mean"] == 0.0  # the twin's steps, spliced: no event
    again = dict(base, group="story8-probed")  # the same curves trained again: named, once
    text = TB.evidence_markdown([*rows.values(), again])
    assert "| story8 | 3 | 100% [100%, 100%] | 2.00 [2.00, 2.00] | 6.00 [6.00, 6.00] (3) |" in text
    assert "every figure equal: story8-probed = story8." in text and "| story8-probed" not in text
    recovery = text[text.index("Recovery"):]
    assert "| story8 | 3; 3 (19" in recovery and "| 100% (3) | — | — | — |" in recovery
    assert "| story8-qk-" not in recovery  # no shift: no row


def test_the_lr_sweep_reads_final_losses_and_lr_sensitivity_per_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(STO, "CURVES", tmp_path)
    record = {"groups": {}}
    finals = {(1e-1, False): [2.0, 2.2, 2.1], (1e-1, True): [1.7, 1.8, 1.75],
              (3e-1, False): [9.0, np.nan, 2.6], (3e-1, True): [1.8, 1.9, 1.85]}
    for g in RW.SWEEP:
        key = (g.lrs[0], g.qk_norm)
        if key not in finals:
            continue
        np.savez(tmp_path / f"{g.name}.npz", loss=np.full((3, 5), 5.5))
        record["groups"][g.name] = {"members": [
            {"seed": s, "eval_step": [4000], "eval_loss": [x], "finite": bool(np.isfinite(x)),
             "spike_steps": [1200] * s, "shift_steps": [], "max_attn_logit": 10.0 ** (s + 1)}
            for s, x in enumerate(finals[key])]}
    rows = BR.sweep_rows(record)
    assert [(r["lr"], r["qk_norm"]) for r in rows] == sorted(finals)
    sens = BR.sensitivity(rows)
    # seed 0 without QK-Norm: 9.0 ends above the initial 5.5, counted at 5.5; seed 1 diverged
    assert sens[False] == pytest.approx([(2.0 + 5.5) / 2 - 2.0, (2.2 + 5.5) / 2 - 2.2,
                                         (2.1 + 2.6) / 2 - 2.1])
    assert sens[True] == pytest.approx([0.05, 0.05, 0.05])
    text = BR.sweep_markdown(record)
    assert "| 0.3 | no | non-finite in 1 of 3 seeds | 0, 1, 2 | 0, 0, 0 | 10–1,000 |" in text
    assert "| 0.1 | yes | 1.750 ± 0.050 |" in text
    # 6: the grid's LRs in Wortsman's range (1 is outside it)
    assert "(2 of its 6; 0.001, 0.003, 0.01, 0.03 not run in both arms)" in text


def test_the_widths_table_finds_the_best_and_the_break_lr_per_width(tmp_path, monkeypatch):
    """Planted width-32 members: the held-out loss is lowest at 1e-2 (inside the grid), the
    level shifts come in 2 of 3 seeds from 1e-1 on (1 of 3 at 3e-2), so the break LR is 0.1, one
    decade above the best; with QK-Norm nothing breaks and the best is the grid's edge. Width 64
    breaks in every seed from 3e-2: its break falls and comes closer to the best."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    grid = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
    loss = {1e-3: 2.3, 1e-2: 1.9, 3e-2: 2.0, 1e-1: 2.4, 3e-1: None, 1.0: None}

    def member(lr, seed, qk, wide=False):
        broke = not qk and (lr >= 1e-1 and seed < 2 or lr == 3e-2 and seed == 0
                            or wide and lr >= 3e-2)
        final = 1.5 + lr if qk else loss[lr]
        return {"lr": lr, "seed": seed, "finite": final is not None,
                "eval_loss": [5.0, final if final is not None else float("nan")],
                "shift_steps": [2000] if broke else [], "max_attn_logit": 10.0}
    record = {"groups": {}}
    loss[1e-4] = 4.0  # width 64 also runs 1e-4: in its best LR, not in its sensitivity
    for name, qk in (("width32", False), ("width32-qk", True), ("width64", False)):
        record["groups"][name] = {"members": [
            member(lr, s, qk, name == "width64")
            for lr in (1e-4, *grid) if lr > 1e-4 or name == "width64" for s in range(3)]}
        (tmp_path / name).mkdir()
        for s in range(3):  # the first step's loss: the same at every LR
            for lr in ("0.0001", "0.001"):
                np.savez(tmp_path / name / f"lr{lr}-seed{s}.npz", loss=np.array([5.5, 5.0]))
    rows = {r["qk_norm"]: r for r in BR.width_rows(record) if r["width"] == 32}
    wide = next(r for r in BR.width_rows(record) if r["width"] == 64)
    assert wide["lrs"][0] == 1e-4 and wide["sensitivity"] == rows[False]["sensitivity"]
    assert rows[False]["best_lr"] == 1e-2 and rows[False]["bracketed"]
    assert rows[False]["break_lr_seeds"] == [3e-2, 1e-1, 3e-1]  # 3e-1: non-finite
    assert rows[True]["best_lr_seeds"] == [1e-3] * 3
    assert rows[False]["break_lr"] == 1e-1 and rows[False]["decades"] == pytest.approx(1.0)
    assert rows[True]["break_lr"] is None and not rows[True]["bracketed"]
    # Wortsman's sensitivity, seed 0 without QK-Norm: min(final, 5.5) over his range, 3e-4 to
    # 3e-1 (the diverged 3e-1 at 5.5; LR 1 is outside), mean minus the best
    assert rows[False]["sensitivity"][0] == pytest.approx(np.mean([2.3, 1.9, 2.0, 2.4, 5.5]) - 1.9)
    assert rows[False]["initial"] == 5.5  # where widths.png's loss axis ends
    text = BR.widths_markdown(record)
    assert "| 32 | no | 0.01 (0.01, 0.01, 0.01) | yes | 0.1 (0.03, 0.1, 0.3) | 1.0 |" in text
    assert ("| 32 | yes | 0.001 (0.001, 0.001, 0.001) | no: at the edge of the grid | none in "
            "the grid (none, none, none) | — |") in text
    assert ("- without QK-Norm: the break LR by width 32: 0.1, 64: 0.03 (falls at every step); "
            "best to break in decades 1.0, 0.5 (shrinks at every step).") in text
    assert "- QK-Norm moves the break LR up at 1 of 1 widths (32)." in text
    assert FG.plot_widths(record, tmp_path).name == "widths.png"  # the figure draws them
    monkeypatch.setattr(TB, "RESULTS", tmp_path)  # results.json: the sweep beside the rows
    (tmp_path / "results.json").write_text('{"rows": {"baseline": 1}}')
    TB.write_results_json({"widths": BR.width_rows(record)})
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["rows"] == {"baseline": 1} and stored["widths"][0]["break_lr"] == 1e-1
    assert stored["widths"][0]["final"]["1.0"] == [None] * 3  # diverged: null, not NaN


def test_the_best_lr_is_read_from_the_curves_float32_evals_not_the_rounded_record(
        tmp_path, monkeypatch):
    """Two LRs whose held-out ties at the record's 4 decimals (1.3146) but not in the stored
    float32 curve (width128's seed 0: 1.314618 at 1e-3, 1.314571 at 3e-3): the seed's best is
    the lower float, 3e-3, not the first LR of the tie; without curves the record's value."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    (tmp_path / "w").mkdir()
    for lr, x in ((1e-3, 1.314618), (3e-3, 1.314571)):
        np.savez(tmp_path / "w" / f"lr{lr:g}-seed0.npz", eval_loss=np.array([2.0, x], np.float32))
    record = {"groups": {"w": {"members": [
        {"lr": lr, "seed": 0, "finite": True, "eval_loss": [2.0, 1.3146], "shift_steps": [],
         "max_attn_logit": 10.0} for lr in (1e-3, 3e-3)]}}}
    assert BR.grid(record, ["w"])["best_lr_seeds"] == [3e-3]
    for f in tmp_path.glob("w/*.npz"):
        f.unlink()
    assert BR.grid(record, ["w"])["best_lr_seeds"] == [1e-3]  # the record's tie: its first


def test_the_knob_and_lever_tables_read_the_distance_and_the_break_ratio_per_seed(
        tmp_path, monkeypatch):
    """Planted d_model 32 members: the proxy as it is breaks at 0.3 (seeds 0, 2) and 0.1
    (seed 1) with its best at 3e-3; under beta2 0.999 the baseline breaks from 1e-2 in every
    seed (half a decade above its best) while its QK-Norm twin never does: the goal's verdict.
    Under eps 1e-15 the best sits at the grid's lowest LR: the distance a lower bound, no verdict.
    QK-Norm's break is read over width32-qk and width32-qk-high pooled (at 3), a lever that
    breaks at its grid's lowest LR reads "<=", one that never breaks "> its highest"."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)  # the planted held-out, no curves

    def members(lrs, brk, best=3e-3):  # brk: each seed's first LR with a shift (None: none)
        return {"members": [{"lr": lr, "seed": s, "finite": True,
                             "eval_loss": [5.0, 1.5 + abs(np.log10(lr / best))],
                             "shift_steps": [2000] if b is not None and lr >= b else [],
                             "max_attn_logit": 10.0 * lr}
                            for lr in lrs for s, b in enumerate(brk)]}
    grid = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
    record = {"groups": {
        "width32": members(grid, (0.3, 0.1, 0.3)), "width32-qk": members(grid, (None,) * 3),
        "width32-qk-high": members((3.0, 10.0), (3.0, 3.0, 10.0)),
        "width32-b2.999": members(grid, (1e-2, 1e-2, 1e-2)),
        "width32-b2.999-qk": members(grid, (None,) * 3),
        "width32-eps1e-15": members(grid, (3e-3,) * 3, best=1e-3),
        "width32-eps1e-15-qk": members(grid, (None,) * 3, best=1e-3),
        "width32-softcap50": members((0.03, 0.1), (0.03, 0.03, 0.03)),
        "width32-embed-scale": members((0.03, 0.1), (None,) * 3),
        "width32-gate": members(grid, (0.3, 0.1, 0.3))}}
    rows = {(r["knob"], r["qk_norm"]): r for r in BR.knob_rows(record)}
    assert rows[("as it is", False)]["decades"] == pytest.approx(2.0)
    assert rows[("b2.999", False)]["seed_decades"] == pytest.approx([np.log10(1e-2 / 3e-3)] * 3)
    text = BR.knobs_markdown(record)
    assert ("- b2.999: the baseline breaks 0.5 decades above its best LR (-1.5 against "
            "the proxy); with QK-Norm no break in the grid. **Within half a decade "
            "while QK-Norm is not.**") in text
    assert ("- eps1e-15: the baseline breaks at least 0.5 decades above its best LR "
            "(at least -1.5 against the proxy); with QK-Norm no "
            "break in the grid.") in text.splitlines()  # the whole line: no verdict after it
    assert "| eps1e-15 | no | <= 0.001 (0.001, 0.001, 0.001) | 0.003 (0.003, 0.003, 0.003) | " \
        ">= 0.5 (0.5, 0.5, 0.5) |" in text
    levers = {r["lever"]: r for r in BR.lever_break_rows(record)}
    assert levers["QK-Norm"]["break_lr"] == 3.0 and levers["QK-Norm"]["ratio"] == 10.0
    assert levers["QK-Norm"]["seed_ratios"] == pytest.approx([10.0, 30.0, 100 / 3])
    assert levers["soft-cap 50"]["bound"] == "<=" and levers["Scaled Embed"]["bound"] == ">"
    table = BR.lever_breaks_markdown(record)
    assert "| soft-cap 50 | 0.03, 0.1 | <= 0.03 (0.03, 0.03, 0.03) | <= 0.1 (0.1, 0.3, 0.1) |" \
        in table
    assert "| Scaled Embed | 0.03, 0.1 | none up to 0.1 (none, none, none) | > 0.33 (—, —, —) |" \
        in table
    top = BR.lever_breaks_top(record)  # the README's cut: the gate's break is the baseline's
    assert "| QK-Norm |" in top and "| Scaled Embed |" in top and "| the attention gate |" \
        not in top and top.endswith("(x1): the attention gate; every row with its LRs in "
                                    "results/README.md.")


def test_the_machine_check_sets_each_cell_on_the_accelerator_against_its_cpu_rerun():
    """A cell trained on an H200 and again on a CPU ("ROW-cpu"): each machine's seeds with a
    level shift (or non-finite) counted apart, each named; the knob table names the machine of
    each arm, and an arm with no QK-Norm twin declared says so."""
    def members(lr, shifted, machine):
        return {"sessions": [{"machine": {"device": machine[0], "cpu": machine[1]},
                              "trains": [lr] if machine == h200 else []}],
                "members": [{"lr": lr, "seed": s, "finite": s != 2 or not shifted[2],
                             "eval_loss": [5.0, 2.0 + s / 100], "max_attn_logit": 300.0 + s,
                             "shift_steps": [900] if shift else []}
                            for s, shift in enumerate(shifted)]}
    h200, epyc = ("NVIDIA H200", "Intel(R) Xeon(R) Processor"), ("cpu", "AMD EPYC")
    record = {"groups": {"width32-b64-qk": members(0.3, (True, True, False), h200),
                         "width32-b64-qk-cpu": members(0.3, (False, False, True), epyc),
                         "width64-mup": members(0.3, (True,) * 3, epyc),
                         "width64": members(0.3, (True,) * 3, epyc),
                         "width32-bf16": members(0.3, (True,) * 3, epyc)}}
    rows = BR.machine_rows(record)
    assert [(r["machine"], r["shifted"]) for r in rows] == [  # a session without the cell's LR
        ("NVIDIA H200", 2), ("AMD EPYC", 1)]
    text = BR.knobs_markdown(record)
    assert "| width32-b64-qk | 0.3 | NVIDIA H200 | 2 of 3 | 2.000, 2.010, 2.020 | 302 |" in text
    assert "| b64 | yes | <= 0.3 (0.3, 0.3, 0.3) | 0.3 (0.3, 0.3, none) |" in text
    assert [line.rsplit("| ", 1)[1] for line in text.splitlines()[2:6]] == [
        "AMD EPYC |", "NVIDIA H200 |", "AMD EPYC |", "AMD EPYC |"]  # bf16 first, then b64
    assert "muP (base width 32): the baseline breaks at least 0.0 decades above its best LR " \
        "(at least +0.0 against d_model 64); " \
        "QK-Norm's arm is not declared." in text
    assert "- bf16:" in text and "QK-Norm's arm has not run." in text  # declared, not recorded


def test_the_zloss_table_reads_the_output_logits_from_the_stored_curves(tmp_path, monkeypatch):
    """Planted z-loss members at d_model 32: z-loss off, LR 1, seed 2 goes non-finite at step
    150 of 200 (its log Z is the mean of the last 100 finite steps, 50-149; its max |output
    logit| the largest before the NaNs); the table and results.json take them as planted: log Z
    over the seeds (-149.5 - 150.5 - 101.5) / 3."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    record = {"groups": {}}
    for z, qk in ((0.0, False), (0.0, True), (1e-4, False)):
        name = f"zloss{z:g}-width32{'-qk' if qk else ''}"
        (tmp_path / name).mkdir()
        members = []
        for lr in (0.1, 1.0):
            for s in range(3):
                diverged = (z, qk, lr, s) == (0.0, False, 1.0, 2)
                log_z = -np.arange(200.0) * lr * (1 if z == 0 else 0.01) - s
                out = np.full(200, 10.0 * (s + 1) * lr)
                out[7] = 1000.0 * lr if z == 0 else out[7]
                if diverged:
                    log_z[150:], out[150:] = np.nan, np.nan
                np.savez(tmp_path / name / f"lr{lr:g}-seed{s}.npz", log_z=log_z,
                         out_logit_max=out)
                final = 2.0 + lr + s / 10 - 0.3 * ((z, lr, s) == (0, 0.1, 0))
                members.append({"lr": lr, "seed": s, "finite": not diverged,
                                "eval_loss": [5.0, final], "max_attn_logit": 50.0 + s,
                                "shift_steps": [120] if lr == 1.0 and not qk else []})
        record["groups"][name] = {"members": members, "machine": {"cpu": "planted"}}
    rows = {(r["z_loss"], r["qk_norm"], r["lr"]): r for r in BR.zloss_rows(record)}
    assert len(rows) == 6
    off = rows[0.0, False, 1.0]
    assert off["broke"] == 3 and np.isnan(off["final"][2]) and off["final"][0] == 3.0
    assert off["out_logit_max"] == [1000.0] * 3
    assert off["log_z_end"][2] == pytest.approx(-np.mean(np.arange(50, 150)) - 2)
    assert off["log_z_end"][0] == pytest.approx(-np.mean(np.arange(100, 200)))
    on = rows[1e-4, False, 0.1]
    assert on["out_logit_max"] == pytest.approx([1.0, 2.0, 3.0]) and on["broke"] == 0
    text = BR.zloss_markdown(record)
    assert "| 0 | no | 1 | 1 of 3 non-finite | 3 of 3 | 1e+03 | -133.83 | 52 |" in text
    assert "| 0.0001 | no | 0.1 | 2.200 (2.100, 2.300) | 0 of 3 | 3 | -1.15 | 52 |" in text
    assert ("- without QK-Norm: held-out, z-loss off minus on (5 seed-and-LR pairs): mean -0.060 "
            "[-0.180, +0.000], 1 of 5 lower without it; off: max |output logit| 1e+03") in text
    assert "with QK-Norm: held-out" not in text  # no z-loss-on group with QK-Norm planted
    assert FG.plot_zloss(record, tmp_path).name == "zloss.png"
    monkeypatch.setattr(TB, "RESULTS", tmp_path)
    TB.write_results_json({"widths_zloss": BR.zloss_rows(record)})
    stored = json.loads((tmp_path / "results.json").read_text())["widths_zloss"]
    assert len(stored) == 6 and stored[1]["final"][2] is None  # the non-finite seed: null


def test_the_readmes_stay_readable_in_one_sitting():
    """The README at most 14,000 bytes and results/README.md at most 35,000: a table the lab
    writes into either (lab/experiments.py) makes room by shorter prose, not by a longer file."""
    root = pathlib.Path(__file__).parent.parent
    assert len((root / "README.md").read_bytes()) <= 14_000
    assert len((root / "results/README.md").read_bytes()) <= 35_000


def test_the_readmes_links_into_the_results_land_on_a_section():
    """Each finding in the README links to its section of results/README.md: every
    `results/README.md#anchor` there is the GitHub anchor of one of that file's headings."""
    root = pathlib.Path(__file__).parent.parent
    headings = re.findall(r"^#+ (.+)$", (root / "results/README.md").read_text(), re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    links = re.findall(r"results/README\.md#([\w\-]+)", (root / "README.md").read_text())
    assert len(links) >= 5 and set(links) <= anchors, set(links) - anchors


def test_the_stored_tables_are_recomputed_from_the_stored_curves_digit_for_digit():
    """results/README.md's harness tables and the README's six evidence rows, recomputed from
    results/search.json and the curves as stored (each kept to what curve_arrays keeps), equal
    the text printed there; results/ stays under 64 MB, so a clone stays light (a 3-seed row adds
    ~130 kB, an 8-seed row ~350 kB). (The whole evidence table and the
    switch's take a minute: python -m lab.experiments --evidence; the early-warning table:
    python -m lab.foresight.)"""
    root = pathlib.Path(__file__).parent.parent
    record = STO.load()
    six = TB.evidence_rows(record, only={name for name, _ in RW.README_ROWS})
    for readme, part, table in (
            *[("results/README.md", part, table) for part, table in (
                ("widths", BR.widths_markdown), ("zloss", BR.zloss_markdown),
                ("knobs", BR.knobs_markdown), ("lever-breaks", BR.lever_breaks_markdown),
                ("teach", TB.teach_markdown), ("adamh-tune", TB.tune_markdown))],
            ("README.md", "evidence-summary", lambda r: TB.readme_summary(six))):
        text = (root / readme).read_text()
        start = f"<!-- {part}: written by lab/experiments.py -->\n"
        stored = text[text.index(start) + len(start):text.index(f"<!-- /{part} -->")]
        assert table(record).strip() == stored.strip(), (readme, part)
    # the README's six rows again, as results/README.md's evidence table prints them (the whole
    # table takes a minute: python -m lab.experiments --evidence)
    text = (root / "results/README.md").read_text()
    stored = text[text.index("<!-- evidence: written"):text.index("<!-- /evidence -->")]
    rows = [line for line in TB.evidence_markdown(six).splitlines() if line.startswith("| story8")]
    assert len(rows) >= 6 and all(line in stored.splitlines() for line in rows)
    for path in sorted((root / "results" / "curves").glob("*/*.npz"))[::40]:
        c = STO.read_curve(path.parent.name, path.stem)
        assert STO.curve_arrays(path.parent.name, c).keys() == c.keys(), path  # kept as it says
    assert sum(f.stat().st_size for f in (root / "results").rglob("*") if f.is_file()) < 64e6


# ---------------------------------------------------------------------------------------------
# lab/foresight.py: early warning

def test_foresight_measures_a_planted_warning_and_its_absence():
    """lab/foresight.py on planted series: the AUROC equals the pairwise count; a signal that rises
    100 steps before each planted episode is caught with a lead of 100 and its alarms are all
    followed by an episode; noise of the same scale is near 0.5; the threshold keeps to its
    false-alarm budget on the twin."""
    rng = np.random.default_rng(0)
    s, y = rng.standard_normal(300), rng.random(300) < 0.2
    pairs = np.mean([(a > b) + 0.5 * (a == b) for a in s[y] for b in s[~y]])
    assert F.auroc(s, y) == pytest.approx(pairs)
    n, onsets = 4000, [1800, 3100]
    warning = rng.standard_normal(n) * 0.1
    for e in onsets:
        warning[e - 100:e] += 3.0
    assert F.leads(warning, 1.0, onsets) == [100, 100]
    assert F.precision(warning, 1.0, onsets) == (2, 2)
    assert F.alarms(warning, 1.0) == [1700, 3000]  # one alarm per run of steps above
    labels = F.labels_within(onsets, n, 200)
    assert F.auroc(warning[F.WARMUP:], labels[F.WARMUP:]) > 0.7
    assert abs(F.auroc(rng.standard_normal(n)[F.WARMUP:], labels[F.WARMUP:]) - 0.5) < 0.06
    twins = [rng.standard_normal(n) for _ in range(3)]
    thr = F.threshold_for(twins, budget=0.5)
    assert np.mean([F.alarm_rate(t, thr) for t in twins]) <= 0.5
    assert np.mean([F.alarm_rate(t, thr - 0.3) for t in twins]) > 0.5  # not far above it
    # the signals computed online in the step, where a curve keeps them: the largest layer's
    ones = np.ones((300, 2))
    entropy = ones.copy()
    entropy[200:, 1] = 0.5  # layer 1's q weights lose half their spectral entropy at 200
    c = {"loss": np.zeros(300), "attn_logit_max": ones, "update_norm_per_layer": ones,
         "adam_mu_norm_per_layer": ones, "adam_nu_norm_per_layer": ones, "wq_norm": ones,
         "wk_norm": ones, "update_ratio_per_layer": ones * [1e-3, 2e-3],
         "adam_ratio_rms_per_layer": ones * [0.1, 0.3], "wq_entropy": entropy, "wk_entropy": ones}
    sig = F.signals(c)
    assert sig["update/param"][5] == 2e-3 and sig["m/sqrt(v) rms"][5] == 0.3
    assert list(sig["qk-entropy-drop"][[50, 150, 250, 299]]) == [-np.inf, 0.0, 0.5, 0.5]
    del c["wq_entropy"]
    assert "qk-entropy-drop" not in F.signals(c)


# ---------------------------------------------------------------------------------------------
# lab/probe.py: the attention sink and the gate's figures

def test_the_probe_reads_the_sink_and_the_gate_from_the_models_own_layers():
    """The sink equals a NumPy restatement of layer 0's causal softmax (mass on key 0 over
    queries 1..T-1); Marin's zero-initialised gate is exactly 1 with weight norm 0, and a
    non-zero gate weight moves both."""
    from lab import probe as PR
    from model import init_params, qkv, rms_norm
    cfg = RW.Group("p", d_model=32, n_layers=2, model=RW.GATE).config().model
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 10), 0, cfg.vocab_size)
    probe = jax.jit(lambda p, t: PR.probe(p, t, cfg))  # jitted, as the harness calls it
    with jax.set_mesh(H.one_device_mesh()):
        got = probe(params, tokens)
    assert {k: v.shape for k, v in got.items()} == {k: (2,) for k in PR.PROBE_KEYS}
    p0 = {k: v[0] for k, v in params["layers"].items()}
    q, k, _ = (np.asarray(x, np.float64) for x in jax.jit(lambda p0, x: qkv(
        rms_norm(x, p0["attn_norm"], cfg.norm_eps), p0, cfg))(p0, params["embed"][tokens]))
    q = q.reshape(3, 10, cfg.n_kv_heads, -1, q.shape[-1])  # [B, T, K, G, H]
    s = np.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((10, 10), bool)), s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(got["probe_sink"][0], probs[..., 1:, 0].mean(), rtol=1e-5)
    assert np.all(got["probe_gate_mean"] == 1.0) and np.all(got["probe_gate_norm"] == 0.0)
    params["layers"]["w_attn_gate"] = params["layers"]["w_attn_gate"] + 0.1
    with jax.set_mesh(H.one_device_mesh()):
        moved = probe(params, tokens)
    assert np.all(moved["probe_gate_norm"] > 0) and np.all(moved["probe_gate_mean"] != 1.0)
    # (that the harness keeps them per member, evaluation and layer: the killed-LR test below)


def test_rows_on_every_core_go_one_pinned_process_per_core(monkeypatch, tmp_path):
    """python -m lab.experiments ROW ROW ... (lab/spread.py): the rows not yet recorded dealt to
    one queue per core (the most work first, each to the least loaded queue; a fork after its
    source, in the source's queue); each queue one `python -m lab.experiments` pinned to its own
    core."""
    monkeypatch.setattr(SP, "load", lambda: {"groups": {"width32-qk": {}}})
    rows = [RW.HARNESS_ROWS[n] for n in ("width32", "width32-qk", "story8", "story8-gate",
                                          "story8-gate-inserted", "width32-gate")]
    queues = SP.core_queues(rows, 2)
    assert sorted(n for q in queues for n in q) == sorted(
        ["width32", "story8", "story8-gate", "story8-gate-inserted", "width32-gate"])
    src = next(q for q in queues if "story8" in q)
    assert src.index("story8") < src.index("story8-gate-inserted")
    assert len(queues) == 2 and SP.core_queues(rows, 1) == [
        [n for q in SP.core_queues(rows, 1) for n in q]]
    core = sorted(os.sched_getaffinity(0))[-1]
    (tmp_path / "affinity_probe.py").write_text(
        "import os, sys\nprint(sys.argv[1:], sorted(os.sched_getaffinity(0)))\n")
    out = subprocess.run(SP.pinned_command(core, "affinity_probe", ["a", "b"]), cwd=tmp_path,
                         capture_output=True, text=True).stdout
    assert out == f"['a', 'b'] [{core}]\n"  # the child runs pinned, with its arguments
    started = []

    class Fake:
        def __init__(self, argv, stdout, stderr):
            started.append(argv)
            stdout.write(f"{argv[-1]}: recorded\n")
            stdout.close()
            self.returncode = 0

        def poll(self):
            return 0
    monkeypatch.setattr(SP.subprocess, "Popen", Fake)
    monkeypatch.chdir(tmp_path)
    SP.run_pinned([["width32"]], [core])
    assert started == [SP.pinned_command(core, "lab.experiments", ["width32"])]
    assert (tmp_path / "runs/logs" / f"core{core}-width32.log").read_text() == "width32: recorded\n"


def test_a_stored_curve_whose_bytes_changed_is_refused_in_one_line(tmp_path, monkeypatch):
    """A curve the harness wrote is listed with its sha256 (results/curves/sha256.json): the
    same curve with its arrays zeroed (which would move a row's held-out with no word) is
    refused, naming the file and how to restore it; a curve not listed is read as it is."""
    monkeypatch.setattr(STO, "SEED_CURVES", tmp_path)
    monkeypatch.setattr(STO, "OUT", tmp_path / "search.json")
    (tmp_path / "row").mkdir()
    curve = {"loss": np.linspace(5.0, 2.0, 40, dtype=np.float32), "eval_step": np.array([40]),
             "eval_loss": np.array([2.1], np.float32)}
    for seed in (0, 1):
        np.savez_compressed(tmp_path / "row" / f"seed{seed}.npz", **curve)
    STO.record_checksums(tmp_path, [tmp_path / "row" / "seed0.npz"])
    np.testing.assert_array_equal(STO.read_curve("row", "seed0")["loss"], curve["loss"])
    np.savez_compressed(tmp_path / "row" / "seed0.npz",
                        **{k: np.zeros_like(v) for k, v in curve.items()})
    with pytest.raises(H.UserError, match="seed0.npz is not the file the harness wrote"):
        STO.read_curve("row", "seed0")
    assert STO.read_curve("row", "seed1")["loss"].shape == (40,)  # unlisted: read
    (tmp_path / "sha256.json").write_text("{")
    with pytest.raises(H.UserError, match="sha256.json cannot be read"):
        STO.read_curve("row", "seed1")


def test_the_probe_table_gives_each_probed_rows_layers_and_the_seeds_range():
    members = [{"seed": s, "final_probe_sink": [0.5 + 0.1 * s, 0.3],
                "final_probe_gate_norm": [1.0, 2.0 + s], "final_probe_gate_mean": [1.0, 0.9]}
               for s in (0, 1)]
    text = TB.probe_markdown({"groups": {"story8-gate": {"members": members},
                                         "story8-probed": {"members": members},
                                         "story8": {"members": [{"seed": 0}]}}})
    assert text.splitlines()[2:] == [  # a row without the gate: no gate figures
        "| the baseline trained again (story8 bit for bit, probed) (2 seeds) | 0.550/0.300 "
        "(0.400-0.450) | — (no gate) | — (no gate) |",
        "| the attention gate from scratch (2 seeds) | 0.550/0.300 (0.400-0.450) | 1.000/2.500 | "
        "1.000/0.900 |"]  # (story8 has no probe: not a row)


@pytest.mark.parametrize("deadline", ["nan", "inf", "-1"])
def test_spread_refuses_a_deadline_that_is_no_number_of_seconds(deadline, capsys):
    """--deadline nan or inf would leave the deadline silently off, as -1 is refused: one line."""
    row = next(iter(SP.HARNESS_ROWS))
    assert SP.main([row, "--deadline", deadline]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--deadline a number of seconds >= 0" in err, err


def test_the_tuning_tables_8_seed_differences_are_paired_seed_by_seed():
    """The 8-seed line's differences are each seed's held-out minus the same seed's (QK-Norm
    under AdamH, AdamH from Adam with QK-Norm), so a seed-wide offset cancels: QK-Norm 0.1 lower
    in every seed gives -0.100 with a zero-width interval, although the seeds' own spread is
    0.7. The 3-seed bests are named once, each with its arm where the arms' bests differ."""
    def group(offset, seeds=RW.EVIDENCE_SEEDS):
        members = [{"seed": s, "eval_step": [4000], "eval_loss": [1.0 + s / 10 + offset],
                    "steps": 4000, "shift_steps": []} for s in seeds]
        return {"members": members, "machine": {"cpu_family": 25, "cpu_model": 1,
                                                "cpu_stepping": 1, "cpu": "AMD EPYC"}}
    record = {"groups": {"story8-adamh-best": group(0.1), "story8-adamh-best-qk": group(0.0),
                         "story8-adam-best-qk": group(-0.05)}}
    # 3-seed rows whose best angle differs by arm: each arm's best is named with its arm
    for name, offset in (("a0.01", 0.1), ("a0.003", 0.2), ("qk-a0.01", 0.1), ("qk-a0.003", 0.0)):
        record["groups"][f"d64-adamh-{name}"] = group(offset, seeds=(0, 1, 2))
    line = TB.tune_markdown(record).splitlines()[-1]
    assert "QK-Norm adds -0.100 [-0.100, -0.100]" in line, line
    assert ("from Adam QK-Norm +0.150 [+0.150, +0.150], QK-Norm +0.050 [+0.050, +0.050]"
            in line), line
    assert "adamh 0.003 / 0.03 1.450 [" in line and "No seed of these rows" in line, line
    assert ("both arms unless named: adamh 0.01 / 0.001 (no QK-Norm), adamh 0.003 / 0.001 "
            "(QK-Norm).") in line, line
