"""Pipeline stages: which decoder layers each stage holds, and which stages each pipeline rank runs.

The program (training_jobs/trainer/strategies/pipeline.py) splits the decoder layers into
`pipeline_parallel_degree x stages per rank` contiguous stages, balanced by compute (`balanced_split`:
the output head counts as the layers' worth of matmul work it does) unless `pipeline_split` says
otherwise; the first stage also holds the embedding, the last the final norm, the head and the loss.
Pipeline rank r holds stages r, r + degree, r + 2 x degree, ... The run planner
(llmtrain/planner/pipeline.py) places the same stages on the same ranks.
"""

from __future__ import annotations

import functools

from .errors import ConfigError


@functools.lru_cache(maxsize=256)
def balanced_split(num_layers: int, num_stages: int, head_cost: float) -> tuple[int, ...]:
    """Decoder layers per stage (contiguous, at least one each) so that the most expensive stage is
    as cheap as possible, and among such splits the most even; a stage costs its layers, the last
    one also `head_cost` layers' worth."""
    if num_layers < num_stages:
        raise ConfigError(f"invalid hyperparameter 'pipeline_parallel_degree': {num_stages} pipeline "
                          f"stages need at least as many decoder layers, and the model has {num_layers}; "
                          "lower pipeline_parallel_degree or pipeline_stages_per_rank")
    worst = (float("inf"), float("inf"))
    # best[s][k]: (most expensive stage, sum of squared stage costs) of the first s stages holding
    # the first k layers, and the layers of stage s in that split.
    best = [[worst] * (num_layers + 1) for _ in range(num_stages + 1)]
    taken = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for stage in range(1, num_stages + 1):
        extra = head_cost if stage == num_stages else 0.0
        for held in range(stage, num_layers - (num_stages - stage) + 1):
            for count in range(1, held - stage + 2):
                most, squares = best[stage - 1][held - count]
                cost = (max(most, count + extra), squares + (count + extra) ** 2)
                if cost < best[stage][held]:
                    best[stage][held], taken[stage][held] = cost, count
    counts, held = [], num_layers
    for stage in range(num_stages, 0, -1):
        counts.append(taken[stage][held])
        held -= taken[stage][held]
    return tuple(reversed(counts))


def stage_indices(pipeline_rank: int, degree: int, per_rank: int) -> list[int]:
    """The stages of one pipeline rank, looping over the ranks: r, r + degree, r + 2 x degree, ..."""
    return [pipeline_rank + round_ * degree for round_ in range(per_rank)]
