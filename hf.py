"""Hugging Face's Llama / Qwen3 layout of a spikefix model, both ways: the config.json that
describes it, the tensor names and shapes (to_hf, from_hf), and reading such a folder's weights
for `train.py --init-from-hf` (load_hf). export.py writes such folders.

The layouts agree without any permutation: RoPE is rotate-half in both, query head n reads KV
head n // (n_heads / n_kv_heads) in both (HF's `repeat_kv`), RMSNorm is
x * rsqrt(mean(x^2) + eps) * weight in float32, and the head is untied. Only the weight matrices
are transposed to torch's [out, in] layout. With QK-Norm the model is Qwen3's: its q_norm /
k_norm, an RMSNorm over head_dim of each head before RoPE, is the same operation.
"""

import json
import pathlib

import numpy as np

from cli import UserError
from model import ModelConfig, param_table


def hf_config(cfg: ModelConfig, seq_len: int) -> dict:
    """The transformers config.json of a spikefix model."""
    arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    return {
        "architectures": [arch], "model_type": "qwen3" if cfg.qk_norm else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": seq_len,  # and as v5 has it:
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "use_sliding_window": False, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


# spikefix name -> (HF name with {layer} for the layer, how the array turns into HF's layout)
def _layout(cfg: ModelConfig) -> dict:
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn, mlp = "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
    names = {
        "embed": ("model.embed_tokens.weight", None),
        "final_norm": ("model.norm.weight", None),
        "head": ("lm_head.weight", (1, 0)),
        "layers/attn_norm": ("model.layers.{layer}.input_layernorm.weight", None),
        "layers/mlp_norm": ("model.layers.{layer}.post_attention_layernorm.weight", None),
        "layers/wq": (attn + "q_proj.weight", (D, N * H)),
        "layers/wk": (attn + "k_proj.weight", (D, K * H)),
        "layers/wv": (attn + "v_proj.weight", (D, K * H)),
        "layers/wo": (attn + "o_proj.weight", (N * H, D)),
        "layers/w_gate": (mlp + "gate_proj.weight", (1, 0)),
        "layers/w_up": (mlp + "up_proj.weight", (1, 0)),
        "layers/w_down": (mlp + "down_proj.weight", (1, 0)),
        "layers/q_norm": (attn + "q_norm.weight", None),
        "layers/k_norm": (attn + "k_norm.weight", None),
    }
    return {k: v for k, v in names.items() if k in param_table(cfg)}


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """spikefix params (a nested dict of arrays) -> {HF tensor name: float32 array}."""
    out = {}
    for key, (name, how) in _layout(cfg).items():
        x = np.asarray(params["layers"][key[7:]] if key.startswith("layers/") else params[key],
                       np.float32)
        for layer, w in enumerate(x) if key.startswith("layers/") else [(None, x)]:
            if how == (1, 0):
                w = w.T
            elif how is not None:  # a [D, N, H]-like weight: flatten to 2-D, then [out, in]
                w = w.reshape(how).T
            out[name.format(layer=layer)] = np.ascontiguousarray(w)
    return out


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The inverse of to_hf; a missing tensor or a shape that does not fit cfg is a UserError."""
    table, params = param_table(cfg), {"layers": {}}
    for key, (name, how) in _layout(cfg).items():
        shape = table[key].shape

        def get(n, want):
            if n not in tensors:
                raise UserError(f"the Hugging Face folder has no tensor {n}")
            if tuple(tensors[n].shape) != want:
                raise UserError(f"{n} is {list(tensors[n].shape)} in the Hugging Face folder "
                                f"but {list(want)} for these flags: give the folder's sizes")
            return np.asarray(tensors[n], np.float32)
        one = shape[1:] if key.startswith("layers/") else shape
        hf_shape = one[::-1] if how == (1, 0) else (how[1], how[0]) if how else one
        ws = [get(name.format(layer=i), hf_shape) for i in range(shape[0])] \
            if key.startswith("layers/") else [get(name, hf_shape)]
        ws = [w.T if how == (1, 0) else w.T.reshape(one) if how else w for w in ws]
        if key.startswith("layers/"):
            params["layers"][key[7:]] = np.stack(ws)
        else:
            params[key] = ws[0]
    return params


def load_hf(folder: pathlib.Path, cfg: ModelConfig) -> dict:
    """Parameters for `cfg` from a Hugging Face Llama / Qwen3 folder (config.json +
    model.safetensors), after checking that the folder's config describes the same model."""
    from safetensors.numpy import load_file
    try:
        hf = json.loads((folder / "config.json").read_text())
        tensors = load_file(folder / "model.safetensors")
    except Exception as e:  # OSError, JSON's, safetensors' own (a truncated file)
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"--init-from-hf {folder}: not a Hugging Face model folder with "
                        f"config.json and a readable model.safetensors ({cause})") from None
    if not isinstance(hf, dict):
        raise UserError(f"--init-from-hf {folder}/config.json is not a model config")
    if "rope_theta" not in hf:  # transformers 5 writes it under rope_parameters
        hf["rope_theta"] = (hf.get("rope_parameters") or {}).get("rope_theta")
    if hf.get("tie_word_embeddings") and "model.embed_tokens.weight" in tensors:  # tied head
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    if "head_dim" not in hf and isinstance(hf.get("num_attention_heads"), int):  # older configs
        hf["head_dim"] = hf.get("hidden_size", 0) // hf["num_attention_heads"]
    want = hf_config(cfg, 0)
    keys = ["architectures", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"]
    diffs = [f"{k} {hf.get(k)!r} (flags give {want[k]!r})" for k in keys if hf.get(k) != want[k]]
    diffs += [f"{k} {hf.get(k)!r} (flags give {want[k]!r})" for k in ("rms_norm_eps", "rope_theta")
              if not isinstance(hf.get(k), (int, float)) or not np.isclose(hf[k], want[k])]
    if diffs:
        raise UserError(f"--init-from-hf {folder} has {'; '.join(diffs)}: set the --model.* "
                        "flags to the folder's model")
    bad = [name for name, t in tensors.items() if not np.all(np.isfinite(t))]
    if bad:
        raise UserError(f"--init-from-hf {folder}: {bad[0]} holds non-finite values (NaN or "
                        "inf); nothing was trained from it")
    return from_hf(tensors, cfg)
