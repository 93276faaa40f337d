"""The eager PyTorch a user would write instead: spikefix's model and optimizer in torch, for
`python -m bench.bench --torch` (the step side by side with train.py's) and its test.

The model is model.py's, built from the same parameters (model.init_params, copied): the
embedding, per layer RMSNorm, the q/k/v projections (QK-Norm if on), RoPE in the rotate-half
layout, causal grouped-query attention (torch's scaled_dot_product_attention), the output
projection, SwiGLU; the final norm and the LM head; cross-entropy plus z-loss. The optimizer is
torch's AdamW (decay on the matrices of model.decay_mask, the same β1, β2, ε), the gradient
clipped to the same global norm, the LR of optim.lr_schedule at each step. torch is optional:
pip install /path/to/torch-*+cpu*.whl, or requirements-check.txt.
"""

from __future__ import annotations  # (torch's types in the annotations: torch is optional)

import math
import time

import jax
import numpy as np

import model as M
import optim as O

try:  # optional: `python -m bench.bench --torch` says how to install it and skips without it
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None


def torch_params(params: dict) -> dict[str, torch.Tensor]:
    """spikefix's parameters (a pytree of arrays) as flat torch leaves, "layers/wq" for the
    stacked ones, each a float32 copy that takes gradients."""
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x, np.float32)
            for path, x in jax.tree_util.tree_leaves_with_path(jax.device_get(params))}
    return {k: torch.tensor(v, requires_grad=True) for k, v in flat.items()}


def rms_norm(x, scale, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def rope(x_BTNH, theta: float):
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    freq = theta ** (-torch.arange(0, H, 2, dtype=torch.float32) / H)
    angle = torch.arange(T, dtype=torch.float32)[:, None] * freq[None, :]
    cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
    x1, x2 = x_BTNH.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def loss_fn(p: dict, tokens_BT1: torch.Tensor, cfg: M.ModelConfig) -> torch.Tensor:
    """model.loss_fn's loss (cross-entropy plus z-loss) in eager torch."""
    if cfg.attn_gate != "none" or cfg.embed_scale or cfg.attn_softcap or cfg.param != "standard":
        raise ValueError("the torch peer has the standard model only (QK-Norm on or off)")
    inputs, targets = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    B, T = inputs.shape
    N, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_model
    H = D // N if "layers/wq" not in p else p["layers/wq"].shape[-1]
    x = p["embed"][inputs]
    for i in range(cfg.n_layers):
        w = {k.removeprefix("layers/"): v[i] for k, v in p.items() if k.startswith("layers/")}
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q = (h @ w["wq"].reshape(D, N * H)).view(B, T, N, H)
        k = (h @ w["wk"].reshape(D, K * H)).view(B, T, K, H)
        v = (h @ w["wv"].reshape(D, K * H)).view(B, T, K, H)
        if cfg.qk_norm:
            q, k = rms_norm(q, w["q_norm"], cfg.norm_eps), rms_norm(k, w["k_norm"], cfg.norm_eps)
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = x + out.transpose(1, 2).reshape(B, T, N * H) @ w["wo"].reshape(N * H, D)
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + (F.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
    logits = rms_norm(x, p["final_norm"], cfg.norm_eps) @ p["head"]
    lse = torch.logsumexp(logits, dim=-1)
    ce = (lse - logits.gather(-1, targets[..., None])[..., 0]).mean()
    return ce + cfg.z_loss_weight * (lse * lse).mean()


def optimizer(p: dict, cfg, total_steps: int):
    """torch's AdamW over p, weight decay on model.decay_mask's leaves, and the LR of each step
    (optim.lr_schedule, computed once)."""
    decayed = M.optimizer_layout(cfg.model)["decay_mask"]
    mask = {"/".join(str(getattr(k, "key", k)) for k in path): bool(d)
            for path, d in jax.tree_util.tree_leaves_with_path(decayed)}
    groups = [{"params": [v for k, v in p.items() if mask[k] == d],
               "weight_decay": cfg.optim.weight_decay if d else 0.0} for d in (True, False)]
    opt = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.b1, cfg.optim.b2),
                            eps=cfg.optim.eps)
    schedule = O.lr_schedule(cfg.optim, total_steps)
    lrs = np.asarray(jax.vmap(schedule)(np.arange(total_steps)), np.float64)
    return opt, lrs


def timer(cfg, tokens: np.ndarray):
    """run(n) -> seconds per step over n eager steps (forward, backward, clip, AdamW) of cfg's
    model on `tokens`, after one untimed step; torch on this process's cores."""
    p = torch_params(M.init_params(cfg.model, jax.random.key(cfg.seed)))
    opt, lrs = optimizer(p, cfg, cfg.steps)
    batch = torch.from_numpy(tokens.astype(np.int64))
    params = list(p.values())
    step = [0]

    def one():
        for g in opt.param_groups:
            g["lr"] = float(lrs[step[0] % len(lrs)])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(p, batch, cfg.model)
        loss.backward()
        if cfg.optim.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_norm)
        opt.step()
        step[0] += 1
        return loss

    t = time.perf_counter()
    one()
    first = time.perf_counter() - t

    def run(n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            loss = one()
        assert math.isfinite(loss.item())
        return (time.perf_counter() - t) / n
    run.first_step_s = first
    return run
