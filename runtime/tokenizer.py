"""Tokenizer: a HF ``tokenizer.json`` through the ``tokenizers`` library, plus the checkpoint's configs.

Sources, in the checkpoint folder:
- ``tokenizer.json`` (required): vocabulary, normaliser, pre-tokenizer, post-processor, decoder;
  not its ``truncation`` and ``padding`` (a saving call's), which transformers never applies to a
  call that does not ask for them: a prompt is neither cut nor padded.
- ``tokenizer_config.json`` (optional): ``bos_token``, ``eos_token``, ``tokenizer_class``,
  ``chat_template``. Tokens may be strings or ``{"content": ...}`` objects. ``add_bos_token`` and
  ``add_eos_token`` are not read: transformers drops them when there is a tokenizer.json (below).
- ``special_tokens_map.json`` (optional): read, as transformers does, only when tokenizer_config
  has no ``added_tokens_decoder`` (older saves); then its entries replace tokenizer_config's
  (``runtime.tokenizer_class.with_special_tokens_map``).
- ``chat_template.jinja`` (optional): the chat template as transformers >= 4.50 saves it; when
  present it is used instead of tokenizer_config's ``chat_template``, as transformers does.
- ``generation_config.json`` and ``config.json`` (optional): ``eos_token_id`` (int or list).

Named special tokens the configs lack (no key) are the tokenizer class's defaults
(``runtime.tokenizer_class.CLASS_SPECIAL_TOKENS``; a pad token, tokenizer.json's ``padding.pad_token``
for the classes without their own: ``with_padding_pad_token``), and each special token the configs name (bos,
eos, ..., ``extra_special_tokens``, model-specific ``*_token`` keys) is an added token
(``special_token_values``), as in transformers 5.

``eos_token_ids``: tokenizer_config's eos (or the class's), then the generation config's, in that order without
duplicates. The generation config is what transformers' ``generate`` reads (checked with 5.24):
``generation_config.json`` when the checkpoint has one, even one without ``eos_token_id`` (then
it has no eos: config.json's does not stop generation, nor in vLLM), else config.json's own
``eos_token_id`` (read from the file: the model class's default, LlamaConfig's and
MistralConfig's 2, never stops ``generate``, so it is no eos here either).

``encode(text, add_special_tokens=True)`` adds the special tokens that transformers 5's
``AutoTokenizer`` adds (``runtime.tokenizer_class``): those of tokenizer.json's post-processor
(none without one), whatever ``add_bos_token`` / ``add_eos_token`` say, except for the classes
that build a post-processor of their own (``CodeLlamaTokenizer``: bos first; ``GPTNeoXTokenizer``:
nothing), which lorafleet builds likewise, with the tokenizer's own named bos/eos
(tokenizer_config.json or special_tokens_map.json; never config.json's ``bos_token_id``). The text
is tokenized, and ids decoded, with the normaliser, pre-tokenizer, decoder and BPE options of that
class where it builds its own in place of tokenizer.json's (``runtime.tokenizer_pipeline``:
``LlamaTokenizer`` with ``legacy`` / ``add_prefix_space``, ``Qwen2Tokenizer``, ...). Such a class
keeps only the added tokens that tokenizer_config.json declares (``runtime.tokenizer_rebuild``),
and a checkpoint where that moves a token's id is refused.

``apply_chat_template`` renders the checkpoint's Jinja ``chat_template`` in a sandbox set up
like transformers' (``jinja2.ext.loopcontrols`` for ``{% break %}``/``{% continue %}``,
``{% generation %}...{% endgeneration %}`` rendered as its body, a
``tojson`` filter that keeps key order and does not HTML-escape, ``strftime_now``,
``raise_exception``, and transformers' ``dict`` (a call or ``dict.fromkeys`` only) and
``namespace`` (no attribute named ``_...``) in place of jinja's; the special tokens as variables, as
transformers' ``special_tokens_map`` holds them: the named ones that are set (``bos_token`` to
``mask_token``) and the model-specific ones (``image_token``, CodeLlama's ``prefix_token``, ...:
``runtime.tokenizer_class.template_tokens``);
``tools`` and ``documents`` as None, since chat takes neither), so a template renders the same prompt text as under transformers;
``continue_final_message`` ends the text inside the last message as transformers does, and
``template_kwargs`` adds variables, and overrides the special tokens' as transformers' kwargs do
(not the others). Unlike transformers, a render is bounded:
one ``*`` may repeat a string, list or tuple into at most ``MAX_TEMPLATE_REPETITION`` items, and
the rendered text may have at most ``MAX_RENDERED_CHARS`` characters, and the render may take
at most ``MAX_TEMPLATE_STEPS`` steps (loop items, range items, calls) and ``MAX_RENDER_SECONDS``
(``runtime/chat_template_budget.py``) (ChatTemplateTooLarge); real templates come nowhere near
any of these. The template is compiled when the tokenizer loads; one that does not compile leaves the tokenizer usable for text and sets
``chat_template_problem``, which every ``apply_chat_template`` raises. Without one it uses ``DEFAULT_CHAT_TEMPLATE``:

    {bos}<|role|>\\ncontent{eos}\\n ... then "<|assistant|>\\n" when add_generation_prompt
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from tokenizers import Tokenizer as HFTokenizer

from runtime import chat_template_budget, chat_template_sizes
from runtime.chat_template_sizes import MAX_RENDERED_CHARS
from runtime.tokenizer_class import (
    CLASS_SPECIAL_TOKENS,
    REBUILT_POST_PROCESSORS,
    SPECIAL_TOKEN_NAMES,
    TOKEN_FLAGS,
    auto_tokenizer_class,
    declared_tokens,
    infilling_token,
    readded_special_tokens,
    template_tokens,
    tokens_to_add,
    unreproduced_class,
    with_class_defaults,
    with_padding_pad_token,
    with_special_tokens_map,
)
from runtime.tokenizer_pipeline import REBUILT_PIPELINES, PipelineError, rebuild_pipeline
from runtime.tokenizer_rebuild import fresh_backend, left_out, moved_id

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token or '' }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_level_alphabet() -> Mapping[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character each byte is written as -> the byte.
    Bytes that are printable Latin-1 characters stand for themselves; the other 68 are ``chr(256 + n)`` in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return MappingProxyType({**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}})


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
METASPACE = "\u2581"  # SentencePiece's visible space, "▁"
REPLACEMENT_CHAR = "\ufffd"
# transformers' continue_final_message_tag: appended to the message to continue, to find where its content ends.
CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "
# The variables a render sets -> what to; ``template_kwargs`` may not set them (nor the template
# environment's functions: jinja's ``range``, ``namespace``, ..., and ``TEMPLATE_FUNCTIONS``).
# The special tokens are not among them: as in transformers, ``template_kwargs`` overrides them.
RENDER_VARIABLES = MappingProxyType({
    "messages": "the request's messages",
    "add_generation_prompt": "the request's add_generation_prompt field",
    "continue_final_message": "the request's continue_final_message field (not a template variable; transformers reads it)",
    "tools": "none (lorafleet has no tool calling)",
    "documents": "none (lorafleet takes no documents)",
    "self": "jinja's reference to the template (the render's own argument)",
})
TEMPLATE_FUNCTIONS = ("raise_exception", "strftime_now")  # transformers' globals, which lorafleet's templates get too


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or inconsistent; names file and key."""


