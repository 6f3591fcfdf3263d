"""Tokenizer vs transformers' AutoTokenizer on the same tokenizer.json, plus eos / template sources."""
from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from runtime.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, TokenizerError

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n", "ünïcödé ✓ and emoji 🙂", "a</s>b<s>c", ""]


@pytest.fixture
def model_copy(tmp_path, tiny_llama_dir) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def test_encode_decode_match_transformers(tiny_llama_dir):
    from transformers import AutoTokenizer

    ours, ref = Tokenizer(tiny_llama_dir), AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref(text, add_special_tokens=special)["input_ids"], text
        ids = ours.encode(text)
        assert ids[0] == ours.bos_token_id
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        # byte-level: exact round trip (special-token text comes back only when specials are kept)
        assert ours.decode(ours.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_special_tokens_and_eos(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert tok.eos_token_ids == (tok.token_to_id("</s>"),)
    assert tok.is_special(tok.bos_token_id) and not tok.is_special(tok.encode("a", add_special_tokens=False)[0])


def test_eos_ids_from_tokenizer_and_generation_config_which_overrides_config(model_copy):
    """generation_config.json's eos replaces config.json's (as in transformers' generate and vLLM); the
    tokenizer's eos stays first; config.json's counts only when there is no generation_config.json
    (one without eos_token_id has no eos: transformers' generate then stops on none)."""
    gen = json.loads((model_copy / "generation_config.json").read_text())
    gen["eos_token_id"] = [257, 12]
    (model_copy / "generation_config.json").write_text(json.dumps(gen))
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["eos_token_id"] = 13
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert Tokenizer(model_copy).eos_token_ids == (257, 12)
    del gen["eos_token_id"]
    (model_copy / "generation_config.json").write_text(json.dumps(gen))
    assert Tokenizer(model_copy).eos_token_ids == (257,)
    (model_copy / "generation_config.json").unlink()
    assert Tokenizer(model_copy).eos_token_ids == (257, 13)


def test_add_bos_and_eos_token_without_a_named_token_add_none_as_in_transformers(model_copy):
    """tokenizer_config.json's add_bos_token / add_eos_token with no bos / eos token named in the
    tokenizer's files: transformers (which never reads config.json for the tokenizer) adds none.
    lorafleet prepended config.json's bos_token_id and appended generation_config.json's eos."""
    from transformers import AutoTokenizer

    raw = json.loads((model_copy / "tokenizer.json").read_text())
    raw["post_processor"] = None
    (model_copy / "tokenizer.json").write_text(json.dumps(raw))
    _set_config(model_copy, bos_token=None, eos_token=None, add_bos_token=True, add_eos_token=True)
    assert json.loads((model_copy / "config.json").read_text())["bos_token_id"] == 256  # <s>, there to be taken
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"] == ours.encode(text, add_special_tokens=False), text
        assert ours.encode_with_spans(text)[0] == ours.encode(text)
    assert ours.bos_token_id is None and ours.eos_token_ids == (257,)  # generation_config's eos still stops generation


def test_chat_template_matches_transformers(tiny_llama_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ref = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    for gen in (True, False):
        assert Tokenizer(tiny_llama_dir).apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen
        )


def test_template_features_render_as_in_transformers(model_copy):
    """{% break %}, tojson (key order kept, no HTML escaping, non-ASCII kept), strftime_now and
    pad_token: real templates (Llama-3.x, Qwen2.5) use them."""
    from transformers import AutoTokenizer

    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{{ bos_token }}[{{ strftime_now('%Y') }}]{% for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
        "<{{ m['role'] }}>{{ m | tojson }}{{ eos_token }}{% endfor %}{{ pad_token }}"
    )
    cfg["pad_token"] = cfg.get("pad_token") or cfg["eos_token"]
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    messages = [{"role": "user", "content": "a <b> & c, café"}, {"role": "assistant", "content": "ok"},
                {"role": "stop", "content": "x"}, {"role": "user", "content": "never shown"}]  # fmt: skip
    ours = Tokenizer(model_copy).apply_chat_template(messages, add_generation_prompt=False)
    ref = AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours == ref
    assert '{"role": "user", "content": "a <b> & c, café"}' in ours and "never shown" not in ours


def test_chat_template_jinja_file_wins_as_in_transformers(model_copy):
    """transformers >= 4.50 saves the template as chat_template.jinja; when the file is there it
    is the template (over tokenizer_config.json's), for transformers and for lorafleet alike."""
    from transformers import AutoTokenizer

    (model_copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    messages = [{"role": "user", "content": "hi"}]
    ours = Tokenizer(model_copy).apply_chat_template(messages)
    assert ours == AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == "[user]hi[assistant]"


def test_default_chat_template_when_checkpoint_has_none(model_copy):
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(model_copy)
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert "messages" in DEFAULT_CHAT_TEMPLATE


def test_errors_name_file_and_key(model_copy):
    with pytest.raises(TokenizerError, match=r"messages\[0\]: each message needs 'role' and 'content'"):
        Tokenizer(model_copy).apply_chat_template([{"content": "x"}])
    cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|not-a-token|>"
    (model_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|not-a-token\|>' is not in"):
        Tokenizer(model_copy)
    (model_copy / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: invalid JSON"):
        Tokenizer(model_copy)
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        Tokenizer(model_copy)


def test_token_text_and_bytes_of_a_sentencepiece_vocabulary(tmp_path):
    """A Llama-2-style tokenizer (Metaspace pieces, byte fallback, a decoder that strips the
    first space): single tokens keep the space their ``▁`` marks, byte pieces give their byte,
    and the token texts add up to the decoded text."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xE2>": 3, "<0x82>": 4, "<0xAC>": 5, "▁": 6, "a": 7, "▁ab": 8, "▁cd": 9, "▁▁x": 10}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = Tokenizer(tmp_path)
    ids = [8, 9, 7, 10, 3, 4, 5]  # " ab cda  x€"
    texts = [ours.token_text(i) for i in ids]
    assert texts[:4] == [" ab", " cd", "a", "  x"]
    assert ours.decode([7] + ids) == "a" + "".join(texts[:4]) + "€"  # after another token nothing is stripped
    assert [ours.token_bytes(i) for i in ids] == [b" ab", b" cd", b"a", b"  x", b"\xe2", b"\x82", b"\xac"]
    assert b"".join(ours.token_bytes(i) for i in ids).decode() == " ab cda  x€"
    assert ours.token_text(2) == "</s>" and ours.token_bytes(2) == b"</s>"


def test_a_space_byte_piece_is_a_space_alone_too(tmp_path):
    """``<0x20>`` decoded alone is "" under Llama-2's Strip decoder; its text and bytes are the
    space, so chat's ``bytes`` and the text offsets count it."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x20>": 3, "<0xE2>": 4, "a": 5, "b": 6}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    ours = Tokenizer(tmp_path)
    assert (ours.token_text(3), ours.token_bytes(3)) == (" ", b" ")
    assert (ours.token_text(4), ours.token_bytes(4)) == ("\ufffd", b"\xe2")  # part of a character
    assert "".join(ours.token_text(i) for i in (5, 3, 6)) == ours.decode([5, 3, 6]) == "a b"


def test_only_added_tokens_marked_special_are_special(model_copy):
    """An added token that is not special (Qwen2's <tool_call>) is text: decode keeps it, so the
    text offsets must count it."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(model_copy / "tokenizer.json"))
    hf.add_tokens(["<tool_call>"])
    hf.add_special_tokens(["<|special|>"])
    hf.save(str(model_copy / "tokenizer.json"))
    ours = Tokenizer(model_copy)
    tool, special = ours.token_to_id("<tool_call>"), ours.token_to_id("<|special|>")
    assert not ours.is_special(tool) and ours.is_special(special)
    assert ours.decode([tool, special, tool]) == "<tool_call><tool_call>"


@pytest.mark.parametrize("trim_offsets", [True, False])
def test_echoed_prompt_offsets_index_the_prompt_as_sent(tmp_path, trim_offsets):
    """prompt_text_offsets: each token starts where its text sits in the prompt as sent, also when the
    tokenizer's ByteLevel post-processor trims leading spaces out of its spans (GPT-2's setting), and
    a special token spelled in the prompt starts at its spelling."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, processors, trainers

    from runtime.server.logprobs import prompt_text_offsets

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello world hello world the cat sat on the mat"] * 50, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer(tmp_path)
    prompt = "hello world  the  cat<|endoftext|>é!"
    ids, spans = tok.encode_with_spans(prompt)
    starts = prompt_text_offsets(tok, prompt, ids, spans)
    assert starts == sorted(starts) and len(starts) == len(ids)
    for token_id, start in zip(ids, starts):
        text = tok.token_text(token_id)
        if "\ufffd" not in text:  # a split character's bytes start where it does
            assert prompt.startswith(text, start), (text, start, prompt)
    split = [s for t, s in zip(ids, starts) if "\ufffd" in tok.token_text(t)]
    assert split == [prompt.index("é")] * len(split) and len(split) == 2


def test_an_added_bos_does_not_take_a_bos_spelled_in_the_prompt():
    """A prompt that starts with the bos's spelling, twice: the tokenizer adds its own bos (an empty
    span) and reads both spellings; those start at 0 and 5, the added one at 0, taking no room."""
    from runtime.demo import demo_model_dir
    from runtime.server.logprobs import prompt_text_offsets

    tok = Tokenizer(demo_model_dir())
    bos = tok.token_text(tok.bos_token_id)
    prompt = bos + bos + "hello"
    ids, spans = tok.encode_with_spans(prompt)
    assert ids[:3] == [tok.bos_token_id] * 3 and spans[0] == (0, 0)
    assert prompt_text_offsets(tok, prompt, ids, spans) == [0, 0, len(bos)] + [2 * len(bos) + i for i in range(5)]


def _set_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_special_tokens_map_json_names_the_special_tokens_as_in_transformers(model_copy):
    """A tokenizer_config.json without added_tokens_decoder (older saves) takes its named special
    tokens from special_tokens_map.json, which wins over its own; lorafleet ignored that file: no
    eos id to stop on and a chat template rendered without bos/eos, or with the wrong eos."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}]
    _set_config(model_copy, bos_token=None, eos_token=None, pad_token=None, add_bos_token=None)
    (model_copy / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    (model_copy / "generation_config.json").unlink()
    (model_copy / "config.json").write_text(json.dumps({k: v for k, v in json.loads((model_copy / "config.json").read_text()).items() if k != "eos_token_id"}))
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token) == ("<s>", "</s>")
    assert ours.eos_token_ids == (ref.eos_token_id,)
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _set_config(model_copy, eos_token="</s>")
    (model_copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))  # it wins over tokenizer_config's
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    assert ours.eos_token == ref.eos_token == "<pad>" and ours.eos_token_ids == (ours.token_to_id("<pad>"),)
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    _set_config(model_copy, added_tokens_decoder={"257": {"content": "</s>", "special": True}})  # then the file is not read
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    assert ours.eos_token == ref.eos_token == "</s>"
    (model_copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    _set_config(model_copy, added_tokens_decoder=None)
    with pytest.raises(TokenizerError, match=r"special_tokens_map\.json: eos_token '<\|nope\|>' is not in"):
        Tokenizer(model_copy)


def test_a_chat_template_sees_every_named_special_token_as_in_transformers(model_copy):
    """transformers renders a template with all named special tokens that are set (unk, sep, cls,
    mask too), and leaves unset ones undefined; lorafleet passed bos/eos/pad only, as "" when unset."""
    from transformers import AutoTokenizer

    _set_config(model_copy, unk_token="<pad>", sep_token="</s>", pad_token=None,
                chat_template="[{{ unk_token }}|{{ sep_token }}|{{ pad_token is defined }}]{{ messages[0]['content'] }}")  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    ours = Tokenizer(model_copy).apply_chat_template(messages)
    assert ours == AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == "[<pad>|</s>|False]hi"


def test_split_special_tokens_reads_their_spelling_as_text_as_in_transformers(model_copy):
    """tokenizer_config's split_special_tokens: transformers encodes "<s>" typed in the text as its
    characters; lorafleet ignored the field and read the special token."""
    from transformers import AutoTokenizer

    _set_config(model_copy, split_special_tokens=True)
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    for text in ("a</s>b", "<s>x"):
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special)["input_ids"], text
    assert ours.token_to_id("</s>") not in ours.encode("a</s>b")


def test_named_chat_templates_without_a_default_are_refused_as_in_transformers(model_copy):
    """chat_template as a list of named templates: "default" is the chat template. With none of
    that name transformers refuses to render; lorafleet rendered its own DEFAULT_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}]
    _set_config(model_copy, chat_template=[{"name": "tool_use", "template": "T{{ messages[0]['content'] }}"}])
    with pytest.raises(ValueError, match="no default"):
        AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False)
    tok = Tokenizer(model_copy)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: chat_template lists named templates \(tool_use\) but none named 'default'"):
        tok.apply_chat_template(messages)
    assert tok.encode("hi")  # plain prompts still work
    _set_config(model_copy, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0]['content'] }}"}])
    assert Tokenizer(model_copy).apply_chat_template(messages) == "Dhi"
    _set_config(model_copy, chat_template=[{"name": "tool_use", "template": "T"}])
    (model_copy / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")  # the file is the default
    ours = Tokenizer(model_copy).apply_chat_template(messages)
    assert ours == AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "Jhi"


def test_clean_up_tokenization_spaces_on_a_non_bpe_tokenizer_is_refused(tmp_path):
    """transformers' decode applies clean_up_tokenization_spaces to a WordLevel/WordPiece/Unigram
    tokenizer ("hello , world" -> "hello, world"); lorafleet's text kept the spaces, silently.
    Such a folder is refused; false, or a BPE tokenizer (where transformers skips it), loads."""
    from tokenizers import Tokenizer as HF, models, pre_tokenizers
    from transformers import AutoTokenizer

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "hello", ",", "world", "!"])}
    hf = HF(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "[UNK]", "clean_up_tokenization_spaces": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ref.decode(ref("hello , world !")["input_ids"]) == "hello, world!"
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: clean_up_tokenization_spaces is true for a WordLevel tokenizer"):
        Tokenizer(tmp_path)
    _set_config(tmp_path, clean_up_tokenization_spaces=False)
    ours, ref = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ref("hello , world !")["input_ids"]
    assert ours.encode("hello , world !") == ids and ours.decode(ids) == ref.decode(ids) == "hello , world !"


def test_clean_up_tokenization_spaces_on_a_bpe_tokenizer_loads_as_transformers_skips_it(model_copy):
    from transformers import AutoTokenizer

    _set_config(model_copy, clean_up_tokenization_spaces=True)
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    ids = ours.encode("hello , world 's !")
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "hello , world 's !"


def test_a_chat_template_sees_tools_and_documents_as_none_as_in_transformers(model_copy):
    """transformers renders every template with ``tools=None`` and ``documents=None``; a template that
    tests ``tools is not none`` (no ``is defined`` guard) took the undefined name for a list of tools
    here: it rendered a tools block, and ``tools | tojson`` crashed the render (a 500)."""
    from transformers import AutoTokenizer

    _set_config(model_copy, chat_template="{% if tools is not none %}T{{ tools | tojson }}{% endif %}"
                "{% if documents is none %}[no documents]{% endif %}{{ messages[0]['content'] }}")  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    ours = Tokenizer(model_copy).apply_chat_template(messages)
    assert ours == AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == "[no documents]hi"


def test_the_chat_template_is_compiled_once(model_copy, monkeypatch):
    """Compiling a real template takes tens of milliseconds, which every chat request spent on the
    server's event loop: it is compiled when the tokenizer loads and kept, as transformers caches it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    compiled = []
    original = ImmutableSandboxedEnvironment.from_string
    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", lambda env, source, *a, **k: compiled.append(source) or original(env, source, *a, **k))
    tok = Tokenizer(model_copy)
    assert len(compiled) == 1 and tok.chat_template  # at load, before any request (its parsed tree: loops' items counted)
    first = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == first
    assert tok.apply_chat_template([{"role": "user", "content": "ho"}]) != first
    assert len(compiled) == 1


# A training template (TRL's assistant_only_loss needs the assistant's text marked); the set inside the
# block stays there, as in transformers' scope for it.
GENERATION_TAG_TEMPLATE = (
    "{% set ns = namespace(turns=0) %}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
    "{% generation %}{% set shown = m['content'] | trim %}{{ shown }}{{ eos_token }}{% set ns.turns = ns.turns + 1 %}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}[{{ shown | default('no shown') }}|{{ ns.turns }}]"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_the_generation_tag_renders_as_in_transformers(model_copy):
    """transformers' template environment has a {% generation %} tag (marking the assistant's text for
    training masks); without it lorafleet could not compile such a template, which transformers renders."""
    from transformers import AutoTokenizer

    _set_config(model_copy, chat_template=GENERATION_TAG_TEMPLATE)
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    assert ours.chat_template_problem is None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " there "}, {"role": "user", "content": "so?"}]
    for add in (True, False):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == want
    assert "there</s><|user|>" in want and want.endswith("[no shown|1]")


BROKEN_TEMPLATE = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"  # line 2 closes {{ with a single }


@pytest.mark.parametrize("in_jinja_file", [False, True], ids=["tokenizer_config", "chat_template_jinja"])
def test_a_chat_template_that_does_not_compile_is_found_at_load(model_copy, in_jinja_file):
    """A jinja syntax error was raised by each render, as if the messages were at fault. It is found
    when the tokenizer loads (chat_template_problem, naming the template's source and jinja's line);
    the tokenizer still encodes text, and every render raises that problem. transformers fails to
    render it too."""
    from transformers import AutoTokenizer

    from runtime.tokenizer import ChatTemplateUnusable

    if in_jinja_file:
        (model_copy / "chat_template.jinja").write_text(BROKEN_TEMPLATE)
    else:
        _set_config(model_copy, chat_template=BROKEN_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="unexpected '}'"):
        AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False)
    tok = Tokenizer(model_copy)
    source = str(model_copy / "chat_template.jinja") if in_jinja_file else f"{model_copy / 'tokenizer_config.json'} (chat_template)"
    problem = tok.chat_template_problem
    assert isinstance(problem, ChatTemplateUnusable) and str(problem) == f"{source}: does not compile: line 2: unexpected '}}'"
    assert problem.source == tok.chat_template_source == source
    assert tok.decode(tok.encode("hi")) == "hi"
    with pytest.raises(ChatTemplateUnusable) as raised:
        tok.apply_chat_template(messages)
    assert raised.value is problem


LLAMA3_STYLE_TEMPLATE = (  # trims the content, so transformers' marker loses its space: the rstrip branch
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, LLAMA3_STYLE_TEMPLATE], ids=["eos_ends_turn", "trimmed_eot_id"])
def test_continue_final_message_matches_transformers(model_copy, template):
    """The prompt ends right after the last message's content, with no end-of-turn (here </s>, or
    <|eot_id|> after trimmed content), as transformers renders it; a final content that the template
    repeats earlier, ends in spaces or is empty included; a user's last message as well as an assistant's."""
    from transformers import AutoTokenizer

    if template is not None:
        _set_config(model_copy, chat_template=template)
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    for final, role in itertools.product(("Sure, the answer is", "twice", "ends in a space ", "", "  padded  "), ("assistant", "user")):
        messages = [{"role": "user", "content": "twice"}, {"role": role, "content": final}]
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
        assert ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == want, final
        assert not want.endswith(("</s>", "<|eot_id|>"))
    whole = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert whole.startswith(want) and whole != want
    with pytest.raises(TokenizerError, match="continue_final_message: not with add_generation_prompt"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_with_templates_that_cannot_continue_it(model_copy):
    """The demo model's template refuses a last message that is not the user's; a template that does not
    write the content cannot end inside it. transformers refuses both as well."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so"}]
    demo = Path(__file__).resolve().parents[1] / "runtime" / "demo_assets" / "base"
    with pytest.raises(Exception, match="must be a user message"):
        AutoTokenizer.from_pretrained(str(demo)).apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(TokenizerError, match="must be a user message"):
        Tokenizer(demo).apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    _set_config(model_copy, chat_template="{% for m in messages %}[{{ m.role }}]{% if m.content %}+{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="does not appear in the chat"):
        AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(TokenizerError, match="continue_final_message: the chat template does not write the last message's content"):
        Tokenizer(model_copy).apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("template", ["{% for m in messages %}{{ m | tojson }}{% endfor %}", "{{ messages | tojson }}",
                                      "{% for m in messages %}{% for k, v in m | items %}{{ k }}={{ v }};{% endfor %}{% endfor %}"])
def test_continue_final_message_with_a_template_that_never_names_content(model_copy, template):
    """transformers refuses to continue the last message when the template's text never names
    ``content`` (it writes each message whole): with tojson the marker stays inside a JSON string,
    which lorafleet cut open, a prompt transformers never gives."""
    from transformers import AutoTokenizer

    _set_config(model_copy, chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "so"}]
    with pytest.raises(ValueError, match="not an accepted field in the chat_template"):
        AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, continue_final_message=True)
    with pytest.raises(TokenizerError, match="^continue_final_message: the chat template's text never names 'content'"):
        Tokenizer(model_copy).apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert '"content": "so"' in Tokenizer(model_copy).apply_chat_template(messages, add_generation_prompt=False) or "content=so;" in \
        Tokenizer(model_copy).apply_chat_template(messages, add_generation_prompt=False)  # the whole message renders as before


