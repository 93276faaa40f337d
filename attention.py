"""Causal grouped-query attention in the forms `--model.attention` selects.

    out_BTNH, logit_max = attend(q_BTNH, k_BTKH, v_BTKH, form, block, spec)   # q, k after RoPE

Every form computes softmax(q k^T / sqrt(H), causal) v, and the max |q.k / sqrt(H)| over the
entries attention uses (the causal ones): the statistic that explodes without QK-Norm. The
statistic is a metric and carries no gradient. With `softcap` c > 0 the scores s become
c * tanh(s / c) before the softmax (Gemma 2's attention soft-capping; the statistic stays the
uncapped one, the logit growth the cap hides); every form but cudnn has it.

    dense      the reference, and the cached decode's: scores [B, K, G, T, S] with K and V
               broadcast over each KV head's G query heads; memory O(T^2) per layer
    grouped    each KV head's G query heads folded into the rows of one score matmul,
               [B, K, T*G, H] x [B, K, H, S]: no broadcast of K and V; still O(T^2)
    blockwise  FlashAttention (Dao et al. 2205.14135) in JAX: online softmax over key blocks,
               blocks above the diagonal never computed, and a custom_vjp whose backward pass
               recomputes each block's probabilities from the saved log-sum-exp instead of
               storing them: memory O(T * block) per layer (a sequence of one block, T <=
               block, runs without loops, its queries in chunks of 32 positions that skip
               the keys after them, and keeps its probabilities instead)
    cudnn      jax.nn.dot_product_attention(implementation="cudnn"): NVIDIA GPUs, bf16 / fp16
    auto       cudnn on a GPU with a 16-bit dtype, else blockwise (bench/README.md times the
               forms on the CPU)

Every form runs per device under `jax.shard_map` (batch over "data", heads over "model"), so
its loops see plain local arrays.
"""

import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax import P

Form = typing.Literal["auto", "dense", "grouped", "blockwise", "cudnn"]
FORMS = typing.get_args(Form)
_MASKED = -1e30


def resolve(form: str, dtype: str, backend: str | None = None, softcap: float = 0.0) -> str:
    """The form `auto` stands for on this platform (never cudnn with a soft-cap, which the
    library call lacks); other forms as given."""
    if form != "auto":
        return form
    backend = backend or jax.default_backend()
    return ("cudnn" if backend == "gpu" and dtype in ("bfloat16", "float16") and not softcap
            else "blockwise")


def cap(s, softcap: float):
    """Gemma 2's soft-cap c * tanh(s / c) (c = 0: none)."""
    return softcap * jnp.tanh(s / softcap) if softcap else s


def check_platform(form: str, platform: str) -> None:
    if form == "cudnn" and platform != "gpu":
        raise ValueError(f"--model.attention cudnn needs an NVIDIA GPU, and these devices are "
                         f"{platform}: use --model.attention auto")


def attend(q_BTNH, k_BTKH, v_BTKH, form: str, block: int, spec: P, softcap: float = 0.0):
    """Attention output [B, T, N, H] and the max |attention logit| (a float32 scalar), for
    arrays sharded as `spec` (model.py's table: batch over "data", heads over "model")."""
    if softcap and form == "cudnn":
        raise ValueError("the cudnn attention form has no soft-cap: use blockwise")
    local = {"dense": lambda q, k, v: dense(q, k, v, softcap=softcap),
             "grouped": lambda q, k, v: grouped(q, k, v, softcap), "cudnn": cudnn,
             "blockwise": lambda q, k, v: blockwise(q, k, v, block, softcap)}[form]

    def per_device(q, k, v):
        out, logit_max = local(q, k, v)
        return out, logit_max[None]  # one per device; their max is taken outside

    # check_vma=False: the loops' carries start as fresh zeros, which the check would have
    # us mark as device-varying one by one.
    out_BTNH, maxes = jax.shard_map(per_device, in_specs=(spec, spec, spec),
                                    out_specs=(spec, P(tuple(a for a in spec if a))),
                                    check_vma=False)(q_BTNH, k_BTKH, v_BTKH)
    return out_BTNH, jnp.max(maxes)


