"""A Llama-style decoder as pure functions on a params pytree, with an optional QK-Norm.

    params = init_params(cfg, key)                    # one table declares every parameter
    loss, aux = loss_fn(params, tokens_BT1, cfg)      # aux: ce, z_loss, per-layer max |logit|

Dimension key (used in einsum strings and in the names of non-obvious tensors):
    B batch, T sequence, D model, F ffw, N query heads, K kv heads, G query heads per kv head,
    H head dim, V vocab, L layers.

Layers are stacked (every per-layer parameter has a leading L axis) and run with `jax.lax.scan`,
so compile time does not grow with depth (`scan_layers=False` unrolls it, for shallow models).
Parameters are float32; `dtype` sets the compute dtype.
Shardings come from the logical axes in param_table and the one small table LOGICAL_TO_MESH.
"""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import P

import attention as A


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # byte-level by default
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads must be a multiple
    d_ff: int = 688  # SwiGLU hidden: ~8/3 * d_model, as Llama
    rope_theta: float = 10_000.0  # Marin 32B (Llama 3): 500_000
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (what rescued Marin 32B)
    qk_mult: float = 1.0  # with QK-Norm, q times this after RoPE (marin's later runs: 1.3)
    z_loss_weight: float = 1e-4  # Marin 32B; OLMo 2 uses 1e-5
    norm_eps: float = 1e-5
    init_std: float = 0.02  # OLMo 2: N(0, 0.02)
    dtype: str = "float32"  # compute dtype; "bfloat16" on accelerators (params stay float32)
    scan_layers: bool = True  # lax.scan over the layers; False unrolls them (a shallow model)
    # attention.py's form of the same math: auto picks by platform and length; dense is the
    # reference; blockwise is O(T) memory
    attention: A.Form = "auto"
    attention_block: int = 256  # blockwise: positions per query / key block
    attn_softcap: float = 0.0  # scores -> c * tanh(s / c) before the softmax (Gemma 2: 50); 0: off
    # Scaled Embed ("Spike No More", 2312.16903): the embeddings times sqrt(d_model). NOTE:
    # from N(0, init_std) the stream starts at std init_std * sqrt(d_model), 1 only near 2,500.
    embed_scale: bool = False
    # The attention gate (Gated Attention, 2505.06708; Marin kept it) on each head's output,
    # from the block's normed input: "none", "headwise" or "elementwise"
    attn_gate: str = "none"
    # "marin": 2 * sigmoid(h @ W_gate), W_gate zero at init (exactly 1: an insertion changes
    # nothing); "qwen": sigmoid, W_gate drawn as the other weights
    attn_gate_form: str = "marin"
    # "standard" (every weight N(0, init_std), one LR) or "mup" (muP, against mup_base_width)
    param: str = "standard"
    mup_base_width: int = 32  # muP: the width at which this model is the standard one

    def __post_init__(self):
        def check(names, ok, what):  # as OptimConfig's: written so that NaN fails every test
            for name in names:
                if not ok(getattr(self, name)):
                    raise ValueError(f"model.{name} must be {what}, got {getattr(self, name)}")
        check(("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
               "attention_block", "mup_base_width"), lambda x: x > 0, "positive")
        check(("rope_theta", "norm_eps", "init_std", "qk_mult"), lambda x: 0 < x < math.inf,
              "a positive finite number")
        check(("attn_softcap", "z_loss_weight"), lambda x: 0 <= x < math.inf, ">= 0 and finite")
        for name, allowed in (("attention", A.FORMS), ("dtype", ("float32", "bfloat16",
                              "float16")), ("param", ("standard", "mup")), ("attn_gate", (
                              "none", "headwise", "elementwise")), ("attn_gate_form", ("marin",
                              "qwen"))):
            check((name,), allowed.__contains__, f"{', '.join(allowed[:-1])} or {allowed[-1]}")
        for wrong, why in (  # settings that must agree with one another
                (self.d_model % self.n_heads, f"model.d_model={self.d_model} is not divisible by "
                 f"model.n_heads={self.n_heads}: pick n_heads that divides d_model"),
                (self.n_heads % self.n_kv_heads, f"model.n_heads={self.n_heads} is not a multiple"
                 f" of model.n_kv_heads={self.n_kv_heads}: pick n_kv_heads that divides n_heads"),
                (self.d_model // self.n_heads % 2, f"model.d_model / model.n_heads = "
                 f"{self.d_model // self.n_heads} is odd: RoPE rotates pairs of dimensions, so "
                 "the head dimension must be even"),
                (self.attention == "cudnn" and self.dtype == "float32", "model.attention cudnn "
                 "needs --model.dtype bfloat16 or float16 (cuDNN has no float32 kernel)"),
                (self.attn_softcap and self.attention == "cudnn", "model.attention cudnn has no "
                 "soft-cap: use --model.attention blockwise with --model.attn-softcap"),
                (self.qk_mult != 1.0 and not self.qk_norm, "model.qk_mult multiplies QK-Norm's "
                 "normalised scores: add --model.qk-norm")):
            if wrong:
                raise ValueError(why)
        if self.param == "mup":
            width_config(self, self.mup_base_width)  # the base exists (raises if it does not)

    @property
    def output_mult(self) -> float:
        """The logits' input times this: muP's readout (MuReadout), 1 if standard."""
        return self.mup_base_width / self.d_model if self.param == "mup" else 1.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# ---------------------------------------------------------------------------------------------
