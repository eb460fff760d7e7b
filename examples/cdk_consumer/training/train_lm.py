"""Acme's own training program, wrapped by its `acme-charlm` job template.

A byte-level recurrent language model in plain PyTorch: it knows the SageMaker container contract
and nothing of the platform. Hyperparameters arrive as `--name value` arguments; text files come
from the `train` channel; checkpoints go to the folder SageMaker syncs with S3 (a restarted job
resumes from the newest one); the model goes to SM_MODEL_DIR. Under torchrun with more than one
process it trains data-parallel (NCCL on GPUs, gloo on CPU). It runs anywhere:

    SM_CHANNEL_TRAIN=data/ SM_MODEL_DIR=out/ python train_lm.py --max_steps 20 --checkpoint_dir ckpt/
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCABULARY = 256  # one token per byte: nothing to download


class ByteLanguageModel(nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(self.embedding(tokens))
        return self.head(states)


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--sequence_length", type=int, default=128)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--save_every_steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--train_dir", default=os.environ.get("SM_CHANNEL_TRAIN"))
    parser.add_argument("--model_dir", default=os.environ.get("SM_MODEL_DIR", "/opt/ml/model"))
    parser.add_argument("--checkpoint_dir", default="/opt/ml/checkpoints")
    args = parser.parse_args(argv)
    if not args.train_dir:
        parser.error("no training data: set SM_CHANNEL_TRAIN (the train channel) or pass --train_dir")
    return args


def read_corpus(folder: str, sequence_length: int) -> torch.Tensor:
    data = b"".join(path.read_bytes() for path in sorted(Path(folder).rglob("*.txt")))
    if len(data) <= sequence_length:
        raise SystemExit(f"{folder} holds {len(data)} bytes of *.txt; need more than --sequence_length "
                         f"({sequence_length})")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt"), key=lambda path: int(path.stem.removeprefix("step-")))
    return found[-1] if found else None


def save_checkpoint(folder: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".step-{step}.pt.partial"
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, partial)
    partial.rename(folder / f"step-{step}.pt")  # a half-written file never looks like a checkpoint
    for old in sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.removeprefix("step-")))[:-2]:
        old.unlink()


def resume(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The step of the newest checkpoint, loaded into the model and optimizer (0 when there is none)."""
    checkpoint = latest_checkpoint(folder)
    if checkpoint is None:
        return 0
    state = torch.load(checkpoint, map_location=device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed from {checkpoint.name} (step {state['step']})", flush=True)
    return state["step"]


def random_windows(corpus: torch.Tensor, args: argparse.Namespace, generator: torch.Generator):
    """A batch of `sequence_length + 1` consecutive bytes from random places of the corpus."""
    last_start = len(corpus) - args.sequence_length - 1
    starts = torch.randint(0, last_start, (args.batch_size,), generator=generator).tolist()
    return torch.stack([corpus[start : start + args.sequence_length + 1] for start in starts])


def main(argv: list[str]) -> None:
    args = arguments(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    on_gpu = torch.cuda.is_available()
    if distributed:
        torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
    rank = torch.distributed.get_rank() if distributed else 0
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if on_gpu else "cpu")
    torch.manual_seed(args.seed)
    corpus = read_corpus(args.train_dir, args.sequence_length)
    model = ByteLanguageModel(args.hidden_size, args.num_layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    checkpoints = Path(args.checkpoint_dir)
    step = resume(checkpoints, model, optimizer, device)
    trained = model
    if distributed:
        trained = DistributedDataParallel(model, device_ids=[device] if on_gpu else None)
    generator = torch.Generator().manual_seed(args.seed + rank + step)
    while step < args.max_steps:
        window = random_windows(corpus, args, generator).to(device)
        logits = trained(window[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            print(f"[metrics] step={step} loss={loss.item():.6f}", flush=True)
            if step % args.save_every_steps == 0 or step == args.max_steps:
                save_checkpoint(checkpoints, step, model, optimizer)
    if rank == 0:
        Path(args.model_dir).mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), Path(args.model_dir) / "model.pt")
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
