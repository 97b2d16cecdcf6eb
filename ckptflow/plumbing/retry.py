"""Which failures deserve another try, and the one retry loop that acts on that.

`is_transient(exc)` is a plain function of the exception, so Prefect can take it as a
`retry_condition_fn` as it is. It looks for an HTTP status code on the exception or anything it was
raised from (`plumbing.failures.status_code`: gcsfs `HttpError.code`, aiohttp
`ClientResponseError.status`, botocore `ClientError.response`, requests / httpx / `HfHubHTTPError`
`.response.status_code`) and decides by the code alone: 408, 429 and 5xx are transient, every other
code is not. Without a code, resets, dropped connections, truncated bodies and timeouts (of the HTTP
libraries here, and of each store's own client: `Store.connection_failures`) are transient; anything
else is not. Base classes say nothing here: `HfHubHTTPError` and gcsfs's 403 are both `OSError`s.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ckptflow.errors import CkptflowError, UploadMismatchError, UploadSessionError
from ckptflow.plumbing.failures import causes, status_code
from ckptflow.plumbing.stores import backends

logger = logging.getLogger(__name__)

T = TypeVar("T")

# 501 (Not Implemented) and 505 (HTTP Version Not Supported) do not get better with time.
_PERMANENT_5XX = frozenset({501, 505})

# Exception classes of the HTTP libraries that mean "the connection failed or timed out", by module;
# each store adds its own client's (`Store.connection_failures`). They are looked up only in modules
# already imported: an exception from a library exists only once it is imported.
_CONNECTION_FAILURES: dict[str, tuple[str, ...]] = {
    "http.client": ("IncompleteRead", "RemoteDisconnected"),
    "aiohttp": ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError"),
    "requests.exceptions": ("ConnectionError", "Timeout", "ChunkedEncodingError"),
    "urllib3.exceptions": ("ProtocolError", "TimeoutError", "NewConnectionError"),
    "httpx": ("TimeoutException", "NetworkError", "RemoteProtocolError"),
    "httpx2": ("TimeoutException", "NetworkError", "RemoteProtocolError"),
}


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently to retry one operation.

    Try `attempts` times in all; before try n+1 sleep a uniformly random time in
    [0, min(max_delay, base_delay * 2**(n-1))] seconds (exponential backoff with full jitter).
    """

    attempts: int = 6
    base_delay: float = 0.5
    max_delay: float = 20.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError(f"delays must be >= 0, got base {self.base_delay}, max {self.max_delay}")


def is_transient(exc: BaseException) -> bool:
    """True when trying the same operation again may succeed: 408, 429, 5xx, resets, timeouts.

    Never for 401, 403, 404 or any other 4xx, and never for ckptflow's own verdicts, except an upload
    that read back different from its source (`UploadMismatchError`) or whose resumable session broke
    (`UploadSessionError`), which a new upload may fix.
    """
    for link in causes(exc):
        if isinstance(link, CkptflowError):
            return isinstance(link, UploadMismatchError | UploadSessionError)
        code = status_code(link)
        if code is not None:
            return code in (408, 429) or (500 <= code < 600 and code not in _PERMANENT_5XX)
        if _is_connection_failure(link):
            return True
    return False


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy | None = None,
    *,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """`fn()`, tried up to `policy.attempts` times while it fails with a transient error.

    Between tries it sleeps with exponential backoff and full jitter (see `RetryPolicy`; the default
    policy when none is given). `on_retry(attempt, exc, delay)` is called before each sleep. A
    permanent error, or the last transient one, is raised as it is.
    """
    policy = policy or RetryPolicy()
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as exc:  # `is_transient` judges it; anything else is raised as it is
            if attempt >= policy.attempts or not is_transient(exc):
                raise
            delay = random.uniform(0.0, min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1)))
            logger.debug("try %d of %d failed (%s); retrying in %.2fs", attempt, policy.attempts,
                         type(exc).__name__, delay)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            time.sleep(delay)
            attempt += 1


def _is_connection_failure(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    for module_name, class_names in _connection_failures():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in class_names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and isinstance(exc, cls):
                return True
    return False


def _connection_failures() -> list[tuple[str, tuple[str, ...]]]:
    tables: list[Mapping[str, tuple[str, ...]]] = [_CONNECTION_FAILURES, *(s.connection_failures for s in backends())]
    return [item for table in tables for item in table.items()]
