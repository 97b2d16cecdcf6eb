"""The hashes and store checksums the publish step compares: `ckptflow.plumbing.checksums`, which the
conversion steps share (a unit's output is checked against the store's checksum before commit)."""

from ckptflow.plumbing.checksums import Digests, StoreChecksum, stamp, stamps_match, store_checksum, valid_stamp

__all__ = ["Digests", "StoreChecksum", "stamp", "stamps_match", "store_checksum", "valid_stamp"]
