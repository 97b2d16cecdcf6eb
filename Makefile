# ckptflow: `make demo` runs the pipeline on a fresh DeepSpeed checkpoint, `make test` runs the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export DS_ACCELERATOR := cpu
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT := false
export HF_HUB_DISABLE_XET := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install lint test test-latest demo clean

install: $(STAMP)

# torch goes in first, from its exact pin, so that no dependency can pull a CUDA build.
$(STAMP): pyproject.toml setup.py constraints.txt ckptflow/formats/_casts.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0 2>&1 | grep -v "is ignored" || true
	set -o pipefail; $(PY) -m pip install -q -c constraints.txt -e '.[test]' 2>&1 | { grep -v "is ignored" || true; }
	$(PY) -c "import torch, deepspeed, prefect, ckptflow" 2>/dev/null
	$(PY) -c "import ckptflow.formats._casts" 2>/dev/null || echo "warning: the compiled casts were not built (no C compiler?); numpy does the casts, slower" >&2
	touch $(STAMP)

# Two processes, each taking whole test files (a file's session fixtures, such as a DeepSpeed oracle
# launch, run in one of them only). TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2

# The house rules before the tests: ruff on the whole tree, mypy --strict on ckptflow/ (pyproject.toml).
lint: install
	$(VENV)/bin/ruff check ckptflow tasks flows tests benchmarks
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile

# The newest releases the extras allow, in a venv of its own rebuilt each time, with no constraints file:
# only torch and DeepSpeed are held (the CPU torch, and the DeepSpeed the fixtures are written with).
# First what `pip install 'ckptflow[all,cluster]'` resolves for a user; then the test tools fitted around
# it without moving it (left to itself, pip reconciles moto's boto3 with s3fs's botocore by searching
# aiobotocore, s3fs and then torch releases). Then a sample of the suite that touches every integration:
# the core on real DeepSpeed checkpoints, local, memory://, GCS and S3 stores, the Hub double, a Prefect
# server with the deployments, schedules, trigger and form, flows, and a Dask cluster.
# $(LATEST)/versions.txt lists what it ran on. CI runs `make test` (constraints.txt) only.
LATEST := .venv-latest
LATEST_PIP := $(LATEST)/bin/python -m pip
LATEST_SAMPLE ?= tests/test_packaging.py tests/test_validate.py tests/test_remote_read.py tests/test_publish.py \
	tests/test_hub.py tests/test_infra.py tests/test_watch.py tests/test_prefect_dask.py

test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST_PIP) install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	set -o pipefail; $(LATEST_PIP) install -q torch==2.13.0 deepspeed==0.19.8 -e '.[all,cluster]' 2>&1 | { grep -v "is ignored" || true; }
	$(LATEST_PIP) freeze --exclude-editable > $(LATEST)/user-install.txt
	set -o pipefail; $(LATEST_PIP) install -q -c $(LATEST)/user-install.txt -e '.[test]' 2>&1 | { grep -v "is ignored" || true; }
	$(LATEST_PIP) check
	$(LATEST_PIP) freeze --exclude-editable > $(LATEST)/versions.txt
	grep -i -E '^(torch|deepspeed|prefect|prefect-dask|huggingface.hub|hf.xet|transformers|safetensors|fsspec|gcsfs|s3fs|dask|distributed|sqlalchemy|fastapi)==' $(LATEST)/versions.txt
	$(LATEST)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(LATEST_SAMPLE)

demo: install
	$(PY) -m flows.demo

clean:
	rm -rf $(VENV) $(LATEST) .cache demo-output
