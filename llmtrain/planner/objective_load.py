"""What a run's objective makes the program do per sample, for the planner: the one table from the
`objective` hyperparameter (training_jobs/contract/objectives.py) to its load.

The planner plans every objective as next-token training of the rows the policy trains on, plus the
work the objective adds around it (llmtrain.planner.post_training):

- next_token: a sample is one row of `seq_len` tokens;
- dpo: a pair is two rows (chosen, rejected) through the policy's forward and backward, and the
  reference's log-probabilities of both: a forward of a frozen copy, of the policy with its LoRA
  adapters off, or none during training (precomputed before it);
- grpo: a prompt is `grpo_group_size` rows of prompt plus `grpo_max_new_tokens` sampled tokens,
  sampled first with the KV cache (generation), then trained; with a KL penalty (`grpo_beta` > 0),
  a reference forward too (the adapters off under LoRA, else a frozen copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from training_jobs.contract.hyperparameters import TrainConfig

ReferenceKind = Literal["none", "copy", "adapters_off", "precomputed"]


@dataclass(frozen=True)
class ObjectiveLoad:
    """Per sample of a micro batch: the rows the policy trains on, the tokens sampled per row before
    the step (appended to the row's `prompt_tokens`), and the reference model the step runs."""

    name: str = "next_token"
    rows_per_sample: int = 1
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    reference: ReferenceKind = "none"

    @property
    def reference_forward(self) -> bool:
        """Whether every micro batch runs a reference forward over its rows (no gradients)."""
        return self.reference in ("copy", "adapters_off")

    @property
    def reference_copy(self) -> bool:
        """Whether a second copy of the model's weights is held (built and spread like the policy)."""
        return self.reference == "copy"

    @property
    def generates(self) -> bool:
        return self.sampled_tokens > 0


def _next_token(config: TrainConfig) -> ObjectiveLoad:
    return ObjectiveLoad()


def _dpo(config: TrainConfig) -> ObjectiveLoad:
    return ObjectiveLoad("dpo", rows_per_sample=2, reference=config.objective.reference(config.lora.lora_r))


def _grpo(config: TrainConfig) -> ObjectiveLoad:
    settings = config.objective
    reference: ReferenceKind = "none"
    if settings.grpo_beta:
        reference = "adapters_off" if config.lora.lora_r else "copy"
    # The prompts are planned at seq_len tokens: an upper bound, as a pair's rows are for DPO.
    return ObjectiveLoad(
        "grpo",
        rows_per_sample=settings.grpo_group_size,
        prompt_tokens=config.data.seq_len,
        sampled_tokens=settings.grpo_max_new_tokens,
        reference=reference,
    )


# objective (contract/objectives.py OBJECTIVES) -> its load of a run's configuration.
OBJECTIVE_LOADS: dict[str, Callable[[TrainConfig], ObjectiveLoad]] = {
    "next_token": _next_token,
    "dpo": _dpo,
    "grpo": _grpo,
}


def objective_load(config: TrainConfig) -> ObjectiveLoad:
    return OBJECTIVE_LOADS[config.objective.objective](config)
