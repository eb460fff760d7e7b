"""The HF Trainer on the same model, data and batch, configured as its documentation suggests.

Run as `python -m bench.workers.hf_trainer --spec JSON` by bench.run.
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from bench.tokens import batch, load_tokens
from bench.workers.common import WorkerSpec, build_model, step_done, write_result


class TokenSamples(torch.utils.data.Dataset):
    """Sample i of the shared token stream, as the Trainer's data collator expects it."""

    def __init__(self, spec: WorkerSpec):
        self._tokens = load_tokens(spec.tokens_path)
        self._seq_len = spec.seq_len
        self._length = spec.steps * spec.batch_size

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:
        input_ids = torch.from_numpy(batch(self._tokens, index, 1, self._seq_len)[0])
        return {"input_ids": input_ids, "labels": input_ids}


class StepLineCallback(TrainerCallback):
    def __init__(self, device: str):
        self.device = device

    def on_step_end(self, args, state, control, **kwargs):
        step_done(state.global_step, self.device)


def train(spec: WorkerSpec) -> None:
    arguments = TrainingArguments(
        output_dir=spec.work_dir,
        per_device_train_batch_size=spec.batch_size,
        max_steps=spec.steps,
        learning_rate=spec.lr,
        weight_decay=spec.weight_decay,
        adam_beta1=spec.adam_betas[0],
        adam_beta2=spec.adam_betas[1],
        lr_scheduler_type="cosine",
        warmup_steps=spec.warmup_lr_steps,
        max_grad_norm=spec.max_grad_norm,
        bf16=spec.precision == "bf16",
        use_cpu=spec.device == "cpu",
        torch_compile=spec.compile,
        logging_steps=spec.steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec.seed,
    )
    trainer = Trainer(
        model=build_model(spec),
        args=arguments,
        train_dataset=TokenSamples(spec),
        callbacks=[StepLineCallback(spec.device)],
    )
    output = trainer.train()
    write_result(spec, final_loss=output.training_loss, extra={"optimizer": arguments.optim})


if __name__ == "__main__":
    train(WorkerSpec.from_argv())
