"""TextOffsets: where each generated token starts in the text, bytes of split and broken characters included."""
from __future__ import annotations

import pytest

from runtime.server.logprobs import TextOffsets


class ByteTokens:
    """A stand-in tokenizer whose token i is ``pieces[i]`` (bytes), none special."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def is_special(self, token_id: int) -> bool:
        return False

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def token_text(self, token_id: int) -> str:
        return self.pieces[token_id].decode("utf-8", errors="replace")


@pytest.mark.parametrize("pieces, offsets", [
    ([b"ab", b"c"], [0, 2]),
    ([b"\xe2", b"\x82", b"\xac", b"!"], [0, 0, 0, 1]),  # a character split over three tokens starts where it starts
    ([b"\xe2", b"Z", b"Z"], [0, 1, 2]),  # a lead byte nothing continues: its U+FFFD comes first, Z starts after it
    ([b"\xe2", b"\xe2", b"Z"], [0, 1, 2]),  # two such lead bytes
    ([b"\xe2", b"\x82", b"Z"], [0, 0, 1]),  # a truncated character: both its bytes start at its U+FFFD
    ([b"a\xe2", b"Zb"], [0, 2]),  # the waiting byte ends one token, the next token starts after its U+FFFD
    ([b"n", b"\xe0", b"\x85", b"Z"], [0, 1, 2, 3]),  # E0 takes A0-BF next: 85 is no continuation of it, its own U+FFFD
    ([b"\xf0", b"\x8b", b"Z"], [0, 1, 2]),  # F0 takes 90-BF next
    ([b"\xf4", b"\x90", b"Z"], [0, 1, 2]),  # F4 takes 80-8F next (90 is beyond U+10FFFF)
    ([b"\xf0", b"\x9f", b"\x99", b"\x82"], [0, 0, 0, 0]),  # a valid four-byte character in four tokens
    ([b"\xef\xbf", b"\xbd", b"!"], [0, 0, 1]),  # U+FFFD itself, written in the text, split over two tokens
    ([b"\xed", b"\xa0", b"\x80", b"Z"], [0, 1, 2, 3]),  # ED takes 80-9F next: A0 would start a surrogate, its own U+FFFD
    ([b"\xed", b"\xbf", b"Z"], [0, 1, 2]),
    ([b"\xed", b"\x9f", b"\xbf", b"Z"], [0, 0, 0, 1]),  # U+D7FF, the last character before the surrogates
])
def test_offsets_index_the_decoded_text(pieces, offsets):
    tok = ByteTokens(pieces)
    counted = TextOffsets(tok)
    got = [counted.advance(i) for i in range(len(pieces))]
    text = b"".join(pieces).decode("utf-8", errors="replace")
    assert got == offsets, (got, text)
    for i, start in enumerate(got):  # a token with text of its own starts where that text is
        own = pieces[i].decode("utf-8", errors="ignore")
        if own and pieces[i][0] < 0x80:
            assert text.startswith(own, start), (i, start, text)


def test_offsets_of_an_output_with_no_prompt_text_before_it_on_a_sentencepiece_tokenizer(tmp_path) -> None:
    """A SentencePiece (Metaspace) decoder drops the leading space of the first token of a decode:
    with a prompt of special tokens only (``""`` is a bos), the output's text starts without it.
    The offsets counted it: every one was one too high, and streamed entries came a chunk late."""
    from pathlib import Path

    from runtime.request import SamplingParams
    from runtime.server.logprobs import StreamedEntries, completion_logprobs, has_text_before
    from tests.engine_helpers import make_engine
    from tests.fixtures.tiny_models import build_tiny_model
    from tests.test_detokenizer_context import write_metaspace_tokenizer

    model = build_tiny_model(Path(tmp_path), "llama", seed=3)
    write_metaspace_tokenizer(model)
    engine = make_engine(model)
    tok = engine.tokenizer
    checked_empty = 0
    for k, prompt in enumerate(["", "Hello", "", "w12 w40"] * 3):
        engine.add_request(f"r{k}", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=k, logprobs=0))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        final = outs[-1]
        before = has_text_before(tok, final.prompt_token_ids)
        assert before == (prompt != "")
        entries = completion_logprobs(tok, final.logprobs, TextOffsets(tok, before))
        for offset, token_id, token in zip(entries["text_offset"], final.token_ids, entries["tokens"]):
            piece = token[1:] if offset == 0 and not before and token.startswith(" ") else token
            assert final.text[offset : offset + len(piece)] == piece, (prompt, final.text, entries)
        ends = entries["text_offset"][1:] + [len(final.text)]  # a token's text ends where the next one's starts
        streamed, released, sent = StreamedEntries(tok, before), 0, 0
        for out in outs:  # an entry comes with the chunk whose text reaches its token's end: not earlier, not later
            streamed.add(out.new_logprobs or ())
            sent += len(out.new_text)
            released += len(streamed.release(out.new_text, out.finished))
            assert released == (len(ends) if out.finished else sum(1 for end in ends[: len(out.token_ids)] if end <= sent)), (prompt, out)
        checked_empty += not before and final.text[:1] != " " and tok.token_text(final.token_ids[0]).startswith(" ")
    assert checked_empty, "no empty-prompt output started with a token whose leading space the decoder drops"


def test_echoed_token_ids_with_no_text_just_before_the_output(tmp_path) -> None:
    """A token-id prompt with text whose last tokens are special: the output has no text just before
    it (it starts without its leading space), while the echoed prompt's own tokens do have text.
    Counting the prompt's tokens used up the dropped space, and the output's offsets were one high."""
    from pathlib import Path

    from runtime.request import SamplingParams
    from runtime.server.completions import _echoed, _whole_logprobs
    from tests.engine_helpers import make_engine
    from tests.fixtures.tiny_models import build_tiny_model
    from tests.test_detokenizer_context import write_metaspace_tokenizer

    model = build_tiny_model(Path(tmp_path), "llama", seed=3)
    write_metaspace_tokenizer(model)
    engine = make_engine(model)
    tok = engine.tokenizer
    prompt = tok.encode("Hello w12 w40", add_special_tokens=False) + [tok.bos_token_id] * 5
    for seed in range(4):
        engine.add_request(f"r{seed}", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=seed, logprobs=0, prompt_logprobs=0))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        final = outs[-1]
        echoed = _echoed(prompt, tok)
        entries = _whole_logprobs(final, tok, prompt, echoed)
        text, n = echoed + final.text, len(final.prompt_token_ids)
        offsets, tokens = entries["text_offset"][n:], entries["tokens"][n:]
        assert offsets[0] == len(echoed)
        first_text = True
        for offset, token, token_id in zip(offsets, tokens, final.token_ids):
            if tok.is_special(token_id):  # takes no room in the text
                continue
            piece = token[1:] if first_text and token.startswith(" ") and not final.text.startswith(" ") else token
            first_text = False
            assert text[offset : offset + len(piece)] == piece, (text, offsets, tokens)
