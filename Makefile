# `make train` and `make test` create (or refresh, when a requirements file changed) the virtualenv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup train test lint

$(STAMP): requirements.txt requirements-nodeps.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check .
