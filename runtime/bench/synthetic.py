"""Random Llama checkpoints and random PEFT adapters, written in the standard formats.

Nothing is downloaded: weights are ``N(0, 1/fan_in)`` draws saved as safetensors with
an HF ``config.json``, and the tokenizer is a real ``tokenizer.json`` (byte-level BPE
with no merges over the 256 byte symbols, so every string round-trips) built with the
``tokenizers`` library. Adapters are PEFT folders (``adapter_config.json`` +
``adapter_model.safetensors``) with non-zero A and B, so they change the output.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import save_file

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    vocab_size: int = 300
    max_position_embeddings: int = 1024

    @classmethod
    def sized(cls, hidden: int, layers: int) -> "LlamaShape":
        """The benchmarks' llama for ``--hidden``/``--layers``: head dim 64 (one head below 64),
        intermediate 2 x hidden, no GQA."""
        heads = max(1, hidden // 64)
        if hidden < 1 or layers < 1 or hidden % heads:
            raise ValueError(f"hidden size {hidden} / layers {layers}: need positive sizes, and hidden divisible into max(1, hidden // 64) = {heads} heads")
        if (hidden // heads) % 2:  # rotary embeddings rotate pairs of channels
            raise ValueError(f"hidden size {hidden} gives {heads} heads of {hidden // heads} channels; rotary embeddings need an even head size")
        return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=heads)  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def module_dims(self) -> dict[str, tuple[str, int, int]]:
        """module -> (block, in, out)."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
            "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i), "down_proj": ("mlp", i, h),
        }


    def adapter_nbytes(self, rank: int, targets: Sequence[str]) -> int:
        """Host bytes of a ``build_random_adapter`` of ``rank`` on ``targets``: A [rank, in] and
        B [out, rank] per target and layer, float32 as the loader keeps them (``LoRAAdapter.nbytes``)."""
        dims = self.module_dims()
        return self.num_hidden_layers * sum(rank * (dims[t][1] + dims[t][2]) * 4 for t in targets)


def write_byte_tokenizer(out_dir: Path, vocab_size: int, chat_template: str | None = None, model_max_length: int | None = None) -> dict[str, int]:
    """Byte-level BPE tokenizer (no merges) + tokenizer_config.json; returns the special token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {sym: i for i, sym in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for tok in (BOS, EOS, PAD):
        vocab[tok] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(vocab)} tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])])
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True, "add_eos_token": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    if model_max_length is not None:
        cfg["model_max_length"] = model_max_length
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return {"bos": vocab[BOS], "eos": vocab[EOS], "pad": vocab[PAD]}


def build_random_llama(out_dir: str | Path, shape: LlamaShape = LlamaShape(), seed: int = 0) -> Path:
    """Write a random Llama checkpoint (float32) + tokenizer into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special = write_byte_tokenizer(out, shape.vocab_size)
    gen = torch.Generator().manual_seed(seed)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) / dims[-1] ** 0.5

    h = shape.hidden_size
    tensors = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": torch.ones(h), "lm_head.weight": rand(shape.vocab_size, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        for name, (block, n_in, n_out) in shape.module_dims().items():
            tensors[f"{p}{block}.{name}.weight"] = rand(n_out, n_in)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **{k: v for k, v in asdict(shape).items()},
        "head_dim": shape.head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": special["bos"], "eos_token_id": special["eos"], "pad_token_id": special["pad"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": special["bos"], "eos_token_id": special["eos"]}))
    return out


def build_random_adapter(out_dir: str | Path, shape: LlamaShape, rank: int, seed: int, targets: Sequence[str] = ATTENTION) -> Path:
    """Write a PEFT LoRA folder for ``shape`` with random A, B (scale alpha/r = 2)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dims = shape.module_dims()
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for name in targets:
            block, n_in, n_out = dims[name]
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none",
              "use_dora": False, "use_rslora": False, "modules_to_save": None, "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
              "base_model_name_or_path": "synthetic-llama"}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def build_random_adapters(root: str | Path, shape: LlamaShape, ranks: Mapping[str, int], seed: int = 0) -> dict[str, Path]:
    """One adapter folder per (name, rank) under ``root``."""
    root = Path(root)
    return {name: build_random_adapter(root / name, shape, rank, seed + i) for i, (name, rank) in enumerate(sorted(ranks.items()))}
