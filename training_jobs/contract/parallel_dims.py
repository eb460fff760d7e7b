"""The degrees of the device mesh, resolved against the world size, and every check on them.

One object owns them (as torchtitan's ParallelDims does): pipeline x replicate x shard x context x
tensor = world size, in that order from the outermost dimension to the innermost (torchtitan's
order). Consecutive ranks share a host, so tensor parallel (the chattiest: four all-gathers or
reduce-scatters of the activations per layer) stays inside an instance on NVLink, context parallel
(an all-gather of keys and values per layer) next to it, the data-parallel dimensions come next, and
pipeline stages (one activation per micro-batch crossing a stage boundary) span instances over EFA.
Context-parallel ranks train the same samples (each a part of every sequence), so the data-parallel
size, which global_batch_size divides, counts neither them nor the tensor-parallel ranks; FSDP
shards the parameters over shard x context.

Only the standard library is imported here: a degree that does not fit the world size fails before
the model is built, with a message naming the hyperparameter, and the platform (llmtrain) checks a
run's degrees against its cluster with the same code before it creates a job (`resolve_cluster`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .hyperparameters import ParallelConfig, TrainConfig
from .moe import check_shard_dimension

MESH_DIMS = ("pp", "replicate", "shard", "cp", "tp")
# Parallelisms that wrap each pipeline stage for data parallelism (DeepSpeed and SMP v2 own the
# whole model; `single` is one process).
PIPELINE_DATA_PARALLELISMS = ("ddp", "fsdp")
# Parallelisms whose checkpoints load on another number of data-parallel ranks (DCP reshards model
# and optimizer state; DeepSpeed saves its ZeRO partitions per rank, SMP's FSDP1 state on another
# rank count is untested).
RESHARDING_PARALLELISMS = ("single", "ddp", "fsdp")


def reshards_checkpoints(parallelism: str) -> bool:
    return parallelism in RESHARDING_PARALLELISMS


def _invalid(name: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"invalid hyperparameter {name!r}: got {value!r}, expected {expected}")


@dataclass(frozen=True)
class ParallelDims:
    """pipeline x replicate x shard x context x tensor ranks; replicate x shard is the data-parallel
    size."""

    pipeline: int
    replicate: int
    shard: int
    tensor: int
    context: int = 1
    # Ranks each MoE layer's experts are split over: borrowed from `shard` (a divisor of it), so no
    # dimension of the mesh; the ranks of one shard group with the same expert slice shard it.
    expert: int = 1

    @property
    def data_parallel(self) -> int:
        return self.replicate * self.shard

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same expert slice, which FSDP2 shards between them."""
        return self.data_parallel // self.expert

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data_parallel * self.context * self.tensor

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        return self.pipeline, self.replicate, self.shard, self.context, self.tensor

    @classmethod
    def resolve(cls, par: ParallelConfig, world_size: int, num_hosts: int) -> ParallelDims:
        """Turn the degree hyperparameters (0 = derive) into dims whose product is the world size."""
        pp = max(par.pipeline_parallel_degree, 1)
        tp = max(par.tensor_parallel_degree, 1)
        cp = max(par.context_parallel_degree, 1)
        if par.parallelism == "single" and world_size != 1:
            raise _invalid("parallelism", "single", f"ddp, fsdp or deepspeed: {world_size} processes "
                                                    "were launched")
        if world_size % (pp * cp * tp):
            name, value = next((n, v) for n, v in (("pipeline_parallel_degree", pp),
                                                   ("context_parallel_degree", cp),
                                                   ("tensor_parallel_degree", tp)) if v > 1)
            raise _invalid(name, value,
                           f"pipeline_parallel_degree x context_parallel_degree x tensor_parallel_degree "
                           f"({pp} x {cp} x {tp}) dividing the world size {world_size}")
        data_parallel = world_size // (pp * cp * tp)
        if par.parallelism == "smp":
            return cls._smp(par, data_parallel, tp)
        if par.parallelism in ("single", "ddp", "deepspeed"):
            _expect_degree("shard_degree", par.shard_degree, (0, 1, data_parallel))
            return cls(pipeline=pp, replicate=data_parallel, shard=1, tensor=tp, context=cp)
        replicate, shard = _data_parallel_split(par, data_parallel, num_hosts)
        if replicate * shard != data_parallel:
            raise ConfigError(f"invalid hyperparameter 'shard_degree': pipeline_parallel_degree ({pp}) x "
                              f"replicate_degree ({replicate}) x shard_degree ({shard}) x "
                              f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) must equal "
                              f"the world size {world_size}")
        expert = max(par.expert_parallel_degree, 1)
        check_shard_dimension(expert, shard, world_size)
        return cls(pipeline=pp, replicate=replicate, shard=shard, tensor=tp, context=cp, expert=expert)

    @classmethod
    def _smp(cls, par: ParallelConfig, data_parallel: int, tp: int) -> ParallelDims:
        """SMP v2 shards over groups of shard_degree ranks (its hybrid_shard_degree) and replicates
        across the groups inside its own FSDP; every rank but the tensor-parallel ones sees its own
        data (strategies/smp.py)."""
        if par.shard_degree and data_parallel % par.shard_degree:
            raise _invalid("shard_degree", par.shard_degree,
                           f"a divisor of world size / tensor_parallel_degree = {data_parallel} (SMP's "
                           "hybrid_shard_degree)")
        return cls(pipeline=1, replicate=1, shard=data_parallel, tensor=tp)

    def check_resume(self, saved: dict, *, reshards: bool) -> None:
        """A checkpoint may be resumed on another data-parallel or context-parallel size where the
        strategy's checkpoints reshard (DCP: context parallel shards no parameter differently from
        FSDP), never with another pipeline or tensor-parallel degree (its stages and shards would
        not line up)."""
        for name, key, now in (("pipeline_parallel_degree", "pipeline", self.pipeline),
                               ("tensor_parallel_degree", "tensor", self.tensor)):
            before = saved.get(key, now)
            if before != now:
                raise ConfigError(f"invalid hyperparameter {name!r}: the checkpoint in the checkpoint "
                                  f"folder was written with {name}={before} and this job has {now}; "
                                  f"keep {name} between attempts of a run (only the number of "
                                  "data-parallel ranks may change) or use a new checkpoint location")
        before = saved.get("data_parallel", self.data_parallel)
        if not reshards and before != self.data_parallel:
            raise ConfigError(f"the checkpoint in the checkpoint folder was written by {before} "
                              f"data-parallel ranks and this job has {self.data_parallel}: this "
                              "parallelism's checkpoints do not reshard (ddp, fsdp and pipeline "
                              "stages do); run on the same number of GPUs or use a new checkpoint "
                              "location")

    def state(self) -> dict:
        return {"pipeline": self.pipeline, "data_parallel": self.data_parallel, "tensor": self.tensor,
                "context": self.context, "expert": self.expert}


