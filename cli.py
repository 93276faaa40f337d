"""What every command shares: one `UserError`, tyro parsing that fails in one line, `command`.

    @command                            # a UserError -> "error: ..." on stderr, exit 2
    def main(argv: list[str]) -> int:
        args = parse(Args, argv)        # a bad flag raises UserError, one line
        ...

    if __name__ == "__main__":
        entry_point(main)               # the heap kept (keep_heap), then main's exit status

A user mistake (a bad flag, a missing file, a run directory that holds another run) ends with
one line naming the problem and the fix, and exit status 2; never a traceback.
"""

import contextlib
import ctypes
import functools
import io
import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys

import tyro


class UserError(Exception):
    """A mistake in the command line, the data or the run directory: one line, exit 2."""


def parse(cls, args: list[str], **kwargs):
    """tyro.cli, with a parse error raised as a one-line UserError (--help still prints)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(cls, args=args, **kwargs)
    except SystemExit as e:
        if e.code:  # tyro draws a box around parse errors; a user error here is one line
            raise UserError(one_line(err.getvalue())) from None
        raise


def one_line(tyro_message: str) -> str:
    """tyro's boxed error (a title line, the message, a help pointer) as one line."""
    lines = [line.strip(" │╭╮╰╯─") for line in tyro_message.splitlines()]
    lines = [line for line in lines if line.strip("-") and not line.startswith(
        "For full helptext") and not line.endswith(" --help")]  # (rules: "-" off a terminal)
    text = " ".join(" ".join(lines[1:] or lines).split())
    text = re.sub(r"Error parsing (--\S+|[\w.]+): ", lambda m: m[1] + ": " if m[1][0] == "-"
                  else "", text)
    # "Unrecognized options: --optim.lrr, 1 Perhaps ...": name the flags, not their values
    text = re.sub(r"(Unrecognized options?: )((?:\S+, )*\S+)", lambda m: m[1] + ", ".join(
        x for x in m[2].split(", ") if x.startswith("-")) + ";", text).removesuffix(";")
    return as_flags(text)


def as_flags(text: str) -> str:
    """A config field named in a message ("optim.max_grad_norm") as the flag that sets it
    ("--optim.max-grad-norm"): one style for every check of the flags."""
    return re.sub(r"(?<![-\w./])(model|optim|data|mesh|dist|guard|wandb)\.([a-z][a-z0-9_]*)"
                  r"(?![\w.])",
                  lambda m: f"--{m[1]}.{m[2].replace('_', '-')}", text)


def command(main):
    """Decorate a command's `main(argv) -> int`: a UserError is printed as one line and
    becomes exit status 2. The libraries' own log lines (orbax's through absl, asyncio's) are
    silenced: each failure they would log also raises, and is reported in one line."""
    @functools.wraps(main)
    def guarded(argv: list[str]) -> int:
        for name in ("absl", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        sys.unraisablehook = quiet_orbax_leftovers
        try:
            return main(argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return guarded


# glibc's malloc maps each large buffer afresh and unmaps it when it is freed, so XLA:CPU's train
# step faults its buffers in again, page by page, every step (~120,000 faults a step on the cpu
# preset). In one heap that is never given back they are reused instead. Measured side by side
# with glibc's defaults, and what it costs in memory: bench/README.md, "The allocator".
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
HEAP = "SPIKEFIX_HEAP"  # "default": glibc's own settings


def keep_heap() -> bool:
    """Keep freed memory in this process's heap for the next step: one arena (set first, before
    JAX's threads allocate), no buffer mapped on its own, nothing trimmed below 2 GiB (glibc's
    mallopt). A no-op without glibc or with SPIKEFIX_HEAP=default; True where it was set."""
    if (how := os.environ.get(HEAP, "kept")) not in ("kept", "default"):
        raise UserError(f"{HEAP}={how}: it takes kept (the default) or default (glibc's own)")
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc has it; musl and macOS do not)
    except (OSError, AttributeError):
        return False
    return how == "kept" and all(libc.mallopt(option, value) == 1 for option, value in (
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))


def entry_point(main) -> None:
    """An entry point: the heap kept (keep_heap), then main(argv), its status the exit status."""
    try:
        keep_heap()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))


