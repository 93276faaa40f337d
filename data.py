"""Token sources and a deterministic `batch(step)`.

    data = TokenData(DataConfig(seq_len=128, batch_size=32))
    tokens_BT1 = data.batch(step)        # int32 [B, T+1]: a pure function of (seed, step, source)
    held_out = data.held_out_batches()   # int32 [C, B, T+1]: the fixed held-out set

Because a batch is a function of the step alone, resuming needs no iterator state and "train on
other batches for steps A..B" (Marin's "skip the problematic data") is one setting:
`--data.replace-batches A:B`.

Sources (`DataConfig.source`):
  ""              the embedded default: this Python's own standard library `.py` sources as bytes
                  (vocab 256) -- real text on every machine with Python, no download;
  a text file or a folder of text files, read as bytes;
  token shards    a `*.npy` / `*.bin` file, a folder holding such files, or a glob
                  ("data/fineweb_train_*.bin"): memory-mapped and concatenated in sorted order,
                  never read as bytes. In a shard folder, files named `*_val_*` (llm.c's naming)
                  are the validation split, never trained on;
  `*.npy`         a 1-D integer token array (loaded with allow_pickle=False, memory-mapped);
  `*.bin`         an llm.c / modded-nanogpt shard (256 x int32 header: magic 20240520 -> uint16
                  tokens, 20240801 -> uint32), else nanoGPT's headerless little-endian uint16.
"""

import dataclasses
import functools
import hashlib
import os
import pathlib
import sysconfig
import time

import numpy as np

from cli import UserError, check_new_folder, command, entry_point, parse

LLMC_MAGIC = {20240520: np.uint16, 20240801: np.uint32}  # llm.c: GPT-2 shards, Llama-3 shards
LLMC_HEADER_INTS = 256


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = ""  # "" = the embedded standard-library corpus
    seq_len: int = 128
    batch_size: int = 32
    seed: int = 0
    held_out_fraction: float = 0.01  # the tail of the token stream, never trained on
    eval_sequences: int = 256  # the held-out loss averages this many windows of the tail
    # "A:B[,C:D]": steps A..B-1 train on other batches than their own (Marin tried skipping
    # the data before a spike)
    replace_batches: str = ""
    # The held-out set's source (file, folder or glob); "" = a shard folder's *_val_* files,
    # else the held-out tail of `source`. With a validation source, all of `source` is trained on.
    val_source: str = ""

    def __post_init__(self):
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError("data.seq_len and data.batch_size must be positive")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.eval_sequences <= 0:
            raise ValueError("data.eval_sequences must be positive")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError("data.held_out_fraction must lie in (0, 1)")
        parse_ranges(self.replace_batches, "replace_batches")


def parse_ranges(spec: str, name: str) -> list[range]:
    """"A:B,C:D" -> [range(A, B), range(C, D)], kept as ranges (a range of a billion steps
    costs nothing)."""
    ranges = []
    for part in filter(None, spec.split(",")):
        try:
            a, b = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"data.{name} must look like A:B (e.g. 1200:1300), "
                             f"got {spec!r}") from None
        if not 0 <= a < b:
            raise ValueError(f"data.{name} A:B needs 0 <= A < B, got {spec!r}")
        ranges.append(range(a, b))
    return ranges


STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_root() -> pathlib.Path:
    """The standard library read as the embedded corpus: SPIKEFIX_STDLIB's, else this Python's."""
    return pathlib.Path(os.environ.get("SPIKEFIX_STDLIB") or sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[pathlib.Path]:
    """The embedded corpus's files: the .py files of this Python's standard library (or of the
    copy of another's that SPIKEFIX_STDLIB names) outside STDLIB_SKIP's folders, sorted (a walk
    that does not enter those folders: 50x faster than a glob)."""
    root = stdlib_root()
    if not root.is_dir():
        raise UserError(f"SPIKEFIX_STDLIB={root} is not a folder (a copy of a Python's "
                        "standard library, read as the embedded corpus)")
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in STDLIB_SKIP]
        paths += [pathlib.Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(paths)


@functools.cache
def embedded_corpus() -> np.ndarray:
    """Read once a process (a run, its evaluation and every test share the bytes, read-only)."""
    return _read_bytes(stdlib_files())


def _read_bytes(paths) -> np.ndarray:
    return np.frombuffer(b"".join(p.read_bytes() for p in paths), dtype=np.uint8)


SHARD_SUFFIXES = (".npy", ".bin")


def is_val_shard(path: pathlib.Path) -> bool:
    return "_val_" in path.name or path.name.startswith("val_")


def shard_paths(source: str, split: str = "all") -> list[pathlib.Path] | None:
    """The token shards `source` names, sorted: a glob, a folder holding .npy / .bin files
    (`split`: "train" drops its *_val_* files, "val" keeps only those), or one such file.
    None if `source` is text (a text file, or a folder without shards)."""
    if any(c in source for c in "*?["):
        paths = sorted(p for p in pathlib.Path("/").glob(str(pathlib.Path(source).absolute())[1:])
                       if p.is_file())
        if not paths:
            raise ValueError(f"data source {source!r} matches no file")
        return paths
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"data source {source!r} does not exist: give a text file, a folder, "
                         "a glob, or a .npy or .bin token file")
    if not (path.is_file() or path.is_dir()):  # a FIFO or a device: reading could block
        raise ValueError(f"data source {source!r} is neither a regular file nor a folder")
    if path.is_file():
        return [path] if path.suffix in SHARD_SUFFIXES else None
    shards = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SHARD_SUFFIXES)
    if not shards:
        return None
    if split != "all":
        shards = [p for p in shards if is_val_shard(p) == (split == "val")]
    return shards


