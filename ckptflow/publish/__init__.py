"""The publish step: push a folder to an object store, any fsspec URL, or the Hugging Face Hub.

- `source.py`: listing SRC, the result of a push, how failures read;
- `store.py`: buckets and folders, atomic (manifest last) and resumable;
- `hub.py`: the Hugging Face Hub, one commit;
- `manifest.py`, `checksums.py`: the commit marker of a bucket push, and the digests that prove an
  object holds its source's bytes;
- `push.py`: `push(src, dest, options=PushOptions(...))`, which sends each destination to its
  publisher.
"""

from ckptflow.publish.hub import HubTarget
from ckptflow.publish.manifest import MANIFEST_NAME, PARTIAL_RECORD_NAME, Manifest, ManifestEntry
from ckptflow.publish.push import PushOptions, push
from ckptflow.publish.source import PushResult, SourceFile, list_source

__all__ = [
    "MANIFEST_NAME", "PARTIAL_RECORD_NAME", "HubTarget", "Manifest", "ManifestEntry", "PushOptions", "PushResult",
    "SourceFile", "list_source", "push",
]
