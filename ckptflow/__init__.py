"""ckptflow: validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints."""

__version__ = "0.1.0"