# The parameter table: name -> (shape, logical axes, initialiser, weight-decayed?).
# init_params, the shardings and the weight-decay mask are all derived from it and nowhere else.

def _normal(std):
    return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)


def _constant(value):
    return lambda key, shape: jnp.full(shape, value, jnp.float32)


_ZERO = _constant(0.0)  # (a zero-init matrix stays off Hyperball's sphere: its radius is 0)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dimension
    init: object
    decay: bool  # weight decay applies to matrices only, never to norms or the embedding
    fan_in: tuple[int, ...] = ()  # a matrix's input dims (Muon reduces over them); () if none


def param_table(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every parameter, keyed by its path in the params pytree ("layers/wq")."""
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    w = _normal(cfg.init_std)
    table = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), w, False),
        "layers/attn_norm": ParamSpec((L, D), ("layers", "embed"), _constant(1.0), False),
        "layers/wq": ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), w, True,
                               (1,)),
        "layers/wk": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, True,
                               (1,)),
        "layers/wv": ParamSpec((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"), w, True,
                               (1,)),
        "layers/wo": ParamSpec((L, N, H, D), ("layers", "heads", "head_dim", "embed"), w, True,
                               (1, 2)),
        "layers/mlp_norm": ParamSpec((L, D), ("layers", "embed"), _constant(1.0), False),
        "layers/w_gate": ParamSpec((L, D, F), ("layers", "embed", "ffw"), w, True, (1,)),
        "layers/w_up": ParamSpec((L, D, F), ("layers", "embed", "ffw"), w, True, (1,)),
        "layers/w_down": ParamSpec((L, F, D), ("layers", "ffw", "embed"), w, True, (1,)),
        "final_norm": ParamSpec((D,), ("embed",), _constant(1.0), False),
        "head": ParamSpec((D, V), ("embed", "vocab"), w, True, (0,)),
    }
    if cfg.attn_gate != "none":
        init = _ZERO if cfg.attn_gate_form == "marin" else w
        table["layers/w_attn_gate"] = (
            ParamSpec((L, D, N), ("layers", "embed", "heads"), init, True, (1,))
            if cfg.attn_gate == "headwise" else
            ParamSpec((L, D, N, H), ("layers", "embed", "heads", "head_dim"), init, True, (1,)))
    if cfg.qk_norm:
        # One [H] scale per layer shared by all heads (Levanter's Qwen3, which Marin switched to;
        # per-head norm did slightly better than full-width in Wortsman et al. 2309.14322).
        table["layers/q_norm"] = ParamSpec((L, H), ("layers", "head_dim"), _constant(1.0), False)
        table["layers/k_norm"] = ParamSpec((L, H), ("layers", "head_dim"), _constant(1.0), False)
    return table


# Logical axis -> mesh axis, for parameters and activations alike (jax-llm-examples'
# ShardingRules). FSDP: parameters are split over "data" along their embed dimension; tensor
# parallelism splits heads, ffw and vocab over "model"; activations split the batch over "data".
# Change a strategy here, only here.
LOGICAL_TO_MESH = {
    # parameters
    "layers": None, "embed": "data", "head_dim": None,
    "vocab": "model", "heads": "model", "kv_heads": "model", "ffw": "model",
    # activations (their heads, kv_heads, ffw and head_dim axes are the parameters')
    "batch": "data", "seq": None, "act_embed": None, "act_vocab": None,
}


def logical_to_spec(axes: tuple[str, ...], gathered: bool = False) -> P:
    """The PartitionSpec of a parameter; `gathered` drops the FSDP axis (the layout used in
    compute, after the all-gather that FSDP performs before each use)."""
    mesh_axes = [LOGICAL_TO_MESH[a] for a in axes]
    if gathered:
        mesh_axes = [None if m == "data" else m for m in mesh_axes]
    return P(*mesh_axes)


def shard(*axes: str) -> P | None:
    """The PartitionSpec of an activation with these logical axes; None outside any mesh."""
    return None if jax.sharding.get_abstract_mesh().empty else logical_to_spec(axes)


def nest(flat: dict, sep: str = "/") -> dict:
    """{"layers/wq": x} -> {"layers": {"wq": x}}"""
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(sep)
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def optimizer_layout(cfg: ModelConfig) -> dict:
    """What optim.make_optimizer reads of the model, all from the table: the leaves weight
    decay applies to (the matrices); each matrix's input and output dims as Muon orthogonalises
    it (the layer axis is neither: a batch axis); the matrices Hyperball keeps on their sphere
    (not a zero-init one: its radius is 0); QK-Clip's head dims; muP's Adam LR multipliers."""
    table = param_table(cfg)

    def outputs(s: ParamSpec) -> tuple[int, ...]:
        return tuple(d for d, a in enumerate(s.axes) if d not in s.fan_in and a != "layers")
    return {"decay_mask": nest({k: s.decay for k, s in table.items()}),
            "matrix_dims": {k.split("/")[-1]: (s.fan_in, outputs(s))
                            for k, s in table.items() if s.fan_in},
            "head_axes": {w: table[f"layers/{w}"].axes.index(a)
                          for w, a in (("wq", "heads"), ("wk", "kv_heads"))},
            "lr_mults": lr_multipliers(cfg),
            "sphere_mask": nest({k: s.decay and s.init is not _ZERO for k, s in table.items()})}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh parameters. Each is drawn from its own key folded from its name, so adding a
    parameter (qk_norm) leaves every other parameter's initial value unchanged."""
    flat, scales = {}, mup_scales(cfg)
    for name, spec in param_table(cfg).items():
        name_hash = int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little") % (2**31 - 1)
        x = spec.init(jax.random.fold_in(key, name_hash), spec.shape)
        flat[name] = x if scales[name][0] == 1.0 else x * scales[name][0]  # muP: std x m^-1/2
    return nest(flat)


def count_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in param_table(cfg).values())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM's appendix B): 6·N for the weights' matmuls (N without the
    embedding, a gather), plus 6·L·T·D for the causal attention's scores and values."""
    n = count_params(cfg) - cfg.vocab_size * cfg.d_model
    return 6 * n + 6 * cfg.n_layers * seq_len * cfg.d_model


