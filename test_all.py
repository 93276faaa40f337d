"""The whole suite, on CPU, in minutes: `pytest test_all.py`; the fast tier, every module but
without the tests that run several training processes: `pytest test_all.py -m "not slow"`.

Sharding tests run on 8 simulated CPU devices. Compiled functions are shared across tests where
they can be (one tiny config, module-level fixtures), since JAX compiles are slow on 2 cores; and
across processes (the two pytest-xdist workers pytest.ini starts, the train.py runs the tests
start) through JAX's persistent compilation cache, in a directory of the system's temporary
folder (SPIKEFIX_TEST_JAX_CACHE overrides it). `-n 0` runs the tests in one process.
"""

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import attention as A
import checkpoint as C
import compat
import config as CF
import data as D
import distributed as DI
import export as E
import guard as G
import hf as HF
import hyperball as HB
import loop as L
import model as M
import optim as O
import records as RC
import report as R
import sample as S
import tracking as TR
import train as T
import warmstart as W
from cli import UserError

HERE = pathlib.Path(__file__).parent
TINY = CF.PRESETS["tiny"]


def tiny(tmp_path=None, **overrides) -> CF.TrainConfig:
    """The tiny preset, with nested overrides written as "optim.lr"=... keywords."""
    d = dataclasses.asdict(TINY)
    if tmp_path is not None:
        d["run_dir"] = str(tmp_path / "run")
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = d
        for p in parents:
            node = node[p]
        node[leaf] = value
    return CF.config_from_dict(d)


def mesh_of(data, model):
    return DI.make_mesh(CF.MeshConfig(data, model), jax.devices()[:data * model])


def init_sharded(cfg, mesh, tx=None):
    tx = tx or CF.make_tx(cfg)
    target = C.abstract_state(cfg.model, tx, mesh)
    with jax.set_mesh(mesh):
        state = C.fresh_state(cfg.model, cfg.seed, tx, target)
    return state, tx, target


def restore_final(cfg, step):
    mesh = mesh_of(1, 1)
    tx = CF.make_tx(cfg)
    mngr = C.checkpoint_manager(pathlib.Path(cfg.run_dir), cfg.keep_checkpoints)
    with jax.set_mesh(mesh):
        return C.restore_checkpoint(mngr, step, C.abstract_state(cfg.model, tx, mesh))


def tree_hashes(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_trees_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


# ---------------------------------------------------------------------------------------------
# model.py

# The shared fixtures are session-scoped: a module-scoped one is torn down, and built again,
# whenever a worker runs a test of another file in between.
@pytest.fixture(scope="session")
def tiny_tokens():
    return np.random.default_rng(0).integers(0, 256, (4, 33)).astype(np.int32)


@pytest.mark.parametrize("subscripts,x_shape,w_shape,out", [
    ("btd,dnh->btnh", (2, 3, 8), (8, 4, 2), ("heads", "head_dim")),
    ("btnh,nhd->btd", (2, 3, 4, 2), (4, 2, 8), ("act_embed",)),
    ("btd,df->btf", (2, 3, 8), (8, 6), ("ffw",))])
def test_a_projection_is_the_einsum_its_subscripts_name(subscripts, x_shape, w_shape, out):
    """model.matmul, the 2-D form XLA:CPU runs faster, computes jnp.einsum(subscripts) to float
    rounding, on a 2x2 mesh and outside one; subscripts that are no projection are refused."""
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in (x_shape, w_shape))
    want = np.einsum(subscripts, np.asarray(x), np.asarray(w))
    np.testing.assert_allclose(M.matmul(subscripts, x, w, out=out), want, rtol=1e-5, atol=1e-5)
    with jax.set_mesh(mesh := mesh_of(2, 2)):
        xs = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data", *[None] * (x.ndim - 1))))
        got = jax.jit(lambda a, b: M.matmul(subscripts, a, b, out=out))(xs, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not a projection"):
        M.matmul(subscripts.replace("->bt", "->tb"), x, w, out=out)


def test_logits_up_to_t_do_not_depend_on_later_tokens(tiny_tokens):
    """Logits at positions <= t do not depend on tokens after t."""
    cfg = TINY.model
    params = M.init_params(cfg, jax.random.key(0))
    with jax.set_mesh(mesh_of(1, 1)):
        fwd = jax.jit(lambda p, x: M.forward(p, x, cfg)[0])
        x = jnp.asarray(tiny_tokens[:, :32])
        base = fwd(params, x)
        t = 12
        changed = x.at[:, t + 1:].set((x[:, t + 1:] + 7) % 256)
        other = fwd(params, changed)
    np.testing.assert_array_equal(np.asarray(base[:, :t + 1]), np.asarray(other[:, :t + 1]))
    assert not np.allclose(base[:, t + 1:], other[:, t + 1:])


def test_qk_norm_bounds_every_attention_logit_by_sqrt_head_dim(tiny_tokens):
    losses, logit_max = {}, {}
    with jax.set_mesh(mesh_of(1, 1)):
        for qk in (False, True):
            cfg = dataclasses.replace(TINY.model, qk_norm=qk, init_std=0.5)
            params = M.init_params(cfg, jax.random.key(0))
            loss, aux = jax.jit(lambda p, x, c=cfg: M.loss_fn(p, x, c))(params, tiny_tokens)
            losses[qk], logit_max[qk] = float(loss), np.asarray(aux["attn_logit_max"])
    assert all(np.isfinite(v) for v in losses.values())
    assert losses[True] != losses[False]
    # With large weights, q.k grows with their norms; QK-Norm bounds each logit by sqrt(H).
    assert logit_max[True].max() <= np.sqrt(TINY.model.head_dim) + 1e-3
    assert logit_max[False].max() > 10 * logit_max[True].max()


def test_qk_norm_scales_are_declared_once_and_leave_other_inits_alone():
    table = M.param_table(dataclasses.replace(TINY.model, qk_norm=True))
    assert table["layers/q_norm"].shape == (TINY.model.n_layers, TINY.model.head_dim)
    assert not table["layers/q_norm"].decay and table["layers/wq"].decay
    assert not table["embed"].decay
    # Adding QK-Norm leaves every other parameter's initial value unchanged.
    a = M.init_params(TINY.model, jax.random.key(0))
    b = M.init_params(dataclasses.replace(TINY.model, qk_norm=True), jax.random.key(0))
    np.testing.assert_array_equal(a["layers"]["wq"], b["layers"]["wq"])
    np.testing.assert_array_equal(b["layers"]["k_norm"], 1.0)


def test_decoding_with_a_kv_cache_gives_the_logits_of_forward(tiny_tokens):
    cfg = dataclasses.replace(TINY.model, qk_norm=True)
    params = M.init_params(cfg, jax.random.key(1))
    tokens = tiny_tokens[:2, :20]
    with jax.set_mesh(mesh_of(1, 1)):
        full = np.asarray(M.forward(params, tokens, cfg)[0])
    plain = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)  # one device, no mesh
    step = jax.jit(S.forward_cached, static_argnums=3)
    logits, cache = step(plain, tokens[:, :12], S.init_cache(cfg, 2, 24), cfg)  # prefill
    chunks = [logits]
    for t in range(12, 20):  # then one token at a time
        logits, cache = step(plain, tokens[:, t:t + 1], cache, cfg)
        chunks.append(logits)
    np.testing.assert_allclose(np.concatenate(chunks, 1), full, atol=1e-5)
    assert step._cache_size() == 2  # prefill and one decode step: no compile per token


def test_scaled_embed_is_the_embedding_table_times_sqrt_d_in_training_and_decoding(tiny_tokens):
    """Scaled Embed (Takase et al. 2312.16903): the model with embed_scale gives the logits of
    the same model without it whose embedding table is sqrt(d_model) times larger, and its
    cached decode gives forward's logits."""
    cfg = dataclasses.replace(TINY.model, embed_scale=True)
    params = M.init_params(cfg, jax.random.key(1))
    larger = dict(params, embed=params["embed"] * np.sqrt(cfg.d_model))
    tokens = tiny_tokens[:2, :12]
    off = dataclasses.replace(cfg, embed_scale=False)
    with jax.set_mesh(mesh_of(1, 1)):
        scaled = np.asarray(M.forward(params, tokens, cfg)[0])
        plain = np.asarray(M.forward(larger, tokens, off)[0])
        unscaled = np.asarray(M.forward(params, tokens, off)[0])
    np.testing.assert_allclose(scaled, plain, atol=1e-5)
    assert np.abs(scaled - unscaled).max() > 1e-3  # the scale is applied
    one = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)
    cached, _ = S.forward_cached(one, tokens, S.init_cache(cfg, 2, 12), cfg)
    np.testing.assert_allclose(np.asarray(cached), scaled, atol=1e-5)


def mup_rules_restated(shapes: dict, fan_in: dict) -> dict:
    """microsoft/mup's rules for Adam, restated in NumPy on torch's 2-D view of each weight
    ([fan_out, fan_in]): `shapes` {name: (base, delta, target) shapes without the layer axis},
    `fan_in` {name: the input dims}. A dim is infinite where base and delta differ
    (set_base_shapes); the width multiplier is the fan-in's if infinite, else the fan-out's
    (InfShape.main: the last infinite dim of [out, in]); ninf == 2: init std x m^-1/2
    (mup.init), Adam LR / m (MuAdam); else both unchanged. {name: (init, lr)}."""
    out = {}
    for name, (b, d, t) in shapes.items():
        ins = fan_in[name]
        outs = tuple(i for i in range(len(t)) if i not in ins)
        view = [tuple(np.prod([x[i] for i in g]) for x in (b, d, t))
                for g in (outs, ins) if g]  # torch's [out, in]
        inf = [bb != dd for bb, dd, _ in view]
        main = max((k for k in range(len(view)) if inf[k]), default=None)
        m = view[main][2] / view[main][0] if main is not None else 1.0
        out[name] = (m ** -0.5, 1 / m) if sum(inf) == 2 else (1.0, 1.0)
    return out


def test_mup_scales_each_parameter_as_mup_does_and_the_step_applies_them(tiny_tokens):
    """--model.param mup (Tensor Programs V; microsoft/mup): at d_model 128 against base 32
    each parameter's init and Adam LR multiplier equal mup's rules restated in NumPy; the init
    drawn has that std; one Adam update of a hidden matrix is the standard one times its LR
    multiplier (what is applied, not what is logged); the readout's input is times base/width;
    at the base width muP is the standard model."""
    cfg = dataclasses.replace(TINY.model, d_model=128, n_heads=8, n_kv_heads=4, d_ff=344,
                              param="mup", mup_base_width=32)
    tables = [M.param_table(c) for c in (M.width_config(cfg, 32), M.width_config(cfg, 64), cfg)]
    drop = {n: [i for i, a in enumerate(s.axes) if a != "layers"]
            for n, s in tables[2].items()}
    shapes = {n: tuple(tuple(t[n].shape[i] for i in drop[n]) for t in tables) for n in drop}
    fan_in = {n: tuple(drop[n].index(i) for i in s.fan_in) for n, s in tables[2].items()}
    want = mup_rules_restated(shapes, fan_in)
    assert M.mup_scales(cfg).keys() == want.keys()
    for name, (init, lr) in M.mup_scales(cfg).items():
        assert (init, lr) == pytest.approx(want[name]), name
    assert M.mup_scales(cfg)["layers/wq"] == (0.5, 0.25)  # fan-in 128 against 32
    assert M.mup_scales(cfg)["head"] == (1.0, 1.0) and cfg.output_mult == 0.25  # MuReadout
    params = M.init_params(cfg, jax.random.key(0))
    assert np.std(params["layers"]["w_up"]) == pytest.approx(0.02 * 0.5, rel=0.03)
    assert np.std(params["embed"]) == pytest.approx(0.02, rel=0.03)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    layout = M.optimizer_layout(cfg)
    optim = dataclasses.replace(TINY.optim, weight_decay=0.0, max_grad_norm=0.0,
                                warmup_steps=0)
    mup_tx = O.make_optimizer(optim, 10, **layout)
    sp_tx = O.make_optimizer(optim, 10, **{**layout, "lr_mults": None})
    extra = dict(loss=1.0, step=0, attn_logit_max_per_head=None)
    u_mup, u_sp = (jax.jit(functools.partial(tx.update, **extra))(grads, tx.init(params), params)[0]
                   for tx in (mup_tx, sp_tx))  # jitted, as the train step applies them
    np.testing.assert_allclose(u_mup["layers"]["wo"], 0.25 * u_sp["layers"]["wo"], rtol=1e-6)
    np.testing.assert_array_equal(u_mup["embed"], u_sp["embed"])
    tokens = tiny_tokens[:2, :8]
    sp = dataclasses.replace(cfg, param="standard")
    forward = jax.jit(lambda p, t, c: M.forward(p, t, c)[0], static_argnums=2)
    with jax.set_mesh(mesh_of(1, 1)):
        a = forward(params, tokens, cfg)
        b = forward(dict(params, head=params["head"] * 0.25), tokens, sp)
    np.testing.assert_allclose(a, b, atol=1e-6)
    base = dataclasses.replace(cfg, d_model=32, n_heads=2, n_kv_heads=1, d_ff=86)
    assert set(M.mup_scales(base).values()) == {(1.0, 1.0)} and base.output_mult == 1.0
    assert M.lr_multipliers(base) is None


@pytest.mark.parametrize("gate, form", [("headwise", "qwen"), ("elementwise", "qwen"),
                                         ("headwise", "marin")])
def test_the_attention_gate_is_the_references(gate, form):
    """The attention gate against its sources, restated in NumPy: qiuzh20/gated_attention's
    modeling_qwen3.py (the gate's columns fused into q_proj per KV group, split off,
    `attn_output * sigmoid(gate_score)`, headwise: one per head, elementwise: one per head
    dim) and Marin's `2 * sigmoid(einsum("bsd,dn->bsn", x, attn_gate))`; our separate
    W_gate is the same math as Qwen's fused columns."""
    cfg = dataclasses.replace(TINY.model, attn_gate=gate, attn_gate_form=form)
    p = jax.tree.map(lambda a: np.asarray(a[0]), M.init_params(cfg, jax.random.key(3))["layers"])
    if form == "marin":  # (its init is 0: the gate 1; any weights for the math)
        p["w_attn_gate"] = 0.3 * np.random.default_rng(0).standard_normal(
            p["w_attn_gate"].shape).astype(np.float32)
    rng = np.random.default_rng(1)
    B, T, D, N, K, H = 2, 5, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rng.standard_normal((B, T, D)).astype(np.float32)
    out = rng.standard_normal((B, T, N, H)).astype(np.float32)
    ours = np.asarray(M.output_projection(jnp.asarray(out), jnp.asarray(h), p, cfg))
    G = N // K
    if form == "marin":
        g = 2 / (1 + np.exp(-np.einsum("bsd,dn->bsn", h, p["w_attn_gate"])))
        gated = out * g[..., None]
    else:  # Qwen: q_proj's output per KV group is [G heads' queries, G gates (x H if elem.)]
        per = 1 if gate == "headwise" else H
        wq = p["wq"].reshape(D, K, G * H)
        wg = p["w_attn_gate"].reshape(D, K, G * per)
        q_proj = np.concatenate([wq, wg], axis=-1).reshape(D, -1)  # the fused weight
        states = (h @ q_proj).reshape(B, T, K, -1)
        score = states[..., G * H:].reshape(B, T, N, per)  # torch.split, then reshape
        gated = out * (1 / (1 + np.exp(-score)))
    want = np.einsum("btnh,nhd->btd", gated, p["wo"])
    np.testing.assert_allclose(ours, want, atol=1e-5)


def test_the_marin_gate_inserted_mid_run_changes_nothing_at_insertion(straight_run):
    """Marin's gate is exactly 1 when inserted (W_gate 0, its moments 0): the first step after
    inserting it into a checkpoint gives the source's loss bit for bit; the guard's escalation
    to it says so in its config, and repeats the insertion on a checkpoint at its own step."""
    src, _ = straight_run
    cfg = dataclasses.replace(src, model=dataclasses.replace(src.model, attn_gate="headwise"))
    mesh = mesh_of(1, 1)
    tokens = jnp.asarray(D.TokenData(src.data).batch(6))
    with jax.set_mesh(mesh):
        _, before = T.make_train_step(src, CF.make_tx(src))(restore_final(src, 6), tokens)
        gated = C.insert_new_leaves(cfg, CF.make_tx(cfg), restore_final(src, 6), mesh)
        assert not np.any(np.asarray(gated["params"]["layers"]["w_attn_gate"]))
        _, after = T.make_train_step(cfg, CF.make_tx(cfg))(gated, tokens)
    assert float(after["loss"]) == float(before["loss"])  # bitwise
    e = {"action": "escalate", "escalation": "attn-gate", "event_step": 5, "rollback_to": 3,
         "replaced_until": 5, "extra_steps": 2, "rule": "shift", "trigger_step": 5}
    assert RC.event_problem(e) is None
    assert G.effective_config(src, [e]).model.attn_gate == "headwise"
    assert G.effective_config(src, [e], restored_at=3).model.attn_gate == "none"
    assert G.pending_insertion([e], 3)


def test_the_marin_32b_preset_has_32b_parameters():
    cfg = CF.PRESETS["marin-32b"].model
    assert 31e9 < M.count_params(cfg) < 34e9  # "32B"


def test_the_output_logit_statistics_are_those_of_the_logits():
    """The output-logit divergence's two statistics (Wortsman et al. §3.2): the largest |logit|
    and the mean log-normaliser over the batch, from forward's logits restated in NumPy."""
    cfg = dataclasses.replace(TINY.model, init_std=0.5)
    params = M.init_params(cfg, jax.random.key(1))
    tokens = np.random.default_rng(3).integers(0, 256, (2, 33)).astype(np.int32)
    with jax.set_mesh(mesh_of(1, 1)):
        _, aux = jax.jit(lambda p, x: M.loss_fn(p, x, cfg))(params, tokens)
        logits = np.asarray(jax.jit(lambda p, x: M.forward(p, x, cfg)[0])(params, tokens[:, :-1]),
                            np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    assert float(aux["out_logit_max"]) == pytest.approx(np.abs(logits).max(), rel=1e-5)
    assert float(aux["log_z"]) == pytest.approx(log_z.mean(), rel=1e-5)
    assert abs(float(aux["log_z"])) > 1  # not a zero that would pass any restatement


def test_the_max_attention_logit_counts_causal_entries_only():
    """Layer 0's statistic equals the max |q.k|/sqrt(H) over the entries attention uses, and
    the masked future entries (larger here) do not count."""
    cfg = dataclasses.replace(TINY.model, init_std=0.5)
    params = M.init_params(cfg, jax.random.key(1))
    tokens = np.random.default_rng(3).integers(0, 256, (2, 33)).astype(np.int32)
    with jax.set_mesh(mesh_of(1, 1)):
        _, aux = jax.jit(lambda p, x: M.loss_fn(p, x, cfg))(params, tokens)
    p0 = jax.tree.map(lambda x: x[0], params["layers"])
    x = M.rms_norm(params["embed"][tokens[:, :-1]], p0["attn_norm"], cfg.norm_eps)
    q = M.rope(jnp.einsum("btd,dnh->btnh", x, p0["wq"]), cfg.rope_theta)
    k = M.rope(jnp.einsum("btd,dkh->btkh", x, p0["wk"]), cfg.rope_theta)
    k = jnp.repeat(k, cfg.n_heads // cfg.n_kv_heads, axis=2)
    logits = np.abs(np.asarray(jnp.einsum("btnh,bsnh->bnts", q, k))) / np.sqrt(cfg.head_dim)
    causal = np.tril(np.ones(logits.shape[-2:], bool))
    assert logits.max() > logits[..., causal].max()  # the masked entries would change it
    assert float(aux["attn_logit_max"][0]) == pytest.approx(logits[..., causal].max(), rel=1e-4)


# ---------------------------------------------------------------------------------------------
# attention.py

@functools.cache
def loss_logit_max_grads(model_cfg, mesh_shape, seq=40):
    """Loss, per-layer max |attention logit| and gradients on a fixed [4, seq + 1] batch."""
    tokens = np.random.default_rng(5).integers(0, 256, (4, seq + 1)).astype(np.int32)
    params = M.init_params(model_cfg, jax.random.key(2))
    with jax.set_mesh(mesh_of(*mesh_shape)):
        f = jax.value_and_grad(lambda p, x: M.loss_fn(p, x, model_cfg), has_aux=True)
        (loss, aux), grads = jax.jit(f)(params, tokens)
    return (float(loss), np.asarray(aux["attn_logit_max"]),
            [np.asarray(g) for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("form,mesh_shape,qk_norm,block,seq,softcap", [
    ("blockwise", (1, 1), True, 16, 40, 0.0),
    ("blockwise", (1, 1), False, 16, 40, 4.0),  # soft-capped, through the flash backward
    *[pytest.param(*case, marks=pytest.mark.slow) for case in [  # more forms, meshes, lengths
        ("grouped", (1, 1), True, 16, 40, 0.0), ("grouped", (2, 2), False, 16, 40, 0.0),
        ("blockwise", (2, 2), False, 16, 40, 0.0), ("blockwise", (2, 2), True, 64, 40, 0.0),
        ("blockwise", (1, 1), False, 128, 100, 0.0), ("grouped", (1, 1), False, 16, 40, 4.0),
        ("blockwise", (1, 1), False, 128, 100, 4.0)]]])
def test_every_attention_form_equals_dense_in_loss_logit_max_and_gradients(
        form, mesh_shape, qk_norm, block, seq, softcap):
    """Grouped-query attention (4 query heads on 2 KV heads), T = 40 in blocks of 16 (the last
    one padded) or in one block of 64 (blockwise's loop-free path), or T = 100 in one block of
    128 (queries in four chunks, the last partial); init_std 0.2 so that the logits are large
    without QK-Norm (max ~10) and a soft-cap of 4 bends them; on one device and on a 2x2 mesh
    (batch and heads split)."""
    cfg = dataclasses.replace(TINY.model, qk_norm=qk_norm, init_std=0.2, attention_block=16,
                              attn_softcap=softcap)
    ref = loss_logit_max_grads(dataclasses.replace(cfg, attention="dense"), mesh_shape, seq)
    got = loss_logit_max_grads(dataclasses.replace(cfg, attention=form, attention_block=block),
                               mesh_shape, seq)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    assert len(got[2]) == len(ref[2])
    for g, r in zip(got[2], ref[2]):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


def test_the_soft_cap_is_c_tanh_s_over_c_before_the_softmax():
    """The dense reference with a soft-cap against a NumPy restatement (one KV head per query
    head): softmax(c tanh(q k^T / (sqrt(H) c)), causal) v; the statistic stays uncapped."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(1, 6, 2, 8)) * 4 for _ in range(3))
    out, top = A.dense(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), softcap=2.0)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(8)
    capped = np.where(np.tril(np.ones((6, 6), bool)), 2.0 * np.tanh(s / 2.0), -np.inf)
    p = np.exp(capped - capped.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bhts,bshd->bthd", p, v), rtol=1e-5, atol=1e-5)
    assert float(top) == pytest.approx(np.abs(s[:, :, np.tril(np.ones((6, 6), bool))]).max(),
                                       rel=1e-5)
    assert float(top) > 2.0  # the statistic is the uncapped logit
    with pytest.raises(ValueError, match="cudnn has no soft-cap"):
        dataclasses.replace(TINY.model, attention="cudnn", dtype="bfloat16", attn_softcap=50.0)
    assert A.resolve("auto", "bfloat16", "gpu", softcap=50.0) == "blockwise"


def test_the_cudnn_form_makes_the_library_call_with_the_same_layout_and_statistic():
    """On CPU the library's XLA implementation stands in for cuDNN: same call, same layout,
    and the statistic from its query-blockwise pass (T = 600 > its 512-position blocks)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 600, 4, 16)) * 3, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 600, 2, 16)), jnp.float32) for _ in range(2))
    out, top = jax.jit(functools.partial(A.cudnn, implementation="xla"))(q, k, v)
    ref_out, ref_top = jax.jit(A.grouped)(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    assert float(top) == pytest.approx(float(ref_top), rel=1e-6)


def test_auto_attention_picks_the_form_by_platform_and_dtype():
    assert A.resolve("auto", "float32", "cpu") == "blockwise"
    assert A.resolve("auto", "bfloat16", "gpu") == "cudnn"
    assert A.resolve("auto", "float32", "gpu") == "blockwise"  # cuDNN: 16-bit only
    assert A.resolve("auto", "bfloat16", "tpu") == "blockwise"
    assert A.resolve("dense", "bfloat16", "gpu") == "dense"


def test_blockwise_attention_memory_grows_linearly_with_length():
    """The compiled gradient's temporary memory about doubles when T doubles with the
    blockwise form (no [T, T] tensor is stored) and about quadruples with the grouped one."""
    def temp_bytes(attend, T):
        q = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
        grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)[0]), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    def blockwise(q, k, v):
        return A.blockwise(q, k, v, 64)
    assert temp_bytes(blockwise, 2048) / temp_bytes(blockwise, 1024) <= 2.3
    assert temp_bytes(A.grouped, 2048) / temp_bytes(A.grouped, 1024) >= 3.5


# ---------------------------------------------------------------------------------------------
# optim.py

def numpy_skip_rule(losses, grad_norms, window, sigma, patience=32, as_anchors=False):
    """A plain restatement of the skip-step rule: which steps are skipped. `as_anchors`: the
    rule as OLMo-core / Levanter have it (a skipped outlier is recorded raw; no patience)."""
    hist_l, hist_g, skipped, in_a_row = [], [], [], 0
    for loss, gn in zip(losses, grad_norms):
        finite = np.isfinite(loss) and np.isfinite(gn)
        thr_l = thr_g = np.inf
        if len(hist_l) >= window // 2:
            hl, hg = np.array(hist_l[-window:]), np.array(hist_g[-window:])
            thr_l, thr_g = hl.mean() + sigma * hl.std(ddof=1), hg.mean() + sigma * hg.std(ddof=1)
        outlier = finite and (loss > thr_l or gn > thr_g)
        settled = outlier and in_a_row >= patience and not as_anchors
        skip = not finite or (outlier and not settled)
        if settled:  # the new level is accepted; the history starts over
            hist_l, hist_g = [], []
        if finite and (as_anchors or not skip):  # ours never records a skipped outlier
            hist_l.append(loss)
            hist_g.append(gn)
        in_a_row = in_a_row + 1 if outlier and not settled else (0 if finite else in_a_row)
        skipped.append(bool(skip))
    return skipped


def run_skip_step(losses, grad_scales, window=16, sigma=6.0, patience=32, inner=None):
    """Drive refuse_nonfinite(skip_step(adam)), as make_optimizer composes them, on a
    1-parameter problem with the given losses and grad norms. Per step: skip-step's state
    before and after, the update, and whether the step applied nothing."""
    inner = inner or optax.chain(optax.scale_by_adam(), optax.scale(-0.1))
    tx = O.refuse_nonfinite(O.skip_step(inner, window, sigma, patience=patience))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for loss, g in zip(losses, grad_scales):
        grads = {"w": jnp.full(3, g / np.sqrt(3), jnp.float32)}
        before = state
        updates, state = update(grads, state, params, loss=loss)
        params = optax.apply_updates(params, updates)
        skipped = bool(state.metrics.refused | state.inner_state.metrics.skipped)
        history.append((before.inner_state, state.inner_state, updates, skipped))
    return history


def test_skip_step_skips_exactly_what_the_numpy_rule_skips():
    rng = np.random.default_rng(0)
    n = 40
    losses = 3 + 0.05 * rng.standard_normal(n)
    grad_norms = 1 + 0.05 * rng.standard_normal(n)
    losses[3] = 50.0  # before the history is long enough: must not skip
    losses[20] = 50.0
    grad_norms[27] = 40.0
    history = run_skip_step(losses, grad_norms)
    skipped = [h[-1] for h in history]
    # float32 norms of the float32 grads the optimizer saw
    seen = [float(np.linalg.norm(np.full(3, g / np.sqrt(3), np.float32))) for g in grad_norms]
    expected = numpy_skip_rule(np.float32(losses), seen, 16, 6.0)
    assert skipped == expected
    assert [i for i, s in enumerate(skipped) if s] == [20, 27]
    before, after, updates, _ = history[20]
    assert_trees_equal(before.inner_state, after.inner_state)  # moments and count untouched
    assert float(jnp.abs(updates["w"]).max()) == 0.0
    assert int(after.inner_state[0].count) == 20  # steps 0..19 applied, 20 skipped


def test_a_nan_never_enters_the_skip_step_history():
    losses = [3.0] * 10 + [np.nan] + [3.0] * 2 + [30.0]
    grads = [1.0] * 10 + [1.0] + [np.nan, 1.0, 1.0]
    losses = np.array(losses) + 0.01 * np.arange(len(losses))
    history = run_skip_step(losses, grads, window=8)
    skipped = [h[-1] for h in history]
    assert skipped[10] and skipped[11]  # NaN loss; NaN grad
    assert skipped[13]  # the next finite outlier is still caught
    assert sum(skipped) == 3
    after_nan = history[11][1]
    assert int(after_nan.count) == 10 and np.all(np.isfinite(np.asarray(after_nan.loss_history)))
    assert_trees_equal(history[10][0].inner_state, history[11][1].inner_state)


def test_a_skipped_outlier_does_not_blind_the_rule_to_the_next_one():
    rng = np.random.default_rng(1)
    losses = 5.3 + 0.1 * rng.standard_normal(60)
    losses[40] += 8.0  # a poisoned batch, skipped
    losses[50] += 2.0  # another, 10 steps later
    grads = np.ones(60)
    history = run_skip_step(losses, grads, window=32)
    skipped = [h[-1] for h in history]
    assert [i for i, s in enumerate(skipped) if s] == [40, 50]
    assert skipped == numpy_skip_rule(np.float32(losses), np.float32(grads), 32, 6.0)
    # As OLMo-core and Levanter record it (the raw +8 in the history), step 50 is applied.
    assert [i for i, s in enumerate(numpy_skip_rule(losses, grads, 32, 6.0, as_anchors=True))
            if s] == [40]
    before, after = history[40][:2]  # the skipped outlier left the history as it was
    assert int(after.count) == int(before.count) == 40
    np.testing.assert_array_equal(np.asarray(after.loss_history), np.asarray(before.loss_history))


