"""What the attention-gate rows are about besides the evidence figures, read from the weights at
each held-out evaluation (lab/harness.py), per layer:

- `probe_sink`: the attention sink, the mean attention probability on the window's first token,
  over every query after it (position 0's query sees only itself), every head and sequence of
  the held-out set. Qiu et al. ("Gated Attention for Large Language Models", arXiv
  2505.06708) report that the gated model puts far less mass there.
- `probe_gate_norm`: the gate weight's Frobenius norm (marin #8818 watches it grow in the early
  layers of the hero run); 0 without a gate.
- `probe_gate_mean`: the gate's mean value on the held-out set (Marin's form is exactly 1 at
  zero init); 1 without a gate.

The layers are recomputed with model.py's own pieces (qkv, attention, mlp), so the probe reads
the model the step trains."""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import model as M
from attention import cap

PROBE_KEYS = ("probe_sink", "probe_gate_norm", "probe_gate_mean")


def first_token_mass(q_BTNH, k_BTKH, softcap: float = 0.0):
    """The mean causal attention probability on key 0 over queries 1..T-1, heads and batch
    (attention.dense's logits, scale and cap)."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BTKH,
                        preferred_element_type=jnp.float32) / math.sqrt(H)
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(causal_TS, cap(logits, softcap), -jnp.inf), axis=-1)
    return jnp.mean(probs[..., 1:, 0])


def sink_mass(q_BTNH, k_BTKH, softcap: float = 0.0):
    """first_token_mass over q, k sharded as model.attention's (batch over "data", heads over
    "model"): per device, as attention.attend computes, then the mean of the devices' equal
    shares; outside a mesh, directly."""
    spec = M.shard("batch", "seq", "heads", "head_dim")
    if spec is None:
        return first_token_mass(q_BTNH, k_BTKH, softcap)
    return jnp.mean(jax.shard_map(lambda q, k: first_token_mass(q, k, softcap)[None],
                                  in_specs=(spec, spec), out_specs=P(tuple(a for a in spec if a)),
                                  check_vma=False)(q_BTNH, k_BTKH))


def probe(params: dict, tokens_BT, cfg: M.ModelConfig) -> dict[str, jnp.ndarray]:
    """PROBE_KEYS, each [L], for one model's params on tokens [B, T]."""
    layers, dtype = params["layers"], jnp.dtype(cfg.dtype)
    top = M.gather_weights(params, cfg, dtype)  # (as model.forward: FSDP shards gathered)
    x_BTD = M.scaled_embedding(
        top["embed"].at[tokens_BT].get(out_sharding=M.shard("batch", "seq", "act_embed")), cfg)
    sink, norm, mean = [], [], []
    for i in range(cfg.n_layers):
        p = M.gather_weights({k: v[i] for k, v in layers.items()}, cfg, dtype)
        h_BTD = M.rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
        q, k, _ = M.qkv(h_BTD, p, cfg)
        sink.append(sink_mass(q, k, cfg.attn_softcap))
        if cfg.attn_gate != "none":
            norm.append(jnp.linalg.norm(p["w_attn_gate"]))
            mean.append(jnp.mean(M.attention_gate(h_BTD, p, cfg)))
        else:
            norm.append(jnp.float32(0.0))
            mean.append(jnp.float32(1.0))
        x_BTD = x_BTD + M.attention(h_BTD, p, cfg)[0]
        x_BTD = x_BTD + M.mlp(M.rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps), p)
    return {"probe_sink": jnp.stack(sink), "probe_gate_norm": jnp.stack(norm),
            "probe_gate_mean": jnp.stack(mean)}