# ---------------------------------------------------------------------------------------------
# The forward pass.

def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype)


def rope(x_BTNH, theta: float, offset=0):
    """Rotary position embedding, rotate-half layout (Llama); positions offset..offset+T-1."""
    T, H = x_BTNH.shape[1], x_BTNH.shape[-1]
    cos_T1H2, sin_T1H2 = rope_tables(T, H, theta, offset)
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos_T1H2 - x2 * sin_T1H2, x2 * cos_T1H2 + x1 * sin_T1H2],
                          axis=-1)
    return out.astype(x_BTNH.dtype)


def rope_tables(T: int, H: int, theta: float, offset=0):
    """cos and sin of each position's angles, [1, T, 1, H/2]. NOTE: with a static offset
    (training) trace-time constants, which XLA:CPU would otherwise recompute (bench/)."""
    static = isinstance(offset, int)
    with jax.ensure_compile_time_eval() if static else contextlib.nullcontext():
        freq_H2 = theta ** (-jnp.arange(0, H, 2, dtype=jnp.float32) / H)
        angle_TH2 = (offset + jnp.arange(T, dtype=jnp.float32))[:, None] * freq_H2[None, :]
        return jnp.cos(angle_TH2)[None, :, None, :], jnp.sin(angle_TH2)[None, :, None, :]