def _data_parallel_split(par: ParallelConfig, data_parallel: int, num_hosts: int) -> tuple[int, int]:
    """(replicate, shard) of FSDP: hybrid replicates across hosts and shards inside one."""
    if par.fsdp_sharding == "hybrid":
        replicate = par.replicate_degree or max(1, min(num_hosts, data_parallel))
        if data_parallel % replicate:
            raise _invalid("replicate_degree", replicate, f"a divisor of the data-parallel size "
                                                          f"{data_parallel}")
        return replicate, par.shard_degree or data_parallel // replicate
    return 1, par.shard_degree or data_parallel


def _expect_degree(name: str, value: int, allowed: tuple[int, ...]) -> None:
    if value not in allowed:
        raise _invalid(name, value, "one of " + ", ".join(str(v) for v in sorted(set(allowed))))


def accumulation_steps(global_batch_size: int, micro_batch_size: int, dims: ParallelDims) -> int:
    """The micro steps per optimizer step that make `global_batch_size` samples on these dims."""
    per_micro_step = dims.data_parallel * micro_batch_size
    if global_batch_size % per_micro_step:
        raise _invalid("global_batch_size", global_batch_size,
                       f"a multiple of data-parallel size x micro_batch_size ({dims.data_parallel} x "
                       f"{micro_batch_size} = {per_micro_step}) on this cluster")
    steps = global_batch_size // per_micro_step
    if steps < dims.pipeline:
        raise _invalid("global_batch_size", global_batch_size,
                       f"at least {dims.pipeline * per_micro_step}: it gives {steps} micro-batches "
                       f"per step, fewer than the {dims.pipeline} pipeline stages")
    return steps


def with_global_batch(config: TrainConfig, dims: ParallelDims) -> TrainConfig:
    """The configuration with grad_accum_steps derived from global_batch_size for this data-parallel
    size (unchanged when global_batch_size is 0)."""
    data = config.data
    if not data.global_batch_size:
        return config
    steps = accumulation_steps(data.global_batch_size, data.micro_batch_size, dims)
    return dataclasses.replace(config, data=dataclasses.replace(data, grad_accum_steps=steps))


def check_pipeline_dims(par: ParallelConfig, dims: ParallelDims) -> None:
    """Pipeline rules that need the mesh: GPipe cannot run stages that DDP replicates (DDP's bucket
    rebuild fails in the second step when every forward precedes any backward)."""
    if dims.pipeline > 1 and par.pipeline_schedule == "gpipe" and par.parallelism == "ddp" \
            and dims.data_parallel > 1:
        raise _invalid("pipeline_schedule", "gpipe", "another schedule: gpipe cannot run stages "
                                                     "replicated by DDP over data-parallel ranks; use "
                                                     "1f1b (the same bubble, fewer micro-batches held) "
                                                     "or parallelism=fsdp")


def resolve_cluster(config: TrainConfig, world_size: int, num_hosts: int) -> tuple[TrainConfig, ParallelDims]:
    """The mesh of `world_size` processes on `num_hosts` hosts and the configuration on it (the
    accumulation derived from global_batch_size), with every rule that needs the cluster's shape."""
    dims = ParallelDims.resolve(config.parallel, world_size, num_hosts)
    check_pipeline_dims(config.parallel, dims)
    return with_global_batch(config, dims), dims
