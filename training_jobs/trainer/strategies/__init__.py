"""The training strategies, one module each: torch_native (single, ddp, fsdp with tensor parallel),
pipeline (pipeline stages x ddp/fsdp x tensor parallel), deepspeed_zero and smp. They implement
protocol.Strategy; build_strategy picks one. Siblings never import each other: what they share is
in setup.py, optimization.py and whole_model.py.
"""

from __future__ import annotations

from ..lora import check_quantization
from .protocol import Strategy
from .setup import SetupContext

__all__ = ["SetupContext", "Strategy", "build_strategy"]


def build_strategy(ctx: SetupContext) -> Strategy:
    kind = ctx.config.parallel.parallelism
    check_quantization(ctx.config.lora, kind, has_checkpoint=ctx.source.pretrained_dir is not None)
    if ctx.dims.pipeline > 1:
        from .pipeline import PipelineStrategy

        return PipelineStrategy(ctx)
    if kind == "deepspeed":
        from .deepspeed_zero import DeepSpeedStrategy

        return DeepSpeedStrategy(ctx)
    if kind == "smp":
        from .smp import SmpStrategy

        return SmpStrategy(ctx)
    from .torch_native import TorchStrategy

    return TorchStrategy(ctx)
