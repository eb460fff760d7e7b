"""DeepSpeed ZeRO stage 1, 2 or 3, with optimizer and parameter offload.

The optimizer is torch's AdamW (the same update as the other strategies, so losses are comparable)
and the learning-rate schedule is ours; DeepSpeed partitions them, reduces gradients, clips, scales
fp16 losses and writes its own checkpoint files, which the atomic checkpoint scheme wraps.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from ...contract.hyperparameters import TrainConfig
from .. import parallel
from ..errors import ConfigError
from ..loss import causal_lm_loss_sum, trained_targets
from ..models import forward_logits
from ..optim import build_optimizer, build_scheduler, peak_lr, resume_schedule
from .protocol import LossFn, MicroBatch, ModelSummary, UpdateGate
from .setup import SetupContext, prepare_model, summarize

TAG = "deepspeed"


def deepspeed_config(config: TrainConfig, data_parallel_size: int, on_gpu: bool) -> dict:
    """The DeepSpeed JSON config equivalent to our hyperparameters."""
    par, data = config.parallel, config.data
    zero: dict = {"stage": par.zero_stage, "contiguous_gradients": True, "overlap_comm": on_gpu,
                  "reduce_scatter": True}
    if par.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if par.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": data.micro_batch_size,
        "gradient_accumulation_steps": data.grad_accum_steps,
        "train_batch_size": data.micro_batch_size * data.grad_accum_steps * data_parallel_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": par.mixed_precision == "bf16"},
        "fp16": {"enabled": par.mixed_precision == "fp16", "loss_scale": 0},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "gradient_clipping": config.optim.max_grad_norm,  # DeepSpeed's default is 1.0, ours says 0 = off
    }


class DeepSpeedStrategy:
    saves_asynchronously = False  # DeepSpeed writes its own files, synchronously
    eval_micro_batches = 1

    def __init__(self, ctx: SetupContext) -> None:
        import deepspeed

        config = ctx.config
        self.config, self.device, self.kind = config, ctx.device, "deepspeed"
        if config.parallel.mixed_precision == "fp16" and ctx.device.type == "cpu":
            raise ConfigError("invalid hyperparameter 'mixed_precision': DeepSpeed runs fp16 only on "
                              "GPUs; use bf16 or fp32 on a CPU")
        if config.parallel.activation_offloading:
            raise ConfigError("invalid hyperparameter 'activation_offloading': not supported with "
                              "deepspeed; use fsdp or smp")
        self.topology = parallel.build_topology(ctx.dims, ctx.device, needs_mesh=False)
        model = prepare_model(ctx, materialize=True, load_weights=ctx.rank == 0).to(ctx.device)
        if ctx.world_size > 1:
            parallel.broadcast_module(model)
        parallel.apply_activation_checkpointing(model, config.parallel.activation_checkpointing,
                                                config.parallel.activation_checkpointing_every)
        if config.parallel.compile:
            parallel.apply_compile(model)
        self.hf_model = model
        data_parallel = ctx.dims.data_parallel
        self.peak_lr = peak_lr(config, data_parallel * config.data.micro_batch_size
                               * config.data.grad_accum_steps)
        optimizer = build_optimizer(model, config.optim, self.peak_lr)
        self.scheduler = build_scheduler(optimizer, config, self.peak_lr)
        if ctx.device.type == "cpu":
            # DeepSpeed's CPU shared-memory all-reduce is compiled at run time (minutes, and again on
            # every launch); gloo is what CPU runs use anyway. The probe result is a module-level
            # dict that DeepSpeed documents as editable.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False)  # adopts our process group
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=self.scheduler,
            config=deepspeed_config(config, data_parallel, ctx.device.type == "cuda"))
        self.model = self.engine
        self.applied_lr: float | None = None

    def model_summary(self) -> ModelSummary:
        return summarize(self.hf_model)

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        """DeepSpeed knows the accumulation boundary from its config: backward scales by 1 /
        gradient_accumulation_steps itself, and step() updates only at the boundary."""
        total = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            loss = loss_fn(forward_logits(self.engine, inputs), targets)
            self.engine.backward(loss)
            if index == len(micro_batches) - 1:
                self.applied_lr = self.scheduler.get_last_lr()[0]
            self.engine.step()
            total += loss.detach()
        return total / len(micro_batches)

    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        total = torch.zeros(2, device=self.device)
        for inputs, targets in batches:
            logits = forward_logits(self.engine, inputs)
            total += torch.stack([causal_lm_loss_sum(logits, targets), trained_targets(targets)])
        return total

    def step(self, gate: UpdateGate | None = None) -> torch.Tensor:
        if gate is not None:  # config.validate refuses the rule actions that need one
            raise ConfigError("DeepSpeed applies the update inside forward_backward: a rule cannot "
                              "skip it (use rule action log, rollback or stop)")
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32)

    def current_lr(self) -> float:
        return self.applied_lr if self.applied_lr is not None else self.scheduler.get_last_lr()[0]

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    def save_checkpoint(self, folder: Path, background_group=None) -> Future | None:
        if background_group is not None:
            raise ValueError("DeepSpeed writes checkpoints synchronously (saves_asynchronously is "
                             "false)")
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        return None

    def load_checkpoint(self, folder: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise ConfigError(f"DeepSpeed found no checkpoint in {folder}")

    def load_scheduler(self, state: dict) -> None:
        resume_schedule(self.scheduler, state)

    def full_state_dict(self) -> dict:
        """Every weight, gathered to rank 0 one parameter at a time (ZeRO-3 partitions them)."""
        import deepspeed

        module = self.engine.module
        state = {}
        for name, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None,
                                                   enabled=self.config.parallel.zero_stage == 3):
                if dist.get_rank() == 0:
                    state[name] = param.data.detach().float().cpu().clone()
        if dist.get_rank() == 0:
            state.update({name: buffer.detach().cpu().clone() for name, buffer in module.named_buffers()
                          if name in module.state_dict()})
        return state

    def close(self) -> None:
        self.engine.destroy()
