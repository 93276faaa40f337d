"""The laboratory's record, written and read in one place: results/search.json (every harness
group's settings, machine and each member's outcome) and the stored curves (what each member
keeps of its per-step metrics: results/curves/GROUP/MEMBER.npz, the search's first groups in
results/search/GROUP.npz), each written whole and checked against its sha256 when read.

    python -m lab.experiments --slim   # rewrite the stored curves to what they keep now
"""

import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import zipfile

import numpy as np

from cli import UserError, written_whole
from lab.probe import PROBE_KEYS
from lab.rows import ZLOSS_ROWS

OUT = pathlib.Path("results/search.json")


CURVES = pathlib.Path("results/search")  # the groups run before the evidence: GROUP.npz


SEED_CURVES = pathlib.Path("results/curves")  # since: GROUP/seedN.npz, one file per member


# What a member's stored curve keeps of the step's metrics, so that results/ stays light (about
# 45 kB a member, under 1 MB a row): the per-step series a rule or a table reads, as the step
# wrote them (float32) -- the loss and the update norm (the spike and level-shift rules), the
# attention logit's max over the layers (the max-logit columns read only the maximum), skipped
# steps (the z-loss rows also the output logits' max and log Z) -- and the held-out evals. The
# groups early warning reads per layer (lab/foresight.py) keep every series, the per-layer ones
# in float16; the switch's source also keeps Adam's relative step per layer (|dW| / |W|, in
# float16), from which its matched angle is taken.
CURVE_KEYS = ("loss", "update_norm", "attn_logit_max", "skipped", "eval_step", "eval_loss",
              "first_step", *PROBE_KEYS)
OUTPUT_LOGIT_KEYS = ("out_logit_max", "log_z")  # kept by the z-loss rows, whose table reads them
FULL_CURVES = ("story8", "story8-qk", "story8-signals", "story8-signals-qk")
RATIO_KEYS = {"story8-switch-src": ("update_ratio_per_layer",)}
ZLOSS_NAMES = {g.name for g in ZLOSS_ROWS}
CURVE_F32 = ("loss", "grad_norm", "update_norm", "attn_logit_max", "skipped", "out_logit_max",
             "log_z", "eval_step", "eval_loss", "first_step", *PROBE_KEYS)


def read_npz(path: pathlib.Path, fix: str) -> dict[str, np.ndarray]:
    """Every array of an .npz the harness wrote (no pickle); a missing, truncated or emptied
    file, or one that is no .npz, is one line naming it and `fix`."""
    try:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise UserError(f"{path} is missing: {fix}") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: damaged): {fix}") from None


# The vector instructions XLA:CPU chooses its kernels by: two CPUs with one marketing name
# ("AMD EPYC") but other ISA gave other bits from step 4 on.
ISA_PREFIXES = ("sse4", "avx", "fma", "f16c", "amx")


def cpu_identity(cpuinfo: str) -> dict:
    """The CPU exactly, from /proc/cpuinfo's first processor: its name, family, model,
    stepping, and the ISA flags XLA:CPU can use."""
    first = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines()
                 if ":" in line)
    first = {k.strip(): v.strip() for k, v in first.items()}
    return {"cpu": first.get("model name", platform.processor()),
            "cpu_family": first.get("cpu family"), "cpu_model": first.get("model"),
            "cpu_stepping": first.get("stepping"),
            "isa": sorted(f for f in first.get("flags", "").split()
                          if f.startswith(ISA_PREFIXES))}


# What must match for a row to repeat bit for bit: the CPU exactly, the cores the process may
# use, JAX, and the text trained on (the harness adds that).
BITWISE_KEYS = ("cpu", "cpu_family", "cpu_model", "cpu_stepping", "isa", "affinity", "jax")


def machine() -> dict:
    """This machine as a row records it: the CPU exactly (cpu_identity), cores, versions."""
    try:
        cpu = cpu_identity(pathlib.Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"cpu": platform.processor()}
    return cpu | {"cores": os.cpu_count(), "jax": importlib.metadata.version("jax"),
                  "python": platform.python_version(), "platform": platform.platform(),
                  "affinity": sorted(os.sched_getaffinity(0))}


