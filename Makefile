# Two commands on a fresh machine: `make demo` and `make test`.
# Both create the virtual environment when it is missing and install gradstat with
# pinned versions from constraints.txt (CPU build of torch).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO   ?= captures/demo

.PHONY: setup test test-slow test-all lint demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,lightning,transformers]'
	touch $(STAMP)

# `make test`: lint and every test but the long end-to-end runs marked `slow` (under
# ~10 minutes on 2 cores); `make test-slow`: those alone; `make test-all`: lint and all.
# CI (.ci/run) runs `make test` and then `make test-slow`.
test: $(STAMP)
	$(BIN)/ruff check gradstat tests benchmarks
	$(BIN)/ruff format --check gradstat tests benchmarks
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

test-all: $(STAMP)
	$(BIN)/ruff check gradstat tests benchmarks
	$(BIN)/ruff format --check gradstat tests benchmarks
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check --fix gradstat tests benchmarks
	$(BIN)/ruff format gradstat tests benchmarks

demo: $(STAMP)
	GRADSTAT=$(BIN)/gradstat OUT=$(DEMO) bash scripts/demo.sh

clean:
	rm -rf $(VENV) $(DEMO)
