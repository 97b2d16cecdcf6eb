"""Publish a folder to the Hugging Face Hub as one commit.

`push_to_hub(src, "hf://ORG/REPO")` creates the repo when it is missing, writes a model card
(README.md) from the provenance record when the folder has none, and commits every file in one
commit on the given revision through `huggingface_hub.HfApi`. The endpoint and token come from the
arguments, else `HF_ENDPOINT` and `HF_TOKEN`, else the Hub's token file.

huggingface_hub retries single requests but not its commit call, so the whole commit is retried on
transient failures (408, 429, 5xx, resets, timeouts). A retry or a re-run sends only what the Hub
lacks: the preupload step drops files that did not change, and the LFS batch step skips blobs the
Hub already stores, including those uploaded by a try that failed before its commit.

What the Hub would refuse (a file over its size limit, a folder over its entry limit, counting what
the revision holds already) is refused before anything is sent. The push stays one `create_commit`:
huggingface_hub 2.x's `upload_folder` streams through Xet in several commits for large folders, so a
reader could see half a model; `create_commit` sends the same files through Xet (when the Hub offers
it and hf_xet is installed) and commits them at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.errors import CkptflowError, PublishError
from ckptflow.formats.hf import PROVENANCE_NAME, read_safetensors_header
from ckptflow.plumbing.checksums import Digests
from ckptflow.plumbing.failures import causes, status_code
from ckptflow.plumbing.files import load_json, open_regular, read_regular
from ckptflow.plumbing.progress import Progress, Tally
from ckptflow.plumbing.redaction import describe, redact
from ckptflow.plumbing.retry import RetryPolicy, is_transient, retry_call
from ckptflow.plumbing.storage import open_fs
from ckptflow.plumbing.stores import hub as hub_store
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt, one_line
from ckptflow.publish.source import PushResult, SourceFile, list_source

logger = logging.getLogger(__name__)

_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_HUB_URL = re.compile(r"^hf://(?:(models|datasets|spaces)/)?([\w.-]+/[\w.-]+)(?:@([^/]+))?/?$")

# What the Hub refuses, from its "Repository limitations and recommendations" (hub-docs,
# docs/hub/storage-limits.md): "no single file will exceed 500GB" and "the maximum number of files per
# folder cannot exceed 10k" (its table: entries per folder < 10k). Its < 100k files per repo is a
# recommendation only: logged, not refused. These belong with the Hub store's traits
# (ckptflow/plumbing/stores/hub.py).
HUB_MAX_FILE_BYTES = 500 * 1000**3
HUB_MAX_FOLDER_ENTRIES = 10_000
HUB_RECOMMENDED_REPO_FILES = 100_000


@dataclass(frozen=True, kw_only=True)
class HubTarget:
    """A repo on the Hub: `hf://[datasets/|spaces/]ORG/REPO[@REVISION]`."""

    repo_type: str
    repo_id: str
    revision: str | None = None

    @classmethod
    def parse(cls, url: str) -> HubTarget:
        match = _HUB_URL.match(url)
        if match is None:
            raise ValueError(
                f"not a Hub repo URL: {redact(url)!r}; expected hf://ORG/REPO, hf://datasets/ORG/REPO "
                "or hf://ORG/REPO@REVISION"
            )
        kind, repo_id, revision = match.groups()
        return cls(repo_type=_REPO_TYPES[kind or "models"], repo_id=repo_id, revision=revision)


def push_to_hub(
    src: str,
    dest: str,
    *,
    revision: str | None = None,
    private: bool = False,
    workers: int = 8,
    token: str | None = None,
    endpoint: str | None = None,
    progress: Progress | None = None,
    retry: RetryPolicy | None = None,
) -> PushResult:
    """Commit the folder `src` to the Hub repo `dest` (`hf://...`) on `revision` (default: main).

    Creates the repo (private when `private`) and the branch when missing. Refuses a folder holding a
    `*.safetensors` file that safetensors cannot load (`hf.read_safetensors_header`: bounded, every
    field checked). Adds a README.md model card built from the provenance record (or what config.json
    and safetensors headers tell) when `src` has no README.md. `PushResult.uploaded` lists the files the commit changed,
    `skipped` those already on the revision with the same content. `progress(done, total)` counts
    the bytes of the files the commit holds, reported once the commit is made.
    """
    from huggingface_hub import HfApi, constants, get_token

    target = HubTarget.parse(dest)
    if revision and target.revision and revision != target.revision:
        raise ValueError(f"two revisions given: {target.revision!r} in {redact(dest)} and {revision!r}")
    token = token or get_token()
    hub = _Hub(
        api=HfApi(endpoint=(endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"), token=token,
                  library_name="ckptflow"),
        target=target, revision=revision or target.revision or "main", shown=redact(dest, [token]), token=token,
        policy=retry or RetryPolicy(),
    )
    with _local_copy(src, hub.policy) as folder, hub_store.quiet_progress_bars():
        contents = _Contents.read(folder, target.repo_id, workers)
        hub.ensure_repo(private)
        unchanged = hub.unchanged(contents)
        info = hub.attempt(lambda: hub.commit(contents, workers), f"commit to {hub.shown}@{hub.revision}")

    pushed = contents.pushed
    tally = Tally(sum(f.size for f in pushed), progress)
    for f in pushed:
        tally.part(f.path)(f.size, f.size)
    uploaded = tuple(f.path for f in pushed if f.path not in unchanged)
    logger.info("pushed %s@%s: %d files changed, %d unchanged (%s)", hub.shown, hub.revision, len(uploaded),
                len(unchanged), info.commit_url)
    return PushResult(
        dest=hub.shown,
        uploaded=uploaded,
        skipped=tuple(f.path for f in pushed if f.path in unchanged),
        bytes_uploaded=sum(f.size for f in pushed if f.path not in unchanged),
        commit_url=info.commit_url,
    )


@dataclass(frozen=True)
class _Contents:
    """What one commit holds: the folder's files with their sha256, and a model card if it has none."""

    folder: Path
    files: tuple[SourceFile, ...]
    hashes: dict[str, str]
    card: bytes | None

    @classmethod
    def read(cls, folder: Path, repo_id: str, workers: int) -> _Contents:
        _, _, files = list_source(str(folder))
        check_file_sizes(files)
        check_folder_entries({f.path for f in files}, added={f.path for f in files})
        for f in files:  # the Hub reads them as models: one that safetensors cannot load is refused
            if f.path.endswith(".safetensors"):
                read_safetensors_header(str(folder / f.path), inside=str(folder))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptflow-hash") as pool:
            hashes = dict(zip((f.path for f in files), pool.map(lambda f: _sha256(folder / f.path), files)))
        card = None if any(f.path == "README.md" for f in files) else model_card(folder, files, repo_id).encode()
        return cls(folder, files, hashes, card)

    @property
    def pushed(self) -> list[SourceFile]:
        return [*self.files, *([SourceFile(path="README.md", size=len(self.card))] if self.card is not None else [])]


