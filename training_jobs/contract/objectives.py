"""What a job optimizes: the `objective` hyperparameter, its settings, and the data each objective
trains on.

- `next_token`: the next-token loss; pretraining on packed text, or supervised fine-tuning where the
  data carries a loss mask (prompt/completion pairs, conversations). The data decides which.
- `dpo`: direct preference optimization on preference pairs (a prompt, a chosen and a rejected
  completion), against a frozen reference model (docs/training.md, Preference tuning (DPO)).
- `grpo`: group relative policy optimization with verifiable rewards on prompts with reference
  answers: completions sampled from the policy, scored by reward functions (docs/training.md,
  Reinforcement learning (GRPO)).

Standard library only (the contract's rule): the platform checks a run's objective against its
data's manifest with the same tables before a job starts.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal, get_args

from .errors import ConfigError
from .fields import hp
from .token_data import DATA_KINDS

Objective = Literal["next_token", "dpo", "grpo"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
DpoLoss = Literal["sigmoid", "robust", "ipo"]
DpoReference = Literal["auto", "copy", "adapters_off", "precomputed"]
GrpoLoss = Literal["dapo", "grpo"]
# The reward functions built into the program (trainer/rewards.py); any other name is `module:function`.
BUILTIN_REWARDS = ("exact_match", "regex", "numeric")

# The kinds of token data (token_data.DATA_KINDS) each objective trains on.
OBJECTIVE_DATA: dict[str, tuple[str, ...]] = {
    "next_token": ("text", "loss_masked"),
    "dpo": ("preference",),
    "grpo": ("prompts",),
}
# GRPO samples with model.generate on the whole model: the parallelisms it runs with.
GRPO_PARALLELISMS = ("single", "ddp")
# The parallelisms the post-training objectives run with: those that train the whole model on every
# rank (the reference forward runs beside the policy's; pipeline stages, DeepSpeed's engine and SMP
# hide the per-sequence log-probabilities the loss needs).
POST_TRAINING_PARALLELISMS = ("single", "ddp", "fsdp")
# Whether an objective's loss has a scale the loss-spike rule can judge: GRPO's surrogate is near 0 and
# of either sign (its advantages are centred per group), so a multiple of its running mean means nothing.
JUDGES_LOSS_SPIKES = {"next_token": True, "dpo": True, "grpo": False}
# The settings that belong to one objective only (refused with another one, so a typo'd objective
# is not silently trained as next_token).
_OWN_PREFIX = {"dpo": "dpo_", "grpo": "grpo_"}


@dataclass(frozen=True)
class ObjectiveConfig:
    objective: Objective = hp(
        "next_token", "What the job optimizes: next_token (pretraining on packed text, or supervised "
                      "fine-tuning when the data has a loss mask: the data decides), dpo (preference "
                      "pairs; docs/training.md, Preference tuning (DPO)) or grpo (prompts with answers "
                      "and reward functions; Reinforcement learning (GRPO)). The train channel's data "
                      "must be of the objective's kind.")
    dpo_beta: float = hp(0.1, "DPO's beta: how far the policy may move from the reference (higher "
                              "stays closer); with dpo_loss=ipo, IPO's tau.",
                         minimum=0.0, exclusive_minimum=True)
    dpo_loss: DpoLoss = hp("sigmoid", "sigmoid (DPO; with dpo_label_smoothing, conservative DPO), "
                                      "robust (robust DPO: an unbiased loss under label noise "
                                      "dpo_label_smoothing) or ipo (IPO: squared loss of the "
                                      "per-token log-ratio margin). As TRL's DPOTrainer computes them.")
    dpo_label_smoothing: float = hp(0.0, "The probability that a pair's preference is flipped "
                                         "(sigmoid and robust; 0 = none).",
                                    minimum=0.0, maximum=0.5, exclusive_maximum=True)
    dpo_reference: DpoReference = hp(
        "auto", "The reference model: copy (a frozen copy of the initial model, sharded like the "
                "policy), adapters_off (with LoRA: the policy's base with the adapters switched off, "
                "no second copy), precomputed (the reference log-probabilities of every pair, "
                "computed in a first pass before training; no reference in memory while training) "
                "or auto (adapters_off with LoRA, else copy).")

    grpo_group_size: int = hp(4, "Completions sampled per prompt; their rewards are compared within "
                                 "the group (group-relative advantages).", minimum=2)
    grpo_max_new_tokens: int = hp(64, "Tokens sampled per completion (a completion ends at its first "
                                      "end-of-sequence id, or here).", minimum=1)
    grpo_temperature: float = hp(1.0, "Sampling temperature of the completions.", minimum=0.0,
                                 exclusive_minimum=True)
    grpo_epsilon: float = hp(0.2, "Clipping range of the probability ratio in the surrogate "
                                  "objective.", minimum=0.0, exclusive_minimum=True, maximum=1.0)
    grpo_beta: float = hp(0.0, "Weight of the KL penalty to the reference model (k3 estimator; 0 = "
                               "none, no reference forward). The reference is the initial model: "
                               "adapters off with LoRA, else a frozen copy.", minimum=0.0)
    grpo_loss: GrpoLoss = hp("dapo", "How per-token losses are averaged: dapo (over every completion "
                                     "token of the step, TRL's default) or grpo (per completion, then "
                                     "over completions).")
    grpo_reward: str = hp("exact_match", "Reward functions, comma-separated, summed: exact_match, "
                                         "regex, numeric (docs/training.md) or `module:function` "
                                         "(in the job's code) called with prompt=, completion= and the "
                                         "example's fields as keywords, returning a number.")
    grpo_answer_key: str = hp("answer", "The example field the built-in rewards compare against.")
    grpo_reward_regex: str = hp("", "The pattern the `regex` reward looks for in a completion "
                                    "(Python re.search): 1 when found, else 0.")

    def reference(self, lora_rank: int) -> str:
        """The reference model this job uses (auto resolved)."""
        if self.dpo_reference != "auto":
            return self.dpo_reference
        return "adapters_off" if lora_rank else "copy"


def validate_objective(objective: ObjectiveConfig, *, parallelism: str, pipeline_degree: int,
                       context_degree: int, lora_rank: int, quantization: str) -> None:
    """The rules between the objective, its settings and the rest of the run."""
    name = objective.objective
    for spec in dataclasses.fields(objective):
        owner = next((other for other, prefix in _OWN_PREFIX.items() if spec.name.startswith(prefix)),
                     None)
        value = getattr(objective, spec.name)
        if owner not in (None, name) and value != spec.default:
            raise _invalid(spec.name, value, f"its default ({spec.default!r}) unless objective={owner} "
                                             f"(this run's objective is {name})")
    if name == "next_token":
        return
    if parallelism not in POST_TRAINING_PARALLELISMS:
        raise _invalid("parallelism", parallelism, f"one of {', '.join(POST_TRAINING_PARALLELISMS)} "
                                                   f"with objective={name}")
    if pipeline_degree > 1:
        raise _invalid("pipeline_parallel_degree", pipeline_degree, f"1 with objective={name} "
                                                                    "(pipeline stages are not supported)")
    if context_degree > 1:
        raise _invalid("context_parallel_degree", context_degree, f"1 with objective={name} (context "
                                                                  "parallel is not supported)")
    if name == "dpo":
        _validate_dpo(objective, lora_rank, quantization)
    else:
        _validate_grpo(objective, parallelism)


def reward_names(objective: ObjectiveConfig) -> list[str]:
    """The reward functions of grpo_reward, in order."""
    return [name.strip() for name in objective.grpo_reward.split(",") if name.strip()]


def _validate_grpo(objective: ObjectiveConfig, parallelism: str) -> None:
    if parallelism not in GRPO_PARALLELISMS:
        raise _invalid("parallelism", parallelism, f"one of {', '.join(GRPO_PARALLELISMS)} with "
                                                   "objective=grpo (sampling runs on the whole model)")
    names = reward_names(objective)
    if not names:
        raise _invalid("grpo_reward", objective.grpo_reward, "one or more reward functions")
    for name in names:
        module, _, function = name.partition(":")
        if name not in BUILTIN_REWARDS and not (module and function):
            raise _invalid("grpo_reward", name, f"one of {', '.join(BUILTIN_REWARDS)} or module:function")
    if "regex" in names:
        try:
            re.compile(objective.grpo_reward_regex)
        except re.error as error:
            raise _invalid("grpo_reward_regex", objective.grpo_reward_regex,
                           f"a Python regular expression ({error})") from error
        if not objective.grpo_reward_regex:
            raise _invalid("grpo_reward_regex", "", "a pattern when grpo_reward has regex")


def _validate_dpo(objective: ObjectiveConfig, lora_rank: int, quantization: str) -> None:
    reference = objective.reference(lora_rank)
    if reference == "adapters_off" and not lora_rank:
        raise _invalid("dpo_reference", "adapters_off", "copy or precomputed unless lora_r > 0 (only "
                                                        "LoRA has adapters to switch off)")
    if reference == "copy" and quantization != "none":
        raise _invalid("dpo_reference", "copy", "adapters_off or precomputed with quantization="
                                                f"{quantization} (the 4-bit base is the reference)")
    if objective.dpo_loss == "ipo" and objective.dpo_label_smoothing:
        raise _invalid("dpo_label_smoothing", objective.dpo_label_smoothing,
                       "0 with dpo_loss=ipo (label smoothing applies to sigmoid and robust)")


def data_kind_problem(objective: str, version: int, channel: str) -> str | None:
    """Why a channel's data (its manifest version) is not what the objective trains on; None when
    it is."""
    kind = DATA_KINDS[version]
    wanted = OBJECTIVE_DATA[objective]
    if kind in wanted:
        return None
    fitting = [name for name, kinds in OBJECTIVE_DATA.items() if kind in kinds]
    return (f"the {channel} channel holds {kind.replace('_', '-')} data (manifest version {version}) "
            f"and objective={objective} trains on {' or '.join(k.replace('_', '-') for k in wanted)} "
            f"data: set objective={fitting[0]}, or prepare the data for {objective}")


def _invalid(name: str, value, expected: str) -> ConfigError:
    return ConfigError(f"invalid hyperparameter {name!r}: got {value!r}, expected {expected}")
