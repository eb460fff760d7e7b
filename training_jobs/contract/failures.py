"""The failure reasons of the training program that the platform acts on.

The program writes why it failed into output/failure as `<Kind>: <message>`; SageMaker reports it as
the job's FailureReason, after "AlgorithmError: ". Two kinds say more than "the job failed"
(docs/training.md, "Rules"); the program raises and writes them by these names, and the platform
(llmtrain.core.program_failures, llmtrain.core.failures) reads them by the same objects.
"""

# A rule of the program (trainer/rules.py) stopped the run: the class name of trainer/errors.py's
# RuleTriggered, which the entry point records as "<class name>: <message>".
RULE_TRIGGERED = "RuleTriggered"
# The hang watchdog (trainer/watchdog.py) ended a job whose collectives stopped completing.
HUNG_COLLECTIVE = "HungCollective"
# The exit status of a rank the hang watchdog ended (torchrun then tears the job down).
HANG_EXIT_CODE = 75
