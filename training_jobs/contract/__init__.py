"""The training program's torch-free contract: what a run may set and the rules it must follow.

Standard library only, and only relative imports inside this package, so that the training program
(training_jobs/trainer) and the platform (llmtrain: render, validation, the planner, the launcher's
functions) share one copy, and the platform can load the contract of a template version's frozen code
on its own (llmtrain/core/program_contract.py):

- `hyperparameters`: every hyperparameter as a typed field with its default, bounds and help, their
  parsing (`from_hyperparameters`) and the rules between them;
- `parallel_dims`: the mesh (`ParallelDims`: pipeline x replicate x shard x tensor) resolved against
  a cluster, and the rules that need the cluster's shape (`resolve_cluster`: degrees dividing the
  world size, the global batch);
- `presets`: the named model sizes' architectures;
- `stage_split`: the pipeline's balanced stage split and each rank's stages;
- `hardware`: the accelerators' dense peaks (MFU, the planner's speed);
- `torch_versions`: the oldest torch the program runs on;
- `capabilities`: what this version of the program does (sequence, loss and context parallel, its
  selective checkpointing policy, FP8's torchao), which the planner plans a version's runs with;
- `docs`: the hyperparameter tables of docs/ (`python -m training_jobs.contract.docs`).

`check_run` is what the platform calls on a run's hyperparameters: the same checks the program runs
before it builds anything. Its name and signature stay as they are, because the platform also calls
it in the frozen code of published template versions.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, TrainingError
from .hyperparameters import TrainConfig, from_hyperparameters
from .parallel_dims import ParallelDims, resolve_cluster

__all__ = ["ConfigError", "ParallelDims", "TrainConfig", "TrainingError", "check_run",
           "from_hyperparameters", "resolve_cluster"]


def check_run(hyperparameters: dict[str, Any], world_size: int,
              num_hosts: int) -> tuple[TrainConfig, ParallelDims]:
    """The configuration and mesh of a run of `world_size` processes on `num_hosts` hosts, checked
    as the program checks them before it builds anything; ConfigError names what to change."""
    return resolve_cluster(from_hyperparameters(hyperparameters), world_size, num_hosts)