def dense(q_BTNH, k_BSKH, v_BSKH, q_offset=0, softcap: float = 0.0):
    """The reference form. Query t sits at position q_offset + t and sees the keys at positions
    up to its own: causal for training (q_offset 0), and for the cached decode, whose queries
    start at the cache's fill level and whose unfilled tail lies past every query."""
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1:3]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    logits_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                              preferred_element_type=jnp.float32) / math.sqrt(H)
    causal_TS = _causal(q_offset, 0, (T, S), 1)
    logit_max = jnp.max(jnp.where(causal_TS, jnp.abs(logits_BKGTS), 0.0))
    probs_BKGTS = jax.nn.softmax(jnp.where(causal_TS, cap(logits_BKGTS, softcap), _MASKED),
                                 axis=-1)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH)
    return out_BTKGH.reshape(B, T, N, H), jax.lax.stop_gradient(logit_max)


def head_logit_max(q_BTNH, k_BTKH, spec: P, chunk: int = 512):
    """[N] the signed max of q.k / sqrt(H) of each query head over the causal entries: QK-Clip's
    statistic (optim.py) as Kimi K2 (arXiv 2507.20534, Alg. 1), MaxText's qk_clip_utils.py
    and Megatron-LM take it (a head whose logits are only large and negative is not clipped;
    the logged instability statistic, attn_logit_max, stays the |max|). Per device like
    `attend`. It recomputes the scores the attention form already computed: ~one more q k^T
    matmul per layer, paid only while QK-Clip is on."""
    maxes_DN = jax.shard_map(lambda q, k: chunked_logit_max(q, k, chunk, per_head=True)[None],
                             in_specs=(spec, spec), out_specs=P(spec[0], spec[2]),
                             check_vma=False)(q_BTNH, k_BTKH)
    return jnp.max(maxes_DN, axis=0)