def gather_weights(p: dict, cfg: ModelConfig, dtype) -> dict:
    """FSDP all-gather of one layer's (or the top-level) weights, cast to the compute dtype.
    Outside any mesh (sampling on one device) only the cast."""
    if jax.sharding.get_abstract_mesh().empty:
        return {k: v.astype(dtype) for k, v in p.items() if k != "layers"}
    specs = {k.split("/")[-1]: logical_to_spec(s.axes[1:] if k.startswith("layers/") else s.axes,
                                               gathered=True)
             for k, s in param_table(cfg).items()}
    return {k: jax.reshard(v, specs[k]).astype(dtype) for k, v in p.items() if k != "layers"}


def matmul(subscripts: str, x, w, out: tuple[str, ...]):
    """A projection, jnp.einsum(subscripts, x, w) with subscripts "bt<in>,<in><out>->bt<out>",
    its output sharded as the logical axes `out`. NOTE: computed as one 2-D [B*T, in] x [in,
    out] matmul, the same math: XLA:CPU's backward of the batched form is slower (bench/)."""
    xs, ws, ys = subscripts.replace("->", ",").split(",")
    if not (xs[:2] == ys[:2] == "bt" and ws == xs[2:] + ys[2:]):
        raise ValueError(f"{subscripts}: not a projection bt<in>,<in><out>->bt<out>")
    B, T = x.shape[:2]
    out_shape = w.shape[x.ndim - 2:]
    out_spec = rows_spec = y_spec = shard("batch", "seq", *out)  # None outside a mesh
    if out_spec is not None:  # rows B*T on the batch's axis; features as x's / the output's
        x_spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
        rows_spec, y_spec = P(out_spec[0], x_spec[2]), P(out_spec[0], out_spec[2])
    x_MI = x.reshape(B * T, math.prod(x.shape[2:]), out_sharding=rows_spec)
    w_IO = w.reshape(x_MI.shape[1], math.prod(out_shape))
    y_MO = jnp.einsum("mi,io->mo", x_MI, w_IO, out_sharding=y_spec)
    return y_MO.reshape(B, T, *out_shape, out_sharding=out_spec)


def qkv(h_BTD, p, cfg: ModelConfig, offset=0):
    """One layer's queries, keys and values: the projections, QK-Norm (if on) and RoPE, for
    positions offset..offset+T-1. The training forward and the cached decode both call this."""
    q_BTNH = matmul("btd,dnh->btnh", h_BTD, p["wq"], out=("heads", "head_dim"))
    k_BTKH = matmul("btd,dkh->btkh", h_BTD, p["wk"], out=("kv_heads", "head_dim"))
    v_BTKH = matmul("btd,dkh->btkh", h_BTD, p["wv"], out=("kv_heads", "head_dim"))
    if cfg.qk_norm:  # NOTE: before RoPE, per head over head_dim, as in Qwen3 (Marin's fix)
        q_BTNH = rms_norm(q_BTNH, p["q_norm"], cfg.norm_eps)
        k_BTKH = rms_norm(k_BTKH, p["k_norm"], cfg.norm_eps)
    q_BTNH = rope(q_BTNH, cfg.rope_theta, offset)
    if cfg.qk_mult != 1.0:  # the normalised scores times a fixed multiplier (marin's qk_mult)
        q_BTNH = q_BTNH * jnp.asarray(cfg.qk_mult, q_BTNH.dtype)
    return q_BTNH, rope(k_BTKH, cfg.rope_theta, offset), v_BTKH