def test_under_a_short_window_skipped_outliers_do_not_raise_the_threshold():
    """Window 16, junk batches every 15 steps (+6 nats): all four are skipped, and the loss
    threshold after them is that of the last 16 clean steps (recorded clipped to the
    threshold, as this rule once did, each skip raised it); a genuine level change is still
    accepted after the patience (the next test)."""
    rng = np.random.default_rng(3)
    losses = (3.0 + 0.05 * rng.standard_normal(100)).astype(np.float32)
    junk = [40, 55, 70, 85]
    losses[junk] += 6.0
    history = run_skip_step(losses, np.ones(100), window=16)
    skipped = [h[-1] for h in history]
    assert [i for i, s in enumerate(skipped) if s] == junk
    assert skipped == numpy_skip_rule(losses, np.ones(100), 16, 6.0)
    clean = np.delete(losses[:86], junk)[-16:]  # what the history holds at step 86
    expected = clean.astype(np.float64).mean() + 6.0 * clean.astype(np.float64).std(ddof=1)
    assert float(history[86][1].metrics.loss_threshold) == pytest.approx(expected, rel=1e-5)
    assert expected < 3.6


def test_skip_step_misses_junk_batches_while_the_loss_falls_fast_as_its_docstring_says():
    """skip_step's misses on a planted series: a loss falling from 5.5 to 2.0 nats (e-fold 150
    steps, noise 0.05) with 40 junk batches of +1.3 nats at random steps of 2,000, window 128,
    6 sigma. No clean step is skipped; the 15 junk batches up to step 524 are all applied
    (while the loss falls fast its trend inflates the window's std, and each junk batch
    applied joins the history and raises the bar for the next); the 25 after it all skipped."""
    rng = np.random.default_rng(0)
    steps = np.arange(2000)
    loss = 2.0 + 3.5 * np.exp(-steps / 150) + 0.05 * rng.standard_normal(2000)
    junk = np.sort(rng.choice(np.arange(20, 2000), 40, replace=False))
    loss[junk] += 1.3
    tx = O.skip_step(optax.identity(), 128, 6.0, patience=32)
    params = jnp.zeros(())

    def body(state, x):
        return tx.update(jnp.ones(()), state, params, loss=x)[1], None
    skipped = []
    state = tx.init(params)
    run = jax.jit(lambda s, x: (lambda n: (n, n.metrics.skipped))(body(s, x)[0]))
    for x in loss.astype(np.float32):
        state, s = run(state, x)
        skipped.append(bool(s))
    skipped = np.array(skipped)
    is_junk = np.isin(steps, junk)
    assert not np.any(skipped & ~is_junk)  # no clean step skipped
    assert list(junk[~skipped[junk]]) == list(junk[junk <= 524]) and len(junk[junk <= 524]) == 15
    assert skipped[junk[junk > 524]].all() and len(junk[junk > 524]) == 25


def test_a_permanent_shift_of_the_loss_level_is_accepted_within_the_patience():
    rng = np.random.default_rng(2)
    losses = 3.0 + 0.02 * rng.standard_normal(120)
    losses[40:] += 1.0  # a new data mixture, say: the level moves for good
    history = run_skip_step(losses, np.ones(120), window=32, patience=5)
    skipped = [h[-1] for h in history]
    assert [i for i, s in enumerate(skipped) if s] == [40, 41, 42, 43, 44]  # then accepted
    assert int(history[45][1].count) == 1  # the history starts over at the new level
    assert skipped == numpy_skip_rule(np.float32(losses), np.ones(120), 32, 6.0, patience=5)


def test_refuse_nonfinite_keeps_the_promise_of_optax_apply_if_finite():
    """The same gradient stream, NaN or inf at a few steps, through optax.apply_if_finite(adam)
    and refuse_nonfinite(scale_by_adam) with the LR after it: a non-finite step changes no
    parameter, moment or count in either, and every other step is the same Adam step. (They
    differ on purpose after many bad steps in a row: optax applies the update after
    max_consecutive_errors of them; train.py stops with its last checkpoint intact.)"""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)}
    ours = optax.chain(O.refuse_nonfinite(optax.scale_by_adam()),
                       O.scale_by_schedule_at_step(lambda step: 1e-2))
    theirs = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=100)
    p1, s1, p2, s2 = params, ours.init(params), params, theirs.init(params)
    for step in range(12):
        g = rng.standard_normal((4, 3)).astype(np.float32)
        g[1, 2] = {3: np.nan, 7: np.inf, 8: np.nan}.get(step, g[1, 2])
        u1, s1 = ours.update({"w": jnp.asarray(g)}, s1, p1, loss=jnp.float32(1.0), step=step)
        u2, s2 = theirs.update({"w": jnp.asarray(g)}, s2, p2)
        before = p1
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        adam1, adam2 = s1[0].inner_state, s2.inner_state[0]
        assert int(adam1.count) == int(adam2.count) == step + 1 - sum(s <= step for s in (3, 7, 8))
        np.testing.assert_allclose(adam1.mu["w"], adam2.mu["w"], rtol=1e-6)
        np.testing.assert_allclose(adam1.nu["w"], adam2.nu["w"], rtol=1e-6)
        np.testing.assert_allclose(p1["w"], p2["w"], rtol=1e-6, atol=1e-7)
        if step in (3, 7, 8):
            assert bool(s1[0].metrics.refused) and not bool(s2.last_finite)
            np.testing.assert_array_equal(p1["w"], before["w"])


def test_a_step_whose_update_is_nonfinite_is_skipped():
    def overflow(updates, state, params=None):  # a gradient above 2 overflows the update
        return jax.tree.map(lambda u: jnp.where(u > 2, jnp.inf, u), updates), state
    inner = optax.chain(optax.GradientTransformation(lambda p: optax.EmptyState(), overflow),
                        optax.scale_by_adam(), optax.scale(-0.1))
    tx = O.refuse_nonfinite(inner)  # on its own: it needs no skip-step
    params, state = {"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)})
    history = []
    for g in [1.0, 1.0, 1.0, 10.0, 1.0, 1.0]:
        before = state
        updates, state = tx.update({"w": jnp.full(3, g / np.sqrt(3))}, state, params, loss=3.0)
        history.append((before, state, updates))
    assert [bool(h[1].metrics.refused) for h in history] == [0, 0, 0, 1, 0, 0]
    before, after, updates = history[3]
    assert float(after.metrics.grad_norm) == pytest.approx(10.0)  # loss and grad were finite
    assert float(jnp.abs(updates["w"]).max()) == 0.0 == float(after.metrics.update_norm)
    assert_trees_equal(before.inner_state, after.inner_state)


class ZClipReference:
    """ZClip's published rule (bluorion-com/ZClip, zclip.py: mode "zscore", clip_option
    "adaptive_scaling", clip_factor 1) restated in plain Python on a series of grad norms:
    step(norm) -> the norm after clipping."""

    def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25):
        self.alpha, self.z, self.cap, self.eps, self.warmup = (alpha, z_thresh, max_grad_norm,
                                                               eps, warmup_steps)
        self.buffer, self.mean, self.var = [], None, None

    def step(self, norm):
        def clipped(to):
            return norm * (to / (norm + 1e-6)) if norm > to else norm
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) >= self.warmup:
                self.mean = sum(self.buffer) / len(self.buffer)
                self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
            return clipped(self.cap)
        std = self.var ** 0.5
        z = (norm - self.mean) / (std + self.eps)
        clip_val = self.mean + (self.z * std) / (z / self.z) if z > self.z else None
        out = clipped(min(clip_val if clip_val is not None else norm, self.cap))
        c = clip_val if clip_val is not None else norm
        self.mean = self.alpha * self.mean + (1 - self.alpha) * c
        self.var = self.alpha * self.var + (1 - self.alpha) * (c - self.mean) ** 2
        return out


def test_zclip_clips_as_the_published_rule_does():
    rng = np.random.default_rng(4)
    norms = np.abs(0.5 + 0.05 * rng.standard_normal(80))
    norms[[10, 40, 41, 60]] = [3.0, 2.0, 0.9, 5.0]  # one in the warmup (only capped), then spikes
    tx = O.zclip(max_norm=4.0)
    state, ref = tx.init({"w": jnp.zeros(4)}), ZClipReference(max_grad_norm=4.0)
    update = jax.jit(tx.update)
    ours, theirs = [], []
    for n in norms:
        out, state = update({"w": jnp.full(4, n / 2, jnp.float32)}, state)
        ours.append(float(optax.tree.norm(out)))
        theirs.append(ref.step(float(np.float32(n))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    clipped = [i for i, (a, n) in enumerate(zip(ours, norms)) if a < n * (1 - 1e-5)]
    assert clipped == [40, 60]  # 10 fell in the warmup: only capped at 4; 41 within 2.5 sigma
    assert float(state.mean) == pytest.approx(ref.mean, rel=1e-5)
    assert float(state.var) == pytest.approx(ref.var, rel=1e-4)


def guarded(update_scale: float):
    """refuse_nonfinite around a plain scale: the smallest inner optimizer QK-Clip can wrap."""
    return optax.chain(O.refuse_nonfinite(optax.scale(update_scale)),
                       optax.GradientTransformationExtraArgs(
                           lambda _: optax.EmptyState(), lambda u, s, p=None, **kw: (u, s)))


def test_qk_clip_rescales_each_head_as_the_references_rule_does():
    """The rule restated from AI-Hypercomputer/maxtext, src/MaxText/utils/qk_clip_utils.py
    (Kimi K2's Alg. 1 on MLA): `scale = jnp.minimum(1.0, tau / (s_max + 1e-6))`, then
    `w_qc * jnp.sqrt(scale_b)` and `w_kc * jnp.sqrt(scale_b)` on each head's own parts, the
    shared rotary parts `w_qr * scale_b` and the shared rotary key left alone. So: with one key
    head per query head, sqrt(gamma) on each; under grouped-query attention (a key shared like
    K2's rotary key), gamma on the query head and the key untouched. No factor above 1; a head
    whose max is negative, or under tau, untouched."""
    rng = np.random.default_rng(5)
    L, D, H = 2, 8, 4
    S = np.array([[50.0, 150.0, -400.0, 400.0], [90.0, 99.0, 100.0, 101.0]], np.float32)
    gamma = np.where(S > 100.0, 100.0 / S, 1.0)  # signed: -400 is no excess
    for K in (4, 2, 1):  # multi-head, grouped, one key head
        N = 4
        params = {"layers": {"wq": rng.standard_normal((L, D, N, H)).astype(np.float32),
                             "wk": rng.standard_normal((L, D, K, H)).astype(np.float32)}}
        grads = jax.tree.map(lambda w: rng.standard_normal(w.shape).astype(np.float32), params)
        tx = O.qk_clip(guarded(-0.1), tau=100.0)
        updates, _ = tx.update(grads, tx.init(params), params, loss=1.0, step=3,
                               attn_logit_max_per_head=jnp.asarray(S))
        q_scale, k_scale = (np.sqrt(gamma), np.sqrt(gamma)) if K == N else (gamma,
                                                                             np.ones((L, K)))
        for w, scale in (("wq", q_scale), ("wk", k_scale)):
            before = params["layers"][w] - 0.1 * grads["layers"][w]
            got = params["layers"][w] + np.asarray(updates["layers"][w])
            np.testing.assert_allclose(got, before * scale[:, None, :, None], rtol=1e-5,
                                       atol=1e-6)
            assert scale.max() <= 1.0  # no weight ever grows
        # every head's logit scales by its own gamma: its q scale x its key head's scale
        np.testing.assert_allclose(q_scale * np.repeat(k_scale, N // K, axis=1), gamma,
                                   rtol=1e-6)
    skipped, _ = tx.update(jax.tree.map(lambda g: g * np.nan, grads), tx.init(params), params,
                           loss=1.0, step=3, attn_logit_max_per_head=jnp.asarray(S))
    assert float(optax.tree.norm(skipped)) == 0.0  # a refused step applies, and clips, nothing


@pytest.mark.slow
def test_qk_clip_brings_the_clipped_heads_max_logit_to_tau_on_the_same_batch(tiny_tokens):
    """A step whose update is zero: QK-Clip alone moves the weights. On that batch each head
    above tau ends at tau, the others where they were; per head, the maxima are the form's.
    One layer: a second layer's inputs would move with the first layer's clip."""
    cfg = tiny(model__n_heads=4, model__n_kv_heads=2, model__n_layers=1)
    params = M.init_params(cfg.model, jax.random.key(0))
    params["layers"]["wq"] = params["layers"]["wq"] * 40.0  # logits of a few units
    tokens = jnp.asarray(np.tile(tiny_tokens, (2, 1)))
    aux = jax.jit(lambda p: M.loss_fn(p, tokens, cfg.model, head_stats=True)[1])
    with jax.set_mesh(mesh_of(1, 1)):
        def heads(p):
            a = aux(p)
            return np.asarray(a["attn_logit_max_per_head"]), np.asarray(a["attn_logit_max"])
        S, per_layer = heads(params)  # signed max per head; per layer the |max|
        tau = float(np.median(S))
        tx = O.qk_clip(guarded(0.0), tau)
        updates, _ = jax.jit(functools.partial(tx.update, loss=1.0, step=0))(
            params, tx.init(params), params, attn_logit_max_per_head=jnp.asarray(S))
        after, _ = heads(jax.jit(optax.apply_updates)(params, updates))
    clipped = S > tau
    assert clipped.any() and (~clipped).any()
    np.testing.assert_allclose(after[clipped], tau, rtol=1e-4)  # the signed max: exactly tau
    np.testing.assert_allclose(after[~clipped], S[~clipped], rtol=1e-4)
    # the statistic is the signed max: a head's |max| may be larger, from negative logits
    assert np.all(S <= per_layer.max() + 1e-6)


@pytest.mark.slow
def test_qk_clip_switched_on_by_a_resume_acts_from_that_step_and_is_recorded(tmp_path):
    cfg = tiny(tmp_path, steps=4, checkpoint_every=4, optim__min_lr_ratio=1.0)
    T.train(cfg, devices=jax.devices()[:1])
    on = dataclasses.replace(cfg, steps=8, optim=dataclasses.replace(cfg.optim, qk_clip=0.3))
    T.train(on, devices=jax.devices()[:1])  # the checkpoint's optimizer state is unchanged
    stored = CF.load_config(tmp_path / "run")
    assert stored.optim.qk_clip == 0.3 and stored.optim.qk_clip_start == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in lines] == list(range(8))
    assert "qk_clip_heads" not in lines[3] and lines[-1]["qk_clip_heads"] > 0
    after = restore_final(stored, 8)["params"]["layers"]
    S = np.asarray(lines[-1]["attn_logit_max"])  # the last step's batch: clipped (per layer)
    assert np.all(S > 0.3) and np.all(np.isfinite(np.asarray(after["wq"])))


def test_opt_metrics_reads_each_piece_by_type_and_nothing_from_a_foreign_optimizer():
    params = {"w": jnp.ones(3)}
    assert O.opt_metrics(optax.adam(1e-3).init(params)) == {}  # bench/bench.py's plain AdamW
    cfg = O.OptimConfig(skip_step=True, update_clip="norm")
    tx = O.make_optimizer(cfg, 10, {"w": True})
    _, state = tx.update({"w": jnp.full(3, 2.0)}, tx.init(params), params, loss=3.0, step=0)
    m = O.opt_metrics(state, cfg.clip_norm)
    assert float(m["grad_norm"]) == pytest.approx(np.sqrt(12.0))
    assert float(m["grad_norm_clipped"]) == pytest.approx(1.0)  # at max_grad_norm
    assert int(m["skipped"]) == 0 and np.isinf(float(m["skip_loss_threshold"]))  # not armed
    assert float(m["update_norm"]) > 0 and "update_clip_threshold" in m


def test_the_update_norm_clip_scales_to_its_rolling_threshold():
    """Levanter's clip_update_norm (marin-community/levanter), as a check against its code
    found it: mean + sigma * max(population std (ddof 0), 1e-6) of the last `window` norms."""
    tx = O.clip_update_norm(window=4, sigma=2.0)
    state = tx.init(None)
    norms = [1.0, 1.2, 0.8, 1.1, 5.0, 0.9]
    for i, n in enumerate(norms):
        u = {"a": jnp.array([n, 0.0]), "b": jnp.zeros(3)}
        out, new = tx.update(u, state, None)
        hist = np.array(norms[max(0, i - 4):i])
        if i >= 2:
            thr = hist.mean() + 2.0 * max(hist.std(ddof=0), 1e-6)
            assert float(new.metrics.threshold) == pytest.approx(thr, rel=1e-6)
            expect = min(n, thr)
        else:
            assert np.isinf(float(new.metrics.threshold))
            expect = n
        assert float(optax.tree.norm(out)) == pytest.approx(expect, rel=1e-6)
        assert float(new.metrics.norm_before) == pytest.approx(n)
        state = new
    assert float(np.asarray(state.history)[4 % 4]) == pytest.approx(5.0)  # unclipped recorded


def test_the_update_rms_clip_bounds_each_tensor_and_each_layer():
    tx = O.clip_update_rms(1.0, stacked=O.is_stacked)
    u = {"small": jnp.full((4,), 0.5), "big": jnp.full((3, 3), 4.0),
         "layers": {"w": jnp.stack([jnp.full((2, 2), 3.0), jnp.full((2, 2), 0.2)])}}
    out, _ = tx.update(u, tx.init(None), None)
    np.testing.assert_array_equal(out["small"], u["small"])  # below threshold: untouched
    assert float(jnp.sqrt(jnp.mean(out["big"] ** 2))) == pytest.approx(1.0)
    per_layer = np.sqrt(np.mean(np.asarray(out["layers"]["w"]) ** 2, axis=(1, 2)))
    np.testing.assert_allclose(per_layer, [1.0, 0.2], rtol=1e-6)  # per layer, not per stack


def test_the_schedule_warms_up_holds_and_decays():
    cfg = O.OptimConfig(lr=1.0, warmup_steps=10, decay="linear", decay_fraction=0.5,
                        min_lr_ratio=0.1)
    s = O.lr_schedule(cfg, 100)
    assert float(s(0)) == pytest.approx(0.1) and float(s(9)) == pytest.approx(1.0)
    assert float(s(50)) == pytest.approx(1.0)  # hold
    assert float(s(75)) == pytest.approx(0.55)  # halfway down the last 50 of the 100 steps
    # Levanter's `decay`: a fraction of all the steps (9e-4 of the peak apart at step 640 of
    # 1,000, warmup 100, from a fraction of the steps after the warmup), at most those after it
    lev = O.lr_schedule(dataclasses.replace(cfg, warmup_steps=100, decay_fraction=0.4), 1000)
    assert float(lev(600)) == pytest.approx(1.0) and float(lev(800)) == pytest.approx(0.55)
    assert float(O.lr_schedule(dataclasses.replace(cfg, decay_fraction=0.95), 100)(55)) == \
        pytest.approx(float(O.lr_schedule(dataclasses.replace(cfg, decay_fraction=1.0), 100)(55)))
    assert float(s(100)) == pytest.approx(0.1)
    cos = O.lr_schedule(dataclasses.replace(cfg, decay="cosine", decay_fraction=1.0), 100)
    assert float(cos(10)) == pytest.approx(1.0)  # the decay starts where warmup ends
    assert float(cos(55)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5)))


@pytest.mark.parametrize("preset", ["cpu", "tiny", "marin-32b", "story"])
def test_the_schedule_is_continuous_where_warmup_ends(preset):
    """No step of a preset's schedule moves the LR by more than one warmup increment (the
    cosine decay over the whole run once dropped 3.00e-3 to 2.60e-3 in one step there)."""
    cfg = CF.PRESETS[preset]
    t = np.arange(cfg.steps + 1)
    lr = np.asarray(O.lr_schedule(cfg.optim, cfg.steps)(t))
    w = cfg.optim.warmup_steps
    assert lr[w - 1] == pytest.approx(cfg.optim.lr) and lr[w] == pytest.approx(cfg.optim.lr)
    assert np.max(np.abs(np.diff(lr))) <= cfg.optim.lr / max(w, 1) * 1.001  # float32


def test_the_schedule_rewarms_as_marin_did_at_step_80k():
    cfg = dataclasses.replace(CF.PRESETS["marin-32b"].optim, rewarmup_start=80_000,
                              rewarmup_steps=1000, rewarmup_from_ratio=0.1)
    s = O.lr_schedule(cfg, 160_000)
    assert float(s(79_999)) == pytest.approx(7e-4)
    assert float(s(80_000)) == pytest.approx(7e-5)
    assert float(s(80_500)) == pytest.approx(7e-5 + 0.5 * (7e-4 - 7e-5))
    assert float(s(81_000)) == pytest.approx(7e-4)
    assert float(s(90_000)) == pytest.approx(7e-4)  # then hold (decay starts at 96,000)


def test_a_nan_step_changes_nothing_and_the_schedule_advances(tiny_tokens):
    """A NaN loss changes no parameter or optimizer state; the LR still follows the step."""
    cfg = tiny()  # skip_step off: the non-finite rule acts regardless
    state, tx, _ = init_sharded(cfg, mesh_of(1, 1))
    step = T.make_train_step(cfg, tx)
    with jax.set_mesh(mesh_of(1, 1)):
        state["params"]["final_norm"] = state["params"]["final_norm"] * jnp.nan
        before = jax.tree.map(np.asarray, state)
        new, metrics = step(state, jnp.asarray(np.tile(tiny_tokens, (2, 1))))
        new, metrics2 = step(new, jnp.asarray(np.tile(tiny_tokens, (2, 1))))
    assert int(metrics["skipped"]) == 1 and int(new["step"]) == 2
    assert float(metrics2["lr"]) > float(metrics["lr"])  # schedule(1) > schedule(0) in warmup
    assert_trees_equal(before["opt_state"][0].inner_state, new["opt_state"][0].inner_state)
    np.testing.assert_array_equal(np.asarray(new["params"]["layers"]["wq"]),
                                  before["params"]["layers"]["wq"])


def test_the_per_layer_signals_are_those_of_the_state_the_step_read_and_wrote(tiny_tokens):
    """Adam's moment norms and the RMS of m / sqrt(v) of the state after the step; the update
    over the weights' norm and the q/k spectral entropy of the weights before it (from their
    singular values); each per layer, recomputed in NumPy."""
    cfg = tiny(spectral_metrics=True)
    state, tx, _ = init_sharded(cfg, mesh_of(1, 1))
    step = T.make_train_step(cfg, tx)
    with jax.set_mesh(mesh_of(1, 1)):
        new, metrics = step(state, jnp.asarray(np.tile(tiny_tokens, (2, 1))))
        read = jax.device_get(new["params"]["layers"])
        new, metrics = step(new, jnp.asarray(np.tile(tiny_tokens, (2, 1))))
    adam = new["opt_state"][0].inner_state[1]  # chain(clip, adam, decay): the second
    assert isinstance(adam, optax.ScaleByAdamState) and int(adam.count) == 2

    def per_layer(tree, f=np.square):
        return sum(np.sum(f(np.asarray(x, np.float64)), axis=tuple(range(1, x.ndim)))
                   for x in jax.tree.leaves(tree))
    for key, moment in (("adam_mu_norm_per_layer", adam.mu), ("adam_nu_norm_per_layer", adam.nu)):
        expected = np.sqrt(per_layer(moment["layers"]))
        np.testing.assert_allclose(np.asarray(metrics[key]), expected, rtol=1e-5)
        assert expected.shape == (cfg.model.n_layers,) and np.all(expected > 0)
    ratio = jax.tree.map(lambda m, v: np.asarray(m, np.float64) / (np.sqrt(v) + 1e-8),
                         adam.mu["layers"], adam.nu["layers"])
    count = sum(x[0].size for x in jax.tree.leaves(ratio))
    np.testing.assert_allclose(np.asarray(metrics["adam_ratio_rms_per_layer"]),
                               np.sqrt(per_layer(ratio) / count), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["update_ratio_per_layer"]),
                               np.asarray(metrics["update_norm_per_layer"])
                               / np.sqrt(per_layer(read)), rtol=1e-5)
    for w in ("wq", "wk"):
        x = np.asarray(read[w], np.float64)
        sv = np.linalg.svd(x.reshape(x.shape[0], x.shape[1], -1), compute_uv=False) ** 2
        p = sv / sv.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(metrics[f"{w}_entropy"]),  # (Renyi, order 2)
                                   -np.log(np.sum(p ** 2, -1)) / np.log(p.shape[-1]), rtol=1e-4)
    flat, one = np.eye(8)[None], np.outer(np.arange(1, 9), np.ones(8))[None]
    np.testing.assert_allclose(TR.spectral_entropy(jnp.asarray(flat)), [1.0], rtol=1e-5)
    np.testing.assert_allclose(TR.spectral_entropy(jnp.asarray(one)), [0.0], atol=1e-5)


