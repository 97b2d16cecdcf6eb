"""Bytes <-> structures, knowing nothing of pipeline steps.

`torchzip` reads torch archives (allow-list unpickler, lazy `TensorRef`s, byte ranges), `torchsave`
writes them as a stream of byte ranges, `casts` converts dtypes on raw bytes, `hf` is the Hugging Face
model folder, `shard_check` compares a written shard with its source, and `deepspeed/` holds
DeepSpeed's checkpoint layouts.
"""
