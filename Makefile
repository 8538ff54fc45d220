# Two commands: `make demo` runs the main job on the embedded default; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed runs on the CPU in tests and the demo.
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the build the machines carry, so nothing pulls a GPU build
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# make demo QUIET=1: no progress bar or progress lines (the step lines and the table stay)
QUIET ?= 0
demo: $(STAMP)
	$(VENV)/bin/iga-ds demo --out demo_out $(if $(filter-out 0,$(QUIET)),--quiet)

# Two worker processes, each taking a whole test file at a time (--dist loadfile: a file's
# shared fixtures, such as a training run several tests read, run once). On 2 cores one
# worker alone kept about one core busy: much of the suite waits on processes it started.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info demo_out
