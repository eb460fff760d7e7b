"""Error types of the job-template model.

Every message names the offending setting and says what to do about it, because these messages
reach people through the CLI, the launcher's failed executions and synth errors.
"""

from __future__ import annotations

import difflib

# What an AWS refusal of an ML engineer's call means (the CLI's messages and the record's reader).
ENGINEER_POLICY_HINT = (
    "ML engineers need their team's engineers' policy (output Team<Name>EngineerPolicyArn of the access "
    "stack)"
)


def shown_value(value: object, longest: int = 60) -> str:
    """A value as an error message quotes it: enormous inputs are cut, not echoed whole."""
    text = repr(value)
    return text if len(text) <= longest else f"{text[:longest]}... ({len(text)} characters)"


class LlmtrainError(Exception):
    """Base class: bad input or state that the user can fix (the CLI exits 2 on these)."""


class LauncherStateError(Exception):
    """What a launcher function was given is not what it expects (a deployment bug, not bad input):
    a state from another deployment's state machine, or settings its construct did not write."""


class TemplateSpecError(LlmtrainError):
    """A template YAML file is malformed (unknown key, wrong type, inconsistent settings)."""

    def __init__(self, source: str, problem: str):
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class TemplateNotFoundError(LlmtrainError):
    """The requested template name or version is not in the catalog."""


class OverrideError(LlmtrainError):
    """A run tried to override a setting its template does not allow, or with a bad value."""

    def __init__(self, setting: str, problem: str):
        super().__init__(f"override '{setting}': {problem}")
        self.setting = setting
        self.problem = problem


class RunInputError(LlmtrainError):
    """A run's own input (run name, attempt, owner) is malformed."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"run input '{field}': {problem}")
        self.field = field
        self.problem = problem


def where_set(*, props: str, config: str) -> str:
    """Where a platform team sets a value: these messages reach deployments made with the construct
    library (whose settings are construct props) and with this repository (config/<env>.yaml)."""
    return f"{props} in a CDK app of llmtrain-constructs; {config} in the platform's config/<env>.yaml"


class TeamLimitError(LlmtrainError):
    """A run asks for more than its team may use (a template, instance type or instance count)."""

    def __init__(self, team: str, limit: str, problem: str):
        super().__init__(
            f"team {team!r}: {problem}; the platform team sets the team's {limit} "
            f"({where_set(props=f'TeamSpec.{limit}', config=f'teams.{team}.{limit}')})"
        )
        self.team = team
        self.limit = limit
        self.problem = problem


class RequestValidationError(LlmtrainError):
    """The rendered CreateTrainingJob request breaks SageMaker's rules or the platform's."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        listing = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the training job request is invalid:\n{listing}")


class ProgramSettingError(LlmtrainError):
    """A run's hyperparameters break the training program's own rules (an unknown name, a wrong type,
    a value out of bounds, a combination it refuses, degrees that do not fit the cluster); the
    message is the program's."""

    def __init__(self, problem: str):
        super().__init__(f"the training program refuses this run: {problem}")
        self.problem = problem


class LockError(LlmtrainError):
    """A published template version no longer matches the content hash in the catalog lock."""


class PlatformContextError(LlmtrainError):
    """The platform context (role, buckets, network) is incomplete or malformed."""


class SourceDirError(LlmtrainError):
    """The code a template wraps cannot be packaged (missing folder or entry point)."""


def did_you_mean(name: str, choices) -> str:
    """' (did you mean 'x'?)' naming the closest of `choices` to a misspelled `name`, or ''."""
    close = difflib.get_close_matches(name, [str(choice) for choice in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