def cpu_label(m: dict) -> str:
    """"AMD EPYC (family 25, model 1, stepping 1)": a machine record's CPU exactly, as a row's
    `cpu` names it (a row that names only "AMD EPYC" takes any of them)."""
    return (f"{m.get('cpu')} (family {m.get('cpu_family')}, model {m.get('cpu_model')}, "
            f"stepping {m.get('cpu_stepping')})")


def same_bits(ran: dict, now: dict) -> list[str]:
    """The fields of BITWISE_KEYS on which two machine records differ (a record older than a
    field does not name it: that field is listed as unknown)."""
    return [k if k in ran else f"{k} (not recorded)" for k in BITWISE_KEYS
            if ran.get(k) != now.get(k)]


def machine_name(m: dict) -> str | None:
    """A machine record's accelerator, or its CPU model where it trained on the CPU."""
    return m["device"] if m.get("device", "cpu") != "cpu" else m.get("cpu")


def group_cpu(entry: dict) -> str | None:
    """The CPU model a recorded group ran on (its accelerator where it ran on one), each one
    joined where its LRs ran on several; None where its record names none (the first groups')."""
    cpus = [machine_name(s["machine"]) for s in entry.get("sessions", [])] or [
        machine_name(entry.get("machine", {}))]
    return " + ".join(dict.fromkeys(c for c in cpus if c)) or None


def lr_cpu(entry: dict, lr: float) -> str | None:
    """The CPU model or accelerator that trained LR `lr` of a recorded group: each session that
    set out to train it (a stopped LR goes on in a later one); None where no session says (its
    sessions predate `trains`)."""
    cpus = [machine_name(s["machine"]) for s in entry.get("sessions", [])
            if lr in s.get("trains", ())]
    return " + ".join(dict.fromkeys(c for c in cpus if c)) or None


def curve_arrays(group: str, a: dict) -> dict:
    """What a member of `group` keeps of its arrays `a` (CURVE_KEYS, or all in FULL_CURVES).
    Applied to what is stored already, it keeps the same (python -m lab.experiments --slim)."""
    if group in FULL_CURVES:
        return {k: v if k in CURVE_F32 else np.asarray(v, np.float16) for k, v in a.items()
                if k not in ("seconds", "chunk_seconds")}
    keys = CURVE_KEYS + (OUTPUT_LOGIT_KEYS if group in ZLOSS_NAMES else ())
    kept = {k: layer_max(a[k]) if k == "attn_logit_max" else a[k] for k in keys if k in a}
    return kept | {k: np.asarray(a[k], np.float16) for k in RATIO_KEYS.get(group, ()) if k in a}


def layer_max(logit: np.ndarray) -> np.ndarray:
    """[T, L] -> [T]: the max over the layers (NaN only where every layer is)."""
    return np.fmax.reduce(logit, axis=-1) if np.ndim(logit) == 2 else logit


def slim_curves(log=print) -> None:
    """Rewrite every stored curve to what curve_arrays keeps (the rows stored before it, and
    those a process started earlier wrote): the same file where nothing is left out."""
    rewritten = []
    for path in sorted(SEED_CURVES.glob("*/*.npz")):
        c = read_curve(path.parent.name, path.stem)
        kept = curve_arrays(path.parent.name, c)
        if kept.keys() == c.keys() and all(kept[k].shape == c[k].shape for k in c):
            continue
        with written_whole(path) as tmp:
            np.savez_compressed(tmp, **kept)
        rewritten.append(path)
        log(f"{path}: kept {', '.join(kept)}")
    record_checksums(SEED_CURVES, rewritten)
    # every curve not listed yet (a row a process started before this code wrote), as it is
    record_checksums(SEED_CURVES, sorted(SEED_CURVES.glob("*/*.npz")), replace=False)
    for path in sorted(CURVES.glob("*.npz")):  # the search's groups: their loss, grad norm, evals
        c = read_curve("", path.stem)
        kept = {k: c[k] for k in ("loss", "grad_norm", "eval_step", "eval_loss") if k in c}
        if kept.keys() != c.keys():
            with written_whole(path) as tmp:
                np.savez_compressed(tmp, **kept)
            record_checksums(CURVES, [path])
            log(f"{path}: kept {', '.join(kept)}")
    record_checksums(CURVES, sorted(CURVES.glob("*.npz")), replace=False)


