"""A tiny training program for the local runner's tests: only the SageMaker container contract.

It reads SM_HPS and the job root (SAGEMAKER_BASE_DIR), joins torchrun's gloo process group, prints
metric lines like the platform's training program, checkpoints its step to the checkpoint folder on
SIGTERM and at the end, resumes from it, and writes a model file. Hyperparameters:
max_steps, step_seconds (sleep per step), fail (raise a ValueError naming the hyperparameter),
gloo_quirk (exit the way the toolkit's swallowed gloo error looks).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    hps = json.loads(os.environ["SM_HPS"])
    if hps.get("fail"):
        raise ValueError("hyperparameter 'fail' is true: set it to false to train")
    if hps.get("gloo_quirk"):
        print("RuntimeError: a peer closed the connection", file=sys.stderr, flush=True)
        print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", file=sys.stderr,
              flush=True)
        return 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stop = torch.zeros(1)
    signal.signal(signal.SIGTERM, lambda *_: stop.fill_(1.0))
    checkpoint = Path(os.environ["SAGEMAKER_BASE_DIR"]) / "checkpoints" / "step.json"
    start = json.loads(checkpoint.read_text())["step"] if checkpoint.exists() else 0
    print(f"[toy] rank={rank} world={world} host={os.environ['SM_CURRENT_HOST']} "
          f"master={os.environ['MASTER_ADDR']} start={start}", flush=True)
    step = start
    while step < hps["max_steps"]:
        step += 1
        time.sleep(hps.get("step_seconds", 0))
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        if rank == 0:
            print(f"[metrics] step={step} loss={value.item() / step:.6f} tokens_per_sec={100.0 * world:.1f}",
                  flush=True)
        stopping = stop.clone()
        dist.all_reduce(stopping, op=dist.ReduceOp.MAX)
        if stopping.item():
            break
    if rank == 0:
        checkpoint.write_text(json.dumps({"step": step}))
        (Path(os.environ["SM_MODEL_DIR"]) / "model.json").write_text(json.dumps({"steps": step}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
