"""Packed, deterministically shuffled, rank-sharded and resumable batches from token shards.

The token stream of each shard is cut into samples of seq_len + 1 tokens that overlap by one token
(sample i covers tokens [i*seq_len, (i+1)*seq_len]), so every token is a prediction target once;
documents are packed back to back, separated by the end-of-sequence id. Samples are visited in a
permutation drawn from (seed, epoch); a global batch is the next `data_parallel * micro_batch_size
* grad_accum_steps` samples of that order, split into micro batches by (micro step, rank). The
only state is the number of samples consumed, so a resumed job continues exactly where it stopped
(even with a different number of data-parallel ranks, as long as the global batch is unchanged).

A loss-masked dataset (shards.py) carries a mask window beside each token window; a target the mask
leaves out (a prompt token) becomes IGNORE_INDEX, which the loss skips.

Under context parallel the ranks of one context group read the same samples and each keeps its
part of every sequence (context_parallel.SequenceSplit: two chunks of inputs and targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from .errors import DataError
from .shards import Manifest, content_problem, read_manifest

if TYPE_CHECKING:
    from .context_parallel import SequenceSplit

IGNORE_INDEX = -100  # a target that is context only (PyTorch's cross-entropy default)


def _windows(values: np.ndarray, count: int, seq_len: int) -> np.ndarray:
    """Sample i of a shard as a row of a strided view (no copy): rows overlap by one token."""
    return np.lib.stride_tricks.as_strided(
        values, shape=(count, seq_len + 1), strides=(seq_len * values.itemsize, values.itemsize),
        writeable=False)


class TokenSamples:
    """Random access to the packed samples of one dataset folder (memory-mapped)."""

    def __init__(self, folder: Path, seq_len: int, channel: str, model_vocab_size: int) -> None:
        self.channel, self.seq_len = channel, seq_len
        self.manifest: Manifest = read_manifest(folder)
        if self.manifest.vocab_size > model_vocab_size:
            raise DataError(f"the {channel} channel was tokenized with a vocabulary of "
                            f"{self.manifest.vocab_size} tokens, larger than the model's "
                            f"{model_vocab_size}: use the same tokenizer for data and model")
        self.vocab_size = model_vocab_size
        problem = content_problem(self.manifest, channel)
        if problem:
            raise DataError(problem)
        self.maps = [np.memmap(shard.path, dtype=self.manifest.numpy_dtype, mode="r")
                     for shard in self.manifest.shards]
        per_shard = [max(len(tokens) - 1, 0) // seq_len for tokens in self.maps]
        self.starts = np.cumsum([0, *per_shard])
        self.windows = [_windows(tokens, count, seq_len)
                        for tokens, count in zip(self.maps, per_shard, strict=True)]
        self.mask_windows = [_windows(np.memmap(shard.mask_path, dtype=np.uint8, mode="r"), count,
                                      seq_len)
                             for shard, count in zip(self.manifest.shards, per_shard, strict=True)] \
            if self.manifest.loss_mask else None
        self.num_samples = int(self.starts[-1])
        if self.num_samples == 0:
            raise DataError(f"the {channel} channel ({self.manifest.folder}) holds "
                            f"{self.manifest.num_tokens} tokens, not enough for one sample of "
                            f"seq_len + 1 = {seq_len + 1} tokens in any shard: add data or lower seq_len")

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """int64 array [len(indices), seq_len + 1] of the given sample indices."""
        out = self._read(self.windows, indices, np.int64)
        if out.max() >= self.vocab_size or out.min() < 0:
            raise DataError(f"the {self.channel} channel holds token id {int(out.max())} outside the "
                            f"model's vocabulary of {self.vocab_size}: the shards are corrupt or were "
                            "made with another tokenizer")
        return out

    def target_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """bool [len(indices), seq_len]: which targets (tokens 1..seq_len) are trained; None when
        the dataset has no loss mask (every target is)."""
        if self.mask_windows is None:
            return None
        # Contiguous, so that a pinned copy is what travels to a GPU (a strided one is re-packed).
        return np.ascontiguousarray(self._read(self.mask_windows, indices, np.bool_)[:, 1:])

    def batch(self, indices: np.ndarray, device: torch.device,
              sequence: SequenceSplit | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the given samples on the device (this rank's part of each sequence
        under context parallel)."""
        inputs, targets = to_device(self.gather(indices), device, self.target_mask(indices))
        if sequence is None:
            return inputs, targets
        return sequence.shard(inputs), sequence.shard(targets)

    def _read(self, windows: list[np.ndarray], indices: np.ndarray, dtype) -> np.ndarray:
        out = np.empty((len(indices), self.seq_len + 1), dtype=dtype)
        shards = np.searchsorted(self.starts, indices, side="right") - 1
        for shard in np.unique(shards):  # one fancy-indexed read per shard, not one per row
            rows = np.flatnonzero(shards == shard)
            out[rows] = windows[shard][indices[rows] - self.starts[shard]]
        return out


