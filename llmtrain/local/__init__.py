"""`llmtrain run --local`: run a rendered CreateTrainingJob request on this machine as SageMaker would.

job            the request -> the local job that runs here (`LocalJob`: scaled down, every change recorded)
jobroot        each emulated host's job root, laid out like /opt/ml
toolkit        the SageMaker training toolkit, one process per host; stopping like StopTrainingJob
metric_lines   the template's MetricDefinitions applied to the log
display        the log and progress in the terminal
report         summary.json (DescribeTrainingJob's shape), the plot, the terminal summary
runner         all of the above, in order
trials         `llmtrain tune --local`: Optuna's trials, each a local run
"""

from llmtrain.local.job import LocalLimits, LocalRunError
from llmtrain.local.runner import EXIT_CODES, LocalRunOptions, RunAlreadyTrained, next_attempt, run_local

__all__ = ["EXIT_CODES", "LocalLimits", "LocalRunError", "LocalRunOptions", "RunAlreadyTrained",
           "next_attempt", "run_local"]
