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

.PHONY: install lint test demo clean

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

demo: install
	$(PY) -m flows.demo

clean:
	rm -rf $(VENV) .cache demo-output
