"""The steps of a training job, in the order train.py calls them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..contract import moe as moe_contract
from ..contract.hyperparameters import RulesConfig, TrainConfig
from ..contract.objectives import JUDGES_LOSS_SPIKES, data_kind_problem
from ..contract.parallel_dims import reshards_checkpoints, resolve_cluster
from . import checkpoint, health, tracking
from .checkpoint import CheckpointStore, StopSignal, Triggers
from .data import BatchLayout, EvalBatches, Samples, TokenSamples, TrainBatches
from .environment import JobEnvironment
from .errors import DataError
from .faults import Faults
from .loop import LoopContext, Throughput
from .metrics import (
    MetricsLogger,
    device_name_peak_flops,
    flops_per_token,
    log,
    measured_peak,
    table_peak_flops,
)
from .model_channel import model_folder
from .models import attention_implementation, load_tokenizer, model_source
from .moe.signals import router_signals
from .objectives import ObjectiveContext, build_objective
from .parallel import COMPUTE_DTYPES
from .preference_data import PreferencePairs
from .prompt_data import PromptSet
from .rules import Rules
from .shards import read_manifest
from .strategies import SetupContext, Strategy, build_strategy
from .strategies.protocol import ModelSummary
from .watchdog import HangWatchdog


@dataclass
class Job:
    loop: LoopContext
    tokenizer: object
    resumed_from: Path | None = None

    def close(self) -> None:
        self.loop.store.abandon_pending()  # only an error leaves one (the last save waits)
        self.loop.metrics.close()
        self.loop.strategy.close()


# The reader of each kind of token data (contract/token_data.DATA_KINDS).
SAMPLE_READERS: dict[str, type[Samples]] = {"text": TokenSamples, "loss_masked": TokenSamples,
                                            "preference": PreferencePairs, "prompts": PromptSet}


def _channel_samples(env: JobEnvironment, name: str, config: TrainConfig, vocab: int) -> Samples | None:
    """The channel's samples, read as its manifest's kind of data, which must be what the objective
    trains on."""
    path = env.channel(name)
    if path is None:
        if name == "train":
            raise DataError("no `train` channel: the job needs pre-tokenized shards in "
                            "SM_CHANNEL_TRAIN (see `python -m training_jobs.prepare_data`)")
        return None
    manifest = read_manifest(path)
    problem = data_kind_problem(config.objective.objective, manifest.version, name)
    if problem:
        raise DataError(problem)
    return SAMPLE_READERS[manifest.kind](path, config.data.seq_len, name, vocab)


def check_tokenizer(samples: tuple[Samples, Samples | None], tokenizer, where: Path) -> None:
    """The data must have been made with the tokenizer the job reads it with: a vocabulary larger
    than the model's is refused by TokenSamples; another end-of-sequence id means another tokenizer."""
    for channel in filter(None, samples):
        if channel.manifest.eos_token_id != tokenizer.eos_token_id:
            raise DataError(f"the {channel.channel} channel was made with a tokenizer whose "
                            f"end-of-sequence id is {channel.manifest.eos_token_id}, and the job's "
                            f"tokenizer ({where}) has {tokenizer.eos_token_id}: give the run the "
                            "tokenizer the data was made with as its tokenizer channel (prepare_data "
                            "writes it as tokenizer/ beside the splits)")


def _check_same_loss(train: Samples, validation: Samples | None) -> None:
    """Evaluation must measure what training optimizes: both loss-masked, or neither."""
    if validation is not None and validation.manifest.loss_mask != train.manifest.loss_mask:
        masked = "train" if train.manifest.loss_mask else "validation"
        raise DataError(f"only the {masked} channel has a loss mask (prompt/completion or chat "
                        "examples): prepare both splits the same way, e.g. with one prepare_data "
                        "run and --validation-fraction")


