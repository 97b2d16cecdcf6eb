"""fsspec's in-memory filesystem (`memory://`): the store the tests use where a filesystem is all that
matters. It reports no content checksum; an object's creation time changes when it is rewritten."""

from __future__ import annotations

from ckptflow.plumbing.stores import Store

STORE = Store(name="memory", protocols=("memory",), stamp_keys=("created",))
