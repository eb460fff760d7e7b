"""What a local job shows while it runs: the program's lines and progress, not the libraries' noise
(which stays in the log file)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from llmtrain.local.display import JobDisplay

# Lines as a DeepSpeed LoRA job prints them after the toolkit launched torchrun (one host).
LAUNCH = ["Invoking script with the following command:", "",
          "torchrun --nproc_per_node 2 training_jobs/train.py"]
NOISY = [
    "W1124 00:22:30.272000 17926 torch/distributed/run.py:874] *****************************************",
    "W1124 00:22:30.272000 17926 torch/distributed/run.py:874] Setting OMP_NUM_THREADS environment variable",
    "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
    "`torch.distributed.reduce_scatter_tensor` is deprecated.",
    "  return func(*args, **kwargs)",
    "/venv/lib/python3.11/site-packages/transformers/modeling_utils.py:3303: FutureWarning: "
    "`is_gradient_checkpointing` is deprecated",
    "  warnings.warn(",
    "The installed version of bitsandbytes was compiled without GPU support. 8-bit optimizers, 8-bit "
    "multiplication, and GPU quantization are unavailable.",
    "2026-11-24 00:23:54,280 sagemaker-training-toolkit INFO     Waiting for the process to finish",
    "Skipping import of cpp extensions due to incompatible torch version 2.13.0+cpu for torchao version "
    "0.16.0             Please see https://github.com/pytorch/ao/issues/2919 for more info",
    "2026/11/27 18:40:44 INFO mlflow.store.db.utils: Creating initial MLflow database tables...",
]
USEFUL = [
    "[train] model preset llama-tiny: 174,400 parameters",
    "  indented program output after a useful line",
    "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1: UserWarning: check your inputs",
    "2026-11-24 00:23:54,281 sagemaker-training-toolkit ERROR    InstallRequirementsError:",
]


def test_library_noise_stays_in_the_log_and_useful_lines_are_shown():
    output = io.StringIO()
    console = Console(file=output, width=300)
    with JobDisplay(console, max_steps=10, metric_names=["train:loss"], hosts=("algo-1",)) as display:
        for line in LAUNCH + NOISY + USEFUL:
            display.line("algo-1", line, [])
    shown = output.getvalue()
    assert display.hidden_lines == len(NOISY)
    for line in USEFUL:
        assert f"algo-1 | {line}" in shown
    for word in ("OMP_NUM_THREADS", "FutureWarning", "warnings.warn", "return func", "bitsandbytes",
                 "Waiting for the process", "cpp extensions", "MLflow database"):
        assert word not in shown


# bitsandbytes on a CPU with AVX512-BF16 and no `kernels` package, once per rank of a LoRA run.
BITSANDBYTES_KERNELS = (
    "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. Please make "
    "sure you already `pip install kernels` and the kernels >= 0.11.1"
)


def test_bitsandbytes_missing_cpu_kernels_stay_in_the_log():
    """Issue 36 item 7: only QLoRA's 4-bit layers would use the kernel; a LoRA run's console does not
    need the line (twice, one per rank)."""
    output = io.StringIO()
    console = Console(file=output, width=300)
    with JobDisplay(console, max_steps=10, metric_names=["train:loss"], hosts=("algo-1",)) as display:
        for line in [*LAUNCH, BITSANDBYTES_KERNELS, BITSANDBYTES_KERNELS, USEFUL[0]]:
            display.line("algo-1", line, [])
    shown = output.getvalue()
    assert display.hidden_lines == 2
    assert "gemm_4bit_forward" not in shown and "pip install kernels" not in shown
    assert f"algo-1 | {USEFUL[0]}" in shown


# What one host of a failed job prints after the program's error (torch 2.13's torchrun, the toolkit).
PROGRAM_ERROR = "[error] DataError: no manifest.json in /job/algo-1/input/data/train: prepare it"
# (A file: the lines are long and end in spaces, as torchrun prints them.)
LAUNCHER_REPORT = (Path(__file__).parent / "torchrun_failure.log").read_text().splitlines()
# A bug in the program: its own traceback is what a person needs, and it stays on the console.
PROGRAM_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/job/algo-1/code/training_jobs/train.py", line 99, in <module>',
    "    sys.exit(main())",
    "ZeroDivisionError: division by zero",
]


def test_a_failed_job_shows_the_programs_error_and_keeps_torchruns_report_in_the_log():
    output = io.StringIO()
    console = Console(file=output, width=300)
    with JobDisplay(console, max_steps=10, metric_names=["train:loss"], hosts=("algo-1",)) as display:
        for line in LAUNCH + [PROGRAM_ERROR, *PROGRAM_TRACEBACK, *LAUNCHER_REPORT, "a later line"]:
            display.line("algo-1", line, [])
    shown = output.getvalue()
    assert f"algo-1 | {PROGRAM_ERROR}" in shown
    for line in PROGRAM_TRACEBACK:
        assert f"algo-1 | {line}" in shown
    assert "algo-1 | a later line" in shown
    for word in ("torchrun\", line 8", "ChildFailedError", "Root Cause", "error_file", "=====",
                 "ExecuteUserScriptError", "ErrorMessage", "Encountered exit_code", "closing signal",
                 "failed (exitcode", "Reporting training FAILURE", "Command \"torchrun"):
        assert word not in shown, word
    assert display.launcher_lines == len(LAUNCHER_REPORT)


def _shown(lines: list[str]) -> list[str]:
    output = io.StringIO()
    with JobDisplay(Console(file=output, width=300), max_steps=10, metric_names=["train:loss"],
                    hosts=("algo-1",)) as display:
        for line in LAUNCH + lines:
            display.line("algo-1", line, [])
    return [line.removeprefix("algo-1 | ") for line in output.getvalue().splitlines()[1:]]


TRACEBACK_HEAD = PROGRAM_TRACEBACK[:3]


def test_an_exception_line_the_toolkit_split_is_shown_whole():
    """The toolkit ends a line at the end of each chunk it reads, and unbuffered Python writes the
    exception's name and its message separately: either piece boundary, or both (CI saw "ValueError",
    ":", the message), is joined again."""
    after_name = _shown([*TRACEBACK_HEAD, "ValueError", ": bad input: fix it", "a later line"])
    after_colon = _shown([*TRACEBACK_HEAD, "mod.DataError:", "no manifest", "a later line"])

    assert after_name == [*TRACEBACK_HEAD, "ValueError: bad input: fix it", "a later line"]
    assert after_colon == [*TRACEBACK_HEAD, "mod.DataError: no manifest", "a later line"]
    both = _shown([*TRACEBACK_HEAD, "ValueError", ":", "hyperparameter 'fail' is true", "a later line"])
    assert both == [*TRACEBACK_HEAD, "ValueError: hyperparameter 'fail' is true", "a later line"]


def test_lines_that_only_look_split_are_shown_as_printed():
    """An exception without a message, a name-like line outside a traceback, and a traceback that
    ends the output keep their lines."""
    no_message = _shown([*TRACEBACK_HEAD, "KeyboardInterrupt", "next: line"])
    outside = _shown(["epoch", ": not a continuation"])
    at_the_end = _shown([*TRACEBACK_HEAD, "SystemExit"])

    assert no_message == [*TRACEBACK_HEAD, "KeyboardInterrupt", "next: line"]
    assert outside == ["epoch", ": not a continuation"]
    assert at_the_end == [*TRACEBACK_HEAD, "SystemExit"]
