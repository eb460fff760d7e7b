"""Prompts with their reference answers (a version-4 dataset) for GRPO.

A sample is an example: its prompt's token ids, its prompt text and its fields (what the reward
functions read). `batch` gives the prompts' ids left-padded, with their attention mask (the layout
generation takes); the GRPO objective reads the examples themselves by index. The sample order, the
split over ranks and the resumable state are data.TrainBatches'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..contract.token_data import PROMPTS_FILE
from .errors import DataError
from .shards import Manifest, read_manifest


@dataclass(frozen=True)
class PromptExample:
    where: str
    prompt: str
    prompt_ids: tuple[int, ...]
    fields: dict[str, Any]


class PromptSet:
    def __init__(self, folder: Path, seq_len: int, channel: str, model_vocab_size: int) -> None:
        self.channel, self.seq_len = channel, seq_len
        self.manifest: Manifest = read_manifest(folder)
        self.examples = [self._example(folder, number, line) for number, line in
                         enumerate((folder / PROMPTS_FILE).read_text().splitlines(), start=1) if line]
        self.num_samples = len(self.examples)
        if not self.examples:
            raise DataError(f"the {channel} channel ({folder}) holds no prompt")
        top = max(max(example.prompt_ids) for example in self.examples)
        if top >= model_vocab_size:
            raise DataError(f"the {channel} channel holds token id {top}, outside the model's vocabulary "
                            f"of {model_vocab_size}: use the same tokenizer for data and model")

    @staticmethod
    def _example(folder: Path, number: int, line: str) -> PromptExample:
        try:
            record = json.loads(line)
            return PromptExample(record["where"], record["prompt"], tuple(record["prompt_ids"]),
                                 record["fields"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise DataError(f"malformed dataset in {folder}: line {number} of {PROMPTS_FILE} is not a "
                            "prompt written by prepare_data --prompts") from error

    def batch(self, indices: np.ndarray, device: torch.device,
              sequence=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt ids left-padded with the end-of-sequence id, attention mask) of the examples."""
        if sequence is not None:
            raise DataError("prompts do not split over context-parallel ranks")
        prompts = [self.examples[index].prompt_ids for index in indices]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.manifest.eos_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        return ids.to(device), mask.to(device)
