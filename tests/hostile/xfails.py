"""Corpus cases that fail today, by kind (all its commands) or by kind and command, each with the
item of issue 14 whose fix will make it pass. `all_kinds()` turns them into strict xfail marks: a case
fixed by a later change fails until its line here is removed. Filled in from a run of the corpus (on the
restructured core: `ckptflow/formats/`, the step packages, `plumbing/`)."""

from __future__ import annotations

XFAIL: dict[str, str | dict[str, str]] = {
}
