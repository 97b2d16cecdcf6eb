"""A Megatron-style checkpoint's padded vocabulary at another tensor-parallel degree. Pure.

Megatron-DeepSpeed pads its vocabulary to a multiple of `make_vocab_size_divisible_by` x the
tensor-parallel degree (`_vocab_size_with_padding` in `megatron/tokenizer/tokenizer.py`), so a GPT-2
vocabulary of 50257 is 50304 rows at tp 1 and 50432 at tp 2, and Megatron at the target degree builds
its vocabulary-parallel layers with the target's rows. Where the run's `args` (an `argparse.Namespace`
in every model-states file) record `make_vocab_size_divisible_by`, the target's padded rows are
Megatron's at the target degree, from `universal_checkpoint_info`'s `original_vocab_size`, once the same
rule is seen to give the source's own rows at the source's degree: the original rows are copied, the
padding rows are zeros, as DeepSpeed's universal route pads them (`load_hp_checkpoint_state`). Without
the field, the target keeps the source's padded rows (`keep_note` says so).
"""

from __future__ import annotations

from ckptflow.errors import UnsupportedCheckpointError
from ckptflow.formats.deepspeed.client_state import namespace_state
from ckptflow.formats.deepspeed.names import UC_INFO
from ckptflow.formats.deepspeed.readers.model_parallel import ModelParallelCheckpoint
from ckptflow.formats.deepspeed.readers.pipeline import vocabulary_rows

DIVISIBLE_BY = "make_vocab_size_divisible_by"
PADDED_VOCAB = "padded_vocab_size"  # in `args`, and in Megatron-DeepSpeed's `universal_checkpoint_info`


def padded_vocab_size(original: int, divisible_by: int, tp: int) -> int:
    """The rows Megatron pads a vocabulary of `original` to at tensor-parallel degree `tp`: the next
    multiple of `divisible_by` x `tp`."""
    multiple = divisible_by * tp
    return -(-original // multiple) * multiple


def divisible_by(index: ModelParallelCheckpoint) -> int | None:
    """`make_vocab_size_divisible_by` of the run's `args` (an `argparse.Namespace` record in its first
    model-states file), where it is an int; else None."""
    args = namespace_state(index.ranks[0].model_states[0].get("args"))
    value = args.get(DIVISIBLE_BY) if args is not None else None
    return value if type(value) is int else None


def vocab_rows_at(index: ModelParallelCheckpoint, tp: int) -> int | None:
    """The padded vocabulary rows of the Megatron-style checkpoint `index` at tensor-parallel degree `tp`,
    as Megatron pads them; None where its `args` record no `make_vocab_size_divisible_by`, or it has no
    vocabulary parameter (the source's rows kept). `UnsupportedCheckpointError`, in one line naming the
    numbers, where the rule does not give the source's own padded rows at its degree."""
    divisor = divisible_by(index)
    rows = vocabulary_rows(index)
    if divisor is None or not rows:
        return None
    if divisor < 1:
        raise UnsupportedCheckpointError(f"its args record {DIVISIBLE_BY} {divisor}, which pads no vocabulary")
    original = (index.ranks[0].model_states[0].get(UC_INFO) or {}).get("original_vocab_size")
    if type(original) is not int or original < 1:
        raise UnsupportedCheckpointError(f"it has vocabulary parameters ({next(iter(rows))}) but records no "
                                         "original_vocab_size to pad again")
    expected = padded_vocab_size(original, divisor, index.tp)
    for name, source in rows.items():
        if source != expected:
            raise UnsupportedCheckpointError(
                f"{name} has {source} rows, but Megatron pads its vocabulary of {original} rows (original_vocab_size) "
                f"to {expected} at tensor-parallel degree {index.tp} ({DIVISIBLE_BY} {divisor} in its args); ckptflow "
                "does not know the rule that padded it, so it does not pad it at another degree", tensor=name)
    return padded_vocab_size(original, divisor, tp)


def keep_note(index: ModelParallelCheckpoint, tp: int) -> str | None:
    """What a change to degree `tp` keeps of the source's padded vocabulary, where its `args` say nothing
    of how Megatron pads it (None: nothing kept, or no vocabulary parameter)."""
    rows = vocabulary_rows(index)
    if not rows or divisible_by(index) is not None:
        return None
    return (f"the vocabulary parameters keep the source's {max(rows.values())} padded rows at tensor-parallel degree "
            f"{tp}: the checkpoint's args record no {DIVISIBLE_BY}, so ckptflow does not pad them as Megatron would "
            "at that degree; build the model at the target with that padded vocabulary size")


__all__ = ["DIVISIBLE_BY", "PADDED_VOCAB", "divisible_by", "keep_note", "padded_vocab_size", "vocab_rows_at"]
