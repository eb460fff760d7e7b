"""TRL's DPOTrainer on the same model, preference pairs and batch as our program's DPO run
(bench.dpo), configured as TRL's documentation shows: the text pairs tokenized by TRL with the same
tokenizer, the reference a frozen copy of the initial model (given as ref_model: TRL would load one
from the model's hub name, which a model built from a config does not have).

Run as `python -m bench.workers.trl_dpo --spec JSON` by bench.dpo.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

from transformers import TrainerCallback

from bench.workers.common import WorkerSpec, build_model, step_done, write_result


class StepLineCallback(TrainerCallback):
    def __init__(self, device: str):
        self.device = device

    def on_step_end(self, args, state, control, **kwargs):
        step_done(state.global_step, self.device)


def read_pairs(path: Path) -> list[dict[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{key: row[key] for key in ("prompt", "chosen", "rejected")} for row in rows]


def train(spec: WorkerSpec) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from bench.dpo import DPO_BETA, PAIRS
    from bench.model import _tokenizer

    arguments = DPOConfig(
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
        beta=DPO_BETA,
        max_length=spec.seq_len,
        logging_steps=spec.steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec.seed,
    )
    model = build_model(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model).requires_grad_(False).eval(),
            args=arguments,
            train_dataset=Dataset.from_list(read_pairs(PAIRS)),
            processing_class=_tokenizer(),
            callbacks=[StepLineCallback(spec.device)],
        )
    output = trainer.train()
    write_result(spec, final_loss=output.training_loss)


if __name__ == "__main__":
    train(WorkerSpec.from_argv())
