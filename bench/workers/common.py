"""What the peer workers share: their spec, the model, the per-step line and the result file."""

from __future__ import annotations

import argparse
import json
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class WorkerSpec:
    """One peer run, passed from bench.run to the worker process as JSON."""

    model_preset: str
    seq_len: int
    batch_size: int
    steps: int
    precision: str  # "fp32" or "bf16"
    device: str  # "cpu" or "cuda"
    compile: bool
    tokens_path: str
    result_path: str
    work_dir: str
    seed: int = 0
    lr: float = 3e-4
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    warmup_lr_steps: int = 2
    max_grad_norm: float = 1.0
    model_overrides: dict = field(default_factory=dict)  # HF config fields on top of the preset

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WorkerSpec:
        parser = argparse.ArgumentParser(description="bench peer worker")
        parser.add_argument("--spec", required=True, help="WorkerSpec as JSON")
        values = json.loads(parser.parse_args(argv).spec)
        values["adam_betas"] = tuple(values["adam_betas"])
        return cls(**values)


def step_done(step: int, device: str) -> None:
    """Prints the per-step line bench.run times (bench.timing); on CUDA only once the step ran."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    print(f"[bench] step={step}", flush=True)


def build_model(spec: WorkerSpec):
    """The benchmark model, built exactly as our program builds it from the same preset."""
    import torch

    from bench.model import build_causal_lm

    torch.manual_seed(spec.seed)
    return build_causal_lm(spec.model_preset, spec.seq_len, spec.model_overrides)


def write_result(spec: WorkerSpec, final_loss: float, extra: dict | None = None) -> None:
    result = {
        "final_loss": final_loss,
        "worker_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **(extra or {}),
    }
    if spec.device == "cuda":
        import torch

        result["cuda_peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    Path(spec.result_path).write_text(json.dumps(result))
