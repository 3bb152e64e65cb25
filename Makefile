# opd: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := out/demo

.PHONY: setup demo test test-fast lint bench clean

$(BIN)/opd-rollout: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,eval,publish,data,test]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

setup: $(BIN)/opd-rollout

demo: setup
	scripts/demo.sh

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python scripts/import_graph.py --check

bench: setup
	$(BIN)/python benchmarks/bench_io.py
	$(BIN)/python benchmarks/bench_rollout_cpu.py

clean:
	rm -rf $(VENV) out .pytest_cache