def test_muon_splits_the_parameters_as_levanters_muon_does():
    """Levanter (marin-community/levanter, src/levanter/optim/muon.py) and Keller Jordan's Muon
    README: the embedding, the LM head and every vector on AdamW; the hidden matrices on Muon
    with momentum 0.95 (`momentum: float = 0.95`). optax's Muon moment after one step of
    gradient g is (1 - momentum) g."""
    cfg = tiny(optim__optimizer="muon")
    params = M.init_params(cfg.model, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    o = cfg.optim
    layout = M.optimizer_layout(cfg.model)
    tx = HB.muon_with_adam(layout["decay_mask"], layout["matrix_dims"], o.muon_momentum, o.b1,
                           o.b2, o.eps)
    with jax.set_mesh(mesh_of(1, 1)):
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    adam = state.inner_states["adam"].inner_state
    muon = state.inner_states["muon"].inner_state[0]
    on_muon = {k for k, v in muon.mu["layers"].items() if not isinstance(v, optax.MaskedNode)}
    assert on_muon == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    assert isinstance(muon.mu["embed"], optax.MaskedNode)
    assert not isinstance(adam.mu["head"], optax.MaskedNode)
    np.testing.assert_allclose(np.asarray(muon.mu["layers"]["wq"]), 0.05 * 0.5, rtol=1e-6)
    # Adam's first step on a constant gradient: +-1 per element
    np.testing.assert_allclose(np.asarray(updates["head"]), 1.0, rtol=1e-5)


def test_the_optimizer_reads_the_weight_layout_from_the_parameter_table():
    """Muon's input / output dims and QK-Clip's head dims come from model.param_table (its axes
    and fan_in), not from a second table of names: the same dims the optimizer used to name."""
    cfg = tiny().model
    assert M.optimizer_layout(cfg)["matrix_dims"] == {
        "wq": ((1,), (2, 3)), "wk": ((1,), (2, 3)), "wv": ((1,), (2, 3)), "wo": ((1, 2), (3,)),
        "w_gate": ((1,), (2,)), "w_up": ((1,), (2,)), "w_down": ((1,), (2,)),
        "head": ((0,), (1,))}
    assert M.optimizer_layout(cfg)["head_axes"] == {"wq": 2, "wk": 2}
    dims = M.optimizer_layout(cfg)["matrix_dims"]
    for name, (inputs, outputs) in dims.items():  # every non-layer dim, once
        spec = M.param_table(cfg)[name if name == "head" else f"layers/{name}"]
        assert sorted(inputs + outputs) == [d for d, a in enumerate(spec.axes) if a != "layers"]


@pytest.mark.slow
def test_muon_trains(tiny_tokens):
    cfg = tiny(optim__optimizer="muon")
    state, tx, _ = init_sharded(cfg, mesh_of(1, 1))
    step = T.make_train_step(cfg, tx)
    losses = []
    with jax.set_mesh(mesh_of(1, 1)):
        for _ in range(5):
            state, m = step(state, jnp.asarray(np.tile(tiny_tokens, (2, 1))))
            losses.append(float(m["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.5


def numpy_norm(x):  # a matrix's norm per stacked layer, as the rule states it
    x = np.asarray(x, np.float64)
    return np.sqrt((x ** 2).sum(axis=tuple(range(1, x.ndim)))) if x.ndim > 2 else \
        np.sqrt((x ** 2).sum())


def per_layer(x, like):
    return np.asarray(x).reshape(np.shape(x) + (1,) * (like.ndim - np.ndim(x)))


def test_hyperball_keeps_each_matrix_on_its_sphere_and_steps_as_the_published_rule(
        tiny_tokens):
    """AdamH (Wen et al.; Levanter's adamH), restated in NumPy: each matrix (per stacked
    layer) moves to R * Norm(W - lr * R * Norm(u)), u Adam's direction before the LR step, R
    its norm at init, which every later step keeps to float rounding; the embedding and the
    norms' scales move by -adam_lr * u."""
    cfg = tiny(optim__optimizer="adamh", optim__lr=0.05, optim__adam_lr=0.01,
               optim__warmup_steps=1, optim__max_grad_norm=0.0)
    layout = M.optimizer_layout(cfg.model)
    tx = CF.make_tx(cfg)
    plain = O.make_optimizer(dataclasses.replace(  # the same direction, a plain LR step
        cfg.optim, optimizer="adamw", weight_decay=0.0), cfg.steps, **layout)
    params = M.init_params(cfg.model, jax.random.key(0))
    radius, matrix = flat_params(jax.tree.map(numpy_norm, params)), flat_params(
        layout["decay_mask"])
    grad = jax.jit(jax.grad(lambda p, t: M.loss_fn(p, t, cfg.model)[0]))
    schedule = O.lr_schedule(cfg.optim, cfg.steps)
    plain_update, update = (jax.jit(functools.partial(t.update, loss=jnp.float32(1.0)))
                            for t in (plain, tx))
    with jax.set_mesh(mesh_of(1, 1)):
        state, plain_state = tx.init(params), plain.init(params)
        for step in range(4):  # jitted, as the train step applies them
            g, lr = grad(params, jnp.asarray(tiny_tokens)), float(schedule(step))
            plain_u, plain_state = plain_update(g, plain_state, params, step=step)
            updates, state = update(g, state, params, step=step)
            new = jax.jit(optax.apply_updates)(params, updates)
            for k, w in flat_params(params).items():
                w, u = np.asarray(w, np.float64), -np.asarray(flat_params(plain_u)[k]) / lr
                got = np.asarray(flat_params(new)[k])
                if matrix[k]:
                    r = per_layer(radius[k], w)
                    moved = w - lr * r * u / per_layer(numpy_norm(u), w)
                    want = r * moved / per_layer(numpy_norm(moved), w)
                    np.testing.assert_allclose(numpy_norm(got), radius[k], rtol=2e-6,
                                               err_msg=k)
                else:  # Adam at its own peak LR, on the same schedule
                    want = w - 0.01 / 0.05 * lr * u
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-7, err_msg=k)
            params = new


# The hero run's MuonH, restated in float64 NumPy from marin's source: the routing of
# experiments/grug/moe_hero_ep/optimizer.py (GrugMoeMuonHConfig.create_mask: matrices on MuonH,
# the LM head on AdamH, the embedding, norm gains and attn_gate on Adam; max_grad_norm None),
# its Muon (grugmuon_hero.py: momentum, Nesterov, Newton-Schulz with Levanter's util.py
# "quintic" triples, the transpose to wide, the sqrt(max(1, fan_out / fan_in)) scale) and its
# hyperball step (_scale_invariant_hyperball_updates: the radius is the matrix's norm now).
HERO_QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def hero_newton_schulz(x):
    x = x / (np.linalg.norm(x) + 1e-8)
    transpose = x.shape[0] > x.shape[1]
    x = x.T if transpose else x
    for a, b, c in HERO_QUINTIC:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if transpose else x


def hero_sphere_step(w, u, lr):
    """One matrix (fan_in x fan_out) moved along u and put back on its sphere."""
    norm = np.sqrt((w ** 2).sum())
    new = w - lr * u * norm / max(np.sqrt((u ** 2).sum()), 1e-10)
    return new / max(np.sqrt((new ** 2).sum()), 1e-10) * norm


def hero_muonh(params, grads, lr, adam_lr, b1=0.9, b2=0.95, eps=1e-8, momentum=0.95):
    """The hero's MuonH over a list of gradients, on the tiny model's table (each stacked
    layer's wq [D, N, H] the matrix [D, N * H] the hero stores, wo [N * H, D]); yields the
    parameters after each step."""
    table = M.param_table(CF.PRESETS["tiny"].model)
    w = {k: np.asarray(x, np.float64) for k, x in params.items()}
    buf = {k: np.zeros_like(x) for k, x in w.items()}
    m, v = dict(buf), dict(buf)
    for t, g in enumerate(grads, start=1):
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        for k in w:
            name = k.split("/")[-1]
            adam = name in ("embed", "w_attn_gate") or "norm" in name
            if name == "head" or adam:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
                u = m[k] / (1 - b1 ** t) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
                w[k] = w[k] - adam_lr * u if adam else hero_sphere_step(w[k], u, lr)
                continue
            buf[k] = momentum * buf[k] + g[k]
            u = momentum * buf[k] + g[k]
            fan_in = table[k].fan_in
            for layer in range(w[k].shape[0]):  # each layer's matrix, fan_in x fan_out
                shape = w[k][layer].shape
                n_in = int(np.prod([table[k].shape[d] for d in fan_in]))
                x = u[layer].reshape(n_in, -1)
                x = hero_newton_schulz(x) * np.sqrt(max(1, x.shape[1] / x.shape[0]))
                w[k][layer] = hero_sphere_step(w[k][layer].reshape(n_in, -1), x,
                                               lr).reshape(shape)
        yield w


def test_muonh_is_the_hero_runs_muonh_restated_from_marins_source():
    """--optim.optimizer muonh against hero_muonh on one sequence of 100 random gradients: the
    parameters after 1, 10 and 100 steps agree leaf by leaf to float32 rounding (the Muon of
    optax this project's MuonH used before sits 2.9e-4 apart after one step). The attention
    gate (zero at init) moves on Adam and stays finite."""
    cfg = tiny(optim__optimizer="muonh", optim__lr=0.05, optim__adam_lr=0.01,
               optim__warmup_steps=0, optim__min_lr_ratio=1.0, model__attn_gate="headwise",
               model__qk_norm=True)
    assert cfg.optim.clip_norm == 0.0  # the hero's max_grad_norm is None
    tx = CF.make_tx(cfg)
    params = M.init_params(cfg.model, jax.random.key(0))
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda x: np.float32(0.01) * rng.standard_normal(x.shape, np.float32),
                          params) for _ in range(100)]
    update = jax.jit(functools.partial(tx.update, loss=jnp.float32(1.0)))
    want = hero_muonh(flat_params(params), [flat_params(g) for g in grads], 0.05, 0.01)
    with jax.set_mesh(mesh_of(1, 1)):
        state = tx.init(params)
        for step, g in enumerate(grads):
            updates, state = update(g, state, params, step=step)
            params = jax.jit(optax.apply_updates)(params, updates)
            expected = next(want)
            if step + 1 in (1, 10, 100):
                for k, got in flat_params(params).items():
                    np.testing.assert_allclose(got, expected[k], rtol=0, atol=3e-6 * max(
                        1.0, np.abs(expected[k]).max()), err_msg=f"{k} after {step + 1}")
    assert np.abs(flat_params(params)["layers/w_attn_gate"]).max() > 0


def flat_params(tree) -> dict:
    """{"layers/wq": leaf, ...}: a params-shaped tree by the parameter table's names."""
    return {"/".join(k.key for k in path): x
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_a_train_py_run_under_adamh_keeps_every_matrix_on_its_initial_sphere(tmp_path):
    """train.py --optim.optimizer adamh: after 6 steps every matrix of the final checkpoint has
    its initial norm, layer by layer; the run learned (the Adam leaves and the angles moved)."""
    cfg = tiny(tmp_path, steps=6, optim__optimizer="adamh", optim__lr=0.02)
    last = T.train(cfg, devices=jax.devices()[:1]).last
    init, final = (flat_params(p) for p in (M.init_params(cfg.model, jax.random.key(cfg.seed)),
                                            restore_final(cfg, 6)["params"]))
    matrix = flat_params(M.optimizer_layout(cfg.model)["decay_mask"])
    for k, w in final.items():
        if matrix[k]:
            np.testing.assert_allclose(numpy_norm(w), numpy_norm(init[k]), rtol=2e-6, err_msg=k)
            assert not np.allclose(w, init[k]), k
    loss = RC.read_metrics(tmp_path / "run")["loss"]
    assert last["eval_loss"] < loss[0] - 0.3 and loss[-1] < loss[0] - 0.3


@pytest.mark.slow
def test_gated_hyperball_runs_and_a_gate_inserted_into_adamh_train_finite(tmp_path):
    """The attention gate is zero at init: on a sphere of radius 0 its first step was 0 / 0.
    It moves on Adam instead (marin keeps attn_gate on Adam): a gated MuonH run trains finite
    and moves its gate; an AdamH run warm-started with the gate inserted trains on finite, and
    its matrices keep their norms at the switch."""
    gated = tiny(tmp_path / "gated", steps=4, checkpoint_every=4, optim__optimizer="muonh",
                 model__attn_gate="headwise")
    T.train(gated, devices=jax.devices()[:1])
    loss = RC.read_metrics(pathlib.Path(gated.run_dir))["loss"]
    gate = flat_params(restore_final(gated, 4)["params"])["layers/w_attn_gate"]
    assert np.isfinite(loss).all() and np.isfinite(gate).all() and np.abs(gate).max() > 0
    src = tiny(tmp_path / "src", steps=4, checkpoint_every=4, optim__optimizer="adamh")
    T.train(src, devices=jax.devices()[:1])
    args = W.WarmStartArgs(source=src.run_dir, to=str(tmp_path / "w"), insert="attn-gate",
                           rewarmup_steps=2)
    cfg = W.convert(args, ["--steps", "8"], devices=jax.devices()[:1])
    T.train(cfg, devices=jax.devices()[:1])
    metrics = RC.read_metrics(tmp_path / "w")
    assert np.isfinite(metrics["loss"]).all() and not metrics["skipped"].any()
    before, after = (flat_params(restore_final(c, s)["params"]) for c, s in ((src, 4), (cfg, 8)))
    for k, on in flat_params(M.optimizer_layout(cfg.model)["sphere_mask"]).items():
        if on:
            np.testing.assert_allclose(numpy_norm(after[k]), numpy_norm(before[k]), rtol=2e-6)
    assert np.isfinite(after["layers/w_attn_gate"]).all()


def test_a_nonfinite_hyperball_step_is_refused_whole():
    """The chain's last word: a Hyperball step that comes out non-finite from a finite
    direction (planted: one matrix's radius made inf in the state) applies nothing, keeps
    Adam's state exactly and is recorded as refused; the next finite step applies."""
    cfg = tiny(optim__optimizer="adamh", optim__warmup_steps=0)
    tx = CF.make_tx(cfg)
    params = M.init_params(cfg.model, jax.random.key(0))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    update = jax.jit(functools.partial(tx.update, loss=jnp.float32(1.0), step=0))
    with jax.set_mesh(mesh_of(1, 1)):
        guard, hyper = tx.init(params)
        planted = hyper._replace(radius={**hyper.radius, "head": jnp.float32(jnp.inf)})
        updates, (new_guard, _) = update(grads, (guard, planted), params)
        assert all(not np.asarray(u).any() for u in jax.tree.leaves(updates))
        assert bool(new_guard.metrics.refused)
        for old, new in zip(jax.tree.leaves(guard.inner_state),
                            jax.tree.leaves(new_guard.inner_state)):
            np.testing.assert_array_equal(new, old)
        updates, (new_guard, _) = update(grads, (guard, hyper), params)
        assert not bool(new_guard.metrics.refused)
        assert all(np.isfinite(u).all() for u in jax.tree.leaves(updates))


def test_hyperball_clips_each_group_by_its_own_norm():
    """Levanter's AdamHConfig and the hero's MuonH config clip each group (the sphere's, the
    Adam leaves') by its own global norm: a group under the clip is left as it is, one over
    it is scaled to it; MuonH's default is no clip, AdamH's 1.0, Adam's 1.0."""
    assert [O.OptimConfig(optimizer=o).clip_norm for o in ("adamw", "adamh", "muonh")] == [
        1.0, 1.0, 0.0]
    groups = {"a": "sphere", "b": "sphere", "c": "adam"}
    grads = {"a": jnp.full((4,), 1.5), "b": jnp.full((4,), 0.0), "c": jnp.full((4,), 0.2)}
    out, _ = HB.clip_by_group_norm(1.0, groups).update(grads, optax.EmptyState())
    np.testing.assert_allclose(optax.tree.norm({"a": out["a"], "b": out["b"]}), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(out["c"], grads["c"])
    layout = M.optimizer_layout(TINY.model)
    labels = HB.hyperball_groups("muonh", layout["sphere_mask"],
                                layout["matrix_dims"])
    assert (labels["layers"]["wq"], labels["head"], labels["embed"]) == ("muon", "sphere",
                                                                         "adam")


def test_beta2_from_the_batch_is_marins_rule_and_is_what_adam_applies():
    """The hero run's rule (marin #5951): clip(0.999 ** (tokens / 131,072), 0.95, 0.9999);
    the story's 2,048-token batch gets 0.9999, the 32B's 33.5M-token batch 0.95. Adam's
    second moment after one step from zero is (1 - beta2) g^2 with that beta2."""
    assert HB.beta2_for_batch(131_072) == pytest.approx(0.999)
    assert HB.beta2_for_batch(2_048) == 0.9999 and HB.beta2_for_batch(8192 * 4096) == 0.95
    assert HB.beta2_for_batch(4 * 131_072) == pytest.approx(0.999 ** 4)
    cfg = tiny(optim__b2_rule="batch", optim__max_grad_norm=0.0)  # 8 x 32 tokens: 0.9999
    params = M.init_params(cfg.model, jax.random.key(0))
    g = jax.tree.map(jnp.ones_like, params)
    tx = CF.make_tx(cfg)
    _, state = jax.jit(functools.partial(tx.update, loss=jnp.float32(1.0), step=0))(
        g, tx.init(params), params)  # jitted, as the train step applies it
    (adam,) = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    np.testing.assert_allclose(np.asarray(adam.nu["embed"]), 1e-4, rtol=1e-3)
    assert "beta2 0.9999 (from the batch)" in CF.identity(cfg)


def test_qk_mult_scales_the_normalised_scores_and_needs_qk_norm(tiny_tokens):
    """marin's qk_mult: with QK-Norm, q times a fixed multiplier after RoPE, so each attention
    logit of a layer (its max too) is that multiple of QK-Norm's own; without QK-Norm it is
    refused."""
    base = dataclasses.replace(TINY.model, qk_norm=True)
    params = M.init_params(base, jax.random.key(0))
    with jax.set_mesh(mesh_of(1, 1)):
        logit = [np.asarray(M.forward(params, jnp.asarray(tiny_tokens[:, :-1]), dataclasses.replace(
            base, qk_mult=m))[1]["attn_logit_max"]) for m in (1.0, 1.3)]
    np.testing.assert_allclose(logit[1][0], 1.3 * logit[0][0], rtol=1e-5)  # (layer 0: the
    # same input; a later layer's input moves with the first layer's attention)
    with pytest.raises(ValueError, match="qk_mult multiplies QK-Norm's normalised scores"):
        dataclasses.replace(TINY.model, qk_mult=1.3)


# ---------------------------------------------------------------------------------------------
# data.py

def test_a_batch_is_a_pure_function_of_the_step_and_splits_by_rows():
    data = D.TokenData(TINY.data)
    a, b = data.batch(5), data.batch(5)
    assert a.dtype == np.int32 and a.shape == (8, 33)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, data.batch(6))
    halves = np.concatenate([data.batch(5, slice(0, 4)), data.batch(5, slice(4, 8))])
    np.testing.assert_array_equal(halves, a)
    np.testing.assert_array_equal(data.held_out_batches(), data.held_out_batches())
    # the held-out tail never overlaps the training part
    assert data.train.size + data.held_out.size == D.load_tokens("").size


def test_replace_batches_changes_only_those_steps_batches():
    plain = D.TokenData(TINY.data)
    skipping = D.TokenData(dataclasses.replace(TINY.data, replace_batches="3:5"))
    for step in range(7):
        same = np.array_equal(plain.batch(step), skipping.batch(step))
        assert same == (step not in (3, 4)), step
    # replaced again (the guard after a relapse): other batches again, not the first ones
    twice = D.TokenData(dataclasses.replace(TINY.data, replace_batches="3:5,4:6"))
    assert np.array_equal(twice.batch(3), skipping.batch(3))
    assert not np.array_equal(twice.batch(4), skipping.batch(4))
    assert not np.array_equal(twice.batch(4), plain.batch(4))


def test_npy_bin_and_text_sources_read_the_same_tokens(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 5000)
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.astype("<u2").tofile(tmp_path / "nano.bin")
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, tokens.size)
    (tmp_path / "llmc.bin").write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    header[0] = 20240801
    (tmp_path / "llama3.bin").write_bytes(header.tobytes() + tokens.astype("<u4").tobytes())
    for name in ("t.npy", "nano.bin", "llmc.bin", "llama3.bin"):
        np.testing.assert_array_equal(D.load_tokens(str(tmp_path / name)), tokens, err_msg=name)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_bytes(b"world")
    (tmp_path / "docs" / "a.txt").write_bytes(b"hello ")
    assert D.load_tokens(str(tmp_path / "docs")).tobytes() == b"hello world"
    assert D.load_tokens(str(tmp_path / "docs" / "a.txt")).tobytes() == b"hello "
    data = D.TokenData(dataclasses.replace(TINY.data, source=str(tmp_path / "llmc.bin")), 1000)
    assert data.batch(0).max() < 1000


def llmc_shard(path: pathlib.Path, tokens: np.ndarray) -> pathlib.Path:
    header = np.zeros(256, "<i4")
    header[:3] = (20240520, 1, tokens.size)
    path.write_bytes(header.tobytes() + tokens.astype("<u2").tobytes())
    return path


def test_a_folder_or_glob_of_shards_is_one_stream_and_its_val_shards_are_never_trained_on(
        tmp_path):
    rng = np.random.default_rng(0)
    train = [rng.integers(0, 100, n) for n in (3000, 50, 2000)]  # ids below 100
    val = rng.integers(200, 256, 1500)  # ids from 200 up: easy to spot in a batch
    for i, t in enumerate(train):  # written out of order: read in sorted order
        llmc_shard(tmp_path / f"fineweb_train_{2 - i:06d}.bin", t) if i < 2 else \
            np.save(tmp_path / f"fineweb_train_{2 - i:06d}.npy", t.astype(np.int32))
    llmc_shard(tmp_path / "fineweb_val_000000.bin", val)
    stream = np.concatenate([train[2], train[1], train[0]])  # 000000.npy, 000001, 000002
    folder = D.TokenData(dataclasses.replace(TINY.data, source=str(tmp_path)))
    assert folder.train.size == stream.size and folder.held_out.size == val.size
    np.testing.assert_array_equal(np.asarray(folder.train), stream)
    np.testing.assert_array_equal(np.asarray(folder.train[2990:3010]), stream[2990:3010])
    np.testing.assert_array_equal(np.asarray(folder.held_out), val)
    batches = np.concatenate([folder.batch(s) for s in range(200)])
    assert batches.max() < 100  # never a validation token
    assert folder.held_out_batches().min() >= 200  # held out: validation tokens only
    glob = D.TokenData(dataclasses.replace(TINY.data, source=str(tmp_path / "*_train_*"),
                                           val_source=str(tmp_path / "*_val_*")))
    np.testing.assert_array_equal(glob.batch(7), folder.batch(7))  # the same stream
    np.testing.assert_array_equal(glob.held_out_batches(), folder.held_out_batches())


def test_the_embedded_corpus_is_the_stdlib_files_a_glob_finds_read_once_a_process():
    """The walk that skips the test folders lists what the glob it replaced listed (the stored
    runs trained on those bytes, in that order); the bytes are read once and cannot be written."""
    import sysconfig
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert D.stdlib_files() == sorted(p for p in root.rglob("*.py")
                                      if not D.STDLIB_SKIP & set(p.relative_to(root).parts))
    corpus = D.load_tokens("")
    assert corpus is D.load_tokens("") and not corpus.flags.writeable and corpus.size > 1e6


def test_spikefix_stdlib_names_another_pythons_library_as_the_corpus(tmp_path, monkeypatch):
    """A copy of another Python's library (3.11's text under 3.12) is walked as this one's."""
    for f in ("b.py", "a/c.py", "test/d.py", "a/e.txt"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_text(f)
    monkeypatch.setenv("SPIKEFIX_STDLIB", str(tmp_path))
    assert D.stdlib_files() == [tmp_path / "a/c.py", tmp_path / "b.py"]
    monkeypatch.setenv("SPIKEFIX_STDLIB", str(tmp_path / "none"))
    with pytest.raises(UserError, match="SPIKEFIX_STDLIB=.*none is not a folder"):
        D.stdlib_files()


def test_an_empty_spikefix_stdlib_is_named_as_such(tmp_path, monkeypatch, capsys):
    """SPIKEFIX_STDLIB naming a folder with no .py file: train.py's data and data.py prepare
    both name the variable and the folder (not "the embedded corpus is empty" alone)."""
    monkeypatch.setenv("SPIKEFIX_STDLIB", str(tmp_path))
    D.embedded_corpus.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"SPIKEFIX_STDLIB={tmp_path} holds no .py file"):
            D.TokenData(TINY.data)
        assert D.main(["prepare", "--out", str(tmp_path / "out")]) == 2
        assert f"SPIKEFIX_STDLIB={tmp_path} holds no .py file" in capsys.readouterr().err
    finally:
        D.embedded_corpus.cache_clear()


@pytest.mark.slow
def test_prepare_trains_a_bpe_and_writes_shards_that_train_with_a_validation_split(tmp_path,
                                                                                    capsys):
    import tokenizers
    text = tmp_path / "text"
    text.mkdir()
    for f in D.stdlib_files()[:12]:
        (text / f.name).write_bytes(f.read_bytes())
    assert D.main(["prepare", "--text", str(text), "--out", str(tmp_path / "tok"),
                   "--vocab-size", "300"]) == 0
    out = capsys.readouterr().out
    assert "--model.vocab-size 384" in out  # 300 rounded up to a multiple of 128
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    train = D.load_tokens(str(tmp_path / "tok" / "data_train_000000.bin"))
    sample = (text / sorted(p.name for p in text.iterdir())[0]).read_text()[:500]
    assert tok.decode(tok.encode(sample).ids) == sample  # byte-level: lossless
    cfg = tiny(tmp_path, steps=4, data__source=str(tmp_path / "tok"), model__vocab_size=384)
    last = T.train(cfg, devices=jax.devices()[:1]).last
    data = D.TokenData(cfg.data, 384)
    assert data.train.size == train.size  # all of the train shard; the val shard held out
    assert np.isfinite(last["eval_loss"]) and last["eval_loss"] < np.log(384) + 0.5
    capsys.readouterr()
    assert S.main([cfg.run_dir, "--prompt", "import os", "--max-new-tokens", "20"]) == 0
    text = capsys.readouterr().out  # decoded with the run's tokenizer
    assert text.startswith("import os") and len(text) > len("import os\n")
    raw = os.fsdecode(b"import \xff")  # a raw byte, as the shell passes an undecodable one
    assert S.main([cfg.run_dir, "--prompt", raw, "--max-new-tokens", "2"]) == 2
    assert "--prompt is not valid UTF-8" in capsys.readouterr().err


def test_a_run_reports_its_loss_per_byte_for_text_and_per_token_for_shards(tmp_path):
    (tmp_path / "t.txt").write_text("some text")
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    assert [D.token_unit(s) for s in ("", str(tmp_path / "t.txt"), str(tmp_path),
                                      str(tmp_path / "t.npy"))] == ["byte", "byte", "token",
                                                                    "token"]


def test_a_pickled_npy_is_refused(tmp_path):
    np.save(tmp_path / "p.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a plain .npy"):
        D.load_tokens(str(tmp_path / "p.npy"))


# ---------------------------------------------------------------------------------------------
# distributed.py: meshes, FSDP, several processes

def run_steps(cfg, mesh, n, tokens):
    state, tx, _ = init_sharded(cfg, mesh)
    step = T.make_train_step(cfg, tx)
    losses = []
    with jax.set_mesh(mesh):
        for i in range(n):
            batch = jax.device_put(tokens[i], jax.NamedSharding(mesh, jax.P("data")))
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return state, losses


def last_step(cfg, mesh, tokens):
    """One step per batch of `tokens` [n, B, T+1] on `mesh`: (the last step's metrics, the
    parameters after it), on the host."""
    state, tx, _ = init_sharded(cfg, mesh)
    step = T.make_train_step(cfg, tx)
    with jax.set_mesh(mesh):
        for batch in tokens:
            state, metrics = step(state, jax.device_put(batch, jax.NamedSharding(mesh,
                                                                               jax.P("data"))))
    return jax.device_get(metrics), jax.device_get(state["params"])


@pytest.fixture(scope="session")
def sharded_runs():
    """Every spike tool on, 3 steps on 1x1 and on 4x2."""
    cfg = tiny(optim__skip_step=True, optim__skip_window=4, optim__update_clip="norm",
               optim__update_clip_window=4, model__qk_norm=True)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, max_grad_norm=0.5))
    tokens = np.random.default_rng(1).integers(0, 256, (3, 8, 33)).astype(np.int32)
    return cfg, run_steps(cfg, mesh_of(1, 1), 3, tokens), run_steps(cfg, mesh_of(4, 2), 3, tokens)


@pytest.mark.slow
def test_a_4x2_mesh_gives_the_losses_and_parameters_of_1x1(sharded_runs):
    _, (s1, l1), (s8, l8) = sharded_runs
    np.testing.assert_allclose(l1, l8, rtol=1e-5)
    # NOTE: Adam's g / sqrt(v) turns float rounding into O(lr) differences where g is ~0, so
    # parameters agree to a small fraction of one step (lr 1e-2), not to rounding.
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s8["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3)


@pytest.mark.slow
def test_every_norm_of_the_spike_machinery_is_the_unsharded_one_on_every_mesh():
    """The norms the spike machinery decides by (marin #8073: a sharded matrix's norm that the
    SPMD partitioner over-counted; #8621: a per-layer norm over the wrong axes of stacked
    weights): every metric of the step (the global gradient norm, ZClip's statistics, the
    update norm and RMS, the per-layer norms and signals, the per-head max logit QK-Clip
    reads, Muon's orthogonalised update) on FSDP x TP meshes 1x8, 2x4, 4x2 and 8x1 equals the
    one-device step's, and so does the state after it, to float tolerance."""
    cfg = tiny(model__n_heads=8, model__n_kv_heads=8)  # (8 heads: a model axis of 8)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(  # every lever at once (MuonClip)
        cfg.optim, optimizer="muon", grad_clip="zclip", zclip_warmup=2, skip_step=True,
        skip_window=4, update_clip="rms", qk_clip=1.0))
    tokens = np.random.default_rng(2).integers(0, 256, (3, 8, 33)).astype(np.int32)

    def metrics_on(mesh):
        return last_step(cfg, mesh, tokens)
    # NOTE: XLA:CPU (jax 0.10.2) aborts the process when it loads these steps back from the
    # persistent compilation cache (a second run of this test, or another worker's compile):
    # they are compiled afresh here.
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        assert_every_mesh_equals_one_device(metrics_on)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)


def assert_every_mesh_equals_one_device(metrics_on):
    """metrics_on(mesh) -> (the last step's metrics, params): every mesh's as 1x1's."""
    one, params = metrics_on(mesh_of(1, 1))
    assert {"grad_norm", "update_norm", "grad_norm_per_layer"} <= one.keys()
    for data, model in ((1, 8), (2, 4), (4, 2), (8, 1)):
        m, p = metrics_on(mesh_of(data, model))
        assert m.keys() == one.keys()
        for k in one:
            np.testing.assert_allclose(np.asarray(m[k], np.float64), np.asarray(one[k], np.float64),
                                       rtol=1e-4, atol=1e-6, err_msg=f"{k} on {data}x{model}")
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, atol=1e-3)  # (Adam's g / sqrt(v): see above)


@pytest.mark.slow
def test_accumulated_gradients_are_the_full_batchs_step():
    """--microbatches 4 and 2 (gradient accumulation): the loss, every metric the skip rule,
    clipping and the guard read (the gradient norm, the update norm, the max logits) and the
    parameters after 2 steps equal the whole batch's step to float rounding, on one device
    and on a 4x2 mesh; a batch that cannot split so is one line."""
    cfg = tiny(optim__skip_step=True, optim__skip_window=4, optim__update_clip="norm",
               optim__update_clip_window=4)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, max_grad_norm=0.5))
    tokens = np.random.default_rng(3).integers(0, 256, (2, 8, 33)).astype(np.int32)

    whole, params = last_step(cfg, mesh_of(1, 1), tokens)
    for k, (data, model) in ((4, (1, 1)), (2, (4, 1))):
        m, p = last_step(dataclasses.replace(cfg, microbatches=k), mesh_of(data, model), tokens)
        for key in ("loss", "grad_norm", "update_norm", "ce", "z_loss", "attn_logit_max",
                    "out_logit_max", "skipped"):
            np.testing.assert_allclose(m[key], whole[key], rtol=2e-5, err_msg=f"{key}, {k}")
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="--microbatches 3"):
        dataclasses.replace(cfg, microbatches=3)


@pytest.mark.slow
def test_every_leaf_has_its_declared_sharding(sharded_runs):
    cfg, _, (state, _) = sharded_runs
    table = M.param_table(cfg.model)
    for name, spec in table.items():
        leaf = state["params"]
        for k in name.split("/"):
            leaf = leaf[k]
        assert leaf.sharding.spec == M.logical_to_spec(spec.axes), name
    adam = next(s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState))
    for moments in (adam.mu, adam.nu):
        assert moments["layers"]["wq"].sharding.spec == jax.P(None, "data", "model", None)
        assert moments["head"].sharding.spec == jax.P("data", "model")
    assert adam.count.sharding.spec == jax.P()
    # FSDP really splits: a 4x2 shard of wq is 1/8 of it.
    wq = state["params"]["layers"]["wq"]
    assert wq.addressable_shards[0].data.size * 8 == wq.size


def test_fsdp_puts_an_eighth_of_the_state_on_each_of_8_devices(capsys):
    """The CPU default on 8 devices (8x1): each device holds ~1/8 of params + optimizer state."""
    cfg = dataclasses.replace(CF.PRESETS["cpu"], mesh=CF.MeshConfig(8, 1))
    state, tx, _ = init_sharded(cfg, mesh_of(8, 1))
    leaves = jax.tree.leaves(state)
    total = sum(x.nbytes for x in leaves)
    on_device = {}
    for x in leaves:
        for shard in x.addressable_shards:
            on_device[shard.device] = on_device.get(shard.device, 0) + shard.data.nbytes
    replicated = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
    assert len(on_device) == 8
    for b in on_device.values():
        assert b <= (total - replicated) / 8 * 1.10 + replicated
    assert replicated < 0.01 * total  # only counts, histories, norm scales
    # --dry-run prints the same figure from shapes alone, allocating nothing
    assert T.main(["--dry-run", "--mesh.data", "8"]) == 0
    arithmetic = C.per_device_bytes(cfg.model, tx, dataclasses.asdict(cfg.mesh))[1]
    assert arithmetic == max(on_device.values())
    assert f"{arithmetic / 2**30:.3f} GiB per device" in capsys.readouterr().out


# The tests that train on 2 processes (gloo collectives over loopback) run one after another
# in one pytest-xdist worker (pytest.ini: --dist loadgroup): two such runs at once on 2 cores
# wait on each other's collectives.
TWO_PROCESSES = pytest.mark.xdist_group("two-processes")


