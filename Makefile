# Two commands on a fresh machine: `make demo` and `make test`.
# Both create the virtual environment when it is missing and install gradstat with its
# extras at the versions pinned in constraints.txt (scripts/install.py: torch's CPU build
# from PyTorch's CPU index where it answers, and a check that nothing unpinned came in).

PYTHON ?= python3
VENV   ?= .venv
# TORCH_INDEX= (empty) installs torch from the default index only (CUDA on Linux x86-64)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO   ?= captures/demo

.PHONY: setup test test-slow test-all lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt scripts/install.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python scripts/install.py --constraints constraints.txt \
	  --extras test,compression,lightning,transformers --torch-index '$(TORCH_INDEX)'
	@# h5dump/h5ls let one test check that standard HDF5 tools read every capture file
	@command -v h5dump >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && apt-get install -y -qq hdf5-tools) >/dev/null 2>&1; } \
	  || echo "note: no h5dump (apt-get install hdf5-tools): its test will be skipped"
	touch $(STAMP)

# `make test`: lint and every test but the long end-to-end runs marked `slow` (under
# ~10 minutes on 2 cores); `make test-slow`: those alone; `make test-all`: lint and all.
# CI (.ci/run) runs `make test` and then `make test-slow`. pytest-xdist runs the test
# files in one worker per core (at most 4: many tests start processes of their own), a
# file's tests in one worker so its module fixtures (captures from real training) are
# made once; PYTEST_JOBS=0 runs them in this process. The slow tests run one at a time.
PYTEST_JOBS ?= auto
XDIST := $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS) --maxprocesses 4 --dist loadfile)
test: $(STAMP)
	$(BIN)/ruff check gradstat tests benchmarks
	$(BIN)/ruff format --check gradstat tests benchmarks
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/ruff check gradstat tests benchmarks
	$(BIN)/ruff format --check gradstat tests benchmarks
	$(BIN)/python -m pytest -q $(XDIST)

lint: $(STAMP)
	$(BIN)/ruff check --fix gradstat tests benchmarks
	$(BIN)/ruff format gradstat tests benchmarks

demo: $(STAMP)
	GRADSTAT=$(BIN)/gradstat OUT=$(DEMO) bash scripts/demo.sh

clean:
	rm -rf $(VENV) $(DEMO)
