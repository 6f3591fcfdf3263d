"""Tokenizer class: the transformers class ``AutoTokenizer`` loads a checkpoint's tokenizer as, and
what that class makes of the special tokens around an encoded text (checked with transformers 5.24).

With a ``tokenizer.json`` in the checkpoint (which lorafleet requires), transformers drops
tokenizer_config.json's ``add_bos_token`` and ``add_eos_token`` before it builds the tokenizer,
whatever its class (``PreTrainedTokenizerBase._from_pretrained``): tokenizer.json's post-processor
alone says which special tokens ``encode`` adds, and a tokenizer.json without one adds none
(``TokenizersBackend.update_post_processor``, both flags off). So ``[256, 71, 72]`` for a
tokenizer.json whose post-processor puts bos first, with or without ``add_eos_token: true``;
``LlamaTokenizer``, ``Qwen2Tokenizer``, ``Qwen3_5Tokenizer``, ``GemmaTokenizer``, ``GPT2Tokenizer`` and the generic
``TokenizersBackend`` (``PreTrainedTokenizerFast``) all keep the post-processor so.

``REBUILT_POST_PROCESSORS``: the classes (for decoder-only checkpoints) whose ``__init__`` puts a
post-processor of their own in its place, from their defaults, the config's flags being gone:
``CodeLlamaTokenizer`` always puts bos first and never appends eos, ``GPTNeoXTokenizer`` adds
nothing. The bos is the tokenizer's named one.

``CLASS_SPECIAL_TOKENS``: the special tokens (bos, eos, unk, pad, ...) a class defaults to
when neither tokenizer_config.json nor special_tokens_map.json has the key (``"bos_token": null``
names none): ``LlamaTokenizer`` and ``CodeLlamaTokenizer`` ``<s>`` / ``</s>`` / ``<unk>``,
``GPTNeoXTokenizer`` ``<|endoftext|>``, ... (``TokenizersBackend`` has none); a pad token none
names is tokenizer.json's ``padding.pad_token`` for a class without one (``with_padding_pad_token``). They are the
tokenizer's as if named: CodeLlamaTokenizer's bos first, the eos among the stop tokens, the chat
template's variables. As in transformers (``TokenizersBackend.__init__``), each special token the
configs name (``special_token_values``: the named ones, model-specific ``*_token`` keys such as
``image_token``, ``extra_special_tokens`` / ``additional_special_tokens``) that tokenizer.json does
not list among its added tokens becomes an added token (a new id when the vocabulary lacks it),
except that a bos or eos the vocabulary lacks is refused (``TokenizerError``), as every prompt or
stop would then hold an id the model does not have. A token listed twice (as a string and as an
object with other flags) gets its first listing's id and its last listing's flags, as in
transformers, and the declared added tokens (tokenizer_config.json's ``added_tokens_decoder``, else
tokenizer.json's) are added again first, a named one as special (``tokens_to_add``);
``Qwen2Tokenizer`` and ``CohereTokenizer`` then add them again, with other flags
(``readded_special_tokens``). ``template_tokens``: those a chat template sees as variables (the
named and the model-specific ones, as transformers' ``special_tokens_map``).
CodeLlamaTokenizer's defaults include its infilling tokens (``prefix_token`` ``▁<PRE>``, ...,
``fill_token`` ``<FILL_ME>``: model-specific tokens, so a string the config gives is one too;
null: none), which are its extra special tokens as well (``with_class_defaults``).
``with_special_tokens_map`` reads the two config files as transformers does. ``infilling_token``:
the text (``<FILL_ME>``) for which CodeLlamaTokenizer encodes an infilling prompt, which lorafleet
refuses rather than reproduce.
These classes, and others, also build their own normaliser, pre-tokenizer and decoder:
``runtime.tokenizer_pipeline``.

``auto_tokenizer_class(tokenizer_config, model_config, byte_level)``: the class, as ``AutoTokenizer`` picks it for
the model types lorafleet serves: ``qwen2`` always loads ``Qwen2Tokenizer`` and ``mistral``
``TokenizersBackend`` (without mistral-common), whatever class the configs name (and so do the
``qwen3_5`` types, which lorafleet's models do not serve, ``Qwen3_5Tokenizer``); otherwise
(``llama``, or no ``model_type``) tokenizer_config.json's ``tokenizer_class``, else
config.json's, with ``Fast`` taken off, as transformers looks it up; none named (or
``PreTrainedTokenizerFast``) is ``TokenizersBackend``, and so is ``LlamaTokenizer`` over a tokenizer.json whose text names
``"ByteLevel"`` (transformers' ``_tokenizer_json_has_byte_level``: Llama-3-style checkpoints that
name LlamaTokenizer), and a name in ``CLASS_ALIASES`` is the class transformers loads for it
(``Phi3Tokenizer``: ``LlamaTokenizer``). Any other name is returned as named: where transformers
loads ``TokenizersBackend`` instead (a name it does not know) the tokens are the same, since such a
name is neither in ``REBUILT_POST_PROCESSORS`` nor in ``runtime.tokenizer_pipeline``'s
``REBUILT_PIPELINES``: it keeps tokenizer.json's steps and post-processor. Not reproduced, and
refused when the tokenizer loads (``unreproduced_class``): the other classes that build their own
steps or post-processor (``REBUILDING_CLASSES_NOT_REPRODUCED``: transformers' encoder and seq2seq
classes, ``BertTokenizer``, ``T5Tokenizer``, ...) and the Python tokenizers that never read
tokenizer.json (``PYTHON_CLASSES``: ``ByT5Tokenizer``, ...); and ``auto_map`` (remote code, which
lorafleet never runs).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Collection, Mapping, Sequence

GENERIC_CLASS = "TokenizersBackend"  # transformers 5's PreTrainedTokenizerFast
# model_type -> the class AutoTokenizer loads for it whatever the configs name (qwen2 is in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS; mistral's registered class is the generic one).
# The qwen3_5 types (also in that set) are not among those runtime/models serves, but their tokenizer
# loads as there.
MODEL_TYPE_CLASSES: Mapping[str, str] = MappingProxyType({
    "qwen2": "Qwen2Tokenizer", "mistral": GENERIC_CLASS,
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp"), "Qwen3_5Tokenizer"),
})
# Names transformers' AutoTokenizer resolves to another class than the one they name (its
# ``tokenizer_class_from_name``: ``transformers.Phi3Tokenizer`` is ``LlamaTokenizer``): the class it
# loads. (Its other aliases name encoder classes, refused below.)
CLASS_ALIASES: Mapping[str, str] = MappingProxyType({"Phi3Tokenizer": "LlamaTokenizer"})
# The classes (names as a config gives them, without ``Fast``) whose ``__init__`` builds its own
# normaliser, pre-tokenizer, decoder or post-processor in place of tokenizer.json's, and which
# lorafleet does not rebuild likewise (``runtime.tokenizer_pipeline.REBUILT_PIPELINES`` holds those
# it does): transformers' encoder, seq2seq and other models' classes (checked with 5.24 and 5.25).
# The decoder-only families' among them (OpenAIGPTTokenizer, XGLMTokenizer, CodeGenTokenizer: openai-gpt,
# xglm, codegen / phi) are of architectures runtime/models does not serve.
REBUILDING_CLASSES_NOT_REPRODUCED = frozenset({
    "AlbertTokenizer", "BartTokenizer", "BarthezTokenizer", "BertTokenizer", "BigBirdTokenizer",
    "BlenderbotTokenizer", "CLIPTokenizer", "CamembertTokenizer", "CodeGenTokenizer", "ConvBertTokenizer",
    "DPRContextEncoderTokenizer", "DPRQuestionEncoderTokenizer", "DPRReaderTokenizer", "DebertaTokenizer",
    "DebertaV2Tokenizer", "DistilBertTokenizer", "ElectraTokenizer", "ErgoTokenizer", "EsmcTokenizer", "FNetTokenizer",
    "FunnelTokenizer", "HerbertTokenizer", "LEDTokenizer", "LasrTokenizer", "LayoutLMTokenizer",
    "LayoutLMv2Tokenizer", "LayoutLMv3Tokenizer", "LayoutXLMTokenizer", "LongformerTokenizer", "LukeTokenizer",
    "LxmertTokenizer", "MBart50Tokenizer", "MBartTokenizer", "MLukeTokenizer", "MPNetTokenizer",
    "MarkupLMTokenizer", "MobileBertTokenizer", "MvpTokenizer", "NllbTokenizer", "NougatTokenizer",
    "OpenAIGPTTokenizer", "PegasusTokenizer", "ReformerTokenizer", "RemBertTokenizer",
    "RoFormerTokenizer", "RobertaTokenizer", "SeamlessM4TTokenizer", "Siglip2Tokenizer", "SplinterTokenizer",
    "SqueezeBertTokenizer", "T5Tokenizer", "Tipsv2Tokenizer", "UdopTokenizer", "VideoPrismTokenizer",
    "WhisperTokenizer", "XGLMTokenizer", "XLMRobertaTokenizer", "XLNetTokenizer",
})
# The classes transformers loads as Python tokenizers, which do not read tokenizer.json at all
# (bytes, characters, their own vocabulary files; some need sentencepiece, without which
# transformers does not load them at all).
PYTHON_CLASSES = frozenset({
    "BartphoTokenizer", "BertGenerationTokenizer", "BertJapaneseTokenizer", "BertweetTokenizer",
    "BioGptTokenizer", "BlenderbotSmallTokenizer", "ByT5Tokenizer", "CTRLTokenizer", "CanineTokenizer",
    "ClvpTokenizer", "CpmAntTokenizer", "CpmTokenizer", "DiaTokenizer", "EsmTokenizer", "FSMTTokenizer",
    "FastSpeech2ConformerTokenizer", "FlaubertTokenizer", "GPTNeoXJapaneseTokenizer", "GPTSw3Tokenizer",
    "M2M100Tokenizer", "MarianTokenizer", "MgpstrTokenizer", "MyT5Tokenizer", "PLBartTokenizer",
    "PerceiverTokenizer", "PhobertTokenizer", "Pop2PianoTokenizer", "ProphetNetTokenizer", "RoCBertTokenizer",
    "SiglipTokenizer", "Speech2TextTokenizer", "SpeechT5Tokenizer", "TapasTokenizer", "VitsTokenizer",
    "Wav2Vec2CTCTokenizer", "Wav2Vec2PhonemeCTCTokenizer", "XLMTokenizer",
})
# class -> (add bos, add eos) of the post-processor it builds in place of tokenizer.json's.
REBUILT_POST_PROCESSORS: Mapping[str, tuple[bool, bool]] = MappingProxyType({
    "CodeLlamaTokenizer": (True, False),  # its __init__'s add_bos_token=True, passed on explicitly
    "GPTNeoXTokenizer": (False, False),  # its __init__ calls update_post_processor() with both flags gone
})

# class -> the named special tokens its __init__ defaults to (its signature's), which count where
# neither tokenizer_config.json nor special_tokens_map.json has the key (a null there names none).
_ENDOFTEXT = "<|endoftext|>"
CODE_LLAMA_FILL_TOKEN = "<FILL_ME>"
# CodeLlamaTokenizer's infilling tokens: model-specific special tokens, and its extra ones too.
CODE_LLAMA_INFILLING_TOKENS: Mapping[str, str] = MappingProxyType({
    "prefix_token": "▁<PRE>", "middle_token": "▁<MID>", "suffix_token": "▁<SUF>", "eot_token": "▁<EOT>", "fill_token": CODE_LLAMA_FILL_TOKEN,
})
CLASS_SPECIAL_TOKENS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "CodeLlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", **CODE_LLAMA_INFILLING_TOKENS},
    "GemmaTokenizer": {"unk_token": "<unk>", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "mask_token": "<mask>"},
    "Qwen2Tokenizer": {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT},
    "Qwen3_5Tokenizer": {"unk_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": _ENDOFTEXT},
    "GPT2Tokenizer": {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT},
    "GPTNeoXTokenizer": {"unk_token": _ENDOFTEXT, "bos_token": _ENDOFTEXT, "eos_token": _ENDOFTEXT, "pad_token": "<|padding|>"},
    "CohereTokenizer": {"unk_token": "<UNK>", "bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "pad_token": "<PAD>",
                        "cls_token": "<CLS>", "sep_token": "<SEP>", "mask_token": "<MASK_TOKEN>"},
})


def auto_tokenizer_class(tokenizer_config: Mapping[str, Any], model_config: Mapping[str, Any], byte_level: bool = False) -> str:
    """The class ``AutoTokenizer.from_pretrained`` loads (name without ``Fast``); see the module docstring.
    ``byte_level``: tokenizer.json's text holds ``"ByteLevel"`` (a ByteLevel step anywhere in it)."""
    model_type = model_config.get("model_type")
    if model_type in MODEL_TYPE_CLASSES:
        return MODEL_TYPE_CLASSES[model_type]
    named = tokenizer_config.get("tokenizer_class") or model_config.get("tokenizer_class")
    if not isinstance(named, str) or not named:
        return GENERIC_CLASS
    name = named.removesuffix("Fast")
    if name == "LlamaTokenizer" and byte_level:  # a Llama-3-style file: LlamaTokenizer would rebuild it as SentencePiece's
        return GENERIC_CLASS
    return GENERIC_CLASS if name in ("PreTrainedTokenizer", "PythonBackend") else CLASS_ALIASES.get(name, name)