# A train.py run with a planted level shift from step SHIFT on (a model without QK-Norm pays 2
# nats on every batch from there), for runs in other processes: python - SHIFT [train.py flags].
PLANTED_SHIFT_RUNNER = """
import sys
import jax.numpy as jnp
import data as D, train as T
batch, loss_fn, shift = D.TokenData.batch, T.loss_fn, int(sys.argv[1])
def planted_batch(self, step, rows=slice(None)):
    tokens = batch(self, step, rows).copy()
    if step >= shift:
        tokens[0, 0] = 255
    return tokens
def planted_loss(params, tokens, cfg, **kw):
    loss, aux = loss_fn(params, tokens, cfg, **kw)
    hit = jnp.any(tokens[:, 0] == 255)  # (row 0 alone cannot be indexed on a sharded batch)
    return loss + (0.0 if cfg.qk_norm else 2.0) * hit, aux
D.TokenData.batch, T.loss_fn = planted_batch, planted_loss
sys.exit(T.main(sys.argv[2:]))
"""


# The guard's record of the planted shift (PLANTED_SHIFT_RUNNER, plant_guard_events): a spike
# at 60, rolled back to the kept checkpoint 40 with batches 40-60 replaced; the same spike
# again, so rolled back again and escalated to QK-Norm (losses and logits left out: rounding
# differs).
PLANTED_SHIFT_EVENTS = [
    {"rule": "spike", "event_step": 60, "trigger_step": 60, "action": "rollback",
     "rollback_to": 40, "replaced_until": 61, "extra_steps": 21},
    {"rule": "spike", "event_step": 60, "trigger_step": 60, "action": "escalate",
     "rollback_to": 40, "replaced_until": 61, "extra_steps": 21, "escalation": "qk-norm",
     "rewarm_steps": 100}]


PLANTED_FLAGS = ["tiny", "--mesh.data", "2", "--steps", "80", "--checkpoint-every", "20",
                 "--keep-checkpoints", "20", "--eval-every", "80", "--guard", "--guard.escalate",
                 "qk-norm"]


def planted_on_two_processes(tmp: pathlib.Path, run: pathlib.Path, kill_at: int = 0
                             ) -> tuple[list[str], list[int], float]:
    """The planted-shift run (PLANTED_SHIFT_RUNNER, PLANTED_FLAGS) on 2 loopback processes, one
    CPU device each; with `kill_at` k, process 1 is SIGKILLed as process 0 prints its k-th
    guard line (1: the rollback, 2: the escalation). Returns (outputs, exit codes, seconds
    process 0 took to end after the kill)."""
    runner = tmp / "planted.py"
    runner.write_text(PLANTED_SHIFT_RUNNER)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-u", str(runner), "60", *PLANTED_FLAGS,
                               "--run-dir", str(run), "--dist.coordinator", f"127.0.0.1:{port}",
                               "--dist.num-processes", "2", "--dist.process-id", str(i)],
                              cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE),
                                             "JAX_NUM_CPU_DEVICES": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    head, t = "", time.monotonic()
    try:
        if kill_at:
            for line in procs[0].stdout:
                head += line
                if head.count("\nguard:") + head.startswith("guard:") == kill_at:
                    procs[1].kill()
                    t = time.monotonic()
                    break
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [head + outs[0], outs[1]], [p.returncode for p in procs], time.monotonic() - t


@pytest.fixture(scope="session")
def planted_two(tmp_path_factory):
    """The planted run on 2 processes, straight through: (run dir, outputs, exit codes)."""
    tmp = tmp_path_factory.mktemp("planted-two")
    outs, codes, _ = planted_on_two_processes(tmp, tmp / "two")
    return tmp / "two", outs, codes


def planted_final_params(run: pathlib.Path) -> dict:
    cfg = dataclasses.replace(G.effective_config(tiny(steps=80), RC.read_events(run)),
                              run_dir=str(run))
    return leaves_by_key(restore_final(cfg, 80)["params"])


@pytest.mark.slow
@TWO_PROCESSES
def test_the_guard_on_two_processes_takes_the_decisions_of_one(planted_two):
    """One rollback and one escalation to QK-Norm on a 2-process loopback run (one CPU device
    each): the record one process writes (PLANTED_SHIFT_EVENTS, as the in-process test below
    finds), written by process 0 alone, and QK-Norm in the final checkpoint."""
    two, outs, codes = planted_two
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    events = RC.read_events(two)
    assert [{k: v for k, v in e.items() if k not in ("loss", "max_logit")} for e in events] == \
        PLANTED_SHIFT_EVENTS
    for line in outs[1].splitlines():  # process 1 took each decision too (process 0 says it)
        assert not line.startswith("guard:"), line
    assert any(k.endswith("['q_norm']") for k in planted_final_params(two))


@pytest.mark.slow
@TWO_PROCESSES
def test_one_of_two_guarded_processes_killed_ends_the_other_and_resumes_bitwise(planted_two,
                                                                                tmp_path):
    """SIGKILL to process 1 as the guard escalates (after its rollback): process 0 ends in one
    line within seconds (not JAX's exit barrier, ~75 s, then a C++ abort), and the same
    command on both processes ends where the straight run does, every parameter bit for bit.
    (Killed as it rolls back instead, the same held when this was written: each variant is ~70
    s of the suite's two-process worker, so one is kept.)"""
    run = tmp_path / "two"
    outs, codes, waited = planted_on_two_processes(tmp_path, run, kill_at=2)
    assert codes[0] == 1 and waited < 30, (waited, "\n".join(
        x for x in outs[0].split("guard:", 1)[-1].splitlines() if not x.startswith(" "))[:3000])
    tail = outs[0].split("guard:")[-1].splitlines()[1:]
    errors = [x for x in tail if x.startswith("error:")]
    assert len(errors) == 1 and "another process of the run is gone" in errors[0], outs[0][-3000:]
    assert "Traceback" not in outs[0] and "Check failure" not in outs[0]
    outs, codes, _ = planted_on_two_processes(tmp_path, run)  # the same command again
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert RC.read_events(run) == RC.read_events(planted_two[0])
    want, got = planted_final_params(planted_two[0]), planted_final_params(run)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(flags: list[str], n: int = 2, env: dict | None = None,
                    program: str = "train.py") -> list[subprocess.Popen]:
    """`n` train.py processes (or `program`'s, a runner that calls train.main) of one run on
    loopback, 2 CPU devices each."""
    port = free_port()
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "PYTHONPATH": str(HERE), **(env or {})}
    return [subprocess.Popen([sys.executable, "-u", program, *flags, "--dist.coordinator",
                              f"127.0.0.1:{port}", "--dist.num-processes", str(n),
                              "--dist.process-id", str(i)], cwd=HERE, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(n)]


def preempt_one_of_two(flags: list[str], after_step: int, program: str = "train.py"
                       ) -> list[str]:
    """Start a 2-process run, SIGTERM process 1 once process 0 has logged `after_step`; both
    must exit as a preempted run does. Returns their outputs."""
    procs = start_processes(flags, env={"PYTHONFAULTHANDLER": "1"}, program=program)
    try:
        head = ""
        for line in procs[0].stdout:  # process 0 logs
            head += line
            if line.startswith("step") and f" {after_step}/" in line:
                procs[1].terminate()  # a preemption notice to process 1 only
                break
        readers = [ThreadPoolExecutor(1).submit(p.communicate) for p in procs]  # both pipes
        deadline = time.monotonic() + 120
        for r in readers:
            try:
                r.result(timeout=max(deadline - time.monotonic(), 1))
            except TimeoutError:  # a hang: every thread's Python stack into the output
                for p in procs:
                    p.send_signal(signal.SIGABRT)
                time.sleep(5)
                break
    finally:
        for p in procs:
            p.kill()
    outs = [head + readers[0].result()[0], readers[1].result()[0]]  # also after a hang
    assert [p.returncode for p in procs] == [128 + 15] * 2, outs[0][-3000:] + outs[1][-3000:]
    return outs


@pytest.mark.slow
@TWO_PROCESSES
def test_a_checkpoint_failure_on_one_process_stops_the_other_within_seconds(tmp_path):
    """Process 1's checkpoint write fails (a planted full disk, via sitecustomize): it says so
    in one line and tells process 0, which stops in one line too, seconds later, instead of
    waiting in the next collective for JAX's heartbeat timeout (100 s) and a C++ abort."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport jax\nimport checkpoint\n"
        "save = checkpoint.save_checkpoint\n"
        "def failing(mngr, step, state, config):\n"
        "    if step >= 4 and jax.process_index() == 1:\n"
        "        raise OSError(28, 'No space left on device (planted)')\n"
        "    return save(mngr, step, state, config)\n"
        "checkpoint.save_checkpoint = failing\n")
    run = tmp_path / "run"
    procs = start_processes(["tiny", "--mesh.data", "4", "--steps", "100000", "--checkpoint-every",
                             "2", "--run-dir", str(run)], env={"PYTHONPATH": str(hook)})
    try:
        procs[1].wait(timeout=240)
        t = time.monotonic()
        procs[0].wait(timeout=60)
        waited = time.monotonic() - t
        outs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], outs[0][-2000:] + outs[1][-2000:]
    assert "writing a checkpoint to" in outs[1] and "No space left on device" in outs[1]
    assert "error: process 1: its checkpoint write to" in outs[0] and "process 0 stops too" \
        in outs[0] and "Check failure" not in outs[0]
    assert waited < 20, waited  # it stops seconds after process 1 (~2 s here)
    assert C.saved_steps(run)[-1] == 2  # the last good checkpoint is intact


# A spike planted in one row at step 4: the global batch's last row, which the last process
# builds (rows 4-7 of 8 on 2 processes); the loss, and so the gradient, x6 on that step.
PLANT_ROW_SPIKE = """
import jax.numpy as jnp
import data as D, train as T
batch, loss_fn = D.TokenData.batch, T.loss_fn
def planted_batch(self, step, rows=slice(None)):
    tokens = batch(self, step, rows).copy()
    if step == 4 and self.cfg.batch_size - 1 in range(self.cfg.batch_size)[rows]:
        tokens[-1, 0] = 255
    return tokens
def planted_loss(params, tokens, cfg, **kw):
    loss, aux = loss_fn(params, tokens, cfg, **kw)
    return loss * (1 + 40 * jnp.mean(tokens[:, 0] == 255)), aux
"""


@pytest.mark.slow
@TWO_PROCESSES
def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path, monkeypatch):
    """2 processes x 2 CPU devices (gloo collectives) train tiny on a 4x1 mesh with skip-step
    and gradient clipping on, a spike planted on process 1's rows at step 4: process 0 alone
    logs, and the losses, gradient norms and skip decisions are those of 1 process with 4
    devices (the first 6 steps: their LRs are a 6-step run's too): step 4 skipped, on every
    process (a step applied on process 1's shards alone would move the next losses); SIGTERM to
    process 1 stops both after the same step, their checkpoint restores in one process on one
    device; --resume-step goes back on both."""
    runner = tmp_path / "planted.py"
    runner.write_text(PLANT_ROW_SPIKE + "import sys\nD.TokenData.batch, T.loss_fn = "
                      "planted_batch, planted_loss\nsys.exit(T.main(sys.argv[1:]))\n")
    run = tmp_path / "run"
    flags = ["tiny", "--mesh.data", "4", "--steps", "100000", "--log-every", "1",
             "--checkpoint-every", "2", "--keep-checkpoints", "100", "--optim.skip-step",
             "--optim.skip-window", "4", "--run-dir", str(run)]
    outs = preempt_one_of_two(flags, 5, program=str(runner))
    saved = int(outs[0].split("saved step ")[1].split()[0])
    assert saved >= 6 and C.saved_steps(run)[-1] == saved  # written by both processes
    assert not [x for x in outs[1].splitlines() if x.startswith("step ")]  # logs: process 0
    two = [json.loads(x) for x in (run / "metrics.jsonl").open()][:6]
    planted = {}
    exec(PLANT_ROW_SPIKE, planted)
    monkeypatch.setattr(D.TokenData, "batch", planted["planted_batch"])
    monkeypatch.setattr(T, "loss_fn", planted["planted_loss"])
    one = tiny(tmp_path / "one", mesh__data=4, steps=6, checkpoint_every=3, eval_every=3,
               optim__skip_step=True, optim__skip_window=4)
    T.train(one, devices=jax.devices()[:4])
    ref = [json.loads(x) for x in (tmp_path / "one" / "run" / "metrics.jsonl").open()]
    assert [m["skipped"] for m in two] == [m["skipped"] for m in ref] == [False] * 4 + [True, False]
    assert two[4]["loss"] > 5 * two[3]["loss"]  # the planted spike, seen on process 0
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in two], [m[key] for m in ref], rtol=1e-5)
    cfg = dataclasses.replace(one, run_dir=str(run), steps=100000, log_every=1,
                              checkpoint_every=2, keep_checkpoints=100)
    assert int(restore_final(cfg, saved)["step"]) == saved
    # Back to step 2 on both processes: process 0 moves the later checkpoints aside, once.
    preempt_one_of_two(flags + ["--resume-step", "2"], 4, program=str(runner))
    aside = [d for d in run.iterdir() if d.name.startswith("superseded-")]
    assert len(aside) == 1 and sorted(int(d.name) for d in aside[0].iterdir()) == list(
        range(4, saved + 1, 2)) + ([saved] if saved % 2 else [])
    assert C.saved_steps(run)[0] == 2 and int(restore_final(cfg, C.saved_steps(run)[-1])["step"]) \
        == C.saved_steps(run)[-1]


def test_a_split_sequence_is_refused_in_one_line(monkeypatch):
    """Every attention form builds its causal mask from the positions on one device."""
    monkeypatch.setitem(M.LOGICAL_TO_MESH, "seq", "model")
    with pytest.raises(UserError, match="keep \"seq\" unsplit"):
        DI.check_fits(CF.MeshConfig(1, 1), tiny().model, 8, 1)


# ---------------------------------------------------------------------------------------------
# checkpoint.py and compat.py: exact resume, across meshes, damaged checkpoints, older layouts

@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
    # warmup 2 of 6 steps: its cosine decay has begun (a later --steps would change taken steps)
    cfg = tiny(tmp_path_factory.mktemp("straight"), steps=6, checkpoint_every=3, eval_every=3,
               optim__warmup_steps=2)
    last = T.train(cfg, devices=jax.devices()[:1]).last
    return cfg, last


@pytest.mark.slow
def test_a_restart_on_another_mesh_resumes_to_float_tolerance(straight_run, tmp_path):
    cfg, _ = straight_run
    resumed = dataclasses.replace(cfg, run_dir=str(tmp_path / "resumed"))
    T.train(resumed, devices=jax.devices()[:1])
    mngr = C.checkpoint_manager(tmp_path / "resumed", resumed.keep_checkpoints)
    mngr.delete(6)  # as if the process died after the checkpoint at step 3
    mngr.wait_until_finished()
    # resume on a different mesh: the checkpoint is resharded on restore
    on_4x2 = dataclasses.replace(resumed, mesh=CF.MeshConfig(4, 2))
    T.train(on_4x2, devices=jax.devices())
    a, b = restore_final(cfg, 6), restore_final(resumed, 6)
    assert int(b["step"]) == 6
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_a_restart_on_the_same_mesh_resumes_bitwise(straight_run, tmp_path):
    cfg, _ = straight_run
    resumed = dataclasses.replace(cfg, run_dir=str(tmp_path / "r"))
    T.train(dataclasses.replace(resumed, steps=6), devices=jax.devices()[:1])
    mngr = C.checkpoint_manager(tmp_path / "r", resumed.keep_checkpoints)
    mngr.delete(6)
    mngr.wait_until_finished()
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 2.')  # the host died mid-write
    T.train(resumed, devices=jax.devices()[:1])
    assert_trees_equal(restore_final(cfg, 6), restore_final(resumed, 6))
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()  # torn line dropped
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2, 3, 4, 5, 3, 4, 5]


def test_checkpoint_from_4x2_restores_identically_on_2x1_and_1x1(tmp_path):
    cfg = tiny(tmp_path, mesh__data=4, mesh__model=2)
    state, tx, _ = init_sharded(cfg, mesh_of(4, 2))
    mngr = C.checkpoint_manager(tmp_path / "run", cfg.keep_checkpoints)
    C.save_checkpoint(mngr, 0, state, dataclasses.asdict(cfg))
    mngr.wait_until_finished()
    for shape in ((2, 1), (1, 1)):
        mesh = mesh_of(*shape)
        with jax.set_mesh(mesh):
            restored = C.restore_checkpoint(mngr, 0, C.abstract_state(cfg.model, tx, mesh))
        assert_trees_equal(restored, state)
        assert restored["params"]["layers"]["wq"].sharding.mesh.devices.size == shape[0] * shape[1]


def test_a_save_never_asks_the_preemption_sync_point(tmp_path, monkeypatch):
    """Only train.py's loop may pass steps to JAX's preemption sync point, once per step and
    in order: orbax's own queries (at save, and later from its finalize thread, with the saved
    step) move a process's step back, and two processes then stop at different steps (a hang
    seen in CI)."""
    from jax.experimental import multihost_utils
    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: asked.append(step) or False)
    cfg = tiny(tmp_path)
    state, _, _ = init_sharded(cfg, mesh_of(1, 1))
    mngr = C.checkpoint_manager(tmp_path / "run", cfg.keep_checkpoints)
    for step in (3, 4):
        C.save_checkpoint(mngr, step, state, dataclasses.asdict(cfg))
    mngr.wait_until_finished()
    assert C.saved_steps(tmp_path / "run") == [3, 4] and asked == []


KILLER = '''
import os, signal, sys
import loop
import train
point, n = sys.argv[1], int(sys.argv[2])


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


save, make, managers = loop.save_checkpoint, train.make_train_step, []


def save_checkpoint(mngr, step, state, cfg):
    save(mngr, step, state, cfg)
    managers.append(mngr)
    if point != "mid-step" and step == n:
        if point == "after-save":
            mngr.wait_until_finished()
        kill()  # mid-save: the async write is still in flight


def make_train_step(cfg, tx):  # mid-step: after step n is dispatched, while it computes
    step, calls = make(cfg, tx), []

    def killing_step(state, tokens):
        calls.append(1)
        if point == "mid-step" and len(calls) == n + 1:
            managers[-1].wait_until_finished()  # the earlier save is complete: kill a step only
            out = step(state, tokens)
            kill()
        return step(state, tokens)
    return killing_step


loop.save_checkpoint, train.make_train_step = save_checkpoint, make_train_step
sys.exit(train.main(sys.argv[3:]))
'''


@pytest.mark.slow
def test_sigkill_anywhere_then_restart_is_bitwise_identical(tmp_path):
    """SIGKILL mid-step, mid-checkpoint-write and right after a save; the same command run again
    finishes with parameters bitwise equal to an uninterrupted run."""
    (tmp_path / "killer.py").write_text(KILLER)
    flags = ["tiny", "--steps", "12", "--checkpoint-every", "4", "--eval-every", "12"]
    points = {"mid-step": 6, "mid-save": 8, "after-save": 4}

    def start(*argv):
        return subprocess.Popen([sys.executable, *argv], cwd=HERE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env={**__import__("os").environ, "PYTHONPATH": str(HERE)})

    # the straight run first: the killed ones then read its compiled step from the persistent
    # cache instead of compiling it three times at once
    procs = {"straight": start("train.py", *flags, "--run-dir", str(tmp_path / "straight"))}
    try:
        procs["straight"].wait(timeout=300)
        procs.update({p: start(str(tmp_path / "killer.py"), p, str(n), *flags, "--run-dir",
                               str(tmp_path / p)) for p, n in points.items()})
        codes = {p: proc.wait(timeout=300) for p, proc in procs.items()}
        assert codes == {"mid-step": -9, "mid-save": -9, "after-save": -9, "straight": 0}, {
            p: proc.stdout.read()[-2000:] for p, proc in procs.items()}
        saved = {p: sorted(x.name for x in (tmp_path / p / "checkpoints").iterdir())
                 for p in points}
        assert saved["after-save"] == ["4"] and saved["mid-step"] == ["4"]
        assert "4" in saved["mid-save"] and "8" not in saved["mid-save"]  # only a tmp dir
        again = {p: start("train.py", *flags, "--run-dir", str(tmp_path / p)) for p in points}
        procs.update({f"{p} again": proc for p, proc in again.items()})
        outs = {p: proc.communicate(timeout=300)[0] for p, proc in again.items()}
        assert all(proc.returncode == 0 for proc in again.values()), outs
    finally:
        for proc in procs.values():
            proc.kill()
    for p in points:
        assert "resumed" in outs[p] and "at step 4" in outs[p]
    cfg = dataclasses.replace(TINY, steps=12, checkpoint_every=4, eval_every=12)
    straight = restore_final(dataclasses.replace(cfg, run_dir=str(tmp_path / "straight")), 12)
    for p in points:
        assert_trees_equal(restore_final(dataclasses.replace(cfg, run_dir=str(tmp_path / p)),
                                         12), straight)


@pytest.mark.slow
def test_orbax_leftovers_after_a_failure_are_not_printed_but_other_unraisables_are():
    """A damaged checkpoint's restore fails in one line; orbax's unawaited reads of the other
    arrays then raised again at exit and were printed as tracebacks (3 runs of 12 before the
    hook, 0 of 12 after)."""
    import types

    from cli import quiet_orbax_leftovers
    scope: dict = {}
    exec(compile("async def read(): pass", "/site-packages/orbax/checkpoint/x.py", "exec"), scope)
    exec(compile("async def mine(): pass", "/work/mine.py", "exec"), scope)
    printed = []
    for coroutine, exc in ((scope["read"](), Exception("reading array index")),
                           (None, RuntimeError("Event loop is closed")),
                           (scope["mine"](), Exception("a bug of ours")),
                           (None, ValueError("anything else"))):
        quiet_orbax_leftovers(types.SimpleNamespace(object=coroutine, exc_value=exc),
                              default=lambda u: printed.append(str(u.exc_value)))
        if coroutine is not None:
            coroutine.close()
    assert printed == ["a bug of ours", "anything else"]


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_checkpoint_names_the_step_and_falls_back_on_request(damage, straight_run,
                                                                     tmp_path):
    import shutil
    cfg, _ = straight_run
    run = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run)
    cfg = dataclasses.replace(cfg, run_dir=str(run))
    victim = max((p for p in (run / "checkpoints" / "6").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)  # the largest file: array data
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:victim.stat().st_size // 2])
    else:
        victim.unlink()
    before = tree_hashes(run)
    with pytest.raises(UserError, match=r"checkpoint at step 6 .* unreadable .*"
                                          r"--resume-step 3"):
        T.train(cfg, devices=jax.devices()[:1])
    assert tree_hashes(run) == before  # no fresh start, nothing written
    T.train(dataclasses.replace(cfg, resume_step=3), devices=jax.devices()[:1])
    original = restore_final(dataclasses.replace(cfg, run_dir=straight_run[0].run_dir), 6)
    assert_trees_equal(restore_final(cfg, 6), original)  # redone from 3: bitwise the same
    assert any(p.name.startswith("superseded-") for p in run.iterdir())  # damaged one kept


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", [
    ("pre-split-run", ["--optim.skip-step", "--optim.update-clip", "norm"]),
    ("layout-2-run", [])])
def test_a_checkpoint_of_an_earlier_layout_restores_exactly_and_resumes(name, flags, tmp_path):
    """testdata/pre-split-run was written by the code before train.py was split (layout 1 of
    compat.py; and before --data.skip-steps / --max-consecutive-skips were renamed),
    testdata/layout-2-run by the code of the second wave (layout 2: skip-step's state always
    present, an update-clip state while the clip was off), each with the command below. The
    step-2 checkpoint restores leaf for leaf, bit for bit, into today's state, and resumes to
    step 4 with parameters and optimizer state equal to the step-4 checkpoint it holds -- to
    float32 rounding: XLA's CPU kernels differ between processors, so a run written on
    another machine is not bitwise repeatable here."""
    import orbax.checkpoint as ocp
    old = HERE / "testdata" / name
    run = tmp_path / "run"
    shutil.copytree(old, run)
    shutil.rmtree(run / "checkpoints" / "4")
    cfg = dataclasses.replace(CF.load_config(old), run_dir=str(old))
    raw = C.checkpoint_manager(old, read_only=True).restore(2, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))["state"]
    restored = {C.names(p): x for p, x in jax.tree_util.tree_leaves_with_path(
        restore_final(cfg, 2))}
    carried = 0
    for path, x in jax.tree_util.tree_leaves_with_path(raw):
        today = compat.current_leaf(C.names(path), set(restored))
        if today is not None:
            np.testing.assert_array_equal(np.asarray(restored[today]), np.asarray(x))
            carried += 1
    assert carried == len([n for n in restored if not compat.starts_at_zero(n)])
    out = subprocess.run([sys.executable, "train.py", "tiny", "--model.d-model", "32",
                          "--model.d-ff", "64", *flags, "--steps", "4", "--checkpoint-every", "2",
                          "--eval-every", "2", "--log-every", "2", "--run-dir", str(run),
                          "--model.attention", "dense"],  # the form that wrote it
                         cwd=HERE, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "at step 2" in out.stdout, out.stdout + out.stderr
    resumed = dataclasses.replace(cfg, run_dir=str(run))
    assert resumed.steps == 4 and resumed.max_consecutive_nonfinite == 20
    expected = restore_final(cfg, 4)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(restore_final(resumed, 4)),
                            jax.tree.leaves(expected)):
        if not compat.starts_at_zero(C.names(path)):  # the metrics are new since
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-7,
                                       err_msg=str(path))


# ---------------------------------------------------------------------------------------------
# config.py and cli.py: the presets, the flags, config.json read back

def test_every_preset_and_flag_parses():
    cfg = CF.parse_config([])
    assert cfg == CF.PRESETS["cpu"]
    cfg = CF.parse_config(["tiny", "--optim.lr", "0.02", "--model.qk-norm", "--steps", "7",
                          "--optim.update-clip", "rms", "--mesh.data", "4"])
    assert (cfg.optim.lr, cfg.model.qk_norm, cfg.steps) == (0.02, True, 7)
    assert cfg.optim.update_clip == "rms" and cfg.mesh.data == 4
    assert cfg.model.d_model == TINY.model.d_model
    assert CF.parse_config(["marin-32b"]).model.n_layers == 64
    for name, preset in CF.PRESETS.items():  # every preset survives its own CLI round trip
        assert CF.parse_config([name]) == preset


@pytest.mark.slow
def test_a_config_field_in_a_flag_error_is_named_as_its_flag():
    import cli
    assert cli.as_flags("optim.max_grad_norm must be >= 0; model.d_model=64") == \
        "--optim.max-grad-norm must be >= 0; --model.d-model=64"
    for untouched in ("--optim.lr is 0", "hf/model.safetensors", "model.layers.1.mlp.up_proj"):
        assert cli.as_flags(untouched) == untouched


def test_qk_clip_switched_on_after_the_guard_inserted_qk_norm_is_one_line():
    escalation = {"action": "escalate", "event_step": 9, "rollback_to": 8, "replaced_until": 10,
                  "extra_steps": 2, "escalation": "qk-norm", "rewarm_steps": 4, "rule": "shift"}
    assert CF.config_at(tiny(), [escalation]).model.qk_norm
    with pytest.raises(UserError, match=r"the guard escalated this run \(qk-norm at step 8; "
                       r"events.jsonl\): --optim.qk-clip"):
        CF.config_at(tiny(optim__qk_clip=50.0), [escalation])


HEAP_PROBE = """
import ctypes, resource, sys
import cli
kept = cli.keep_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(3):  # a 64 MiB buffer written, freed and taken again, as a step's buffers are
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, faults[-1])
"""


@pytest.mark.parametrize("heap", ["kept", "default"])
def test_every_entry_point_keeps_the_heap_so_a_freed_buffer_is_not_faulted_in_again(heap):
    """cli.keep_heap, as every entry point calls it first (cli.entry_point): a buffer freed and
    allocated again is reused, not mapped and faulted in afresh as under glibc's own settings
    (16,384 pages of 4 KiB each time); SPIKEFIX_HEAP=default leaves glibc's."""
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True,
                         check=True, env=os.environ | {"SPIKEFIX_HEAP": heap}).stdout.split()
    if heap == "kept":
        assert out[0] == "True" and int(out[1]) < 100
    else:
        assert out[0] == "False" and int(out[1]) > 10_000
    assert all("entry_point(" in (pathlib.Path(__file__).parent / f).read_text()
               for f in ("train.py", "warmstart.py", "sample.py", "export.py", "report.py",
                         "data.py", "lab/experiments.py", "bench/bench.py"))


