"""What a local job shows in the terminal while it runs: the training log and its progress.

Every line goes to the host's log file; the terminal gets the training program's output, the
toolkit's errors, and one progress line per metric line (step, loss, tokens/s, ...). The toolkit's
long preamble (the training environment it prints before it launches torchrun) stays in the log
file, and so does noise that would bury the useful lines (`NOISE`). On a terminal, a progress bar
sits below the log.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from llmtrain.local.metrics import MetricPoint, loss_metric, throughput_metric

# The toolkit prints this, a blank line, then the command it runs (torchrun ...).
_INVOCATION = "Invoking script with the following command"
_ALWAYS_SHOWN = (" ERROR ", "Traceback", "Error:")
# Lines only the log file gets: every rank repeating a library's deprecation warnings (DeepSpeed's
# collectives, transformers' renamed attributes), torchrun's thread-count banner, the toolkit's INFO
# chatter, bitsandbytes announcing that it has no GPU kernels (only QLoRA needs them), and
# transformers' padding advice (packed samples have no padding).
NOISE = re.compile("|".join((
    r"(Future|Deprecation)Warning: ",
    r"torch/distributed/run\.py:\d+\]",
    r"sagemaker-training-toolkit INFO ",
    r"bitsandbytes.*(without GPU support|GPU quantization are unavailable)",
    r"We strongly recommend passing in an `attention_mask`",
    r"You may ignore this warning if your `pad_token_id`",
)))
# Python prints a warning's source line, indented, under it.
_SOURCE_LINE = re.compile(r"^\s+\S")


class JobDisplay:
    def __init__(
        self, console: Console, *, max_steps: int | None, metric_names: list[str], hosts: tuple[str, ...]
    ):
        self.console = console
        self.max_steps = max_steps
        self.loss_name = loss_metric(metric_names)
        self.throughput_name = throughput_metric(metric_names)
        self._launched = dict.fromkeys(hosts, False)
        self._command_next = dict.fromkeys(hosts, False)
        self._progress: Progress | None = None
        self._task = None
        self.last_step: int | None = None
        self._after_noise = dict.fromkeys(hosts, False)
        self.hidden_lines = 0

    def __enter__(self) -> JobDisplay:
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("training", total=self.max_steps, stats="starting")
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _print(self, renderable) -> None:
        # Log lines keep their own length: wrapping would break them for copy and paste.
        (self._progress.console if self._progress else self.console).print(renderable, soft_wrap=True)

    def note(self, message: str) -> None:
        self._print(Text.from_markup(f"[bold cyan]llmtrain[/] {message}"))

    def line(self, host: str, line: str, points: list[MetricPoint]) -> None:
        if points:
            self._show_progress(host, points)
            return
        if not self._launched[host]:
            self._preamble_line(host, line)
            return
        if self._is_noise(host, line):
            self.hidden_lines += 1
        elif line.strip():
            self._print(Text(f"{host} | {line}"))

    def _is_noise(self, host: str, line: str) -> bool:
        follows_noise, self._after_noise[host] = self._after_noise[host], False
        if NOISE.search(line):
            self._after_noise[host] = True
            return True
        return follows_noise and bool(_SOURCE_LINE.match(line))

    def _preamble_line(self, host: str, line: str) -> None:
        if self._command_next[host] and line.strip():
            self._launched[host] = True
            self._print(Text.from_markup(f"[bold]{host}[/] | the toolkit runs: {escape(line.strip())}"))
        elif _INVOCATION in line:
            self._command_next[host] = True
        elif any(marker in line for marker in _ALWAYS_SHOWN):
            self._print(Text(f"{host} | {line}", style="red"))

    def _show_progress(self, host: str, points: list[MetricPoint]) -> None:
        step = next((p.step for p in points if p.step is not None), None)
        values = "  ".join(f"{p.name}={p.value:g}" for p in points)
        if step is not None:
            self.last_step = max(step, self.last_step or 0)
        if self._progress is not None:
            stats = self._stats(points)
            if stats:
                self._progress.update(self._task, completed=self.last_step or 0, stats=stats)
            else:
                self._progress.update(self._task, completed=self.last_step or 0)
            if not any(p.name in (self.loss_name, self.throughput_name) for p in points):
                self._print(Text(f"{host} | step {step}: {values}", style="cyan"))
            return
        where = f"step {step}/{self.max_steps}" if step is not None and self.max_steps else f"step {step}"
        self._print(Text(f"{host} | {where}  {values}", style="cyan"))

    def _stats(self, points: list[MetricPoint]) -> str:
        parts = []
        for point in points:
            if point.name == self.loss_name:
                parts.append(f"loss {point.value:.4f}")
            elif point.name == self.throughput_name:
                parts.append(f"{point.value:,.0f} tokens/s")
        return "  ".join(parts)
