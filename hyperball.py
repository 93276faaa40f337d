"""Bounded weights, what Marin runs after the 32B: Hyperball's step (AdamH, MuonH: each matrix
kept on the sphere of its initial norm), and the Muon directions it and --optim.optimizer muon
take. Each piece is an optax transformation; optim.make_optimizer chains them. "The hero run"
is Marin's large MoE run after the 32B (marin #8435); its optimizer is the MuonH here.

    direction = hero_muon_with_adam(groups, matrix_dims, 0.95, b1, b2, eps)  # MuonH's
    step = hyperball_at_step(schedule, sphere_mask, adam_lr / lr)           # in place of -lr * u
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import P

# ---------------------------------------------------------------------------------------------
# Muon (Jordan et al. 2024) for the hidden matrices: --optim.optimizer muon

def muon_with_adam(decay_mask, matrix_dims, momentum: float, b1: float, b2: float,
                   eps: float) -> optax.GradientTransformation:
    """Muon for the hidden matrices, Adam for the rest (norms, embedding, LM head), as
    Levanter and Keller Jordan split them (optax's Muon: Nesterov momentum with bias
    correction, Keller Jordan's Newton-Schulz triple). Muon's update is rescaled by
    0.2 * sqrt(max(fan_in, fan_out)) to Adam's update RMS (Liu et al. 2025, "Muon is
    scalable"), so one LR serves both. `matrix_dims`: model.matrix_dims. Marin tried it on the
    32B: "looked great until it didn't"."""
    if not matrix_dims:
        raise ValueError("Muon needs the model's matrix dims (model.matrix_dims)")

    def dims(tree):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: optax.contrib.MuonDimensionNumbers(*matrix_dims[path[-1].key]), tree)

    def match_adam_rms(updates, state, params=None):
        def scale(path, u):
            red, out = matrix_dims[path[-1].key]
            fan = max(math.prod(u.shape[a] for a in red), math.prod(u.shape[a] for a in out))
            return u * (0.2 * math.sqrt(fan))
        return jax.tree_util.tree_map_with_path(scale, updates), state

    labels = jax.tree_util.tree_map_with_path(
        lambda path, decayed: "muon" if decayed and path[-1].key in matrix_dims
        and path[-1].key != "head" else "adam", decay_mask)
    muon = on_whole_arrays(optax.chain(
        optax.contrib.scale_by_muon(beta=momentum, eps=eps, weight_dimension_numbers=dims),
        optax.GradientTransformation(lambda _: optax.EmptyState(), match_adam_rms)))
    return optax.partition({"muon": muon, "adam": optax.scale_by_adam(b1, b2, eps)}, labels)


def on_whole_arrays(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` on whole arrays (Muon orthogonalises whole matrices: all-gathered first)."""
    def whole(tree):
        return jax.tree.map(lambda x: jax.reshard(x, P()), tree)

    def like(tree, ref):
        return jax.tree.map(lambda x, r: jax.reshard(x, jax.typeof(r).sharding.spec), tree, ref)

    def update(updates, state, params=None):
        out, new_state = inner.update(whole(updates), whole(state), None)
        return like(out, updates), like(new_state, state)
    return optax.GradientTransformation(inner.init, update)


# ---------------------------------------------------------------------------------------------
# Hyperball (Wen, Dang, Lyu, Ma, Liang, "Hyperball Optimization", 2025),
# Levanter's adamH and the hero run's MuonH (marin experiments/grug/moe_hero_ep/optimizer.py):
# what Marin runs after the 32B. As there: the matrices of the parameter table (projections,
# MLP, LM head) on their spheres; the embedding, the norms' scales and a zero-init matrix (the
# attention gate: a sphere of radius 0) on plain Adam at --optim.adam-lr (Levanter's adam_lr),
# on the same schedule; no weight decay (the sphere fixes each norm). MuonH: the hidden matrices
# take the hero's Muon direction, the LM head Adam's (AdamH), as its mask assigns them. A set
# gradient clip clips each group by its own norm, as Levanter's AdamHConfig and the hero's
# config do (the Adam chain, and grug's AdamH, clip the whole tree once).

def hyperball_groups(optimizer: str, sphere, matrix_dims) -> dict:
    """Each leaf's group: "muon" (muonh's hidden matrices), "sphere" (the other matrices on
    their sphere: the LM head, or every one under adamh), "adam" (the rest)."""
    def group(path, on):
        if not on:
            return "adam"
        hidden = path[-1].key in (matrix_dims or {}) and path[-1].key != "head"
        return "muon" if optimizer == "muonh" and hidden else "sphere"
    return jax.tree_util.tree_map_with_path(group, sphere)


def clip_by_group_norm(max_norm: float, groups) -> optax.GradientTransformation:
    """optax.clip_by_global_norm within each group of `groups` (a tree of labels), each group
    scaled by its own global norm."""
    def update(updates, state, params=None):
        labels = jax.tree.leaves(groups)
        leaves, tree = jax.tree.flatten(updates)
        norm = {g: jnp.sqrt(sum(jnp.sum(jnp.square(u)) for u, lab in zip(leaves, labels)
                                if lab == g)) for g in sorted(set(labels))}
        clipped = [jax.lax.select(norm[lab] < max_norm, u, u / norm[lab].astype(u.dtype)
                                  * max_norm) for u, lab in zip(leaves, labels)]
        return jax.tree.unflatten(tree, clipped), state
    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


# Levanter's "quintic" Newton-Schulz coefficients (lib/levanter/src/levanter/optim/util.py,
# NEWTON_SCHULZ_COEFFICIENTS, from NVIDIA-NeMo/Emerging-Optimizers): one (a, b, c) an iteration.
QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
MUON_EPS = 1e-8  # the hero's muon_epsilon


def newton_schulz(x_MN, eps: float = MUON_EPS) -> jax.Array:
    """The hero's orthogonalisation of one matrix: x / (|x|_F + eps), transposed to wide,
    five quintic iterations X <- aX + (bA + cA^2)X with A = XX^T, transposed back. NOTE: the
    hero runs it in bfloat16 for its accelerators' throughput; here it runs in float32."""
    x = x_MN.astype(jnp.float32)
    x = x / (jnp.linalg.norm(x) + eps)
    wide = x.T if x.shape[0] > x.shape[1] else x
    for a, b, c in QUINTIC:
        A = wide @ wide.T
        wide = a * wide + (b * A + c * A @ A) @ wide
    return (wide.T if x.shape[0] > x.shape[1] else wide).astype(x_MN.dtype)


class HeroMuonState(NamedTuple):
    momentum_buffer: optax.Updates


def scale_by_hero_muon(matrix_dims, momentum: float = 0.95) -> optax.GradientTransformation:
    """The hero's Muon direction (marin experiments/grug/moe_hero_ep/grugmuon_hero.py, as
    Levanter's grugmuon.py): buf <- momentum * buf + g, Nesterov u = momentum * buf + g, no
    bias correction; each matrix (each stacked layer's, its input dims x its output dims, as
    matrix_dims names them) orthogonalised by newton_schulz and scaled by
    sqrt(max(1, fan_out / fan_in))."""
    def orthogonal(path, u):
        fan_in, fan_out = matrix_dims[path[-1].key]
        batch = tuple(d for d in range(u.ndim) if d not in fan_in + fan_out)
        order = batch + fan_in + fan_out
        moved = jnp.transpose(u, order)
        n_in = math.prod(u.shape[d] for d in fan_in)
        n_out = math.prod(u.shape[d] for d in fan_out)
        flat = moved.reshape(-1, n_in, n_out)
        out = jax.vmap(newton_schulz)(flat) * math.sqrt(max(1.0, n_out / n_in))
        return jnp.transpose(out.reshape(moved.shape), [order.index(d) for d in range(u.ndim)])

    def update(updates, state, params=None):
        buf = jax.tree.map(lambda m, g: momentum * m + g, state.momentum_buffer, updates)
        nesterov = jax.tree.map(lambda m, g: momentum * m + g, buf, updates)
        return jax.tree_util.tree_map_with_path(orthogonal, nesterov), HeroMuonState(buf)

    return optax.GradientTransformation(
        lambda params: HeroMuonState(jax.tree.map(jnp.zeros_like, params)), update)


def hero_muon_with_adam(groups, matrix_dims, momentum: float, b1: float, b2: float,
                        eps: float) -> optax.GradientTransformation:
    """MuonH's direction: the hero's Muon for the "muon" group, Adam for the rest."""
    labels = jax.tree.map(lambda g: "muon" if g == "muon" else "adam", groups)
    muon = on_whole_arrays(scale_by_hero_muon(matrix_dims, momentum))
    return optax.partition({"muon": muon, "adam": optax.scale_by_adam(b1, b2, eps)}, labels)


class HyperballState(NamedTuple):
    radius: optax.Params  # each matrix's norm where it started (per stacked layer); 0 the rest


def matrix_norm(x) -> jax.Array:
    """A matrix's Frobenius norm in float32: [L] for stacked layers (over each layer's own
    axes), [] for a 2-D one, as Levanter's adamH takes it."""
    axes = tuple(range(1, x.ndim)) if x.ndim > 2 else None
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axes))