def load() -> dict:
    """results/search.json, every group's record; a damaged file is one line naming it."""
    if not OUT.exists():
        return {"machine": {}, "groups": {}}
    try:
        record = json.loads(OUT.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{OUT} cannot be read ({type(e).__name__}): it is damaged; restore it "
                        f"(git checkout {OUT}) and run the same command again") from None
    if not isinstance(record, dict) or not isinstance(record.get("groups"), dict) or not all(
            isinstance(g, dict) and isinstance(g.get("members"), list)
            for g in record["groups"].values()):
        raise UserError(f"{OUT} is not the harness's record (no groups with members): restore "
                        f"it (git checkout {OUT}) and run the same command again")
    return record


def save_group(name: str, entry: dict) -> None:
    """Add one group's record to results/search.json, under a lock: several harness processes
    (one per core) may finish groups at the same time."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT.with_suffix(".lock"), "w") as lock:  # not a result: .gitignore has it
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = load()
        record["groups"][name] = entry
        with written_whole(OUT) as tmp:
            tmp.write_text(json.dumps(record, indent=0) + "\n")  # a value a line, unindented


def read_curve(group: str, member: str) -> dict[str, np.ndarray]:
    """The stored curve results/curves/GROUP/MEMBER.npz (MEMBER: seedN or lrLR-seedN), or with
    group "" the search's results/search/MEMBER.npz: every array. A missing or damaged file, or
    one whose bytes are not those the harness wrote (its sha256 against the folder's
    sha256.json), is one line naming it."""
    root = SEED_CURVES if group else CURVES
    path = (root / group if group else root) / f"{member}.npz"
    fix = (f"restore it (git checkout {path}), or make it again: python -m lab.experiments "
           f"{group or member}, its group taken out of results/search.json first")
    arrays = read_npz(path, fix)
    want = read_checksums(root).get(path.relative_to(root).as_posix())
    if want is not None and sha256(path) != want:
        raise UserError(f"{path} is not the file the harness wrote (its sha256 differs from "
                        f"{root / 'sha256.json'}'s): {fix}")
    return arrays


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_checksums(root: pathlib.Path) -> dict[str, str]:
    """ROOT/sha256.json: each stored curve's sha256 as written, by its path under ROOT."""
    path = root / "sha256.json"
    if not path.exists():
        return {}
    try:
        sums = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}): restore it (git checkout "
                        f"{path})") from None
    if not isinstance(sums, dict):
        raise UserError(f"{path} is not a checksum record: restore it (git checkout {path})")
    return sums


def record_checksums(root: pathlib.Path, paths, replace: bool = True) -> None:
    """Enter each written file's sha256 into ROOT/sha256.json (under the record's lock: one
    process per core may write at once); with replace=False only files it does not list."""
    with open(OUT.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sums = read_checksums(root)
        for path in paths:
            key = path.relative_to(root).as_posix()
            if replace or key not in sums:
                sums[key] = sha256(path)
        with written_whole(root / "sha256.json") as tmp:
            tmp.write_text(json.dumps(dict(sorted(sums.items())), indent=0) + "\n")


def seed_curve(group: str, seed: int) -> dict:
    """A member's stored curve as report.py reads a run: per-step arrays indexed by "step"
    (a fork's start at its fork step), and its evals."""
    c = read_curve(group, f"seed{seed}")
    first = int(c["first_step"])
    n = len(c["loss"])
    return {"step": np.arange(first, first + n), "loss": c["loss"].astype(np.float64),
            "update_norm": c["update_norm"].astype(np.float64),
            "attn_logit_max": layer_max(c["attn_logit_max"]), "eval_step": c["eval_step"],
            "eval_loss": c["eval_loss"], "first_step": first}


