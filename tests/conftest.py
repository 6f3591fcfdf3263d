"""Session fixtures: tiny random checkpoints and PEFT adapters, built once per run; and the
Triton-interpreter tests skipped, with the reason, where the installed Triton cannot run them."""
from __future__ import annotations

import importlib.util
import re
import signal
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


# The oldest Triton whose CPU interpreter runs the kernels. 3.6.0's fails on a loop bound loaded from
# memory (`range(0, rank, BLOCK_R)`: "only 0-dimensional arrays can be converted to Python scalars";
# checked 2026-11-30); 3.9.0 runs them; 3.7 and 3.8 were not tried. On a GPU 3.6 compiles them fine.
INTERPRETER_MIN_TRITON = (3, 9)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("triton") is None:
        return
    try:
        import triton
    except Exception:  # a broken install: the tests that need it fail on their own, with its error
        return

    found = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if found is None or (int(found[1]), int(found[2])) >= INTERPRETER_MIN_TRITON:
        return
    skip = pytest.mark.skip(reason=f"triton {triton.__version__}: its interpreter cannot run these kernels; "
                                   f"needs >= {'.'.join(map(str, INTERPRETER_MIN_TRITON))} (GPU runs are not affected)")
    for item in items:
        if item.get_closest_marker("interpreter") is not None:
            item.add_marker(skip)


@pytest.fixture
def interactive_sigint():
    """SIGINT as in a foreground process. A shell's background job (`make test &`, `nohup ... &`)
    starts with SIGINT ignored, and children inherit that through exec: a test that sends SIGINT to
    a subprocess would see it ignored. With a handler set here, a child starts with the default."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
