"""Text from a run's checkpoint: a jitted decode step over a KV cache.

    python sample.py runs/default --prompt "def " --max-new-tokens 200 --top-k 50
    python sample.py runs/default --step 200 --prompt "import " --temperature 0   # greedy

The prompt is encoded with the run's tokenizer (`tokenizer.json` beside its data, as
`data.py prepare` writes it), else as UTF-8 bytes; the output is decoded the same way (invalid
bytes replaced). The prompt is run through the model once (prefill), then one token at a time
reads the cache, all in one compiled function (no recompilation, no host round trip per
token). Positions past the sequence length the model was trained on are allowed, and said to be
untrained.
"""

import dataclasses
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro

import attention as A
from cli import UserError, entry_point, simple_command
from config import TrainConfig, load_checkpointed
from export import restore_params
from model import (
    ModelConfig,
    gather_weights,
    mlp,
    output_projection,
    qkv,
    readout_input,
    rms_norm,
    scaled_embedding,
)

# ---------------------------------------------------------------------------------------------
# Decoding with a KV cache: the same math as model.py's `forward`, one new chunk at a time

def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Keys and values of every layer for `length` positions, and how many are filled."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype),
            "pos": jnp.zeros((), jnp.int32)}


def forward_cached(params: dict, tokens_BT, cache: dict, cfg: ModelConfig):
    """Logits [B, T, V] of T new tokens at positions cache["pos"]..+T-1, attending to every
    earlier position through the cache; returns (logits, the cache with them added). For one
    device, outside any mesh (sampling): the params are plain, unsharded arrays. The block is
    model.forward's (qkv, mlp); its attention is the reference form over the cache's keys."""
    dtype, pos = jnp.dtype(cfg.dtype), cache["pos"]
    top = gather_weights(params, cfg, dtype)
    x_BTD = scaled_embedding(top["embed"][tokens_BT], cfg)

    def block(x_BTD, layer):
        layer_params, k_cache_BSKH, v_cache_BSKH = layer
        p = gather_weights(layer_params, cfg, dtype)
        h_BTD = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
        q_BTNH, k_BTKH, v_BTKH = qkv(h_BTD, p, cfg, pos)
        k_cache_BSKH = jax.lax.dynamic_update_slice(k_cache_BSKH, k_BTKH, (0, pos, 0, 0))
        v_cache_BSKH = jax.lax.dynamic_update_slice(v_cache_BSKH, v_BTKH, (0, pos, 0, 0))
        out_BTNH, _ = A.dense(q_BTNH, k_cache_BSKH, v_cache_BSKH, q_offset=pos,
                              softcap=cfg.attn_softcap)
        x_BTD = x_BTD + output_projection(out_BTNH, h_BTD, p, cfg)
        return x_BTD + mlp(rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps), p), (k_cache_BSKH,
                                                                                v_cache_BSKH)

    x_BTD, (k, v) = jax.lax.scan(block, x_BTD, (params["layers"], cache["k"], cache["v"]))
    logits_BTV = readout_input(rms_norm(x_BTD, top["final_norm"], cfg.norm_eps), cfg) @ top["head"]
    return logits_BTV.astype(jnp.float32), {"k": k, "v": v, "pos": pos + tokens_BT.shape[1]}


@dataclasses.dataclass(frozen=True)
class SampleArgs:
    run: tyro.conf.Positional[str]  # a train.py run directory
    prompt: str = "def "
    step: int | None = None  # the checkpoint; default the latest
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 = greedy (the most likely token every time)
    top_k: int = 50  # sample among the k most likely tokens; 0 = all
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens <= 0 or self.top_k < 0 or not 0 <= self.temperature < np.inf:
            raise ValueError("--max-new-tokens must be positive, --top-k >= 0 and "
                             "--temperature a finite number >= 0")


def codec(cfg: TrainConfig):
    """(encode, decode) of the run's tokens: its tokenizer.json, or UTF-8 bytes for a byte-level
    run (vocab 256). A prompt the shell could not decode as UTF-8 keeps its raw bytes."""
    tokenizer = pathlib.Path(cfg.data.source) / "tokenizer.json" if cfg.data.source else None
    if tokenizer is not None and tokenizer.is_file():
        import tokenizers
        try:
            tok = tokenizers.Tokenizer.from_file(str(tokenizer))
        except Exception as e:  # the library's own error types: not a tokenizer file
            raise UserError(f"{tokenizer} is not a tokenizer.json ({type(e).__name__}): "
                            "restore the file `data.py prepare` wrote") from None

        def encode(text):
            try:
                text.encode("utf-8")  # a raw byte the shell kept (a surrogate) is no text
                return tok.encode(text).ids
            except UnicodeEncodeError:
                raise UserError("--prompt is not valid UTF-8: a BPE run's tokenizer needs "
                                "text") from None
        return encode, (lambda ids: tok.decode(list(ids)))
    if cfg.model.vocab_size != 256:
        raise UserError(f"no tokenizer.json in {cfg.data.source or 'the run'}: this run's "
                        f"{cfg.model.vocab_size}-token vocabulary is not bytes; put the "
                        "tokenizer.json `data.py prepare` wrote beside its shards")
    return (lambda text: list(text.encode("utf-8", "surrogateescape")),
            lambda ids: bytes(ids).decode("utf-8", "replace"))


