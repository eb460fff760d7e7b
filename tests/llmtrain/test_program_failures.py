"""The training program's failure reasons the platform acts on (llmtrain.core.program_failures) are the
ones the program writes: llmtrain never imports the program, so this test holds the two together."""

from __future__ import annotations

from pathlib import Path

from llmtrain.core.program_failures import HUNG_COLLECTIVE, RULE_TRIGGERED, meaning, program_failure
from training_jobs.trainer.errors import RuleTriggered
from training_jobs.trainer.watchdog import FAILURE_PREFIX, HangWatchdog


def test_the_platform_reads_the_reasons_the_program_writes():
    assert (RuleTriggered.__name__, FAILURE_PREFIX) == (RULE_TRIGGERED, HUNG_COLLECTIVE)
    error = RuleTriggered("loss_spike at step 12: loss 55.9 is above 3 x its running mean 6.1")
    written = f"{type(error).__name__}: {error}"  # what training_jobs/train.py records
    assert program_failure(f"AlgorithmError: {written}") == RULE_TRIGGERED
    watchdog = HangWatchdog(20.0, Path("/opt/ml/output/data"), 3, "algo-2")
    hang = watchdog.reason(Path("/opt/ml/output/data/hang/rank_00003.txt"))
    assert program_failure(f"AlgorithmError: {hang}") == HUNG_COLLECTIVE
    assert hang.startswith("HungCollective: nothing finished for 20 minutes on rank 3 (host algo-2)")


def test_other_reasons_are_nobody_elses_business():
    for reason in (None, "", "AlgorithmError: ExecuteUserScriptError: exit code 1",
                   "AlgorithmError: DivergenceError: the loss is nan at step 12"):
        assert program_failure(reason) is None and meaning(reason) is None
    assert "not retried" in meaning(f"AlgorithmError: {RULE_TRIGGERED}: throughput_drop at step 9")
