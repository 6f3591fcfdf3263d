"""Session fixtures: tiny random checkpoints and PEFT adapters, built once per run."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_models import build_standard_adapters, build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> adapter folder for the tiny llama: ranks 4/8/16, rsLoRA, rank/alpha patterns, MLP targets."""
    return build_standard_adapters(tiny_llama_dir, tmp_path_factory.mktemp("tiny_adapters"))


@pytest.fixture(scope="session")
def tiny_qwen2_adapters(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same adapter set, built for the tiny qwen2."""
    return build_standard_adapters(tiny_qwen2_dir, tmp_path_factory.mktemp("tiny_qwen2_adapters"))
