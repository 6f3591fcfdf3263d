"""The Ascend NPU backend (registry name ``npu``): torch_npu operators for LoRA, with
declared plain-torch fallbacks, and gather + SDPA attention (device-generic).

``AscendBackend(device="npu", npu_ops=None, soc_name=None)``:

- ``npu_ops`` provides ``npu_grouped_matmul`` and ``npu_batch_gather_matmul_``. ``None``
  imports ``torch_npu`` (lazily, here, never at module import). Tests inject an
  emulation of the documented semantics; nothing ships one as a fallback.
- ``soc_name`` is the device name (``Ascend910B2``...). ``None`` asks
  ``torch_npu.npu.get_device_name``. It decides which ops are allowed (``soc.py``).
"""
from __future__ import annotations

import torch

from backends.ascend import import_guard
from backends.ascend.fallback_log import FallbackLog
from backends.ascend.lora_ops import AscendLoRAOps
from backends.ascend.soc import SocFamily, classify, lacks_bfloat16
from backends.reference import ReferenceAttention


CHIP_FALLBACK_REASONS = {
    SocFamily.ATLAS_A2: frozenset(),
    SocFamily.ATLAS_INFERENCE_310P: frozenset({"prefill:dtype", "prefill:n-multiple-16", "decode:soc"}),
    SocFamily.OTHER: frozenset({"prefill:soc", "decode:soc"}),
}


class AscendBackend:
    name = "npu"

    def __init__(self, device: str | torch.device = "npu", npu_ops=None, soc_name: str | None = None) -> None:
        torch_npu = None
        if npu_ops is None or soc_name is None:
            torch_npu = import_guard.import_torch_npu()  # registers the "npu" device type with torch
        self.device = torch.device(device)
        if soc_name is None:
            try:
                soc_name = torch_npu.npu.get_device_name(self.device)
            except (AssertionError, RuntimeError) as err:  # no visible device: torch_npu asserts "Invalid device id"
                raise RuntimeError(f"npu backend: cannot read the name of device {self.device} ({import_guard.one_line(err)}); "
                                   "is an Ascend device visible to this process (ASCEND_RT_VISIBLE_DEVICES, npu-smi info)?") from None
        self.soc_name = soc_name
        self.soc = classify(soc_name)
        self.fallbacks = FallbackLog()
        self.lora = AscendLoRAOps(torch_npu if npu_ops is None else npu_ops, self.soc, self.fallbacks)
        self.attention = ReferenceAttention()

    @property
    def chip_fallback_reasons(self) -> frozenset[str]:
        """The fallback reasons this chip family takes whatever the problem within the matrix's
        primary limits (those limits hold for Atlas A2; the declared fallbacks name the others):
        310P runs the grouped matmul in fp16 with N % 16 == 0 only and has no fused decode op; any
        other chip has neither op."""
        return CHIP_FALLBACK_REASONS[self.soc]

    def dtype_problem(self, dtype: str) -> str | None:
        """Why this chip cannot serve in ``dtype`` (the engine refuses the config with it), or None."""
        if dtype == "bfloat16" and lacks_bfloat16(self.soc_name):
            return (f"{self.soc_name} has no bfloat16 (the Ascend docs mark bf16 unsupported on its product line); "
                    "serve with --dtype float16 or float32")
        return None

    @staticmethod
    def availability() -> tuple[bool, str]:
        return import_guard.availability()

    def synchronize(self) -> None:
        if self.device.type == "npu":
            torch.npu.synchronize(self.device)
