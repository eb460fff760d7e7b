"""AWS sessions for the CLI, and AWS failures turned into messages a person can act on.

Every cloud command makes its session with `aws_session` and calls AWS inside `explained` (or lets
the CLI's last resort, `explain`, translate what escapes): an unknown profile, missing credentials,
no network, credentials AWS refused and a denied action each get their own message, never a
traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    SSOError,
    TokenRetrievalError,
)

from llmtrain.core.errors import ENGINEER_POLICY_HINT, LlmtrainError

# Error codes AWS answers when it does not accept the credentials themselves.
REFUSED_CREDENTIALS = frozenset(
    {
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "AuthFailure",
        "InvalidAccessKeyId",
        "RequestExpired",
    }
)
ACCESS_DENIED = frozenset({"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "Forbidden"})
_CONFIGURE = "`aws configure`, `aws sso login` or AWS_PROFILE"


class AwsAccessError(LlmtrainError):
    """AWS could not be used as asked; the message says what to do."""


def aws_session(profile: str | None = None) -> boto3.Session:
    """A session for `profile` (default: the usual chain: AWS_PROFILE, environment, config files)."""
    try:
        return boto3.Session(profile_name=profile)
    except ProfileNotFound as error:
        raise explain(error) from error


def session_region(session: boto3.Session, region: str | None) -> str:
    """`region` if given, else the session's (AWS_DEFAULT_REGION, the profile's), else AWS_REGION
    (which the other AWS SDKs and the AWS CLI v2 read, and botocore does not)."""
    chosen = region or session.region_name or os.environ.get("AWS_REGION")
    if not chosen:
        raise AwsAccessError(
            "no AWS region: pass --region (the region the environment is deployed in) or set AWS_REGION"
        )
    return chosen


def caller_identity(session: boto3.Session, region: str) -> dict[str, Any]:
    """STS GetCallerIdentity: the cheapest call that proves the credentials work."""
    with explained("checking your AWS credentials"):
        return session.client("sts", region_name=region).get_caller_identity()


@contextmanager
def explained(doing: str) -> Iterator[None]:
    """Re-raise botocore's exceptions as AwsAccessError messages that say what to do."""
    try:
        yield
    except (BotoCoreError, ClientError) as error:
        raise explain(error, doing) from error
    except S3UploadFailedError as error:
        # boto3's transfer manager replaces S3's own error (AccessDenied, ...) with this one.
        cause = error.__context__
        raise explain(cause if isinstance(cause, BotoCoreError | ClientError) else error, doing) from error


def explain(error: Exception, doing: str = "") -> AwsAccessError:
    """The message for one of botocore's exceptions (see the module docstring)."""
    where = f"{doing}: " if doing else ""
    if isinstance(error, ProfileNotFound):
        return AwsAccessError(
            f"AWS profile {error.kwargs.get('profile')!r} is not configured (no such profile in "
            "~/.aws/config "
            "or ~/.aws/credentials): check AWS_PROFILE / --profile, or create it with "
            "`aws configure --profile NAME` or `aws configure sso`"
        )
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return AwsAccessError(f"{where}no AWS credentials found: configure them ({_CONFIGURE}) and try again")
    if isinstance(error, SSOError | TokenRetrievalError):
        return AwsAccessError(
            f"{where}your AWS SSO session has expired or is missing: run `aws sso login` ({error})"
        )
    if isinstance(error, NoRegionError):
        return AwsAccessError(f"{where}no AWS region: pass --region or set AWS_REGION")
    if isinstance(error, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError):
        return AwsAccessError(
            f"{where}cannot reach AWS ({error}): check your network connection, proxy (HTTPS_PROXY) and "
            "the region; your credentials were not checked"
        )
    if isinstance(error, ClientError):
        return _explain_client_error(error, where)
    return AwsAccessError(f"{where}{error}")


def _explain_client_error(error: ClientError, where: str) -> AwsAccessError:
    code = error.response.get("Error", {}).get("Code", "")
    message = error.response.get("Error", {}).get("Message", "")
    if code in REFUSED_CREDENTIALS:
        return AwsAccessError(
            f"{where}AWS refused your credentials ({code}: {message}): they are wrong or expired; "
            f"refresh them ({_CONFIGURE}) and try again"
        )
    if code in ACCESS_DENIED:
        return AwsAccessError(f"{where}access denied ({message or code}); {ENGINEER_POLICY_HINT}")
    return AwsAccessError(f"{where}{code}: {message}")
