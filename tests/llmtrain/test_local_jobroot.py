"""The emulated hosts' job roots, checked by reading them with the SageMaker training toolkit itself."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from llmtrain.core.catalog import Catalog
from llmtrain.core.render import render
from llmtrain.core.run_settings import RunInput
from llmtrain.core.team_context import local_context
from llmtrain.local.job import LocalChannel, LocalRunError, local_job
from llmtrain.local.jobroot import upload_from_hosts, write_host_roots
from llmtrain.local.toolkit import host_environment

# What the toolkit makes of a job root: the same object the PyTorch container builds at start-up.
READ_WITH_TOOLKIT = """
import json
from sagemaker_training import environment
env = environment.Environment()
print(json.dumps({
    "hosts": env.hosts, "current_host": env.current_host, "master": env.master_hostname,
    "channels": env.channel_input_dirs, "hyperparameters": env.hyperparameters,
    "framework": env.additional_framework_parameters, "model_dir": env.model_dir,
    "output_dir": env.output_dir, "network_interface": env.network_interface_name,
}))
"""


@pytest.fixture(scope="module")
def plan():
    template = Catalog.load().resolve("llama-pretrain-fsdp")
    request = render(template, RunInput(run_name="roots"), local_context())
    return local_job(request)


@pytest.fixture
def train_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "train-data"
    folder.mkdir()
    for name in ("a.bin", "b.bin", "c.bin"):
        (folder / name).write_bytes(b"x")
    return folder


def toolkit_view(root, plan, port=None) -> dict:
    env = host_environment(root, job_name=plan.job_name, container_env={}, rendezvous_port=port,
                           parent_env={"PATH": "/usr/bin:/bin"})
    result = subprocess.run([sys.executable, "-c", READ_WITH_TOOLKIT], env=env, capture_output=True,
                            text=True, check=True, cwd=root.root)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_host_root_reads_back_through_the_toolkit(plan, train_dir, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step_00000002").mkdir(parents=True)
    (checkpoints / "step_00000002" / "__0_0.distcp").write_text("shard of rank 0")
    roots = write_host_roots(plan, tmp_path / "job", channel_dirs={"train": train_dir},
                             checkpoints_dir=checkpoints)

    assert [r.host for r in roots] == ["algo-1", "algo-2"]
    expected_hps = {k: json.loads(v) for k, v in plan.hyperparameters.items()
                    if not k.startswith("sagemaker_")}
    for root in roots:
        view = toolkit_view(root, plan)
        assert view["hosts"] == ["algo-1", "algo-2"]
        assert view["current_host"] == root.host
        assert view["master"] == "algo-1"
        assert view["network_interface"] == "lo"
        assert view["channels"] == {"train": str(root.data_dir / "train")}
        assert view["hyperparameters"] == expected_hps
        assert view["framework"]["sagemaker_mpi_num_of_processes_per_host"] == 2
        assert view["framework"]["sagemaker_torch_distributed_enabled"] is True
        assert view["model_dir"] == str(root.model_dir)
        # Created before the toolkit runs, so that it can always write output/failure.
        assert root.output_dir.is_dir() and root.model_dir.is_dir()
        assert (root.output_dir / "intermediate").is_dir()
        assert (root.data_dir / "train").resolve() == train_dir.resolve()
        assert sorted(p.name for p in (root.data_dir / "train").iterdir()) == ["a.bin", "b.bin", "c.bin"]
        # Every host starts from its own copy of the run's checkpoints (SageMaker's download).
        host_checkpoints = root.root / "checkpoints"
        assert not host_checkpoints.is_symlink()
        assert (host_checkpoints / "step_00000002" / "__0_0.distcp").read_text() == "shard of rank 0"


def test_what_every_host_checkpoints_is_uploaded_to_the_run(plan, train_dir, tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    roots = write_host_roots(plan, tmp_path / "job", channel_dirs={"train": train_dir},
                             checkpoints_dir=checkpoints)
    for rank, root in enumerate(roots):
        step = root.root / "checkpoints" / "step_00000004"
        step.mkdir()
        (step / f"__{rank}_0.distcp").write_text(f"shard of host {root.host}")
    (roots[0].root / "checkpoints" / "step_00000004" / ".metadata").write_text("rank 0 writes this")

    upload_from_hosts(roots, "checkpoints", checkpoints)

    uploaded = sorted(p.name for p in (checkpoints / "step_00000004").iterdir())
    assert uploaded == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_a_job_root_is_never_reused(plan, train_dir, tmp_path):
    write_host_roots(plan, tmp_path / "job", channel_dirs={"train": train_dir}, checkpoints_dir=None)
    with pytest.raises(LocalRunError, match="fresh job root"):
        write_host_roots(plan, tmp_path / "job", channel_dirs={"train": train_dir}, checkpoints_dir=None)


def test_a_channel_without_a_folder_is_named(plan, tmp_path):
    with pytest.raises(LocalRunError, match="--data CHANNEL=DIR"):
        write_host_roots(plan, tmp_path / "job", channel_dirs={}, checkpoints_dir=None)


def test_sharded_by_s3_key_gives_each_host_its_share(plan, train_dir, tmp_path):
    sharded = replace(plan, channels=(LocalChannel("train", {"TrainingInputMode": "File",
                                                             "S3DistributionType": "ShardedByS3Key",
                                                             "RecordWrapperType": "None"}, sharded=True),))
    roots = write_host_roots(sharded, tmp_path / "job", channel_dirs={"train": train_dir},
                             checkpoints_dir=None)
    shares = [sorted(p.name for p in (r.data_dir / "train").iterdir()) for r in roots]
    assert shares == [["a.bin", "c.bin"], ["b.bin"]]
    config = json.loads((roots[0].config_dir / "inputdataconfig.json").read_text())
    assert config["train"]["S3DistributionType"] == "ShardedByS3Key"


def test_host_environment_isolates_the_job(plan, train_dir, tmp_path):
    root = write_host_roots(plan, tmp_path / "job", channel_dirs={"train": train_dir},
                            checkpoints_dir=None)[0]
    outer = {"PATH": "/usr/bin", "SM_HPS": "{}", "PET_NNODES": "9", "RANK": "3", "HOME": "/home/me"}
    env = host_environment(root, job_name="j", container_env={"MY_FLAG": "1"}, rendezvous_port=29999,
                           parent_env=outer)
    assert "SM_HPS" not in env and "PET_NNODES" not in env and "RANK" not in env
    assert env["HOME"] == "/home/me" and env["MY_FLAG"] == "1"
    assert env["SAGEMAKER_BASE_DIR"] == str(root.root)
    assert env["SM_STUDIO_LOCAL_MODE"] == "true"
    assert env["SAGEMAKER_TRAINING_MODULE"] == "sagemaker_pytorch_container.training:main"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:29999"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    single = host_environment(root, job_name="j", container_env={}, rendezvous_port=None, parent_env=outer)
    assert "PET_RDZV_ENDPOINT" not in single
