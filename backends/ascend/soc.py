"""Which Ascend chip family a device belongs to, from its name.

torch_npu's op docs state support per product line: "Atlas A2 训练系列产品/Atlas 800I A2
推理产品" (Atlas A2 training / 800I A2 inference: SoC names ``Ascend910B*``) and "Atlas
推理系列产品" (Atlas inference cards: ``Ascend310P*``). torch_npu itself compares
``get_device_name()`` against the ``Ascend910B`` prefix the same way. Any other name
(A3 ``Ascend910_93*``, older 910, unknown) is ``OTHER``: the docs promise nothing for it,
so the backend uses only the plain-torch path there (declared fallback).
"""
from __future__ import annotations

import enum


class SocFamily(enum.Enum):
    ATLAS_A2 = "atlas_a2"
    ATLAS_INFERENCE_310P = "atlas_inference_310p"
    OTHER = "other"


def classify(soc_name: str) -> SocFamily:
    """Map a device name such as ``Ascend910B2`` or ``Ascend310P3`` to its family."""
    if soc_name.startswith("Ascend910B"):
        return SocFamily.ATLAS_A2
    if soc_name.startswith("Ascend310P"):
        return SocFamily.ATLAS_INFERENCE_310P
    return SocFamily.OTHER


# Product lines whose docs mark bfloat16 unsupported ("Atlas 推理系列产品" 310P, "Atlas 200I/500 A2
# 推理产品" 310B, and the first "Atlas 训练系列产品" 910s): the Ascend C bf16 conversion APIs
# (ToBfloat16, __bfloat162float...) carry an "x" for each. A2 (910B) and A3 (910_93) have it.
NO_BFLOAT16_PREFIXES = ("Ascend310P", "Ascend310B", "Ascend910A", "Ascend910ProA", "Ascend910PremiumA", "Ascend910ProB")


def lacks_bfloat16(soc_name: str) -> bool:
    """True for a chip whose product line the docs mark as having no bfloat16 (an unknown name: False)."""
    return soc_name.startswith(NO_BFLOAT16_PREFIXES)
