"""What the benchmarks share: timing a subprocess, and benchmarks/RESULTS.md, where each benchmark owns
one `## Section` and replaces only that."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def compile_sources() -> None:
    """Byte-compile ckptflow (and the flows and tasks) into `__pycache__`, as installing a wheel does.

    A checkout run with PYTHONDONTWRITEBYTECODE set (this machine sets it) compiles every module of
    ckptflow from source in each process, about 0.1 s of a CLI run that an installed ckptflow does not
    spend; Python still reads bytecode that exists, so this once makes the timed runs an install's."""
    import compileall

    for package in ("ckptflow", "flows", "tasks"):
        compileall.compile_dir(str(REPO_ROOT / package), quiet=1)


def run_measured(command: list[str], *, env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds) of one subprocess run under /usr/bin/time. A process
    that prints a line `WORK_SECONDS=<s>` reports the wall time of its work alone (imports excluded)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as timing:
        started = time.monotonic()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M %U %S", "-o", timing.name, *command], cwd=REPO_ROOT,
                              env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout.decode()[-3000:]}")
        rss_kb, user, system = timing.read().strip().splitlines()[-1].split()
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("WORK_SECONDS="):
            seconds = float(line.split("=", 1)[1])
    return seconds, int(rss_kb) * 1024, float(user) + float(system)


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
