"""The `model` channel as a Hugging Face folder, whatever form the weights arrive in.

A run's own base model is a folder (config.json, safetensors, tokenizer files) and arrives as one.
SageMaker JumpStart publishes many models' training weights as a single `.tar.gz` object instead
(`training_artifact_key`), which SageMaker downloads into the channel as it is: the program unpacks
it once per instance, next to the channel, and reads the folder inside (the archive's root, or its
only top-level folder). Every process of the instance may ask; the first one unpacks under a file
lock and the others wait for it, so no process group is needed yet. An interrupted unpacking never
looks complete: it happens in a scratch folder that is renamed when done.
"""

from __future__ import annotations

import fcntl
import shutil
import tarfile
from pathlib import Path

from .errors import ContainerError

CONFIG = "config.json"
UNPACKED_SUFFIX = ".unpacked"


def model_folder(channel: Path | None) -> Path | None:
    """The folder to load the model (and its tokenizer) from: the channel itself, or the folder its
    one .tar.gz unpacks to."""
    if channel is None or (channel / CONFIG).is_file():
        return channel
    archives = sorted(channel.glob("*.tar.gz"))
    if len(archives) != 1:
        return channel  # model_source says what the channel lacks
    target = channel.parent / f"{channel.name}{UNPACKED_SUFFIX}"
    with (channel.parent / f"{channel.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():
            _unpack(archives[0], target)
    return _hf_folder(target, archives[0])


def _unpack(archive: Path, target: Path) -> None:
    scratch = target.with_name(target.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        # The "data" filter refuses absolute paths, links out of the folder and device files.
        tar.extractall(scratch, filter="data")
    scratch.rename(target)


def _hf_folder(unpacked: Path, archive: Path) -> Path:
    if (unpacked / CONFIG).is_file():
        return unpacked
    inner = [child for child in unpacked.iterdir() if child.is_dir()]
    if len(inner) == 1 and (inner[0] / CONFIG).is_file():
        return inner[0]
    raise ContainerError(
        f"the model channel's {archive.name} holds no {CONFIG} at its root or in its only "
        "folder: it must be a Hugging Face model (config.json and weights)"
    )
