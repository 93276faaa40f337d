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
  a text file or a folder of files, read as bytes;
  `*.npy`         a 1-D integer token array (loaded with allow_pickle=False, memory-mapped);
  `*.bin`         an llm.c / modded-nanogpt shard (256 x int32 header: magic 20240520 -> uint16
                  tokens, 20240801 -> uint32), else nanoGPT's headerless little-endian uint16.
"""

import dataclasses
import pathlib
import sysconfig

import numpy as np

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

    def __post_init__(self):
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError("data.seq_len and data.batch_size must be positive")
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
            raise ValueError(f"data.{name} must look like A:B (e.g. 1200:1300), got {spec!r}")
        if not 0 <= a < b:
            raise ValueError(f"data.{name} A:B needs 0 <= A < B, got {spec!r}")
        ranges.append(range(a, b))
    return ranges


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _read_bytes(paths) -> np.ndarray:
    return np.frombuffer(b"".join(p.read_bytes() for p in paths), dtype=np.uint8)


def load_tokens(source: str) -> np.ndarray:
    """A 1-D integer array of token ids (memory-mapped where the format allows)."""
    if not source:
        return _read_bytes(stdlib_files())
    path = pathlib.Path(source)
    if not path.exists():
        raise ValueError(f"data.source {source!r} does not exist: give a text file, a folder, "
                         "a .npy or a .bin token file")
    if path.is_dir():
        return _read_bytes(sorted(p for p in path.rglob("*") if p.is_file()))
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:  # pickled object arrays and malformed headers land here
            raise ValueError(f"{source}: not a plain .npy token array ({e}); save integer "
                             "tokens with np.save(path, array) and no object dtype") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{source}: expected a 1-D integer token array, got "
                             f"{tokens.dtype} of shape {tokens.shape}")
        return tokens
    if path.suffix == ".bin":
        return _load_bin(path)
    return np.fromfile(path, dtype=np.uint8)


def _load_bin(path: pathlib.Path) -> np.ndarray:
    size = path.stat().st_size
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
    if size % 2:
        raise ValueError(f"{path}: a headerless .bin must hold uint16 tokens (nanoGPT), but its "
                         f"size {size} is odd")
    return np.memmap(path, dtype="<u2", mode="r")


class TokenData:
    """A token stream split into a training part and a held-out tail; batches by step."""

    def __init__(self, cfg: DataConfig, vocab_size: int = 256):
        self.cfg = cfg
        tokens = load_tokens(cfg.source)
        name = cfg.source or "the embedded corpus"
        if tokens.size == 0:
            raise ValueError(f"data.source {name} is empty")
        top = int(tokens.max())
        if top >= vocab_size or int(tokens.min()) < 0:
            raise ValueError(f"{name} holds token id {top}, outside the vocab of {vocab_size}: "
                             "raise --model.vocab-size or fix the tokenizer")
        self.window = cfg.seq_len + 1
        n_held_out = max(int(tokens.size * cfg.held_out_fraction), self.window)
        if tokens.size - n_held_out < self.window:
            raise ValueError(f"{name} has {tokens.size} tokens: too short for one training "
                             f"sequence of {self.window} plus a held-out slice of {n_held_out}; "
                             "use more data or a smaller --data.seq-len")
        self.train, self.held_out = tokens[:-n_held_out], tokens[-n_held_out:]
        self.replaced = parse_ranges(cfg.replace_batches, "replace_batches")

    def _rows(self, tokens, starts, rows: slice):
        starts = starts[rows]
        return np.stack([np.asarray(tokens[s:s + self.window]) for s in starts]).astype(np.int32)

    def batch(self, step: int, rows: slice = slice(None)) -> np.ndarray:
        """int32 [B, T+1] for `step`. `rows` picks this process's share of the global batch:
        every process draws the same offsets and builds only its own rows."""
        stream = 1 if any(step in r for r in self.replaced) else 0  # replaced: another stream
        rng = np.random.default_rng([self.cfg.seed, step, stream])
        starts = rng.integers(0, self.train.size - self.window + 1, size=self.cfg.batch_size)
        return self._rows(self.train, starts, rows)

    def held_out_batches(self, rows: slice = slice(None)) -> np.ndarray:
        """The fixed held-out set: int32 [C, B, T+1], `eval_sequences` evenly spaced windows of
        the held-out tail (rounded up to whole batches of B), the same for every run that uses
        this source, seq_len and batch size. `rows` picks this process's rows of each batch."""
        B = self.cfg.batch_size
        C = -(-self.cfg.eval_sequences // B)
        starts = np.linspace(0, self.held_out.size - self.window, C * B).astype(np.int64)
        return np.stack([self._rows(self.held_out, starts[c * B:(c + 1) * B], rows)
                         for c in range(C)])