# Python errors a chat template raises on values it cannot handle (comparing a string with a
# number, ``str.index`` of a missing substring, dividing by a count of zero, ...). The template
# is fixed for the server's lifetime, so the inputs of one render are what trigger them.
TEMPLATE_DATA_ERRORS = (TypeError, ValueError, LookupError, ArithmeticError)


class ChatTemplateUnusable(TokenizerError):
    """The checkpoint's chat template cannot render any messages: it does not compile (a jinja
    syntax error), or the config names its templates but none "default". Found when the tokenizer
    loads (``Tokenizer.chat_template_problem``); the server's misconfiguration, not a request's.
    ``source``: where the template comes from (a file, or tokenizer_config.json's key);
    ``reason``: what is wrong, with jinja's line number for a syntax error."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source, self.reason = source, reason


class ChatTemplateError(TokenizerError):
    """The chat template failed on the inputs of one render with one of ``TEMPLATE_DATA_ERRORS``
    (not jinja's own errors, not its ``raise_exception``). The message names the error; the
    original is its ``__cause__``, for the log."""


# What one render may build. Real templates repeat short strings a few times (``' ' * indent``,
# ``'-' * 40``) and write each message about once, so neither limit changes their prompts;
# without them a template's ``'x' * n`` (or a loop's output) sized by a client's
# ``chat_template_kwargs`` or messages took as much memory as asked (a 500, or the server killed).
MAX_TEMPLATE_REPETITION = 1 << 20  # items (characters of a string) one ``*`` may build: 1 Mi
# MAX_RENDERED_CHARS (runtime/chat_template_sizes.py): the prompt and any value built on the way, 16 Mi characters by default


class ChatTemplateTooLarge(TokenizerError):
    """A render would build or do more than lorafleet allows: a ``*`` that repeats a string, list
    or tuple into more than ``MAX_TEMPLATE_REPETITION`` items, a prompt text longer than
    ``MAX_RENDERED_CHARS``, or more than ``MAX_TEMPLATE_STEPS`` steps or ``MAX_RENDER_SECONDS``
    of work (``runtime/chat_template_budget.py``). The template is fixed for the server's
    lifetime, so the inputs of the render (messages, ``chat_template_kwargs``) are what ask for it: the request's error."""


class ChatTemplateTooDeep(ChatTemplateTooLarge):
    """The render nested calls past ``chat_template_budget.MAX_CALL_DEPTH`` (a macro or a
    recursive loop calling itself as deep as the inputs say). A template that does so on any
    input is found when the tokenizer loads (``chat_template_problem``)."""


# Texts this long (characters) are encoded without holding the GIL (``Tokenizer._encoding``);
# callers on an event loop or under the engine's lock hand them to a worker thread.
LONG_TEXT_CHARS = 16_384


def tokenizer_file(model_dir: str | Path) -> Path:
    """The checkpoint's tokenizer.json; TokenizerError when it has none (also checked on its own by
    ``lorafleet serve`` before the weights load)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: missing (lorafleet reads HF fast tokenizers: tokenizer.json)")
    return path


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = tokenizer_file(root)
        try:
            json_text = path.read_text(encoding="utf-8")
            self._tok = HFTokenizer.from_str(json_text)
        except Exception as err:  # the tokenizers library raises plain Exception subclasses; name the file
            raise TokenizerError(f"{path}: cannot be parsed by the tokenizers library: {err}") from err
        cfg = _read_json(root / "tokenizer_config.json")
        # tokenizer.json may carry the truncation and padding of the call that saved it (a "truncation"
        # section with a max_length); transformers turns both off for each call that does not ask for
        # them, so a prompt is never cut nor padded. Kept here, they cut every prompt (and padded a long one).
        file_padding = self._tok.padding
        self._tok.no_truncation()
        self._tok.no_padding()
        # transformers' decode then removes spaces before punctuation (" ." -> "."), except on a BPE
        # model (v5 skips it there unless told to corrupt BPE output); lorafleet's text never does.
        model_type = type(self._tok.model).__name__
        if cfg.get("clean_up_tokenization_spaces") and (
            model_type != "BPE" or cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        ):
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: clean_up_tokenization_spaces is true for a {model_type} tokenizer: "
                "transformers' decode would then drop spaces before punctuation, which lorafleet does not do; set it to false")
        # Where each named special token comes from: special_tokens_map.json's entries replace
        # tokenizer_config's when the latter has no added_tokens_decoder (transformers' legacy
        # loading, v4 and v5 alike); with one, special_tokens_map.json is not read.
        token_file = dict.fromkeys(SPECIAL_TOKEN_NAMES, root / "tokenizer_config.json")
        token_map = _read_json(root / "special_tokens_map.json") if "added_tokens_decoder" not in cfg else {}
        cfg = with_special_tokens_map(cfg, token_map)
        token_file.update({name: root / "special_tokens_map.json" for name in SPECIAL_TOKEN_NAMES if name in token_map})
        # The class transformers' AutoTokenizer loads; a class that builds its own normaliser, pre-tokenizer,
        # decoder and BPE options gets them here too, in place of tokenizer.json's (runtime.tokenizer_pipeline).
        model_cfg = _read_json(root / "config.json")
        self.tokenizer_class = auto_tokenizer_class(cfg, model_cfg, byte_level='"ByteLevel"' in json_text)
        refused = unreproduced_class(self.tokenizer_class)
        if refused is not None:
            named = root / ("tokenizer_config.json" if cfg.get("tokenizer_class") else "config.json")
            raise TokenizerError(f"{named}: tokenizer_class {cfg.get('tokenizer_class') or model_cfg.get('tokenizer_class')!r}: {refused}, "
                                 "whose prompt ids differ from tokenizer.json's; name the class that fits the file "
                                 "(PreTrainedTokenizerFast, or none, to follow tokenizer.json)")
        # A class that rebuilds its pipeline starts from tokenizer.json's model alone and adds back only
        # the declared added tokens (runtime.tokenizer_rebuild); the file as loaded stays, to compare ids with.
        file_tok = self._tok
        if self.tokenizer_class in REBUILT_PIPELINES:
            self._tok = fresh_backend(file_tok)
        try:
            rebuild_pipeline(self._tok, self.tokenizer_class, cfg, str(path))
        except PipelineError as err:
            raise TokenizerError(str(err)) from None
        # transformers hands split_special_tokens to the backend: special tokens spelled in the text
        # are then read as plain text, not as the special tokens.
        self._tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        # A special token that neither file names (no key; null names none) is the class's default.
        for name in SPECIAL_TOKEN_NAMES:
            if name not in cfg and name in CLASS_SPECIAL_TOKENS.get(self.tokenizer_class, {}):
                token_file[name] = (f"{root / 'tokenizer_config.json'} (no {name}: {self.tokenizer_class}'s default, as "
                                    "transformers' AutoTokenizer loads it; name one, or null for none)")
        cfg = with_padding_pad_token(self.tokenizer_class, cfg, (file_padding or {}).get("pad_token"))
        cfg = with_class_defaults(self.tokenizer_class, cfg)
        # The special tokens transformers passes to a chat template: the named ones that are set, and the model-specific ones.
        self._template_tokens = template_tokens(self.tokenizer_class, cfg)
        self.bos_token = self._template_tokens.get("bos_token")
        self.eos_token = self._template_tokens.get("eos_token")
        # A bos or eos that tokenizer.json lacks would get an id the model never learnt: refused.
        for key, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token)):
            if token is not None and file_tok.token_to_id(token) is None:
                raise TokenizerError(f"{token_file[key]}: {key} {token!r} is not in tokenizer.json's vocabulary")
        self._add_named_special_tokens(cfg, file_tok)
        if self._tok is not file_tok:
            self._refuse_moved_ids(file_tok, root, cfg)
        # The ids of the tokenizer's own bos and eos (added tokens by now), None when its files name none:
        # transformers never reads config.json's bos_token_id or eos_token_id for the tokenizer.
        self.bos_token_id = None if self.bos_token is None else self._tok.token_to_id(self.bos_token)
        self.eos_token_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        self._infilling_token = infilling_token(self.tokenizer_class, cfg)
        # A class that builds its own post-processor gets it here, in place of tokenizer.json's
        # (tokenizer_config's add_bos_token / add_eos_token count for no class).
        rebuilt = REBUILT_POST_PROCESSORS.get(self.tokenizer_class)
        if rebuilt is not None:
            self._tok.post_processor = self._template_post_processor(*rebuilt)
        template = cfg.get("chat_template")
        # Why no messages can be rendered (ChatTemplateUnusable), else None; apply_chat_template raises
        # it. Either the template does not compile (below), or the config names its templates but none
        # "default": transformers then refuses to render (it does not fall back to a built-in template).
        self.chat_template_problem: ChatTemplateUnusable | None = None
        jinja_file = root / "chat_template.jinja"  # where transformers >= 4.50 saves it; it wins over the config's, as there
        source = f"{root / 'tokenizer_config.json'} (chat_template)"
        if isinstance(template, list):  # HF also allows [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
            if "default" not in named and not jinja_file.is_file():
                self.chat_template_problem = ChatTemplateUnusable(
                    str(root / "tokenizer_config.json"),
                    f"chat_template lists named templates ({', '.join(sorted(map(str, named)))}) but none named 'default', the one chat uses")
        if jinja_file.is_file():
            template, source = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.chat_template_source = source if self.chat_template is not None else "lorafleet's default chat template"
        # The jinja Template of chat_template (or the default), compiled now and kept: a syntax error
        # is the checkpoint's, known at load (chat_template_problem), not a failure of each request.
        self._compiled_template: Any = None
        if self.chat_template_problem is None:
            try:
                self._compiled_template = _compile_chat_template(self.chat_template or DEFAULT_CHAT_TEMPLATE, self.chat_template_source)
                self.chat_template_problem = self._nesting_problem()
            except ChatTemplateUnusable as err:
                self.chat_template_problem = err
        eos: list[int] = [] if self.eos_token_id is None else [self.eos_token_id]
        generation = root / "generation_config.json" if (root / "generation_config.json").is_file() else root / "config.json"
        eos.extend(_eos_ids(_read_json(generation).get("eos_token_id"), generation))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        # Only tokens marked special: an added token that is not (Qwen2's <tool_call>, <|fim_*|>)
        # is text, which decoding keeps and text offsets must count.
        self._special_ids = frozenset(i for i, added in self._tok.get_added_tokens_decoder().items() if added.special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a ValueError for a string that is not Unicode text (a lone
        surrogate, which JSON's ``"\\ud800"`` can carry), or that holds CodeLlamaTokenizer's fill
        token (``runtime.tokenizer_class.infilling_token``: transformers encodes it otherwise)."""
        return list(self._encoding(text, add_special_tokens).ids)

    def encode_with_spans(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)``'s ids, and the characters ``(start, end)`` of ``text`` each token was read
        from (the tokenizer's offset mapping: a special token spelled in the text, such as ``<eos>``,
        spans that spelling, a token for characters the vocabulary lacks spans them; a special token
        the post-processor adds is ``(0, 0)``). A ByteLevel post-processor with ``trim_offsets``
        leaves a token's leading spaces out of its span."""
        encoding = self._encoding(text, add_special_tokens)
        return list(encoding.ids), [(int(start), int(end)) for start, end in encoding.offsets]

    def _encoding(self, text: str, add_special_tokens: bool) -> Any:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"not valid Unicode text: a lone surrogate {text[err.start]!r} at character {err.start}") from None
        if self._infilling_token is not None and self._infilling_token in text:
            raise ValueError(
                f"the text holds {self._infilling_token!r}, from which transformers' CodeLlamaTokenizer builds an infilling prompt "
                "(prefix and suffix around the ▁<PRE> / ▁<SUF> / ▁<MID> tokens), which lorafleet does not reproduce; "
                "write that prompt out instead")
        if len(text) >= LONG_TEXT_CHARS:
            # The same encoding; ``encode_batch`` lets go of the GIL while it works, ``encode`` does
            # not: a ~1 MiB prompt (~1 s) would stop every other Python thread, the step loop's too.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def _template_post_processor(self, add_bos: bool, add_eos: bool) -> Any:
        """transformers' ``update_post_processor``: ``bos $A eos`` (``bos $A eos bos $B eos`` for a
        pair), each of bos and eos only when asked for and the tokenizer names one."""
        from tokenizers import processors

        bos = (self.bos_token, self.bos_token_id) if add_bos and self.bos_token is not None else None
        eos = (self.eos_token, self.eos_token_id) if add_eos and self.eos_token is not None else None
        single = f"{f'{bos[0]}:0 ' if bos else ''}$A:0{f' {eos[0]}:0' if eos else ''}"
        pair = f"{single}{f' {bos[0]}:1' if bos else ''} $B:1{f' {eos[0]}:1' if eos else ''}"
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token on its own as text, special tokens included (e.g. ``</s>``); a token that is
        part of a multi-byte character decodes to U+FFFD here (see ``token_bytes``).

        A SentencePiece piece ``▁word`` keeps its space: decoding it alone, the decoder's Strip
        step takes off the space it would keep after other tokens (Llama 2, Mistral), so the
        spaces its leading ``▁`` marks are put back, and the tokens add up to the text. A
        byte-fallback piece ``<0xHH>`` of an ASCII byte is that character (``<0x20>`` alone
        would decode to "", the space stripped)."""
        byte = self._fallback_byte(token_id)
        if byte is not None:
            return chr(byte) if byte < 0x80 else REPLACEMENT_CHAR
        text = self._tok.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id) or ""
        spaces = len(piece) - len(piece.lstrip(METASPACE))
        if spaces and not text.startswith(" " * spaces):
            text = " " * spaces + text.lstrip(" ")
        return text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, also when they are only part of a UTF-8 character:
        a byte-fallback piece ``<0xHH>`` is that byte, a byte-level BPE piece (GPT-2's
        printable-character alphabet) maps back through that alphabet. None when neither applies
        to a token that does not decode to whole characters."""
        byte = self._fallback_byte(token_id)
        if byte is not None:
            return bytes([byte])
        text = self.token_text(token_id)
        if REPLACEMENT_CHAR not in text:
            return text.encode("utf-8")
        piece = self._tok.id_to_token(token_id) or ""
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # byte fallback in a model that does not say so (Unigram)
        if match:
            return bytes([int(match.group(1), 16)])
        if piece and all(ch in BYTE_LEVEL_ALPHABET for ch in piece):
            return bytes(BYTE_LEVEL_ALPHABET[ch] for ch in piece)
        return None

    def _fallback_byte(self, token_id: int) -> int | None:
        """The byte of a byte-fallback piece ``<0xHH>`` (in a model with byte fallback on; in
        another, such a piece is the text it spells), else None."""
        if not getattr(self._tok.model, "byte_fallback", False):
            return None
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", self._tok.id_to_token(token_id) or "")
        return int(match.group(1), 16) if match else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
                            max_chars: int = MAX_RENDERED_CHARS) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) with the checkpoint's template (or the default).

        A key whose value is None (OpenAI's ``"content": null``) is left out of the message the
        template sees, as transformers' ``apply_chat_template`` leaves it out (many templates render
        a None as the text "None", or fail on it, where they handle a missing key).

        ``template_kwargs``: more variables for the template (vLLM's ``chat_template_kwargs``, e.g.
        ``enable_thinking``), as transformers passes its extra keyword arguments; one that the
        template does not read changes nothing. A special token's variable (``bos_token``,
        ``image_token``, ...) is overridden, as transformers' ``{**special_tokens_map, **kwargs}``
        does; a name the render sets otherwise (``RENDER_VARIABLES``) or a function of the
        template's environment is refused (TokenizerError), never overridden.

        ``continue_final_message``: the text ends inside the last message, right after its content
        (no end-of-turn after it), so a model continues that message; not with
        ``add_generation_prompt``. As transformers 5 does it (compared with 5.24): the last message's content gets
        ``CONTINUE_MARKER`` appended, and the rendered text is cut where the marker's last occurrence
        starts (then right-stripped, when the template dropped the marker's trailing space: a
        template that trims the content). A template whose text never names ``content``
        (transformers' check, before rendering: one that writes each message whole, with
        ``tojson``, would keep the marker inside a JSON string) or that does not write the
        content as given (the content, stripped, or the marker is missing from its text) cannot
        be continued.

        Raises ChatTemplateUnusable (``chat_template_problem``) whatever the messages when the
        template does not compile; TokenizerError when the template refuses the messages
        (``raise_exception``) or jinja fails (sandbox, an undefined value used), and its subclass
        ChatTemplateError when the template's own code fails on these values with one of
        ``TEMPLATE_DATA_ERRORS``, and ChatTemplateTooLarge when the render would build more than
        ``MAX_TEMPLATE_REPETITION`` items with one ``*`` or more than ``max_chars`` characters in
        any value or the prompt (``runtime/chat_template_sizes.py``; a server passes its
        ``size_cap``), or takes more than its budget of steps or time
        (``runtime/chat_template_budget.py``); its subclass ChatTemplateTooDeep when calls nest
        past ``chat_template_budget.MAX_CALL_DEPTH``."""
        if self.chat_template_problem is not None:
            raise self.chat_template_problem
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise TokenizerError(f"messages[{i}]: each message needs 'role' and 'content'")
        extra = dict(template_kwargs or {})
        for key in extra:
            why = RENDER_VARIABLES.get(key) or ("a function templates call" if key in TEMPLATE_FUNCTIONS or key in _jinja_globals() else None)
            if why is not None:
                raise TokenizerError(f"chat_template_kwargs: {key!r} cannot be set: lorafleet sets it to {why}")
        shown = [{key: value for key, value in m.items() if value is not None} for m in messages]  # transformers' _normalize_chat_messages
        if not continue_final_message:
            return self._render(shown, add_generation_prompt, extra, max_chars)
        if add_generation_prompt:
            raise TokenizerError("continue_final_message: not with add_generation_prompt, which starts a new message after it")
        if not shown or not isinstance(shown[-1].get("content"), str):
            raise TokenizerError("continue_final_message: needs a last message whose content is a string")
        if "content" not in (self.chat_template or DEFAULT_CHAT_TEMPLATE):  # transformers' test: the template's text
            raise TokenizerError("continue_final_message: the chat template's text never names 'content' (it writes the messages "
                                 "whole, e.g. with tojson), so the prompt cannot end inside the last message's content")
        final = shown[-1]["content"]
        shown[-1]["content"] = final + CONTINUE_MARKER
        text = self._render(shown, False, extra, max_chars)
        marker = CONTINUE_MARKER.strip()
        if final.strip() not in text or marker not in text:
            raise TokenizerError("continue_final_message: the chat template does not write the last message's content as given, "
                                 "so the prompt cannot end inside it")
        cut = text.rindex(marker)
        return text[:cut] if text.startswith(CONTINUE_MARKER, cut) else text[:cut].rstrip()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, extra: Mapping[str, Any], max_chars: int) -> str:
        """The template's text for ``messages``, with the variables transformers passes and ``extra`` (checked
        by the caller); its errors as ``apply_chat_template`` says. The render's context gets a
        budget of its own with ``max_chars`` (what jinja's ``generate`` does, but for that). The
        text is joined from the pieces the template writes as it goes, and the render stops
        (ChatTemplateTooLarge) once they pass ``max_chars``, rather than after building all of it."""
        import jinja2

        template = self._compiled_template
        context = template.new_context({
            "messages": messages,
            "tools": None,  # transformers passes both, None without tools or documents; a template may test ``is none``
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self._template_tokens, **extra,  # transformers' {**special_tokens_map, **kwargs}
        })
        context.budget = chat_template_budget.render_budget(max_chars)
        try:
            return _joined_within(template.root_render_func(context), max_chars)
        except TokenizerError:  # the template's raise_exception, ChatTemplateTooLarge
            raise
        except chat_template_budget.TemplateCallsTooDeep as err:
            raise ChatTemplateTooDeep(str(err)) from None
        except (chat_template_budget.TemplateStepsExhausted, chat_template_sizes.ValueTooLarge) as err:
            raise ChatTemplateTooLarge(str(err)) from None
        except jinja2.TemplateError as err:
            raise TokenizerError(f"chat_template: cannot render: {err}") from err
        except TEMPLATE_DATA_ERRORS as err:
            raise ChatTemplateError(f"chat_template: failed on these inputs with {type(err).__name__}: {err}") from err

    def _refuse_moved_ids(self, file_tok: Any, root: Path, cfg: Mapping[str, Any]) -> None:
        """TokenizerError when the rebuilt backend gives a token another id than tokenizer.json
        (``runtime.tokenizer_rebuild.moved_id``): the model would read those tokens as others."""
        why = moved_id(file_tok, self._tok)
        if why is None:
            return
        dropped = left_out(file_tok, self._tok)
        declared = "tokenizer_config.json's added_tokens_decoder" if isinstance(cfg.get("added_tokens_decoder"), dict) else "tokenizer.json's added tokens"
        raise TokenizerError(
            f"{root / 'tokenizer.json'}: transformers' {self.tokenizer_class} rebuilds the tokenizer from tokenizer.json's "
            f"vocabulary and adds back only {declared} and the named special tokens"
            f"{f' (it leaves out {dropped[:4]})' if dropped else ''}, in that order, so {why}: prompts and outputs would hold "
            "ids the model reads as other tokens, so lorafleet refuses this checkpoint; declare every added token of "
            "tokenizer.json, with its id, in tokenizer_config.json's added_tokens_decoder")

    def _nesting_problem(self) -> ChatTemplateUnusable | None:
        """ChatTemplateUnusable when the template nests calls past ``MAX_CALL_DEPTH`` rendering one
        short user message: such a template (a macro that always calls itself) fails for every
        request, the server's fault, known at load. Any other refusal of that message is the
        message's (a template may require a system message), not the template's: not judged here."""
        try:
            self._render([{"role": "user", "content": "Hello"}], True, {}, MAX_RENDERED_CHARS)
        except ChatTemplateTooDeep as err:
            return ChatTemplateUnusable(self.chat_template_source, f"rendering one user message, {str(err).removeprefix('chat_template: ').split(';')[0]}")
        except TokenizerError:
            pass
        return None

    def _add_named_special_tokens(self, cfg: Mapping[str, Any], file_tok: Any) -> None:
        """Make each special token the config names (``runtime.tokenizer_class.special_token_values``:
        bos, eos, ..., ``extra_special_tokens``) an added token, as transformers'
        ``TokenizersBackend.__init__`` does with those tokenizer.json does not list among its added
        tokens: spelled in a text it is then that one token, and decoding with ``skip_special_tokens``
        drops it (when special). One not in the vocabulary gets the next id, as there. The declared
        added tokens go first, with tokenizer_config.json's flags, special when named
        (``tokens_to_add``); after a rebuild (``runtime.tokenizer_rebuild``) the backend holds none of
        tokenizer.json's added tokens, so the declared ones are all it gets back. Then those
        the class adds again (``readded_special_tokens``: Qwen2Tokenizer, CohereTokenizer), which
        take the flags it gives them, also those tokenizer.json lists."""
        from tokenizers import AddedToken

        file_tokens = [(t.content, {flag: getattr(t, flag) for flag in TOKEN_FLAGS}) for _, t in sorted(file_tok.get_added_tokens_decoder().items())]
        held = [t.content for t in self._tok.get_added_tokens_decoder().values()]  # none after a rebuild
        # One call, as there: a token listed twice keeps its first id and takes its last flags.
        self._tok.add_tokens([AddedToken(text, **flags) for text, flags in tokens_to_add(cfg, file_tokens, held)])
        # Then those the class adds again, which take these flags (runtime.tokenizer_class.readded_special_tokens).
        readded = readded_special_tokens(self.tokenizer_class, cfg, declared_tokens(cfg, file_tokens))
        self._tok.add_tokens([AddedToken(text, **flags) for text, flags in readded])


def _generation_block() -> Any:
    """transformers' ``{% generation %}...{% endgeneration %}`` tag, a jinja extension class: it marks
    the assistant's text (for ``return_assistant_tokens_mask``, training masks, as TRL's
    ``assistant_only_loss`` needs) and renders its body unchanged, in a scope of its own (a call
    block, as transformers parses it); rendering a prompt never tracks it. Without it such a
    template did not compile."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationBlock


