"""GRPO with verifiable rewards: each step samples a group of completions per prompt from the policy,
scores them with the reward functions (trainer/rewards.py), and trains on the clipped surrogate of
their group-relative advantages (grpo_loss.py).

A micro batch of `micro_batch_size` prompts becomes micro_batch_size x grpo_group_size rows: each
prompt followed by one sampled completion, cut after its first end-of-sequence id (which is trained:
the model learns to stop), right-padded. Sampling runs with the KV cache (transformers' generate)
for the full grpo_max_new_tokens, seeded by (seed, samples consumed, micro batch, rank), in
evaluation mode.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..data import IGNORE_INDEX, EvalBatches
from ..errors import DataError
from ..loss import token_cross_entropy
from ..prompt_data import PromptExample, PromptSet
from ..rewards import Rewards
from ..strategies.protocol import LossFn, MicroBatch
from .grpo_loss import averaged, group_advantages, token_loss
from .protocol import ObjectiveContext, PolicyModel

METRICS = ("reward", "reward_std", "kl", "completions/mean_length", "clip_ratio/region_mean")


def completion_batch(prompts: list[tuple[int, ...]], completions: list[list[int]], pad: int,
                     device: torch.device) -> MicroBatch:
    """(inputs, targets) of rows prompt + completion, right-padded; only the completion's tokens are
    targets (the prompt is context)."""
    rows = [list(prompt) + completion for prompt, completion in zip(prompts, completions, strict=True)]
    width = max(map(len, rows)) - 1
    inputs = torch.full((len(rows), width), pad, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for number, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        inputs[number, :len(row) - 1] = torch.tensor(row[:-1])
        start = len(prompt) - 1  # the first completion token's target position
        targets[number, start:len(row) - 1] = torch.tensor(row[start + 1:])
    return inputs.to(device), targets.to(device)


class GrpoObjective:
    def __init__(self, ctx: ObjectiveContext) -> None:
        self.settings, self.config = ctx.config.objective, ctx.config
        self.policy: PolicyModel = ctx.strategy
        self.strategy, self.device = ctx.strategy, ctx.device
        self.prompts: PromptSet = ctx.train.samples
        self.eos = self.prompts.manifest.eos_token_id
        self.rewards = Rewards.from_settings(self.settings)
        self._check_rewards(self.prompts.examples[0])
        if ctx.evaluation is not None:
            raise DataError("objective=grpo evaluates no validation channel: leave it out (each step's "
                            "reward metrics are measured on fresh samples)")
        # The KL penalty's reference: the base with the adapters off under LoRA, else a frozen copy.
        self._adapters_off = bool(self.settings.grpo_beta and ctx.config.lora.lora_r)
        self._reference_model = self.policy.frozen_copy() \
            if self.settings.grpo_beta and not self._adapters_off else None
        self.tokenizer = ctx.tokenizer
        self.train = ctx.train
        self._window: list[torch.Tensor] = []

    def _check_rewards(self, example: PromptExample) -> None:
        """Before training: the reward functions run on the first example (its answer as the
        completion, else an empty one) and return numbers."""
        completion = str(example.fields.get(self.settings.grpo_answer_key, ""))
        self.rewards.score(example.prompt, completion, example.fields, example.where)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --- rollouts ---

    def _completions(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
        group = self.settings.grpo_group_size
        # Seeded by the samples consumed (the same after a resume), the micro batch and the rank.
        torch.manual_seed(self.config.run.seed * 1_000_003 + self.train.consumed_samples * 7_919
                          + int(prompt_ids[0].sum()) * 31 + dist.get_rank())
        self.strategy.train(False)
        sampled = self.policy.sample(prompt_ids.repeat_interleave(group, dim=0),
                                     attention_mask.repeat_interleave(group, dim=0),
                                     max_new_tokens=self.settings.grpo_max_new_tokens,
                                     temperature=self.settings.grpo_temperature)
        self.strategy.train(True)
        completions = []
        for row in sampled.tolist():
            end = row.index(self.eos) + 1 if self.eos in row else len(row)
            completions.append(row[:end])
        return completions

    def _rollout(self, indices: np.ndarray, prompt_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> tuple[MicroBatch, torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the prompts' sampled completions, their advantages and rewards."""
        group = self.settings.grpo_group_size
        examples = [self.prompts.examples[index] for index in indices for _ in range(group)]
        completions = self._completions(prompt_ids, attention_mask)
        rewards = torch.tensor([self.rewards.score(example.prompt, self._decode(completion), example.fields,
                                                   example.where)
                                for example, completion in zip(examples, completions, strict=True)],
                               device=self.device)
        batch = completion_batch([example.prompt_ids for example in examples], completions, self.eos,
                                 self.device)
        return batch, group_advantages(rewards, group)[0], rewards

    # --- the step ---

    def prepare_step(self, micro_batches: list[MicroBatch],
                     samples: list[np.ndarray]) -> tuple[list[MicroBatch], LossFn]:
        rollouts = [self._rollout(indices, prompt_ids, mask)
                    for (prompt_ids, mask), indices in zip(micro_batches, samples, strict=True)]
        batches = [batch for batch, _, _ in rollouts]
        return batches, self.rollout_loss(batches, [advantage for _, advantage, _ in rollouts],
                                          torch.cat([reward for _, _, reward in rollouts]))

    def rollout_loss(self, batches: list[MicroBatch], advantages: list[torch.Tensor],
                     rewards: torch.Tensor) -> LossFn:
        """The loss function of sampled completions (`batches`, completion_batch's), their
        advantages per micro batch and all their rewards, group by group."""
        references = iter([self._reference_logps(*batch) for batch in batches])
        advantages = iter(advantages)
        tokens_per_rank = self._tokens_per_rank(batches)
        group = self.settings.grpo_group_size
        reward_std = rewards.view(-1, group).std(dim=1).mean()

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logps = self._logps(logits, targets)
            mask = targets != IGNORE_INDEX
            terms = token_loss(logps, logps.detach(), next(references), next(advantages),
                               self.settings.grpo_epsilon, self.settings.grpo_beta)
            tokens = mask.sum().clamp(min=1)
            self._window.append(torch.stack([
                rewards.mean(), reward_std, (terms.kl * mask).sum() / tokens,
                mask.sum(-1).float().mean(), (terms.clipped & mask).sum() / tokens]).float())
            return averaged(terms.loss, mask, self.settings.grpo_loss, tokens_per_rank)
        return loss

    def _logps(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token log-probabilities of the distribution the completions were sampled from (the
        logits divided by the sampling temperature, as TRL computes them)."""
        return -token_cross_entropy(logits / self.settings.grpo_temperature, targets)

    def _reference_logps(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The reference's per-token log-probabilities (None without a KL penalty)."""
        if self._adapters_off:
            with self.policy.adapters_off():
                return self._logps(self.policy.inference_logits(inputs), targets)
        if self._reference_model is None:
            return None
        return self._logps(self.policy.inference_logits(inputs, self._reference_model), targets)

    def _tokens_per_rank(self, batches: list[MicroBatch]) -> torch.Tensor:
        """The step's completion tokens on all batch ranks / (ranks x micro batches): dapo's divisor
        (forward_backward divides by the micro batches, the gradients are averaged over ranks)."""
        group = self.strategy.topology.batch_group()
        count = sum((targets != IGNORE_INDEX).sum().float() for _, targets in batches)
        dist.all_reduce(count, group=group)
        return count / (dist.get_world_size(group) * len(batches))

    def window_metrics(self) -> dict[str, float]:
        if not self._window:
            return {}
        means = torch.stack(self._window).mean(dim=0)
        self._window = []
        return dict(zip(METRICS, self.strategy.topology.mean_loss(means).tolist(), strict=True))

    def evaluate(self, batches: EvalBatches) -> dict[str, float]:
        raise AssertionError("unreachable: a grpo job with a validation channel is refused when built")
