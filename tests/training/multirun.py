"""Run several training jobs in one torchrun launch (its start-up costs more than a tiny job).

    python -m torch.distributed.run --nproc_per_node N tests/training/multirun.py SPEC.json

SPEC.json is a list of {"root": job root folder, "hyperparameters": {...}, "environment": {...}}
("environment" optional: variables set for that job only, e.g. LLMTRAIN_TEST_FAULTS). Each job runs
through training_jobs/train.py's own `run` with SAGEMAKER_BASE_DIR and SM_HPS set exactly as the
SageMaker toolkit sets them; the process group is shared. Rank 0 writes ROOT/outcome.json: {"ok": true} or
the TrainingError it stopped with.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from training_jobs import train  # noqa: E402
from training_jobs.trainer.errors import TrainingError  # noqa: E402


def main(spec_path: str) -> int:
    jobs = json.loads(Path(spec_path).read_text())
    for job in jobs:
        os.environ["SAGEMAKER_BASE_DIR"] = job["root"]
        os.environ["SM_HPS"] = json.dumps(job["hyperparameters"])
        extra = job.get("environment", {})
        os.environ.update(extra)
        started = time.monotonic()
        try:
            train.run([], own_process_group=False)
            outcome = {"ok": True}
        except TrainingError as error:
            outcome = {"ok": False, "error": type(error).__name__, "message": str(error)}
        except Exception as error:  # a bug: keep the traceback for the test report
            outcome = {"ok": False, "error": type(error).__name__, "message": traceback.format_exc()}
        for name in extra:
            del os.environ[name]
        if not outcome["ok"] and os.environ.get("RANK", "0") != "0":
            # Only rank 0 writes the outcome: another rank's own failure would show only as rank 0's
            # broken connection or a hang.
            print(f"[multirun] rank {os.environ['RANK']}: {outcome['message']}", file=sys.stderr, flush=True)
        if os.environ.get("RANK", "0") == "0":
            (Path(job["root"]) / "outcome.json").write_text(json.dumps(outcome))
            # Which jobs a launch's time goes to (tests/training's slow launches are budgeted).
            (Path(job["root"]) / "seconds.txt").write_text(f"{time.monotonic() - started:.1f}\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
