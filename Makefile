# Entry points; each creates the virtualenv and installs what it needs on first use.
#   make run       - the OpenAI-compatible server on the embedded default model (PORT=8000)
#   make generate  - complete a prompt with the embedded default model (PROMPT="...")
#   make test      - the test suite (CPU; HF transformers as the numerical oracle)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= def add(a, b):
PORT ?= 8000

.PHONY: run generate test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test-deps: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $@ $(VENV)/.run-deps

run: $(VENV)/.run-deps
	$(PY) -m atlas_jax.serve --port $(PORT)

generate: $(VENV)/.run-deps
	$(PY) -m atlas_jax.generate --prompt "$(PROMPT)"

# pytest-xdist, one worker per core (scripts/run_tests.sh; a crashed worker's report repeated at the end).
test: $(VENV)/.test-deps
	PY=$(PY) scripts/run_tests.sh

clean:
	rm -rf $(VENV)
