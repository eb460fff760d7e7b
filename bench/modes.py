"""What one benchmark run measures: the mode (machine-sized settings) and the configurations.

Every configuration trains the same model on the same token stream with the same GLOBAL batch
(micro batch x processes x accumulation), so tokens/s compare like for like.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchModel:
    """A model of the benchmark: our program's preset, with HF config fields on top of it."""

    preset: str
    overrides: dict = field(default_factory=dict)  # our `model_overrides`, for every runner
    # Set for the peers only, so that they train the objective our program trains by default (a
    # mixture of experts: transformers adds the balance loss only with output_router_logits).
    peer_overrides: dict = field(default_factory=dict)


# Our program's default moe_aux_loss_coef, which the MoE peers train with too.
_MOE_PEERS = {"output_router_logits": True, "router_aux_loss_coef": 0.001}


@dataclass(frozen=True)
class BenchMode:
    """Sizes and switches of one benchmark mode."""

    name: str
    device: str  # "cpu" or "cuda"
    model_preset: str
    seq_len: int
    global_batch_size: int  # samples per optimizer step, the same for every configuration
    warmup_steps: int  # steps excluded from the timing (allocator, autotuning, compile)
    measure_steps: int
    rounds: int  # the configurations run this many times, interleaved; step times are pooled
    distributed_world_size: int  # processes for DDP / FSDP2 / DeepSpeed configurations
    compile: bool  # torch.compile for our program and the peers (GPU mode)
    matmul_sizes: tuple[int, ...]
    matmul_seconds: float  # time spent per size and dtype
    checkpoint_every_steps: int  # interval used to measure the stall of one save
    checkpoint_saves: int
    data_loader_tokens: int  # tokens read by the data-loader benchmark
    synth: bool  # time `cdk synth` of the whole app
    step_timeout_s: int  # a configuration that takes longer is recorded as failed
    # The mixture of experts of the `moe_*` configurations (qwen3_moe: 8 experts, top-2).
    moe_model: BenchModel = BenchModel("qwen3-moe-tiny", peer_overrides=_MOE_PEERS)

    @property
    def dense_model(self) -> BenchModel:
        return BenchModel(self.model_preset)


MODES: dict[str, BenchMode] = {
    # The default on this project's 2-core CPU machine: all configurations in under 20 minutes.
    "quick": BenchMode(
        name="quick",
        device="cpu",
        model_preset="llama-20m",
        seq_len=256,
        global_batch_size=8,
        warmup_steps=2,
        measure_steps=8,
        rounds=2,
        distributed_world_size=2,
        compile=False,
        matmul_sizes=(512, 1024, 2048, 3072),
        matmul_seconds=1.5,
        checkpoint_every_steps=4,
        checkpoint_saves=3,
        data_loader_tokens=4_000_000,
        synth=True,
        step_timeout_s=600,
        # Experts at the size of llama-20m's MLP share: hidden 256, 4 layers, 8 experts of 256.
        moe_model=BenchModel("qwen3-moe-tiny", {"hidden_size": 256, "moe_intermediate_size": 256,
                                                "num_hidden_layers": 4, "head_dim": 64},
                             _MOE_PEERS),
    ),
    # GPU machines: the same configurations on CUDA with bf16, fused AdamW, SDPA and torch.compile.
    "full": BenchMode(
        name="full",
        device="cuda",
        model_preset="llama-20m",
        seq_len=256,
        global_batch_size=64,
        warmup_steps=10,
        measure_steps=50,
        rounds=1,
        distributed_world_size=2,
        compile=True,
        matmul_sizes=(4096, 8192),
        matmul_seconds=2.0,
        checkpoint_every_steps=20,
        checkpoint_saves=3,
        data_loader_tokens=50_000_000,
        synth=True,
        step_timeout_s=600,
    ),
    # Seconds, for the smoke test: proves the harness end to end, measures nothing meaningful.
    "tiny": BenchMode(
        name="tiny",
        device="cpu",
        model_preset="llama-tiny",
        seq_len=32,
        global_batch_size=4,
        warmup_steps=1,
        measure_steps=2,
        rounds=1,
        distributed_world_size=2,
        compile=False,
        matmul_sizes=(128,),
        matmul_seconds=0.2,
        checkpoint_every_steps=2,
        checkpoint_saves=1,
        data_loader_tokens=20_000,
        synth=False,
        step_timeout_s=300,
    ),
}


