"""Mixture-of-experts rules that need only the model's config: its experts, its top-k, and what the
expert-parallel and router hyperparameters may be with it.

Standard library only: the program checks a preset (with its model_overrides) before any work, and
a `model` channel's config.json once it has read it, with the same function; the platform can check
a run's preset the same way before it creates a job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .hyperparameters import TrainConfig

# model_type -> the config fields holding (the number of routed experts, experts per token).
MOE_MODEL_TYPES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("num_experts", "num_experts_per_tok"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok"),
}
# Families whose router adds a correction bias (not trained by gradients) to the scores before top-k
# (DeepSeek-V3's e_score_correction_bias), which the auxiliary-loss-free balancing moves.
SCORE_BIAS_MODEL_TYPES = ("deepseek_v3",)
# Mixture-of-experts models train with these parallelisms (their router losses and counts are taken
# after each whole-model forward).
MOE_PARALLELISMS = ("single", "ddp", "fsdp")
# Expert parallelism runs with these parallelisms and without these other degrees.
EXPERT_PARALLELISMS = ("fsdp",)
_NOT_WITH_EXPERTS = (("pipeline_parallel_degree", "pipeline stages"),
                     ("tensor_parallel_degree", "tensor parallel"),
                     ("context_parallel_degree", "context parallel"))


@dataclass(frozen=True)
class ExpertShape:
    num_experts: int
    top_k: int


def expert_shape(model_type: str, config: Mapping[str, Any]) -> ExpertShape | None:
    """The routed experts and top-k of a config (a config.json's content); None for a dense model."""
    names = MOE_MODEL_TYPES.get(model_type)
    if names is None:
        return None
    experts = config.get(names[0], config.get("num_local_experts"))
    return ExpertShape(int(experts), int(config[names[1]]))


def _invalid(name: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"invalid hyperparameter {name!r}: got {value!r}, expected {expected}")


def check_model(config: TrainConfig, model_type: str, model_config: Mapping[str, Any], where: str) -> None:
    """The MoE hyperparameters against the model (`where` names it in the messages)."""
    shape = expert_shape(model_type, model_config)
    degree = config.parallel.expert_parallel_degree
    if shape is None:
        if degree > 1:
            raise _invalid("expert_parallel_degree", degree, f"1: {where} is a dense {model_type} model "
                                                             "without experts to split")
        return
    par = config.parallel
    if par.parallelism not in MOE_PARALLELISMS:
        raise _invalid("parallelism", par.parallelism, f"one of {', '.join(MOE_PARALLELISMS)} for {where}, a "
                                                       "mixture of experts")
    if par.pipeline_parallel_degree > 1:
        raise _invalid("pipeline_parallel_degree", par.pipeline_parallel_degree,
                       f"1 for {where}: a mixture of experts is not split into pipeline stages")
    for name, what in _NOT_WITH_EXPERTS[1:]:
        if getattr(par, name) > 1:
            raise _invalid(name, getattr(par, name), f"1 for {where}: {what} splits dense Llama-layout "
                                                     "models only (use expert_parallel_degree and fsdp)")
    if par.fp8:
        raise _invalid("fp8", True, f"false for {where}: FP8 converts linear layers only, so the routed "
                                    "experts (most of a mixture's matmuls) would stay in bf16, and FP8 "
                                    "with experts has not been run on a GPU")
    if shape.top_k > shape.num_experts or shape.top_k < 1:
        raise ConfigError(f"{where} routes each token to {shape.top_k} experts (num_experts_per_tok) "
                          f"but has {shape.num_experts}: set num_experts_per_tok between 1 and "
                          f"{shape.num_experts} (model_overrides)")
    if degree > 1 and shape.num_experts % degree:
        raise _invalid("expert_parallel_degree", degree, f"a divisor of the {shape.num_experts} experts "
                                                         f"of {where}")
    if config.moe.moe_bias_update_rate > 0 and model_type not in SCORE_BIAS_MODEL_TYPES:
        raise _invalid("moe_bias_update_rate", config.moe.moe_bias_update_rate,
                       f"0 for {where}: auxiliary-loss-free balancing moves a score-correction bias that "
                       f"only {', '.join(SCORE_BIAS_MODEL_TYPES)} routers have (use moe_aux_loss_coef)")


def check_parallelism(config: TrainConfig) -> None:
    """Expert parallelism's combinations, named where refused (before the model is known)."""
    par = config.parallel
    degree = par.expert_parallel_degree
    if degree <= 1:
        return
    if par.parallelism not in EXPERT_PARALLELISMS:
        raise _invalid("expert_parallel_degree", degree, f"1 with parallelism={par.parallelism} (expert "
                                                         "parallel runs with fsdp, whose data-sharding "
                                                         "ranks it splits the experts over)")
    for name, what in _NOT_WITH_EXPERTS:
        if getattr(par, name) > 1:
            raise _invalid("expert_parallel_degree", degree, f"1 with {name} > 1 (expert parallel with "
                                                             f"{what} is not supported)")
    if par.fsdp_sharding == "hybrid":
        raise _invalid("expert_parallel_degree", degree, "1 with fsdp_sharding=hybrid (expert parallel "
                                                         "splits the full or grad_op sharding dimension)")
    if config.lora.lora_r:
        raise _invalid("expert_parallel_degree", degree, "1 with lora_r > 0 (LoRA on split experts is "
                                                         "not supported)")


def check_shard_dimension(degree: int, shard: int, world_size: int) -> None:
    """Expert parallel borrows its ranks from the data-sharding dimension (as torchtitan's does)."""
    if degree > 1 and shard % degree:
        raise _invalid("expert_parallel_degree", degree, f"a divisor of the data-sharding ranks ({shard} "
                                                         f"of the world size {world_size})")