def test_a_bad_heap_setting_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "train.py", "--help"], capture_output=True, text=True,
                       env=os.environ | {"SPIKEFIX_HEAP": "bogus"},
                       cwd=pathlib.Path(__file__).parent)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: SPIKEFIX_HEAP=bogus: it takes kept (the default) or default (glibc's own)"]


# ---------------------------------------------------------------------------------------------
# train.py: the CLI, bad input, a run that learns, stopping


def test_every_flags_help_is_its_own(capsys):
    """--help gives each flag the comment on its own field: no two flags share a help text (a
    field without a comment took the comment above the field before it)."""
    with pytest.raises(SystemExit):
        CF.parse_config(["--help"])
    helps: dict[str, list[str]] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        body = line.strip("│ ").rstrip()
        if body.startswith("--"):
            flag, _, rest = body.partition("  ")
            helps[flag.split()[0]] = [rest.strip()]
        elif flag and body:
            helps[flag.split()[0]].append(body)
    texts = {f: " ".join(h).split("(default")[0].strip() for f, h in helps.items()}
    seen: dict[str, str] = {}
    for f, text in texts.items():
        if text:
            assert text not in seen, f"{f} and {seen.get(text)} share their help: {text}"
            seen[text] = f
    assert texts["--optim.eps"].startswith("Adam's epsilon") and len(seen) > 60


def test_a_dry_run_gives_a_verdict_and_the_microbatches_that_would_fit(capsys):
    """--dry-run --device-gib G: the state and a microbatch's activations (the lower bound it
    prints) against G; where they do not fit, the fewest --microbatches that would."""
    argv = ["marin-32b", "--dry-run", "--mesh.data", "256", "--mesh.model", "4"]
    cfg = CF.PRESETS["marin-32b"]
    state = C.per_device_bytes(cfg.model, CF.make_tx(cfg), dataclasses.asdict(cfg.mesh))[1]
    per_seq = DI.activation_bytes(cfg.model, 4096, 4)  # one sequence's activations a device
    for gib, verdict in ((0, f"at least {(state + 32 * per_seq) / 2**30:.1f} GiB a device at "
                             "--microbatches 1, by this lower bound; on 80 GiB (H100): "
                             "--microbatches 16; on 141 GiB (H200): --microbatches"),
                         (80, "does not fit in 80 GiB a device; --microbatches 16 would"),
                         (16, "does not fit in 16 GiB a device, even one sequence at a time"),
                         (1000, "fits in 1000 GiB a device, by this lower bound")):
        assert T.main(argv + ["--device-gib", str(gib)]) == 0
        assert f"verdict             {verdict}" in capsys.readouterr().out
    assert (state + 2 * per_seq) / 2**30 < 80 < (state + 4 * per_seq) / 2**30  # 2 rows: k 16


def test_a_dry_run_of_marin_32b_prints_the_bytes_per_device(capsys):
    assert T.main(["marin-32b", "--dry-run", "--mesh.data", "256", "--mesh.model", "4"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "per device" in out
    cfg = CF.PRESETS["marin-32b"]
    total, per_device = C.per_device_bytes(cfg.model, CF.make_tx(cfg),
                                           dataclasses.asdict(cfg.mesh))
    assert total / 1024 < per_device < total / 1024 * 1.1  # 3 x 4 bytes x 32B, FSDP x TP
    act = DI.activation_bytes(cfg.model, 8192 // 256 * 4096, 4)
    assert f"activations         {act / 2**30:.3f} GiB per device (131,072 tokens" in out
    T.main(["marin-32b", "--dry-run", "--mesh.data", "256", "--mesh.model", "4",
            "--microbatches", "8"])
    assert f"activations         {act / 8 / 2**30:.3f} GiB" in capsys.readouterr().out


@pytest.mark.parametrize("batch,seq,d_model", [(64, 128, 64), (8, 512, 128)])
def test_the_activation_estimate_is_a_lower_bound_on_xlas_temporaries(batch, seq, d_model):
    """The dry run's activations (distributed.activation_bytes, from the shapes) against the memory
    XLA plans for the compiled step's temporaries on one device: below it, within 3x."""
    cfg = tiny(None, data__batch_size=batch, data__seq_len=seq, model__d_model=d_model,
               model__d_ff=4 * d_model, model__n_layers=4)
    tx, mesh = CF.make_tx(cfg), mesh_of(1, 1)
    with jax.set_mesh(mesh):
        tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32,
                                      sharding=jax.NamedSharding(mesh, jax.P("data")))
        step = T.make_train_step(cfg, tx).lower(C.abstract_state(cfg.model, tx, mesh), tokens)
        temp = step.compile().memory_analysis().temp_size_in_bytes
    est = DI.activation_bytes(cfg.model, batch * seq)
    assert est < temp < 3 * est

# (command, argv, what the one-line error must say). {run} is a fresh run directory, {existing}
# a tiny run's directory with a config.json, other {names} are files from `bad_files`. Every case
# must exit 2 with one line and leave every file in sight unchanged.
BAD_INPUTS = [
    ("train", ["--data.source", "/nonexistent/x.txt"], "does not exist"),
    ("train", ["--data.source", "{empty}"], "is empty"),
    ("train", ["--data.source", "{big_ids}"], "outside the vocab"),
    ("train", ["--data.source", "{short}"], "too short"),
    ("train", ["--data.source", "{pickled}"], "not a plain .npy token array"),
    ("train", ["--data.source", "{floats}"], "expected a 1-D integer token array"),
    ("train", ["--data.source", "{truncated_llmc}"], "file truncated?"),
    ("train", ["--data.source", "{odd_bin}"], "size 7 is odd"),
    ("train", ["--model.d-model", "66"], "not divisible by --model.n-heads"),
    ("train", ["--model.n-kv-heads", "3"], "not a multiple"),
    ("train", ["--mesh.data", "3"], "devices"),
    ("train", ["--mesh.data", "8", "--data.batch-size", "12"], "batch_size=12 is not divisible"),
    ("train", ["--steps", "0"], "--steps must be positive"),
    ("train", ["--steps", "ten"], "--steps"),
    ("train", ["--optim.lr", "-1"], "--optim.lr must be a positive finite number"),
    ("train", ["--optim.update-clip", "sometimes"], "--optim.update-clip"),
    ("train", ["--data.replace-batches", "9:3"], "--data.replace-batches A:B"),
    ("train", ["--run-dir", "{existing}", "--optim.lr", "0.5"],
     "optim.lr (run has 0.01, flags give 0.5)"),
    ("train", ["--run-dir", "{existing}", "--resume-step", "7"], "no checkpoint at step 7"),
    ("train", ["--run-dir", "{empty}/run"], "cannot write to --run-dir"),
    ("train", ["--run-dir", "{garbage_config}"], "is unreadable"),
    ("train", ["nosuchpreset"], "unknown preset"),
    ("train", ["--dist.num-processes", "2"], "needs --dist.coordinator HOST:PORT"),
    ("warmstart", ["--to", "{run}"], "--from"),
    ("warmstart", ["--from", "{trained}", "--to", "{short}/new", "--no-train"],
     "which is a file"),
    ("train", ["--guard", "--guard.data-fraction", "2"], "in [0, 1]"),
    ("train", ["--model.attn-gate", "headwise", "--guard", "--guard.escalate", "attn-gate"],
     "already has"),
    ("train", ["--model.attn-gate", "sideways"], "none, headwise or elementwise"),
    ("train", ["--guard", "--guard.data-fraction", "0.5", "--guard.no-shifts"], "leaves alone"),
    ("warmstart", ["--from", "{run}", "--to", "{run}2"], "no config.json"),
    ("warmstart", ["--from", "{garbage_config}", "--to", "{run}"], "not a spikefix config"),
    ("report", [], "give at least one run directory"),
    ("report", ["{run}"], "no such file or run directory"),
    ("report", ["{garbage_metrics}"], "is not a metrics record"),
    ("report", ["{empty_metrics}"], "is empty"),
    ("report", ["{garbage_metrics}", "--rule.window", "2"], "--window >= 4"),
    # Every numeric flag is range-checked; NaN and infinities included.
    ("train", ["--optim.lr", "inf"], "--optim.lr must be a positive finite number"),
    ("train", ["--optim.lr", "nan"], "--optim.lr must be a positive finite number"),
    ("train", ["--optim.max-grad-norm", "nan"], "--optim.max-grad-norm must be >= 0"),
    ("train", ["--optim.max-grad-norm", "-1"], "--optim.max-grad-norm must be >= 0"),
    ("train", ["--optim.eps", "-1"], "--optim.eps must be a positive finite number"),
    ("train", ["--optim.eps", "0"], "--optim.eps must be a positive finite number"),
    ("train", ["--optim.b1", "1"], "--optim.b1 must be in [0, 1)"),
    ("train", ["--optim.b2", "nan"], "--optim.b2 must be in [0, 1)"),
    ("train", ["--optim.weight-decay", "-0.1"], "--optim.weight-decay must be >= 0"),
    ("train", ["--optim.weight-decay", "inf"], "--optim.weight-decay must be >= 0"),
    # flags that would change nothing where they are given
    ("train", ["--optim.adam-lr", "0.01"], "--optim.adam-lr is a setting of adamh and muonh"),
    ("train", ["--optim.optimizer", "adamh", "--optim.weight-decay", "0.1"],
     "--optim.optimizer adamh does not apply"),
    ("train", ["--optim.b2-rule", "batch", "--optim.b2", "0.99"], "--optim.b2-rule batch"),
    ("train", ["--optim.muon-momentum", "0.9"], "--optim.muon-momentum is a setting of Muon"),
    ("train", ["--optim.zclip-z", "3"], "add --optim.grad-clip zclip"),
    ("train", ["--optim.skip-sigma", "4"], "add --optim.skip-step"),
    ("train", ["--optim.update-clip-sigma", "3"], "add --optim.update-clip norm"),
    ("train", ["--optim.update-rms-threshold", "2"], "add --optim.update-clip rms"),
    ("train", ["--optim.hyperball-radius", "init"], "add --optim.optimizer adamh or muonh"),
    ("train", ["--optim.skip-sigma", "0"], "--optim.skip-sigma must be a positive"),
    ("train", ["--optim.skip-sigma", "nan"], "--optim.skip-sigma must be a positive"),
    ("train", ["--optim.update-clip-sigma", "-2"], "--optim.update-clip-sigma must be a positive"),
    ("train", ["--optim.update-rms-threshold", "0"], "--optim.update-rms-threshold must be"),
    ("train", ["--optim.skip-window", "1"], "--optim.skip-window must be >= 2"),
    ("train", ["--optim.skip-patience", "0"], "--optim.skip-patience must be >= 1"),
    ("train", ["--optim.warmup-steps", "-1"], "--optim.warmup-steps must be >= 0"),
    ("train", ["--optim.decay-fraction", "1.5"], "--optim.decay-fraction must be in [0, 1]"),
    ("train", ["--optim.min-lr-ratio", "nan"], "--optim.min-lr-ratio must be in [0, 1]"),
    ("train", ["--optim.rewarmup-from-ratio", "2"], "--optim.rewarmup-from-ratio must be in"),
    ("train", ["--optim.rewarmup-start", "-5"], "--optim.rewarmup-start must be >= 0"),
    ("train", ["--optim.optimizer", "sgd"], "--optim.optimizer"),
    ("train", ["--model.rope-theta", "0"], "--model.rope-theta must be a positive finite"),
    ("train", ["--model.rope-theta", "inf"], "--model.rope-theta must be a positive finite"),
    ("train", ["--model.norm-eps", "-1"], "--model.norm-eps must be a positive finite"),
    ("train", ["--model.init-std", "nan"], "--model.init-std must be a positive finite"),
    ("train", ["--model.z-loss-weight", "-1"], "--model.z-loss-weight must be >= 0"),
    ("train", ["--model.d-model", "72", "--model.n-heads", "8"], "= 9 is odd: RoPE"),
    ("train", ["--model.vocab-size", "0"], "--model.vocab-size must be positive"),
    ("train", ["--model.vocab-size", "100"], "outside the vocab"),
    ("train", ["--model.dtype", "float64"], "--model.dtype must be"),
    ("train", ["--model.attention", "cudnn", "--model.dtype", "bfloat16"], "needs an NVIDIA GPU"),
    ("train", ["--model.attention", "cudnn"], "no float32 kernel"),
    ("train", ["--model.attention", "flash"], "--model.attention"),
    ("train", ["--model.attention-block", "0"], "--model.attention-block must be positive"),
    ("train", ["--data.seq-len", "0"], "--data.seq-len and --data.batch-size must be positive"),
    ("train", ["--data.batch-size", "-8"], "--data.seq-len and --data.batch-size must be positive"),
    ("train", ["--data.held-out-fraction", "1"], "--data.held-out-fraction must lie in (0, 1)"),
    ("train", ["--data.held-out-fraction", "nan"], "--data.held-out-fraction must lie in (0, 1)"),
    ("train", ["--data.eval-sequences", "0"], "--data.eval-sequences must be positive"),
    ("train", ["--data.replace-batches", "5"], "must look like A:B"),
    ("train", ["--data.replace-batches", "0:10000000000"], "reaches past the last step"),
    ("train", ["--guard.escalate", "qk-norm"], "--guard.escalate is a setting of the guard"),
    ("train", ["--guard", "--guard.relapses", "0"], "--guard.relapses must be >= 1, got 0"),
    ("train", ["--dist.num-processes", "2", "--dist.process-id", "1", "--dist.coordinator",
               "no-such-host.invalid:1234"], "does not resolve"),
    ("train", ["--run-dir", "{user_folder}"], "not a train.py run"),
    ("train", ["--keep-checkpoints", "0"], "--keep-checkpoints must be positive"),
    ("train", ["--log-every", "-1"], "--log-every must be positive"),
    ("train", ["--max-consecutive-nonfinite", "0"], "--max-consecutive-nonfinite must be"),
    ("train", ["--mesh.model", "0"], "--mesh.data and --mesh.model must be positive"),
    ("train", ["--dist.timeout", "0"], "--dist.timeout must be positive"),
    ("train", ["--dist.num-processes", "2", "--dist.process-id", "1", "--dist.coordinator",
               "nohost"], "--dist.coordinator must be HOST:PORT"),
    # Run directories that cannot hold a run, and config.json files that are not configs.
    ("train", ["--run-dir", "{empty}"], "exists and is not a directory"),
    ("train", ["--run-dir", "{checkpoints_file}"], "checkpoints exists and is not a directory"),
    ("train", ["--run-dir", "{config_list}"], "is not a spikefix config"),
    ("train", ["--run-dir", "{config_null}"], "is not a spikefix config"),
    ("train", ["--run-dir", "{config_steps_text}"], "steps is 'ten'"),
    ("train", ["--run-dir", "{config_model_number}"], "model is 5"),
    ("train", ["--run-dir", "{config_lr_text}"], "optim.lr is 'fast'"),
    ("train", ["--run-dir", "{config_lr_nan}"], "optim.lr must be a positive finite number"),
    ("train", ["--run-dir", "{config_unknown}"], "unknown setting 'nonsense'"),
    ("train", ["--run-dir", "{existing}", "--resume-step", "-1"], "no checkpoint at step -1"),
    # warmstart.py: a source with checkpoints at steps 3 and 6 ({trained}).
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--rewarmup-steps", "-1",
                   "--steps", "12"], "optim.rewarmup_steps must be >= 0"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--rewarmup-from-ratio", "nan",
                   "--steps", "12"], "optim.rewarmup_from_ratio must be in [0, 1]"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--step", "5"],
     "no checkpoint at step 5"),
    ("warmstart", ["--from", "{trained}", "--to", "{trained}/rescued", "--steps", "12"],
     "lies inside --from"),
    ("warmstart", ["--from", "{trained}", "--to", "{trained}", "--steps", "12"],
     "lies inside --from"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}"], "does not go beyond"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--steps", "12",
                   "--model.no-qk-norm"], "do not pass --model.no-qk-norm"),
    ("warmstart", ["--from", "{trained}", "--to", "{empty}", "--steps", "12"],
     "exists and is not empty"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--steps", "12", "--optim.lr",
                   "nan"], "optim.lr must be a positive finite number"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--steps", "12", "--mesh.data", "3"],
     "devices"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--bogus-flag", "1"], "bogus"),
    ("warmstart", ["--from", "{existing}", "--to", "{run}"], "has no checkpoint"),
    # report.py
    ("report", ["{garbage_metrics}", "--rule.sigma", "nan"], "the spike rule needs"),
    ("report", ["{garbage_metrics}", "--rule.min-height", "-1"], "the spike rule needs"),
    ("report", ["{garbage_metrics}", "--rule.lookback", "-1"], "the spike rule needs"),
    ("report", ["{garbage_metrics}", "--shift.rise", "nan"], "the level-shift rule needs"),
    ("report", ["{garbage_metrics}", "--shift.hold", "0"], "the level-shift rule needs"),
    ("report", ["{garbage_metrics}", "--shift.margin", "1"], "the level-shift rule needs"),
    ("report", ["{lossless_metrics}"], "records without a loss"),
    ("report", ["{empty}"], "empty.txt is empty"),
    ("report", ["{lossless_metrics}", "--no-such-flag"], "--no-such-flag"),
    ("report", ["{bool_step_metrics}"], "metrics.jsonl:1: step True is not a step number"),
    ("report", ["{bad_utf8_metrics}"], "metrics.jsonl:2 is not UTF-8 text"),
    ("report", ["{trained}", "--plot", "{blocked_plot}"], "overview.png: Is a directory"),
    # token shards: folders, globs, a validation source
    ("train", ["--data.source", "{empty_dir}/*.bin"], "matches no file"),
    ("train", ["--data.source", "{bad_magic}"], "unknown llm.c shard magic 20240999"),
    ("train", ["--data.val-source", "/nonexistent/val.bin"], "does not exist"),
    ("train", ["--data.source", "{shards}", "--model.vocab-size", "128"],
     "train_000001.bin holds token id 200, outside the vocab of 128"),
    ("train", ["--data.source", "{shards}", "--data.val-source", "{short}"], "too short"),
    ("data", ["prepare", "--out", "{run}", "--text", "/nonexistent"], "does not exist"),
    ("data", ["prepare", "--out", "{empty}"], "exists and is not empty"),
    ("data", ["prepare", "--out", "{run}", "--tokenizer", "{empty}"], "is not a tokenizer.json"),
    ("data", ["prepare", "--out", "{run}", "--vocab-size", "100"], "--vocab-size must lie in"),
    ("data", ["tokenize"], "usage: python data.py prepare"),
    ("sample", ["{existing}"], "has no checkpoint to sample from"),
    ("sample", ["{run}"], "no config.json there"),
    ("sample", ["{trained}", "--step", "5"], "no checkpoint at step 5"),
    ("sample", ["{trained}", "--prompt", "x" * 40], "the prompt is 40 tokens: give 1 to 32"),
    ("sample", ["{trained}", "--prompt", ""], "the prompt is 0 tokens"),
    ("sample", ["{trained}", "--temperature", "-1"], "--temperature a finite number"),
    ("sample", ["{trained}", "--top-k", "-2"], "--top-k >= 0"),
    ("sample", ["{trained}", "--top-k", "1000"], "--top-k 1000 exceeds the vocabulary of 256"),
    ("sample", ["{trained}", "--max-new-tokens", "1000000000"], "GiB KV cache, more than half"),
    ("train", ["--resume", "{config_empty}"], "is not a spikefix config (it has no model, optim"),
    ("train", ["--data.seed", "-1"], "--data.seed must be >= 0, got -1"),
    ("train", ["--optim.zclip-z", "-1"], "--optim.zclip-z must be a positive finite number"),
    ("train", ["--optim.zclip-alpha", "1"], "--optim.zclip-alpha must be in [0, 1)"),
    ("train", ["--optim.zclip-warmup", "1"], "--optim.zclip-warmup must be >= 2"),
    ("train", ["--optim.grad-clip", "zlip"], "--optim.grad-clip"),
    ("train", ["--optim.qk-clip", "-1"], "--optim.qk-clip must be >= 0 and finite"),
    ("train", ["--optim.qk-clip", "100", "--model.qk-norm"], "use one or the other"),
    ("train", ["--model.attn-softcap", "-1"], "--model.attn-softcap must be >= 0"),
    ("export", ["{capped}", "--to", "{run}"], "soft-caps its attention scores"),
    ("train", ["--guard", "--guard.escalate", "maybe"], "--guard.escalate must be one of"),
    ("train", ["--guard", "--guard.relapses", "0"], "--guard.relapses"),
    ("train", ["--guard.too-far", "later"], "--guard.too-far must be stop or go-on"),
    ("train", ["--seed", "-1"], "--seed must be >= 0, got -1"),
    ("train", ["--optim.lrr", "1"], "Unrecognized options: --optim.lrr; Perhaps you meant: "
     "--optim.lr FLOAT"),  # the flag named, not its value
    ("export", ["{trained}", "--to", "{short}/hf"], "short.txt is a file, not a folder"),
    ("export", ["{trained}", "--to", "{trained}/checkpoints/99"],
     "lies inside the checkpoints of the run"),
    ("export", ["{trained}", "--to", "{user_out}"], "was not written by this program"),
    ("data", ["prepare", "--text", "{one_byte}", "--vocab-size", "300", "--out", "{run}"],
     "encodes to 1 tokens: too little to train on"),
    ("data", ["prepare", "--text", "{one_byte}", "--out", "{short}/o"], "is a file, not a folder"),
    # --resume, Hugging Face folders in and out, W&B
    ("train", ["--resume", "{run}"], "no config.json there"),
    ("train", ["--resume"], "--resume needs a run directory"),
    ("train", ["--resume", "{existing}", "--mesh.data", "8", "--optim.lr", "0.5"],
     "optim.lr (run has 0.01, flags give 0.5)"),
    ("train", ["--resume", "{trained}", "--mesh.data", "8", "--steps", "9"],
     "differs from the run's at steps already taken"),
    ("train", ["--resume", "{trained}", "--mesh.data", "8", "--steps", "5"],
     "has taken 6 steps already"),
    ("train", ["--init-from-hf", "{hf_llama}", "--model.d-ff", "256"],
     "intermediate_size 128 (flags give 256)"),
    ("train", ["--init-from-hf", "{hf_llama}", "--model.qk-norm"], "architectures"),
    ("train", ["--init-from-hf", "{empty}"], "not a Hugging Face model folder"),
    ("train", ["--data.source", "{negative}"], "negative.npy holds token id -1"),
    ("train", ["--data.source", "{zero_bin}"], "zero.bin is empty"),
    ("train", ["--data.source", "{fifo}"], "is neither a regular file nor a folder"),
    ("train", ["--run-dir", "{metrics_dir}"], "metrics.jsonl exists and is not a file"),
    ("report", ["{string_loss_metrics}"], "'loss' is not a number in every record"),
    ("train", ["--init-from-hf", "{hf_nan}"], "model.layers.1.mlp.up_proj.weight holds non-finite"),
    ("train", ["--init-from-hf", "{hf_truncated}"], "and a readable model.safetensors"),
    ("train", ["--wandb.timeout", "0"], "--wandb.timeout must be positive"),
    ("train", ["--wandb.mode", "sometimes"], "--wandb.mode"),
    ("export", ["{trained}", "--to", "{run}", "--step", "5"], "no checkpoint at step 5"),
    ("export", ["{existing}", "--to", "{run}"], "has no checkpoint"),
    ("export", ["{trained}", "--to", "{empty}"], "exists and is not empty"),
    ("export", ["{trained}", "--to", "{hf_llama}"], "exists and is not empty"),
    ("export", ["{run}", "--to", "{run}2"], "no config.json there"),
    ("export", ["{trained}"], "Missing from export.py: --to STR"),
    ("train", ["--model.attn-gate-form", "qwen"], "a setting of the attention gate, which is off"),
    ("train", ["--optim.optimizer", "adamh", "--optim.qk-clip", "100"], "off their sphere"),
    ("train", ["--optim.optimizer", "muonh", "--model.param", "mup"], "Hyperball's step"),
    ("train", ["--model.qk-mult", "1.3"], "add --model.qk-norm"),
    ("train", ["--model.mup-base-width", "16"], "a setting of muP, which is off"),
    ("warmstart", ["--from", "{trained}", "--to", "{run}", "--insert", "attn-gate",
                   "--model.attn-gate", "none"], "do not pass --model.attn-gate none"),
]


