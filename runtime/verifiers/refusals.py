"""Verifiers for the int8 weight-only base and DoRA.

int8 base, declared supported: ``runtime.quant.capability.check_int8_base`` on the backend.
DoRA, declared unsupported: a real PEFT adapter folder with ``use_dora: true`` (config +
``adapter_model.safetensors`` with the magnitude vectors PEFT saves) is written to a temp
dir and loaded through ``runtime.lora.adapter.load_adapter``, the reader
``LLMEngine.load_adapter_files`` and the adapter pool use; it must be refused with an
``AdapterError`` that names DoRA and quotes the matrix entry. The same folder with
``use_dora: false`` and no magnitude vectors must load, so the refusal is DoRA's and not a
malformed folder's. DoRA declared supported fails, since no backend implements its
magnitude vector.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from runtime.capabilities import DEFAULT_MATRIX_PATH, Capability, CapabilityMatrix
from runtime.verifiers.result import VerificationFailure, VerifierResult, verifier

DORA_RANK, DORA_WIDTH, DORA_LAYERS = 4, 16, 1
DORA_TARGETS = {"q_proj": (DORA_WIDTH, DORA_WIDTH), "v_proj": (DORA_WIDTH, DORA_WIDTH)}


def write_peft_adapter(folder: Path, use_dora: bool, seed: int = 0) -> Path:
    """A PEFT LoRA folder (as ``runtime.bench.synthetic.build_random_adapter`` writes one) for a
    ``DORA_LAYERS``-layer model with q_proj / v_proj of ``DORA_WIDTH``; with ``use_dora`` also the
    per-output-row ``lora_magnitude_vector`` tensors PEFT saves for a DoRA adapter."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(DORA_LAYERS):
        for name, (n_in, n_out) in DORA_TARGETS.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(DORA_RANK, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, DORA_RANK, generator=g) * 0.02
            if use_dora:
                tensors[f"{key}.lora_magnitude_vector"] = torch.rand(n_out, generator=g) + 0.5
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": DORA_RANK, "lora_alpha": 2 * DORA_RANK, "target_modules": sorted(DORA_TARGETS),
              "bias": "none", "use_dora": use_dora, "use_rslora": False, "modules_to_save": None, "task_type": "CAUSAL_LM",
              "lora_dropout": 0.0, "base_model_name_or_path": "probe-llama"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def dora_refused(entry: Capability, matrix: CapabilityMatrix) -> str:
    """The refusal message a real ``use_dora: true`` folder gets from the adapter loader."""
    from runtime.lora.adapter import AdapterError, load_adapter

    def load(folder: Path) -> Any:
        return load_adapter(folder, folder.name, DORA_TARGETS, num_layers=DORA_LAYERS, max_lora_rank=DORA_RANK)

    with tempfile.TemporaryDirectory(prefix="lorafleet-probe-dora-") as tmp:
        plain = write_peft_adapter(Path(tmp) / "plain-lora", use_dora=False)
        try:
            load(plain)
        except AdapterError as err:
            raise VerificationFailure(f"the probe's plain LoRA folder (use_dora: false) does not load, so the DoRA check proves nothing: {err}") from err
        try:
            load(write_peft_adapter(Path(tmp) / "dora", use_dora=True))
        except AdapterError as err:
            message = str(err)
        else:
            raise VerificationFailure("declared unsupported, but a PEFT folder with use_dora: true loaded through runtime.lora.adapter.load_adapter")
    if "DoRA" not in message or "use_dora" not in message:
        raise VerificationFailure(f"a use_dora: true folder was refused, but the message does not name DoRA (use_dora): {message}")
    if entry.key not in message or DEFAULT_MATRIX_PATH.name not in message:  # the loader quotes the matrix the runtime reads
        raise VerificationFailure(f"the DoRA refusal does not point to the matrix entry {DEFAULT_MATRIX_PATH.name} [{entry.key}]: {message}")
    return message


dora_refused.how = "a use_dora: true PEFT folder, by runtime.lora.adapter.load_adapter"  # type: ignore[attr-defined]


@verifier("quantized_base_int8")
def verify_quantized_base_int8(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    """int8 base linear + mixed-rank float LoRA + no-adapter rows vs float64, per declared dtype."""
    import torch

    from runtime.quant.capability import check_int8_base

    names = entry.limits.dtypes or ("float32",)
    try:
        figures = check_int8_base(backend, dtypes=tuple(getattr(torch, n) for n in names))
    except AssertionError as err:
        raise VerificationFailure(str(err)) from err
    detail = ", ".join(f"{k.removeprefix('rel_err_')}={v:.1e}" for k, v in figures.items())
    return VerifierResult("pass", f"int8 base + mixed-rank float LoRA vs float64, relative max err: {detail}", figures)


@verifier("dora", refusal=dora_refused)
def verify_dora(backend: Any, entry: Capability, matrix: CapabilityMatrix) -> VerifierResult:
    raise VerificationFailure("declared supported, but no backend implements DoRA's magnitude vector")
