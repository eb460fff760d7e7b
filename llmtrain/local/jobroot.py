"""The job root of each emulated host, laid out like /opt/ml in a SageMaker training container.

```
<host root>/                      SAGEMAKER_BASE_DIR (the container's /opt/ml)
  input/config/hyperparameters.json
  input/config/resourceconfig.json
  input/config/inputdataconfig.json
  input/data/<channel>/           the channel's files (links to the local folder)
  code/                           the toolkit extracts sourcedir.tar.gz here
  model/                          SM_MODEL_DIR
  output/                         output/failure or output/success, output/data
  checkpoints/                    CheckpointConfig.LocalPath
```

Every job gets fresh roots: the toolkit skips extracting the code when code/ is not empty, and keeps
an old output/failure, so a reused root would run old code or report an old failure.

Checkpoints move like SageMaker moves them between a host's local folder and CheckpointConfig.S3Uri:
every host starts with a copy of the run's checkpoint folder (the download at job start), and what
every host wrote is copied back into it when the job ends (the upload; S3 keys that several hosts
write hold the last writer's file). Each host keeps its own folder, as each SageMaker host has its
own disk: a training program that relied on a folder shared between hosts would fail here as it
would in the cloud.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from llmtrain.local.job import LocalChannel, LocalJob, LocalRunError

# SageMaker's name for the single instance group of a homogeneous cluster.
INSTANCE_GROUP = "homogeneousCluster"
# The emulated hosts talk over this machine's loopback interface.
NETWORK_INTERFACE = "lo"


@dataclass(frozen=True)
class HostRoot:
    host: str
    root: Path

    @property
    def config_dir(self) -> Path:
        return self.root / "input" / "config"

    @property
    def data_dir(self) -> Path:
        return self.root / "input" / "data"

    @property
    def code_dir(self) -> Path:
        return self.root / "code"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def failure_file(self) -> Path:
        return self.output_dir / "failure"

    @property
    def success_file(self) -> Path:
        return self.output_dir / "success"


def resource_config(plan: LocalJob, host: str) -> dict:
    """resourceconfig.json as SageMaker writes it for a homogeneous cluster."""
    hosts = list(plan.hosts)
    return {
        "current_host": host,
        "current_instance_type": "local",
        "current_group_name": INSTANCE_GROUP,
        "hosts": hosts,
        "instance_groups": [
            {"instance_group_name": INSTANCE_GROUP, "instance_type": "local", "hosts": hosts},
        ],
        "network_interface_name": NETWORK_INTERFACE,
    }


def write_host_roots(
    plan: LocalJob,
    job_dir: Path,
    *,
    channel_dirs: dict[str, Path],
    checkpoints_dir: Path | None,
) -> list[HostRoot]:
    """Create one fresh root per host under `job_dir`."""
    missing = [c.name for c in plan.channels if c.name not in channel_dirs]
    if missing:
        raise LocalRunError(
            f"no local folder for channel(s) {', '.join(missing)}: pass --data CHANNEL=DIR for each"
        )
    roots = []
    for index, host in enumerate(plan.hosts):
        root = HostRoot(host, job_dir / host)
        if root.root.exists():
            raise LocalRunError(f"{root.root} already exists: every job needs a fresh job root")
        # output/ and model/ first: without them the toolkit cannot write output/failure, and a
        # failed job could end looking like a success.
        for folder in (root.config_dir, root.data_dir, root.model_dir, root.output_dir / "data"):
            folder.mkdir(parents=True)
        # SageMaker creates output/intermediate and syncs it itself; the toolkit only starts its own
        # S3 upload when the folder is missing.
        (root.output_dir / "intermediate").mkdir()
        _write_json(root.config_dir / "hyperparameters.json", dict(plan.hyperparameters))
        _write_json(root.config_dir / "resourceconfig.json", resource_config(plan, host))
        _write_json(root.config_dir / "inputdataconfig.json", {c.name: dict(c.config) for c in plan.channels})
        for channel in plan.channels:
            _link_channel(channel, channel_dirs[channel.name], root.data_dir / channel.name,
                          host_index=index, host_count=len(plan.hosts))
        if plan.checkpoint_subpath and checkpoints_dir is not None:
            download_checkpoints(checkpoints_dir, root.root / plan.checkpoint_subpath)
        roots.append(root)
    return roots


def download_checkpoints(run_checkpoints: Path, host_checkpoints: Path) -> None:
    """The host's checkpoint folder, filled from the run's (SageMaker's download at job start)."""
    host_checkpoints.parent.mkdir(parents=True, exist_ok=True)
    if run_checkpoints.is_dir():
        shutil.copytree(run_checkpoints, host_checkpoints, symlinks=True)
    else:
        host_checkpoints.mkdir()


def upload_from_hosts(roots: list[HostRoot], subpath: str, run_folder: Path) -> None:
    """Every host's files under `subpath` (checkpoints, TensorBoard events) into the run's folder,
    as SageMaker uploads them to S3; files are never deleted there, as the upload never deletes S3
    objects."""
    run_folder.mkdir(parents=True, exist_ok=True)
    for root in roots:
        host_folder = root.root / subpath
        if host_folder.is_dir():
            shutil.copytree(host_folder, run_folder, symlinks=True, dirs_exist_ok=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _link_channel(
    channel: LocalChannel, source: Path, target: Path, *, host_index: int, host_count: int
) -> None:
    source = source.resolve()
    if not source.is_dir():
        raise LocalRunError(f"channel '{channel.name}': {source} is not a folder")
    if not channel.sharded or host_count == 1:
        target.symlink_to(source, target_is_directory=True)
        return
    # ShardedByS3Key: each host receives its share of the objects under the prefix.
    files = sorted(p for p in source.rglob("*") if p.is_file())
    share = files[host_index::host_count]
    if not share:
        raise LocalRunError(
            f"channel '{channel.name}' is ShardedByS3Key over {host_count} hosts but {source} holds "
            f"only {len(files)} file(s): host {host_index + 1} would get none"
        )
    for path in share:
        link = target / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path, link)
