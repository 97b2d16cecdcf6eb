"""Corpus cases that fail today, by kind (all its commands) or by kind and command, each with the
item of issue 14 whose fix will make it pass. `all_kinds()` turns them into strict xfail marks: a case
fixed by a later change fails until its line here is removed. Filled in from a run of the corpus (on the
restructured core: `ckptflow/formats/`, the step packages, `plumbing/`)."""

from __future__ import annotations

XFAIL: dict[str, str | dict[str, str]] = {
    "manifests/manifest-hundred-megabytes": "issue 14 (4): RecursionError traceback from ckptflow/publish/manifest.py from_json",
    "manifests/manifest-nested-deep": "issue 14 (4): RecursionError traceback from ckptflow/publish/manifest.py from_json",
    "manifests/manifest-special-file": "issue 14 (7): hangs (killed at the time limit)",
    "manifests/manifest-stamp-not-an-object": "issue 14 (new, bad manifests): TypeError traceback from ckptflow/publish/store.py adopt",
    "manifests/partial-record-nested-deep": "issue 14 (4): RecursionError traceback from ckptflow/publish/store.py parse",
    "manifests/partial-record-odd-entries": "issue 14 (new, bad manifests): AttributeError traceback from ckptflow/publish/checksums.py stamps_match",
    "manifests/partial-record-special-file": "issue 14 (7): hangs (killed at the time limit)",
    "pushsrc/card-config-dev-zero": "issue 14 (7): hangs (killed at the time limit)",
    "pushsrc/card-config-fifo": "issue 14 (7): hangs (killed at the time limit)",
    "pushsrc/card-config-nested-deep": "issue 14 (1): RecursionError traceback from ckptflow/publish/hub.py _read_json",
    "pushsrc/provenance-nested-deep": "issue 14 (1): RecursionError traceback from ckptflow/publish/hub.py _read_json",
    "pushsrc/provenance-source-not-an-object": "issue 14 (1): AttributeError traceback from ckptflow/publish/hub.py model_card",
    "pushsrc/safetensors-entry-not-an-object": {
        "push-hf": "issue 14 (1): TypeError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-header-2-60": {
        "push-hf": "issue 14 (1): MemoryError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-header-list": {
        "push-hf": "issue 14 (1): AttributeError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-header-over-100mb": {
        "push-hf": "issue 14 (1): accepted: exits 0",
    },
    "pushsrc/safetensors-header-past-end": {
        "push-hf": "issue 14 (1): accepted: exits 0",
    },
    "pushsrc/safetensors-lfs-pointer": {
        "push-hf": "issue 14 (1): MemoryError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-nested-deep": {
        "push-hf": "issue 14 (1): RecursionError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-not-utf8": {
        "push-hf": "issue 14 (1): accepted: exits 0",
    },
    "pushsrc/safetensors-shape-missing": {
        "push-hf": "issue 14 (1): KeyError traceback from ckptflow/publish/hub.py _count_safetensors_parameters",
    },
    "pushsrc/safetensors-shape-string": {
        "push-hf": "issue 14 (1): TypeError traceback from ckptflow/plumbing/sizes.py element_count",
    },
    "pushsrc/safetensors-short": {
        "push-hf": "issue 14 (1): accepted: exits 0",
    },
    "pushsrc/src-dangling-symlink": {
        "push-hf": "issue 14 (7): FileNotFoundError traceback from ckptflow/publish/hub.py _sha256",
    },
    "pushsrc/src-dev-zero": {
        "push": "issue 14 (7): File too large under the harness's limits, not the input checked",
        "push-hf": "issue 14 (7): hangs (killed at the time limit)",
    },
    "pushsrc/src-fifo": "issue 14 (7): hangs (killed at the time limit)",
    "pushsrc/src-fifo-in-subfolder": "issue 14 (7): hangs (killed at the time limit)",
    "sources/truncated-while-mapped": "issue 14 (9): killed by SIGBUS",
}
