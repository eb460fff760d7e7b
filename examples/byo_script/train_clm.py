"""A user's own causal-LM training script, as the byo-script template wraps it.

It stands for the scripts people bring (an HF Trainer `run_clm.py` and the like): it knows nothing
about the platform beyond the SageMaker container contract. Hyperparameters arrive as `--name value`
arguments; the data comes from the `train` (and optional `validation`) channel as UTF-8 text files;
the model goes to SM_MODEL_DIR; checkpoints go to the checkpoint folder that SageMaker syncs with S3,
and a restarted job resumes from the newest one there.

Self-contained on purpose: a byte-level vocabulary (no tokenizer to download) and a GPT-2 model built
from a config (no weights to download), so it runs anywhere, CPU included:

    SM_CHANNEL_TRAIN=data/ SM_MODEL_DIR=out/ python train_clm.py --max_steps 5 --n_layer 1 --n_embd 32
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

EOS = 256  # bytes are tokens 0..255; one extra token ends each document
VOCAB_SIZE = 257


def parse_args(argv: list[str]) -> argparse.Namespace:
    base_dir = os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128, help="tokens per training sample")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--logging_steps", type=int, default=10)
    parser.add_argument("--save_steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--train_dir", default=os.environ.get("SM_CHANNEL_TRAIN"))
    parser.add_argument("--validation_dir", default=os.environ.get("SM_CHANNEL_VALIDATION"))
    parser.add_argument(
        "--model_dir", default=os.environ.get("SM_MODEL_DIR", os.path.join(base_dir, "model"))
    )
    parser.add_argument("--checkpoint_dir", default=os.path.join(base_dir, "checkpoints"))
    args = parser.parse_args(argv)
    if not args.train_dir:
        parser.error("no training data: set SM_CHANNEL_TRAIN (the train channel) or pass --train_dir")
    if args.n_embd % args.n_head:
        parser.error(f"--n_embd ({args.n_embd}) must be divisible by --n_head ({args.n_head})")
    return args


class ByteBlocks(Dataset):
    """Every text file under a folder as bytes, documents joined by EOS, cut into equal blocks."""

    def __init__(self, folder: str, block_size: int):
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith("."))
        tokens: list[int] = []
        for path in files:
            tokens.extend(path.read_bytes())
            tokens.append(EOS)
        count = len(tokens) // block_size
        if count == 0:
            raise SystemExit(
                f"{folder} holds {len(tokens)} tokens, fewer than one block of {block_size}: "
                "add text or lower --block_size"
            )
        self.blocks = torch.tensor(tokens[: count * block_size], dtype=torch.long).view(count, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block}


class MetricLines(TrainerCallback):
    """Print the platform's metric lines, which the template's metric definitions parse."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            print(
                f"[metrics] step={state.global_step} loss={float(logs['loss']):.6f} "
                f"lr={float(logs.get('learning_rate', 0.0)):.3e} "
                f"grad_norm={float(logs.get('grad_norm', 0.0)):.4f}",
                flush=True,
            )
        if "eval_loss" in logs:
            print(f"[eval] step={state.global_step} eval_loss={float(logs['eval_loss']):.6f}", flush=True)


def training_arguments(args: argparse.Namespace, has_validation: bool) -> TrainingArguments:
    on_gpu = torch.cuda.is_available()
    # Under torchrun on CPU (tests, the local runner) processes talk over gloo instead of NCCL.
    distributed_on_cpu = not on_gpu and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return TrainingArguments(
        output_dir=args.checkpoint_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate,
        logging_steps=args.logging_steps,
        save_steps=args.save_steps,
        save_total_limit=2,
        eval_strategy="steps" if has_validation else "no",
        eval_steps=args.save_steps if has_validation else None,
        seed=args.seed,
        bf16=on_gpu and torch.cuda.is_bf16_supported(),
        use_cpu=not on_gpu,
        ddp_backend="gloo" if distributed_on_cpu else None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        report_to="none",
    )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    train = ByteBlocks(args.train_dir, args.block_size)
    validation = ByteBlocks(args.validation_dir, args.block_size) if args.validation_dir else None
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=training_arguments(args, validation is not None),
        train_dataset=train,
        eval_dataset=validation,
        callbacks=[MetricLines()],
    )
    resume = get_last_checkpoint(args.checkpoint_dir) if os.path.isdir(args.checkpoint_dir) else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(args.model_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