def simple_command(args_type, run, doc: str, prog: str):
    """The main(argv) of a command that parses its flags into `args_type` and calls run(args)
    (sample.py, export.py)."""
    @command
    def main(argv: list[str]) -> int:
        run(parse(args_type, argv, description=doc, prog=prog))
        return 0
    return main


def quiet_orbax_leftovers(unraisable, default=sys.unraisablehook) -> None:
    """Two kinds of orbax leftovers Python would print as "Exception ignored" tracebacks after
    a failure that is itself reported in one line: after a failed save, tensorstore's late
    callbacks find their asyncio event loop closed; after a failed restore (a damaged
    checkpoint), the reads of the other arrays, never awaited, raise again when collected at
    exit (in about 1 run of 4 here). Anything else is printed as usual."""
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine's
    closed_loop = (isinstance(unraisable.exc_value, RuntimeError)
                   and "Event loop is closed" in str(unraisable.exc_value))
    if not (closed_loop or (code is not None and "/orbax/" in code.co_filename)):
        default(unraisable)


def check_new_folder(path, flag: str) -> None:
    """Raise UserError unless `path` can become a new output folder: not an existing file or
    non-empty folder, no parent that is a file, and not inside a run's checkpoints (a folder
    named checkpoints beside a config.json), where orbax would take it for a checkpoint. A
    folder elsewhere in a run directory (RUN/hf) is fine: train.py reads only its own files
    there (config.json, metrics.jsonl, events.jsonl, checkpoints/) and leaves the rest."""
    path = pathlib.Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(f"{flag} {path} exists and is not empty: choose a new folder")
    for parent in path.absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {parent} is a file, not a folder")
        if parent.name == "checkpoints" and (parent.parent / "config.json").is_file():
            raise UserError(f"{flag} {path} lies inside the checkpoints of the run "
                            f"{parent.parent}: choose a folder outside it")


def claim_partial(out, marker: str):
    """A fresh `OUT.partial` folder to write into before renaming it to OUT, holding the file
    `marker`. One that a killed earlier attempt of this program left (it holds `marker`) is
    replaced; any other is the user's, and refused, never deleted."""
    partial = pathlib.Path(f"{out}.partial")
    if partial.exists():
        if not (partial / marker).is_file():
            raise UserError(f"{partial} exists and was not written by this program: move it "
                            "away, or choose another folder")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / marker).write_text("written by spikefix; renamed into place once complete\n")
    return partial


def fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


@contextlib.contextmanager
def written_whole(path, fix: str = "make room (or choose another place) and run the same "
                  "command again: nothing written before is lost"):
    """Write a file whole or not at all: yields a path beside `path` (NAME.partial.SUFFIX) to
    write, then renames it into place, so a kill leaves the old file or the new one, never half.
    A full disk or an unwritable folder is one line (ending with `fix`); the partial file goes.
    Every file the program rewrites is written this way."""
    tmp = path.with_name(f"{path.stem}.partial{path.suffix}")
    try:
        yield tmp
        tmp.replace(path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise UserError(f"cannot write {path}: {e.strerror or e}; {fix}") from None


def drop_torn_line(path: pathlib.Path, announce=print) -> None:
    """Cut a last line left half-written by a crash (a host failure, a full disk), so that the
    records appended after it stay one per line."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        tail_start = max(0, f.seek(0, os.SEEK_END) - 2**20)
        f.seek(tail_start)
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            f.truncate(tail_start + tail.rfind(b"\n") + 1)
            announce(f"note: dropped the cut-off last line of {path} (a crash mid-write)")


def strict_json(obj, indent: int | None = None) -> str:
    """JSON in which NaN and +-inf are null (json.dumps would write the non-standard NaN /
    Infinity tokens that strict readers reject)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, (list, tuple)) else v
    return json.dumps(clean(obj), indent=indent, allow_nan=False)
