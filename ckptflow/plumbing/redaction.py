"""Keep credentials out of every message, log line and artifact ckptflow writes.

`redact(text)` replaces what looks like a credential (Hub tokens, bearer headers, signed-URL query
parameters, passwords in URLs, AWS key ids) and the values of the usual credential variables of the
environment with `***`. Every text built from a third-party exception goes through it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ckptflow.plumbing.text import plain

MASK = "***"

# Environment variables whose values are secrets wherever they show up.
SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    "FSSPEC_S3_SECRET",
    "FSSPEC_S3_TOKEN",
)

_PATTERNS = (
    # Hugging Face tokens.
    (re.compile(r"\bhf_[A-Za-z0-9]{8,}"), MASK),
    # Authorization headers and bearer tokens, in reprs of header dicts too.
    (re.compile(r"(?i)(bearer\s+)[^\s'\",}]+"), rf"\1{MASK}"),
    (
        re.compile(
            r"(?i)(['\"]?(?:authorization|x-amz-security-token|x-goog-api-key)['\"]?\s*[:=]\s*['\"]?)"
            r"(?:(?:bearer|basic|token)\s+)?[^\s'\",}]+"
        ),
        rf"\1{MASK}",
    ),
    # Signed URLs and token query parameters.
    (
        re.compile(
            r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential"
            r"|signature|sig|token|access_token|key|upload_token)=)[^&\s'\"]+"
        ),
        rf"\1{MASK}",
    ),
    # user:password@ in URLs.
    (re.compile(r"(?i)([a-z][a-z0-9+.-]*://)[^/@\s:]+:[^/@\s]+@"), rf"\1{MASK}@"),
    # AWS access key ids.
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), MASK),
)


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """`text` with credentials replaced by `***`: the given `secrets`, those of the environment, and
    anything that looks like one."""
    known = [s for s in (*secrets, *(os.environ.get(name) for name in SECRET_ENV_VARS)) if s and len(s) >= 6]
    for secret in sorted(set(known), key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def describe(exc: BaseException, secrets: Iterable[str | None] = ()) -> str:
    """One redacted line naming `exc`: its type and the first line of its message, control characters
    escaped (`plumbing.text.plain`)."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    text = f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
    return plain(redact(text[:300], secrets))
