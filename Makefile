# kvserve — `make serve` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvserve-installed

.PHONY: install serve test bench bench-quick bench-serving bench-budget load-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall when the project's dependency files change.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Benchmarks (not tests): numbers for the README tables.
bench: $(STAMP)
	$(BIN)/kvserve bench --out reports/bench

bench-quick: $(STAMP)
	$(BIN)/kvserve bench --quick --out reports/bench-quick

bench-serving: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test,bench]"
	$(BIN)/python -m bench.serving

bench-budget: $(STAMP)
	$(BIN)/python -m bench.budget

load-test: $(STAMP)
	$(BIN)/python -m bench.load_test

clean:
	rm -rf $(VENV) .pytest_cache
