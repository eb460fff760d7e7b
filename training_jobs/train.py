"""Entry point of the training job (sagemaker_program), launched by torchrun on every host.

    torchrun --nproc_per_node N training_jobs/train.py [--name value ...]

Reads the SageMaker container contract (SM_HPS or --name value flags, SM_CHANNEL_*, SM_MODEL_DIR,
SM_OUTPUT_DATA_DIR, /opt/ml/checkpoints), validates the hyperparameters before anything slow, then:
build the model and data, resume from the newest complete checkpoint, train, export. A bad
hyperparameter, channel or diverged loss exits non-zero with a one-line reason; SIGTERM saves a
checkpoint and exits 0 so the next attempt resumes. See docs/training.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The toolkit runs this file as a script with cwd = the code folder: make `training_jobs` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training_jobs.contract.hyperparameters import from_hyperparameters  # noqa: E402
from training_jobs.trainer.environment import read_environment  # noqa: E402
from training_jobs.trainer.errors import (  # noqa: E402
    ConfigError,
    DataError,
    DivergenceError,
    RuleTriggered,
    TrainingError,
    record_failure,
)

EXIT_FAILED = 1


def run(argv: list[str], *, own_process_group: bool = True) -> int:
    """One training job. `own_process_group=False` keeps an existing process group alive (tests
    run several jobs in one torchrun launch to save its start-up time)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download at run time
    env = read_environment(argv)
    config = from_hyperparameters(env.hyperparameters)  # fails fast: no torch imported yet

    import torch.distributed as dist
    import transformers

    from training_jobs.trainer import export, host, job, loop, metrics, parallel, torch_support, tracking
    from training_jobs.trainer.checkpoint import StopSignal
    from training_jobs.trainer.rules import process_group_timeout_minutes

    transformers.utils.logging.disable_progress_bar()
    torch_support.check_torch(config.parallel.parallelism)

    device = parallel.pick_device(env.local_rank)
    if device.type == "cpu":
        host.keep_freed_memory()  # a CPU step then reuses its activation memory (trainer/host.py)
    parallel.init_distributed(device, env.rank, env.world_size,
                              timeout_minutes=process_group_timeout_minutes(config.rules),
                              collective_backend=config.parallel.collective_backend)
    stop = StopSignal()  # from here on, SIGTERM means "checkpoint and exit 0"
    training = None
    try:
        job.prepare_folders(env)
        training = job.build(config, env, device, stop)
        job.resume(training)
        tracker = training.loop.metrics.tracker
        if loop.run(training.loop) == "finished":
            path = export.export_model(training.loop.strategy, training.loop.config,
                                       training.tokenizer, env.model_dir, env.is_main)
            if env.is_main:
                metrics.log(f"finished at step {training.loop.step}; model written to {path}")
            if tracker is not None:
                tracker.log_model(str(path), os.environ.get(tracking.MODEL_ARTIFACT_ENV))
                tracker.finish("FINISHED")
        elif tracker is not None:
            tracker.finish("KILLED")  # stopped (SIGTERM): the next attempt resumes in a new MLflow run
        dist.barrier()  # leave together: no rank tears down its connections while rank 0 still writes
        return 0
    finally:
        stop.restore()
        if training is not None:
            training.close()
        if own_process_group and dist.is_initialized():
            dist.destroy_process_group()


def _report(error: TrainingError) -> None:
    """One line per host for errors every rank hits alike, one per rank otherwise; and the reason in
    the job's failure file."""
    same_everywhere = isinstance(error, ConfigError | DataError | DivergenceError | RuleTriggered)
    reason = f"{type(error).__name__}: {error}"
    if not same_everywhere:
        reason += f" (rank {os.environ.get('RANK', '0')})"
    if not same_everywhere or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"[error] {reason}", file=sys.stderr, flush=True)
    record_failure(reason)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except TrainingError as error:
        _report(error)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