def chunked_logit_max(q_BTNH, k_BTKH, chunk: int = 512, per_head: bool = False):
    """The max |q.k / sqrt(H)| over the causal entries (a scalar), or with `per_head` each query
    head's signed max ([N]), from a pass over the scores one chunk of query positions at a
    time: forward only, without gradient, memory O(T * chunk)."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    G = N // K
    q_BTNH, k_BTKH = jax.lax.stop_gradient((q_BTNH / math.sqrt(H), k_BTKH))
    c = min(chunk, T)
    q_nBKRH, _, _, n = _blocks(q_BTNH, k_BTKH, k_BTKH, c)

    def chunk_max(i):
        s_BKRS = jnp.einsum("bkrh,bskh->bkrs", q_nBKRH[i], k_BTKH,
                            preferred_element_type=jnp.float32)
        real = (i * c + jnp.arange(c * G) // G < T)[:, None]  # not a padded query position
        seen_RS = _causal(i * c, 0, s_BKRS.shape[-2:], G) & real
        if per_head:  # rows are position-major: row r is position r // G, head r % G
            s = jnp.where(seen_RS, s_BKRS, -jnp.inf).reshape(B, K, c, G, T)
            return jnp.max(s, axis=(0, 2, 4)).reshape(N)
        return jnp.max(jnp.where(seen_RS, jnp.abs(s_BKRS), 0.0))
    return jnp.max(jax.lax.map(chunk_max, jnp.arange(n)), axis=0)


def _grouped_rows(x_BTNH, K):
    """[B, T, N, H] -> [B, K, T*G, H]: row t*G + g is query head g of KV head k at position t."""
    B, T, N, H = x_BTNH.shape
    return x_BTNH.reshape(B, T, K, N // K, H).transpose(0, 2, 1, 3, 4).reshape(B, K, -1, H)


def _ungroup(x_BKRH, T):
    B, K, R, H = x_BKRH.shape
    return x_BKRH.reshape(B, K, T, R // T, H).transpose(0, 2, 1, 3, 4).reshape(B, T, -1, H)


def grouped(q_BTNH, k_BTKH, v_BTKH, softcap: float = 0.0):
    B, T, N, H = q_BTNH.shape
    K, G = k_BTKH.shape[2], N // k_BTKH.shape[2]
    q_BKRH = _grouped_rows(q_BTNH * jnp.asarray(1 / math.sqrt(H), q_BTNH.dtype), K)
    logits_BKRS = jnp.einsum("bkrh,bskh->bkrs", q_BKRH, k_BTKH,
                             preferred_element_type=jnp.float32)
    causal_RS = _causal(0, 0, (T * G, T), G)
    logit_max = jnp.max(jnp.where(causal_RS, jnp.abs(logits_BKRS), 0.0))
    probs_BKRS = jax.nn.softmax(jnp.where(causal_RS, cap(logits_BKRS, softcap), _MASKED),
                                axis=-1)
    out_BKRH = jnp.einsum("bkrs,bskh->bkrh", probs_BKRS.astype(v_BTKH.dtype), v_BTKH)
    return _ungroup(out_BKRH, T), jax.lax.stop_gradient(logit_max)


def cudnn(q_BTNH, k_BTKH, v_BTKH, implementation="cudnn"):
    """The library's fused attention (cuDNN's flash kernel on NVIDIA GPUs), and the statistic
    from chunked_logit_max (forward only, memory O(T * 512))."""
    out_BTNH = jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True,
                                            implementation=implementation)
    return out_BTNH, chunked_logit_max(q_BTNH, k_BTKH)


# ---------------------------------------------------------------------------------------------
# blockwise: the layout is [n blocks, B, K, rows, H]; a query block holds c positions x G heads
# (c*G rows, position-major), a key block c positions.

def _blocks(q_BTNH, k_BTKH, v_BTKH, c):
    """Pad T to a multiple of c and split it into blocks (padded keys sit after every real
    query, so the causal mask hides them; padded query rows are dropped at the end)."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    n = -(-T // c)
    pad = [(0, 0), (0, n * c - T), (0, 0), (0, 0)]

    def split(x, group):
        x = jnp.pad(x, pad).reshape(B, n, c, K, group, H)
        return x.transpose(1, 0, 3, 2, 4, 5).reshape(n, B, K, c * group, H)
    return split(q_BTNH, N // K), split(k_BTKH, 1), split(v_BTKH, 1), n


def _causal(q_start, k_start, shape, G):
    """Rows of queries from position q_start (G heads per position) against the columns of
    keys from position k_start: True where the query's position >= the key's."""
    rows, cols = shape
    return (q_start + jnp.arange(rows) // G)[:, None] >= (k_start + jnp.arange(cols))[None, :]


def blockwise(q_BTNH, k_BTKH, v_BTKH, block: int, softcap: float = 0.0):
    B, T, N, H = q_BTNH.shape
    c = min(block, T)
    q_BTNH = q_BTNH * jnp.asarray(1 / math.sqrt(H), q_BTNH.dtype)
    q, k, v, n = _blocks(q_BTNH, k_BTKH, v_BTKH, c)
    out_nBKRH, logit_max = (_flash if n > 1 else _one_block)(q, k, v, softcap)
    K = k.shape[2]
    out_BncKGH = out_nBKRH.reshape(n, B, K, c, N // K, H).transpose(1, 0, 3, 2, 4, 5)
    return out_BncKGH.reshape(B, n * c, N, H)[:, :T], logit_max


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, softcap):
    out, _, logit_max = _flash_forward(q, k, v, softcap)
    return out, logit_max


def _scores(q_BKRH, k_BKSH, G: int, q_start: int | None, softcap: float):
    """A block's scores (soft-capped) and their max |logit| (uncapped) over the causal
    entries. q_start: the position of the block's first query relative to its first key where
    the diagonal crosses the block (the only blocks that need a mask); None for a block left
    of the diagonal."""
    s_BKRS = jnp.einsum("bkrh,bksh->bkrs", q_BKRH, k_BKSH, preferred_element_type=jnp.float32)
    if q_start is None:
        return cap(s_BKRS, softcap), jnp.max(jnp.abs(s_BKRS))
    causal_RS = _causal(q_start, 0, s_BKRS.shape[-2:], G)
    return (jnp.where(causal_RS, cap(s_BKRS, softcap), _MASKED),
            jnp.max(jnp.where(causal_RS, jnp.abs(s_BKRS), 0.0)))


def _cap_slope(s_BKRS, softcap: float):
    """d(capped score) / d(score) = 1 - tanh^2, from the capped scores (masked ones: 0)."""
    return 1 - jnp.square(jnp.clip(s_BKRS / softcap, -1, 1)) if softcap else None


def _block_grads(q_BKRH, k_BKSH, v_BKSH, p_BKRS, d_out_BKRH, delta_BKR, slope_BKRS=None):
    """One (query block, key block) pair's share of dq, dk and dv, from its probabilities:
    dv = p^T do, ds = p * (do v^T - rowsum(do * out)) (times the soft-cap's slope), dq = ds k,
    dk = ds^T q."""
    f32 = dict(preferred_element_type=jnp.float32)
    dv_BKSH = jnp.einsum("bkrs,bkrh->bksh", p_BKRS.astype(v_BKSH.dtype), d_out_BKRH, **f32)
    dp_BKRS = jnp.einsum("bkrh,bksh->bkrs", d_out_BKRH, v_BKSH, **f32)
    ds_BKRS = p_BKRS * (dp_BKRS - delta_BKR[..., None])
    if slope_BKRS is not None:
        ds_BKRS = ds_BKRS * slope_BKRS
    ds_BKRS = ds_BKRS.astype(q_BKRH.dtype)
    dq_BKRH = jnp.einsum("bkrs,bksh->bkrh", ds_BKRS, k_BKSH, **f32)
    dk_BKSH = jnp.einsum("bkrs,bkrh->bksh", ds_BKRS, q_BKRH, **f32)
    return dq_BKRH, dk_BKSH, dv_BKSH


def _rowsum_d_out_out(d_out, out):
    return jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


_CHUNK = 32  # query positions per chunk of a one-block sequence


def _chunks(T: int) -> list[tuple[int, int]]:
    """A one-block sequence's query chunks, (first, end) positions: a chunk attends the keys
    before its end."""
    return [(first, min(first + _CHUNK, T)) for first in range(0, T, _CHUNK)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _one_block(q, k, v, softcap):
    """T <= block: one block, without loops. Its queries go in chunks of 32 positions, each
    against only the keys up to its last position: causal skipping at a finer grain than the
    block (bench/README.md has the measurements behind the chunk size). The chunks'
    probabilities, fewer than T^2 per head, are kept for the backward pass."""
    return _one_block_fwd(q, k, v, softcap)[0]


def _one_block_fwd(q, k, v, softcap):
    (q_BKRH,), (k_BKSH,), (v_BKSH,) = q, k, v
    G = q_BKRH.shape[2] // k_BKSH.shape[2]
    outs, probs, slopes, top = [], [], [], jnp.zeros((), jnp.float32)
    for first, end in _chunks(k_BKSH.shape[2]):
        s_BKRS, chunk_top = _scores(q_BKRH[:, :, first * G:end * G], k_BKSH[:, :, :end], G,
                                    first, softcap)
        p_BKRS = jax.nn.softmax(s_BKRS, axis=-1)
        slopes.append(_cap_slope(s_BKRS, softcap))
        outs.append(jnp.einsum("bkrs,bksh->bkrh", p_BKRS.astype(v.dtype), v_BKSH[:, :, :end],
                               preferred_element_type=jnp.float32))
        probs.append(p_BKRS)
        top = jnp.maximum(top, chunk_top)
    out = jnp.concatenate(outs, axis=2).astype(q.dtype)[None]
    return (out, top), (q, k, v, out, probs, slopes)


def _one_block_bwd(softcap, residuals, cotangents):
    q, k, v, out, probs, slopes = residuals
    d_out = cotangents[0]  # the statistic's cotangent is dropped: it carries no gradient
    (q_BKRH,), (k_BKSH,), (v_BKSH,), (d_out_BKRH,) = q, k, v, d_out
    delta_BKR = _rowsum_d_out_out(d_out, out)[0]
    B, K, S, H = k_BKSH.shape
    G = q_BKRH.shape[2] // S
    dq, dk, dv = [], jnp.zeros((B, K, S, H), jnp.float32), jnp.zeros((B, K, S, H), jnp.float32)
    for (first, end), p_BKRS, slope in zip(_chunks(S), probs, slopes):
        rows = slice(first * G, end * G)
        dq_c, dk_c, dv_c = _block_grads(q_BKRH[:, :, rows], k_BKSH[:, :, :end],
                                        v_BKSH[:, :, :end], p_BKRS, d_out_BKRH[:, :, rows],
                                        delta_BKR[:, :, rows], slope)
        pad = [(0, 0), (0, 0), (0, S - end), (0, 0)]
        dq.append(dq_c)
        dk, dv = dk + jnp.pad(dk_c, pad), dv + jnp.pad(dv_c, pad)
    return tuple(g[None].astype(x.dtype) for g, x in zip(
        (jnp.concatenate(dq, axis=2), dk, dv), (q, k, v)))


_one_block.defvjp(_one_block_fwd, _one_block_bwd)


def _flash_forward(q, k, v, softcap):
    G = q.shape[3] // k.shape[3]

    def query_block(i):
        q_BKRH = q[i]

        def key_block(j, carry, on_diagonal=False):
            m_BKR, l_BKR, acc_BKRH, top = carry
            s_BKRS, block_top = _scores(q_BKRH, k[j], G, 0 if on_diagonal else None, softcap)
            top = jnp.maximum(top, block_top)
            m_new = jnp.maximum(m_BKR, jnp.max(s_BKRS, axis=-1))
            p_BKRS = jnp.exp(s_BKRS - m_new[..., None])
            rescale = jnp.exp(m_BKR - m_new)
            acc_BKRH = acc_BKRH * rescale[..., None] + jnp.einsum(
                "bkrs,bksh->bkrh", p_BKRS.astype(v.dtype), v[j],
                preferred_element_type=jnp.float32)
            return m_new, l_BKR * rescale + jnp.sum(p_BKRS, axis=-1), acc_BKRH, top

        shape = q_BKRH.shape[:-1]
        init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(q_BKRH.shape, jnp.float32), jnp.zeros((), jnp.float32))
        carry = jax.lax.fori_loop(0, i, key_block, init)  # the blocks left of the diagonal
        m, total, acc, top = key_block(i, carry, on_diagonal=True)  # none right of it: causal
        return (acc / total[..., None]).astype(q.dtype), m + jnp.log(total), top

    out, lse, top = jax.lax.map(query_block, jnp.arange(q.shape[0]))
    return out, lse, jnp.max(top)


def _flash_fwd(q, k, v, softcap):
    out, lse, logit_max = _flash_forward(q, k, v, softcap)
    return (out, logit_max), (q, k, v, out, lse)


def _flash_bwd(softcap, residuals, cotangents):
    """Per key block j, over the query blocks i >= j: recompute p = exp(s - lse), then add
    the pair's share of dq, dk and dv."""
    q, k, v, out, lse = residuals
    d_out = cotangents[0]  # the statistic's cotangent is dropped: it carries no gradient
    delta = _rowsum_d_out_out(d_out, out)
    G = q.shape[3] // k.shape[3]

    def key_block(dq, j):
        def query_block(i, carry, on_diagonal=False):
            dq, dk_BKSH, dv_BKSH = carry
            s_BKRS, _ = _scores(q[i], k[j], G, 0 if on_diagonal else None, softcap)
            p_BKRS = jnp.exp(s_BKRS - lse[i][..., None])
            dq_i, dk_j, dv_j = _block_grads(q[i], k[j], v[j], p_BKRS, d_out[i], delta[i],
                                            _cap_slope(s_BKRS, softcap))
            return dq.at[i].add(dq_i), dk_BKSH + dk_j, dv_BKSH + dv_j

        zeros = jnp.zeros(k.shape[1:], jnp.float32)
        carry = query_block(j, (dq, zeros, zeros), on_diagonal=True)
        dq, dk, dv = jax.lax.fori_loop(j + 1, q.shape[0], query_block, carry)  # below it
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32),
                                jnp.arange(k.shape[0]))
    return dq.astype(q.dtype), dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)
