"""The training objectives, registered by the `objective` hyperparameter's names
(contract/objectives.py): next_token (pretraining and supervised fine-tuning), dpo and grpo."""

from __future__ import annotations

from collections.abc import Callable

from .protocol import Objective, ObjectiveContext


def _next_token(ctx: ObjectiveContext) -> Objective:
    from .next_token import NextTokenObjective

    return NextTokenObjective(ctx)


def _dpo(ctx: ObjectiveContext) -> Objective:
    from .dpo import DpoObjective

    return DpoObjective(ctx)


def _grpo(ctx: ObjectiveContext) -> Objective:
    from .grpo import GrpoObjective

    return GrpoObjective(ctx)


OBJECTIVES: dict[str, Callable[[ObjectiveContext], Objective]] = {"next_token": _next_token, "dpo": _dpo,
                                                                  "grpo": _grpo}

__all__ = ["OBJECTIVES", "Objective", "ObjectiveContext", "build_objective"]


def build_objective(ctx: ObjectiveContext) -> Objective:
    return OBJECTIVES[ctx.config.objective.objective](ctx)
