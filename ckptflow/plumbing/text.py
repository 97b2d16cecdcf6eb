"""Text that came from the input, made safe to show: one line, no control characters, bounded.

Anything a message, a report, a log line or an artifact quotes from a checkpoint, a side file, a
manifest or a path goes through this module:

- `excerpt(value)` quotes a value for a message: a string between single quotes, cut to `limit`
  characters with the number of characters left out; bytes shown as text where they decode, else
  as "binary data"; numbers as they are unless they are too long to print (an integer of 5,000
  digits is "an integer of about 5001 digits"); a short list or tuple of numbers (a shape) as it is;
  other containers by their type and length, never by a full repr (a shared-reference "billion
  laughs" would take forever to print).
- `plain(text)` escapes what would act on a terminal or break a line (control characters, line and
  paragraph separators, bidirectional overrides, lone surrogates) as `\\xNN` / `\\uNNNN` and leaves
  everything else as it is: markup such as `[red]` or `:x:` and backslashes are printed as written,
  so what a user reads is what the input holds.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

EXCERPT_CHARS = 60
# Characters shown escaped: C0 and C1 controls and DEL (Cc), format characters such as bidirectional
# overrides and zero-width joiners (Cf), lone surrogates (Cs), line and paragraph separators.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_ASCII_SAFE = re.compile(r"[\x20-\x7e]*")


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def plain(text: str) -> str:
    """`text` with every control, format and separator character escaped (see the module docstring)."""
    if _ASCII_SAFE.fullmatch(text):
        return text
    return "".join(_escape(c) if unicodedata.category(c) in _ESCAPED_CATEGORIES else c for c in text)


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """`value` quoted for a one-line message, escaped and at most about `limit` characters long."""
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value[: limit * 4])
        text = raw.decode("utf-8", errors="replace")
        if "\ufffd" in text[:-1]:  # not UTF-8 (a character cut at the window's end does not count)
            return f"binary data ({len(value):,} bytes, starting {raw[:16].hex(' ')})"
        return _quoted(text.rstrip("\ufffd"), len(value), limit=limit, unit="bytes")
    if isinstance(value, str):
        return _quoted(value[: limit + 1], len(value), limit=limit)
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        if value.bit_length() <= 3 * limit:  # short enough to turn into digits cheaply
            digits = str(value)
            if len(digits) <= limit:
                return digits
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple | list) and len(value) <= 8 and all(_small_number(x) for x in value):
        return repr(list(value)) if isinstance(value, list) else repr(tuple(value))  # a shape, offsets
    if isinstance(value, tuple | list | dict | set | frozenset):
        return f"a {type(value).__name__} of {len(value)} item{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def _small_number(value: Any) -> bool:
    return (type(value) is int and value.bit_length() <= 64) or type(value) is float


def _quoted(text: str, total: int, *, limit: int, unit: str = "characters") -> str:
    shown = plain(text[:limit])
    if total <= limit:
        return f"'{shown}'"
    if unit == "characters":
        return f"'{shown}' (and {total - limit:,} more characters)"
    return f"'{shown}' ({total:,} bytes in all)"


def one_line(text: str, limit: int | None = None) -> str:
    """`text` as one line: runs of whitespace become one space, the rest as `plain`; cut to `limit`
    characters (with an ellipsis) when given."""
    line = plain(" ".join(text.split()))
    if limit is not None and len(line) > limit:
        return line[: limit - 1] + "…"
    return line


__all__ = ["EXCERPT_CHARS", "excerpt", "one_line", "plain"]


def and_more(count: int, noun: str, *, then: str = "") -> str:
    """What follows the first few of several things named in a message: ' (and 2 more problems; run
    `ckptflow validate SRC`)' for `count` 2, `noun` 'problem' and `then` 'run ...'; '' when `count` is 0."""
    if count <= 0:
        return ""
    return f" (and {count} more {noun}{'s' if count != 1 else ''}{f'; {then}' if then else ''})"
