"""The special tokens ``encode`` adds, against transformers' ``AutoTokenizer`` on the same folders:
tokenizer.json's post-processor (bos first, eos last, or none) crossed with tokenizer_config.json's
``tokenizer_class`` and ``add_bos_token`` / ``add_eos_token`` (which transformers 5 drops when there
is a tokenizer.json; lorafleet added bos / eos for them), and config.json's ``model_type``, which
makes AutoTokenizer load another class than the one named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, TokenizerError
from runtime.tokenizer_class import CLASS_ALIASES, PYTHON_CLASSES, REBUILDING_CLASSES_NOT_REPRODUCED, auto_tokenizer_class
from runtime.tokenizer_pipeline import REBUILT_PIPELINES

TEXTS = ["hello world", "<s>hi</s>", "", " x"]
FLAGS = [(None, None), (True, False), (False, True), (True, True), (False, False)]  # None: the key is absent
POST_PROCESSORS = ["bos", "eos", "none"]


def write_tokenizer(folder: Path, kind: str, post_processor: str, added: bool = True) -> None:
    """tokenizer.json: ``kind`` "metaspace" (Llama-2 style pieces, one per character, <unk> 0, <s> 1,
    </s> 2) or "byte_level" (GPT-2 style, <s> 256, </s> 257); ``post_processor`` "bos" (bos first),
    "eos" (eos last) or "none" (no post-processor); <s> and </s> listed as added special tokens
    when ``added``, else only in the vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

    if kind == "metaspace":
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyz")}}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        vocab = {sym: i for i, sym in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
        vocab.update({"<s>": 256, "</s>": 257})
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    if added:
        tok.add_special_tokens(["<s>", "</s>"])
    if post_processor == "bos":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    elif post_processor == "eos":
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])])
    tok.save(str(folder / "tokenizer.json"))


def write_configs(folder: Path, tokenizer_class: str | None, model_type: str | None, flags: tuple[bool | None, bool | None]) -> None:
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": tokenizer_class, "add_bos_token": flags[0], "add_eos_token": flags[1]}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))


def assert_encodes_as_transformers(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours, ref = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        assert ours.encode_with_spans(text) == (ref(text)["input_ids"], [tuple(s) for s in ref(text, return_offsets_mapping=True)["offset_mapping"]])


@pytest.mark.parametrize("post_processor", POST_PROCESSORS)
@pytest.mark.parametrize("kind, tokenizer_class", [
    ("byte_level", "PreTrainedTokenizerFast"),  # transformers' generic class: the post-processor alone decides
    ("byte_level", None),  # no class named: the generic one
    ("byte_level", "SomeCustomTokenizer"),  # a name transformers does not know: the generic one
    ("metaspace", "LlamaTokenizerFast"),  # LlamaTokenizer keeps the post-processor too
    ("metaspace", "CodeLlamaTokenizerFast"),  # builds its own: bos first, never eos
    ("byte_level", "GPTNeoXTokenizerFast"),  # builds its own: nothing
])
def test_special_tokens_added_as_by_transformers(tmp_path, kind, tokenizer_class, post_processor):
    write_tokenizer(tmp_path, kind, post_processor)
    for flags in FLAGS:
        write_configs(tmp_path, tokenizer_class, "llama", flags)
        assert_encodes_as_transformers(tmp_path)


@pytest.mark.parametrize("kind, model_type, tokenizer_class, loaded", [
    ("byte_level", "qwen2", "CodeLlamaTokenizerFast", "Qwen2Tokenizer"),  # qwen2 always loads Qwen2Tokenizer
    ("metaspace", "mistral", "CodeLlamaTokenizerFast", "TokenizersBackend"),  # mistral the generic class
    ("metaspace", "llama", "CodeLlamaTokenizerFast", "CodeLlamaTokenizer"),  # llama the class named
    ("byte_level", None, "GPTNeoXTokenizerFast", "GPTNeoXTokenizer"),  # so does a checkpoint without config.json
])
def test_the_model_type_picks_the_class_as_in_transformers(tmp_path, kind, model_type, tokenizer_class, loaded):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, kind, "eos")
    write_configs(tmp_path, tokenizer_class, model_type, (True, False))
    assert_encodes_as_transformers(tmp_path)
    assert type(AutoTokenizer.from_pretrained(str(tmp_path))).__name__ == loaded
    assert Tokenizer(tmp_path).tokenizer_class == loaded


