"""What an exception says about a failed request: the chain it was raised from, and its HTTP status code.

`status_code(exc)` reads the code the way each client library carries it (gcsfs `HttpError.code`,
aiohttp `ClientResponseError.status`, botocore `ClientError.response`, requests / httpx /
`HfHubHTTPError` `.response.status_code`). `plumbing.retry` judges failures with them, and each store
(`plumbing.stores`) its broken upload sessions.
"""

from __future__ import annotations

from collections.abc import Iterator


def status_code(exc: BaseException) -> int | None:
    """The HTTP status code carried by `exc` itself, or None."""
    for value in (getattr(exc, "code", None), getattr(exc, "status", None)):
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return value if isinstance(value, int) else None
    if response is not None:  # requests, httpx, HfHubHTTPError
        value = getattr(response, "status_code", None)
        return value if isinstance(value, int) else None
    return None


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during, outermost first (cycles cut)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        if link.__cause__ is not None:
            link = link.__cause__
        else:
            link = None if link.__suppress_context__ else link.__context__
