"""The kinds of hostile input, one module per family; each `@kind` builder registers itself.

Modules: `checkpoint` (broken checkpoints a user meets: missing, extra, truncated, mixed files; the
first corpus, moved here from tests/test_validate.py), `zipfiles` (damage to the torch zip archive),
`pickles` (hostile pickles of every opcode family, bombs), `records` (tensor records: strides,
offsets, BUILD after a storage), `counts` (absurd sizes and counts in the metadata), `latest` (bad
`latest` pointers), `markup` (rich markup and emoji codes in what messages quote), `sidefiles`
(config and other root files for consolidate and reshard), `pushsrc` (what `push` is given:
special files, safetensors headers, model-card inputs), `manifests` (bad manifests and partial
records at DEST), `sources` (files that change while they are read).
"""
