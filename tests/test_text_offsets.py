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
