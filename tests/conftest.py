"""Session-wide test settings. The environment is set before anything imports gcsfs, DeepSpeed or Prefect."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# rich fixes a console's width for good when COLUMNS is set as it is made: the CLI's consoles are made
# here, with COLUMNS unset, so that each test's `CliRunner(env={"COLUMNS": ...})` sets the width it reads
# whichever test imported the CLI first.
_columns = os.environ.pop("COLUMNS", None)
import ckptflow.cli  # noqa: E402, F401

if _columns is not None:
    os.environ["COLUMNS"] = _columns

# Fixture plugins, one module per area: each registers its own session fixtures.
pytest_plugins = [
    "tests.fixtures.plugin",
    "tests.servers.prefect",
    "tests.servers.stores",
    "tests.hostile.plugin",
    "tests.servers.cluster",
]

# The longest files first (serial seconds of the default run, longest first; measured 2026-11-27), so
# that the two processes of `make test` (--dist loadfile hands out whole files in this order) finish
# together. Files not named keep their order after these; tests keep their order within a file.
_LONGEST_FIRST = ("test_expert_parallel", "test_flows", "test_model_parallel_reshard", "test_reshard",
                  "test_client_state", "test_hostile", "test_scale_out", "test_watch", "test_fuzz", "test_lightning",
                  "test_publish_faults", "test_accelerate", "test_pipeline_reshard", "test_holdout",
                  "test_model_parallel", "test_publish", "test_optimizer_shards", "test_consolidate",
                  "test_consolidate_config", "test_prefect_dask", "test_fixtures", "test_staging")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