class _TemplateDict:
    """A chat template's ``dict``, as transformers': ``dict(...)`` builds one and ``dict.fromkeys``
    works; nothing else of the type is reachable (``dict.keys(m)`` is undefined, so calling it fails).
    With jinja's own ``dict``, ``dict.update(d, {...})`` changed a value inside the immutable sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _template_namespace() -> Any:
    """A chat template's ``namespace``, as transformers': jinja's, except that an attribute name
    starting with ``_`` is refused (jinja's SecurityError), whether given to ``namespace(...)`` or
    set with ``{% set ns._x = ... %}``; jinja's own accepted both."""
    import jinja2

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _compile_chat_template(text: str, source: str) -> Any:
    """``text`` compiled in a sandbox set up like transformers' (see the module docstring). Done
    once per tokenizer, at load (transformers caches it too): compiling a real template (Llama
    3.1's, ~5 KB) takes tens of milliseconds, which every chat request spent on the event loop.
    A syntax error raises ChatTemplateUnusable naming ``source`` and jinja's line."""
    import jinja2

    env = _bounded_sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_block()])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)  # TEMPLATE_FUNCTIONS
    env.globals.update(dict=_TemplateDict(), namespace=_template_namespace())  # transformers' narrower versions of jinja's
    chat_template_budget.install(env)  # a counted range, and the filter every loop's items pass through
    chat_template_sizes.install(env)  # filters, lipsum, ~ and what {{ }} writes, bounded in size
    try:
        tree = chat_template_budget.count_loop_items(env, env.parse(text))
        return env.from_string(chat_template_sizes.bound_concats(env, tree))
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateUnusable(source, f"does not compile: line {err.lineno}: {err.message}") from err