def make_generate(cfg: ModelConfig, temperature: float, top_k: int):
    """(params, prompt [1, P], cache, keys [N]) -> N new token ids: the prompt through the model
    once (prefill), then N - 1 single-token steps over the cache in a `lax.scan`: one compiled
    function, one dispatch, no host round trip per token."""
    def pick(logits_BV, key):
        if temperature == 0:
            return jnp.argmax(logits_BV, axis=-1)
        if top_k:
            kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
            logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
        return jax.random.categorical(key, logits_BV / temperature, axis=-1)

    def generate(params, prompt_BP, cache, keys):
        logits_BPV, cache = forward_cached(params, prompt_BP, cache, cfg)
        first_B = pick(logits_BPV[:, -1], keys[0])

        def step(carry, key):
            token_B, cache = carry
            logits_B1V, cache = forward_cached(params, token_B[:, None], cache, cfg)
            token_B = pick(logits_B1V[:, -1], key)
            return (token_B, cache), token_B
        _, rest_NB = jax.lax.scan(step, (first_B, cache), keys[1:])
        return jnp.concatenate([first_B[None], rest_NB])[:, 0]
    return jax.jit(generate)


def generate(params: dict, cfg: ModelConfig, prompt: list[int], args: SampleArgs
             ) -> tuple[list[int], float]:
    """The new token ids, and the seconds they took (compiled ahead, so without the compile)."""
    params = jax.tree.map(jnp.asarray, params)
    inputs = (params, jnp.asarray([prompt], jnp.int32),
              init_cache(cfg, 1, len(prompt) + args.max_new_tokens),
              jax.random.split(jax.random.key(args.seed), args.max_new_tokens))
    compiled = make_generate(cfg, args.temperature, args.top_k).lower(*inputs).compile()
    t0 = time.perf_counter()
    ids = np.asarray(compiled(*inputs))
    return ids.tolist(), time.perf_counter() - t0


def sample(args: SampleArgs) -> str:
    run = pathlib.Path(args.run)
    cfg, step = load_checkpointed(run, args.step, purpose=" to sample from")
    encode, decode = codec(cfg)
    prompt = encode(args.prompt)
    if not prompt or len(prompt) > cfg.data.seq_len:
        raise UserError(f"the prompt is {len(prompt)} tokens: give 1 to {cfg.data.seq_len} (the "
                        "model's sequence length)")
    if max(prompt) >= cfg.model.vocab_size:
        raise UserError(f"the prompt holds token {max(prompt)}, outside the model's vocab of "
                        f"{cfg.model.vocab_size}")
    if args.top_k > cfg.model.vocab_size:
        raise UserError(f"--top-k {args.top_k} exceeds the vocabulary of "
                        f"{cfg.model.vocab_size}: give at most that (0 = all)")
    m = cfg.model
    cache = 2 * m.n_layers * (len(prompt) + args.max_new_tokens) * m.n_kv_heads * m.head_dim * 4
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if cache > memory // 2:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} needs a {cache / 2**30:.0f} GiB "
                        f"KV cache, more than half of this machine's {memory / 2**30:.0f} GiB: "
                        "ask for fewer tokens")
    params = restore_params(run, step, cfg)
    ids, seconds = generate(params, cfg.model, prompt, args)
    total = len(prompt) + len(ids)
    note = (f"; positions past {cfg.data.seq_len} were never trained on"
            if total > cfg.data.seq_len else "")
    print(args.prompt + decode(ids))
    print(f"\n[{len(ids)} tokens from step {step} of {run} in {seconds:.2f} s (prefill "
          f"included, compile not): {len(ids) / seconds:.0f} tokens/s{note}]", file=sys.stderr)
    return decode(ids)


main = simple_command(SampleArgs, sample, __doc__, "sample.py")


if __name__ == "__main__":
    entry_point(main)