def token_unit(source: str) -> str:
    """What one token of `source` is: "byte" for text (read as bytes), else "token"."""
    return "byte" if not source or shard_paths(source) is None else "token"


def load_tokens(source: str, vocab_size: int = 2**31 - 1, split: str = "train"):
    """A 1-D array of token ids (memory-mapped where the format allows; several shards as a
    `Shards` view, never copied). Every shard's ids are checked against `vocab_size` here."""
    if not source:
        return embedded_corpus()
    paths = shard_paths(source, split)
    if paths is None:
        path = pathlib.Path(source)
        return _read_bytes(sorted(p for p in path.rglob("*") if p.is_file())) \
            if path.is_dir() else np.fromfile(path, dtype=np.uint8)
    if not paths:
        raise ValueError(f"data source {source!r} holds no {split} shards")
    parts = []
    for path in paths:
        tokens = _load_npy(path) if path.suffix == ".npy" else _load_bin(path)
        if tokens.size and int(tokens.min()) < 0:
            raise ValueError(f"{path} holds token id {int(tokens.min())}: token ids are >= 0; "
                             "fix the tokenizer")
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise ValueError(f"{path} holds token id {int(tokens.max())}, outside the vocab of "
                             f"{vocab_size}: raise --model.vocab-size or fix the tokenizer")
        parts.append(tokens)
    return parts[0] if len(parts) == 1 else Shards(parts)


class Shards:
    """Several token arrays read as one, without copying: slices are views, and a short slice
    (a training window) becomes an array when NumPy asks for one."""

    def __init__(self, parts: list):
        self.parts = [p for p in parts if p.size]
        self.offsets = np.cumsum([0] + [p.size for p in self.parts])
        self.size = int(self.offsets[-1])

    def __getitem__(self, index: slice) -> "Shards":
        start, stop, _ = index.indices(self.size)
        parts = [p[max(start - lo, 0):max(min(stop - lo, p.size), 0)]
                 for p, lo in zip(self.parts, self.offsets)]
        return Shards(parts)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int32)
        return out if dtype is None else out.astype(dtype)

    def max(self):
        return max(p.max() for p in self.parts)

    def min(self):
        return min(p.min() for p in self.parts)


def _load_npy(path: pathlib.Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # pickled object arrays and malformed headers land here
        raise ValueError(f"{path}: not a plain .npy token array ({e}); save integer "
                         "tokens with np.save(path, array) and no object dtype") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer token array, got "
                         f"{tokens.dtype} of shape {tokens.shape}")
    return tokens


def _load_bin(path: pathlib.Path) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty: a .bin token file holds tokens")
    if size >= LLMC_HEADER_INTS * 4:
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
        if int(header[0]) in LLMC_MAGIC:
            dtype = np.dtype(LLMC_MAGIC[int(header[0])]).newbyteorder("<")
            count = int(header[2])
            if header[1] != 1 or size != LLMC_HEADER_INTS * 4 + count * dtype.itemsize:
                raise ValueError(f"{path}: llm.c shard header (version {header[1]}, {count} "
                                 f"tokens) does not match the file size {size}: file truncated?")
            return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_INTS * 4,
                             shape=(count,))
        if 20_000_000 <= int(header[0]) < 30_000_000 and header[1] == 1:  # date-like: llm.c's
            raise ValueError(f"{path}: unknown llm.c shard magic {int(header[0])} (known: "
                             f"{', '.join(map(str, LLMC_MAGIC))}): not a shard this reads")
    if size % 2:
        raise ValueError(f"{path}: a headerless .bin must hold uint16 tokens (nanoGPT), but its "
                         f"size {size} is odd")
    return np.memmap(path, dtype="<u2", mode="r")