class Samples(Protocol):
    """What the batch streams read: packed token samples (TokenSamples) or preference pairs
    (preference_data.PreferencePairs), addressed by sample index."""

    channel: str
    seq_len: int
    num_samples: int
    manifest: Manifest

    def batch(self, indices: np.ndarray, device: torch.device,
              sequence: SequenceSplit | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class BatchLayout:
    """How one global batch is split: per micro step, per data-parallel rank."""

    data_parallel_size: int
    data_parallel_rank: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel_size * self.micro_batch_size * self.grad_accum_steps

    def positions(self, first: int, micro_step: int) -> np.ndarray:
        """Positions in the sample order that this rank trains on in `micro_step`."""
        start = first + (micro_step * self.data_parallel_size + self.data_parallel_rank) \
            * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size, dtype=np.int64)


class ShuffledOrder:
    """Sample order: a fresh permutation of all samples per epoch, drawn from (seed, epoch)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._permutation = -1, np.empty(0, dtype=np.int64)

    def _for_epoch(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._permutation

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(positions, self.num_samples)
        result = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            result[mask] = self._for_epoch(int(epoch))[offsets[mask]]
        return result


def to_device(batch: np.ndarray, device: torch.device,
              target_mask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) on the device: the sample without its last / first token; targets the
    mask leaves out are IGNORE_INDEX."""
    tokens = _on(device, torch.from_numpy(batch))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if target_mask is not None:
        targets = targets.masked_fill(~_on(device, torch.from_numpy(target_mask)), IGNORE_INDEX)
    return inputs, targets


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)


class TrainBatches:
    """The training stream for one rank. `consumed_samples` is its whole resumable state."""

    def __init__(self, samples: Samples, layout: BatchLayout, seed: int,
                 device: torch.device, sequence: SequenceSplit | None = None) -> None:
        self.samples, self.layout, self.device, self.sequence = samples, layout, device, sequence
        self.order = ShuffledOrder(samples.num_samples, seed)
        self.seed = seed
        self.consumed_samples = 0
        # The sample indices of each micro batch of the last step (an objective may look up what it
        # stored per sample, such as precomputed reference log-probabilities).
        self.step_samples: list[np.ndarray] = []

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro batches of the next optimizer step for this rank."""
        first = self.consumed_samples
        self.step_samples = [self.order[self.layout.positions(first, m)]
                             for m in range(self.layout.grad_accum_steps)]
        micro_batches = [self.samples.batch(indices, self.device, self.sequence)
                         for indices in self.step_samples]
        self.consumed_samples += self.layout.global_batch_size
        return micro_batches

    @property
    def epoch(self) -> float:
        return self.consumed_samples / self.samples.num_samples

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "num_samples": self.samples.num_samples,
                "seed": self.seed, "seq_len": self.samples.seq_len,
                "global_batch_size": self.layout.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        expected = {"num_samples": self.samples.num_samples, "seed": self.seed,
                    "seq_len": self.samples.seq_len}
        for key, value in expected.items():
            if state.get(key) != value:
                raise DataError(f"cannot resume the data order: the checkpoint was written with "
                                f"{key}={state.get(key)} and this job has {key}={value} (the train "
                                "channel, seed and seq_len must not change between resumes)")
        self.consumed_samples = int(state["consumed_samples"])


class EvalBatches:
    """A fixed, unshuffled slice of the validation channel, split across data-parallel ranks; the
    number of batches is a multiple of `together` (a pipeline evaluates a round of micro-batches
    at once)."""

    def __init__(self, samples: Samples, layout: BatchLayout, steps: int,
                 device: torch.device, *, together: int = 1, sequence: SequenceSplit | None = None) -> None:
        per_batch = layout.data_parallel_size * layout.micro_batch_size
        available = min(steps, samples.num_samples // per_batch)
        self.steps = available // together * together
        if available == 0:
            raise DataError(f"the validation channel holds {samples.num_samples} samples, fewer than "
                            f"one evaluation batch of {per_batch} (data-parallel ranks x "
                            "micro_batch_size)")
        if self.steps == 0:
            raise DataError(f"a pipeline evaluates {together} batches at once (grad_accum_steps) and "
                            f"this job has {available}: raise eval_steps to at least {together}, or "
                            "add validation data")
        self.samples, self.layout, self.device, self.sequence = samples, layout, device, sequence

    def sample_indices(self) -> list[np.ndarray]:
        """The sample indices of this rank's batches, in order (the same at every evaluation)."""
        single = BatchLayout(self.layout.data_parallel_size, self.layout.data_parallel_rank,
                             self.layout.micro_batch_size, 1)
        return [single.positions(step * single.global_batch_size, 0) for step in range(self.steps)]

    def __iter__(self):
        for indices in self.sample_indices():
            yield self.samples.batch(indices, self.device, self.sequence)
