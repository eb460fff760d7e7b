"""Runs one configuration as a child process, timestamps its output lines as they arrive (with the
CPU seconds its process tree has used by then), and samples the memory of its whole process tree
(launcher and every rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE_INTERVAL_S = 0.1


@dataclass
class ProcessResult:
    returncode: int
    wall_seconds: float
    peak_rss_bytes: int  # the highest sum of RSS over the tree (launcher and every rank)
    peak_process_rss_bytes: int  # the highest RSS of any single process in the tree
    log_path: Path
    timed_out: bool
    lines: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter at arrival, line)
    # The tree's user + system CPU seconds when each line arrived (aligned with `lines`): on a machine
    # other sessions share, the work a step took, which its wall time mixes with their load.
    line_cpu_seconds: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def log_tail(self, count: int = 60) -> str:
        return "\n".join(line for _, line in self.lines[-count:])


class _TreeMemorySampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self._root = psutil.Process(pid)
        self._stop_event = threading.Event()
        self.peak_total = 0
        self.peak_single = 0

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._sample()
            self._stop_event.wait(SAMPLE_INTERVAL_S)

    def _sample(self) -> None:
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total = 0
        for process in processes:
            try:
                rss = process.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            total += rss
            self.peak_single = max(self.peak_single, rss)
        self.peak_total = max(self.peak_total, total)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User + system CPU seconds of `root` and its living descendants."""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return float("nan")
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _copy_lines(stream, log, lines: list[tuple[float, str]], root: psutil.Process,
                cpu: list[float]) -> None:
    for raw in iter(stream.readline, b""):
        arrival = time.perf_counter()
        cpu.append(tree_cpu_seconds(root))
        text = raw.decode(errors="replace").rstrip("\n")
        lines.append((arrival, text))
        log.write(text + "\n")
        log.flush()


def run_measured(command: list[str], env: dict[str, str], log_path: Path, timeout_s: int,
                 cwd: Path) -> ProcessResult:
    """Runs `command` to the end (or kills its whole tree after `timeout_s`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[float, str]] = []
    cpu: list[float] = []
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=cwd,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        sampler = _TreeMemorySampler(process.pid)
        sampler.start()
        reader = threading.Thread(target=_copy_lines, daemon=True,
                                  args=(process.stdout, log, lines, psutil.Process(process.pid), cpu))
        reader.start()
        timed_out = False
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)  # its own session: only this run's processes
            process.wait()
        finally:
            sampler.stop()
            reader.join(timeout=10)
    return ProcessResult(
        returncode=process.returncode,
        wall_seconds=time.perf_counter() - start,
        peak_rss_bytes=sampler.peak_total,
        peak_process_rss_bytes=sampler.peak_single,
        log_path=log_path,
        timed_out=timed_out,
        lines=lines,
        line_cpu_seconds=cpu,
    )
