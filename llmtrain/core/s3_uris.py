"""S3 URIs as the platform accepts them: one parser for the CLI's checks, `render` and the launcher.

A team may read only under its datasets prefix, and IAM grants that prefix as a string
(`teams/<team>/*`). A URI whose key says more than its characters (`teams/a/../b/`, `./`, `%2e%2e`,
a trailing space, an empty segment) matches that string while a client that normalises paths reads
elsewhere. So a URI whose key could mean two things is refused, naming what to fix, rather than
rewritten: the key is a plain path of segments, none of them `.` or `..`, none empty but the last
(a prefix ends with `/`), with no percent sign, backslash, `?`, `#`, whitespace or control character.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from llmtrain.core.errors import shown_value

S3_SCHEME = "s3://"
# S3's bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, a letter or digit at
# both ends, no two dots in a row.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
# Characters that a client or a proxy may decode, translate or drop before S3 sees the key.
_AMBIGUOUS = {"%": "a percent sign (percent-encoding such as %2e is not decoded: write the characters "
                   "themselves)",
              "\\": "a backslash (some clients read it as '/')",
              "?": "a '?' (the start of a query in a URL)",
              "#": "a '#' (the start of a fragment in a URL)"}


class S3UriError(ValueError):
    """A string is not an S3 URI the platform accepts; the message says what to fix."""


@dataclass(frozen=True)
class S3Location:
    """A bucket and a key (a prefix when it ends with '/'), both checked by `parse_s3_uri`."""

    bucket: str
    key: str

    @property
    def uri(self) -> str:
        return f"{S3_SCHEME}{self.bucket}/{self.key}"

    def within(self, prefix: S3Location) -> bool:
        """Whether this location lies under `prefix` (a prefix ending with '/', or the bucket)."""
        return self.bucket == prefix.bucket and self.key.startswith(prefix.key)


def parse_s3_uri(text: object) -> S3Location:
    """`s3://bucket/key` as an `S3Location`; S3UriError naming the problem otherwise."""
    if not isinstance(text, str) or not text.startswith(S3_SCHEME):
        raise S3UriError(f"{_quoted(text)} must be an S3 URI such as s3://bucket/prefix/")
    _refuse_hidden_characters(text)
    bucket, _, key = text[len(S3_SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise S3UriError(
            f"{_quoted(text)}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.' and '-')"
        )
    for character, why in _AMBIGUOUS.items():
        if character in key:
            raise S3UriError(f"{_quoted(text)} holds {why}; S3 keys of the platform are plain paths")
    segments = key.split("/")
    for index, segment in enumerate(segments):
        if segment in (".", ".."):
            raise S3UriError(
                f"{_quoted(text)} holds the path segment {segment!r}: S3 keeps it as written while "
                "other clients resolve it; write the prefix without '.' and '..' segments"
            )
        if segment == "" and index < len(segments) - 1:
            raise S3UriError(
                f"{_quoted(text)} holds an empty path segment ('//' or a '/' right after the bucket): "
                "write each '/' once"
            )
    return S3Location(bucket, key)


def _quoted(text: object) -> str:
    return shown_value(text, 80)


def _refuse_hidden_characters(text: str) -> None:
    for position, character in enumerate(text):
        if character.isspace() or unicodedata.category(character) in ("Cc", "Cf", "Zl", "Zp"):
            raise S3UriError(
                f"{_quoted(text)} holds {unicodedata.name(character, f'U+{ord(character):04X}')} at "
                f"position {position}: S3 URIs of the platform hold no whitespace or control characters; "
                "remove it (check for a trailing space or a copied line break)"
            )
