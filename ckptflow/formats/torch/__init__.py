"""Torch zip archives: read lazily through a bounded allow-list unpickler, written as a stream of byte
ranges. `tensorref` (where a tensor's bytes are), `unpickler`, `zipdir` (reading), `pickler` and
`writer` (writing), `serialization_id`."""
