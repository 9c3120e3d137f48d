# One gate: `make test` is what CI runs (lint, format, types, tests). It names the 25 slowest
# tests, so the suite's 15-minute budget is watched in every CI log.
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8080
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION := 1

.PHONY: install run test lint unit bench lock clean

$(BIN)/.installed: requirements.txt pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check uv
	$(BIN)/uv pip install -q --python $(BIN)/python -r requirements.txt -e '.[dev]'
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/shoal dev --host 127.0.0.1 --port $(PORT) --state-dir .shoal

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -n 2 --dist loadfile -q --durations=25

unit: install
	$(BIN)/pytest -q tests/unit

bench: install
	$(BIN)/python -m bench

lock:
	$(BIN)/uv pip compile requirements.in -p 3.11 -q --no-header -o requirements.txt

clean:
	rm -rf $(VENV) cdk.out .shoal