def unreproduced_class(tokenizer_class: str) -> str | None:
    """Why lorafleet cannot tokenize as ``tokenizer_class`` (as ``auto_tokenizer_class`` returns it)
    does, None when it can: a class in ``REBUILDING_CLASSES_NOT_REPRODUCED`` or ``PYTHON_CLASSES``.
    Following tokenizer.json for one of them would give other prompt ids than transformers."""
    if tokenizer_class in REBUILDING_CLASSES_NOT_REPRODUCED:
        return (f"transformers' AutoTokenizer loads {tokenizer_class}, which builds its own normaliser, pre-tokenizer, decoder "
                "or post-processor in place of tokenizer.json's; lorafleet does not reproduce that class")
    if tokenizer_class in PYTHON_CLASSES:
        return (f"transformers' AutoTokenizer loads {tokenizer_class}, a Python tokenizer that does not read tokenizer.json; "
                "lorafleet does not reproduce that class")
    return None


# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens (a chat template sees them).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")  # an AddedToken's, as a config object spells them


def with_special_tokens_map(tokenizer_config: Mapping[str, Any], special_tokens_map: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json as transformers 5's ``_from_pretrained`` hands it to the class, read
    with special_tokens_map.json: ``additional_special_tokens`` becomes ``extra_special_tokens`` when
    that is empty; model-specific tokens given as strings (any key ending in ``_token`` but the
    named ones, e.g. ``"image_token": "<img>"``) and an ``extra_special_tokens`` object move to
    ``model_specific_special_tokens``; then, without ``added_tokens_decoder`` only, each entry of the
    map replaces the config's (an object as a special ``AddedToken``, as transformers reads it: a
    model-specific or extra one counts too; an ``extra_special_tokens`` list adds to
    the config's), and ``additional_special_tokens`` becomes ``extra_special_tokens`` when there is
    no such key."""
    cfg = dict(tokenizer_config)
    if "additional_special_tokens" in cfg and not cfg.get("extra_special_tokens"):
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    specific = {key: cfg.pop(key) for key in list(cfg) if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES and isinstance(cfg[key], str)}
    if isinstance(cfg.get("extra_special_tokens"), dict):
        specific.update(cfg.pop("extra_special_tokens"))
    if "added_tokens_decoder" not in cfg:
        for key, value in special_tokens_map.items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                value = {**value, "__type": "AddedToken", "special": True}  # transformers makes it an AddedToken
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(cfg.get("extra_special_tokens") or [])
                for token in value:
                    token = {**token, "__type": "AddedToken", "special": True} if isinstance(token, dict) else token
                    if token not in merged:
                        merged.append(token)
                value = merged
            cfg[key] = value
        if isinstance(cfg.get("extra_special_tokens"), dict):
            specific.update(cfg.pop("extra_special_tokens"))
    if "additional_special_tokens" in cfg and "extra_special_tokens" not in cfg:
        cfg["extra_special_tokens"] = cfg.pop("additional_special_tokens")
    cfg["model_specific_special_tokens"] = specific
    return cfg


# The classes whose ``__init__`` passes its own ``pad_token`` on (its default; None for GPT2Tokenizer).
OWN_PAD_TOKEN_CLASSES = frozenset({"GemmaTokenizer", "Qwen2Tokenizer", "Qwen3_5Tokenizer", "GPT2Tokenizer", "GPTNeoXTokenizer", "CohereTokenizer"})


def with_padding_pad_token(tokenizer_class: str, tokenizer_config: Mapping[str, Any], padding_pad_token: str | None) -> dict[str, Any]:
    """``tokenizer_config`` (as ``with_special_tokens_map`` returns it) with tokenizer.json's
    ``padding.pad_token`` as its ``pad_token`` when it has no such key (null names none), as
    ``TokenizersBackend.__init__`` sets it (``kwargs.setdefault("pad_token", ...)``), except for the
    classes that pass their own (``OWN_PAD_TOKEN_CLASSES``). The pad token is then a named special
    token: an added special token, and the chat template's ``pad_token``."""
    cfg = dict(tokenizer_config)
    if padding_pad_token is not None and "pad_token" not in cfg and tokenizer_class not in OWN_PAD_TOKEN_CLASSES:
        cfg["pad_token"] = padding_pad_token
    return cfg


def with_class_defaults(tokenizer_class: str, tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    """``tokenizer_config`` (as ``with_special_tokens_map`` returns it) with ``tokenizer_class``'s
    defaults (``CLASS_SPECIAL_TOKENS``) for the keys it lacks; CodeLlamaTokenizer also makes its
    infilling tokens (those not null) its ``extra_special_tokens`` when the config has no such key
    (it passes them as ``additional_special_tokens``, which count only then)."""
    cfg = dict(tokenizer_config)
    for name, default in CLASS_SPECIAL_TOKENS.get(tokenizer_class, {}).items():
        cfg.setdefault(name, default)
    if tokenizer_class == "CodeLlamaTokenizer" and "extra_special_tokens" not in cfg:
        cfg["extra_special_tokens"] = [cfg[name] for name in CODE_LLAMA_INFILLING_TOKENS if cfg[name] is not None]
    return cfg


def _is_token(value: Any) -> bool:
    """A string, or a token object as transformers reads one (``{"__type": "AddedToken", ...}``)."""
    return isinstance(value, str) or (isinstance(value, dict) and value.get("__type") == "AddedToken")


def _model_specific_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The model-specific special tokens of ``tokenizer_config`` (as ``with_special_tokens_map`` returns
    it): every key ending in ``_token`` but the named ones whose value is a token, then
    ``model_specific_special_tokens``, which wins for a key in both (transformers' auto-detected
    and explicit ones, ``{**auto, **explicit}``)."""
    specific = {key: value for key, value in tokenizer_config.items() if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES and _is_token(value)}
    specific.update(tokenizer_config.get("model_specific_special_tokens") or {})
    return {key: value for key, value in specific.items() if _is_token(value)}


def template_tokens(tokenizer_class: str, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens transformers 5 passes to a chat template as variables, name -> text: its
    ``special_tokens_map``, the named ones that are set and the model-specific ones
    (``_model_specific_tokens``: ``image_token``, CodeLlamaTokenizer's ``prefix_token``, ..., and
    the keys of an ``extra_special_tokens`` object), not the ``extra_special_tokens`` list.
    ``tokenizer_config`` as ``with_class_defaults`` returns it. CodeLlamaTokenizer sets its
    ``fill_token`` after the others, from its own argument: the config's string has gone to the
    model-specific tokens, so the template sees ``<FILL_ME>`` (``infilling_token``; none when null)."""
    tokens = {name: _token_text(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    tokens.update({name: _token_text(value) for name, value in _model_specific_tokens(tokenizer_config).items()})
    if tokenizer_class == "CodeLlamaTokenizer":
        tokens["fill_token"] = infilling_token(tokenizer_class, tokenizer_config)
    return {name: value for name, value in tokens.items() if value is not None}


def special_token_values(tokenizer_config: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The special tokens transformers 5 makes of ``tokenizer_config`` (as ``with_special_tokens_map``
    returns it; ``SpecialTokensMixin.__init__``), in its order, each as ``(content, AddedToken
    flags)``: the named ones (``SPECIAL_TOKEN_NAMES``), the model-specific ones (any other key
    ending in ``_token`` whose value is a token, then ``model_specific_special_tokens``, which wins
    for a key in both), then the ``extra_special_tokens`` list. A token is a string or an
    ``{"__type": "AddedToken", "content": ...}`` object (whose flags count; a named or model-specific
    one is special whatever its ``special`` says, an extra one only when it says so, or when it is
    also a named or model-specific one); the named ones may also be plain ``{"content": ...}``
    objects. A token listed again with other flags is listed again (an equal listing is not):
    transformers hands them all to ``add_tokens`` in one call, which keeps the first one's id and
    the last one's flags, and skips it in decoding when any listing was special."""
    def entry(value: Any, special: bool) -> tuple[str, dict[str, Any]] | None:
        if isinstance(value, str):
            return value, {"special": True}
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            flags = {k: value[k] for k in TOKEN_FLAGS if k in value}
            return value["content"], {**flags, "special": True} if special else {"special": False, **flags}
        return None

    specific = _model_specific_tokens(tokenizer_config)
    extra = tokenizer_config.get("extra_special_tokens")
    entries = [entry(tokenizer_config.get(name), True) for name in SPECIAL_TOKEN_NAMES]
    entries += [entry(value, True) for value in specific.values()]
    entries += [entry(value, False) for value in (extra if isinstance(extra, list) else []) if _is_token(value)]
    named = {e[0] for e in entries[:len(SPECIAL_TOKEN_NAMES) + len(specific)] if e is not None}
    listed: list[tuple[str, dict[str, Any]]] = []
    for e in entries:
        if e is not None:
            e = (e[0], {**e[1], "special": True}) if e[0] in named else e
            if e not in listed:  # transformers skips only a listing equal in content and flags
                listed.append(e)
    return listed



def declared_tokens(tokenizer_config: Mapping[str, Any], file_tokens: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """The added tokens transformers reads as declared, each ``(content, AddedToken flags)`` in id
    order: tokenizer_config.json's ``added_tokens_decoder``, else tokenizer.json's (``file_tokens``)."""
    declared_map = tokenizer_config.get("added_tokens_decoder")
    if not isinstance(declared_map, dict):
        return list(file_tokens)
    entries = sorted((int(i), e) for i, e in declared_map.items() if isinstance(e, dict) and isinstance(e.get("content"), str))
    return [(e["content"], {k: e[k] for k in TOKEN_FLAGS if k in e}) for _, e in entries]


def tokens_to_add(tokenizer_config: Mapping[str, Any], file_tokens: Sequence[tuple[str, dict[str, Any]]],
                  held: Collection[str]) -> list[tuple[str, dict[str, Any]]]:
    """What transformers' ``TokenizersBackend.__init__`` hands to one ``add_tokens`` call, each
    ``(content, AddedToken flags)``, over a tokenizer.json whose added tokens are ``file_tokens`` (in
    id order), to a backend that already holds the added tokens ``held`` (tokenizer.json's for a class
    that keeps its backend, none for one that builds a fresh one: ``runtime.tokenizer_rebuild``):
    first the declared added tokens, tokenizer_config.json's ``added_tokens_decoder``
    (in id order; tokenizer.json's own when the config has none), all of them (its check for those
    already there never matches), so the config's flags win; then the special tokens
    (``special_token_values``) that neither ``held`` nor the declared ones hold. A declared token whose content is a named or
    model-specific special token is special, whatever it says (a pad token tokenizer.json lists as
    not special is then skipped in decoding). ``tokenizer_config`` as ``with_class_defaults``
    returns it."""
    declared = declared_tokens(tokenizer_config, file_tokens)
    named = {_token_text(value) for value in (*(tokenizer_config.get(name) for name in SPECIAL_TOKEN_NAMES), *_model_specific_tokens(tokenizer_config).values())}
    listed = [(text, {**flags, "special": True} if text in named else flags) for text, flags in declared]
    known = set(held) | {text for text, _ in declared}
    return listed + [(text, flags) for text, flags in special_token_values(tokenizer_config) if text not in known]


def _token_text(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def readded_special_tokens(tokenizer_class: str, tokenizer_config: Mapping[str, Any],
                           declared: Sequence[tuple[str, dict[str, Any]]] = ()) -> list[tuple[str, dict[str, Any]]]:
    """The special tokens ``tokenizer_class``'s ``__init__`` adds again once ``TokenizersBackend``'s
    has added them (``special_token_values``), each ``(content, AddedToken flags)``: re-adding a token
    replaces its flags, those tokenizer.json gives it too. ``Qwen2Tokenizer`` re-adds the text of each
    of its ``all_special_tokens`` (the named and model-specific ones, then the extra ones) as
    ``AddedToken(text, special=True)``: default flags (no ``lstrip``, ``rstrip``, ``single_word``, not
    normalised), special. ``CohereTokenizer`` calls ``_post_init``, which re-adds each one as
    ``special_token_values`` gives it, marked special (``add_special_tokens``): an extra token listed
    as not special is special after all, and a named one (bos, ..., mask) that is ``declared``
    (``declared_tokens``) has the declared flags (transformers' loading hands the class the declared
    token in its place). Empty for the other classes. ``tokenizer_config`` as
    ``with_class_defaults`` returns it."""
    if tokenizer_class == "Qwen2Tokenizer":
        texts = [*template_tokens(tokenizer_class, tokenizer_config).values(), *(text for text, _ in special_token_values(tokenizer_config))]
        return [(text, {"special": True}) for text in dict.fromkeys(texts)]
    if tokenizer_class == "CohereTokenizer":
        declared_flags = dict(declared)
        named = {_token_text(tokenizer_config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        return [(text, {**(declared_flags[text] if text in named and text in declared_flags else flags), "special": True})
                for text, flags in special_token_values(tokenizer_config)]
    return []


def infilling_token(tokenizer_class: str, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The text that makes transformers' ``CodeLlamaTokenizer`` encode a prompt for infilling
    (``_encode_plus``: it cuts the text there and encodes ``▁<PRE> prefix ▁<SUF>suffix ▁<MID>``, or only
    the prefix when the suffix is empty, and changes its own normaliser afterwards), which lorafleet
    does not reproduce; None for another class. ``fill_token`` in ``tokenizer_config`` (as
    ``with_special_tokens_map`` returns it): a string there has gone to the model-specific tokens,
    so the class keeps its default ``<FILL_ME>``; null turns infilling off."""
    if tokenizer_class != "CodeLlamaTokenizer":
        return None
    if "fill_token" not in tokenizer_config:
        return CODE_LLAMA_FILL_TOKEN
    value = tokenizer_config["fill_token"]
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None
