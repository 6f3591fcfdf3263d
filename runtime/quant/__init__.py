"""Quantized base weights: int8 weight-only with per-output-channel scales (see int8.py)."""
from runtime.quant.int8 import (
    QUANT_METHOD,
    QUANTIZATION_CONFIG,
    Int8Weight,
    QuantizationConfigError,
    dequantize_int8,
    int8_linear,
    is_quantized_projection,
    quantization_scheme,
    quantize_int8,
)

__all__ = [
    "QUANT_METHOD",
    "QUANTIZATION_CONFIG",
    "Int8Weight",
    "QuantizationConfigError",
    "dequantize_int8",
    "int8_linear",
    "is_quantized_projection",
    "quantization_scheme",
    "quantize_int8",
]