@dataclass(frozen=True)
class _Hub:
    """One repo revision on one Hub, and the calls a push makes to it, each retried on transient errors."""

    api: Any
    target: HubTarget
    revision: str
    shown: str
    token: str | None
    policy: RetryPolicy

    def attempt(self, fn: Any, what: str) -> Any:
        try:
            return retry_call(fn, self.policy, on_retry=lambda n, exc, delay: logger.warning(
                "%s failed (%s); retrying", what, describe(exc, [self.token])))
        except Exception as exc:  # the Hub client raises its HTTP stack's errors and its own: `_hub_error` sorts them
            raise _hub_error(exc, what=what, dest=self.shown, token=self.token, policy=self.policy) from None

    def ensure_repo(self, private: bool) -> None:
        """The repo and the branch, created when missing."""
        t = self.target
        if not self.attempt(lambda: self.api.repo_exists(t.repo_id, repo_type=t.repo_type),
                            f"look up the repo {self.shown}"):
            self.attempt(lambda: self.api.create_repo(t.repo_id, repo_type=t.repo_type, private=private, exist_ok=True),
                         f"create the repo {self.shown}")
        if self.revision != "main":
            self.attempt(lambda: self.api.create_branch(t.repo_id, branch=self.revision, repo_type=t.repo_type,
                                                        exist_ok=True),
                         f"create the branch {self.revision} of {self.shown}")

    def unchanged(self, contents: _Contents) -> set[str]:
        """The files the revision already holds with the same bytes."""
        remote = self.attempt(lambda: _remote_files(self.api, self.target, self.revision),
                              f"list the files of {self.shown}@{self.revision}")
        after = {*remote, *(f.path for f in contents.pushed)}
        check_folder_entries(after, added={f.path for f in contents.pushed})
        if len(after) > HUB_RECOMMENDED_REPO_FILES:
            logger.warning("%s@%s will hold %d files; the Hub recommends fewer than %d per repo", self.shown,
                           self.revision, len(after), HUB_RECOMMENDED_REPO_FILES)
        same = {f.path for f in contents.files
                if hub_store.holds(remote.get(f.path), (contents.folder / f.path).read_bytes, f.size,
                                   contents.hashes[f.path])}
        card = contents.card
        if card is not None and hub_store.holds(remote.get("README.md"), lambda: card, len(card),
                                             hashlib.sha256(card).hexdigest()):
            same.add("README.md")
        return same

    def commit(self, contents: _Contents, workers: int) -> Any:
        from huggingface_hub import CommitOperationAdd

        operations = []
        for f in contents.files:
            operation = CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(contents.folder / f.path))
            operation.upload_info.sha256 = bytes.fromhex(contents.hashes[f.path])
            operations.append(operation)
        if contents.card is not None:
            operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=contents.card))
        return self.api.create_commit(
            self.target.repo_id, operations, commit_message=f"Publish {len(contents.files)} files with ckptflow",
            repo_type=self.target.repo_type, revision=self.revision, num_threads=workers,
        )


