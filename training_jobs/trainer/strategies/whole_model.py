"""What the strategies that train the whole model on every rank share (single, ddp, fsdp with
tensor parallel, and SMP v2): gradient accumulation around a wrapped model, evaluation, the
optimizer step and DCP checkpoints. Subclasses build and wrap the model; this class trains it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ...contract.hyperparameters import TrainConfig
from .. import parallel
from ..loss import causal_lm_loss_sum, trained_targets
from ..models import forward_logits
from .optimization import Optimization, read_state, write_state
from .protocol import LossFn, MicroBatch, ModelSummary, UpdateGate
from .setup import summarize

# How gradients are accumulated over micro-batches: by FSDP2's switches (trainer/parallel.py's
# fully_shard), by the wrapper's no_sync until the last micro-batch (DDP, FSDP1), or locally.
Accumulation = Literal["fsdp2", "no_sync", "local"]


class WholeModelStrategy:
    eval_micro_batches = 1

    def __init__(self, config: TrainConfig, device: torch.device, topology: parallel.Topology, *,
                 kind: str, model: nn.Module, hf_model: nn.Module, accumulation: Accumulation,
                 clip: Callable[[float], torch.Tensor] | None = None, asynchronous: bool) -> None:
        self.config, self.device, self.topology, self.kind = config, device, topology, kind
        self.model, self.hf_model, self.accumulation = model, hf_model, accumulation
        self.optimization = Optimization(config, [hf_model], device, topology.data_parallel_size)
        self._clip = clip or (lambda max_norm: parallel.clip_grad_norm(self.optimization.parameters,
                                                                        max_norm))
        self.saves_asynchronously = asynchronous

    def model_summary(self) -> ModelSummary:
        return summarize(self.hf_model)

    # --- training ---

    @contextlib.contextmanager
    def _micro_step(self, last: bool):
        """Gradient synchronisation for a micro step, and autocast where FSDP2 does not cast."""
        sync = contextlib.nullcontext()
        if self.accumulation == "fsdp2":
            self._fsdp_accumulation(last)
        elif self.accumulation == "no_sync" and not last:
            sync = self.model.no_sync()  # accumulate locally, reduce once
        cast = contextlib.nullcontext() if self.accumulation == "fsdp2" else \
            parallel.autocast_context(self.device, self.config.parallel.mixed_precision)
        with sync, cast, parallel.activation_offload(self.config.parallel, self.device):
            yield

    def _fsdp_accumulation(self, last: bool) -> None:
        """full: reduce-scatter every micro step, so gradients stay sharded (the point of full
        sharding); hybrid: also, but all-reduce across replicas (between nodes) only on the last;
        grad_op: keep unsharded gradients until the last micro step (more memory, less traffic)."""
        sharding = self.config.parallel.fsdp_sharding
        if sharding == "grad_op":
            self.model.set_requires_gradient_sync(last)
        elif sharding == "hybrid":
            self.model.set_requires_all_reduce(last)

    def _logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's tokens (its vocabulary shard under tensor parallel)."""
        topology = self.topology
        return topology.vocabulary_logits(forward_logits(self.model, inputs, topology.positions(inputs)))

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            with self._micro_step(index == len(micro_batches) - 1):
                loss = loss_fn(self._logits(inputs), targets)
            self.optimization.backward(loss / len(micro_batches))
            total += loss.detach()
        return total / len(micro_batches)

    @torch.no_grad()
    def inference_logits(self, inputs: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """The logits of `inputs` under `model` (default: the policy), without gradients: a
        post-training objective's reference or evaluation forward (objectives/protocol.PolicyModel)."""
        cast = contextlib.nullcontext() if self.accumulation == "fsdp2" else \
            parallel.autocast_context(self.device, self.config.parallel.mixed_precision)
        topology = self.topology
        with cast:
            return topology.vocabulary_logits(forward_logits(model if model is not None else self.hf_model,
                                                             inputs, topology.positions(inputs)))

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
               temperature: float) -> torch.Tensor:
        """[rows, max_new_tokens]: tokens sampled from the policy after each left-padded prompt, with
        its KV cache (transformers' generate). Every row runs the full length (no early stop at the
        end-of-sequence id), so every rank makes the same number of forwards."""
        from transformers import GenerationConfig

        settings = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                    max_new_tokens=max_new_tokens, eos_token_id=None,
                                    pad_token_id=int(prompt_ids[0, 0]), use_cache=True)
        cast = contextlib.nullcontext() if self.accumulation == "fsdp2" else \
            parallel.autocast_context(self.device, self.config.parallel.mixed_precision)
        with cast:
            out = self.hf_model.generate(input_ids=prompt_ids, attention_mask=attention_mask,
                                         generation_config=settings)
        return out[:, prompt_ids.shape[1]:]

    def adapters_off(self) -> contextlib.AbstractContextManager:
        """The policy's LoRA adapters switched off inside the context (peft's disable_adapter)."""
        return self.hf_model.disable_adapter()

    def evaluate(self, batches: list[MicroBatch]) -> torch.Tensor:
        total = torch.zeros(2, device=self.device)
        for inputs, targets in batches:
            with self._micro_step(True):
                logits = self._logits(inputs)
                total += torch.stack([causal_lm_loss_sum(logits, targets), trained_targets(targets)])
        return total

    def step(self, gate: UpdateGate | None = None) -> torch.Tensor:
        return self.optimization.step(self._clip, gate)

    def current_lr(self) -> float:
        return self.optimization.current_lr()

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def scheduler_state(self) -> dict:
        return self.optimization.scheduler_state()

    def load_scheduler(self, state: dict) -> None:
        self.optimization.load_scheduler(state)

    # --- state ---

    def save_checkpoint(self, folder: Path, background_group=None) -> Future | None:
        return write_state(self.optimization.state([self.model]), folder, background_group)

    def load_checkpoint(self, folder: Path) -> None:
        state = self.optimization.state([self.model])
        read_state(state, folder)
        self.optimization.load_state([self.model], state)

    def full_state_dict(self) -> dict:
        return parallel.gathered_state_dict(self.model)

    def close(self) -> None:
        pass