def attention(x_BTD, p, cfg: ModelConfig, head_stats: bool = False):
    """Causal grouped-query attention in cfg.attention's form (attention.py), and its max
    |attention logit| over the causal entries (with `head_stats` per query head, QK-Clip's)."""
    q_BTNH, k_BTKH, v_BTKH = qkv(x_BTD, p, cfg)
    form = A.resolve(cfg.attention, cfg.dtype, softcap=cfg.attn_softcap)
    spec = shard("batch", "seq", "heads", "head_dim")
    out_BTNH, logit_max = A.attend(q_BTNH, k_BTKH, v_BTKH, form, cfg.attention_block, spec,
                                   cfg.attn_softcap)
    stats = {"attn_logit_max": logit_max}
    if head_stats:
        stats["attn_logit_max_per_head"] = A.head_logit_max(q_BTNH, k_BTKH, spec)
    return output_projection(out_BTNH, x_BTD, p, cfg), stats


def output_projection(out_BTNH, h_BTD, p, cfg: ModelConfig):
    """The heads' outputs through the attention gate (if on; from the block's normed input h)
    and the output projection. The training forward and the cached decode both call this."""
    if cfg.attn_gate != "none":
        gate = attention_gate(h_BTD, p, cfg)
        out_BTNH = out_BTNH * (gate[..., None] if cfg.attn_gate == "headwise" else gate)
    return matmul("btnh,nhd->btd", out_BTNH, p["wo"], out=("act_embed",))


def attention_gate(h_BTD, p, cfg: ModelConfig):
    """The gate's value from the block's normed input: [B, T, N] headwise, [B, T, N, H]
    elementwise; Marin's form 2 * sigmoid (1 at its zero init), Qwen's sigmoid."""
    headwise = cfg.attn_gate == "headwise"
    z = matmul("btd,dn->btn", h_BTD, p["w_attn_gate"], out=("heads",)) if headwise else \
        matmul("btd,dnh->btnh", h_BTD, p["w_attn_gate"], out=("heads", "head_dim"))
    return jax.nn.sigmoid(z) * (2 if cfg.attn_gate_form == "marin" else 1)


def mlp(x_BTD, p):
    gate_BTF = matmul("btd,df->btf", x_BTD, p["w_gate"], out=("ffw",))
    up_BTF = matmul("btd,df->btf", x_BTD, p["w_up"], out=("ffw",))
    return matmul("btf,fd->btd", jax.nn.silu(gate_BTF) * up_BTF, p["w_down"], out=("act_embed",))


def scaled_embedding(x_BTD, cfg: ModelConfig):
    """The looked-up embeddings, times sqrt(d_model) with embed_scale (Scaled Embed)."""
    return x_BTD * math.sqrt(cfg.d_model) if cfg.embed_scale else x_BTD


def readout_input(x_BTD, cfg: ModelConfig):
    """The final normed state as the readout takes it: times output_mult under muP."""
    return x_BTD * cfg.output_mult if cfg.output_mult != 1.0 else x_BTD


def forward(params: dict, tokens_BT, cfg: ModelConfig, head_stats: bool = False):
    """Logits [B, T, V] (float32) and per-layer statistics {"attn_logit_max": [L]} (with
    `head_stats` also "attn_logit_max_per_head": [L, N])."""
    dtype = jnp.dtype(cfg.dtype)
    top = gather_weights(params, cfg, dtype)
    x_BTD = scaled_embedding(
        top["embed"].at[tokens_BT].get(out_sharding=shard("batch", "seq", "act_embed")), cfg)

    def block(x_BTD, layer_params):
        p = gather_weights(layer_params, cfg, dtype)
        attn_BTD, stats = attention(rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps), p, cfg,
                                    head_stats)
        x_BTD = x_BTD + attn_BTD
        x_BTD = x_BTD + mlp(rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps), p)
        return x_BTD, stats

    x_BTD, stats_L = jax.lax.scan(block, x_BTD, params["layers"],
                                  unroll=1 if cfg.scan_layers else cfg.n_layers)
    x_BTD = rms_norm(x_BTD, top["final_norm"], cfg.norm_eps)
    logits_BTV = jnp.einsum("btd,dv->btv", readout_input(x_BTD, cfg), top["head"],
                            out_sharding=shard("batch", "seq", "act_vocab"))
    return logits_BTV.astype(jnp.float32), stats_L


