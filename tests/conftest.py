"""Session-wide test settings. The environment is set before anything imports gcsfs, DeepSpeed or Prefect."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# Fixture plugins, one module per area: each registers its own session fixtures.
pytest_plugins = [
    "tests.fixtures.plugin",
    "tests.prefect_plugin",
    "tests.servers",
    "tests.hostile.plugin",
    "tests.cluster",
]