def _bounded_sandbox() -> type:
    """jinja's ``ImmutableSandboxedEnvironment`` with its ``*`` bounded (``_check_repetition``):
    jinja's sandbox bounds ``range()`` (100000 items) but builds whatever ``'x' * n`` asks for;
    ``+``, ``%``, ``**``, integers' ``*`` and string methods' results bounded in length
    (``runtime/chat_template_sizes.py``); calls nested at most ``MAX_CALL_DEPTH`` deep. An intercepted operator is also never evaluated at compile
    time, so a constant ``'x' * 10**10`` in a template is the render's error, not the load's.
    Each render's context holds its ``RenderBudget`` of steps, and every call the template makes
    spends one (``runtime/chat_template_budget.py``)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "%", "**"})
        context_class = chat_template_budget.budgeted_context_class()

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                _check_repetition(left, right)
            chat_template_sizes.check_binop(context, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            args = chat_template_budget.spend_on_call(context, obj, args)
            chat_template_sizes.check_str_method(context, obj, args, kwargs)
            context.budget.enter_call()
            try:
                return super().call(context, obj, *args, **kwargs)
            finally:
                context.budget.leave_call()

    return BoundedSandbox


def _check_repetition(left: Any, right: Any) -> None:
    """Raise ChatTemplateTooLarge, before anything is built, when ``left * right`` repeats a
    string, list or tuple into more than ``MAX_TEMPLATE_REPETITION`` items (``len(seq) * count``)."""
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > MAX_TEMPLATE_REPETITION:
            unit = "characters" if isinstance(seq, str) else "items"
            raise ChatTemplateTooLarge(
                f"chat_template: '*' would build a {type(seq).__name__} of {len(seq) * count} {unit} ({len(seq)} x {count}), past the limit of "
                f"{MAX_TEMPLATE_REPETITION} {unit}; these messages or chat_template_kwargs ask the template for more than a prompt needs")


def _joined_within(pieces: Any, limit: int) -> str:
    """The strings of ``pieces`` joined, or ChatTemplateTooLarge as soon as they pass ``limit`` characters."""
    kept: list[str] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise ChatTemplateTooLarge(f"chat_template: the prompt these messages render to passes the limit of {limit} characters; "
                                       "these messages or chat_template_kwargs ask the template for more than a prompt can hold")
        kept.append(piece)
    return "".join(kept)


def _jinja_globals() -> frozenset[str]:
    """The functions every jinja environment has (``range``, ``namespace``, ``cycler``, ...)."""
    from jinja2.defaults import DEFAULT_NAMESPACE

    return frozenset(DEFAULT_NAMESPACE)


def _raise_exception(message: str) -> None:
    """A chat template's ``raise_exception``: it refuses the messages."""
    raise TokenizerError(f"chat_template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    """A chat template's ``tojson``, as transformers': key order kept, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TokenizerError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _eos_ids(value: Any, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)
