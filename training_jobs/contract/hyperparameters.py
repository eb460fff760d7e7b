"""Typed configuration of the training program: the hyperparameter contract.

Every hyperparameter a job template may set is a field of one of the frozen dataclasses below,
under its contract name, with its type, default, bounds and help; docs/training.md's tables are
generated from them (`python -m training_jobs.contract.docs`). Values arrive as JSON values (SM_HPS,
decoded by the SageMaker training toolkit) or as strings (command-line flags); both are validated up
front so that a bad hyperparameter stops the job before any expensive work, with a message naming it.

This module imports only the standard library (no torch): the program checks a configuration in
well under a second, on every rank identically, and the platform (llmtrain) checks a run with the
same rules before it creates a job.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .errors import ConfigError
from .fields import hp as _hp
from .objectives import ObjectiveConfig, validate_objective
from .presets import MODEL_PRESETS

__all__ = ["ConfigError", "TrainConfig", "from_hyperparameters"]


Parallelism = Literal["single", "ddp", "fsdp", "deepspeed", "smp"]
FsdpSharding = Literal["full", "hybrid", "grad_op"]
MixedPrecision = Literal["bf16", "fp16", "fp32"]
ActivationCheckpointing = Literal["none", "full", "selective"]
LrSchedule = Literal["cosine", "linear", "constant"]
Quantization = Literal["none", "nf4"]
Attention = Literal["auto", "sdpa", "eager"]
CompileMode = Literal["auto", "default", "cuda_graphs"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
CollectiveBackend = Literal["nccl", "smddp"]
PARALLELISMS: tuple[str, ...] = get_args(Parallelism)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
Fp8Recipe = Literal["tensorwise", "rowwise"]
# What a rule does when it fires (training_jobs/trainer/rules.py), mildest first.
RuleAction = Literal["off", "log", "skip", "rollback", "stop"]
# Schedules that run several stages per rank (the others run exactly one).
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
# The parallelisms QLoRA trains with: bitsandbytes' packed 4-bit weights do not shard (FSDP,
# DeepSpeed ZeRO-3, SMP).
QUANTIZED_PARALLELISMS = ("single", "ddp")


@dataclass(frozen=True)
class ModelConfig:
    model_preset: str = _hp("", "A named model size (docs/training.md, Models and tokenizers; "
                                "contract/presets.py); required unless the `model` channel holds a "
                                "checkpoint, which it then ignores.")
    model_overrides: dict = _hp({}, "HF config fields set on top of the preset, e.g. "
                                    '{"num_hidden_layers": 4}.')
    attention: Attention = _hp("auto", "Attention kernel: `sdpa` (PyTorch's fused flash / memory-"
                                       "efficient kernels), `eager` (matmul, softmax, matmul, which "
                                       "`torch.compile` fuses) or `auto`: eager when `compile` is on "
                                       "and the device is a CPU, sdpa otherwise (docs/benchmarks.md "
                                       "shows why).")


@dataclass(frozen=True)
class DataConfig:
    seq_len: int = _hp(1024, "Tokens per sample.", minimum=1)
    micro_batch_size: int = _hp(4, "Samples per data-parallel rank per micro step.", minimum=1)
    grad_accum_steps: int = _hp(1, "Micro steps per optimizer step (with pipeline parallelism: the "
                                   "pipeline's micro-batches).", minimum=1)
    global_batch_size: int = _hp(0, "Samples per optimizer step over all data-parallel ranks; 0 = "
                                    "data-parallel size x micro_batch_size x grad_accum_steps. When "
                                    "set, grad_accum_steps is derived from it (leave that at 1; the "
                                    "batch must be a multiple of data-parallel ranks x "
                                    "micro_batch_size), so an attempt on another number of GPUs "
                                    "trains the same recipe.",
                                 minimum=0)


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _hp(3e-4, "Peak learning rate.", minimum=0.0, exclusive_minimum=True)
    min_lr: float = _hp(0.0, "Learning rate at the end of the decay (at most `lr`).", minimum=0.0)
    warmup_steps: int = _hp(0, "Linear warm-up steps from 0 to `lr` (at most the decay horizon).",
                            minimum=0)
    lr_schedule: LrSchedule = _hp("cosine", "Decay from `lr` to `min_lr` after warm-up.")
    lr_decay_steps: int = _hp(0, "Step at which the decay reaches `min_lr` (0 = max_steps). Pin it "
                                 "when you train a run in stages with growing max_steps, so every "
                                 "stage follows one schedule.",
                              minimum=0)
    weight_decay: float = _hp(0.1, "AdamW weight decay (not applied to biases and norms).",
                              minimum=0.0)
    max_grad_norm: float = _hp(1.0, "Clip the global gradient norm (over all shards) to this (0 = no "
                                    "clipping).",
                               minimum=0.0)
    adam_beta1: float = _hp(0.9, "AdamW beta1.", minimum=0.0, maximum=0.999999)
    adam_beta2: float = _hp(0.95, "AdamW beta2.", minimum=0.0, maximum=0.999999)
    scale_lr_by_global_batch: bool = _hp(False, "`lr` is per 256 samples and scales linearly with "
                                                "the global batch size.")


@dataclass(frozen=True)
class ParallelConfig:
    parallelism: Parallelism = _hp("ddp", "single, ddp, fsdp (FSDP2, with tensor parallel when "
                                          "tensor_parallel_degree > 1), deepspeed or smp (SMP v2).")
    fsdp_sharding: FsdpSharding = _hp("full", "FSDP2 sharding: `full` (ZeRO-3-like), `hybrid` "
                                              "(shard within a group, replicate across groups) or "
                                              "`grad_op` (keep parameters gathered between forward "
                                              "and backward).")
    replicate_degree: int = _hp(0, "Data-parallel replicas (hybrid sharding); 0 = number of hosts.",
                                minimum=0)
    shard_degree: int = _hp(0, "Ranks one parameter is sharded over; 0 = derive.", minimum=0)
    tensor_parallel_degree: int = _hp(1, "Tensor-parallel ranks (fsdp and smp); 0 or 1 = none. "
                                         "pipeline x replicate x shard x context x tensor = world size.",
                                      minimum=0)
    sequence_parallel: bool = _hp(True, "With tensor_parallel_degree > 1 (fsdp): shard the norms and "
                                        "residual stream on the sequence (all-gather / reduce-scatter "
                                        "around each tensor-parallel region instead of an all-reduce). "
                                        "The output head is always sharded on the vocabulary and the "
                                        "loss computed on the shards (loss parallel).")
    context_parallel_degree: int = _hp(1, "Ranks one sequence is split across (fsdp, Llama-style "
                                          "models): each holds 2 of 2 x degree chunks (i and "
                                          "2 x degree - 1 - i, a causal load balance) and attends over "
                                          "the all-gathered keys and values; 0 or 1 = none.",
                                       minimum=0)
    pipeline_parallel_degree: int = _hp(1, "Pipeline stages across ranks (ddp and fsdp; "
                                           "torch.distributed.pipelining; docs/training.md, Pipeline "
                                           "parallelism and 3-D training); 0 or 1 = none.", minimum=0)
    pipeline_schedule: PipelineSchedule = _hp(
        "1f1b", "Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, interleaved_1f1b "
                "or zero_bubble (several stages per rank; zero_bubble splits backward into input and "
                "weight gradients to fill the bubble).")
    pipeline_stages_per_rank: int = _hp(0, "Stages each pipeline rank holds: 1 for gpipe and 1f1b; "
                                           "2 or more for interleaved_1f1b and zero_bubble (0 = 1 "
                                           "or 2 by schedule).", minimum=0)
    pipeline_split: str = _hp("", 'Decoder layers per stage in stage order, e.g. "7,9,9,7" (the '
                                  'first stage also holds the embedding, the last the norm and head); '
                                  "empty = balanced by compute.")
    expert_parallel_degree: int = _hp(1, "Ranks each mixture-of-experts layer's experts are split over "
                                         "(fsdp; a divisor of the number of experts and of the "
                                         "data-sharding ranks, which it borrows from: tokens travel to "
                                         "their experts' rank and back by all-to-all); 0 or 1 = none "
                                         "(docs/training.md, Mixture of experts).", minimum=0)
    collective_backend: CollectiveBackend = _hp(
        "nccl", "GPU collectives: nccl, or smddp (SageMaker's distributed data parallel library for "
                "FSDP2's collectives, on the instance types it supports; docs/training.md, SMDDP and "
                "FP8); rendered from the template's `distribution.smddp`.")
    zero_stage: int = _hp(2, "DeepSpeed ZeRO stage.", minimum=1, maximum=3)
    offload_optimizer: bool = _hp(False, "Keep optimizer state on the CPU (DeepSpeed; FSDP2 "
                                         "offloads parameters, gradients and optimizer together).")
    offload_params: bool = _hp(False, "Keep parameters on the CPU (FSDP2 CPUOffloadPolicy, "
                                      "DeepSpeed ZeRO-3 offload_param).")
    mixed_precision: MixedPrecision = _hp("bf16", "Compute precision; fp16 (single, ddp, deepspeed) "
                                                  "with loss scaling; master weights stay fp32.")
    activation_checkpointing: ActivationCheckpointing = _hp(
        "none", "Recompute activations in backward: full layers, or selective (torchtitan's op-level "
                "policy: keep attention outputs, reduce-scatter outputs and every other matmul output "
                "of a decoder layer, recompute the rest).")
    activation_checkpointing_every: int = _hp(1, "Checkpoint every k-th decoder layer (layers 0, k, "
                                                 "2k, ...).", minimum=1)
    activation_offloading: bool = _hp(False, "Move the activations autograd saves (with checkpointing: "
                                             "the layer inputs) to the CPU; SMP's "
                                             "`sm_activation_offloading` with smp.")
    compile: bool = _hp(False, "`torch.compile` each decoder layer (the first step compiles; identical "
                               "layers share one compiled graph). On this project's CPU it is the "
                               "largest single speed-up (docs/benchmarks.md).")
    fp8: bool = _hp(False, "Train the decoder layers' linear layers in FP8 (torchao float8) on GPUs of "
                           "compute capability 8.9+ (H100, H200, L4, L40S).")
    fp8_recipe: Fp8Recipe = _hp("tensorwise", "FP8 scaling: tensorwise (one scale per tensor; under "
                                              "fsdp the parameters are all-gathered in FP8, and with "
                                              "tensor parallel its all-gathers travel in FP8 too) or "
                                              "rowwise (one scale per row: more accurate, bf16 "
                                              "all-gathers, no tensor parallel).")
    compile_mode: CompileMode = _hp(
        "auto", "With compile: cuda_graphs replays each compiled layer as a CUDA graph (torch.compile "
                "mode reduce-overhead), which removes the per-kernel launch cost that bounds small "
                "models and micro batches on fast GPUs; needs parallelism=single, grad_accum_steps=1 "
                "and no activation_offloading (other parallelisms move or hook parameters and "
                "gradients outside the graphs; a second micro step's replay frees the gradients the "
                "first left), and a GPU. default: inductor's kernels launched one by one. auto: "
                "cuda_graphs on a GPU where those hold, default otherwise.")
    mp_parameters: dict = _hp({}, "SMP v2 settings passed through to torch.sagemaker.init (set by "
                                  "the SageMaker SDK's `distribution`; docs/training.md, SMP v2); a "
                                  "named degree, when set, must agree with it.")


@dataclass(frozen=True)
class MoeConfig:
    """The router of mixture-of-experts models (docs/training.md, Mixture of experts)."""

    moe_aux_loss_coef: float = _hp(0.001, "Weight of the load-balancing auxiliary loss added to the "
                                          "training loss: Switch Transformer's (Qwen3-MoE, Mixtral, as "
                                          "transformers computes it over every MoE layer's tokens) or "
                                          "DeepSeek-V3's sequence-wise one; 0 = none.", minimum=0.0)
    moe_z_loss_coef: float = _hp(0.0, "Weight of the router z-loss (ST-MoE: the mean squared "
                                      "log-sum-exp of the router logits); 0 = none.", minimum=0.0)
    moe_bias_update_rate: float = _hp(0.0, "DeepSeek-V3's auxiliary-loss-free balancing: after each "
                                           "step every expert's score-correction bias moves by this "
                                           "much towards balance (up when it took fewer than the mean "
                                           "tokens, down when more); deepseek_v3 models only; 0 = "
                                           "off (DeepSeek-V3 used 0.001).", minimum=0.0, maximum=1.0)


@dataclass(frozen=True)
class LoraConfig:
    lora_r: int = _hp(0, "LoRA rank; 0 trains the full model.", minimum=0)
    lora_alpha: float = _hp(16.0, "LoRA scaling numerator (scale = alpha / r).", minimum=0.0,
                            exclusive_minimum=True)
    lora_dropout: float = _hp(0.0, "Dropout on the LoRA input.", minimum=0.0, maximum=0.99)
    lora_target_modules: list = _hp(["all-linear"], "Module names LoRA adapts (a JSON list or "
                                                    "`q_proj,v_proj`); all-linear = every linear.")
    quantization: Quantization = _hp("none", "nf4 loads the model channel's checkpoint in 4 bits "
                                             "(QLoRA; single or ddp; needs lora_r > 0).")
    merge_lora: bool = _hp(False, "Export the merged model instead of the adapter.")


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_every_steps: int = _hp(500, "Save every N optimizer steps (0 = never by steps).",
                                      minimum=0)
    checkpoint_every_minutes: float = _hp(0.0, "Save when this many minutes passed since the last "
                                               "save (0 = never by time).", minimum=0.0)
    keep_checkpoints: int = _hp(3, "Complete checkpoints to keep (older ones are deleted).",
                                minimum=1)
    checkpoint_async: bool = _hp(True, "Write checkpoints in the background: training waits only "
                                       "while the state is copied to host memory, and the checkpoint "
                                       "is marked complete once every rank's files are written "
                                       "(parallelism single, ddp and fsdp; deepspeed and smp save "
                                       "synchronously). The last checkpoint, and one on a stop "
                                       "signal, are written before the job ends.")


@dataclass(frozen=True)
class LoggingConfig:
    log_every_steps: int = _hp(10, "Print a [metrics] line every N steps.", minimum=1)
    eval_every_steps: int = _hp(0, "Evaluate on the validation channel every N steps (0 = only "
                                   "after the last step).", minimum=0)
    eval_steps: int = _hp(10, "Validation batches per evaluation (fixed batches, the same every "
                              "time).", minimum=1)
    tensorboard: bool = _hp(False, "Write TensorBoard logs to `<output data dir>/tensorboard`.")
    profile_steps: str = _hp("", '"START-END": a torch.profiler trace of those steps, one Chrome '
                                 "trace per rank in `<output data dir>/profile/`; empty for none.")
    preflight_check: bool = _hp(False, "Check collectives (all-reduce bandwidth per rank, hung "
                                       "ranks) before training (docs/training.md, The preflight "
                                       "check).")


@dataclass(frozen=True)
class RunConfig:
    max_steps: int = _hp(1000, "Optimizer steps to train.", minimum=1)
    seed: int = _hp(42, "Seed of initialisation, data order and dropout.", minimum=0)


@dataclass(frozen=True)
class RulesConfig:
    """The rules that watch a run and act on it (docs/training.md, "Rules")."""

    rule_loss_spike_factor: float = _hp(3.0, "A step's loss above this multiple of the running mean "
                                             "of the recent healthy steps' losses is a loss spike.",
                                        minimum=1.0, exclusive_minimum=True)
    rule_loss_spike_action: RuleAction = _hp(
        "rollback", "What a loss spike does: off, log, skip (the step's update is not applied), "
                    "rollback (reload the last complete checkpoint, continue with the data after the "
                    "spike) or stop (the job fails with RuleTriggered).")
    rule_grad_norm_factor: float = _hp(10.0, "A step's gradient norm above this multiple of the "
                                             "running median of the recent healthy steps' norms is a "
                                             "gradient explosion.", minimum=1.0,
                                       exclusive_minimum=True)
    rule_grad_norm_action: RuleAction = _hp("log", "What a gradient explosion does: off, log, skip, "
                                                   "rollback or stop (as rule_loss_spike_action).")
    rule_throughput_fraction: float = _hp(0.5, "tokens/s of a logging window below this fraction of "
                                               "the running median of the recent windows' is a "
                                               "throughput drop.", minimum=0.0,
                                          exclusive_minimum=True, maximum=1.0)
    rule_throughput_action: RuleAction = _hp("log", "What a throughput drop does: off, log or stop "
                                                    "(skipping a batch or reloading weights does not "
                                                    "make a slow step fast).")
    rule_hang_minutes: float = _hp(20.0, "When no step, evaluation or checkpoint has finished for this "
                                         "many minutes, every rank writes its threads' Python stacks "
                                         "and the job fails with HungCollective, which the launcher "
                                         "retries once (0 = off).", minimum=0.0)
    rule_warmup_steps: int = _hp(20, "Steps at the start of each job (also a resumed one) that the "
                                     "loss, gradient and throughput rules neither check nor count in "
                                     "their running statistics (fast-falling loss, compilation).",
                                 minimum=0)
    rule_window: int = _hp(50, "Values the running statistics hold: the last N healthy steps' loss "
                               "and gradient norm, the last N logging windows' tokens/s. A rule "
                               "checks once it holds 5.", minimum=5)
    rule_router_collapse_fraction: float = _hp(
        0.9, "Mixture-of-experts models: a logging window in which one expert of a layer took at least "
             "this fraction of the layer's tokens is a router collapse.", minimum=0.0,
        exclusive_minimum=True, maximum=1.0)
    rule_router_collapse_action: RuleAction = _hp("stop", "What a router collapse does: off, log or "
                                                          "stop (the router does not recover by "
                                                          "skipping a step).")
    rule_max_rollbacks: int = _hp(3, "Roll-backs in a row (no new checkpoint written in between) "
                                     "after which a rule whose action is rollback stops the run.",
                                  minimum=1)


GROUPS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
          "parallel": ParallelConfig, "moe": MoeConfig, "lora": LoraConfig,
          "checkpoint": CheckpointConfig,
          "logging": LoggingConfig, "run": RunConfig, "rules": RulesConfig, "objective": ObjectiveConfig}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    @property
    def decay_steps(self) -> int:
        return self.optim.lr_decay_steps or self.run.max_steps

    def flat(self) -> dict[str, Any]:
        """Every hyperparameter by its contract name (what the job ran with)."""
        return {name: getattr(getattr(self, group), name)
                for group, cls in GROUPS.items() for name in _field_names(cls)}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def hyperparameter_fields() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """name -> (group, dataclass field, resolved type) for every hyperparameter."""
    table = {}
    for group, cls in GROUPS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            table[f.name] = (group, f, hints[f.name])
    return table


# --- parsing ------------------------------------------------------------------------------------

_INT = re.compile(r"^[+-]?\d+$")


def parse_command_line(argv: list[str]) -> dict[str, str]:
    """`--name value` / `--name=value` pairs (as the SageMaker toolkit passes them) to a dict."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected command-line argument {arg!r}: pass hyperparameters as "
                              "--name value")
        name, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 >= len(argv):
                raise ConfigError(f"hyperparameter {name!r} has no value: pass --{name} VALUE")
            value = argv[i + 1]
            i += 1
        values[name.replace("-", "_")] = value
        i += 1
    return values


