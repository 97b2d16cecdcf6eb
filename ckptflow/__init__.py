"""ckptflow: validate, consolidate, reshard and publish DeepSpeed ZeRO checkpoints."""

__version__ = "0.1.0"

# The dtype a consolidated model is written in when none is asked for, everywhere (the library, the CLI,
# the Prefect tasks and flows): the fp32 master weights bit for bit. Here, not in `consolidate`, so the
# CLI names it without importing the converter.
DEFAULT_DTYPE = "fp32"
