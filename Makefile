# lorafleet: `make run` serves the bundled demo, `make test` runs the test suite.
# Both create .venv when it is missing. torch is installed first and pinned, so a
# CPU-only machine never resolves a multi-GB CUDA build of torch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.lorafleet-installed

.PHONY: run test venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/lorafleet serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
