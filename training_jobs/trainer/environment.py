"""The SageMaker training container contract, read once at start-up.

SageMaker (through the training toolkit) describes the job in environment variables: SM_HPS (the
hyperparameters as JSON), SM_CHANNEL_<NAME> (input folders), SM_MODEL_DIR, SM_OUTPUT_DATA_DIR,
SM_HOSTS, SM_CURRENT_HOST, SM_CURRENT_INSTANCE_TYPE; checkpoints live in /opt/ml/checkpoints,
which SageMaker syncs with CheckpointConfig.S3Uri. torchrun adds RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE. The job root is SAGEMAKER_BASE_DIR when set (the local runner and tests lay out a
folder like /opt/ml), so the program runs the same in the cloud, locally and under plain torchrun.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract.hyperparameters import parse_command_line
from .errors import ConfigError, ContainerError

DEFAULT_BASE_DIR = Path("/opt/ml")


@dataclass(frozen=True)
class JobEnvironment:
    hyperparameters: dict[str, Any]
    hyperparameter_source: str
    channels: dict[str, Path]
    model_dir: Path
    output_data_dir: Path
    checkpoint_dir: Path
    hosts: list[str]
    current_host: str
    instance_type: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @property
    def num_hosts(self) -> int:
        return max(len(self.hosts), self.world_size // max(self.local_world_size, 1))

    def channel(self, name: str) -> Path | None:
        return self.channels.get(name)


def base_dir(environ: Mapping[str, str]) -> Path:
    """The job root: SAGEMAKER_BASE_DIR, else /opt/ml inside a SageMaker container."""
    if environ.get("SAGEMAKER_BASE_DIR"):
        return Path(environ["SAGEMAKER_BASE_DIR"])
    if DEFAULT_BASE_DIR.is_dir():
        return DEFAULT_BASE_DIR
    raise ContainerError(
        "not inside a SageMaker container (/opt/ml does not exist) and SAGEMAKER_BASE_DIR is not "
        "set: set SAGEMAKER_BASE_DIR to a job root laid out like /opt/ml (channels under "
        "input/data/<name>), or use `llmtrain run --local`")


def read_hyperparameters(argv: list[str], environ: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """SM_HPS when present (JSON values, lossless); else --name value pairs from the command line.

    The toolkit passes the same hyperparameters both ways; the command-line copy flattens
    dictionaries to k=v strings, so SM_HPS wins.
    """
    if environ.get("SM_HPS"):
        try:
            hyperparameters = json.loads(environ["SM_HPS"])
        except json.JSONDecodeError as error:
            raise ConfigError(f"SM_HPS is not valid JSON: {error}") from error
        if not isinstance(hyperparameters, dict):
            raise ConfigError("SM_HPS must be a JSON object of hyperparameters")
        return hyperparameters, "SM_HPS"
    return dict(parse_command_line(argv)), "command line"


def _channels(environ: Mapping[str, str], root: Path) -> dict[str, Path]:
    channels = {key[len("SM_CHANNEL_"):].lower(): Path(value)
                for key, value in environ.items() if key.startswith("SM_CHANNEL_")}
    data_root = root / "input" / "data"
    if not channels and data_root.is_dir():
        channels = {child.name: child for child in sorted(data_root.iterdir()) if child.is_dir()}
    return channels


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    return int(value) if value not in (None, "") else default


def read_environment(argv: list[str], environ: Mapping[str, str] | None = None) -> JobEnvironment:
    """Everything the program needs from its surroundings, with fallbacks for plain torchrun."""
    environ = os.environ if environ is None else environ
    hyperparameters, source = read_hyperparameters(argv, environ)
    root = base_dir(environ)
    hosts = json.loads(environ["SM_HOSTS"]) if environ.get("SM_HOSTS") else ["algo-1"]
    return JobEnvironment(
        hyperparameters=hyperparameters,
        hyperparameter_source=source,
        channels=_channels(environ, root),
        model_dir=Path(environ.get("SM_MODEL_DIR") or root / "model"),
        output_data_dir=Path(environ.get("SM_OUTPUT_DATA_DIR") or root / "output" / "data"),
        checkpoint_dir=root / "checkpoints",
        hosts=list(hosts),
        current_host=environ.get("SM_CURRENT_HOST") or hosts[0],
        instance_type=environ.get("SM_CURRENT_INSTANCE_TYPE") or "local",
        rank=_int_env(environ, "RANK", 0),
        local_rank=_int_env(environ, "LOCAL_RANK", 0),
        world_size=_int_env(environ, "WORLD_SIZE", 1),
        local_world_size=_int_env(environ, "LOCAL_WORLD_SIZE", 1),
    )
