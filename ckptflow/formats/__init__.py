"""Bytes <-> structures, knowing nothing of pipeline steps.

`torch/` reads torch archives (a bounded allow-list unpickler, lazy `TensorRef`s, exact byte ranges)
and writes them as a stream of byte ranges, `casts` converts dtypes on raw bytes, `hf` is the Hugging
Face model folder, `shard_check` compares a written shard with its source, and `deepspeed/` holds
DeepSpeed's checkpoint layouts.
"""