class TokenData:
    """A token stream split into a training part and a held-out tail; batches by step."""

    def __init__(self, cfg: DataConfig, vocab_size: int = 256):
        self.cfg = cfg
        tokens = load_tokens(cfg.source, vocab_size)
        name = cfg.source or "the embedded corpus"
        if tokens.size == 0:
            raise ValueError(f"data.source {name} is empty" if cfg.source else
                             f"the embedded corpus is empty: SPIKEFIX_STDLIB={stdlib_root()} "
                             "holds no .py file (name a copy of a Python's standard library)")
        top = int(tokens.max())
        if top >= vocab_size or int(tokens.min()) < 0:
            raise ValueError(f"{name} holds token id {top}, outside the vocab of {vocab_size}: "
                             "raise --model.vocab-size or fix the tokenizer")
        self.row_len = cfg.seq_len + 1
        auto_val = (cfg.source and not any(c in cfg.source for c in "*?[")
                    and pathlib.Path(cfg.source).is_dir() and shard_paths(cfg.source, "val"))
        val_source = cfg.val_source or (cfg.source if auto_val else "")
        if val_source:  # a validation split of its own: all of `source` is training data
            val = load_tokens(val_source, vocab_size, split="val" if not cfg.val_source
                              else "all")
            if val.size < self.row_len:
                raise ValueError(f"the validation source {val_source} has {val.size} tokens: "
                                 f"too short for one sequence of {self.row_len}")
            self.train, self.held_out = tokens, val
        else:
            n_held_out = max(int(tokens.size * cfg.held_out_fraction), self.row_len)
            self.train, self.held_out = tokens[:-n_held_out], tokens[-n_held_out:]
        if self.train.size < self.row_len:
            raise ValueError(f"{name} has {tokens.size} tokens: too short for one training "
                             f"sequence of {self.row_len} (plus a held-out slice); use more data "
                             "or a smaller --data.seq-len")
        self.replace_batches(cfg.replace_batches)

    def replace_batches(self, spec: str) -> None:
        """The batches of the steps in `spec` ("a-b,c") drawn from other streams (the guard's
        replaced windows: a step in k windows draws from stream k)."""
        self.replaced = parse_ranges(spec, "replace_batches")

    def corpus(self) -> dict:
        """What this data is, to check that a resume or a warm start reads the same text: the
        source, its token count, and a sha256 of the training and held-out tokens (all of
        them; beyond 16 Mi tokens, of 16 spread 1 Mi-token slices), its first 16 hex digits."""
        h = hashlib.sha256()
        for tokens in (self.train, self.held_out):
            n, k = tokens.size, 1 << 20
            h.update(str(n).encode())
            for a in ([0] if n <= 16 * k else np.linspace(0, n - k, 16).astype(int)):
                h.update(np.ascontiguousarray(tokens[a:a + (n if n <= 16 * k else k)]).tobytes())
        source = self.cfg.source or f"the embedded corpus ({stdlib_root()})"
        return {"source": source, "tokens": int(self.train.size + self.held_out.size),
                "sha256": h.hexdigest()[:16]}

    def _rows(self, tokens, starts, rows: slice):
        starts = starts[rows]
        return np.stack([np.asarray(tokens[s:s + self.row_len]) for s in starts]).astype(np.int32)

    def batch(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        """int32 [B, T+1] for `step`. `rows` picks this process's share of the global batch:
        every process draws the same offsets and builds only its own rows."""
        # a replaced step draws from another stream, one more for each window that holds it
        # (the guard replaces a window again after a relapse: new batches each time)
        stream = sum(step in r for r in self.replaced)
        rng = np.random.default_rng([self.cfg.seed, step, stream])
        starts = rng.integers(0, self.train.size - self.row_len + 1, size=self.cfg.batch_size)
        return self._rows(self.train, starts, rows)

    def held_out_batches(self, rows: slice = slice(None)) -> np.ndarray:
        """The fixed held-out set: int32 [C, B, T+1], `eval_sequences` evenly spaced windows of
        the held-out tail (rounded up to whole batches of B), the same for every run that uses
        this source, seq_len and batch size. `rows` picks this process's rows of each batch."""
        B = self.cfg.batch_size
        C = -(-self.cfg.eval_sequences // B)
        starts = np.linspace(0, self.held_out.size - self.row_len, C * B).astype(np.int64)
        return np.stack([self._rows(self.held_out, starts[c * B:(c + 1) * B], rows)
                         for c in range(C)])


# ---------------------------------------------------------------------------------------------
# `python data.py prepare`: text -> a byte-level BPE tokenizer -> llm.c token shards

@dataclasses.dataclass(frozen=True)
class PrepareArgs:
    out: str  # the folder to write: data_train_000000.bin, data_val_000000.bin, tokenizer.json
    text: str = ""  # a folder (or file) of text; "" = the embedded standard-library corpus
    vocab_size: int = 4096  # BPE vocab to train (with --tokenizer: taken from the file)
    tokenizer: str = ""  # a tokenizer.json to use instead of training one
    val_fraction: float = 0.01  # the tail of the token stream (at least 4,096 tokens): validation

    def __post_init__(self):
        if not 257 <= self.vocab_size <= 2**32 - 1:
            raise ValueError(f"--vocab-size must lie in [257, 2**32), got {self.vocab_size}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must lie in (0, 1), got {self.val_fraction}")


def write_llmc(path: pathlib.Path, tokens: np.ndarray) -> None:
    """An llm.c shard: 256 x int32 header (magic, version 1, count), then uint16 / uint32."""
    magic = 20240520 if tokens.max(initial=0) < 2**16 else 20240801
    header = np.zeros(LLMC_HEADER_INTS, "<i4")
    header[:3] = (magic, 1, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.dtype(LLMC_MAGIC[magic]).newbyteorder("<")).tobytes())


def prepare(args: PrepareArgs) -> dict:
    """Train (or load) a byte-level BPE on local text, encode every document in one batch call,
    write train / val shards and tokenizer.json. Returns what was written and how fast."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    out = pathlib.Path(args.out)
    check_new_folder(out, "--out")
    if args.text and not pathlib.Path(args.text).exists():
        raise ValueError(f"--text {args.text} does not exist")
    files = stdlib_files() if not args.text else [pathlib.Path(args.text)] if pathlib.Path(
        args.text).is_file() else sorted(p for p in pathlib.Path(args.text).rglob("*")
                                         if p.is_file())
    tok = None
    if args.tokenizer:
        try:
            tok = tokenizers.Tokenizer.from_file(args.tokenizer)
        except Exception as e:
            raise ValueError(f"--tokenizer {args.tokenizer} is not a tokenizer.json "
                             f"({type(e).__name__})") from None
    docs = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    if not any(docs):
        raise ValueError(f"--text {args.text} holds no text" if args.text else
                         f"the embedded corpus is empty: SPIKEFIX_STDLIB={stdlib_root()} holds "
                         "no .py file (name a copy of a Python's standard library, or --text)")
    t0 = time.perf_counter()
    if tok is None:
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(docs, trainers.BpeTrainer(
            vocab_size=args.vocab_size, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t1 = time.perf_counter()
    ids = [np.asarray(e.ids, np.uint32) for e in tok.encode_batch_fast(docs)]  # no offsets
    t2 = time.perf_counter()
    tokens = np.concatenate(ids)
    n_val = min(max(int(tokens.size * args.val_fraction), 4096), tokens.size // 2)
    train, val = tokens[:-n_val], tokens[-n_val:]  # the stream's tail: validation
    if train.size < 2:
        raise ValueError(f"--text {args.text or 'the corpus'} encodes to {tokens.size} tokens: "
                         "too little to train on (give more text)")
    out.mkdir(parents=True, exist_ok=True)
    write_llmc(out / "data_train_000000.bin", train)
    write_llmc(out / "data_val_000000.bin", val)
    tok.save(str(out / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size() // 128) * 128  # a multiple of 128: shards over "model"
    n_bytes = sum(len(d.encode()) for d in docs)
    return {"train_tokens": int(train.size), "val_tokens": int(val.size), "vocab_size": vocab,
            "bytes_per_token": n_bytes / (train.size + val.size), "train_seconds": t1 - t0,
            "encode_tokens_per_s": (train.size + val.size) / (t2 - t1)}


USAGE = ("usage: python data.py prepare --out DIR [--text DIR] [--vocab-size N] "
         "[--tokenizer FILE] [--val-fraction F]")


@command
def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if argv[:1] != ["prepare"]:
        raise UserError(USAGE)
    args = parse(PrepareArgs, argv[1:], prog="data.py prepare",
                 description="Train (or load) a byte-level BPE tokenizer on local text and write "
                             "llm.c train / val token shards and tokenizer.json into --out.")
    try:
        r = prepare(args)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"wrote {args.out}: {r['train_tokens']:,} training and {r['val_tokens']:,} validation "
          f"tokens ({r['bytes_per_token']:.2f} bytes per token), tokenizer.json; BPE trained in "
          f"{r['train_seconds']:.1f} s, encoded at {r['encode_tokens_per_s'] / 1e6:.2f}M tokens/s")
    print(f"train on them: python train.py --data.source {args.out} --model.vocab-size "
          f"{r['vocab_size']}")
    return 0


if __name__ == "__main__":
    entry_point(main)
