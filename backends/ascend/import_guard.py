"""Lazy import of ``torch_npu``, with the one-line reason when it cannot be imported.

``torch_npu`` is imported only when the npu backend is selected: importing ``runtime``
or ``backends`` never touches it. Two traps make the failure easy to misread:

- without the CANN toolkit, ``import torch_npu`` fails deep inside (``libhccl.so``);
- once torch_npu is installed, torch's device-backend autoload imports it during
  ``import torch`` itself, so a missing CANN breaks every torch program unless
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` is set.

The message below names both, on one line, never as a traceback.
"""
from __future__ import annotations

import importlib
from types import ModuleType

NEEDS_MESSAGE = (
    "npu backend needs torch_npu and the CANN toolkit: {error}. If torch_npu is installed without CANN, "
    "`import torch` itself fails unless TORCH_DEVICE_BACKEND_AUTOLOAD=0."
)


class TorchNpuImportError(ImportError):
    """torch_npu (or the CANN runtime under it) could not be imported; ``str()`` is one line."""


def one_line(error: BaseException) -> str:
    """``ClassName: message`` with all whitespace runs (newlines included) collapsed."""
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text}"


def import_torch_npu() -> ModuleType:
    """Import and return ``torch_npu``; raise ``TorchNpuImportError`` with the one-line reason.

    ImportError covers a missing package; OSError a missing CANN shared library;
    RuntimeError what torch_npu raises when its driver initialisation fails. Anything
    else is a bug and propagates unchanged.
    """
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as err:
        raise TorchNpuImportError(NEEDS_MESSAGE.format(error=one_line(err))) from err


def availability() -> tuple[bool, str]:
    """(available, one-line reason): torch_npu imports and ``torch.npu.is_available()``."""
    try:
        torch_npu = import_torch_npu()
    except TorchNpuImportError as err:
        return False, str(err)
    import torch  # torch_npu registers torch.npu on import

    if not torch.npu.is_available():
        return False, "npu backend: torch_npu imported but no Ascend device is visible (torch.npu.is_available() is False)"
    version = getattr(torch_npu, "__version__", "unknown version")
    return True, f"torch_npu {version}, {torch.npu.device_count()} device(s): {torch.npu.get_device_name()}"
