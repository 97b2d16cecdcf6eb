"""How the core's messages name options inside a Prefect task: as the lifecycle form's fields.

The core names an option by its Python keyword (`ckptflow.errors.option`); a user of the Prefect UI
sets it in the form, so there a message says the field's title. `in_form_words(fn)` makes the messages
of a task's body name options so. Options the form does not have keep the core's word.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ckptflow.errors import naming

# keyword -> the form field's title, as flows.params gives it (tests/test_flows.py checks they match).
FORM_FIELDS = {
    "tag": "Tag",
    "dtype": "Output dtype",
    "exclude_frozen": "Exclude frozen parameters",
    "verify": "Verify",
    "config": "Config source",
    "config_revision": "Config revision",
    "max_shard_size": "Max shard size",
    "world_size": "Target world sizes",
    "stage": "ZeRO stage",
    "tp": "Tensor-parallel degree",
    "pp": "Pipeline stages",
    "ep": "Expert-parallel degree",
    "partition_method": "Pipeline partition method",
    "pipeline_layers": "Pipeline layers",
    "layer_types": "Pipeline layer types",
    "tied_modules": "Pipeline tied modules",
    "qkv_layout": "Megatron query_key_value layout",
    "cluster": "Dask cluster",
}
NAMES = {keyword: f'the form\'s "{title}"' for keyword, title in FORM_FIELDS.items()}

P = ParamSpec("P")
R = TypeVar("R")


def in_form_words(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, its messages naming options by the form's fields (put it under `@task`)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with naming(NAMES):
            return fn(*args, **kwargs)

    return run
