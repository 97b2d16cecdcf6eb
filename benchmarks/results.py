"""benchmarks/RESULTS.md: each benchmark owns one `## Section` and replaces only that."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, lines: list[str]) -> None:
    """Replace (or append) `section` (e.g. "## Reshard") of RESULTS.md, leaving other sections alone."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n\n"
    body = "\n".join(lines).rstrip() + "\n"
    start = text.find(section + "\n")
    if start < 0:
        text = text.rstrip() + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(section))
        text = text[:start] + body + ("\n" + text[end + 1:] if end >= 0 else "")
    RESULTS.write_text(text)
