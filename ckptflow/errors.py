"""Every error ckptflow raises on purpose.

Each one subclasses a builtin so callers can catch it the way they already do, carries the fields a
program needs (uri, file, rank, tensor, expected, actual) and renders a one-line message that says
what is wrong, where, what was expected and what to do.
"""

from __future__ import annotations


class CkptflowError(Exception):
    """Base of every error raised on purpose. `str(err)` is the one line a user reads."""

    def __init__(
        self,
        message: str,
        *,
        uri: str | None = None,
        file: str | None = None,
        rank: int | None = None,
        tensor: str | None = None,
        expected: object = None,
        actual: object = None,
        hint: str | None = None,
    ) -> None:
        self.uri = uri
        self.file = file
        self.rank = rank
        self.tensor = tensor
        self.expected = expected
        self.actual = actual
        self.hint = hint
        super().__init__(f"{message}; {hint}" if hint else message)


class CheckpointError(CkptflowError, ValueError):
    """The checkpoint is not what it must be (missing rank, wrong count, inconsistent metadata)."""


class CheckpointNotFoundError(CkptflowError, FileNotFoundError):
    """A file or folder the checkpoint needs does not exist."""


class UnsafePickleError(CheckpointError):
    """A checkpoint pickle names a global outside the allow-list; nothing from it was executed."""


class CorruptFileError(CheckpointError):
    """A file cannot be parsed: truncated, empty, not a torch archive, or inconsistent inside."""


class OutputError(CkptflowError, OSError):
    """The output cannot be written (exists already, not enough space, destination refused)."""


class PublishError(CkptflowError, OSError):
    """A push failed for good: a permanent error, or transient errors past the retry budget."""


class VerificationError(CkptflowError, ValueError):
    """Something written does not match its source."""


class UploadMismatchError(VerificationError):
    """An object just uploaded reads back different from its source; uploading it again may fix it."""


class SourceReadError(CkptflowError, OSError):
    """A checkpoint file could not be read during a conversion (store error, file changed underneath)."""


class UnsupportedCheckpointError(CheckpointError):
    """The checkpoint is valid but uses a DeepSpeed layout ckptflow cannot convert (e.g. elastic ZeRO-1/2)."""
