"""What the numbers were measured on: the machine, its load, the software versions."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import psutil

PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "numpy", "aws-cdk-lib")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_average() -> dict:
    one, five, fifteen = os.getloadavg()
    return {"1min": round(one, 2), "5min": round(five, 2), "15min": round(fifteen, 2)}


def accelerator() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def git_revision(repo: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        except FileNotFoundError:  # a bare GPU machine without git
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def describe(repo: Path) -> dict:
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "accelerator": accelerator(),
        "versions": versions(),
        "git": git_revision(repo),
    }