def check_file_sizes(files: tuple[SourceFile, ...]) -> None:
    """Refuse, before anything is hashed or sent, a folder holding a file the Hub would refuse: larger
    than HUB_MAX_FILE_BYTES."""
    too_large = [f for f in files if f.size > HUB_MAX_FILE_BYTES]
    if too_large:
        largest = max(too_large, key=lambda f: f.size)
        more = f" (and {len(too_large) - 1} more)" if len(too_large) > 1 else ""
        raise PublishError(
            f"{largest.path} is {largest.size:,} bytes{more}; the Hub takes files of at most "
            f"{HUB_MAX_FILE_BYTES:,} bytes (500 GB)",
            file=largest.path, expected=HUB_MAX_FILE_BYTES, actual=largest.size,
            hint="split it into smaller files (consolidate with a smaller shard size) and push again",
        )


def check_folder_entries(paths: set[str], *, added: set[str]) -> None:
    """Refuse a commit after which a folder of the repo would hold more than HUB_MAX_FOLDER_ENTRIES
    entries (files and subfolders; `paths`: every file of the revision once committed, `added`: those
    the commit brings)."""
    entries = _folder_entries(paths)
    crowded = {folder: names for folder, names in entries.items() if len(names) > HUB_MAX_FOLDER_ENTRIES}
    if crowded:
        folder, names = max(crowded.items(), key=lambda item: len(item[1]))
        new = len(names - _folder_entries(paths - added).get(folder, set()))
        where = f"folder {folder}/" if folder else "the repo's top folder"
        raise PublishError(
            f"{where} would hold {len(names):,} entries ({new:,} from this push); the Hub allows at most "
            f"{HUB_MAX_FOLDER_ENTRIES:,} per folder",
            file=folder or None, expected=HUB_MAX_FOLDER_ENTRIES, actual=len(names),
            hint="spread the files over subfolders and push again",
        )


def _folder_entries(paths: set[str]) -> dict[str, set[str]]:
    """Folder ('' for the top) -> the names of the files and subfolders directly in it."""
    entries: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split("/")
        for depth in range(len(parts)):
            entries.setdefault("/".join(parts[:depth]), set()).add(parts[depth])
    return entries