@pytest.fixture(scope="session")
def bad_files(tmp_path_factory, straight_run):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_bytes(b"")
    np.save(d / "big.npy", np.arange(300, 5000, dtype=np.int32))
    np.save(d / "pickled.npy", np.array([{"tokens": [1, 2]}], dtype=object), allow_pickle=True)
    np.save(d / "floats.npy", np.zeros(5000, np.float32))
    (d / "short.txt").write_bytes(b"abc" * 10)
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, 10_000]  # says 10,000 tokens; holds 100
    (d / "truncated.bin").write_bytes(header.tobytes() + np.zeros(100, np.uint16).tobytes())
    (d / "odd.bin").write_bytes(b"1234567")
    header[:3] = [20240999, 1, 100]  # a magic llm.c never wrote
    (d / "bad_magic.bin").write_bytes(header.tobytes() + np.zeros(100, np.uint16).tobytes())
    existing = d / "existing"
    existing.mkdir()
    (existing / "config.json").write_text(json.dumps(dataclasses.asdict(
        dataclasses.replace(TINY, run_dir=str(existing)))))
    texts = {"garbage_config": "{not json", "garbage_metrics": 'xx\n{"step": 1}\n',
             "empty_metrics": "", "lossless_metrics": '{"step": 0}\n{"step": 1}\n',
             "config_list": "[]", "config_null": "null", "config_steps_text": '{"steps": "ten"}',
             "config_model_number": '{"model": 5}', "config_lr_text": '{"optim": {"lr": "fast"}}',
             "config_lr_nan": '{"optim": {"lr": NaN}}', "config_unknown": '{"nonsense": 1}',
             "config_empty": "{}", "string_loss_metrics": '{"step": 0, "loss": "high"}\n',
             "bool_step_metrics": '{"step": true, "loss": 1.0}\n{"step": 2, "loss": 1.0}\n'}
    for name, text in texts.items():
        (d / name).mkdir()
        (d / name / ("metrics.jsonl" if "metrics" in name else "config.json")).write_text(text)
    E.export(E.ExportArgs(run=straight_run[0].run_dir, to=str(d / "hf_llama")))
    shutil.copytree(straight_run[0].run_dir, d / "capped")  # as if trained soft-capped
    capped = json.loads((d / "capped" / "config.json").read_text())
    capped["model"]["attn_softcap"] = 4.0
    (d / "capped" / "config.json").write_text(json.dumps(capped))
    from safetensors.numpy import load_file, save_file
    for name in ("hf_nan", "hf_truncated"):
        shutil.copytree(d / "hf_llama", d / name)
    tensors = load_file(d / "hf_nan" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(tensors, d / "hf_nan" / "model.safetensors")
    whole = (d / "hf_truncated" / "model.safetensors").read_bytes()
    (d / "hf_truncated" / "model.safetensors").write_bytes(whole[:len(whole) // 2])
    (d / "shards").mkdir()
    llmc_shard(d / "shards" / "x_train_000000.bin", np.arange(5000) % 100)
    llmc_shard(d / "shards" / "x_train_000001.bin", np.full(100, 200))
    (d / "empty_dir").mkdir()
    (d / "user_out.partial").mkdir()  # the user's own folder, beside an export's --to
    (d / "user_out.partial" / "notes.txt").write_text("mine")
    (d / "one_byte.txt").write_bytes(b"a")
    np.save(d / "negative.npy", np.r_[np.arange(200), -1].astype(np.int32))
    (d / "zero.bin").write_bytes(b"")
    os.mkfifo(d / "fifo")
    (d / "metrics_dir" / "metrics.jsonl").mkdir(parents=True)
    (d / "bad_utf8_metrics").mkdir()
    (d / "bad_utf8_metrics" / "metrics.jsonl").write_bytes(
        b'{"step": 0, "loss": 1.0}\n{"step": 1, "loss": \xff1.0}\n')
    (d / "blocked_plot" / "overview.png").mkdir(parents=True)  # the figure cannot be written
    (d / "checkpoints_file").mkdir()
    (d / "checkpoints_file" / "checkpoints").write_text("not a directory")
    (d / "user_folder").mkdir()  # a folder of the user's files, one named like ours
    (d / "user_folder" / "lock").write_text("my lock notes")
    (d / "user_folder" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"mine')
    return {"empty": d / "empty.txt", "big_ids": d / "big.npy", "short": d / "short.txt",
            "pickled": d / "pickled.npy", "floats": d / "floats.npy",
            "truncated_llmc": d / "truncated.bin", "odd_bin": d / "odd.bin",
            "bad_magic": d / "bad_magic.bin",
            "existing": existing, "trained": pathlib.Path(straight_run[0].run_dir),
            "hf_llama": d / "hf_llama", "shards": d / "shards", "empty_dir": d / "empty_dir",
            "user_out": d / "user_out", "one_byte": d / "one_byte.txt",
            "hf_nan": d / "hf_nan", "hf_truncated": d / "hf_truncated",
            "negative": d / "negative.npy", "zero_bin": d / "zero.bin", "fifo": d / "fifo",
            "metrics_dir": d / "metrics_dir", "user_folder": d / "user_folder",
            "bad_utf8_metrics": d / "bad_utf8_metrics", "blocked_plot": d / "blocked_plot",
            **{n: d / n for n in [*texts, "checkpoints_file", "capped"]}}


@pytest.mark.parametrize("command,argv,message", BAD_INPUTS,
                         ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD_INPUTS])
def test_bad_input_exits_2_and_writes_nothing(command, argv, message, bad_files, tmp_path,
                                              capsys):
    names = {k: str(v) for k, v in bad_files.items()} | {"run": str(tmp_path / "run")}
    argv = [a.format(**names) for a in argv]
    if command == "train":
        preset = [] if argv[0] in ("nosuchpreset", "--resume") else ["tiny"]
        if "--mesh.data" not in argv and preset:  # the test process has 8 devices
            preset += ["--mesh.data", "8"]
        run_dir = [] if "--run-dir" in argv or "--resume" in argv else ["--run-dir", names["run"]]
        argv = preset + argv + run_dir
    trees = (bad_files["empty"].parent, bad_files["trained"], tmp_path)
    before = [tree_hashes(t) for t in trees]
    code = {"train": T.main, "warmstart": W.main, "report": R.main, "export": E.main,
            "data": D.main, "sample": S.main}[command](argv)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert "-----" not in err and "--help\n" not in err  # (tyro's rules off a terminal)
    assert [tree_hashes(t) for t in trees] == before
    assert not (tmp_path / "run").exists()


def test_report_names_two_runs_of_one_folder_name_by_their_paths(straight_run, tmp_path,
                                                                capsys):
    """report.py a/run b/run: each run reported (and drawn) under the shortest end of its path
    that the other does not share."""
    for side in "ab":
        (tmp_path / side / "run").mkdir(parents=True)
        for f in ("metrics.jsonl", "config.json"):
            shutil.copy(pathlib.Path(straight_run[0].run_dir) / f, tmp_path / side / "run")
    assert R.main([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]) == 0
    out = capsys.readouterr().out
    assert "a/run" in out and "b/run" in out
    assert R.labels([str(tmp_path / "a" / "run"), str(tmp_path / "c")]) == ["run", "c"]


def test_before_shift_picks_the_last_checkpoint_margin_steps_before_the_first_shift(
        straight_run, tmp_path, capsys):
    """warmstart.py --step before-shift: report.py's level-shift rule on the source's metrics
    (planted: loss 2.0, then 3.0 from step 200 on), the last checkpoint (3 and 6 here) at least
    --margin steps before the shift; none early enough, or no shift, is one line naming why."""
    run = tmp_path / "src"
    shutil.copytree(straight_run[0].run_dir, run)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": t, "loss": 2.0 if t < 200 else 3.0}) + "\n" for t in range(400)))
    first = R.find_shifts(RC.read_metrics(run))[0].step
    assert W.before_shift(run, 100) == 6 and f"first level shift is at step {first}" in \
        capsys.readouterr().out
    assert W.before_shift(run, first - 5) == 3
    with pytest.raises(UserError, match=f"at step {first}, and no checkpoint .* earliest: 3"):
        W.before_shift(run, first - 2)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": t, "loss": 2.0}) + "\n" for t in range(400)))
    with pytest.raises(UserError, match="finds no shift"):
        W.before_shift(run, 100)


def test_the_warm_starts_summary_names_the_parameters_it_added(straight_run, tmp_path, capsys):
    """The summary is read from the converted state's new leaves, not from --insert: QK-Norm
    asked for by a model flag under --insert none is named as added."""
    argv = ["--from", straight_run[0].run_dir, "--to", str(tmp_path / "w"), "--insert", "none",
            "--model.qk-norm", "--steps", "12", "--no-train", "--mesh.data", "8"]
    assert W.main(argv) == 0
    assert "with k_norm, q_norm added" in capsys.readouterr().out


def test_a_resume_or_a_warm_start_on_other_text_is_refused_naming_both(tmp_path, monkeypatch,
                                                                        capsys):
    """config.json records the text a run trained on (data.TokenData.corpus); a resume, or a
    warm start from it, that would read other text under the same name (SPIKEFIX_STDLIB naming
    another library) is refused in one line naming both, before anything is written."""
    libs = {name: tmp_path / name for name in "ab"}  # the same size, one letter apart
    for name, lib in libs.items():
        lib.mkdir()
        (lib / "m.py").write_text(f"def {name}():\n    return 1\n" * 400)
    monkeypatch.setenv("SPIKEFIX_STDLIB", str(libs["a"]))
    D.embedded_corpus.cache_clear()
    cfg = tiny(tmp_path, steps=4, checkpoint_every=2, data__eval_sequences=8)
    T.train(cfg, devices=jax.devices()[:1])
    stored = json.loads((tmp_path / "run" / "config.json").read_text())["corpus"]
    assert stored["source"] == f"the embedded corpus ({libs['a']})" and stored["tokens"] == 8800
    monkeypatch.setenv("SPIKEFIX_STDLIB", str(libs["b"]))
    D.embedded_corpus.cache_clear()
    before = tree_hashes(tmp_path / "run")
    try:
        for main, argv in ((T.main, ["--resume", str(tmp_path / "run"), "--resume-step", "2"]),
                           (W.main, ["--from", str(tmp_path / "run"), "--to",
                                     str(tmp_path / "warm"), "--insert", "none", "--steps", "8"])):
            assert main(argv + ["--mesh.data", "8"]) == 2  # (the test process has 8 devices)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"({libs['a']}) (8,800 tokens" in err, err
            assert f"would read the embedded corpus ({libs['b']}) (8,800 tokens" in err
            assert "SPIKEFIX_STDLIB to a copy of the standard library it was trained on" in err
        assert tree_hashes(tmp_path / "run") == before and not (tmp_path / "warm").exists()
        monkeypatch.setenv("SPIKEFIX_STDLIB", str(libs["a"]))  # its own text: it resumes
        D.embedded_corpus.cache_clear()
        assert T.main(["--resume", str(tmp_path / "run"), "--steps", "6", "--mesh.data", "8"]) == 0
        # a --no-train warm start records the text too: a resume of it on other text, or the
        # same command run again to train, is refused
        warm = ["--from", str(tmp_path / "run"), "--to", str(tmp_path / "warm"), "--insert",
                "none", "--steps", "12", "--mesh.data", "8"]
        assert W.main(warm + ["--no-train"]) == 0
        assert json.loads((tmp_path / "warm" / "config.json").read_text())["corpus"] == stored
        monkeypatch.setenv("SPIKEFIX_STDLIB", str(libs["b"]))
        D.embedded_corpus.cache_clear()
        capsys.readouterr()
        for main, argv in ((T.main, ["--resume", str(tmp_path / "warm"), "--mesh.data", "8"]),
                           (W.main, warm)):
            assert main(argv) == 2 and "other text" in capsys.readouterr().err
        config = json.loads((tmp_path / "warm" / "config.json").read_text())
        del config["corpus"]  # a record this version wrote, lost: refused, not trusted
        (tmp_path / "warm" / "config.json").write_text(json.dumps(config))
        assert T.main(["--resume", str(tmp_path / "warm"), "--mesh.data", "8"]) == 2
        assert "lost its record of the text" in capsys.readouterr().err
        assert C.saved_steps(tmp_path / "warm") == [6]
    finally:
        D.embedded_corpus.cache_clear()


def test_warmstart_refuses_to_insert_a_gate_the_guard_already_inserted(straight_run, tmp_path):
    """A run whose guard inserted the attention gate (events.jsonl, not config.json) has it at
    its later checkpoints: --insert attn-gate, alone or with QK-Norm, is refused in one line."""
    run = tmp_path / "run"
    shutil.copytree(straight_run[0].run_dir, run)
    G.record(run, {"rule": "shift", "event_step": 4, "trigger_step": 4, "action": "escalate",
                   "rollback_to": 3, "replaced_until": 5, "extra_steps": 2,
                   "escalation": "attn-gate", "rewarm_steps": 1})
    for insert in ("attn-gate", "qk-norm+attn-gate"):
        with pytest.raises(UserError, match="has an attention gate at step 6 .its guard"):
            W.load_source(run, None, insert)
    assert W.load_source(run, 3, "attn-gate")[0].model.attn_gate == "none"  # before it


def test_bad_input_from_the_shell_is_one_line_too(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "tiny", "--model.n-heads", "5",
                          "--run-dir", str(tmp_path / "r")], cwd=HERE, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: --model.d-model=64")
    assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


def test_a_short_run_learns(straight_run):
    cfg, last = straight_run
    lines = [json.loads(x) for x in (pathlib.Path(cfg.run_dir) / "metrics.jsonl").open()]
    assert [m["step"] for m in lines] == list(range(6))
    assert lines[0]["loss"] > 5.3  # ln 256 = 5.55 at init
    assert last["eval_loss"] < lines[0]["loss"] - 1.0
    assert len(last["attn_logit_max"]) == cfg.model.n_layers


def test_the_progress_line_shows_mfu_against_the_peak_it_names(tmp_path, capsys):
    """MFU (PaLM's model FLOPs utilisation) in the progress line: against --peak-tflops where
    given (the line at the start names the peak), none on a CPU without it; the figure is
    model.flops_per_token x the line's tokens/s over the peak."""
    cfg = tiny(tmp_path, steps=12, log_every=4, peak_tflops=0.01)
    T.train(cfg, devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "MFU against 0.01 TFLOP/s a device (--peak-tflops)" in out
    line = [x for x in out.splitlines() if x.startswith("step") and "MFU" in x][-1]
    rate = float(line.split(" tok/s")[0].split("| ")[-1].removesuffix("k")) * 1e3
    mfu = float(line.split("MFU ")[1].split("%")[0]) / 100
    flops = M.flops_per_token(cfg.model, cfg.data.seq_len)
    # within the line's rounding: tok/s to 0.1k, MFU to 0.1%
    assert abs(mfu - flops * rate / 1e10) <= flops * 50 / 1e10 + 0.0005 + 1e-9
    T.train(dataclasses.replace(tiny(tmp_path / "b", steps=4), run_dir=str(tmp_path / "b")),
            devices=jax.devices()[:1])
    out = capsys.readouterr().out
    assert "MFU: no peak known for cpu" in out and "| MFU" not in out


def test_a_run_inside_its_warmup_and_a_flag_on_a_finished_run_say_so(tmp_path, capsys):
    """--steps that end inside the warmup get a note; a finished run resumed with
    --wandb.project trains nothing and says that nothing goes to W&B (no W&B run starts)."""
    cfg = tiny(tmp_path, steps=4)  # the tiny preset's warmup: 5 steps
    T.train(cfg, devices=jax.devices()[:1])
    assert "ends inside the LR warmup (5 steps)" in capsys.readouterr().out
    again = dataclasses.replace(cfg, wandb=TR.WandbConfig(project="spikefix-tests",
                                                          mode="offline"))
    assert T.train(again, devices=jax.devices()[:1]).last == {}
    out = capsys.readouterr().out
    assert "is done (step 4 of 4)" in out and "nothing goes to W&B" in out
    assert not (tmp_path / "run" / "wandb").exists()


@pytest.mark.slow
def test_bfloat16_compute_trains_finitely(tmp_path):
    cfg = tiny(tmp_path, model__dtype="bfloat16", steps=8, eval_every=8, checkpoint_every=8)
    last = T.train(cfg, devices=jax.devices()[:1]).last
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert all(np.isfinite(m["loss"]) for m in lines) and last["eval_loss"] < lines[0]["loss"]
    state = restore_final(cfg, 8)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state["params"]))  # params f32


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_says_where(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-u", "train.py", "tiny", "--steps", "100000", "--log-every", "1",
           "--checkpoint-every", "100000", "--run-dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        for line in proc.stdout:
            if line.startswith("step") and " 3/" in line:
                proc.terminate()  # SIGTERM, as a preemption sends
                break
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + 15
    finally:
        proc.kill()
    saved = int(out.split("saved step ")[1].split()[0])
    assert saved >= 4 and "resume with the same command" in out
    assert [p.name for p in (run / "checkpoints").iterdir()] == [str(saved)]
    cfg = dataclasses.replace(TINY, run_dir=str(run), steps=100000, log_every=1,
                              checkpoint_every=100000)
    assert int(restore_final(cfg, saved)["step"]) == saved


def start_tiny_run(run: pathlib.Path, *flags: str) -> subprocess.Popen:
    """A long tiny run in a subprocess that logs every step; stdout and stderr kept apart."""
    return subprocess.Popen([sys.executable, "-u", "train.py", "tiny", "--steps", "100000",
                             "--log-every", "1", "--run-dir", str(run), *flags], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, wanted, what: str) -> None:
    """Read the run's stdout up to the first line for which wanted(line) holds."""
    for line in proc.stdout:
        if wanted(line):
            return
    raise AssertionError(f"the run ended before {what}: {proc.stderr.read()[-2000:]}")


def wait_for_step(proc: subprocess.Popen, step: int) -> None:
    wait_for_line(proc, lambda line: line.startswith("step") and f" {step}/" in line,
                  f"step {step}")


@pytest.mark.slow
def test_ctrl_c_twice_stops_at_once_in_one_line(tmp_path):
    import signal
    run = tmp_path / "run"
    proc = start_tiny_run(run, "--checkpoint-every", "2", "--keep-checkpoints", "100")
    try:
        # step 7 is read before step 8 is saved, and by then the save of 6 has waited for 4's
        wait_for_step(proc, 7)
        proc.send_signal(signal.SIGINT)
        # (the steps that ran before the signal was seen may be printed first)
        wait_for_line(proc, lambda line: "SIGINT: saving a checkpoint" in line, "the SIGINT line")
        proc.send_signal(signal.SIGINT)  # while the first one's checkpoint is being written
        assert proc.wait(timeout=30) == 128 + 2
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert err.count("\n") == 1 and "again: stopped without saving" in err, err
    steps = C.saved_steps(run)
    cfg = dataclasses.replace(TINY, run_dir=str(run), steps=100000, log_every=1,
                              checkpoint_every=2, keep_checkpoints=100)
    assert steps[-1] >= 4 and int(restore_final(cfg, steps[-1])["step"]) == steps[-1]


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_ends_the_run_in_one_line(tmp_path):
    import resource
    import time
    run = tmp_path / "run"
    proc = start_tiny_run(run, "--checkpoint-every", "2", "--keep-checkpoints", "100")
    try:
        # step 7 is read before step 8 is saved, and by then the save of 6 has waited for 4's
        wait_for_step(proc, 7)
        # The disk fills up: no file may grow past 100 kB (a checkpoint needs more).
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (100_000, 100_000))
        t0 = time.monotonic()
        assert proc.wait(timeout=60) == 1
        seconds, err = time.monotonic() - t0, proc.stderr.read()
    finally:
        proc.kill()
    assert seconds < 20 and err.count("\n") == 1 and "File too large" in err, err
    good = int(err.split("the last good checkpoint is step ")[1].split(".")[0])
    cfg = dataclasses.replace(TINY, run_dir=str(run), steps=100000, log_every=1,
                              checkpoint_every=2, keep_checkpoints=100)
    assert good >= 4 and C.saved_steps(run)[-1] == good
    assert int(restore_final(cfg, good)["step"]) == good  # intact


def test_one_writer_per_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    with C.run_lock(run):  # another train.py holds the run (flock: per open file)
        assert T.main(["tiny", "--mesh.data", "8", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"is in use by another process (PID {os.getpid()})" in err and err.count("\n") == 1
    assert not (run / "config.json").exists()
    (run / "lock").write_text("999999999\n")  # left by a process killed with the lock held
    said = []
    with C.run_lock(run, announce=said.append):
        assert (run / "lock").read_text() == f"{os.getpid()}\n"
    assert said == [f"process 999999999 ended without releasing {run}/lock; taking it over"]
    assert (run / "lock").read_text() == ""  # released cleanly


@pytest.mark.slow
@pytest.mark.parametrize("pid, said", [
    (1, "could not reach --dist.coordinator"),  # process 1: process 0 is not there
    (0, "not every one of the 2 processes joined")])  # process 0: process 1 never comes
def test_a_process_left_alone_fails_in_one_line_within_the_timeout(tmp_path, pid, said):
    out = subprocess.run([sys.executable, "train.py", "tiny", "--dist.num-processes", "2",
                          "--dist.process-id", str(pid), "--dist.coordinator",
                          f"127.0.0.1:{free_port()}", "--dist.timeout", "2", "--run-dir",
                          str(tmp_path / "r")], cwd=HERE, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert said in out.stderr and "within --dist.timeout 2s" in out.stderr
    assert not (tmp_path / "r").exists()
    if pid == 1:
        assert out.stdout.startswith("process 1: waiting up to 2s (--dist.timeout) for the "
                                     "coordinator 127.0.0.1:"), out.stdout  # said at once


@pytest.mark.slow
def test_an_unreachable_wandb_neither_stops_nor_stalls_training(tmp_path):
    env = {**os.environ, "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
           "WANDB_API_KEY": "x" * 40}
    out = subprocess.run([sys.executable, "train.py", "tiny", "--steps", "3", "--run-dir",
                          str(tmp_path / "run"), "--wandb.project", "p", "--wandb.timeout", "1"],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and "done: step 3" in out.stdout, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "warning: W&B is not reachable" in out.stderr
    history = [r for r in wandb_records(tmp_path / "run")
               if r.WhichOneof("record_type") == "history"]
    assert len(history) >= 3  # logged offline instead


@pytest.mark.slow
def test_resume_by_run_directory_and_raise_the_steps_of_a_constant_schedule(tmp_path):
    """The end line's "train on" command is the one that works: for a constant schedule the
    resume with twice the steps (run here, and it trains on exactly as a straight run); for a
    schedule that decays over all its steps, no such command (it would be refused)."""
    cfg = tiny(tmp_path, steps=6, checkpoint_every=3, optim__min_lr_ratio=1.0)
    T.train(cfg, devices=jax.devices()[:1])
    assert CF.train_on(cfg, 6) == f"train on: python train.py --resume {cfg.run_dir} --steps 12"
    decayed = tiny(tmp_path, steps=20)  # (its warmup: 5 steps; then it decays to the end)
    assert "python warmstart.py" in CF.train_on(decayed, 20)  # (the test below runs it)
    with pytest.raises(UserError, match="LR schedule"):
        CF.check_same_run(decayed, dataclasses.replace(decayed, steps=40), taken=20)
    CF.check_same_run(cfg, dataclasses.replace(cfg, steps=12), taken=6)  # accepted
    longer = CF.parse_config(["--resume", cfg.run_dir, "--steps", "9"])
    assert longer == dataclasses.replace(cfg, steps=9)  # no preset, no flags retyped
    assert CF.parse_config([cfg.run_dir, "--steps", "9"]) == longer
    T.train(longer, devices=jax.devices()[:1])
    straight = dataclasses.replace(longer, run_dir=str(tmp_path / "straight"))
    T.train(straight, devices=jax.devices()[:1])
    assert_trees_equal(restore_final(longer, 9), restore_final(straight, 9))


@pytest.mark.slow
def test_a_run_stops_after_too_many_nonfinite_steps_in_a_row(tmp_path, capsys):
    # An absurd LR: the first step is applied, its parameters overflow the next forward pass,
    # and every step after that is non-finite (and skipped).
    cfg = tiny(tmp_path, optim__lr=1e30, max_consecutive_nonfinite=3, steps=20, checkpoint_every=1)
    outcome = T.train(cfg, devices=jax.devices()[:1])  # returned, not exited: main() exits
    assert (outcome.why, outcome.exit_code) == ("non-finite", 1)
    assert "3 non-finite steps in a row" in capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(lines) < 8 and all(m["skipped"] for m in lines[-3:])


def poison_batches(monkeypatch, steps):
    """A test-only data source: the batches of `steps` are all token 255, and a batch of all
    255s makes the loss (and so every gradient) NaN, as a corrupt shard might."""
    batch, loss_fn = D.TokenData.batch, T.loss_fn

    def poisoned_batch(self, step, rows=slice(None)):
        tokens = batch(self, step, rows)
        return np.full_like(tokens, 255) if step in steps else tokens

    def poisoned_loss(params, tokens, cfg):
        loss, aux = loss_fn(params, tokens, cfg)
        return loss * jnp.where(jnp.all(tokens == 255), jnp.nan, 1.0), aux
    monkeypatch.setattr(D.TokenData, "batch", poisoned_batch)
    monkeypatch.setattr(T, "loss_fn", poisoned_loss)


def test_poisoned_batch_is_skipped_and_training_continues(tmp_path, monkeypatch):
    poison_batches(monkeypatch, {3})
    cfg = tiny(tmp_path, steps=6, checkpoint_every=1, keep_checkpoints=10)
    last = T.train(cfg, devices=jax.devices()[:1]).last
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["skipped"] for m in lines] == [0, 0, 0, 1, 0, 0]
    assert lines[3]["loss"] is None and np.isfinite(last["eval_loss"])  # non-finite: null
    before, after = restore_final(cfg, 3), restore_final(cfg, 4)  # around the poisoned step
    assert_trees_equal(before["params"], after["params"])
    assert_trees_equal(before["opt_state"][0].inner_state, after["opt_state"][0].inner_state)
    assert lines[5]["loss"] < lines[2]["loss"] + 0.5  # and it trains on


@pytest.mark.slow
def test_poisoned_stretch_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    poison_batches(monkeypatch, set(range(2, 100)))
    cfg = tiny(tmp_path, steps=20, checkpoint_every=2, max_consecutive_nonfinite=3)
    assert T.train(cfg, devices=jax.devices()[:1]).exit_code == 1
    err = capsys.readouterr().err
    assert "3 non-finite steps in a row (last at step 4)" in err and "Last checkpoint" in err
    good = restore_final(cfg, 2)
    assert int(good["step"]) == 2 and all(np.isfinite(np.asarray(x)).all()
                                         for x in jax.tree.leaves(good["params"]))


@pytest.mark.slow
def test_the_held_out_loss_is_the_mean_over_the_whole_fixed_set_in_one_pass():
    cfg = dataclasses.replace(TINY, data=dataclasses.replace(TINY.data, eval_sequences=20))
    data = D.TokenData(cfg.data)
    batches = data.held_out_batches()
    assert batches.shape == (3, 8, 33)  # 20 windows, rounded up to 3 batches of 8
    assert len({b.tobytes() for b in batches.reshape(24, 33)}) == 24  # distinct windows
    np.testing.assert_array_equal(batches, D.TokenData(cfg.data).held_out_batches())
    params = M.init_params(cfg.model, jax.random.key(0))
    mesh = mesh_of(2, 1)
    with jax.set_mesh(mesh):
        loss = float(T.make_eval_step(cfg)(params, L.put_held_out(data, mesh)))
        ce = jax.jit(lambda p, b: M.loss_fn(p, b, cfg.model)[1]["ce"])
        each = [float(ce(params, jnp.asarray(b))) for b in batches]
    assert loss == pytest.approx(np.mean(each), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# guard.py

def test_the_guard_watch_fires_where_the_report_rules_find_the_first_event():
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.02 * rng.standard_normal(400)
    spiky = loss.copy()
    spiky[260] += 0.5
    shifted = loss.copy()
    shifted[300:] += 0.3
    for series, rule in ((spiky, "spike"), (shifted, "shift")):
        m = {"step": np.arange(400), "loss": series}
        first = (R.find_spikes(m) if rule == "spike" else R.find_shifts(m))[0].step
        watch = G.Watch(spikes=rule == "spike")
        fired = next(t for s, x in enumerate(series) if (t := watch.observe(s, float(x))))
        assert (fired.rule, fired.event) == (rule, first)
        assert fired.step == first + (R.ShiftRule().hold if rule == "shift" else 0)
    assert G.Watch().observe(0, float("nan")).rule == "non-finite"


def test_the_guard_plan_rolls_back_past_the_margin_and_escalates_at_a_relapse():
    cfg = G.GuardConfig(on=True, margin=20, escalate="qk-norm", relapses=2, within=500)
    first = G.plan(cfg, G.Trigger("spike", 150, 150, 3.0), [100, 120, 140], [])
    assert (first["action"], first["rollback_to"], first["replaced_until"]) == ("rollback", 120,
                                                                               151)
    second = G.plan(cfg, G.Trigger("shift", 400, 450, 3.0), [100, 120, 380], [first])
    assert (second["action"], second["escalation"], second["rollback_to"]) == ("escalate",
                                                                               "qk-norm", 380)
    far = G.plan(cfg, G.Trigger("spike", 900, 900, 3.0), [100, 120, 380], [first])
    assert far["action"] == "rollback"  # 750 steps after the first: no relapse
    assert G.plan(cfg, G.Trigger("spike", 110, 110, 3.0), [100], [])["action"] == "stop"
    # never back past the escalation: the model changed there
    later = G.plan(cfg, G.Trigger("spike", 500, 500, 3.0), [100, 120, 380], [first, second])
    assert (later["action"], later["rollback_to"]) == ("rollback", 380)
    early = G.plan(cfg, G.Trigger("spike", 390, 390, 3.0), [100, 120, 380], [first, second])
    assert early["action"] == "stop" and "escalated at step 380" in early["why"]
    clip = G.plan(dataclasses.replace(cfg, escalate="qk-clip"), G.Trigger("shift", 400, 450, 3.0),
                  [100, 120, 380], [first])
    eff = G.effective_config(tiny(steps=1000), [first, clip])
    assert (eff.optim.qk_clip, eff.optim.qk_clip_start, eff.model.qk_norm) == (100.0, 380, False)
    eff = G.effective_config(tiny(steps=1000), [first, second])
    assert eff.data.replace_batches == "120:151,380:451" and eff.model.qk_norm
    assert not G.effective_config(tiny(steps=1000), [first, second],
                                  restored_at=380).model.qk_norm
    with pytest.raises(ValueError, match="--guard.escalate"):
        G.GuardConfig(escalate="maybe")


def plant_guard_events(monkeypatch, poison=(), shift_from=None):
    """Test-only data: the original batches of `poison` steps make the loss NaN (a replaced
    batch is clean); from `shift_from` on, every batch adds 2 nats to the loss of a model
    without QK-Norm (a level shift that only the escalation ends)."""
    batch, loss_fn = D.TokenData.batch, T.loss_fn

    def planted_batch(self, step, rows=slice(None)):
        tokens = batch(self, step, rows).copy()
        if step in poison and not any(step in r for r in self.replaced):
            tokens[0, 0] = 254
        if shift_from is not None and step >= shift_from:
            tokens[0, 0] = 255
        return tokens

    def planted_loss(params, tokens, cfg, **kw):
        loss, aux = loss_fn(params, tokens, cfg, **kw)
        loss = loss + (0.0 if cfg.qk_norm else 2.0) * (tokens[0, 0] == 255)
        return loss * jnp.where(tokens[0, 0] == 254, jnp.nan, 1.0), aux
    monkeypatch.setattr(D.TokenData, "batch", planted_batch)
    monkeypatch.setattr(T, "loss_fn", planted_loss)


def final_state(cfg):
    run = pathlib.Path(cfg.run_dir)
    return restore_final(G.effective_config(cfg, RC.read_events(run)), C.saved_steps(run)[-1])


@pytest.mark.slow
def test_the_guard_rolls_back_a_poisoned_batch_and_never_applies_it(tmp_path, monkeypatch):
    plant_guard_events(monkeypatch, poison={7})
    cfg = tiny(tmp_path, steps=12, checkpoint_every=2, keep_checkpoints=10, guard__on=True,
               guard__margin=1)
    T.train(cfg, devices=jax.devices()[:1])
    (e,) = RC.read_events(tmp_path / "run")
    assert (e["rule"], e["rollback_to"], e["replaced_until"]) == ("non-finite", 6, 8)
    m = RC.read_metrics(tmp_path / "run")
    assert np.all(np.isfinite(m["loss"])) and not np.any(m["skipped"])  # on the new path
    assert "1 guard action (2 steps computed again)\nguard: non-finite at step 7 (seen at 7): " \
        "rolled back to step 6, batches 6-7 replaced" in R.event_report(m)  # the report says it
    # the same as a run told to replace those batches from the start: the poison never applied
    plain = tiny(tmp_path / "plain", steps=12, checkpoint_every=2, data__replace_batches="6:8")
    T.train(plain, devices=jax.devices()[:1])
    assert_trees_equal(final_state(cfg)["params"], final_state(plain)["params"])


@pytest.mark.slow
def test_a_rollback_below_the_step_a_resumed_process_started_at_is_no_traceback(
        tmp_path, monkeypatch, capsys):
    """Killed (Ctrl-C) after step 6, resumed at 7: the poisoned batch 7 rolls the resumed
    process back to step 6, below where it started; the progress line's ETA stays defined.
    Each train() in process leaves the signal handlers as it found them (a run's handler left
    behind would take the next SIGTERM into its flag, which no loop reads any more)."""
    handlers = lambda: (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    before = handlers()
    plant_guard_events(monkeypatch, poison={7})
    cfg = tiny(tmp_path, steps=12, checkpoint_every=2, keep_checkpoints=10, guard__on=True,
               guard__margin=1, log_every=1)
    requested = DI.StopRequested.requested

    def stop_after_6(self, step):
        if step == 6:
            self.signal = 2
        return requested(self, step)
    monkeypatch.setattr(DI.StopRequested, "requested", stop_after_6)
    assert T.train(cfg, devices=jax.devices()[:1]).exit_code == 128 + 2
    monkeypatch.setattr(DI.StopRequested, "requested", requested)
    assert C.saved_steps(tmp_path / "run")[-1] == 7
    assert handlers() == before
    capsys.readouterr()
    T.train(cfg, devices=jax.devices()[:1])
    assert handlers() == before
    out = capsys.readouterr().out
    (e,) = RC.read_events(tmp_path / "run")
    assert (e["rollback_to"], e["replaced_until"]) == (6, 8)
    lines = [line for line in out.splitlines() if "ETA" in line]
    etas = [line.split("ETA ")[1] for line in lines]
    # no rate on the first record after the compile or a rollback, then rates over the steps
    # since it: never a negative ETA
    assert etas[0] == "--" and "-- tok/s" in lines[0] and "--" in etas[1:], out
    assert all(x == "--" or x[0].isdigit() for x in etas), out
    assert all("-- tok/s" in line or float(line.split("k tok/s")[0].split("| ")[-1]) > 0
               for line in lines), out


class Killed(Exception):
    pass


@pytest.mark.slow
def test_the_guard_escalates_a_relapsing_shift_to_qk_norm_and_a_kill_changes_nothing(
        tmp_path, monkeypatch, capsys):
    plant_guard_events(monkeypatch, shift_from=60)
    runs = {}
    record = G.record
    # a kill after the bad path's checkpoints are deleted, before the rollback is recorded;
    # and one right after the escalation is recorded, before its QK-Norm is inserted
    # (the killed runs start as the straight run was at step 40, the checkpoint it rolls back
    # to: the same path, 40 steps shorter)
    for name, kill_at in (("straight", None), ("kill-rollback", (1, "before")),
                          ("kill-escalation", (2, "after"))):
        calls = []
        if kill_at:
            as_at_step(tmp_path / "straight" / "run", tmp_path / name / "run", 40)

        def killing(run_dir, event, calls=calls, kill_at=kill_at):
            calls.append(event)
            if kill_at == (len(calls), "before"):
                raise Killed
            record(run_dir, event)
            if kill_at == (len(calls), "after"):
                raise Killed
        monkeypatch.setattr(G, "record", killing)
        cfg = tiny(tmp_path / name, steps=80, checkpoint_every=20, keep_checkpoints=20,
                   eval_every=80, guard__on=True, guard__escalate="qk-norm")
        killed = False
        try:
            T.train(cfg, devices=jax.devices()[:1])
        except Killed:
            killed = True
            T.train(cfg, devices=jax.devices()[:1])  # the same command again
        runs[name] = cfg
        assert killed == (kill_at is not None)
        # killed before its record, the rollback is decided again; after it, re-applied
        assert len(calls) == 2 + (kill_at is not None and kill_at[1] == "before")
    events = RC.read_events(tmp_path / "straight" / "run")
    assert [{k: v for k, v in e.items() if k not in ("loss", "max_logit")} for e in events] == \
        PLANTED_SHIFT_EVENTS
    assert all(0 < e["max_logit"] < 1e3 for e in events)  # the signal when it acted
    m = RC.read_metrics(tmp_path / "straight" / "run")
    after = m["loss"][m["step"] > events[1]["replaced_until"]]
    assert after.max() < m["loss"][20:60].max() + 0.5  # no relapse: the planted nats are gone
    straight = final_state(runs["straight"])
    assert "q_norm" in straight["params"]["layers"]
    for name in ("kill-rollback", "kill-escalation"):
        assert RC.read_events(tmp_path / name / "run") == events
        assert_trees_equal(final_state(runs[name]), straight)
    # every tool reads the escalated model (config.json does not have it; events.jsonl does)
    run = tmp_path / "straight" / "run"
    cfg, step = CF.load_checkpointed(run, None)
    assert cfg.model.qk_norm and step == 80
    assert S.main([str(run), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    assert W.main(["--from", str(run), "--to", str(tmp_path / "w"), "--no-train"]) == 2
    assert "its guard inserted it" in capsys.readouterr().err
    # --resume-step to before the escalation: its record goes aside with the later checkpoints
    # (no KeyError), and the plain command goes on from there
    cfg = dataclasses.replace(runs["straight"], resume_step=20)
    T.train(cfg, devices=jax.devices()[:1])
    (aside,) = run.glob("events.superseded-*.jsonl")
    assert [json.loads(x) for x in aside.read_text().splitlines()] == events
    assert RC.read_events(run) == events  # the same path again: the same two decisions
    T.train(runs["straight"], devices=jax.devices()[:1])  # the same command: done, no error
    # the record emptied by hand: one line that says so, not "unreadable"
    (run / "events.jsonl").write_text("")
    with pytest.raises(UserError, match="its record .*events.jsonl is missing or emptied"):
        T.train(runs["straight"], devices=jax.devices()[:1])


def test_a_level_shift_in_the_data_is_recorded_as_data_and_the_run_goes_on(tmp_path, monkeypatch):
    """A change of the data mixture (half of each batch random bytes, steps 150-449): the
    train loss shifts up for good while the held-out loss barely moves, so the guard records
    "data" once, rolls nothing back and escalates nothing; killed right after that record,
    the same command ends bitwise where the straight run does. (The spike rule is off here:
    the onset's jump is a one-step spike of its own.) The decision's arithmetic: a held-out
    rise of at least data_fraction x the train loss's rise is an instability."""
    batch = D.TokenData.batch
    noise = np.random.default_rng(0).integers(0, 256, (600, 4, 33)).astype(np.int32)

    def mixed(self, step, rows=slice(None)):
        tokens = batch(self, step, rows).copy()
        if 150 <= step < 450:
            tokens[:4] = noise[step]
        return tokens
    monkeypatch.setattr(D.TokenData, "batch", mixed)
    record = G.record
    for name in ("straight", "killed"):  # (killed: from the straight run's step 180)
        kills = [] if name == "killed" else [None]  # one kill, right after the record
        if name == "killed":
            as_at_step(tmp_path / "straight" / "run", tmp_path / name / "run", 180)

        def killing(run_dir, event, kills=kills):
            record(run_dir, event)
            if not kills:
                kills.append(event)
                raise Killed
        monkeypatch.setattr(G, "record", killing)
        cfg = tiny(tmp_path / name, steps=300, checkpoint_every=20, keep_checkpoints=20,
                   eval_every=300, guard__on=True, guard__spikes=False,
                   guard__data_fraction=0.5)
        killed = False
        try:
            T.train(cfg, devices=jax.devices()[:1])
        except Killed:
            killed = True
            T.train(cfg, devices=jax.devices()[:1])
        assert killed == (name == "killed")
    (e,) = RC.read_events(tmp_path / "straight" / "run")
    assert e["action"] == "data" and 150 <= e["event_step"] < 200 and e["rise"] > 0.5
    assert e["held_out_now"] - e["held_out_before"] < 0.5 * e["rise"]
    assert RC.read_events(tmp_path / "killed" / "run") == [e]
    assert_trees_equal(final_state(tiny(tmp_path / "killed", steps=300)),
                       final_state(tiny(tmp_path / "straight", steps=300)))
    m = RC.read_metrics(tmp_path / "straight" / "run")
    assert list(m["step"]) == list(range(300))  # nothing computed again
    trig = G.Trigger("shift", 400, 450, 3.0, rise=0.4)
    half = G.GuardConfig(data_fraction=0.5)
    assert G.in_the_data(half, trig, 2.0, 2.19, 380)["action"] == "data"
    assert G.in_the_data(half, trig, 2.0, 2.21, 380) is None  # moved with it
    assert G.in_the_data(G.GuardConfig(), trig, 2.0, 2.0, 380) is None  # off by default


@pytest.mark.slow
def test_a_predicted_break_escalates_where_the_run_stands_and_a_kill_changes_nothing(
        tmp_path, monkeypatch):
    """--guard.predict max-logit, on a planted signal (from step 50 on, the max logit of a
    model without QK-Norm reads 1,000 more; the loss does not move): at the next checkpoint
    step, 60, the guard inserts QK-Norm with no rollback and nothing computed again. Killed
    after the checkpoint and before the record, or after the record and before the
    insertion, the same command ends bitwise where the straight run does."""
    loss_fn = T.loss_fn

    def planted(params, tokens, cfg, **kw):
        loss, aux = loss_fn(params, tokens, cfg, **kw)
        hit = (tokens[0, 0] == 255) & (not cfg.qk_norm)
        return loss, aux | {"attn_logit_max": aux["attn_logit_max"] + 1000.0 * hit}
    batch = D.TokenData.batch

    def marked(self, step, rows=slice(None)):
        tokens = batch(self, step, rows).copy()
        tokens[0, 0] = 255 if step >= 50 else tokens[0, 0] % 255
        return tokens
    monkeypatch.setattr(T, "loss_fn", planted)
    monkeypatch.setattr(D.TokenData, "batch", marked)
    runs = {}
    for name in ("straight", "kill-before-record", "kill-after-record"):
        if name != "straight":
            as_at_step(tmp_path / "straight" / "run", tmp_path / name / "run", 60)
        if name == "kill-after-record":
            shutil.copy(tmp_path / "straight" / "run" / "events.jsonl", tmp_path / name / "run")
        runs[name] = tiny(tmp_path / name, steps=100, checkpoint_every=20, keep_checkpoints=10,
                          eval_every=100, guard__on=True, guard__escalate="qk-norm",
                          guard__spikes=False, guard__shifts=False, guard__predict="max-logit")
        T.train(runs[name], devices=jax.devices()[:1])
    (e,) = RC.read_events(tmp_path / "straight" / "run")
    assert e.pop("max_logit") > 1000
    assert {k: v for k, v in e.items() if k != "loss"} == {
        "rule": "predict", "event_step": 60, "trigger_step": 59, "action": "escalate",
        "rollback_to": 60, "replaced_until": 60, "extra_steps": 0, "escalation": "qk-norm",
        "rewarm_steps": 100}
    m = RC.read_metrics(tmp_path / "straight" / "run")
    assert list(m["step"]) == list(range(100))  # nothing computed again
    assert m["attn_logit_max"][60:].max() < 1000 < m["attn_logit_max"][50:60].min()
    straight = final_state(runs["straight"])
    assert "q_norm" in straight["params"]["layers"]
    for name in ("kill-before-record", "kill-after-record"):
        assert RC.read_events(tmp_path / name / "run")[0]["event_step"] == 60
        assert_trees_equal(final_state(runs[name]), straight)
    with pytest.raises(ValueError, match="--guard.predict acts by escalating"):
        G.GuardConfig(on=True, predict="max-logit")


def as_at_step(run: pathlib.Path, copy: pathlib.Path, step: int) -> None:
    """`copy`: `run` as a run killed right after saving `step` left it (its checkpoints up to
    `step`, its metrics before it, no guard record yet)."""
    shutil.copytree(run, copy)
    for d in (copy / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > step:
            shutil.rmtree(d)
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    first_late = next(i for i, x in enumerate(lines) if json.loads(x)["step"] >= step)
    (copy / "metrics.jsonl").write_text("".join(lines[:first_late]))
    (copy / "events.jsonl").unlink()


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfe{}\n", "not UTF-8"),
    (b"[]\n", "not a guard record"),
    (b"{}\n", "unknown action"),
    (b'{"action": "rollback", "event_step": 5}\n', "rollback_to"),
    (b'{"action": "escalate", "event_step": 5, "rollback_to": 4, "replaced_until": 6, '
     b'"extra_steps": 2, "escalation": "qk-norms"}\n', "unknown escalation"),
    (None, "not a file"),
    (b'{"action": "stop", "event_step": 5, "trigger_step": 5, "rule": "spike"}\n', "its why"),
    (b'{"action": "data", "event_step": 5, "trigger_step": 6, "rule": "shift"}\n', "its rise"),
    (b'{"action": "escalate", "event_step": 5, "trigger_step": 5, "rule": "predict", '
     b'"rollback_to": 5, "replaced_until": 5, "extra_steps": 0, "escalation": "qk-norm"}\n',
     "its max_logit"),
    (b'{"action": "rollback", "event_step": 5, "trigger_step": 5, "rule": "spike", '
     b'"rollback_to": 9, "replaced_until": 10, "extra_steps": 2}\n', "rollback goes back"),
    (b'{"action": "rollback", "event_step": 1000000, "trigger_step": 1000000, "rule": "spike", '
     b'"rollback_to": 4, "replaced_until": 6, "extra_steps": 2}\n', "of a 20-step run"),
])
def test_a_damaged_guard_record_is_one_line_and_changes_nothing(tmp_path, capsys, content, says):
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)  # (read before any checkpoint is)
    C.write_config(run, dataclasses.asdict(tiny(tmp_path)))
    if content is None:
        (run / "events.jsonl").mkdir()
    else:
        (run / "events.jsonl").write_bytes(content)
    before = tree_hashes(run)
    assert T.main(["--resume", str(run), "--mesh.data", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "events.jsonl" in err and says in err, err
    assert tree_hashes(run) == before


@pytest.mark.parametrize("flags, says", [
    (["--model.qk-norm", "--guard", "--guard.escalate", "qk-clip"], "cannot take beside"),
    (["--optim.qk-clip", "50", "--guard", "--guard.escalate", "qk-norm"], "cannot take beside"),
    (["--model.qk-norm", "--guard", "--guard.escalate", "qk-norm"], "already has"),
    (["--optim.optimizer", "adamh", "--guard", "--guard.escalate", "qk-clip"],
     "cannot take beside --optim.optimizer adamh"),
    (["--model.attn-gate", "headwise", "--guard", "--guard.escalate", "attn-gate"],
     "already has"),
])
def test_an_escalation_the_run_could_not_carry_out_is_refused_before_it_starts(
        tmp_path, capsys, flags, says):
    assert T.main(["tiny", "--run-dir", str(tmp_path / "run"), "--mesh.data", "8", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and not (tmp_path / "run").exists(), err


# ---------------------------------------------------------------------------------------------
# warmstart.py

@pytest.mark.slow
def test_a_decayed_run_trains_on_by_the_warm_start_its_end_line_suggests(straight_run,
                                                                         tmp_path):
    """Its LR decayed over all its steps, a run cannot be resumed with more steps; its end line
    suggests warmstart.py --insert none instead, and that command, run as printed, trains on
    from the last step: every leaf carried, the LR there 0.1x the peak, re-warmed to the
    longer schedule, to the new last step."""
    import shlex
    src, _ = straight_run
    line = CF.train_on(src, src.steps)
    assert line.startswith("train on (its LR has decayed: re-warmed): python warmstart.py ")
    argv = shlex.split(line.split("python warmstart.py ", 1)[1])
    argv[argv.index("--to") + 1] = str(tmp_path / "longer")
    args, overrides = W.parse_args(argv)
    cfg = W.convert(args, overrides, devices=jax.devices()[:1])
    assert cfg.model == src.model and cfg.steps == 2 * src.steps
    old, new = leaves_by_key(restore_final(src, src.steps)), leaves_by_key(restore_final(cfg,
                                                                                        src.steps))
    assert old.keys() == new.keys() and all(np.array_equal(old[k], new[k]) for k in old)
    T.train(cfg, devices=jax.devices()[:1])
    m = RC.read_metrics(cfg.run_dir)
    assert m["step"][-1] == cfg.steps - 1
    lr = dict(zip(m["step"].tolist(), m["lr"].tolist()))
    peak, k = src.optim.lr, cfg.optim.rewarmup_steps
    assert lr[src.steps] == pytest.approx(0.1 * peak, rel=1e-5)
    want = float(O.lr_schedule(cfg.optim, cfg.steps)(src.steps + k))  # back on the schedule
    assert lr[src.steps + k] == pytest.approx(want, rel=1e-5) and want > 0.1 * peak


def leaves_by_key(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)}


@pytest.fixture(scope="session")
def warm_started(straight_run, tmp_path_factory):
    """The straight tiny run (1 device, no QK-Norm) converted at step 3 onto a 4x2 mesh."""
    src_cfg, _ = straight_run
    src = pathlib.Path(src_cfg.run_dir)
    before = tree_hashes(src)
    dst = tmp_path_factory.mktemp("warm") / "new"
    args = W.WarmStartArgs(source=str(src), to=str(dst), step=3, rewarmup_steps=4,
                           rewarmup_from_ratio=0.1, no_train=True)
    cfg = W.convert(args, ["--mesh.data", "4", "--mesh.model", "2", "--steps", "12"],
                    devices=jax.devices())
    return src_cfg, cfg, before


@pytest.mark.slow
@pytest.mark.parametrize("b2", [0.95, 0.999])
def test_the_new_scales_first_update_is_adams_with_zero_moments_under_the_carried_count(
        straight_run, b2):
    """The warm start's new q/k scales start with zero moments under the carried Adam count t,
    so their first update is (1 - b1) / (1 - b1^t) / sqrt((1 - b2) / (1 - b2^t)) x lr per
    element: at a late step (t -> inf) 0.45 lr at beta2 0.95, 3.2 lr at 0.999, instead of
    fresh Adam's 1 lr. Measured on what the step applies, at t = 7."""
    src, _ = straight_run
    cfg = dataclasses.replace(src, model=dataclasses.replace(src.model, qk_norm=True),
                              optim=dataclasses.replace(src.optim, b2=b2))
    state = restore_final(src, 6)
    mesh = mesh_of(1, 1)
    with jax.set_mesh(mesh):
        state = C.insert_new_leaves(cfg, CF.make_tx(cfg), state, mesh)
        tokens = D.TokenData(cfg.data).batch(6)
        new, _ = T.make_train_step(cfg, CF.make_tx(cfg))(state, jnp.asarray(tokens))
    lr = float(O.lr_schedule(cfg.optim, cfg.steps)(6))
    b1, t = cfg.optim.b1, 7
    want = (1 - b1) / (1 - b1 ** t) / np.sqrt((1 - b2) / (1 - b2 ** t))
    for name in ("q_norm", "k_norm"):
        step = np.abs(np.asarray(new["params"]["layers"][name]) - 1.0) / lr
        # m / (sqrt(v) + eps): `want` where |g| >> eps, less on the smallest gradients
        assert step.max() == pytest.approx(want, rel=1e-3) and np.all(step <= want * 1.0001)


def test_warmstart_carries_every_leaf_and_adds_only_the_norm_scales(warm_started):
    src_cfg, cfg, _ = warm_started
    assert cfg.model.qk_norm and cfg.optim.rewarmup_start == 3 and cfg.steps == 12
    old = leaves_by_key(restore_final(src_cfg, 3))
    new = leaves_by_key(restore_final(cfg, 3))
    added = set(new) - set(old)
    assert set(old) <= set(new)
    for key in old:  # params, Adam moments and count, skip/clip histories, step
        np.testing.assert_array_equal(new[key], old[key], err_msg=key)
    assert int(new["['step']"]) == 3
    scales = [k for k in added if k.endswith("['q_norm']") or k.endswith("['k_norm']")]
    assert len(scales) == len(added) and len(added) == 6  # param, mu, nu for each of q and k
    for key in scales:
        expected = 1.0 if key.startswith("['params']") else 0.0
        np.testing.assert_array_equal(new[key], expected, err_msg=key)


def test_warmstart_inserts_the_attention_gate_carrying_every_leaf(straight_run, tmp_path):
    """warmstart.py --insert attn-gate: the gate (Marin's form) and nothing else added, at 0
    with zero moments; every source leaf carried as it is; QK-Norm left off."""
    src_cfg, _ = straight_run
    args = W.WarmStartArgs(source=src_cfg.run_dir, to=str(tmp_path / "gated"), step=3,
                           insert="attn-gate", no_train=True)
    cfg = W.convert(args, ["--steps", "12"], devices=jax.devices()[:1])
    assert cfg.model.attn_gate == "headwise" and cfg.model.attn_gate_form == "marin"
    assert not cfg.model.qk_norm and cfg.optim.rewarmup_start == 3
    old = leaves_by_key(restore_final(src_cfg, 3))
    new = leaves_by_key(restore_final(cfg, 3))
    added = set(new) - set(old)
    assert len(added) == 3 and all("w_attn_gate" in k for k in added)  # param, mu, nu
    for key in old:
        np.testing.assert_array_equal(new[key], old[key], err_msg=key)
    for key in added:
        np.testing.assert_array_equal(new[key], 0.0, err_msg=key)


def test_a_switch_to_adamh_mid_run_takes_each_matrix_norm_at_the_switch(straight_run, tmp_path):
    """warmstart.py --insert none --optim.optimizer adamh: the Adam moments carried, and each
    matrix's radius is its norm at the switch (the source's checkpoint), not at a fresh init."""
    src_cfg, _ = straight_run
    args = W.WarmStartArgs(source=src_cfg.run_dir, to=str(tmp_path / "h"), step=3,
                           insert="none", no_train=True)
    cfg = W.convert(args, ["--steps", "12", "--optim.optimizer", "adamh"],
                    devices=jax.devices()[:1])
    old, new = restore_final(src_cfg, 3), restore_final(cfg, 3)
    (hyper,) = [s for s in jax.tree.leaves(new["opt_state"], is_leaf=lambda x: isinstance(
        x, HB.HyperballState)) if isinstance(s, HB.HyperballState)]
    radius, params = flat_params(hyper.radius), flat_params(old["params"])
    for k, on in flat_params(M.optimizer_layout(cfg.model)["decay_mask"]).items():
        np.testing.assert_allclose(radius[k], numpy_norm(params[k]) if on else 0.0, rtol=1e-6,
                                   err_msg=k)
    old_leaves, new_leaves = leaves_by_key(old), leaves_by_key(new)
    for key in old_leaves:  # every source leaf (the moments too) carried as it is
        np.testing.assert_array_equal(new_leaves[key], old_leaves[key], err_msg=key)


def test_a_switch_to_adamh_with_the_initial_radius_rescales_each_matrix_onto_it(
        straight_run, tmp_path):
    """--optim.hyperball-radius init: at the switch each matrix (per stacked layer) is rescaled
    onto its norm at init, which is its radius from then on; its direction and every other
    leaf (Adam's moments too) are the source's."""
    src_cfg, _ = straight_run
    args = W.WarmStartArgs(source=src_cfg.run_dir, to=str(tmp_path / "h"), step=3,
                           insert="none", no_train=True)
    cfg = W.convert(args, ["--steps", "12", "--optim.optimizer", "adamh",
                           "--optim.hyperball-radius", "init"], devices=jax.devices()[:1])
    old, new = restore_final(src_cfg, 3), restore_final(cfg, 3)
    (hyper,) = [s for s in jax.tree.leaves(new["opt_state"], is_leaf=lambda x: isinstance(
        x, HB.HyperballState)) if isinstance(s, HB.HyperballState)]
    init = flat_params(M.init_params(cfg.model, jax.random.key(cfg.seed)))
    radius, before, after = (flat_params(t) for t in (hyper.radius, old["params"],
                                                      new["params"]))
    for k, on in flat_params(M.optimizer_layout(cfg.model)["sphere_mask"]).items():
        if not on:
            np.testing.assert_array_equal(after[k], before[k], err_msg=k)
            continue
        np.testing.assert_allclose(radius[k], numpy_norm(init[k]), rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(numpy_norm(after[k]), numpy_norm(init[k]), rtol=1e-5)
        scale = per_layer(numpy_norm(after[k]) / numpy_norm(before[k]), before[k])
        np.testing.assert_allclose(after[k], before[k] * scale, rtol=1e-5, atol=1e-8)
    assert not np.allclose(numpy_norm(before["head"]), numpy_norm(init["head"]), rtol=1e-3)
    with pytest.raises(ValueError, match="add --optim.optimizer adamh or muonh"):
        O.OptimConfig(hyperball_radius="init")


def wandb_records(run_dir: pathlib.Path, wait_s: float = 60.0) -> list:
    """The records of a run's offline W&B files, read once the exit record is there: W&B's
    writer is another process and may still be writing after `finish` returns (seen once in a
    suite run on a loaded machine: no run record yet, all there a minute later)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = read_wandb_files(run_dir)
        if (any(r.WhichOneof("record_type") == "exit" for r in records)
                or time.monotonic() > deadline):
            return records
        time.sleep(0.5)


def read_wandb_files(run_dir: pathlib.Path) -> list:
    """The records in a run's offline W&B files (LevelDB-log framing of protobuf records)."""
    import struct

    from wandb.proto import wandb_internal_pb2
    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunk = path.read_bytes(), 7, b""  # after the 7-byte ":W&B" header
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                break
            chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # a full record, or the last piece of one
                records.append(wandb_internal_pb2.Record.FromString(chunk))
                chunk = b""
    return records


@pytest.mark.slow
def test_a_warm_started_run_rewarms_and_learns(warm_started, tmp_path):
    src_cfg, cfg, _ = warm_started
    shutil.copytree(cfg.run_dir, tmp_path / "new")  # trained on here: the fixture's run stays
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "new"))  # as converted for the others
    tracked = dataclasses.replace(cfg, wandb=TR.WandbConfig(project="spikefix-tests",
                                                            mode="offline"))
    last = T.train(tracked, devices=jax.devices()).last  # on the 4x2 mesh it was converted onto
    lines = [json.loads(x) for x in (pathlib.Path(cfg.run_dir) / "metrics.jsonl").open()]
    # W&B (offline) got what metrics.jsonl got, the config and the tag of a warm start
    records = wandb_records(pathlib.Path(cfg.run_dir))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert "warm-start" in run.tags and f"from {src_cfg.run_dir}@3"[-64:] in run.tags
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["warm_started_from"] == f"{src_cfg.run_dir}@3" == cfg.warm_started_from
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    steps = [h for h in history if "loss" in h]
    assert [h["_step"] for h in steps] == [m["step"] for m in lines] == list(range(3, 12))
    assert [h["loss"] for h in steps] == [m["loss"] for m in lines]
    assert [h["attn_logit_max/layer_1"] for h in steps] == [m["attn_logit_max"][1] for m in lines]
    assert any(k.startswith("figures/") for h in history for k in h)
    summary = [u for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update]
    assert any(u.key == "spike_report" and "loss spike" in u.value_json for u in summary)
    assert [m["step"] for m in lines] == list(range(3, 12))
    base = O.lr_schedule(src_cfg.optim, 12)  # the source's schedule stretched to 12 steps
    peak = cfg.optim.lr
    for m in lines:
        s = m["step"]
        t = min((s - 3) / 4, 1.0)
        expected = 0.1 * peak + (float(base(s)) - 0.1 * peak) * t
        assert m["lr"] == pytest.approx(expected, rel=1e-5), s
    assert all(np.isfinite(m["loss"]) for m in lines)
    assert np.mean([m["loss"] for m in lines[-3:]]) < lines[0]["loss"]
    assert max(lines[-1]["attn_logit_max"]) <= np.sqrt(cfg.model.head_dim) + 1e-3
    # ... and back: the 4x2-written checkpoint resumes on one device
    more = dataclasses.replace(cfg, steps=14, mesh=CF.MeshConfig(1, 1))
    with pytest.raises(UserError, match="steps"):  # a longer run is a different config
        T.train(more, devices=jax.devices()[:1])
    on_4x2 = restore_final(cfg, 12)
    one = dataclasses.replace(cfg, mesh=CF.MeshConfig(1, 1), resume_step=9)
    assert T.train(one, devices=jax.devices()[:1]).last["step"] == 11 == last["step"]
    for a, b in zip(jax.tree.leaves(on_4x2), jax.tree.leaves(restore_final(cfg, 12))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3)


def test_warmstart_leaves_the_source_untouched(warm_started):
    src_cfg, _, before = warm_started
    assert tree_hashes(pathlib.Path(src_cfg.run_dir)) == before


@pytest.mark.parametrize("case,message", [
    ("missing", "no config.json"),
    ("no_checkpoint", "has no checkpoint"),
    ("has_qk_norm", "already has QK-Norm"),
    ("dst_not_empty", "exists and is not empty"),
    ("bad_step", "no checkpoint at step 5; it has [3, 6]"),
    ("shape_change", "in the source but"),
    ("to_inside_from", "lies inside --from"),
    ("steps_not_beyond", "--steps 6 does not go beyond the checkpoint's step 6"),
    ("another_warm_start", "rewarmup_steps (run has 1000, flags give 7)"),
])
def test_warmstart_refuses_a_bad_source_in_one_line(case, message, straight_run, tmp_path, capsys):
    src_cfg, _ = straight_run
    src, dst = src_cfg.run_dir, tmp_path / "dst"
    extra = ["--mesh.data", "8"] + ([] if case == "steps_not_beyond" else ["--steps", "12"])
    if case == "missing":
        src = str(tmp_path / "nope")
    elif case == "no_checkpoint":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(
            (pathlib.Path(src) / "config.json").read_text())
        src = str(tmp_path / "empty")
    elif case == "has_qk_norm":
        d = dataclasses.asdict(src_cfg)
        d["model"]["qk_norm"] = True
        (tmp_path / "qk").mkdir()
        (tmp_path / "qk" / "config.json").write_text(json.dumps(d))
        src = str(tmp_path / "qk")
    elif case == "dst_not_empty":
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
    elif case == "bad_step":
        extra += ["--step", "5"]
    elif case == "shape_change":
        extra += ["--model.d-ff", "256"]
    elif case == "to_inside_from":
        dst = pathlib.Path(src) / "rescued"
    elif case == "another_warm_start":  # --to holds a warm start made with other flags
        shutil.copytree(src, dst)
        stored = json.loads((dst / "config.json").read_text())
        stored["optim"] |= {"rewarmup_start": 6, "rewarmup_steps": 1000}
        stored["model"]["qk_norm"], stored["steps"], stored["run_dir"] = True, 12, str(dst)
        (dst / "config.json").write_text(json.dumps(stored))
        extra += ["--rewarmup-steps", "7"]
    before = tree_hashes(tmp_path)
    code = W.main(["--from", src, "--to", str(dst), "--no-train"] + extra)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert tree_hashes(tmp_path) == before


@pytest.mark.slow
def test_the_same_warmstart_command_resumes_after_a_kill(straight_run, tmp_path):
    cmd = [sys.executable, "-u", "warmstart.py", "--from", straight_run[0].run_dir, "--to",
           str(tmp_path / "new"), "--steps", "100", "--rewarmup-steps", "4",
           "--checkpoint-every", "4", "--log-every", "1"]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_step(proc, 11)  # converted at step 6, trained on past the checkpoint at 8
    finally:
        proc.kill()
    proc.wait()
    killed_at = C.saved_steps(tmp_path / "new")[-1]
    again = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert killed_at >= 8 and "already holds this warm start" in again.stdout
    assert f"resumed {tmp_path / 'new'} at step {killed_at}" in again.stdout
    assert "done: step 100" in again.stdout  # train.py's end line: unit, checkpoint, next
    assert "nats/byte" in again.stdout and "checkpoint step 100 in" in again.stdout
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "is done (step 100 of 100)" in done.stdout, done.stderr


@pytest.mark.slow
def test_a_conversion_killed_mid_save_leaves_no_run_behind(straight_run, tmp_path, monkeypatch):
    src, dst = straight_run[0].run_dir, tmp_path / "new"
    argv = ["--from", src, "--to", str(dst), "--steps", "12", "--no-train", "--mesh.data", "8"]

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if SIGKILL arrived while the checkpoint was written
    with monkeypatch.context() as m:
        m.setattr(C, "save_checkpoint", killed)
        with pytest.raises(KeyboardInterrupt):
            W.main(argv)
    assert not dst.exists() and (tmp_path / "new.converting" / "config.json").exists()
    with pytest.raises(UserError, match="no config.json"):  # nothing to start fresh from
        W.load_source(dst, None)
    assert W.main(argv) == 0  # the same command again converts from scratch
    assert C.saved_steps(dst) == [6] and not (tmp_path / "new.converting").exists()


@pytest.fixture(scope="session")
def high_lr_runs(tmp_path_factory):
    """tiny at LR 3e-2 for 100 steps, without and with QK-Norm."""
    runs = {}
    for qk in (False, True):
        cfg = tiny(tmp_path_factory.mktemp(f"qk{qk}"), model__qk_norm=qk, optim__lr=3e-2,
                   steps=100, eval_every=100, checkpoint_every=50, log_every=50)
        T.train(cfg, devices=jax.devices()[:1])
        runs[qk] = (cfg, RC.read_metrics(cfg.run_dir))
    return runs


@pytest.mark.slow
def test_qk_norm_keeps_attention_logits_10x_smaller_at_high_lr(high_lr_runs):
    without = high_lr_runs[False][1]["attn_logit_max"][-10:].max()
    with_qk = high_lr_runs[True][1]["attn_logit_max"][-10:].max()
    assert without >= 10 * with_qk, (without, with_qk)


@pytest.mark.slow
def test_inserting_qk_norm_drops_the_logits_10x_at_once(high_lr_runs, tmp_path):
    src, m = high_lr_runs[False]
    args = W.WarmStartArgs(source=src.run_dir, to=str(tmp_path / "rescued"), step=100,
                           rewarmup_steps=10)
    cfg = W.convert(args, ["--steps", "105"], devices=jax.devices()[:1])
    T.train(cfg, devices=jax.devices()[:1])
    after = RC.read_metrics(tmp_path / "rescued")
    before = m["attn_logit_max"][-1].max()
    assert after["step"][0] == 100 and len(after["step"]) == 5
    assert after["attn_logit_max"].max() * 10 <= before, (before, after["attn_logit_max"])


def strict_lines(path: pathlib.Path) -> list[dict]:
    """metrics.jsonl read by a strict JSON parser: NaN / Infinity tokens are refused."""
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.open()]


def applied_lrs(cfg, steps) -> dict:
    """step -> the learning rate the parameters actually moved by at that step: |dparams|
    between the checkpoints around it, over the norm of the update before the LR (after
    clipping), which the optimizer computed; 0 where nothing was applied."""
    lines = {m["step"]: m for m in strict_lines(pathlib.Path(cfg.run_dir) / "metrics.jsonl")}
    out = {}
    for s in steps:
        a, b = restore_final(cfg, s)["params"], restore_final(cfg, s + 1)["params"]
        moved = float(optax.tree.norm(jax.tree.map(lambda x, y: y - x, a, b)))
        update = lines[s]["update_norm_clipped"]
        out[s] = moved / update if update else moved
    return out


@pytest.mark.slow
def test_the_lr_applied_follows_the_global_step_through_skips_and_a_warm_start(
        tmp_path, monkeypatch):
    """The mission's path: a source run skips 4 of its first 8 steps (non-finite batches), is
    warm-started with QK-Norm at step 8 and skips again at step 10. Every applied step moves
    the parameters by schedule(global step), in the source and through the re-warmup, as the
    logged lr says; a skipped step moves nothing and logs update norms of 0."""
    poisoned = {1, 3, 5, 6, 10}
    poison_batches(monkeypatch, poisoned)
    src = tiny(tmp_path, optim__skip_step=True, steps=12, checkpoint_every=1,
               keep_checkpoints=20)
    T.train(src, devices=jax.devices()[:1])
    args = W.WarmStartArgs(source=src.run_dir, to=str(tmp_path / "warm"), step=8,
                           rewarmup_steps=4, rewarmup_from_ratio=0.1)
    cfg = W.convert(args, ["--steps", "14", "--checkpoint-every", "1", "--keep-checkpoints",
                           "20"], devices=jax.devices()[:1])
    T.train(cfg, devices=jax.devices()[:1])
    for run, steps in ((src, range(1, 8)), (cfg, range(8, 14))):
        schedule = O.lr_schedule(run.optim, run.steps)
        lines = {m["step"]: m for m in strict_lines(pathlib.Path(run.run_dir) / "metrics.jsonl")}
        for s, lr in applied_lrs(run, steps).items():
            if s in poisoned:
                assert lr == 0 and lines[s]["skipped"] == 1, s
                assert lines[s]["update_norm"] == 0 == lines[s]["update_norm_clipped"], s
                assert lines[s]["loss"] is None  # non-finite: written null
            else:
                assert lr == pytest.approx(float(schedule(s)), rel=1e-3), s
                assert lines[s]["lr"] == pytest.approx(float(schedule(s)), rel=1e-6), s
    # the re-warmup really starts from 0.1 x peak at the warm-start step
    assert applied_lrs(cfg, [8])[8] == pytest.approx(0.1 * cfg.optim.lr, rel=1e-3)


def test_warmstart_never_removes_a_converting_folder_it_did_not_write(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "checkpoints" / "4").mkdir(parents=True)
    C.write_config(src, dataclasses.asdict(tiny(tmp_path)))
    mine = tmp_path / "new.converting"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    assert W.main(["--from", str(src), "--to", str(tmp_path / "new"), "--no-train"]) == 2
    assert "not written by warmstart.py" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "a user's file"


# ---------------------------------------------------------------------------------------------
# hf.py and export.py: Hugging Face folders out and in

def hf_numpy_logits(folder: pathlib.Path, tokens_T: np.ndarray) -> np.ndarray:
    """Logits [T, V] of a Hugging Face Llama / Qwen3 folder, computed in float64 NumPy from its
    config.json and safetensors alone, the way transformers' modelling code computes them
    (rotate-half RoPE, repeat_kv, RMSNorm, untied lm_head), independent of model.py."""
    from safetensors.numpy import load_file
    hf = json.loads((folder / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(folder / "model.safetensors").items()}
    N, K, H, eps = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
                    hf["rms_norm_eps"])
    T = len(tokens_T)

    def norm(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale

    def rope(x):  # [T, heads, H]
        angle = np.arange(T)[:, None] * hf["rope_theta"] ** (-np.arange(0, H, 2) / H)[None]
        cos, sin = (np.concatenate([f(angle)] * 2, -1)[:, None] for f in (np.cos, np.sin))
        return x * cos + np.concatenate([-x[..., H // 2:], x[..., :H // 2]], -1) * sin

    x = w["model.embed_tokens.weight"][tokens_T]
    for layer in range(hf["num_hidden_layers"]):
        a = f"model.layers.{layer}."
        h = norm(x, w[a + "input_layernorm.weight"])
        q, k, v = ((h @ w[a + f"self_attn.{n}_proj.weight"].T).reshape(T, -1, H) for n in "qkv")
        if hf["architectures"] == ["Qwen3ForCausalLM"]:
            q = norm(q, w[a + "self_attn.q_norm.weight"])
            k = norm(k, w[a + "self_attn.k_norm.weight"])
        q, k = rope(q), np.repeat(rope(k), N // K, axis=1)
        scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("nts,snh->tnh", probs, np.repeat(v, N // K, axis=1)).reshape(T, N * H)
        x = x + out @ w[a + "self_attn.o_proj.weight"].T
        h = norm(x, w[a + "post_attention_layernorm.weight"])
        gate, up = (h @ w[a + f"mlp.{n}_proj.weight"].T for n in ("gate", "up"))
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[a + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_an_exported_folder_computes_the_logits_of_model_forward(arch, straight_run, warm_started,
                                                                  tmp_path, capsys):
    cfg = straight_run[0] if arch == "LlamaForCausalLM" else warm_started[1]
    step = C.saved_steps(pathlib.Path(cfg.run_dir))[-1]
    assert E.main([cfg.run_dir, "--step", str(step), "--to", str(tmp_path / "hf")]) == 0
    assert f"{arch}, " in capsys.readouterr().out
    from safetensors.numpy import load_file
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    per_layer = 11 if cfg.model.qk_norm else 9
    assert len(tensors) == 3 + per_layer * cfg.model.n_layers
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (
        cfg.model.n_kv_heads * cfg.model.head_dim, cfg.model.d_model)
    params = jax.tree.map(np.asarray, restore_final(cfg, step)["params"])
    assert_trees_equal(HF.from_hf(tensors, cfg.model), params)  # and back, exactly
    tokens = D.TokenData(cfg.data).held_out_batches()[0, 0, :-1]
    with jax.set_mesh(mesh_of(1, 1)):
        ours = np.asarray(M.forward(params, tokens[None], cfg.model)[0][0])
    theirs = hf_numpy_logits(tmp_path / "hf", tokens)
    np.testing.assert_allclose(theirs, ours, atol=1e-4 * np.abs(ours).max())


def test_export_check_without_torch_says_so_before_writing_anything(straight_run, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a machine without it
    out = tmp_path / "hf"
    assert E.main([straight_run[0].run_dir, "--to", str(out), "--check"]) == 2
    assert "requirements-check.txt (nothing was written)" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_a_run_initialised_from_a_hf_folder_starts_from_its_weights(straight_run, tmp_path,
                                                                    capsys):
    src, hf = straight_run[0], tmp_path / "hf"
    E.export(E.ExportArgs(run=src.run_dir, to=str(hf)))  # step 6
    hf_cfg = json.loads((hf / "config.json").read_text())
    del hf_cfg["rope_theta"]  # as transformers 5 saves a config: under rope_parameters only
    (hf / "config.json").write_text(json.dumps(hf_cfg))
    cfg = tiny(tmp_path, steps=1, init_from_hf=str(hf))
    capsys.readouterr()
    T.train(cfg, devices=jax.devices()[:1])
    assert f"parameters from the Hugging Face folder {hf}" in capsys.readouterr().out
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    with jax.set_mesh(mesh_of(1, 1)):  # the loss of batch 0 under the exported weights
        loss, _ = M.loss_fn(restore_final(src, 6)["params"], D.TokenData(cfg.data).batch(0),
                            cfg.model)
    assert first["loss"] == pytest.approx(float(loss), rel=1e-6)
    assert C.read_config(tmp_path / "run")["init_from_hf"] == str(hf)


# ---------------------------------------------------------------------------------------------
# bench/peer.py: the eager torch step the benchmark sets beside train.py's

@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_torch_peer_is_the_same_model_and_optimizer(qk_norm, tiny_tokens):
    """bench/peer.py's eager torch, from the same initial parameters: the loss and every
    gradient of model.loss_fn to float rounding, and after one step of its AdamW (clipped, at
    optim.lr_schedule's LR) the parameters of the optimizer make_tx builds, the spike levers
    off. Skipped where torch is not installed (bench/peer.py says how)."""
    torch = pytest.importorskip("torch")
    from bench import peer
    cfg = tiny(**{"model__qk_norm": qk_norm, "model__scan_layers": True,  # a clip that acts,
                  "optim__max_grad_norm": 1e-3, "optim__weight_decay": 0.5})  # a decay to see
    params = M.init_params(cfg.model, jax.random.key(cfg.seed))
    with jax.set_mesh(mesh_of(1, 1)):
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: M.loss_fn(p, tiny_tokens, cfg.model)[0]))(params)
    p = peer.torch_params(params)
    tloss = peer.loss_fn(p, torch.from_numpy(tiny_tokens.astype(np.int64)), cfg.model)
    tloss.backward()
    assert tloss.item() == pytest.approx(float(loss), rel=1e-6)
    flat = peer.torch_params(grads)
    for k, g in flat.items():
        np.testing.assert_allclose(p[k].grad.numpy(), g.detach().numpy(), rtol=2e-4,
                                   atol=1e-7, err_msg=k)
    opt, lrs = peer.optimizer(p, cfg, cfg.steps)
    for group in opt.param_groups:
        group["lr"] = float(lrs[0])
    torch.nn.utils.clip_grad_norm_(list(p.values()), cfg.optim.clip_norm)
    opt.step()
    tx = CF.make_tx(cfg)
    new = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(  # as the train step
        g, s, p, step=jnp.zeros((), jnp.int32), loss=loss)[0]))(grads, tx.init(params), params)
    for k, x in peer.torch_params(new).items():
        # (Adam's first step divides by |g|: a gradient near 0 moves by float rounding x LR)
        np.testing.assert_allclose(p[k].detach().numpy(), x.detach().numpy(), rtol=1e-5,
                                   atol=lrs[0] * 5e-4, err_msg=k)


# ---------------------------------------------------------------------------------------------
# sample.py: text from a checkpoint

def test_greedy_sampling_is_deterministic_and_starts_with_the_forward_argmax(straight_run,
                                                                             capsys):
    cfg = straight_run[0]
    argv = [cfg.run_dir, "--prompt", "def spike", "--max-new-tokens", "40", "--temperature", "0"]
    assert S.main(argv) == 0 and S.main(argv) == 0
    out = capsys.readouterr()
    first, second = out.out.split("def spike")[1:]
    assert first == second and "tokens/s" in out.err  # deterministic
    params = restore_final(cfg, 6)["params"]
    prompt = np.frombuffer(b"def spike", np.uint8).astype(np.int32)[None]
    with jax.set_mesh(mesh_of(1, 1)):
        argmax = int(np.argmax(M.forward(params, prompt, cfg.model)[0][0, -1]))
    ids, _ = S.generate(jax.tree.map(np.asarray, params), cfg.model, prompt[0].tolist(),
                        S.SampleArgs(run="", max_new_tokens=5, temperature=0))
    assert ids[0] == argmax
    sampled = S.generate(jax.tree.map(np.asarray, params), cfg.model, prompt[0].tolist(),
                         S.SampleArgs(run="", max_new_tokens=5, temperature=1.0, top_k=3))[0]
    assert len(sampled) == 5


# ---------------------------------------------------------------------------------------------
# report.py

def planted_metrics(path: pathlib.Path) -> pathlib.Path:
    """A metrics.jsonl with two planted loss spikes: at step 120 (update-norm spike 3 steps
    earlier; back at the pre-spike level 3 steps later) and at step 200 (no update spike; the
    loss settles 0.5 higher and never comes back)."""
    steps = np.arange(300)
    loss = 2.0 + 0.01 * np.where(steps % 2, 1.0, -1.0)  # mean exactly 2.0 over any even window
    loss[120:123] = [3.0, 2.6, 2.3]
    loss[123] = 1.99
    loss[200:] += 0.5
    update = 1.0 + 0.02 * np.where(steps % 2, 1.0, -1.0)
    update[117] = 5.0
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in steps:
            f.write(json.dumps({"step": int(s), "loss": loss[s], "update_norm": update[s],
                                "grad_norm": 1.0, "lr": 1e-3, "skipped": 0,
                                "attn_logit_max": [1.0, 2.0]}) + "\n")
        f.write('{"step": 300, "lo')  # a record cut off by a crash mid-write is ignored
    return path


def test_the_spike_report_finds_planted_spikes(tmp_path):
    spikes = R.find_spikes(RC.read_metrics(planted_metrics(tmp_path / "run")))
    assert [s.step for s in spikes] == [120, 200]
    first, second = spikes
    assert first.peak_step == 120 and first.length == 3
    assert first.height == pytest.approx(1.0) and first.pre_level == pytest.approx(2.0)
    assert first.update_lead == 3 and first.recovered_after == 3
    assert second.update_lead is None and second.recovered_after is None
    table = R.spike_table(spikes)
    assert "3 steps" in table and "never" in table


def test_a_nan_in_the_first_steps_is_no_spike_and_moves_no_level(tmp_path, capsys):
    run = planted_metrics(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    for i in range(3):  # steps 0-2 diverged (written null, as train.py writes a NaN)
        lines[i] = lines[i].replace(json.dumps(json.loads(lines[i])["loss"]), "null", 1)
    (run / "metrics.jsonl").write_text("\n".join(lines))
    m = RC.read_metrics(run)
    assert np.isnan(m["loss"][:3]).all() and "metrics.jsonl:301 is cut off" in \
        capsys.readouterr().err
    spikes = R.find_spikes(m)
    assert [s.step for s in spikes] == [120, 200] and spikes[0].pre_level == pytest.approx(2.0)
    assert R.main([str(run)]) == 0 and "2 loss spikes" in capsys.readouterr().out


def test_the_olmo_2_spike_score_counts_the_planted_spikes():
    rng = np.random.default_rng(0)
    x = 3 + 0.1 * rng.standard_normal(3000)
    x[[1200, 1500, 2000, 2500]] += 5.0  # 50 sigma
    x[2700] = np.nan  # non-finite: a spike, kept out of the history
    # 7 sigma over the previous 1,000 (the paper): 5 of the 2,000 steps with a full history
    assert R.spike_score(x, 1000, 7.0) == pytest.approx(5 / 2000)
    assert R.spike_score(x[:1000], 1000, 7.0) != R.spike_score(x[:1000], 1000, 7.0)  # NaN

    def brute(x, window, sigma):  # the rule restated, one step at a time
        hits = scored = 0
        finite = []  # the finite values before this step
        for v in x:
            prev = finite[-window:]
            if len(prev) == window:
                scored += 1
                hits += not np.isfinite(v) or v > np.mean(prev) + sigma * np.std(prev, ddof=1)
            if np.isfinite(v):
                finite.append(v)
        return hits / scored
    y = x[:700].copy()
    y[[300, 302, 310]] += [1.0, 2.0, 0.5]  # spikes close together: each raises the next's bar
    assert R.spike_score(y, 128, 6.0) == pytest.approx(brute(y, 128, 6.0))
    scores = R.summary({"step": np.arange(3000.0), "loss": x, "eval_loss": np.array([]),
                        "grad_norm": np.ones(3000)})
    assert scores["spike_score_loss_7s1000"] == pytest.approx(5 / 2000)
    assert scores["spike_score_grad_norm_6s128"] == 0.0
    # OLMo-core's logged score: one rate, a step counting if its loss OR its grad norm spikes
    g = 1 + 0.1 * rng.standard_normal(3000)
    g[[1200, 1700]] += 5.0  # one step shared with the loss, one its own
    whole, last = R.either_spike_rate(x, g, 128, 6.0, last=1000)
    both = brute(x, 128, 6.0) * (3000 - 128), brute(g, 128, 6.0) * (3000 - 128)
    assert round(whole * (3000 - 128)) == round(both[0]) + round(both[1]) - 1  # 1200 once
    assert last == pytest.approx(3 / 1000)  # 2000, 2500 and 2700: the last 1,000 steps
    assert R.spike_scores({"loss": x, "grad_norm": g})["spike_score_olmo_core_6s128"] == \
        R.olmo_core_spike_score(x, g)[0]


def test_olmo_cores_spike_score_gives_its_own_tests_numbers():
    """allenai/OLMo-core's stability_monitor_test.py, its cases as facts: window 5, 2 sigma,
    rolling window 5."""
    loss, grad = [1.0 + i * 0.1 for i in range(5)], [0.5 + i * 0.01 for i in range(5)]
    assert R.olmo_core_spike_score(loss, grad, 5, 2.0, rolling=5) == (0.0, 0.0)
    loss, grad = loss + [100.0], grad + [0.5]  # a loss spike: 1 of 6 steps
    assert R.olmo_core_spike_score(loss, grad, 5, 2.0, 5)[0] == pytest.approx(1 / 6)
    loss, grad = loss + [1.0], grad + [100.0]  # a grad-norm spike: 2 of 7
    assert R.olmo_core_spike_score(loss, grad, 5, 2.0, 5)[0] == pytest.approx(2 / 7)
    # a loss alone (test_checkpoint_persistence): 1 spike in 6 steps
    assert R.olmo_core_spike_score(loss[:6], None, 5, 2.0, 5)[0] == pytest.approx(1 / 6)
    # identical values (test_identical_values_no_crash): std 0, no spike in 10 steps
    assert R.olmo_core_spike_score([1.0] * 10, [0.5] * 10, 5, 2.0, 5) == (0.0, 0.0)
    # where spikefix's own rate differs: Bessel's std and the steps scored for both
    assert R.either_spike_rate(loss, grad, 5, 2.0)[0] == 1.0  # both of the 2 steps it scores


def test_report_draws_figures_that_are_not_blank(tmp_path, capsys):
    run = planted_metrics(tmp_path / "run")
    assert R.main([str(run), str(run), "--plot", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert "2 loss spikes in run" in out
    import matplotlib.image
    for name in ("overview.png", "attn_logits.png"):
        pixels = matplotlib.image.imread(tmp_path / "fig" / name)  # fails on a non-PNG
        assert min(pixels.shape[:2]) > 200 and pixels[..., :3].std() > 0.05  # not blank
    # the loss axis says per what: the run's data, from its config.json
    assert R.run_unit(run) == ""  # (no config.json: the axis says nats)
    (run / "config.json").write_text(json.dumps({"data": {"source": ""}}))
    assert R.run_unit(run) == "byte"  # the embedded text
    (tmp_path / "shards").mkdir()
    llmc_shard(tmp_path / "shards" / "x_train_000000.bin", np.arange(100))
    (run / "config.json").write_text(json.dumps({"data": {"source": str(tmp_path / "shards")}}))
    assert R.run_unit(run) == "token"


def test_the_figure_shades_each_level_shift_over_the_span_report_finds(tmp_path, monkeypatch):
    """A planted level shift (loss 2.0, 3.0 over steps 300-449, 2.0 after) and one that lasts
    to the end: each is one shaded band from report.py's start of it to where it is back (or to
    the run's end), the span the rule finds, drawn in the run's colour."""
    steps = np.arange(600)
    planted = {"back": np.where((steps >= 300) & (steps < 450), 3.0, 2.0),
               "stays": np.where(steps >= 400, 3.0, 2.0)}
    drawn = []
    real = matplotlib_axes().axvspan
    monkeypatch.setattr(matplotlib_axes(), "axvspan",
                        lambda ax, a, b, **kw: drawn.append((a, b)) or real(ax, a, b, **kw))
    for name, loss in planted.items():
        m = {"step": steps, "loss": loss, "grad_norm": np.ones(600), "lr": np.full(600, 0.1),
             "attn_logit_max": np.ones((600, 1)), "eval_step": [], "eval_loss": []}
        (shift,) = R.find_shifts(m)
        end = 599 if shift.recovered_after is None else shift.step + shift.recovered_after
        assert R.shift_spans(m) == [(shift.step, end)]
        assert (name == "back") == (end < 599) and 300 <= shift.step <= 420
        drawn.clear()
        R.plot({name: m}, tmp_path / name)
        assert drawn == [(shift.step, end)]


def planted_log_loss(n: int = 600) -> np.ndarray:
    """A loss with noise, a level shift from step 300 on, and a one-step spike at step 150."""
    loss = 2.0 + 0.01 * np.random.default_rng(0).standard_normal(n)
    loss[300:] += 1.0
    loss[150] += 2.0
    return loss


def test_report_reads_other_trainers_logs_and_finds_the_planted_events(tmp_path, capsys):
    """report.py FILE: a W&B CSV export (its run-name prefix, blank cells, __MIN / __MAX
    columns), a TensorBoard scalar export, nanoGPT's printed lines and JSON lines all give the
    planted level shift (from step 300) and the spike (150) the rules find in the loss itself;
    columns it cannot guess are named by flags; the figures draw them."""
    loss = planted_log_loss()
    want = (R.find_shifts({"step": np.arange(600), "loss": loss})[0].step, 150)
    rows = [(t, f"{x:.6f}") for t, x in enumerate(loss)]
    logs = {
        "wandb.csv": "Step,my-run - train/loss,my-run - train/loss__MIN,my-run - grad_norm\n"
                     + "".join(f"{t},{x},{x},{1.0 if t % 2 else ''}\n" for t, x in rows),
        "tb.csv": "Wall time,Step,Value\n" + "".join(f"1.0,{t},{x}\n" for t, x in rows),
        "nanogpt.log": "step 0: train loss 5.5, val loss 5.5\n" + "".join(
            f"iter {t}: loss {x}, time 12.34ms, mfu 1.23%\n" for t, x in rows),
        "levanter.jsonl": "".join(json.dumps({"_step": t, "train/loss": float(x)}) + "\n"
                                  for t, x in rows),
        "custom.csv": "it,objective\n" + "".join(f"{t},{x}\n" for t, x in rows)}
    for name, text in logs.items():
        (tmp_path / name).write_text(text)
        m = RC.read_log(tmp_path / name, *(("it", "objective") if name == "custom.csv" else ()))
        np.testing.assert_allclose(m["loss"], np.round(loss, 6), err_msg=name)
        assert R.find_shifts(m)[0].step == want[0] and want[1] in [
            x.step for x in R.find_spikes(m)], name
    assert R.main([str(tmp_path / "wandb.csv"), "--plot", str(tmp_path / "fig")]) == 0
    out = capsys.readouterr().out
    assert f"{want[0]:>7}" in out and "overview.png" in out
    assert R.main([str(tmp_path / "custom.csv"), "--step-column", "it", "--loss-column",
                   "objective"]) == 0
    capsys.readouterr()
    bad = {"empty.csv": ("", "is empty"),
           "nostep.csv": ("when,loss\n1,2.0\n", "no step column found"),
           "text.csv": ("step,loss\n0,2.0\n1,high\n", "text.csv:3: loss is 'high'"),
           "half.csv": ("step,loss\n0.5,2.0\n", "step 0.5 is not a step number")}
    for name, (text, says) in bad.items():
        (tmp_path / name).write_text(text)
        assert R.main([str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and name in err, err


def matplotlib_axes():
    import matplotlib.axes
    return matplotlib.axes.Axes


def test_a_warm_started_runs_figure_splices_its_source_before_the_insertion(tmp_path):
    """report.py --plot on a warm start draws its source's steps and held-out losses before the
    insertion step (config.json's warm_started_from), the warm start's own from it on."""
    def write(run, steps, loss, evals, config):
        run.mkdir()
        (run / "config.json").write_text(json.dumps(config))
        (run / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "loss": loss + s, "grad_norm": 1.0, "lr": 0.1, "attn_logit_max": [2.0]}
            | ({"eval_loss": loss - s} if s in evals else {})) + "\n" for s in steps))
    write(tmp_path / "src", range(10), 100.0, {3, 7}, {})
    write(tmp_path / "warm", range(5, 10), 200.0, {7}, {"warm_started_from":
                                                        f"{tmp_path / 'src'}@5"})
    m = R.with_source(tmp_path / "warm", RC.read_metrics(tmp_path / "warm"))
    assert m["inserted_at"] == 5 and list(m["step"]) == list(range(10))
    assert list(m["loss"]) == [100.0 + s for s in range(5)] + [200.0 + s for s in range(5, 10)]
    assert list(m["eval_step"]) == [3, 7] and list(m["eval_loss"]) == [97.0, 193.0]
    plain = RC.read_metrics(tmp_path / "src")  # no warm start: the run as it is
    assert R.with_source(tmp_path / "src", plain) is plain


def test_a_restore_is_not_a_rise(tmp_path):
    """Marin's "a restore is not a rise" (PR #8568): a run rolled back from its bad path to step
    50 and stopped at 79, before the replay passed the bad path's end (99): its report, and the
    guard resuming it, read the replayed attempt alone. Mixed, the bad path's steps 80-99 would
    read as a level shift from step 80."""
    run = tmp_path / "run"
    run.mkdir()
    good = lambda s: 2.0 + 0.01 * (-1) ** s
    attempts = [[(s, good(s) + (1.0 if s >= 60 else 0.0)) for s in range(100)],  # the bad path
                [(s, good(s)) for s in range(50, 80)]]  # the replay after the rollback to 50
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": x, "grad_norm": 1.0, "lr": 1e-3, "attn_logit_max": [1.0]}) + "\n"
        for attempt in attempts for s, x in attempt))
    m = RC.read_metrics(run)
    assert list(m["step"]) == list(range(80)) and not R.find_shifts(m, R.ShiftRule(window=40))
    mixed = {"step": np.arange(100), "loss": np.array(
        [good(s) for s in range(80)] + [good(s) + 1.0 for s in range(80, 100)])}
    (shift,) = R.find_shifts(mixed, R.ShiftRule(window=40, hold=10))
    assert 80 <= shift.step < 80 + R.ShiftRule().smooth  # (the smoothed loss lags the rise)
    seen, _ = G.history_before(run, 80, 1)  # the guard resuming at 80 sees the replay's losses
    assert seen == {s: good(s) for s in range(80 - G.SPAN, 80) if s >= 0}


def planted_slow_rise(path: pathlib.Path, back_at: int | None) -> pathlib.Path:
    """600 steps of loss 2.0 with per-step noise of 0.1 nats; from step 300 a rise to 2.3
    spread over 20 steps, held until `back_at` (None: for good), then back to 2.0."""
    rng = np.random.default_rng(0)
    steps = np.arange(600)
    loss = 2.0 + 0.1 * rng.standard_normal(600)
    level = np.clip((steps - 300) / 20, 0, 1) * 0.3
    if back_at is not None:
        level[back_at:] = 0.0
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in steps:
            f.write(json.dumps({"step": int(s), "loss": float(loss[s] + level[s]),
                                "update_norm": 1.0, "grad_norm": 1.0, "lr": 1e-3, "skipped": 0,
                                "attn_logit_max": [1.0]}) + "\n")
    return path


def test_a_slow_rise_is_a_level_shift_that_the_one_step_rule_misses(tmp_path):
    for back_at, recovered in ((450, True), (None, False)):
        m = RC.read_metrics(planted_slow_rise(tmp_path / f"run{back_at}", back_at))
        assert R.find_spikes(m) == []  # per-step noise hides a rise spread over 20 steps
        shifts = R.find_shifts(m)
        assert len(shifts) == 1, shifts
        shift = shifts[0]
        assert 300 <= shift.step <= 325 and 0.25 < shift.height < 0.4
        assert shift.pre_level == pytest.approx(2.0, abs=0.03)  # the mean loss before it
        if recovered:
            assert 140 <= shift.length <= 175 and 150 <= shift.recovered_after <= 200
        else:
            assert shift.length == 600 - shift.step and shift.recovered_after is None
        assert "1 level shift" in R.event_report(m)


# ---------------------------------------------------------------------------------------------
# The whole project: imports flow one way

CORE = ["cli", "compat", "attention", "model", "hyperball", "optim", "data", "tracking",
        "records", "distributed", "checkpoint", "config", "hf", "export", "report", "guard",
        "loop", "guarded", "train", "warmstart", "sample"]
LAB = ["lab.stats", "lab.rows", "lab.harness", "lab.probe", "lab.tables", "lab.breaks",
       "lab.figures", "lab.search", "lab.experiments", "lab.foresight", "lab.coord", "lab.spread",
       "lab.store", "bench.bench", "bench.peer"]
PROJECT = CORE + LAB


def project_imports(name: str) -> tuple[set, set]:
    """(project modules imported at the top of name.py, those imported inside a function)."""
    import ast
    top, inner = set(), set()
    tree = ast.parse((HERE / f"{name.replace('.', '/')}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = ({a.name for a in node.names} if isinstance(node, ast.Import)
                    else {f"{node.module}.{a.name}" for a in node.names}  # from lab import x
                    if node.module in ("lab", "bench") else {node.module})
            (top if node in tree.body else inner).update(mods & set(PROJECT))
    return top, inner


def test_imports_flow_one_way():
    imports = {name: project_imports(name) for name in PROJECT}
    for leaf in ("cli", "compat", "attention", "hyperball", "data", "tracking", "records"):
        assert imports[leaf][0] <= {"cli"} - {leaf}, leaf  # leaves know nothing of the rest
    assert imports["optim"][0] <= {"hyperball"}  # the chain, and the bounded-weight pieces
    assert imports["model"][0] <= {"cli", "attention"}
    assert all(not inner for _, inner in imports.values()), imports  # no import in a function
    # the core stands alone: nothing at the top level imports from lab/ or bench/
    assert not {m: t for m in CORE for t in [imports[m][0] & set(LAB)] if t}
    # and holds only the core: the laboratory's modules live in lab/, the benchmarks in bench/
    assert sorted(p.stem for p in HERE.glob("*.py") if p.stem not in CORE) == ["conftest",
                                                                              "test_all"]

    def reaches(a, b, seen=()):
        return any(m == b or (m not in seen and reaches(m, b, seen + (m,)))
                   for m in imports[a][0])
    assert not [n for n in PROJECT if reaches(n, n)]  # no circle, however long
    assert "train" not in imports["report"][0]
    # the guard decides from the event rules alone (cli: the one way to write a file whole)
    assert imports["guard"][0] <= {"report", "records", "cli"}
    # the loop sits below both of its callers: neither hands it to the other
    assert "loop" in imports["train"][0] & imports["guarded"][0]
    assert not {"train", "guarded"} & imports["loop"][0]
    assert imports["hf"][0] <= {"cli", "model"} and "export" not in imports["train"][0]
