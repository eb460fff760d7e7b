"""What a local job shows in the terminal while it runs: the training log and its progress.

Every line goes to the host's log file; the terminal gets the training program's output, the
toolkit's errors, and one progress line per metric line (step, loss, tokens/s, ...). The toolkit's
long preamble (the training environment it prints before it launches torchrun) stays in the log
file, and so does noise that would bury the useful lines (`NOISE`). When the job fails, what the
launchers print after the training program's own error stays in the log file too (`LauncherReport`):
torchrun's agent log lines, its traceback and its report of the failed processes, and the toolkit's
restatement of the failure (ExecuteUserScriptError, with the whole torchrun command). The program's
`[error]` line, its own tracebacks and the summary's failure reason (output/failure) say what failed.
The last line of such a traceback, which the toolkit can print in two pieces, is shown whole
(`ExceptionLineMender`). On a terminal, a progress bar sits below the log.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from llmtrain.local.metric_lines import MetricPoint, loss_metric, throughput_metric

# The toolkit prints this, a blank line, then the command it runs (torchrun ...).
_INVOCATION = "Invoking script with the following command"
_ALWAYS_SHOWN = (" ERROR ", "Traceback", "Error:")
# Lines only the log file gets: every rank repeating a library's deprecation warnings (DeepSpeed's
# collectives, transformers' renamed attributes), torchrun's thread-count banner, the toolkit's INFO
# chatter, bitsandbytes announcing that it has no GPU kernels (only QLoRA needs them) nor the optional
# `kernels` package's CPU 4-bit kernel (QLoRA on CPU falls back to its own), torchao
# announcing that its C++ kernels do not match this torch (FP8 training, the only part the program
# uses, is Python; a library imports torchao even when FP8 is off), MLflow creating a local store's
# tables, and transformers' padding advice (packed samples have no padding).
NOISE = re.compile("|".join((
    r"(Future|Deprecation)Warning: ",
    r"torch/distributed/run\.py:\d+\]",
    r"sagemaker-training-toolkit INFO ",
    r"bitsandbytes.*(without GPU support|GPU quantization are unavailable)",
    r"Failed to load CPU gemm_4bit_forward from kernels-community: ",
    r"Skipping import of cpp extensions due to incompatible torch version",
    r"INFO mlflow\.store\.db\.utils: ",
    r"We strongly recommend passing in an `attention_mask`",
    r"You may ignore this warning if your `pad_token_id`",
)))
# Python prints a warning's source line, indented, under it.
_SOURCE_LINE = re.compile(r"^\s+\S")
# torchrun's agent logs ("E1127 11:28:07.179000 9266 torch/distributed/elastic/...] failed ...").
_AGENT_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ torch/distributed/elastic/")
_TRACEBACK = "Traceback (most recent call last):"
# The first frame of torchrun's own traceback: its console script, or torch.distributed.run.
_LAUNCHER_FRAME = re.compile(r'^\s*File ".*(/torchrun|torch/distributed/run\.py)", line')
_REPORT_RULE = re.compile(r"^={20,}$")
_TOOLKIT_FAILURE = re.compile(r"sagemaker-training-toolkit ERROR\s+(Reporting training FAILURE|"
                              r"Encountered exit_code)")
_TOOLKIT_RESTATEMENT = re.compile(r"sagemaker-training-toolkit ERROR\s+ExecuteUserScriptError:")
# A traceback's last line: the exception's (dotted) name, then ": message" or nothing.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(:.*)?$")
_EXCEPTION_NAME_ONLY = re.compile(r"^[A-Za-z_][\w.]*:?$")


class ExceptionLineMender:
    """Joins the last line of a traceback that the toolkit split in two.

    The toolkit reads the program's output in fixed-size chunks and ends a line at the end of each
    chunk. Unbuffered (PYTHONUNBUFFERED, as in the training images), Python writes that last line in
    pieces: the exception's name, ": ", the message. So a chunk can end after the name, and
    "ValueError: bad input" reaches the console as "ValueError" and ": bad input" (CloudWatch shows
    the same; the log file keeps what the toolkit printed). Both boundaries can fall in one line
    ("ValueError", ":", "bad input"). `feed` takes one shown line and returns
    the lines to show now: a lone exception name is held until the next line says whether it goes on.
    """

    def __init__(self) -> None:
        self._in_traceback = False
        self._held: str | None = None

    def feed(self, line: str) -> list[str]:
        if self._held is not None:
            held, self._held = self._held, None
            if line.startswith(":"):
                if not line[1:].strip():  # the name and its colon: the message comes next
                    self._held = held + ":"
                    return []
                return [held + line]
            if held.endswith(":") and line.strip():
                return [f"{held} {line.strip()}"]
            return [held, *self.feed(line)]
        if line.strip() == _TRACEBACK:
            self._in_traceback = True
        elif self._in_traceback and _EXCEPTION_LINE.match(line):
            self._in_traceback = False
            if _EXCEPTION_NAME_ONLY.match(line):
                self._held = line
                return []
        return [line]

    def flush(self) -> list[str]:
        held, self._held = self._held, None
        return [] if held is None else [held]


class LauncherReport:
    """Recognises, line by line, what torchrun and the toolkit print when the training processes
    fail: `hidden(line)` says whether a line belongs to it. A traceback is held back one line, until
    its first frame says whose it is (torchrun's is hidden, the program's shown): `held` returns it."""

    def __init__(self) -> None:
        self._state: str | None = None  # "traceback", "report", "restatement"
        self.held: str | None = None

    def hidden(self, line: str) -> bool:
        if self.held is not None:
            launcher = bool(_LAUNCHER_FRAME.match(line))
            self.held, self._state = None, "traceback" if launcher else None
            return launcher  # else the program's traceback: the caller shows the held line, then this
        if self._state is not None:
            self._continue(line)
            return True
        if line.strip() == _TRACEBACK:
            self.held = line
            return True
        if _TOOLKIT_RESTATEMENT.search(line):
            self._state = "restatement"
            return True
        return bool(_AGENT_LOG.match(line) or _TOOLKIT_FAILURE.search(line))

    def _continue(self, line: str) -> None:
        if self._state == "restatement":
            if line.startswith('Command "'):
                self._state = None
        elif _REPORT_RULE.match(line.strip()):  # the report opens and closes with a rule of '='
            self._state = "report" if self._state == "traceback" else None


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
        self._reports = {host: LauncherReport() for host in hosts}
        self._menders = {host: ExceptionLineMender() for host in hosts}
        self.hidden_lines = 0
        self.launcher_lines = 0

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
        for host, report in self._reports.items():
            if report.held is not None:  # a traceback's first line, with nothing after it
                self._show(host, report.held)
            for line in self._menders[host].flush():
                self._print(Text(f"{host} | {line}"))
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
        report = self._reports[host]
        held = report.held
        if report.hidden(line):
            # A held line is counted with the next one, once it is known to be torchrun's.
            self.launcher_lines += 1 + (held is not None) if report.held is None else 0
            return
        if held is not None:
            self._show(host, held)
        if self._is_noise(host, line):
            self.hidden_lines += 1
        elif line.strip():
            self._show(host, line)

    def _show(self, host: str, line: str) -> None:
        for mended in self._menders[host].feed(line):
            self._print(Text(f"{host} | {mended}"))

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