def model_card(folder: Path, files: tuple[SourceFile, ...], repo_id: str) -> str:
    """A README.md for `folder`: source run, tag, step, dtype and parameter count from the provenance
    record `consolidate` writes, else from config.json and the safetensors headers; then the file
    list. Deterministic, so that pushing the same folder twice changes nothing. What the card quotes
    from the folder is plain text in its table (one line, `|` escaped, cut, credentials redacted); a
    record or config that cannot be read (too large, not JSON, nested too deep) is left out of it."""
    record = _read_json(folder / PROVENANCE_NAME)
    source, output = _object(record.get("source")), _object(record.get("output"))
    config = _read_json(folder / "config.json")
    parameters = output.get("total_parameters")
    if type(parameters) is not int:
        parameters = _count_safetensors_parameters(folder, files)
    stage = (f"{_cell(source['zero_stage'])}, {_cell(source.get('world_size'))}" if "zero_stage" in source else None)
    rows = [
        ("Source run", source.get("uri")),
        ("Tag", source.get("tag")),
        ("Step", source.get("step")),
        ("ZeRO stage, ranks", stage),
        ("dtype", output.get("dtype") or config.get("torch_dtype") or config.get("dtype")),
        ("Parameters", f"{parameters:,}" if isinstance(parameters, int) else None),
    ]
    front = ["---", *(["library_name: transformers"] if config else []), "tags:", "- ckptflow", "---"]
    lines = [*front, "", f"# {repo_id.split('/')[-1]}", ""]
    lines.append("Consolidated from a DeepSpeed checkpoint and published with ckptflow." if record
                 else "Published with ckptflow.")
    lines += ["", "| | |", "|---|---|"]
    lines += [f"| {name} | {_cell(value) if value is not None else 'not recorded'} |" for name, value in rows]
    lines += ["", "## Files", "", "| File | Bytes |", "|---|---:|"]
    lines += [f"| {_cell(f.path)} | {f.size:,} |" for f in files]
    return "\n".join(lines) + "\n"


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _cell(value: Any) -> str:
    """A value from the folder as one markdown table cell: plain text, `|` escaped, at most 200 characters."""
    text = value if isinstance(value, str) else str(value) if isinstance(value, int | float) else excerpt(value)
    return one_line(redact(text), 200).replace("|", "\\|")


# Helpers.


@contextmanager
def _local_copy(src: str, policy: RetryPolicy) -> Iterator[Path]:
    """`src` as a local folder: itself when local, else a temporary download removed afterwards."""
    path = os_path(src)
    if path is not None:
        yield Path(path)
        return
    fs, root = open_fs(src)
    tmp = Path(tempfile.mkdtemp(prefix="ckptflow-hub-"))
    try:
        try:
            retry_call(lambda: fs.get(root.rstrip("/") + "/", str(tmp), recursive=True), policy)
        except Exception as exc:  # each fsspec backend raises its own errors: one line naming SRC
            raise PublishError(
                f"could not download SRC {redact(src)} to stage it for the Hub: {describe(exc)}",
                uri=redact(src), hint="check SRC and the credentials fsspec uses for it",
            ) from None
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(path: Path) -> str:
    digests = Digests()
    with open_regular(str(path)) as handle:
        while chunk := handle.read(8 * 2**20):
            digests.update(chunk)
    return digests.sha256


def _remote_files(api: Any, target: HubTarget, revision: str) -> dict[str, Any]:
    from huggingface_hub.hf_api import RepoFile

    entries = api.list_repo_tree(target.repo_id, recursive=True, revision=revision, repo_type=target.repo_type)
    return {e.path: e for e in entries if isinstance(e, RepoFile)}


# The card reads the provenance record and config.json: a few KB each.
MAX_CARD_INPUT_BYTES = 16 << 20


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from the folder for the card, or {} when there is none or it cannot be read."""
    if not os.path.lexists(path):
        return {}
    try:
        doc = load_json(read_regular(str(path), limit=MAX_CARD_INPUT_BYTES, what=path.name))
    except (CkptflowError, OSError, ValueError) as exc:
        logger.warning("the model card leaves out %s: %s", path.name, one_line(str(exc), 300))
        return {}
    return doc if isinstance(doc, dict) else {}


def _count_safetensors_parameters(folder: Path, files: tuple[SourceFile, ...]) -> int | None:
    """Parameters in the safetensors files, from their headers alone (shared tensors count once per
    file); the headers were checked when SRC was listed (`hf.read_safetensors_header`)."""
    headers = [read_safetensors_header(str(folder / f.path)) for f in files if f.path.endswith(".safetensors")]
    return sum(h.parameters for h in headers) if headers else None


def _hub_error(exc: Exception, *, what: str, dest: str, token: str | None, policy: RetryPolicy) -> PublishError:
    codes = {status_code(e) for e in causes(exc)} - {None}
    reason = describe(exc, [token])
    if is_transient(exc):
        reason = f"still failing after {policy.attempts} tries ({reason})"
        hint = "the Hub may be overloaded; run the same push again: what is uploaded already is not sent twice"
    elif codes & {401}:
        hint = "the Hub did not accept the token: set HF_TOKEN or run `hf auth login`"
    elif codes & {403}:
        hint = "the token may not write to this repo: use a token with write access to it"
    elif codes & {404}:
        hint = "check the repo name, its type (hf://datasets/... for datasets) and the revision"
    else:
        hint = "fix the cause and run the same push again"
    return PublishError(f"could not {what}: {reason}", uri=dest, hint=hint)