def test_the_class_named_in_config_json_counts_without_one_in_tokenizer_config():
    assert auto_tokenizer_class({}, {"tokenizer_class": "CodeLlamaTokenizerFast"}) == "CodeLlamaTokenizer"
    assert auto_tokenizer_class({"tokenizer_class": "GPTNeoXTokenizer"}, {"tokenizer_class": "CodeLlamaTokenizerFast"}) == "GPTNeoXTokenizer"
    assert auto_tokenizer_class({"tokenizer_class": "PreTrainedTokenizerFast"}, {}) == "TokenizersBackend"


NO_INFILL_TOKENS = dict.fromkeys(["prefix_token", "middle_token", "suffix_token", "eot_token", "fill_token"])  # CodeLlama's, not in the vocabulary


@pytest.mark.parametrize("added", [True, False])
@pytest.mark.parametrize("tokenizer_config", [
    {"tokenizer_class": "LlamaTokenizerFast"},  # names none: the class's <s> / </s> / <unk>
    {"tokenizer_class": "CodeLlamaTokenizerFast", **NO_INFILL_TOKENS},  # likewise, and its bos goes first
    {"tokenizer_class": "CodeLlamaTokenizerFast", "middle_token": "<mid>"},  # and its infilling tokens: ▁<PRE>, <mid>, ... (new ids)
    {"tokenizer_class": "LlamaTokenizerFast", "bos_token": None},  # null names none: no default
    {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"},  # the generic class: no defaults
])
def test_named_special_tokens_as_transformers_names_and_adds_them(tmp_path, tokenizer_config, added):
    """A class's default bos / eos where the configs name none (LlamaTokenizer's ``<s>`` / ``</s>``:
    lorafleet had none); a named special token that tokenizer.json does not list among its added
    tokens is one (lorafleet split ``<s>`` spelled in a text into characters, and decoding kept it)."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none", added=added)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ours.bos_token, ours.eos_token, ours.bos_token_id, ours.eos_token_id) == (ref.bos_token, ref.eos_token, ref.bos_token_id, ref.eos_token_id)
    assert ours.eos_token_ids == (() if ref.eos_token_id is None else (ref.eos_token_id,))
    assert ours.vocab_size == len(ref)
    for text in ["<s>hi</s>", "hi", "a<unk>b", "▁<PRE>x<mid>y▁<EOT>"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert [ours.decode(ids, skip_special_tokens=skip) for skip in (True, False)] == [ref.decode(ids, skip_special_tokens=skip) for skip in (True, False)]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == ref.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, chat_template=DEFAULT_CHAT_TEMPLATE)


def test_a_class_default_bos_the_vocabulary_lacks_is_refused(tmp_path):
    write_tokenizer(tmp_path, "byte_level", "none")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTNeoXTokenizerFast", "eos_token": "</s>"}))
    with pytest.raises(TokenizerError, match=r"no bos_token: GPTNeoXTokenizer's default.*bos_token '<\|endoftext\|>' is not in tokenizer.json's vocabulary"):
        Tokenizer(tmp_path)


def added_token(content: str) -> dict:
    """A token as transformers saves one in tokenizer_config.json (not special unless it says so)."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}


@pytest.mark.parametrize("tokenizer_config, special_tokens_map", [
    ({"additional_special_tokens": ["<x>"]}, None),
    ({"extra_special_tokens": ["<x>", "<y>"]}, None),  # <y> is not in the vocabulary: a new id
    ({"extra_special_tokens": [], "additional_special_tokens": ["<x>"]}, None),
    ({"additional_special_tokens": [added_token("<x>")]}, None),  # an object without "special": added, not special
    ({"image_token": "<img>", "image_id_token": added_token("<x>")}, None),  # model-specific: special
    ({"extra_special_tokens": {"image_token": "<img>"}}, None),
    ({}, {"additional_special_tokens": ["<x>"], "image_token": "<img>"}),  # special_tokens_map.json's count too
    ({"image_token": "<y>"}, {"image_token": "<img>", "extra_special_tokens": ["<x>"]}),  # the config's string wins
    ({}, {"video_token": {"content": "<img>"}, "extra_special_tokens": [{"content": "<x>", "lstrip": True}]}),  # the map's objects: tokens too
    ({"added_tokens_decoder": {}}, {"additional_special_tokens": ["<x>"]}),  # with added_tokens_decoder the map is not read
])
def test_extra_and_model_specific_special_tokens_as_transformers_adds_them(tmp_path, tokenizer_config, special_tokens_map):
    """``additional_special_tokens`` / ``extra_special_tokens`` and model-specific ``*_token`` keys
    that tokenizer.json does not list among its added tokens are added tokens in transformers 5
    (lorafleet read ``<x>`` spelled in a prompt as characters, and kept it in decoded text)."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab.update({"<x>": len(vocab), "<img>": len(vocab) + 1})  # in the vocabulary, not among the added tokens
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **tokenizer_config}))
    if special_tokens_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.vocab_size == len(ref)
    for text in ["a<x>b<img>c<y>d", "<x>"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert [ours.decode(ids, skip_special_tokens=skip) for skip in (True, False)] == [ref.decode(ids, skip_special_tokens=skip) for skip in (True, False)]


def flagged(content: str, **flags) -> dict:
    return {**added_token(content), **flags}


@pytest.mark.parametrize("tokenizer_config", [
    {"pad_token": "<x>", "extra_special_tokens": [flagged("<x>", lstrip=True, rstrip=True)]},
    {"pad_token": flagged("<x>", lstrip=True), "extra_special_tokens": ["<x>"]},
    {"pad_token": flagged("<x>", lstrip=True), "image_token": flagged("<x>", rstrip=True)},
    {"image_token": "<x>", "extra_special_tokens": [flagged("<x>", rstrip=True, special=False)]},  # still special: it is named
    {"extra_special_tokens": ["<y>", "<x>", flagged("<y>", lstrip=True, special=False), flagged("<x>", rstrip=True)]},
])
def test_a_special_token_listed_twice_takes_its_last_flags_as_in_transformers(tmp_path, tokenizer_config):
    """transformers adds a token listed twice with the flags of its last listing (and its first id);
    lorafleet kept the first: ``a <x> b`` lost or kept the spaces around ``<x>`` otherwise, and decoding
    kept a token transformers skips (listed special once)."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **tokenizer_config}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert {i: repr(t) for i, t in ours._tok.get_added_tokens_decoder().items()} == {i: repr(t) for i, t in ref.added_tokens_decoder.items()}
    for text in ["a <x> b", "a <y> b <x>"]:
        ids = ref(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert [ours.decode(ids, skip_special_tokens=skip) for skip in (True, False)] == [ref.decode(ids, skip_special_tokens=skip) for skip in (True, False)]


@pytest.mark.parametrize("tokenizer_config", [
    {"pad_token": "<pad>"},  # tokenizer.json lists <pad> as an added token that is not special
    {"pad_token": "<pad>", "added_tokens_decoder": {"30": {"content": "<pad>", "lstrip": True, "special": False}}},  # the config's flags win
])
def test_a_named_token_tokenizer_json_lists_as_not_special_is_special_as_in_transformers(tmp_path, tokenizer_config):
    """transformers re-adds the declared added tokens, a named one as special: decoding with
    skip_special_tokens drops the pad token; lorafleet kept tokenizer.json's flags and wrote it out."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["added_tokens"].append({"id": 30, "content": "<pad>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", **tokenizer_config}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ref("ab <pad> c")["input_ids"]
    assert ours.encode("ab <pad> c") == ids
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) and ours.is_special(30)


TOKEN_VARIABLES = ["bos_token", "unk_token", "pad_token", "image_token", "image_id_token", "video_token", "audio_token", "prefix_token",
                   "eot_token", "fill_token"]
TOKEN_TEMPLATE = "".join(f"{{{{ {name} | default('-') }}}}|" for name in TOKEN_VARIABLES) + "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("tokenizer_config, special_tokens_map", [
    ({"image_token": "<img>", "image_id_token": added_token("<x>"), "extra_special_tokens": ["<y>"]}, None),
    ({"extra_special_tokens": {"image_token": "<img>", "audio_token": "<x>"}}, None),
    ({"image_token": None}, {"image_token": "<img>", "video_token": {"content": "<v>"}}),  # the map's object is a token too
    ({"tokenizer_class": "CodeLlamaTokenizerFast"}, None),  # its infilling tokens: ▁<PRE>, ..., <FILL_ME>
    ({"tokenizer_class": "CodeLlamaTokenizerFast", "prefix_token": "<P>", "fill_token": "<F>", "eot_token": None}, None),  # fill_token stays <FILL_ME>
    ({"tokenizer_class": "CodeLlamaTokenizerFast", "prefix_token": added_token("<P>"), "fill_token": None}, None),
])
def test_a_chat_template_sees_the_model_specific_special_tokens_as_in_transformers(tmp_path, tokenizer_config, special_tokens_map):
    """transformers passes its whole ``special_tokens_map`` to a chat template, the model-specific
    tokens (``image_token``, CodeLlama's ``prefix_token``, ...) too, and lets the template's kwargs
    override any of them; lorafleet passed the named ones only (``image_token`` was undefined) and
    refused ``bos_token`` among chat_template_kwargs."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none")
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TOKEN_TEMPLATE, **tokenizer_config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if special_tokens_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    for kwargs in ({}, {"bos_token": "[B]", "image_token": "[I]", "fill_token": "[F]", "sep_token": "[S]"}):
        rendered = ours.apply_chat_template(messages, template_kwargs=kwargs)
        assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs), kwargs
    assert ours.vocab_size == len(ref)
    assert ours.encode("a<v>b<x>") == ref("a<v>b<x>")["input_ids"]


@pytest.mark.parametrize("fill_token", ["<FILL_ME>", "<FILL>", None, "absent"])
def test_code_llama_infilling_prompts_are_refused_not_encoded_otherwise(tmp_path, fill_token):
    """transformers' CodeLlamaTokenizer encodes a text holding its fill token (``<FILL_ME>``, whatever
    string the config names, which goes to the model-specific tokens; null turns it off) as an
    infilling prompt, ▁<PRE> prefix ▁<SUF>suffix ▁<MID>; lorafleet refuses it rather than encode it another way."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "bos")
    infill = {"prefix_token": "<s>", "middle_token": "</s>", "suffix_token": "<unk>", "eot_token": None}
    cfg = {"tokenizer_class": "CodeLlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", **infill}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg if fill_token == "absent" else {**cfg, "fill_token": fill_token}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "ab<FILL_ME>cd"
    if fill_token is None:
        assert ours.encode(text) == ref(text)["input_ids"]
    else:
        assert ref(text)["input_ids"] != ref(text.replace("<FILL_ME>", ""))["input_ids"]  # infilling
        with pytest.raises(ValueError, match="holds '<FILL_ME>', from which transformers' CodeLlamaTokenizer builds an infilling prompt"):
            ours.encode(text)
        with pytest.raises(ValueError, match="infilling"):
            ours.encode_with_spans(text)


def transformers_tokenizer_classes() -> dict[str, type]:
    """Every tokenizer class name transformers 5 can be asked for (the values of AutoTokenizer's
    mapping, the ``*Tokenizer`` / ``*TokenizerFast`` names it exports, the names its slow-to-fast
    converters know), without ``Fast``, -> the class ``tokenizer_class_from_name`` resolves it to
    (skipped: names that resolve to no class here, e.g. those needing sentencepiece)."""
    import warnings

    import transformers
    from transformers.convert_slow_tokenizer import SLOW_TO_FAST_CONVERTERS
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    names = {n for n in TOKENIZER_MAPPING_NAMES.values() if n} | set(SLOW_TO_FAST_CONVERTERS)
    names |= {n for n in transformers._class_to_module if n.endswith(("Tokenizer", "TokenizerFast"))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolved = {name: tokenizer_class_from_name(name) for name in sorted({n.removesuffix("Fast") for n in names})}
    return {name: cls for name, cls in resolved.items() if isinstance(cls, type)}


def python_classes_needing_a_backend(classes: dict[str, type]) -> set[str]:
    """The names that resolve, here, to transformers' stand-in for a class whose backend (sentencepiece,
    ...) is not installed, each checked by its source to be a Python tokenizer (its base class); a
    stand-in for any other class fails here, to be classified."""
    import re

    import transformers

    bases = {m.group(1): m.group(2) for f in Path(transformers.__file__).parent.glob("models/*/tokenization_*.py")
             for m in re.finditer(r"^class (\w+)\((\w+)", f.read_text(encoding="utf-8"), re.M)}
    stand_ins = {name for name, cls in classes.items() if hasattr(cls, "_backends")}
    assert {name: bases.get(name) for name in stand_ins if bases.get(name) not in ("SentencePieceBackend", "PreTrainedTokenizer", "PythonBackend")} == {}
    return stand_ins


def builds_its_own_steps(cls: type) -> bool:
    """``cls`` (a TokenizersBackend subclass) has an ``__init__`` below TokenizersBackend that builds a
    new backend tokenizer or sets its normaliser, pre-tokenizer, decoder or post-processor."""
    import inspect
    import re

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    below = cls.__mro__[:cls.__mro__.index(TokenizersBackend)]
    source = "\n".join(inspect.getsource(c.__init__) for c in below if "__init__" in c.__dict__)
    return re.search(r"_tokenizer = Tokenizer\(|_tokenizer\.(normalizer|pre_tokenizer|decoder|post_processor) =|update_post_processor\(", source) is not None


def test_the_classes_lorafleet_refuses_or_aliases_are_transformers_own():
    """The static lists in runtime.tokenizer_class, against transformers' source: every class name that
    loads a class building its own steps is rebuilt (REBUILT_PIPELINES), an alias of one that is
    (CLASS_ALIASES), or refused; every Python tokenizer (which never reads tokenizer.json) is refused.
    Before, a llama checkpoint naming BertTokenizer, T5Tokenizer or ByT5Tokenizer silently followed
    its tokenizer.json, and one naming Phi3Tokenizer (transformers: LlamaTokenizer) had no bos/eos."""
    from transformers.tokenization_python import PythonBackend
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    classes = transformers_tokenizer_classes()
    rebuilding = {name: cls.__name__ for name, cls in classes.items()
                  if issubclass(cls, TokenizersBackend) and cls is not TokenizersBackend and builds_its_own_steps(cls)}
    python = {name for name, cls in classes.items() if issubclass(cls, PythonBackend) and cls is not PythonBackend and not hasattr(cls, "_backends")}
    # The lists hold every transformers release's classes since 5.24 (5.25 added ErgoTokenizer): the
    # installed one's must all be there, and a name listed that it does not have must be unknown to it
    # (another release's), never a class it has and treats otherwise.
    known = set(classes)
    aliases = {name: loaded for name, loaded in rebuilding.items() if name != loaded and loaded in REBUILT_PIPELINES}
    assert aliases == {name: loaded for name, loaded in CLASS_ALIASES.items() if name in known}
    not_reproduced = {name for name, loaded in rebuilding.items() if loaded not in REBUILT_PIPELINES}
    assert not_reproduced == REBUILDING_CLASSES_NOT_REPRODUCED & known, (not_reproduced ^ (REBUILDING_CLASSES_NOT_REPRODUCED & known))
    python |= python_classes_needing_a_backend(classes)
    assert python == PYTHON_CLASSES & known, python ^ (PYTHON_CLASSES & known)
    assert set(REBUILT_PIPELINES) <= set(rebuilding)  # and what lorafleet rebuilds, transformers does


@pytest.mark.parametrize("tokenizer_class", ["BertTokenizerFast", "T5Tokenizer", "XLMRobertaTokenizerFast", "ByT5Tokenizer"])
def test_a_class_lorafleet_does_not_reproduce_is_refused_at_load(tmp_path, tokenizer_class):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "bos")
    write_configs(tmp_path, tokenizer_class, "llama", (None, None))
    if tokenizer_class == "ByT5Tokenizer":  # transformers encodes bytes, whatever tokenizer.json says
        assert AutoTokenizer.from_pretrained(str(tmp_path))("hi")["input_ids"] != [1, 10, 11]
    with pytest.raises(TokenizerError, match=rf"tokenizer_config\.json: tokenizer_class '{tokenizer_class}': transformers' AutoTokenizer "
                                             rf"loads {tokenizer_class.removesuffix('Fast')}, .*lorafleet does not reproduce that class"):
        Tokenizer(tmp_path)
    write_configs(tmp_path, tokenizer_class, "qwen2", (None, None))  # a qwen2 checkpoint loads Qwen2Tokenizer whatever it names
    assert Tokenizer(tmp_path).tokenizer_class == "Qwen2Tokenizer"


def test_phi3_tokenizer_loads_as_llama_tokenizer_as_in_transformers(tmp_path):
    """transformers loads LlamaTokenizer for ``Phi3Tokenizer``: its default bos / eos and its steps."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "bos")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Phi3TokenizerFast", "legacy": False}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ref).__name__ == ours.tokenizer_class == "LlamaTokenizer"
    assert (ours.bos_token, ours.eos_token, ours.bos_token_id, ours.eos_token_id) == (ref.bos_token, ref.eos_token, ref.bos_token_id, ref.eos_token_id)
    for text in ["hello world", "<s> hi</s>", " hi"]:
        assert ours.encode(text) == ref(text)["input_ids"], text
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == ref.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True, chat_template=DEFAULT_CHAT_TEMPLATE)


@pytest.mark.parametrize("tokenizer_class", [None, "LlamaTokenizerFast", "CodeLlamaTokenizerFast", "GemmaTokenizerFast", "GPT2Tokenizer", "GPTNeoXTokenizerFast"])
@pytest.mark.parametrize("pad_token", ["absent", None, "<s>"])
def test_tokenizer_json_padding_names_the_pad_token_as_in_transformers(tmp_path, tokenizer_class, pad_token):
    """transformers takes tokenizer.json's ``padding.pad_token`` as the pad token when the configs name
    none (no key), except for the classes that pass their own; lorafleet ignored it: a chat template
    saw no ``pad_token``, and the token was not made special."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "metaspace", "none")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 30, "pad_type_id": 0, "pad_token": "<p>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": tokenizer_class, "pad_token": pad_token,
           "chat_template": "{{ pad_token | default('-') }}|{{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v != "absent"}))
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ref("a<p>b")["input_ids"]
    assert ours.encode("a<p>b") == ids and ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