def loss_fn(params: dict, tokens_BT1, cfg: ModelConfig, head_stats: bool = False):
    """Next-token cross-entropy plus z-loss, weight * logsumexp(logits)**2 (PaLM; Marin 1e-4,
    OLMo 2 1e-5), over a [B, T+1] batch. Returns (loss, aux): ce, z_loss, attn_logit_max [L]
    (per head [L, N] with `head_stats`), out_logit_max and log_z, the mean log-normaliser."""
    inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
    logits_BTV, stats = forward(params, inputs_BT, cfg, head_stats)
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    ce = jnp.mean(lse_BT - target_logit_BT)
    z_loss = cfg.z_loss_weight * jnp.mean(lse_BT**2)
    return ce + z_loss, {"ce": ce, "z_loss": z_loss, **stats, "log_z": jnp.mean(lse_BT),
                         "out_logit_max": jnp.max(jnp.abs(logits_BTV))}


# ---------------------------------------------------------------------------------------------
# Beyond the card: muP (Tensor Programs V, arXiv 2203.03466) as microsoft/mup does it for Adam

def width_config(cfg: ModelConfig, d_model: int) -> ModelConfig:
    """The model at another width, standard: d_ff and the heads in proportion, H kept."""
    def scaled(n: int, what: str) -> int:
        if (n * d_model) % cfg.d_model:
            raise ValueError(f"model.mup_base_width {d_model}: {what} {n} at d_model "
                             f"{cfg.d_model} does not scale to a whole number; pick a base "
                             "width that divides it")
        return n * d_model // cfg.d_model
    return dataclasses.replace(
        cfg, param="standard", d_model=d_model, d_ff=round(cfg.d_ff * d_model / cfg.d_model),
        n_heads=scaled(cfg.n_heads, "n_heads"), n_kv_heads=scaled(cfg.n_kv_heads, "n_kv_heads"))


def mup_scales(cfg: ModelConfig) -> dict[str, tuple[float, float]]:
    """muP for Adam as microsoft/mup derives it: {name: (init multiplier, LR multiplier)}. A
    dimension is "infinite" where the base and a model twice as wide differ; a weight infinite
    in fan-in and fan-out (MuAdam's `ninf() == 2`), with m its fan-in over the base's, takes
    init std x m^-1/2 and Adam LR x 1/m; the rest as standard (the readout: output_mult).
    Attention keeps 1/sqrt(H): the head dimension is kept, so muP's 1/H changes nothing."""
    table = param_table(cfg)
    if cfg.param != "mup":
        return {name: (1.0, 1.0) for name in table}
    base, delta = (param_table(width_config(cfg, w))
                   for w in (cfg.mup_base_width, 2 * cfg.mup_base_width))
    out = {}
    for name, spec in table.items():
        inf = {d for d, a in enumerate(spec.axes)
               if a != "layers" and base[name].shape[d] != delta[name].shape[d]}
        fan_out = {d for d, a in enumerate(spec.axes) if a != "layers"} - set(spec.fan_in)
        if spec.fan_in and inf & set(spec.fan_in) and inf & fan_out:
            m = (math.prod(spec.shape[d] for d in spec.fan_in)
                 / math.prod(base[name].shape[d] for d in spec.fan_in))
            out[name] = (m ** -0.5, 1 / m)
        else:
            out[name] = (1.0, 1.0)
    return out


def lr_multipliers(cfg: ModelConfig) -> dict | None:
    """The Adam LR multiplier of every parameter (a params-shaped pytree), None if all are 1."""
    scales = mup_scales(cfg)
    return None if all(lr == 1.0 for _, lr in scales.values()) else \
        nest({name: lr for name, (_, lr) in scales.items()})
