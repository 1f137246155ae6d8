# The commands of the README: `make start`, `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: start demo test bench drills chromium bubblewrap

$(VENV)/.runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.test: requirements-test.txt requirements.txt $(VENV)/.runtime
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

# Browser tests drive Debian's Chromium (never a downloaded one); as root, install it if missing.
chromium:
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# Job sandboxes are Debian's bubblewrap (bwrap); as root, install it if missing.
bubblewrap:
	@command -v bwrap >/dev/null || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null)

## start: install what is missing, migrate, and run web + scheduler + a node agent (Ctrl-C stops)
start: $(VENV)/.runtime bubblewrap
	$(PY) manage.py up

## demo: like start, with a living simulated fleet (8 nodes, teams, budgets, a job generator)
demo: $(VENV)/.runtime bubblewrap
	$(PY) manage.py demo

## test: install what the tests need and run the whole suite (lint, migrations check, pytest)
test: $(VENV)/.test chromium bubblewrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	HANGAR_DATA_DIR=$${HANGAR_TEST_DATA_DIR:-$$(mktemp -d)} $(PY) manage.py makemigrations --check --dry-run
	HANGAR_DATA_DIR=$${HANGAR_TEST_DATA_DIR:-$$(mktemp -d)} $(PY) -m pytest -n $${HANGAR_TEST_WORKERS:-3} --dist loadfile

## bench: every benchmark, quick
bench: $(VENV)/.test
	for script in bench/*.py; do $(PY) $$script --quick || exit 1; done

## drills: the reliability drills alone, printing their figures (they also run in `make test`)
drills: $(VENV)/.test bubblewrap
	HANGAR_DATA_DIR=$${HANGAR_TEST_DATA_DIR:-$$(mktemp -d)} $(PY) -m pytest -m e2e tests/test_drills_agents.py tests/test_drills_services.py -s -q
