"""Every error ckptflow raises on purpose.

Each one subclasses a builtin so callers can catch it the way they already do, carries a stable
`code` (what a program branches on: never the message text or the class name) and the fields a
program needs (uri, file, rank, tensor, expected, actual), and renders a one-line message that says
what is wrong, where, what was expected and what to do.

A class gives its errors a default code; a raise may name a finer one (`code="rank-missing"`).

A message that tells the reader to set an option names it by the core's own word for it, its keyword
in the Python API: `option("tag")`. How that reads is the entry point's choice (`naming`): the command
line spells it as its flag (`--tag`), the Prefect tasks as the form field's title, and a Python caller
sees the keyword in backquotes (`tag`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

_NAMES: ContextVar[Mapping[str, str]] = ContextVar("ckptflow_option_names", default={})


def option(name: str) -> str:
    """The option the core calls `name` (its Python keyword), as the reader of this message knows it."""
    return _NAMES.get().get(name) or f"`{name}`"


@contextmanager
def naming(names: Mapping[str, str]) -> Iterator[None]:
    """Messages made inside (on this thread, and on threads that copy its context) name options as
    `names` spells them: keyword -> what the reader types or sees."""
    token = _NAMES.set(names)
    try:
        yield
    finally:
        _NAMES.reset(token)


class CkptflowError(Exception):
    """Base of every error raised on purpose. `str(err)` is the one line a user reads."""

    default_code: ClassVar[str] = "error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        uri: str | None = None,
        file: str | None = None,
        rank: int | None = None,
        tensor: str | None = None,
        expected: object = None,
        actual: object = None,
        hint: str | None = None,
    ) -> None:
        self.code = code or self.default_code
        self.uri = uri
        self.file = file
        self.rank = rank
        self.tensor = tensor
        self.expected = expected
        self.actual = actual
        self.hint = hint
        super().__init__(f"{message}; {hint}" if hint else message)

    def to_dict(self) -> dict[str, Any]:
        """The error as plain data: code, message and the fields that are set."""
        fields = {"uri": self.uri, "file": self.file, "rank": self.rank, "tensor": self.tensor}
        return {"code": self.code, "message": str(self), **{k: v for k, v in fields.items() if v is not None}}


class CheckpointError(CkptflowError, ValueError):
    """The checkpoint is not what it must be (missing rank, wrong count, inconsistent metadata)."""

    default_code = "checkpoint-invalid"


class CheckpointNotFoundError(CkptflowError, FileNotFoundError):
    """A file or folder the checkpoint needs does not exist."""

    default_code = "not-found"


class UnsafePickleError(CheckpointError):
    """A checkpoint pickle names a global outside the allow-list; nothing from it was executed."""

    default_code = "unsafe-pickle"


class CorruptFileError(CheckpointError):
    """A file cannot be parsed: truncated, empty, not a torch archive, or inconsistent inside."""

    default_code = "corrupt-file"


class UnsafeInputError(CheckpointError):
    """An input file ckptflow will not read: not a regular file (a FIFO, a device, a folder, a link to
    nothing or out of its folder), larger than a file of its kind can be, or nested too deeply."""

    default_code = "unsafe-input"


class UnsupportedCheckpointError(CheckpointError):
    """The checkpoint is valid but uses a DeepSpeed layout ckptflow cannot convert (e.g. elastic ZeRO-1/2)."""

    default_code = "unsupported-layout"


class ConfigError(CkptflowError, ValueError):
    """The model config given to go with a checkpoint cannot be used: not found, unreadable, or it does not
    describe the checkpoint's tensors (codes `config-not-found`, `config-unreadable`, `config-mismatch`)."""

    default_code = "config-invalid"


class OutputError(CkptflowError, OSError):
    """The output cannot be written (exists already, not enough space, destination refused)."""

    default_code = "output-error"


class PublishError(CkptflowError, OSError):
    """A push failed for good: a permanent error, or transient errors past the retry budget."""

    default_code = "publish-failed"


class UploadSessionError(CkptflowError, OSError):
    """A resumable upload's session broke (out of sync with the store after a lost response, or gone):
    that file's upload starts over with a new session; a transient failure (`plumbing.retry`)."""

    default_code = "upload-session-broken"


class VerificationError(CkptflowError, ValueError):
    """Something written does not match its source."""

    default_code = "verification-failed"


class UploadMismatchError(VerificationError):
    """An object just uploaded reads back different from its source; uploading it again may fix it."""

    default_code = "upload-mismatch"


class SourceReadError(CkptflowError, OSError):
    """A checkpoint file could not be read during a conversion (store error, file changed underneath)."""

    default_code = "unreadable-file"


class ClusterError(CkptflowError, ConnectionError):
    """The Dask cluster the units were to run on cannot be used (not installed, not reachable)."""

    default_code = "cluster-unreachable"
