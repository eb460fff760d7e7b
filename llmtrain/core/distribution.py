"""A template's `distribution:`: the strategy and the degrees of the device mesh, typed once.

Every parallel degree a run can have is declared here and only here (`DEGREE_NAMES`): data sharding
and replication, tensor, pipeline, context and expert parallelism. Render sends them to the platform's
program as hyperparameters (the program's `ParallelDims` checks them against the world size), a run
overrides them by the same names, and the planner reads them from the same record. Versions
published before a degree had its place here set it under `hyperparameters` (`context_parallel_degree`
of llama3-8b-long-context@1.0.0): the spec moves it here when it loads them, so their YAML stays as
written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llmtrain.core.spec_fields import Fields, check_positive, fail
from training_jobs.contract.hyperparameters import PARALLELISMS
from training_jobs.contract.parallel_dims import PIPELINE_DATA_PARALLELISMS

DEGREE_NAMES = (
    "shard_degree",
    "replicate_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
)
# Degrees that 0 derives from the world size; the others are at least 1.
DERIVABLE_DEGREES = ("shard_degree", "replicate_degree")
# Degrees the program learnt after its first release: render sends them only when they are used, as
# code frozen before them refuses the name.
LATER_DEGREES = ("pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree")
# Degrees that published versions set as hyperparameters.
LEGACY_DEGREE_HYPERPARAMETERS = ("context_parallel_degree",)
# Strategies whose pipeline stages the training program builds (trainer/strategies/pipeline.py).
PIPELINE_STRATEGIES = PIPELINE_DATA_PARALLELISMS


@dataclass(frozen=True)
class DistributionSpec:
    """How the job is parallelised: the strategy and every degree of the device mesh (`DEGREE_NAMES`).
    Shard and replicate degrees of 0 are derived so the product is the world size."""

    strategy: str
    shard_degree: int = 0
    replicate_degree: int = 1
    tensor_parallel_degree: int = 1
    pipeline_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    smddp: bool = False  # SageMaker's distributed data parallel library as the collective backend
    smp_parameters: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, f: Fields) -> DistributionSpec:
        strategy = f.get("strategy", str)
        if strategy not in PARALLELISMS:
            raise fail(f.source, f"'distribution.strategy' must be one of {', '.join(PARALLELISMS)}, "
                                 f"got {strategy!r}")
        degrees = {}
        for name in DEGREE_NAMES:
            degrees[name] = f.get(name, int, getattr(cls, name))
            check_positive(f, name, degrees[name], allow_zero=name in DERIVABLE_DEGREES)
        smp_parameters = dict(f.get("smp_parameters", Mapping, {}))
        smddp = f.get("smddp", bool, False)
        f.done()
        if degrees["pipeline_parallel_degree"] > 1 and strategy not in PIPELINE_STRATEGIES:
            why = " (SMP v2 has no pipeline parallelism)" if strategy == "smp" else ""
            raise fail(f.source, f"'distribution.pipeline_parallel_degree' needs strategy "
                                  f"{' or '.join(PIPELINE_STRATEGIES)}, not {strategy}{why}")
        if smddp and (strategy != "fsdp" or degrees["pipeline_parallel_degree"] > 1):
            raise fail(f.source, "'distribution.smddp' needs strategy fsdp without pipeline stages: "
                                  "launched by torchrun, SMDDP replaces FSDP's all-gather")
        if smp_parameters and strategy != "smp":
            raise fail(f.source, "'distribution.smp_parameters' is only valid with strategy 'smp'")
        reserved = {"hybrid_shard_degree", "tensor_parallel_degree", "sm_activation_offloading"} & set(
            smp_parameters
        )
        if reserved:
            raise fail(
                f.source,
                f"'distribution.smp_parameters' must not set {', '.join(sorted(reserved))}: they come from "
                "shard_degree, tensor_parallel_degree and the activation_offloading hyperparameter",
            )
        return cls(strategy=strategy, smp_parameters=smp_parameters, smddp=smddp, **degrees)



    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREE_NAMES}

    def with_legacy_degrees(
        self, hyperparameters: Mapping[str, Any], source: str
    ) -> tuple[DistributionSpec, dict[str, Any]]:
        """The distribution and hyperparameters of a version that set a degree under
        `hyperparameters` (versions published before the degree had a place here): the degree moves
        to the distribution, where every later step reads it. Setting it in both places is refused."""
        remaining = dict(hyperparameters)
        moved = {name: remaining.pop(name) for name in LEGACY_DEGREE_HYPERPARAMETERS if name in remaining}
        if not moved:
            return self, remaining
        for name, value in moved.items():
            if getattr(self, name) != getattr(DistributionSpec, name):
                raise fail(source, f"'{name}' is set under both 'distribution' and 'hyperparameters'; "
                                   "keep it under 'distribution' only")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise fail(source, f"'hyperparameters.{name}' must be an integer >= 1, got {value!r}")
        return dataclasses.replace(self, **moved), remaining
