# lorafleet: `make run` serves the bundled demo, `make test` runs the test suite.
# Both create .venv when it is missing; `make run` installs only what serving needs, `make test`
# adds the test extra (transformers, peft, ray[serve], triton, ...). torch is installed first, pinned (TORCH_PIN),
# through pip's own configuration unless TORCH_INDEX names a wheel index, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu   (PyTorch's CPU-only wheels; on
#   plain PyPI the default Linux torch wheel is a CUDA build)
#   make run PORT=8001   (the demo server's port; HOST likewise)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.lorafleet-installed
TEST_STAMP := $(VENV)/.lorafleet-test-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )"$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(TEST_STAMP)

venv: $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/lorafleet serve --host $(HOST) --port $(PORT)

test: $(TEST_STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
