"""Llama-family decoder (llama, qwen2, mistral) on the backend's paged attention and LoRA ops.

For every layer, with RMSNorm(x) = w * x / sqrt(mean(x^2) + eps) computed in float32:

    a         = RMSNorm_in(h)
    q, k, v   = split(a @ [Wq; Wk; Wv]^T (+ b_qkv)) + LoRA per slice        (one fused GEMM)
    q, k      = rope(q, pos), rope(k, pos)
    o         = paged_attention(q, k, v) @ Wo^T (+ b_o) + LoRA_o             (GQA: Hq / Hkv query heads per kv head)
    h         = h + o
    m         = RMSNorm_post(h)
    g, u      = split(m @ [Wgate; Wup]^T (+ b_gate_up)) + LoRA per slice     (one fused GEMM)
    h         = h + (silu(g) * u) @ Wdown^T (+ b_down) + LoRA_down
logits = RMSNorm_final(h) @ Wlm^T     (Wlm = embedding matrix when tie_word_embeddings)

A projection weight W may be an ``Int8Weight`` (int8 weight-only base): then
``x @ W^T`` is computed as ``(x @ q^T) * s`` (float16: ``x @ (q * s)^T``) by ``LoRALinear``; LoRA stays float.

Rows of a step are the concatenated new tokens of several sequences; the per-step
``AttentionMeta`` and ``LoRABatchMeta`` are built once and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.backend_api import AttentionOps, LoRAOps
from runtime.kv.attention_meta import AttentionMeta
from runtime.lora.batch_meta import LoRABatchMeta
from runtime.lora.layers import LoRALinear, fuse
from runtime.lora.slice_weights import LoRASliceWeights
from runtime.models.dense import dense_linear, float32_packed, pack_weight
from runtime.models.hf_config import ModelConfig
from runtime.models.rope import RotaryEmbedding
from runtime.quant.int8 import Int8Weight

# Fused projection -> its HF module names, in stacking order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module name -> (in_features, out_features) of every LoRA-targetable linear (``LORA_TARGET_MODULES``)."""
    h, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return dict(zip(LORA_TARGET_MODULES, ((h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h))))


@dataclass(frozen=True)
class LoRAPoolShape:
    """How big each slice's LoRA row buffers are."""

    max_slots: int
    row_capacity: int
    interleaved_a: bool = False  # the backend's ops want fused projections' A rows interleaved


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32 like HF, scaled in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, idx: int, w: dict[str, Tensor | Int8Weight], pool: LoRAPoolShape, pack_float32: bool) -> None:
        p = f"model.layers.{idx}."
        targets = lora_targets(cfg)
        dtype, device = w[p + "input_layernorm.weight"].dtype, w[p + "input_layernorm.weight"].device

        def proj(fused: str) -> LoRALinear:
            names = FUSED_PROJECTIONS[fused]
            # Popped: once fused (and packed, where cpu_gemm says so), the plain tensors can be freed while the next layers load.
            weights = [w.pop(f"{p}{MODULE_PARENT[n]}.{n}.weight") for n in names]
            biases = [w.get(f"{p}{MODULE_PARENT[n]}.{n}.bias") for n in names]
            if any(b is not None for b in biases) and any(b is None for b in biases):
                raise ValueError(f"layer {idx}: {fused} has a bias on some slices only")
            bias = fuse([b for b in biases if b is not None]) if biases[0] is not None else None
            slices = LoRASliceWeights.allocate_projection(
                targets[names[0]][0], [targets[n][1] for n in names], pool.max_slots, pool.row_capacity, dtype, device, pool.interleaved_a
            )
            base = fuse(weights)
            packed = base if isinstance(base, Int8Weight) else pack_weight(base, float32=pack_float32)
            return LoRALinear(packed, bias, names, [targets[n][1] for n in names], slices)

        self.input_norm = w[p + "input_layernorm.weight"]
        self.post_norm = w[p + "post_attention_layernorm.weight"]
        self.projections = {fused: proj(fused) for fused in FUSED_PROJECTIONS}
        self.eps = cfg.rms_norm_eps
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size, self.inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.scale = cfg.head_dim**-0.5

    def forward(self, h: Tensor, rope_tables: tuple[Tensor, Tensor], kv_cache: Tensor, ctx: "StepContext") -> Tensor:
        t = h.shape[0]
        proj = self.projections
        a = rms_norm(h, self.input_norm, self.eps)
        qkv = proj["qkv_proj"].forward(a, ctx.ops, ctx.lora_meta, ctx.workspace)
        # q and k are side by side in qkv: one rotation of their Hq + Hkv heads.
        qk = RotaryEmbedding.rotate(qkv[:, : self.q_size + self.kv_size].reshape(t, self.hq + self.hkv, self.d), rope_tables)
        q, k = qk[:, : self.hq], qk[:, self.hq :]
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.hkv, self.d)
        attn = ctx.attention.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, ctx.attn_meta, self.scale)
        h = h + proj["o_proj"].forward(attn.reshape(t, self.q_size), ctx.ops, ctx.lora_meta, ctx.workspace)
        m = rms_norm(h, self.post_norm, self.eps)
        gate, up = proj["gate_up_proj"].forward(m, ctx.ops, ctx.lora_meta, ctx.workspace).split([self.inter, self.inter], dim=-1)
        return h + proj["down_proj"].forward(F.silu(gate) * up, ctx.ops, ctx.lora_meta, ctx.workspace)