def _invalid(name: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"invalid hyperparameter {name!r}: got {value!r}, expected {expected}")


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _invalid(name, value, "true or false (JSON booleans, not 0/1)")


def _coerce_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise _invalid(name, value, "an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT.match(value.strip()):
        return int(value.strip())
    raise _invalid(name, value, "an integer")


def _coerce_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _invalid(name, value, "a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise _invalid(name, value, "a number")


def _decode_json_text(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise _invalid(name, value, f"a JSON {kind.__name__}") from error
    return value


def _coerce_dict(name: str, value: Any) -> dict:
    value = _decode_json_text(name, value, dict)
    if not isinstance(value, dict):
        raise _invalid(name, value, "a JSON object")
    return value


def _coerce_list(name: str, value: Any) -> list:
    if isinstance(value, str) and not value.strip().startswith("["):
        value = [item.strip() for item in value.split(",") if item.strip()]
    value = _decode_json_text(name, value, list)
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise _invalid(name, value, "a list of names (JSON list or comma-separated)")
    return value


def _coerce_literal(name: str, value: Any, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _invalid(name, value, "one of " + ", ".join(choices))
    return value


def _coerce_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid(name, value, "a string")
    return value


_COERCERS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, dict: _coerce_dict,
             list: _coerce_list, str: _coerce_str}


def coerce(name: str, value: Any, hint: Any) -> Any:
    """Convert one raw hyperparameter value to its declared type, or raise naming it."""
    if get_origin(hint) is Literal:
        return _coerce_literal(name, value, get_args(hint))
    return _COERCERS[hint](name, value)


def _check_range(name: str, value: Any, spec: dataclasses.Field) -> None:
    meta = spec.metadata
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None and (value < low or (meta.get("exclusive_minimum") and value == low)):
        bound = f"> {low}" if meta.get("exclusive_minimum") else f">= {low}"
        raise _invalid(name, value, f"a value {bound}")
    if high is not None and (value > high or (meta.get("exclusive_maximum") and value == high)):
        bound = f"< {high}" if meta.get("exclusive_maximum") else f"<= {high}"
        raise _invalid(name, value, f"a value {bound}")


def from_hyperparameters(raw: dict[str, Any]) -> TrainConfig:
    """Build the validated configuration from raw hyperparameters (SM_HPS or command line)."""
    table = hyperparameter_fields()
    unknown = sorted(set(raw) - set(table))
    if unknown:
        raise ConfigError(f"unknown hyperparameter {unknown[0]!r}"
                          + (f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else "")
                          + _did_you_mean(unknown[0], table))
    grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for name, value in raw.items():
        group, spec, hint = table[name]
        converted = coerce(name, value, hint)
        if isinstance(converted, int | float) and not isinstance(converted, bool):
            _check_range(name, converted, spec)
        grouped[group][name] = converted
    config = TrainConfig(**{group: GROUPS[group](**values) for group, values in grouped.items()})
    validate(config)
    return config


def _did_you_mean(name: str, table: dict) -> str:
    import difflib

    close = difflib.get_close_matches(name, table, n=1)
    return f"; did you mean {close[0]!r}?" if close else "; see docs/training.md for the list"


# --- cross-field rules --------------------------------------------------------------------------

_PROFILE = re.compile(r"^(\d+)-(\d+)$")


def profile_window(text: str) -> tuple[int, int] | None:
    """(first, last) step of the profiler window, or None when profiling is off."""
    if not text:
        return None
    match = _PROFILE.match(text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise _invalid("profile_steps", text, '"START-END" with 1 <= START <= END, e.g. "5-7"')
    return int(match[1]), int(match[2])


def validate(config: TrainConfig) -> None:
    """Rules that involve more than one hyperparameter."""
    optim, par, lora = config.optim, config.parallel, config.lora
    if config.model.model_preset and config.model.model_preset not in MODEL_PRESETS:
        raise _invalid("model_preset", config.model.model_preset, "one of " + ", ".join(MODEL_PRESETS))
    if optim.min_lr > optim.lr:
        raise _invalid("min_lr", optim.min_lr, f"a value <= lr ({optim.lr})")
    if optim.warmup_steps > config.decay_steps:
        raise _invalid("warmup_steps", optim.warmup_steps,
                       f"at most the decay horizon ({config.decay_steps} steps: lr_decay_steps or "
                       "max_steps)")
    profile_window(config.logging.profile_steps)
    _validate_parallel(par)
    if par.compile_mode == "cuda_graphs" and not cuda_graphs_apply(config):
        # FSDP, DDP and DeepSpeed move or hook parameters and gradients outside the captured graphs,
        # offloading copies activations to the host, and a second micro step's replay frees the
        # gradients the first one left: each would read memory a replay has overwritten.
        raise _invalid("compile_mode", "cuda_graphs", "auto or default unless compile=true, "
                                                      "parallelism=single, grad_accum_steps=1 and no "
                                                      "activation_offloading")
    if lora.quantization == "nf4" and lora.lora_r == 0:
        raise _invalid("quantization", "nf4", "none unless lora_r > 0 (QLoRA trains adapters on "
                                              "a 4-bit base)")
    if lora.merge_lora and lora.lora_r == 0:
        raise _invalid("merge_lora", True, "false unless lora_r > 0")
    if lora.merge_lora and lora.quantization != "none":
        raise _invalid("merge_lora", True, "false with quantization=nf4 (the export merges into a "
                                           "full-precision base; merge the exported adapter into the "
                                           "original checkpoint instead)")
    if lora.lora_r and par.tensor_parallel_degree > 1:
        raise _invalid("lora_r", lora.lora_r, "0 with tensor_parallel_degree > 1 (LoRA with tensor "
                                              "parallel is not supported; use fsdp sharding)")
    _validate_pipeline(config)
    _validate_context_parallel(config)
    _validate_experts(config)
    _validate_rules(config)
    validate_objective(config.objective, parallelism=par.parallelism,
                       pipeline_degree=par.pipeline_parallel_degree,
                       context_degree=par.context_parallel_degree, lora_rank=lora.lora_r,
                       quantization=lora.quantization)
    if config.data.global_batch_size and config.data.grad_accum_steps != 1:
        raise _invalid("grad_accum_steps", config.data.grad_accum_steps,
                       "1 when global_batch_size is set (the accumulation steps are derived from it)")


def cuda_graphs_apply(config: TrainConfig) -> bool:
    """Whether compiled layers may be replayed as CUDA graphs (on a GPU): the settings they were
    measured and tested with (docs/benchmarks.md, GPU mode)."""
    par = config.parallel
    return (par.compile and par.parallelism == "single" and config.data.grad_accum_steps == 1
            and not par.activation_offloading)


def _validate_parallel(par: ParallelConfig) -> None:
    tp = par.tensor_parallel_degree
    if tp > 1 and par.parallelism not in ("fsdp", "smp"):
        raise _invalid("tensor_parallel_degree", tp,
                       f"1 with parallelism={par.parallelism} (tensor parallel runs with fsdp or smp)")
    if par.fsdp_sharding != "hybrid" and par.parallelism == "fsdp" and par.replicate_degree > 1:
        raise _invalid("replicate_degree", par.replicate_degree,
                       "0 or 1 unless fsdp_sharding=hybrid")
    for name in ("offload_params", "offload_optimizer"):
        if getattr(par, name) and par.parallelism in ("single", "ddp"):
            raise _invalid(name, True, f"false with parallelism={par.parallelism} (offload needs fsdp "
                                       "or deepspeed)")
    if par.offload_params and par.parallelism == "deepspeed" and par.zero_stage != 3:
        raise _invalid("offload_params", True, "false unless zero_stage=3 (DeepSpeed offloads "
                                               "parameters only in ZeRO-3)")
    if par.mixed_precision == "fp16" and par.parallelism == "fsdp":
        raise _invalid("mixed_precision", "fp16", "bf16 or fp32 with fsdp (fp16 needs loss scaling, "
                                                  "provided with single, ddp and deepspeed)")
    if par.activation_offloading and par.activation_checkpointing == "none":
        raise _invalid("activation_offloading", True,
                       "false unless activation_checkpointing is full or selective")
    if par.collective_backend == "smddp" and (par.parallelism != "fsdp"
                                              or par.pipeline_parallel_degree > 1):
        raise _invalid("collective_backend", "smddp",
                       "nccl unless parallelism=fsdp without pipeline stages: launched by torchrun, "
                       "SMDDP replaces FSDP's all-gather; its all-reduce (ddp) needs SageMaker's mpirun "
                       "launcher, and it cannot form the sub-groups pipeline stages talk over")
    if par.fp8 and (par.parallelism not in ("single", "ddp", "fsdp") or par.mixed_precision != "bf16"):
        raise _invalid("fp8", True, "false unless parallelism is single, ddp or fsdp, with "
                                    "mixed_precision=bf16 (float8 matmuls, the rest in bf16)")
    if par.fp8 and par.fp8_recipe == "rowwise" and par.tensor_parallel_degree > 1:
        raise _invalid("fp8_recipe", "rowwise", "tensorwise with tensor_parallel_degree > 1 (torchao's "
                                                "float8 tensor-parallel layers take tensorwise scales)")


def _validate_context_parallel(config: TrainConfig) -> None:
    cp = config.parallel.context_parallel_degree
    if cp <= 1:
        return
    if config.parallel.parallelism != "fsdp":
        raise _invalid("context_parallel_degree", cp, f"1 with parallelism={config.parallel.parallelism} "
                                                      "(context parallel runs with fsdp, which shards "
                                                      "the parameters over the data and context ranks)")
    if config.data.seq_len % (2 * cp):
        raise _invalid("context_parallel_degree", cp, f"a degree whose 2 x degree chunks divide seq_len "
                                                      f"({config.data.seq_len}) evenly")
    if config.model.attention == "eager":
        raise _invalid("attention", "eager", "auto or sdpa with context_parallel_degree > 1 (context "
                                             "parallel attention runs PyTorch's SDPA kernels)")
    if config.lora.lora_r:
        raise _invalid("lora_r", config.lora.lora_r, "0 with context_parallel_degree > 1 (LoRA with "
                                                     "context parallel is not supported)")


def default_stages_per_rank(schedule: str) -> int:
    """1 for gpipe and 1f1b, 2 for the interleaved schedules."""
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def _validate_experts(config: TrainConfig) -> None:
    from . import moe
    from .presets import PRESETS

    moe.check_parallelism(config)
    if config.model.model_preset:
        family, architecture = PRESETS[config.model.model_preset]
        moe.check_model(config, family, {**architecture, **config.model.model_overrides},
                        f"model_preset {config.model.model_preset}")


def _validate_rules(config: TrainConfig) -> None:
    rules = config.rules
    if rules.rule_router_collapse_action in ("skip", "rollback"):
        raise _invalid("rule_router_collapse_action", rules.rule_router_collapse_action,
                       "off, log or stop (a collapsed router stays collapsed after a skipped step or a "
                       "roll-back to the weights that led to it)")
    if rules.rule_throughput_action in ("skip", "rollback"):
        raise _invalid("rule_throughput_action", rules.rule_throughput_action,
                       "off, log or stop (a slow step is neither its batch's fault nor the weights': "
                       "skipping or rolling back does not make the next one faster)")
    if config.parallel.parallelism == "deepspeed":
        for name in ("rule_loss_spike_action", "rule_grad_norm_action"):
            if getattr(rules, name) == "skip":
                raise _invalid(name, "skip", "off, log, rollback or stop with parallelism=deepspeed "
                                             "(DeepSpeed applies the update inside its engine at the "
                                             "last micro-batch, before a rule sees the step)")


def pipeline_stages_per_rank(par: ParallelConfig) -> int:
    """Stages per pipeline rank: the setting, or 1 (gpipe, 1f1b) / 2 (interleaved schedules)."""
    return par.pipeline_stages_per_rank or default_stages_per_rank(par.pipeline_schedule)


def pipeline_split(text: str) -> tuple[int, ...]:
    """The manual split "7,9,9,7" as decoder layers per stage; () for the balanced split."""
    if not text.strip():
        return ()
    parts = [part.strip() for part in text.split(",")]
    if not all(_INT.match(part) and int(part) > 0 for part in parts):
        raise _invalid("pipeline_split", text, 'decoder layers per stage as positive integers, e.g. '
                                               '"7,9,9,7", or empty for a balanced split')
    return tuple(int(part) for part in parts)


def _validate_pipeline(config: TrainConfig) -> None:
    par = config.parallel
    if par.pipeline_parallel_degree <= 1:
        return
    if par.parallelism == "smp":
        raise _invalid("pipeline_parallel_degree", par.pipeline_parallel_degree,
                       "1 with parallelism=smp: SMP v2 has no pipeline parallelism (it shards with "
                       "FSDP and splits layers with tensor parallel); use parallelism=fsdp for "
                       "pipeline stages, or smp without them")
    if par.parallelism not in ("ddp", "fsdp"):
        raise _invalid("pipeline_parallel_degree", par.pipeline_parallel_degree,
                       f"1 with parallelism={par.parallelism} (pipeline stages are replicated with ddp "
                       "or sharded with fsdp)")
    if config.lora.lora_r:
        raise _invalid("lora_r", config.lora.lora_r, "0 with pipeline_parallel_degree > 1 (LoRA with "
                                                     "pipeline parallelism is not supported)")
    if par.mixed_precision == "fp16":
        raise _invalid("mixed_precision", "fp16", "bf16 or fp32 with pipeline_parallel_degree > 1 "
                                                  "(fp16 loss scaling is not pipelined)")
    stages = pipeline_stages_per_rank(par)
    multi = par.pipeline_schedule in MULTI_STAGE_SCHEDULES
    if multi and stages < 2 or not multi and stages != 1:
        raise _invalid("pipeline_stages_per_rank", par.pipeline_stages_per_rank,
                       ("2 or more" if multi else "0 or 1") + f" with pipeline_schedule="
                       f"{par.pipeline_schedule}")
    split = pipeline_split(par.pipeline_split)
    total = par.pipeline_parallel_degree * stages
    if split and len(split) != total:
        raise _invalid("pipeline_split", par.pipeline_split,
                       f"{total} numbers, one per stage (pipeline_parallel_degree "
                       f"{par.pipeline_parallel_degree} x {stages} stages per rank)")
    micro_batches = config.data.grad_accum_steps
    if not config.data.global_batch_size and micro_batches < par.pipeline_parallel_degree:
        raise _invalid("grad_accum_steps", micro_batches,
                       f"at least pipeline_parallel_degree ({par.pipeline_parallel_degree}): the "
                       "accumulation steps are the pipeline's micro-batches, and fewer leave stages "
                       "idle (4 x the degree or more keeps the bubble small)")
