"""Metrics: the contract's `[metrics]`/`[eval]` lines, JSON lines, TensorBoard, and MFU.

Rank 0 prints one line per logging step (one line in the output, wrapped here), e.g.

    [metrics] step=10 loss=4.123456 lr=3.000e-04 grad_norm=1.2345 tokens_per_sec=12345.6 mfu=0.4123
        step_time=0.532 memory_gb=1.23
    [eval] step=100 eval_loss=3.987654
    [moe] step=10 moe_aux_loss=2.012345 moe_load_balance=1.4210 moe_max_expert_share=0.3550
        moe_dropped_tokens=0 moe_load_balance_layer0=1.3120 moe_aux_loss_layer0=2.010001 ...

(the `[moe]` line only for mixture-of-experts models, with one load_balance and aux_loss per MoE
layer, named by its decoder layer's index) which the template's MetricDefinitions (and `llmtrain run
--local`) parse; the same values go to
SM_OUTPUT_DATA_DIR/metrics.jsonl. Keys are stable: new ones are appended, never renamed.

MFU = achieved model FLOPs / peak FLOPs. Model FLOPs per token are 6 x non-embedding parameters
(forward and backward of every weight a token meets: of a mixture of experts' routed experts, the
top-k's share) plus 12 x layers x hidden size x sequence length for
attention scores (PaLM, appendix B), counted without activation recomputation. The peak is the
accelerator's dense bf16 number by instance type (or by the GPU's name outside SageMaker), or a
measured matmul peak where neither is in the tables (CPUs, unknown GPUs).
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from pathlib import Path

import torch

from ..contract.hardware import device_peak_tflops, instance_peak_tflops


def table_peak_flops(instance_type: str) -> float | None:
    """The dense peak of one accelerator of this SageMaker instance type (contract/hardware.py)."""
    tflops = instance_peak_tflops(instance_type)
    return tflops * 1e12 if tflops else None


def device_name_peak_flops(device_name: str) -> float | None:
    """The dense peak of the GPU CUDA names so (a workstation, a lent machine)."""
    tflops = device_peak_tflops(device_name)
    return tflops * 1e12 if tflops else None


def measured_peak(device: torch.device, dtypes: set[torch.dtype], size: int) -> float:
    """The fastest of `dtypes`' observed matmul FLOP/s here, leaving out on a CPU the dtypes oneDNN
    has no kernels for: torch runs those as a scalar loop (bf16 ~50x slower than fp32 on a CPU
    without AVX-512 or AMX), so measuring them took seconds per rank for a figure the maximum
    discards."""
    if device.type == "cpu":
        dtypes = {dtype for dtype in dtypes if cpu_has_matmul_kernels(dtype)} or {torch.float32}
    return max(measured_peak_flops(device, dtype, size) for dtype in dtypes)


def cpu_has_matmul_kernels(dtype: torch.dtype) -> bool:
    """Whether torch multiplies `dtype` matrices with oneDNN's vectorised kernels on this CPU."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


@functools.cache  # once per process: a process that runs several jobs (tests) measures once
def measured_peak_flops(device: torch.device, dtype: torch.dtype, size: int,
                        repeats: int = 5) -> float:
    """Observed FLOP/s of a square matmul on this device, in the training's compute dtype.

    The products run back to back between two synchronisations: timing each one alone measures
    the launch and the synchronisation as much as the GPU (a 1024 product takes microseconds there).
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.mm(a, b)  # warms up (kernel selection, handles)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b, out=out)
    _synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(non_embedding_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12 L H T (PaLM's formula)."""
    return 6.0 * non_embedding_params + 12.0 * num_layers * hidden_size * seq_len


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


class MetricsLogger:
    """Writes metrics on rank 0: stdout lines, metrics.jsonl and (optionally) TensorBoard and MLflow
    (a `tracking.MlflowTracker`)."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, tracker=None) -> None:
        self.enabled = enabled
        self.jsonl = None
        self.writer = None
        self.tracker = tracker
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (output_dir / "metrics.jsonl").open("a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Flushed every 30 s (not 120): SageMaker uploads the folder live (TensorBoardOutputConfig).
            self.writer = SummaryWriter(str(output_dir / "tensorboard"), flush_secs=30)

    def train(self, values: dict[str, float]) -> None:
        self._emit("metrics", values, {"loss": "{:.6f}", "lr": "{:.3e}", "grad_norm": "{:.4f}",
                                       "tokens_per_sec": "{:.1f}", "mfu": "{:.4f}",
                                       "step_time": "{:.3f}", "memory_gb": "{:.2f}"})

    def eval(self, values: dict[str, float]) -> None:
        self._emit("eval", values, {"eval_loss": "{:.6f}"})

    def moe(self, values: dict[str, float]) -> None:
        """A mixture of experts' routing over the logging window (trainer/moe/signals.py)."""
        self._emit("moe", values, {key: "{:.6f}" if key.startswith("moe_aux_loss") else "{:.4f}"
                                   for key in values if key not in ("step", "moe_dropped_tokens")})

    def rule(self, values: dict) -> None:
        """What a rule saw or did (trainer/rules.py): a `[rule]` line and a JSON line of kind "rule";
        not a metric (no template regex matches it)."""
        if not self.enabled:
            return
        fields = " ".join(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}"
                          for key, value in values.items())
        print(f"[rule] {fields}", flush=True)
        self.jsonl.write(json.dumps({"kind": "rule", **values}) + "\n")

    def _emit(self, tag: str, values: dict[str, float], formats: dict[str, str]) -> None:
        if not self.enabled:
            return
        fields = " ".join(f"{key}={formats.get(key, _default_format(value)).format(value)}"
                          for key, value in values.items())
        print(f"[{tag}] {fields}", flush=True)
        kind = {"metrics": "train"}.get(tag, tag)
        self.jsonl.write(json.dumps({"kind": kind, **values}) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if key != "step":
                    self.writer.add_scalar(f"{tag}/{key}", value, int(values["step"]))
        if self.tracker is not None:
            self.tracker.log_metrics(values)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def _default_format(value) -> str:
    """An objective's metrics (e.g. DPO's rewards/margins) to 6 significant digits; counts as is."""
    return "{:.6g}" if isinstance(value, float) else "{}"


def log(message: str) -> None:
    """Human-readable progress (not parsed by anyone), flushed so CloudWatch shows it at once."""
    print(f"[train] {message}", file=sys.stdout, flush=True)
