"""The hashes and store checksums the publish step compares: `ckptflow.plumbing.checksums`, which the
conversion steps share (a unit's output is checked against the store's checksum before commit); what
each store reports and stamps is its own (`ckptflow.plumbing.stores`)."""

from ckptflow.plumbing.checksums import Digests, StoreChecksum, stamps_match, valid_stamp

__all__ = ["Digests", "StoreChecksum", "stamps_match", "valid_stamp"]
