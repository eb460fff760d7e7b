"""Validation helpers shared by the constructs: props errors name the construct and the field."""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import ipaddress
import types
import typing
from typing import Any, TypeVar

from aws_cdk import Token

from llmtrain.core.errors import did_you_mean
from llmtrain.core.instances import KNOWN_INSTANCE_TYPES
from llmtrain.core.platform import MAX_JOB_NAME_PREFIX, is_job_name_prefix

T = TypeVar("T")


class PropsError(ValueError):
    """A construct was given invalid props; raised at synth, naming the construct and the field."""


def require(condition: bool, construct: str, field: str, message: str) -> None:
    """Raise PropsError as ``Construct(field=...): message`` unless ``condition`` holds."""
    if not condition:
        raise PropsError(f"{construct}({field}=...): {message}")


def checked_props(construct: str, props: object, expected: type[T]) -> T:
    """``props`` when it is an ``expected`` record (each validated itself when built)."""
    got = type(props).__name__
    require(isinstance(props, expected), construct, "props", f"must be a {expected.__name__}, got {got}")
    return props


# The annotations that mean "several of something": a field typed so holds a tuple once validated.
_SEQUENCE_ORIGINS = (collections.abc.Sequence, tuple, list)


def freeze_sequences(construct: str, record: Any) -> None:
    """Store every sequence-typed field of the frozen dataclass ``record`` (``Sequence[...]``,
    ``tuple[...]``, ``list[...]``, optionally ``| None``) as a tuple, first refusing a value that is
    not a list or tuple of items: a str would otherwise be taken apart character by character
    (``availability_zones="us-west-2a,us-west-2b"`` becoming ``('u', 's', ...)``)."""
    for name, optional in _sequence_fields(type(record)).items():
        value = getattr(record, name)
        if value is None and optional:
            continue
        hint = ' (one item per element: ["a", "b"], not "a,b")' if isinstance(value, str) else ""
        require(
            isinstance(value, collections.abc.Iterable)
            and not isinstance(value, str | bytes | collections.abc.Mapping),
            construct,
            name,
            f"must be a list or tuple, got the {type(value).__name__} {value!r}{hint}",
        )
        object.__setattr__(record, name, tuple(value))


@functools.cache
def _sequence_fields(record_type: type) -> dict[str, bool]:
    """The record's sequence-typed fields, each with whether it may be None."""
    hints = typing.get_type_hints(record_type)
    found = {}
    for field in dataclasses.fields(record_type):
        hint = hints[field.name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = typing.get_args(hint) if is_union else (hint,)
        kinds = [typing.get_origin(member) or member for member in members if member is not type(None)]
        if kinds and all(kind in _SEQUENCE_ORIGINS for kind in kinds):
            found[field.name] = type(None) in members
    return found


def is_whole_number(value: object) -> bool:
    """An int that is not a bool (``True`` is an int in Python, never a count of anything here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_unresolved(value: object) -> bool:
    """True for a CDK token (a value CloudFormation fills in at deploy time)."""
    return isinstance(value, str) and Token.is_unresolved(value)


def check_cidr(construct: str, field: str, cidr: str) -> ipaddress.IPv4Network | None:
    """Validate an IPv4 CIDR block given as a literal (tokens are accepted as they are)."""
    if is_unresolved(cidr):
        return None
    try:
        network = ipaddress.IPv4Network(cidr, strict=True)
    except ValueError as error:
        raise PropsError(
            f"{construct}({field}=...): {cidr!r} is not an IPv4 network CIDR block "
            f"({error}); e.g. 10.20.0.0/16"
        ) from error
    require(
        16 <= network.prefixlen <= 24,
        construct,
        field,
        f"prefix /{network.prefixlen} is out of range: use /16 to /24",
    )
    return network


def check_job_name_prefix(construct: str, prefix: str) -> None:
    """The prefix of every job name the platform starts (one rule: llmtrain.core.platform)."""
    require(
        is_job_name_prefix(prefix),
        construct,
        "job_name_prefix",
        f"{prefix!r} must be 1-{MAX_JOB_NAME_PREFIX} lowercase letters, digits and hyphens "
        "(SageMaker lowercases job names in ARNs, where the IAM policies match the prefix)",
    )


def check_instance_types(construct: str, field: str, types: object) -> None:
    """A non-empty list of SageMaker instance types the platform knows (it renders and plans runs
    only on those): a mistyped one fails the synth, naming its nearest match."""
    require(
        isinstance(types, tuple | list) and len(types) > 0,
        construct,
        field,
        f"must list SageMaker instance types such as ml.g5.12xlarge, got {types!r}",
    )
    known = KNOWN_INSTANCE_TYPES
    unknown = [f"{t!r} is not an instance type the platform knows{did_you_mean(str(t), known)}"
               for t in types if t not in known]
    require(not unknown, construct, field, "; ".join(unknown) + f" (known: {', '.join(sorted(known))})")
