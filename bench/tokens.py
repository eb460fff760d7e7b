"""The benchmark's token stream: deterministic synthetic token ids, shared by every configuration.

Speed does not depend on which tokens a model sees, so the stream is random ids drawn once with a
fixed seed and saved as one `.npy` file; the peers read samples from it and our program reads the
same ids from shards written in its own format (bench.ours).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEED = 1234


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def write_tokens(path: Path, count: int, vocab_size: int) -> Path:
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, vocab_size, size=count, dtype=np.int64).astype(token_dtype(vocab_size))
    np.save(path, tokens)
    return path


def load_tokens(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r")


def batch(tokens: np.ndarray, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Samples `step * batch_size ...` of length seq_len, wrapping around the stream."""
    samples_in_stream = len(tokens) // seq_len
    rows = [((step * batch_size + i) % samples_in_stream) * seq_len for i in range(batch_size)]
    return np.stack([np.asarray(tokens[r : r + seq_len], dtype=np.int64) for r in rows])