@dataclass(frozen=True)
class BenchConfig:
    """One side-by-side configuration."""

    name: str
    runner: str  # "ours", "hf_trainer" or "plain_loop"
    precision: str  # "fp32" or "bf16"
    world_size: int = 1
    parallelism: str = "single"  # our program's `parallelism` hyperparameter
    hyperparameters: dict = field(default_factory=dict)  # extra hyperparameters for our program
    compile: bool | None = None  # torch.compile; None: the mode's setting
    moe: bool = False  # trains the mode's mixture of experts instead of its dense model

    def compiles(self, mode: BenchMode) -> bool:
        return mode.compile if self.compile is None else self.compile

    def model(self, mode: BenchMode) -> BenchModel:
        return mode.moe_model if self.moe else mode.dense_model


def _pipeline(mode: BenchMode, stages: int, schedule: str) -> dict:
    """Hyperparameters of a pipeline over all `stages` processes: one sample per micro-batch."""
    return {"pipeline_parallel_degree": stages, "pipeline_schedule": schedule, "micro_batch_size": 1,
            "grad_accum_steps": mode.global_batch_size}


def configurations(mode: BenchMode) -> list[BenchConfig]:
    """The configurations of one run, in the order they are measured.

    Our single-process runs use the settings we recommend for speed (compile=true, which also picks
    the eager attention on a CPU); `ours_bf16_no_compile` shows our program without them, and
    `hf_trainer_bf16_compile` the Trainer with its own `torch_compile=True`, so each ratio has its
    like-for-like counterpart. `ours_fsdp2_grad_op` is FSDP2 keeping parameters gathered from
    forward to backward (ZeRO-2 style); `ours_ddp_bf16` is the counterpart of `ours_fsdp2_bf16`.
    `ours_pp2_*` split the model into pipeline stages over the same processes (interleaved: two
    stages per process), with the global batch as micro-batches of one sample.
    """
    n = mode.distributed_world_size
    configs = [
        BenchConfig("ours_fp32", "ours", "fp32", compile=True),
        BenchConfig("ours_bf16", "ours", "bf16", compile=True),
        BenchConfig("ours_bf16_no_compile", "ours", "bf16", compile=False),
        BenchConfig("ours_ddp", "ours", "fp32", n, "ddp"),
        BenchConfig("ours_ddp_bf16", "ours", "bf16", n, "ddp"),
        BenchConfig("ours_fsdp2", "ours", "fp32", n, "fsdp", {"fsdp_sharding": "full"}),
        BenchConfig("ours_fsdp2_bf16", "ours", "bf16", n, "fsdp", {"fsdp_sharding": "full"}),
        BenchConfig("ours_fsdp2_grad_op", "ours", "fp32", n, "fsdp", {"fsdp_sharding": "grad_op"}),
        # Pipeline stages on the same processes, the global batch as 8 micro-batches of one sample
        # (DDP: one micro-batch per rank); the pipeline's counterpart is ours_ddp.
        BenchConfig("ours_pp2_1f1b", "ours", "fp32", n, "ddp", _pipeline(mode, n, "1f1b")),
        BenchConfig("ours_pp2_gpipe", "ours", "fp32", n, "ddp", _pipeline(mode, n, "gpipe")),
        BenchConfig("ours_pp2_interleaved", "ours", "fp32", n, "ddp",
                    _pipeline(mode, n, "interleaved_1f1b")),
        BenchConfig("ours_zero2", "ours", "fp32", n, "deepspeed", {"zero_stage": 2}),
        BenchConfig("ours_zero3", "ours", "fp32", n, "deepspeed", {"zero_stage": 3}),
        BenchConfig("hf_trainer_fp32", "hf_trainer", "fp32"),
        BenchConfig("hf_trainer_bf16", "hf_trainer", "bf16"),
    ]
    if not mode.compile:  # in a compiling mode hf_trainer_bf16 already compiles
        configs.append(BenchConfig("hf_trainer_bf16_compile", "hf_trainer", "bf16", compile=True))
    return [
        *configs,
        BenchConfig("plain_loop_fp32", "plain_loop", "fp32"),
        BenchConfig("plain_loop_bf16", "plain_loop", "bf16"),
        *moe_configurations(mode),
    ]


def moe_configurations(mode: BenchMode) -> list[BenchConfig]:
    """The mixture of experts (mode.moe_model) in fp32: our program against transformers' own
    Qwen3MoeForCausalLM under the HF Trainer (both eager: the grouped matmul on the CPU runs fp32
    eagerly, and under torch.compile only bf16), and expert parallelism over the 2 processes
    (FSDP2, each rank holding half of every layer's experts) against the single process."""
    n = mode.distributed_world_size
    return [
        BenchConfig("moe_ours_fp32", "ours", "fp32", compile=False, moe=True),
        BenchConfig("moe_ours_ep2", "ours", "fp32", n, "fsdp",
                    {"fsdp_sharding": "full", "expert_parallel_degree": n}, compile=False, moe=True),
        BenchConfig("moe_hf_trainer_fp32", "hf_trainer", "fp32", compile=False, moe=True),
    ]