def beta2_for_batch(tokens: int) -> float:
    """The hero run's beta2 for a batch of `tokens` tokens (its "May Recipe", marin #5951:
    MoeHeuristic._beta2 in experiments/grug/moe_hero_ep/heuristic.py): 0.999 at 131,072,
    lower for a larger batch, clipped to [0.95, 0.9999]."""
    return min(max(0.999 ** (tokens / 131_072), 0.95), 0.9999)


def hyperball_at_step(schedule, matrices, adam_ratio: float = 1.0
                      ) -> optax.GradientTransformationExtraArgs:
    """The LR step of AdamH / MuonH in place of scale_by_schedule_at_step: each leaf that
    `matrices` marks keeps the norm R it had at init: W <- R * Norm(W - lr * R * Norm(u)),
    Norm(x) = x / |x|_F per stacked layer, u the direction (Adam's or Muon's), lr =
    schedule(step), an angle. The other leaves take -lr * adam_ratio * u. A zero direction
    (a refused or skipped step) moves nothing. Levanter computes the new norm in closed form,
    and the hero's MuonH takes R as the matrix's norm now; here R is kept and the new norm
    taken from the moved matrix: the same to float rounding."""
    def init(params):
        return HyperballState(jax.tree.map(lambda w, on: matrix_norm(w) if on else
                                           jnp.zeros((), jnp.float32), params, matrices))

    def update(updates, state, params=None, *, step, **extra):
        lr = schedule(step)

        def one(u, w, r, on):
            if not on:
                return jnp.array(-lr * adam_ratio, u.dtype) * u
            def per_layer(x):
                return x.reshape(x.shape + (1,) * (w.ndim - x.ndim))
            w32, u32, r = w.astype(jnp.float32), u.astype(jnp.float32), per_layer(r)
            u_norm = per_layer(matrix_norm(u32))
            moved = w32 - lr * r * u32 / jnp.maximum(u_norm, 1e-30)
            new = r * moved / per_layer(matrix_norm(moved))
            return jnp.where(u_norm > 0, new - w32, 0.0).astype(u.dtype)
        return jax.tree.map(one, updates, params, state.radius, matrices), state
    return optax.GradientTransformationExtraArgs(init, update)