def test_template_kwargs_render_as_transformers_extra_arguments(model_copy):
    """vLLM's chat_template_kwargs: more variables for the template, as transformers' apply_chat_template
    passes its extra keyword arguments, over the special tokens too; the other names the render sets
    itself are refused, not overridden."""
    from transformers import AutoTokenizer

    _set_config(model_copy, chat_template="{% if enable_thinking is false %}<no_think>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                          "{% if persona %}[{{ persona.name }}|{{ persona.traits | join(',') }}]{% endif %}{{ eos_token }}")
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"enable_thinking": False, "persona": {"name": "Ada", "traits": ["terse", "exact"]}, "unused": 1}
    ours = Tokenizer(model_copy).apply_chat_template(messages, template_kwargs=kwargs)
    assert ours == AutoTokenizer.from_pretrained(str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours == "<no_think>hi[Ada|terse,exact]</s>"
    overridden = {**kwargs, "eos_token": "[E]", "mask_token": "[M]"}  # lorafleet refused these, transformers overrides them
    assert Tokenizer(model_copy).apply_chat_template(messages, template_kwargs=overridden) == AutoTokenizer.from_pretrained(
        str(model_copy)).apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **overridden) == "<no_think>hi[Ada|terse,exact][E]"
    for key in ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
                "raise_exception", "strftime_now", "namespace", "range", "self"):  # self: was "failed on these inputs with TypeError"
        with pytest.raises(TokenizerError, match=f"^chat_template_kwargs: '{key}' cannot be set: lorafleet sets it to "):
            Tokenizer(model_copy).apply_chat_template(messages, template_kwargs={key: 1})


@pytest.mark.parametrize("padding", ["BatchLongest", {"Fixed": 40000}])
def test_tokenizer_json_truncation_and_padding_do_not_cut_or_pad_prompts_as_in_transformers(model_copy, padding):
    """A tokenizer.json saved with the truncation and padding of a call (``"truncation": {"max_length":
    4, ...}``) cut every prompt to 4 tokens, and a fixed padding padded a long one (encoded in a
    batch of one); transformers turns both off for a call that does not ask for them."""
    from transformers import AutoTokenizer

    data = json.loads((model_copy / "tokenizer.json").read_text())
    data["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {"strategy": padding, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}
    (model_copy / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = Tokenizer(model_copy), AutoTokenizer.from_pretrained(str(model_copy))
    for text in ["Hello, world! and more words", "word " * 4000]:  # the second is encoded in a batch of one (LONG_TEXT_CHARS)
        assert ours.encode(text) == ref(text)["input_ids"]
        assert len(ours.encode(text)) > 4
