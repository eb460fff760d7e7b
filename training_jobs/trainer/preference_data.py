"""Preference pairs (a prompt, a chosen and a rejected completion) from a version-3 dataset.

A sample is a pair; a micro batch of B pairs is 2B rows, the B chosen sequences then the B rejected
ones (as TRL's DPOTrainer concatenates them), so one forward serves both completions of every pair.
Rows are padded on the right to the batch's longest sequence: under causal attention, padding after
a sequence changes none of its logits, and its targets are IGNORE_INDEX, so the loss never sees it.
A target is trained where the mask marks the completion (and its end-of-sequence id).

The sample order, the split over ranks and the resumable state are data.TrainBatches', unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .data import IGNORE_INDEX
from .errors import DataError
from .shards import Manifest, read_manifest


class PreferencePairs:
    """Random access to the pairs of one preference dataset folder (memory-mapped)."""

    def __init__(self, folder: Path, seq_len: int, channel: str, model_vocab_size: int) -> None:
        self.channel, self.seq_len = channel, seq_len
        self.manifest: Manifest = read_manifest(folder)
        if self.manifest.vocab_size > model_vocab_size:
            raise DataError(f"the {channel} channel was tokenized with a vocabulary of "
                            f"{self.manifest.vocab_size} tokens, larger than the model's "
                            f"{model_vocab_size}: use the same tokenizer for data and model")
        self.vocab_size = model_vocab_size
        dtype = self.manifest.numpy_dtype
        self.tokens = [np.memmap(shard.path, dtype=dtype, mode="r") for shard in self.manifest.shards]
        self.masks = [np.memmap(shard.mask_path, dtype=np.uint8, mode="r") for shard in self.manifest.shards]
        indexes = [np.fromfile(shard.pairs_path, dtype="<i8").reshape(-1, 3)
                   for shard in self.manifest.shards]
        # One row per pair over all shards: (shard, chosen start, rejected start, rejected end).
        self.pairs = np.concatenate([np.column_stack([np.full(len(rows), number), rows])
                                     for number, rows in enumerate(indexes)] or [np.empty((0, 4), np.int64)])
        self.num_samples = len(self.pairs)
        if self.num_samples == 0:
            raise DataError(f"the {channel} channel ({self.manifest.folder}) holds no preference pair")
        longest = int(np.max(np.maximum(self.pairs[:, 2] - self.pairs[:, 1],
                                        self.pairs[:, 3] - self.pairs[:, 2])))
        if longest - 1 > seq_len:
            raise DataError(f"the {channel} channel holds a sequence of {longest} tokens (prompt and "
                            f"completion) and seq_len is {seq_len}: set seq_len to at least {longest - 1}, "
                            "or prepare the data again with a smaller --max-length")

    def sequences(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, mask) of each pair's chosen sequence, then of each one's rejected sequence."""
        rows = self.pairs[indices]
        spans = [(shard, start, middle) for shard, start, middle, _ in rows] + \
            [(shard, middle, end) for shard, _, middle, end in rows]
        return [(np.asarray(self.tokens[shard][start:end], dtype=np.int64),
                 np.asarray(self.masks[shard][start:end], dtype=bool)) for shard, start, end in spans]

    def batch(self, indices: np.ndarray, device: torch.device,
              sequence=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) [2 x len(indices), longest - 1]: the chosen rows, then the rejected."""
        if sequence is not None:
            raise DataError("preference pairs do not split over context-parallel ranks")
        sequences = self.sequences(indices)
        width = max(len(tokens) for tokens, _ in sequences) - 1
        inputs = np.full((len(sequences), width), self.manifest.eos_token_id, dtype=np.int64)
        targets = np.full((len(sequences), width), IGNORE_INDEX, dtype=np.int64)
        for row, (tokens, mask) in enumerate(sequences):
            length = len(tokens) - 1
            inputs[row, :length] = tokens[:-1]
            targets[row, :length] = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
        if max(int(tokens.max()) for tokens, _ in sequences) >= self.vocab_size:
            raise DataError(f"the {self.channel} channel holds a token id outside the model's vocabulary "
                            f"of {self.vocab_size}: the shards are corrupt or were made with another "
                            "tokenizer")
        return torch.from_numpy(inputs).to(device), torch.from_numpy(targets).to(device)