@dataclass(frozen=True)
class StepContext:
    """What every layer needs for one step besides its own weights."""

    attn_meta: AttentionMeta
    lora_meta: LoRABatchMeta
    ops: LoRAOps  # backend.lora
    attention: AttentionOps  # backend.attention
    workspace: Tensor  # float32 [n_slices >= 3, T, max rank] shrink buffer


class LlamaModel:
    """The decoder: embeddings, layers, final norm, LM head (see module docstring).

    Building it takes the projection and LM-head entries out of ``weights``: the model keeps its
    own fused (and on the CPU, where ``cpu_gemm`` chooses oneDNN, packed) copies, and the plain ones are freed as it goes, so loading
    never holds two copies of every projection."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor | Int8Weight], pool: LoRAPoolShape, max_positions: int,
                 cpu_gemm: str = "auto") -> None:
        self.config = cfg
        # The float32 kernel on the CPU: packed for oneDNN or plain on F.linear (EngineConfig.cpu_gemm, dense.float32_packed).
        pack_float32 = float32_packed(cpu_gemm)
        self.embed = weights["model.embed_tokens.weight"]
        # A tied head stays plain: the embedding lookup reads the same tensor.
        self.lm_head = self.embed if cfg.tie_word_embeddings else pack_weight(weights.pop("lm_head.weight"), float32=pack_float32)
        self.norm = weights["model.norm.weight"]
        self.layers = [DecoderLayer(cfg, i, weights, pool, pack_float32) for i in range(cfg.num_hidden_layers)]
        self.rope = RotaryEmbedding(cfg, self.embed.device, max_positions)

    def forward(self, token_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], ctx: StepContext) -> Tensor:
        """token_ids, positions: [T] -> final-normed hidden states [T, H]."""
        h = self.embed.index_select(0, token_ids)
        rope_tables = self.rope.tables(positions, h.dtype)  # q and k come out of the projections in h's dtype
        for layer, cache in zip(self.layers, kv_caches):
            h = layer.forward(h, rope_tables, cache, ctx)
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, H] -> float32 [N, vocab]."""
        return dense_linear(hidden, self.lm_head).float()

    def lora_linear(self, layer: int, module: str) -> tuple[LoRALinear, int]:
        """The fused projection holding HF module ``module`` of ``layer``, and its slice index."""
        for fused, names in FUSED_PROJECTIONS.items():
            if module in names:
                lin = self.layers[layer].projections[fused]
                return lin, lin.slice_index(module)
        raise KeyError(f"{module!r} is not a LoRA target of this model")

    def all_slices(self) -> list[tuple[int, str, LoRASliceWeights]]:
        out = []
        for i, layer in enumerate(self.layers):
            for lin in layer.projections.values():
                out.extend((i, name, s) for name, s in zip(lin.slice_names, lin.slices))
        return out

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        total = sum(t.numel() * t.element_size() for t in tensors)
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in (layer.input_norm, layer.post_norm))
            total += sum(lin.nbytes() for lin in layer.projections.values())
        return total
