# One gate: `make test` is what CI runs (lint, format, types, tests). It names the 25 slowest
# tests, so the suite's 15-minute budget is watched in every CI log.
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8080
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION := 1
# Some hosts set PYTHONDONTWRITEBYTECODE, and uv installs no .pyc: every Python process (each
# test worker, each `shoal dev`) would then compile botocore, moto and aws_cdk from source.
unexport PYTHONDONTWRITEBYTECODE
# Python's objects in transparent huge pages (THP granted on request, Debian's default): CI's
# VM walks page tables slowly, so every pass over the heap (the collector's, a dict of moto's
# items) paid about 100 us a 4 KB page. Measured there: one gc.collect() of 300,000 objects
# 39.9 s with pymalloc's 4 KB-paged arenas, 1.3 s with glibc's malloc asked for huge pages; the
# topic unit tests and the publish API module side by side 126 s vs not three quarters done at
# 460 s. Both variables reach every child: test workers, `shoal dev`, its Lambda workers, mypy.
export PYTHONMALLOC := malloc
export GLIBC_TUNABLES := glibc.malloc.hugetlb=1

.PHONY: install run test lint unit bench lock clean chromium

# The venv is made without pip (ensurepip took 2 minutes on CI's machine; pip comes pinned from
# requirements.txt) and uv goes in with the machine's pip. uv reads its cache offline first:
# this machine's package proxy sends no caching headers, so online uv asked the index again for
# each of 121 packages (2 minutes) and downloaded and rebuilt PySpark's 317 MB sdist (5 minutes)
# at every install. Requirements are pinned, so what is cached is what the network would give;
# a cold cache falls back to the network.
UV_VERSION := 0.13.9
# The venv's Python is the Lambda runtime's (infra: python3.12): pyenv's 3.12 where it is
# installed, else a python3.12 on PATH, else python3 (tests/infra/test_package_limits.py then
# says the two differ). PySpark's jobs run on EMR's Python 3.9 apart (tests/pipeline).
PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3.12) $(shell command -v python3.12) python3)

$(BIN)/.installed: requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	test -x $(BIN)/uv || $(PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore --prefix $(VENV) uv==$(UV_VERSION)
	$(BIN)/uv pip install -q --python $(BIN)/python --offline -r requirements.txt -e '.[dev]' 2>/dev/null \
		|| $(BIN)/uv pip install -q --python $(BIN)/python -r requirements.txt -e '.[dev]'
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/shoal dev --host 127.0.0.1 --port $(PORT) --state-dir .shoal

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The console's browser tests (tests/e2e/test_console.py) drive the system's Chromium, never a
# browser of Playwright's own. A fresh machine has none: root with apt-get gets Debian's package
# (so CI, which runs only `make test`); anyone else is told how in one line, before the install
# and the suite, rather than see those tests fail 14 minutes later. They are never skipped.
# SHOAL_CHROMIUM names another Chromium, for this check and the tests alike.
DEBIAN_CHROMIUM := /usr/bin/chromium
SHOAL_CHROMIUM ?= $(DEBIAN_CHROMIUM)
export SHOAL_CHROMIUM

chromium:
	@test -x "$(SHOAL_CHROMIUM)" || { \
		if [ "$(SHOAL_CHROMIUM)" = "$(DEBIAN_CHROMIUM)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null; then \
			echo "make: no Chromium at $(SHOAL_CHROMIUM); installing Debian's chromium for the browser tests"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null; \
		fi; \
		test -x "$(SHOAL_CHROMIUM)" || { \
			echo "make: no Chromium at $(SHOAL_CHROMIUM) for the console's browser tests: install Debian's (apt-get install chromium, as root) or name another (SHOAL_CHROMIUM=/path/to/chromium)" >&2; \
			exit 1; }; }

# mypy runs beside pytest, not before it: started cold (as in CI) it is several CPU-minutes,
# and the end-to-end tests leave a core idle while they wait on timers (ack timeouts, the
# reaper's schedule). Both must pass; mypy's report is printed after the tests'.
test: chromium install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(BIN)/mypy > $(VENV)/mypy.out 2>&1 & types=$$!; \
	$(BIN)/pytest -n 2 --dist loadfile -q --durations=25; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.out; \
	test $$tests -eq 0 && test $$typed -eq 0

unit: install
	$(BIN)/pytest -q tests/unit

bench: install
	$(BIN)/python -m bench

lock:
	$(BIN)/uv pip compile requirements.in -p 3.12 -q --no-header -o requirements.txt

clean:
	rm -rf $(VENV) cdk.out .shoal
