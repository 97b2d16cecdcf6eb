"""One reader per checkpoint layout DeepSpeed writes, each turning a tag folder into an index.

`zero` (ZeRO-1/2/3, data parallel) and `zero0` are also the bases the others stand on: every
model-parallel rank is a data-parallel checkpoint of its own. `model_parallel` is the shared base of
the tensor- and pipeline-parallel readers (`autotp`, `pipeline`), `experts` that of the expert-parallel
ones (`autoep`, `moe`). Readers import `model`, `inspection`, `partition`, `config` and these bases,
never each other.
"""
