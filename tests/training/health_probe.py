"""Launched by test_health.py under torchrun: runs the preflight check, with one rank late on demand.

    python -m torch.distributed.run --nproc_per_node N tests/training/health_probe.py OUT_DIR [late]

Each rank writes OUT_DIR/rank<N>.json: the ranks' measurements or the error it stopped with. Without
`late`, a second check follows in which rank 2's matmul time is an hour (a rank slowed by other
processes on shared CPU cores; 10x its own measurement was not always 3x the median when the two
cores were shared by more processes than the three ranks), with its outcome under "injected_slow".
"""

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from training_jobs.trainer import health  # noqa: E402
from training_jobs.trainer.errors import ContainerError  # noqa: E402


def main(out: Path, late: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if late and rank == 1:
        time.sleep(8)  # a hung host: arrives long after the others gave up waiting
    try:
        checked = health.preflight(torch.device("cpu"), f"host-{rank}", timeout_seconds=3, repeats=2)
        report = {"ok": True, "ranks": [r.rank for r in checked.ranks],
                  "bus_gbps": [r.bus_gbps for r in checked.ranks]}
    except (ContainerError, RuntimeError) as error:
        report = {"ok": False, "error": type(error).__name__, "message": str(error)}
    if not late:
        report["injected_slow"] = _with_a_slow_rank(rank)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # skip the teardown collectives a failed check leaves unmatched


def _with_a_slow_rank(rank: int) -> dict:
    measure = health.measure

    def slowed(*args, **kwargs):
        mine = measure(*args, **kwargs)
        return replace(mine, matmul_seconds=3600.0) if rank == 2 else mine

    health.measure = slowed
    try:
        checked = health.preflight(torch.device("cpu"), f"host-{rank}", timeout_seconds=3, repeats=2)
        return {"ok": True, "slow": [r.rank for r in checked.slow],
                "timings_checked": checked.timings_checked}
    except ContainerError as error:
        return {"ok": False, "message": str(error)}
    finally:
        health.measure = measure


if __name__ == "__main__":
    main(Path(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "late")