def _table_peak(env: JobEnvironment, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return table_peak_flops(env.instance_type) or device_name_peak_flops(torch.cuda.get_device_name(device))


def _throughput(config: TrainConfig, strategy: Strategy, summary: ModelSummary, env: JobEnvironment,
                device: torch.device) -> Throughput:
    model_config = summary.config
    layers, hidden = model_config.num_hidden_layers, model_config.hidden_size  # GPT-2's map to n_*
    tokens = config.data.seq_len * config.data.micro_batch_size * config.data.grad_accum_steps \
        * strategy.topology.data_parallel_size
    per_token = flops_per_token(summary.non_embedding_parameters, layers, hidden, config.data.seq_len)
    peak = _table_peak(env, device)
    if peak is None:  # the faster of fp32 and the compute dtype (CPUs have no fast fp16 matmul)
        dtype, size = COMPUTE_DTYPES[config.parallel.mixed_precision], 4096 if device.type == "cuda" else 1024
        peak = measured_peak(device, {torch.float32, dtype}, size)
    return Throughput(tokens, per_token, peak * dist.get_world_size())


def _preflight(device: torch.device, env: JobEnvironment) -> None:
    checked = health.preflight(device, env.current_host)
    if env.is_main:
        slowest = max(checked.ranks, key=lambda r: r.allreduce_seconds)
        log(f"preflight ok: {len(checked.ranks)} ranks, slowest all-reduce {slowest.bus_gbps:.2f} GB/s "
            f"(rank {slowest.rank} on {slowest.host})")
        if checked.slow:
            log(f"preflight: {', '.join(r.describe() for r in checked.slow)} slower than "
                f"{checked.factor:g}x the median; on CPU cores shared with other processes that is "
                "timing noise: reported, not a fault")


def _loop_context(config: TrainConfig, env: JobEnvironment, device: torch.device, strategy: Strategy,
                  samples: tuple[Samples, Samples | None], stop: StopSignal,
                  summary: ModelSummary, tokenizer) -> LoopContext:
    train_samples, eval_samples = samples
    topo = strategy.topology
    layout = BatchLayout(topo.data_parallel_size, topo.data_parallel_rank,
                         config.data.micro_batch_size, config.data.grad_accum_steps)
    evaluation = EvalBatches(eval_samples, layout, config.logging.eval_steps, device,
                             together=strategy.eval_micro_batches,
                             sequence=topo.sequence_split) if eval_samples else None
    train = TrainBatches(train_samples, layout, config.run.seed, device, topo.sequence_split)
    objective = build_objective(ObjectiveContext(config, strategy, train, evaluation, device, tokenizer))
    return LoopContext(
        config=config, strategy=strategy, train=train, evaluation=evaluation, objective=objective,
        store=CheckpointStore(env.checkpoint_dir, config.checkpoint.keep_checkpoints, env.rank,
                              env.is_local_main, background_writes=config.checkpoint.checkpoint_async
                              and strategy.saves_asynchronously),
        triggers=Triggers(config.checkpoint.checkpoint_every_steps,
                          config.checkpoint.checkpoint_every_minutes, stop),
        metrics=MetricsLogger(env.output_data_dir, env.is_main, config.logging.tensorboard,
                              tracker=tracking.start_tracking(os.environ, enabled=env.is_main,
                                                              job_name=tracking.job_name(),
                                                              params=config.flat())),
        throughput=_throughput(config, strategy, summary, env, device),
        output_dir=env.output_data_dir, device=device, rules=Rules(_rules(config)),
        faults=Faults.from_environment(os.environ), watchdog=_watchdog(config, env),
        router=router_signals(strategy.hf_model, config.moe, topo.batch_group))


def _rules(config: TrainConfig) -> RulesConfig:
    """The rules' settings, without the loss-spike rule for an objective whose loss it cannot judge."""
    if JUDGES_LOSS_SPIKES[config.objective.objective]:
        return config.rules
    return dataclasses.replace(config.rules, rule_loss_spike_action="off")


def _watchdog(config: TrainConfig, env: JobEnvironment) -> HangWatchdog | None:
    minutes = config.rules.rule_hang_minutes
    return HangWatchdog(minutes, env.output_data_dir, env.rank, env.current_host) if minutes else None


def build(config: TrainConfig, env: JobEnvironment, device: torch.device,
          stop: StopSignal | None = None) -> Job:
    """Tokenizer, model, data and strategy; data channels are checked before the model is built."""
    stop = stop or StopSignal()
    config, dims = resolve_cluster(config, env.world_size, env.num_hosts)
    if config.logging.preflight_check:
        _preflight(device, env)
    model_channel = model_folder(env.channel("model"))
    tokenizer, tokenizer_path = load_tokenizer(env.channel("tokenizer"), model_channel)
    attention = attention_implementation(config.model.attention, compiled=config.parallel.compile,
                                         device_type=device.type)
    source = model_source(config.model, model_channel, tokenizer, config.data.seq_len, attention)
    moe_contract.check_model(config, source.config.model_type, source.config.to_dict(), source.description)
    vocab = source.config.vocab_size
    samples = (_channel_samples(env, "train", config, vocab),
               _channel_samples(env, "validation", config, vocab))
    _check_same_loss(*samples)
    check_tokenizer(samples, tokenizer, tokenizer_path)
    strategy = build_strategy(SetupContext(config, source, device, dims))
    summary = strategy.model_summary()
    loop = _loop_context(config, env, device, strategy, samples, stop, summary, tokenizer)
    if env.is_main:
        log(f"model {source.description}: {summary.parameters:,} parameters, {source.attention} "
            f"attention, tokenizer {tokenizer_path}, {dims}, {samples[0].num_samples} training "
            f"samples of {config.data.seq_len} tokens, {config.data.grad_accum_steps} micro-batches "
            "per step")
    return Job(loop, tokenizer)


def resume(job: Job) -> None:
    """Continue from the newest complete checkpoint, if there is one."""
    loop = job.loop
    root = loop.store.root
    found = checkpoint.scan(root)
    if found.incomplete and dist.get_rank() == 0:
        log(f"ignoring incomplete checkpoints: {', '.join(p.name for p in found.incomplete)}")
    if not found.complete:
        return
    folder = found.complete[-1][1]
    state = checkpoint.read_trainer_state(folder)
    checkpoint.check_resumable(state, loop.config.flat())
    saved = state.get("parallel", {})
    reshards = reshards_checkpoints(loop.config.parallel.parallelism)
    loop.strategy.topology.dims.check_resume(saved, reshards=reshards)
    loop.store.load(folder, loop.strategy)
    loop.step = int(state["step"])
    loop.train.load_state_dict(state["data"])
    loop.strategy.load_scheduler(state["scheduler"])
    job.resumed_from = folder
    if dist.get_rank() == 0:
        log(f"resumed from {folder} at step {loop.step}" + _reshaped(saved, loop))


def _reshaped(saved: dict, loop: LoopContext) -> str:
    before, now = saved.get("data_parallel"), loop.strategy.topology.data_parallel_size
    if before is None or before == now:
        return ""
    return (f" (written by {before} data-parallel ranks, resharded for {now}; the data continues at "
            f"sample {loop.train.consumed_samples} of the global order)")


def prepare_folders(env: JobEnvironment) -> None:
    if env.is_local_main:
        for folder in (env.checkpoint_dir, env.model_dir, env.output_data_dir):
            os.makedirs(folder, exist_ok=True)
    dist.barrier()
