"""Where the model folder's config and tokenizer files come from: SRC, or a config source.

DeepSpeed's `save_checkpoint`, Accelerate and Lightning write no `config.json`; without one a
consolidated folder does not load with `from_pretrained`. `ConsolidateOptions.config` names a config
source: a folder (local or a store URL; a path to a `config.json` file takes that file alone) or a Hub
model repo (`org/name` or `hf://org/name`, at `config_revision` or the default branch). Only the
side files (`hf.SIDE_FILES`: config, generation config, tokenizer) are read from it, each bounded
in size; from the Hub, all at one commit.

Precedence, by kind (`hf.side_kind`): a kind SRC holds any file of comes from SRC, whole; a kind SRC
lacks comes from the config source, whole. So SRC's own config.json always wins (a Trainer
checkpoint keeps the config it trained with), and the files of one kind never mix two places.
`SideFiles.unused` lists what the source offered and SRC overrode, for the caller to say so.

A config.json taken from the source is checked against the checkpoint's tensors before anything is
committed (`checked`, `consolidate.architecture.check_config`: transformers builds the architecture on
the meta device, no weights, no repo code). That is the one step here that imports transformers, which
takes seconds whatever the model: `ConsolidateStep` runs it beside the shard writes.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ckptflow.errors import CkptflowError, ConfigError, UnsupportedCheckpointError, option
from ckptflow.formats import hf
from ckptflow.formats.deepspeed.model import Partitioned
from ckptflow.formats.deepspeed.readers.optimizer_shards import OptimizerShards
from ckptflow.plumbing.files import read_regular
from ckptflow.plumbing.redaction import describe, redact
from ckptflow.plumbing.retry import RetryPolicy, is_transient, retry_call
from ckptflow.plumbing.storage import join, open_fs
from ckptflow.plumbing.stores.hub import quiet_progress_bars
from ckptflow.plumbing.stores.local import os_path
from ckptflow.plumbing.text import excerpt

if TYPE_CHECKING:
    from ckptflow.consolidate.plan import ConsolidationPlan

logger = logging.getLogger(__name__)

# A Hub model repo id: `name` or `org/name` (letters, digits, `-`, `_`, `.`), optionally as `hf://org/name`.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_HUB_URL = re.compile(r"^hf://(?:models/)?([A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@([^/]+))?/?$")
_HINT = "give the config of the model that was trained: a folder holding its config.json, or its Hub repo"


@dataclass(frozen=True, kw_only=True)
class ConfigSource:
    """A config source as given: a folder (local path or store URL) or a Hub model repo at a revision."""

    hub: bool
    location: str  # the folder's URI, or the repo id
    revision: str | None = None
    text: str = ""  # as given

    @classmethod
    def parse(cls, text: str, revision: str | None = None) -> ConfigSource:
        """`hf://org/name[@rev]` or `org/name` (not a local folder of that name) is a Hub repo; an existing
        local path or any other URL is a folder. A revision is for Hub repos only."""
        text = text.strip()
        hub_url = _HUB_URL.match(text)
        if hub_url is not None:
            repo_id, pinned = hub_url.groups()
            if pinned and revision and pinned != revision:
                raise ConfigError(f"two revisions given for the config: {pinned!r} in {text} and {revision!r}",
                                  code="config-not-found", uri=text, hint="give one")
            return cls(hub=True, location=repo_id, revision=pinned or revision, text=text)
        if text.startswith("hf://"):
            raise ConfigError(f"{redact(text)} is not a Hub model repo: expected hf://ORG/NAME or hf://ORG/NAME@REVISION",
                              code="config-not-found", uri=text, hint=_HINT)
        local = "://" not in text and not os.path.exists(text)
        if local and _REPO_ID.match(text) and not text.startswith("."):
            return cls(hub=True, location=text, revision=revision, text=text)
        if revision:
            raise ConfigError(f"a revision ({revision}) was given for the config folder {redact(text)}; revisions are "
                              "for Hub repos", code="config-not-found", uri=text,
                              hint="leave the revision out, or name a Hub repo (hf://ORG/NAME)")
        return cls(hub=False, location=text, text=text)

    @property
    def shown(self) -> str:
        """How messages name it: the folder, or `hf://org/name@revision`."""
        if not self.hub:
            return redact(self.location)
        return f"hf://{self.location}" + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class ConfigFiles:
    """The side files a config source holds, read whole: name -> bytes (config.json as written there)."""

    source: ConfigSource
    files: Mapping[str, bytes]
    commit: str | None = None  # the Hub commit they were read at

    @property
    def shown(self) -> str:
        return self.source.shown


@dataclass(frozen=True)
class SideFiles:
    """The config and tokenizer files a model folder gets: SRC's own (`own`, copied from `root` when
    the folder is written) and those taken from a config source (`given`, in memory)."""

    root: str
    own: tuple[str, ...] = ()
    given: Mapping[str, bytes] = field(default_factory=dict)
    source: ConfigFiles | None = None
    architecture: str | None = None  # what the given config.json was checked against, e.g. LlamaForCausalLM

    @property
    def names(self) -> tuple[str, ...]:
        """Every side file the model folder holds, in `hf.SIDE_FILES` order."""
        present = {*self.own, *self.given}
        return tuple(n for n in hf.SIDE_FILES if n in present)

    @property
    def has_config(self) -> bool:
        return hf.CONFIG_NAME in self.own or hf.CONFIG_NAME in self.given

    @property
    def unused(self) -> tuple[str, ...]:
        """Files the config source holds that were not taken, because SRC has its own of their kind."""
        if self.source is None:
            return ()
        return tuple(n for n in hf.SIDE_FILES if n in self.source.files and n not in self.given)

    def sizes(self, dtype: str) -> dict[str, int]:
        """The size each given file comes to in the model folder (`hf.side_file_bytes`)."""
        return {name: len(hf.side_file_bytes(name, data, dtype)) for name, data in self.given.items()}

    def record(self, dtype: str) -> dict[str, Any] | None:
        """The provenance record's `config` section: the source and the sha256 of each file taken from it
        as written (None without a config source)."""
        if self.source is None:
            return None
        import hashlib

        src = self.source.source
        return {
            "source": f"hf://{src.location}" if src.hub else self.source.shown,
            "revision": src.revision,
            "commit": self.source.commit,
            "architecture": self.architecture,
            "files": {name: hashlib.sha256(hf.side_file_bytes(name, data, dtype)).hexdigest()
                      for name, data in sorted(self.given.items())},
            "unused": list(self.unused),
        }


def side_files(plan: ConsolidationPlan, *, retry: RetryPolicy | None = None, check: bool = True) -> SideFiles:
    """The side files of `plan`'s model folder: SRC's, and, with `plan.options.config`, the kinds SRC
    lacks from that source. A config.json taken from it is checked against the plan's tensors first
    (with `check`; else later, by `checked`).

    Raises `ConfigError` when the source cannot be read, holds no side file, holds no config.json while
    SRC has none either, or its config.json does not describe the checkpoint (the first mismatch named).
    """
    own = tuple(hf.find_side_files(plan.root))
    if plan.options.config is None:
        return SideFiles(plan.root, own)
    source = ConfigSource.parse(plan.options.config, plan.options.config_revision)
    read = read_config_source(source, retry=retry)
    if not read.files:
        raise ConfigError(f"{read.shown} holds no config.json, generation config or tokenizer file",
                          code="config-not-found", uri=read.shown, hint=_HINT)
    kinds = {hf.side_kind(n) for n in own}
    given = {n: read.files[n] for n in hf.SIDE_FILES if n in read.files and hf.side_kind(n) not in kinds}
    if hf.CONFIG_NAME not in own and hf.CONFIG_NAME not in given:
        raise ConfigError(f"{read.shown} has no {hf.CONFIG_NAME} (it holds {', '.join(read.files)}), and the "
                          "checkpoint has none either", code="config-not-found", uri=read.shown, hint=_HINT)
    if hf.CONFIG_NAME in given:  # the JSON read and its plain checks now; the model built by `checked`
        from ckptflow.consolidate.architecture import parse_config

        parse_config(given[hf.CONFIG_NAME], f"{hf.CONFIG_NAME} of {read.shown}")
    result = SideFiles(plan.root, own, given, read)
    if result.unused:
        logger.info("the checkpoint has its own %s; %s not taken from %s", ", ".join(sorted(
            {hf.side_kind(n) for n in result.unused})), ", ".join(result.unused), read.shown)
    return checked(plan, result) if check else result


def checked(plan: ConsolidationPlan, side: SideFiles) -> SideFiles:
    """`side` with the config.json it takes from its config source checked against `plan`'s tensors
    (transformers builds the architecture on the meta device: `architecture.check_config`), and the
    class checked against recorded; `side` itself when it takes no config.json or was checked already.
    Raises `ConfigError` naming the first mismatch."""
    if side.architecture is not None or hf.CONFIG_NAME not in side.given or side.source is None:
        return side
    from ckptflow.consolidate.architecture import check_config

    tensors = [(t.name, t.shape) for u in plan.units for t in u.tensors]
    architecture = check_config(side.given[hf.CONFIG_NAME], tensors, tied=plan.tied, excluded=plan.excluded,
                                where=f"{hf.CONFIG_NAME} of {side.source.shown}")
    return replace(side, architecture=architecture)


def shaped(index: Partitioned, config: str | None, revision: str | None = None, *,
           retry: RetryPolicy | None = None) -> Partitioned:
    """`index` knowing its parameters' shapes. Optimizer shards saved without the model beside them
    (`readers.optimizer_shards`) hold each parameter's size only: the shapes then come from the
    architecture the config source's config.json describes (transformers on the meta device), each
    checked against the size the shards hold. Without a config source, `UnsupportedCheckpointError`
    says what to give; every other index is returned as it is."""
    if not isinstance(index, OptimizerShards) or index.has_shapes:
        return index
    if config is None:
        raise UnsupportedCheckpointError(
            f"{index.root} holds optimizer shards that give each parameter's size but not its shape, and no model "
            "weights beside them; a model folder needs the shapes", code="shapes-unknown", uri=index.root,
            hint=f"give the trained model's config with {option('config')} (a folder or a Hub repo ORG/NAME), or "
                 "save the model beside the shards (save_pretrained)")
    read = read_config_source(ConfigSource.parse(config, revision), retry=retry)
    raw = read.files.get(hf.CONFIG_NAME)
    if raw is None:
        raise ConfigError(f"{read.shown} has no {hf.CONFIG_NAME}, which the shapes of the optimizer shards in "
                          f"{index.root} must come from", code="config-not-found", uri=read.shown, hint=_HINT)
    from ckptflow.consolidate.architecture import model_shapes

    where = f"{hf.CONFIG_NAME} of {read.shown}"
    return index.with_shapes(model_shapes(raw, most_tensors=len(index.params), where=where), where)


def read_config_source(source: ConfigSource, *, retry: RetryPolicy | None = None) -> ConfigFiles:
    """The side files `source` holds, read whole and bounded (`hf.MAX_CONFIG_BYTES` for config.json,
    `hf.MAX_SIDE_FILE_BYTES` for the others). A `ConfigError` names what could not be read."""
    if source.hub:
        return _read_hub(source, retry or RetryPolicy())
    return _read_folder(source)


def _limit(name: str) -> int:
    return hf.MAX_CONFIG_BYTES if name == hf.CONFIG_NAME else hf.MAX_SIDE_FILE_BYTES


def _read_folder(source: ConfigSource) -> ConfigFiles:
    uri = source.location
    fs, path = open_fs(uri)
    try:
        if fs.isfile(path) and posixpath.basename(path.rstrip("/")) == hf.CONFIG_NAME:
            folder = uri.rstrip("/").rpartition("/")[0] or "."
            return ConfigFiles(source, {hf.CONFIG_NAME: _read(join(folder, hf.CONFIG_NAME), hf.CONFIG_NAME, folder)})
        if not fs.isdir(path):
            local = os_path(uri)
            there = f"there is no folder {source.shown}" if local is None or not os.path.exists(local) \
                else f"{source.shown} is not a folder"
            path_like = "://" in uri or uri.startswith(("/", ".", "~"))
            hub = "" if path_like else " (nor is it a Hub repo id such as ORG/NAME)"
            raise ConfigError(f"{there}{hub}", code="config-not-found", uri=uri, hint=_HINT)
    except CkptflowError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read the config source {source.shown} ({describe(exc)})", code="config-not-found",
                          uri=uri, hint="check the path and access to it") from None
    names = hf.find_side_files(uri)
    return ConfigFiles(source, {name: _read(join(uri, name), name, uri) for name in names})


def _read(uri: str, name: str, inside: str) -> bytes:
    try:
        return read_regular(uri, limit=_limit(name), what=name, inside=inside,
                            hint="a config source holds small regular files: config, generation config, tokenizer")
    except CkptflowError as exc:
        raise ConfigError(str(exc), code="config-unreadable", uri=uri, file=name) from None


# ---- the Hub ---------------------------------------------------------------------------------------


def _read_hub(source: ConfigSource, policy: RetryPolicy) -> ConfigFiles:
    """The side files at the top of a Hub model repo, all read at the one commit `source.revision` names
    (endpoint and token: `HF_ENDPOINT`, `HF_TOKEN` or the token file, read now)."""
    from huggingface_hub import HfApi, constants, get_token

    token = get_token()
    api = HfApi(endpoint=(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"), token=token,
                library_name="ckptflow")
    repo, shown = source.location, source.shown

    def attempt(fn: Any, what: str) -> Any:
        try:
            return retry_call(fn, policy, on_retry=lambda n, exc, delay: logger.warning(
                "%s failed (%s); retrying", what, describe(exc, [token])))
        except Exception as exc:  # the Hub client raises its HTTP stack's errors and its own: `_hub_error` sorts them
            raise _hub_error(exc, source, what, token, policy) from None

    info = attempt(lambda: api.model_info(repo, revision=source.revision), f"look up {shown}")
    commit = str(info.sha)
    entries = attempt(lambda: list(api.list_repo_tree(repo, revision=commit, recursive=False)),
                      f"list the files of {shown}")
    sizes = {e.path: int(e.size) for e in entries if getattr(e, "size", None) is not None}
    names = [n for n in hf.SIDE_FILES if n in sizes]
    for name in names:
        if sizes[name] > _limit(name):
            raise ConfigError(f"{name} of {shown} is {sizes[name]:,} bytes, more than a {name} can be "
                              f"({_limit(name):,} bytes at most)", code="config-unreadable", uri=shown, file=name,
                              hint=_HINT)
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="ckptflow-config-") as tmp, quiet_progress_bars():
        for name in names:
            path = attempt(lambda name=name: api.hf_hub_download(repo, name, revision=commit, local_dir=tmp),
                           f"download {name} of {shown}")
            files[name] = _read(str(path), name, tmp)
    logger.info("config source %s: %s at commit %s", shown, ", ".join(names) or "no side file", commit[:12])
    return ConfigFiles(source, files, commit)


def _hub_error(exc: Exception, source: ConfigSource, what: str, token: str | None,
               policy: RetryPolicy) -> ConfigError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    shown, reason = source.shown, describe(exc, [token])
    here = "" if source.text.startswith("hf://") else f"no folder {redact(source.text)} here, and "
    if isinstance(exc, GatedRepoError):
        return ConfigError(f"{shown} is gated: its files need a token of an account that accepted its terms",
                           code="config-not-found", uri=shown, hint="accept them on the Hub, then set HF_TOKEN")
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(f"{here}no model repo {source.location} on the Hub (or it is private and the token cannot "
                           "read it)", code="config-not-found", uri=shown,
                           hint="check the repo id; for a private repo set HF_TOKEN or run `hf auth login`")
    if isinstance(exc, RevisionNotFoundError):
        return ConfigError(f"{source.location} has no revision {excerpt(source.revision)} on the Hub",
                           code="config-not-found", uri=shown, hint="give a branch, tag or commit the repo has")
    if is_transient(exc):
        return ConfigError(f"{here}could not {what}: still failing after {policy.attempts} tries ({reason})",
                           code="config-unreachable", uri=shown,
                           hint="check the network and HF_ENDPOINT (the Hub may be overloaded), then run again")
    return ConfigError(f"{here}could not {what} ({reason})", code="config-unreachable", uri=shown,
                       hint="check the network and HF_ENDPOINT, then run again")


__all__ = ["ConfigFiles", "ConfigSource", "SideFiles", "checked", "read_config_source", "side_files"]
