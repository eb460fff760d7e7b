"""Start the SageMaker training toolkit once per emulated host, stream its log, stop it like SageMaker.

Each host runs what the SageMaker PyTorch container runs as its entry point: the toolkit's `train`
command with SAGEMAKER_TRAINING_MODULE pointing at the PyTorch toolkit, which launches torchrun. The
toolkit runs unmodified; the local differences are all in its environment:

- SAGEMAKER_BASE_DIR points the toolkit at the host's job root instead of /opt/ml.
- SM_STUDIO_LOCAL_MODE=true skips the toolkit's wait until every host name resolves in DNS.
- For more than one host, torchrun's own PET_RDZV_ENDPOINT setting makes it meet on 127.0.0.1 at a
  free port. The toolkit still passes `--master_addr algo-1 --master_port 7777` (in SageMaker each
  host is its own machine and algo-1 resolves); torchrun only uses those to build the rendezvous
  endpoint when none is given, and the workers get MASTER_ADDR from the rendezvous.
- CUDA_VISIBLE_DEVICES is empty, so the training program trains on CPU with gloo.
- The toolkit's `pip install -r requirements.txt` runs with no network (llmtrain.local.packages):
  this environment must already satisfy the requirements; a package it lacks fails the job, named.

Stopping follows StopTrainingJob: the training processes (the ranks torchrun started) receive
SIGTERM and get a grace period to checkpoint and exit; then everything left gets SIGKILL. If
llmtrain dies without stopping the job (SIGKILL, the OOM killer), the reaper (reaper.py) kills it.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from llmtrain.local.jobroot import HostRoot
from llmtrain.local.packages import offline_install_environment
from llmtrain.local.reaper import Reaper

PYTORCH_TRAINING_MODULE = "sagemaker_pytorch_container.training:main"
TOOLKIT_COMMAND = (sys.executable, "-m", "sagemaker_training.cli.train")
# Variables of an outer launcher or container that must not leak into an emulated host.
# What the toolkit starts the ranks with (torchrun for torch_distributed, mpirun for MPI jobs).
_LAUNCHERS = ("torchrun", "torch.distributed.run", "mpirun")
_INHERITED_PREFIXES = ("SM_", "SAGEMAKER_", "PET_", "TORCHELASTIC_")
_INHERITED_NAMES = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "ROLE_RANK", "CURRENT_HOST", "TRAINING_JOB_NAME", "TRAINING_JOB_ARN",
})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_environment(
    root: HostRoot,
    *,
    job_name: str,
    container_env: dict[str, str],
    rendezvous_port: int | None,
    parent_env: dict[str, str],
) -> dict[str, str]:
    """The environment of one host's toolkit process (see the module docstring for why)."""
    env = {
        k: v for k, v in offline_install_environment(parent_env).items()
        if not k.startswith(_INHERITED_PREFIXES) and k not in _INHERITED_NAMES
    }
    env.update(container_env)
    env.update({
        "SAGEMAKER_BASE_DIR": str(root.root),
        "SAGEMAKER_TRAINING_MODULE": PYTORCH_TRAINING_MODULE,
        "SM_STUDIO_LOCAL_MODE": "true",
        "TRAINING_JOB_NAME": job_name,
        "TRAINING_JOB_ARN": f"arn:aws:sagemaker:local:000000000000:training-job/{job_name}",
        # The toolkit starts `torchrun` by name: use the one of this Python environment.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), parent_env.get("PATH", os.defpath)]),
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
    })
    if rendezvous_port is not None:
        env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{rendezvous_port}"
    return env


@dataclass
class _Host:
    root: HostRoot
    process: subprocess.Popen
    log_path: Path
    reader: threading.Thread
    signalled: set[int] = field(default_factory=set)


class ToolkitProcesses:
    """The toolkit processes of one job, one per emulated host."""

    def __init__(self, roots: list[HostRoot], envs: dict[str, dict[str, str]], log_dir: Path):
        self._roots = roots
        self._envs = envs
        self._log_dir = log_dir
        self._hosts: list[_Host] = []
        self._reaper: Reaper | None = None
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()

    @property
    def log_paths(self) -> dict[str, Path]:
        return {h.root.host: h.log_path for h in self._hosts}

    def start(self) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._reaper = Reaper()
        for root in self._roots:
            log_path = self._log_dir / f"{root.host}.log"
            process = subprocess.Popen(
                TOOLKIT_COMMAND,
                env=self._envs[root.host],
                cwd=root.root,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                bufsize=1,
                # Own process group: a Ctrl-C in the terminal reaches llmtrain only, which then stops
                # the job the way SageMaker does; and the whole group can be killed at the end.
                start_new_session=True,
            )
            self._reaper.watch(process.pid)  # its own session: the process group id is its pid
            reader = threading.Thread(target=self._read, args=(root.host, process, log_path), daemon=True)
            reader.start()
            self._hosts.append(_Host(root, process, log_path, reader))

    def _read(self, host: str, process: subprocess.Popen, log_path: Path) -> None:
        with log_path.open("w") as log:
            for line in process.stdout:
                log.write(line)
                log.flush()
                self.lines.put((host, line.rstrip("\n")))

    def running(self) -> bool:
        return any(h.process.poll() is None for h in self._hosts)

    def returncodes(self) -> dict[str, int | None]:
        return {h.root.host: h.process.poll() for h in self._hosts}

    def terminate_training(self) -> None:
        """SIGTERM to every training process that has not had one yet; call it again to reach
        processes started since (torchrun may still be starting its workers when a stop arrives)."""
        for host in self._hosts:
            for process in training_processes(host.process.pid):
                if process.pid not in host.signalled:
                    host.signalled.add(process.pid)
                    _signal(process, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to every process of the job, the toolkits included."""
        for host in self._hosts:
            _kill_group(host.process.pid)

    def kill_if_running(self) -> None:
        """The safety net when supervision ends by an exception: leave no process behind."""
        if self.running():
            self.kill()
            self.finish()

    def release_reaper(self) -> None:
        """Call once every process of the job has ended (after finish or kill_if_running)."""
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for the toolkits, clear out leftover processes and let the readers drain the logs."""
        deadline = time.monotonic() + timeout
        for host in self._hosts:
            try:
                host.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(host.process.pid)
                host.process.wait()
            # Orphans (a worker whose torchrun died first) are still in the host's process group.
            _kill_group(host.process.pid)
            host.reader.join(timeout=10)


def training_processes(toolkit_pid: int) -> list[psutil.Process]:
    """The processes that run the user's code: the ranks a launcher (torchrun) started, or the
    toolkit's own child when it runs the program directly. Not the launcher, which would stop its
    workers itself with a 30-second limit, and not the ranks' helpers (data loader workers), which
    die on SIGTERM and would break the step that saves the checkpoint."""
    found = []
    try:
        for child in psutil.Process(toolkit_pid).children():
            found.extend(child.children() if _is_launcher(child) else [child])
    except psutil.NoSuchProcess:
        pass
    return found


def _is_launcher(process: psutil.Process) -> bool:
    try:
        command = " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False
    return any(launcher in command for launcher in _LAUNCHERS)


def _signal(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.NoSuchProcess:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
