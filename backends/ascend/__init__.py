"""Ascend NPU backend: torch_npu operator mapping (see backend.py). Never imports torch_npu at import time."""
