"""Incremental, UTF-8-safe detokenization: a token may end in the middle of a multi-byte
character (byte-level BPE splits emoji and CJK across tokens), so text is released only up to the
last complete character and the rest waits for the next token."""

from __future__ import annotations

import codecs


class StreamDetokenizer:
    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok = tokenizer
        self.skip = tokenizer.special_ids if skip_special and hasattr(tokenizer, "special_ids") else frozenset()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # SentencePiece pieces carry the space '▁' stands for; like Tokenizer.decode, drop the one
        # the prefix rule put before the first piece so the stream equals the final decode.
        self.strip_first_space = bool(getattr(tokenizer, "add_space_prefix", False))

    def push(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        if token_id in self.skip:
            return ""
        piece = self.tok.token_bytes(token_id)
        if self.strip_first_space and piece:
            self.strip_first_space = False
            piece = piece[1:] if piece.startswith(b" ") else piece
        return self.decoder.decode(piece)

    def flush(self) -> str:
        """Whatever is left (an incomplete character becomes U+FFFD, as a final decode would)."""
        return self.decoder.decode(b"", final=True)
