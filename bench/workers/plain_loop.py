"""The minimal plain PyTorch loop: what a competent engineer writes in 30 lines.

AdamW (fused), bf16 autocast when asked, gradient clipping, a cosine schedule; no framework.
Run as `python -m bench.workers.plain_loop --spec JSON` by bench.run.
"""

from __future__ import annotations

import math

import torch

from bench.tokens import batch, load_tokens
from bench.workers.common import WorkerSpec, build_model, step_done, write_result


def cosine_with_warmup(spec: WorkerSpec):
    def factor(step: int) -> float:
        if step < spec.warmup_lr_steps:
            return (step + 1) / spec.warmup_lr_steps
        progress = (step - spec.warmup_lr_steps) / max(1, spec.steps - spec.warmup_lr_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(spec: WorkerSpec) -> None:
    device = torch.device(spec.device)
    model = build_model(spec).to(device)
    if spec.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=spec.adam_betas, weight_decay=spec.weight_decay, fused=True
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(spec))
    tokens = load_tokens(spec.tokens_path)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.precision == "bf16")
    for step in range(spec.steps):
        input_ids = torch.from_numpy(batch(tokens, step, spec.batch_size, spec.seq_len)).to(device)
        with autocast:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step_done(step + 1, spec.device)
    write_result(spec, final_loss=loss.item())


if __name__ == "__main__":
    train(WorkerSpec.from_argv())
