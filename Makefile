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

# Two processes: native crashes inside XLA (compile / serialize) were seen only late in one long process
# holding hundreds of executables; splitting bounds that (session fixtures are built once per half).
# scripts/run_tests.sh repeats a native fault's report at the end of the output.
test: $(VENV)/.test-deps
	PY=$(PY) scripts/run_tests.sh

clean:
	rm -rf $(VENV)
