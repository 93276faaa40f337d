"""A run's checkpoint as a Hugging Face model folder, and back.

    python export.py runs/default --to hf/default            # the latest checkpoint
    python export.py runs/rescued --step 600 --to hf/rescued --check   # + compare in transformers
    python train.py --init-from-hf hf/default --run-dir runs/more ...   # a run from such a folder

Writes `config.json` and `model.safetensors` that transformers loads as `LlamaForCausalLM`
(without QK-Norm) or `Qwen3ForCausalLM` (with it) with the same logits; hf.py holds the layout.
"""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import tyro

from checkpoint import abstract_state, checkpoint_manager, restore_checkpoint, unreadable
from cli import UserError, check_new_folder, claim_partial, entry_point, simple_command
from config import load_checkpointed, make_tx
from data import TokenData
from distributed import MeshConfig, make_mesh
from hf import hf_config, to_hf
from model import forward


def restore_params(run: pathlib.Path, step: int, cfg) -> dict:
    """The parameters of a run's checkpoint, on one device, as NumPy arrays."""
    tx = make_tx(cfg)
    mesh = make_mesh(MeshConfig(1, 1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        try:
            state = restore_checkpoint(checkpoint_manager(run, read_only=True), step,
                                       abstract_state(cfg.model, tx, mesh))
        except Exception as e:
            raise unreadable(run, step, e, "export another with --step") from None
    return jax.tree.map(np.asarray, state["params"])


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    run: tyro.conf.Positional[str]  # a train.py run directory
    to: str  # the Hugging Face folder to write (must not exist, or be empty)
    step: int | None = None  # the checkpoint to export; default the latest
    check: bool = False  # load the folder with transformers (and torch), compare the logits


def check_extras() -> None:
    """--check needs torch and transformers, which requirements.txt leaves out: say so before
    anything is written."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("--check needs torch and transformers: pip install -r "
                        "requirements-check.txt (nothing was written)") from None


def check_with_transformers(folder: pathlib.Path, cfg, params: dict) -> float:
    """Max |logit difference| between transformers' model of `folder` and model.forward, on
    the first held-out window."""
    import torch
    import transformers
    tokens = TokenData(cfg.data, cfg.model.vocab_size).held_out_batches()[0, :1, :-1]
    transformers.utils.logging.disable_progress_bar()  # its weight-loading bar: not our output
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    with jax.set_mesh(make_mesh(MeshConfig(1, 1), jax.devices()[:1])):
        ours = np.asarray(forward(params, tokens, cfg.model)[0])
    diff = float(np.abs(theirs - ours).max())
    print(f"transformers {transformers.__version__} ({type(hf).__name__}): max |logit "
          f"difference| {diff:.2e} over {tokens.size} tokens (logits up to "
          f"{np.abs(ours).max():.1f})")
    return diff


PARTIAL_MARKER = "spikefix-export"


def export(args: ExportArgs) -> pathlib.Path:
    run, out = pathlib.Path(args.run), pathlib.Path(args.to)
    cfg, step = load_checkpointed(run, args.step)
    if cfg.model.attn_softcap:
        raise UserError(f"{run} soft-caps its attention scores (model.attn_softcap "
                        f"{cfg.model.attn_softcap:g}), which Llama and Qwen3 do not: no export")
    if cfg.model.qk_mult != 1.0:
        raise UserError(f"{run} multiplies its queries by model.qk_mult {cfg.model.qk_mult:g}, "
                        "which Qwen3 does not: no export")
    if cfg.model.attn_gate != "none":
        raise UserError(f"{run} gates its attention output (model.attn_gate), which Llama and "
                        "Qwen3 do not (Qwen3-Next does, with its own layout): no export")
    if cfg.model.embed_scale:
        raise UserError(f"{run} scales its embeddings by sqrt(d_model) (model.embed_scale), "
                        "which Llama and Qwen3 do not: no export")
    check_new_folder(out, "--to")
    if args.check:
        check_extras()
    from safetensors.numpy import save_file
    params = restore_params(run, step, cfg)
    tensors = to_hf(params, cfg.model)
    partial = claim_partial(out, PARTIAL_MARKER)  # renamed into place once complete
    (partial / "config.json").write_text(json.dumps(hf_config(cfg.model, cfg.data.seq_len),
                                                    indent=2))
    save_file(tensors, partial / "model.safetensors",
              metadata={"format": "pt", "spikefix_run": str(run), "spikefix_step": str(step)})
    (partial / PARTIAL_MARKER).unlink()
    if out.exists():
        out.rmdir()
    partial.rename(out)
    arch = hf_config(cfg.model, 0)["architectures"][0]
    print(f"wrote {out}: {arch}, {len(tensors)} tensors, step {step} of {run}")
    if args.check:
        check_with_transformers(out, cfg, params)
    return out


main = simple_command(ExportArgs, export, __doc__, "export.py")


if __name__ == "__main__":
    entry_point(main)
