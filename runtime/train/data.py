"""Deterministic data: which samples form microbatch `index` of global step `step` is a pure function
of (seed, step, index), so any layout, any reconfiguration and any replay sees the same batches.

Two sources:
- `SyntheticTokens`: a learnable synthetic language (each next token is an affine function of the
  previous one, with occasional random tokens), generated on the fly.
- `TokenFile`: a local file of token ids (`.npy`, or raw `.bin` of uint16/int32 ids), or any other
  file tokenised bytewise (vocabulary 256). Samples are windows at pseudo-random offsets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from oobleck.runtime.errors import DataError

_MASK = (1 << 63) - 1


def mix(*values: int) -> int:
    """A stable 63-bit hash of integers (splitmix64 steps); Python's hash() is salted per process."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        state = z ^ (z >> 31)
    return state & _MASK


class Dataset(Protocol):
    microbatch_size: int
    seq_len: int

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each `[microbatch_size, seq_len]` int64."""
        ...


class StepBatches:
    """The microbatches offset..offset+count-1 of one step (a pipeline's first or last stage), made ahead of use.

    Made one after another, a synthetic microbatch costs the host a third of what it costs between a forward and a
    backward (tiny Llama, 2026-11-29: ~0.1 ms against ~0.27 ms; the caches are cold there). So a stage makes its
    step's batches together: one that waits for peers during the step, at its first wait (`make_all`: its core is
    idle then); one that never waits, at its first forward (`take(all_now=True)`)."""

    def __init__(self, data: Dataset, step: int, offset: int, count: int) -> None:
        self.data, self.step, self.offset, self.count = data, step, offset, count
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.next = 0  # microbatches below it are made (and maybe taken)

    def make_all(self) -> None:
        self._make(self.count)

    def take(self, m: int, all_now: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Microbatch m (the pipeline's numbering), made now unless made before (with all the rest if `all_now`)."""
        self._make(self.count if all_now else m + 1)
        return self.made.pop(m)

    def _make(self, until: int) -> None:
        for m in range(self.next, until):
            self.made[m] = self.data.microbatch(self.step, self.offset + m)
        self.next = max(self.next, until)


MAX_SYNTHETIC_VOCAB = 2**31
"""The closed form multiplies two tokens' worth of values in int64: vocab^2 must stay below 2^63."""


class SyntheticTokens:
    """x[t+1] = (a * x[t] + c) mod vocab, replaced by a uniform token with probability `noise`.

    Generated without a loop over positions: a token k steps after the last random one (the first token
    counts as random) is a^k * that token + c * (a^(k-1) + ... + 1) mod vocab, with both coefficients
    precomputed exactly. A loop over 1024 positions cost ~8 ms of host time per microbatch, which a GPU
    spent idle."""

    def __init__(self, vocab: int, seq_len: int, microbatch_size: int, seed: int = 0, noise: float = 0.1) -> None:
        if not 2 <= vocab <= MAX_SYNTHETIC_VOCAB:
            raise ValueError(f"data.vocab: must be within [2, {MAX_SYNTHETIC_VOCAB}], got {vocab}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"data.noise: must be within [0, 1], got {noise}")
        self.vocab, self.seq_len, self.microbatch_size = vocab, seq_len, microbatch_size
        self.seed, self.noise = seed, noise
        rng = np.random.default_rng(mix(seed, 0xA11CE))
        self._a = int(rng.integers(1, vocab)) | 1
        self._c = int(rng.integers(0, vocab))
        # coefficients k steps after a random token: x = scale[k] * x_random + shift[k] (mod vocab)
        scale, shift = [1], [0]
        for _ in range(seq_len):
            scale.append(scale[-1] * self._a % vocab)
            shift.append((shift[-1] * self._a + self._c) % vocab)
        # scale * token < vocab^2 fits int64 (MAX_SYNTHETIC_VOCAB)
        self._scale = np.array(scale, dtype=np.int64)
        self._shift = np.array(shift, dtype=np.int64)

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(mix(self.seed, step, index))
        rows, length = self.microbatch_size, self.seq_len + 1
        first = rng.integers(0, self.vocab, rows)
        noise = rng.random((rows, self.seq_len)) < self.noise
        random_tokens = rng.integers(0, self.vocab, (rows, self.seq_len))
        # Every position's last random token (position 0 always is one) and the distance back to it.
        is_random = np.concatenate([np.ones((rows, 1), dtype=bool), noise], axis=1)
        values = np.concatenate([first[:, None], random_tokens], axis=1)
        positions = np.broadcast_to(np.arange(length), (rows, length))
        last = np.maximum.accumulate(np.where(is_random, positions, 0), axis=1)
        since = positions - last
        tokens = (self._scale[since] * np.take_along_axis(values, last, axis=1) + self._shift[since]) % self.vocab
        window = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class TokenFile:
    """Windows of `seq_len + 1` tokens at offsets drawn from (seed, step, index, sample)."""

    def __init__(
        self,
        path: str | Path,
        seq_len: int,
        microbatch_size: int,
        seed: int = 0,
        vocab: int | None = None,
        dtype: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.seq_len, self.microbatch_size, self.seed = seq_len, microbatch_size, seed
        self.tokens = load_tokens(self.path, dtype)
        if len(self.tokens) < seq_len + 1:
            raise DataError(
                f"holds {len(self.tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}",
                field="data.path",
                path=str(self.path),
            )
        if vocab is not None:
            check_vocabulary(self.tokens, vocab, str(self.path))

    def microbatch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(mix(self.seed, step, index))
        starts = rng.integers(0, len(self.tokens) - self.seq_len, self.microbatch_size)
        windows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(windows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def check_vocabulary(tokens: np.ndarray, vocab: int, path: str, chunk: int = 1 << 24) -> None:
    """Raise DataError at the first id >= `vocab` (read in chunks: token files can be larger than memory)."""
    for start in range(0, len(tokens), chunk):
        bad = np.flatnonzero(np.asarray(tokens[start : start + chunk]) >= vocab)
        if len(bad):
            offset = start + int(bad[0])
            raise DataError(
                f"token id {int(tokens[offset])} at offset {offset} (token index) is outside the model's vocabulary "
                f"of {vocab}",
                field="data.path",
                path=path,
            )


def load_tokens(path: Path, dtype: str | None = None) -> np.ndarray:
    """Token ids from `.npy` (1-D integers), a raw file of `dtype` ids (uint16 or uint32, little-endian),
    or without `dtype`: `.bin` (uint16 ids, or int32 with a `.i32.bin` suffix), any other file as bytes."""
    if not path.is_file():
        raise DataError("is not a file", field="data.path", path=str(path))
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise DataError(
                f"must hold a 1-D integer array, got {array.dtype} {array.shape}", field="data.path", path=str(path)
            )
        return array
    if dtype is not None:
        width = np.dtype(dtype).itemsize
        if path.stat().st_size % width:
            raise DataError(
                f"size {path.stat().st_size} is not a multiple of {width} bytes ({dtype} ids)",
                field="data.dtype",
                path=str(path),
            )
        return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    if path.suffix == ".bin":
        ids = np.int32 if path.name.endswith(".i32.bin") else np.uint16
        return np.memmap(path, dtype=ids, mode="r")
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)
