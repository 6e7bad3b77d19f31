"""Text of a growing sequence of token ids, handed out as it settles.

A generation's text is ``tokenizer.decode(ids, skip_special_tokens=True)``
of its ids so far. Decoding all of them at every round costs time that grows
with the output; ``StreamingDetokenizer`` decodes only the new ids behind a
few ids of context and hands out the text they add:

* SentencePiece writes a word's leading space as "▁" and drops it at the
  start of the text: the ids of context decode the new ids where they stand,
  not at the start, so a new word keeps its space.
* A character made of byte pieces ("<0xE4>", "<0xBD>", "<0xA0>": 你) is one
  UTF-8 sequence: the decoder turns a run of byte pieces into its
  characters when the run is valid UTF-8 and into one U+FFFD per byte when
  not, so a run's text is known only once a piece that is not a byte ends
  it (special tokens, which decoding skips, do not). Until then its ids
  wait.
* A tokenizer that cleans up spaces (" ." to ".") may drop a space when the
  next token comes: its text from the last space on waits too.

Text once handed out never changes, and the pieces joined equal the whole
decode once the sequence ends (``add(..., last=True)``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# SentencePiece's name for the byte pieces of its byte fallback.
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Ids of context kept before the new ones: the window of ids decoded each
# time holds between CONTEXT and 2 * CONTEXT of them. Ids coming one at a
# time, each decodes with about 1.5 * CONTEXT others, and the window's
# shortening decodes CONTEXT more every CONTEXT ids.
CONTEXT = 2


def byte_piece_ids(tokenizer) -> frozenset[int]:
    """The ids of ``tokenizer``'s byte pieces ("<0x00>" to "<0xFF>")."""
    return frozenset(
        index for piece, index in tokenizer.get_vocab().items() if BYTE_PIECE.fullmatch(piece)
    )


class StreamingDetokenizer:
    """The text of one sequence of token ids, as ids are added to it:
    ``add`` returns the text that the new ids settle."""

    def __init__(self, tokenizer, byte_ids: frozenset[int] | None = None):
        """``byte_ids``: ``byte_piece_ids(tokenizer)``, given where many
        sequences share a tokenizer (reading the vocabulary takes time)."""
        self.tokenizer = tokenizer
        self.byte_ids = byte_piece_ids(tokenizer) if byte_ids is None else byte_ids
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.cleans_up_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.window: list[int] = []  # the last ids decoded: context for the next ones
        self.window_text = ""  # their text, decoded together
        self.sent = 0  # characters of window_text handed out
        self.pending: list[int] = []  # ids after the window: a run of bytes not yet ended

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` alone, as the tokenizer decodes a generation."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: Sequence[int], last: bool = False) -> str:
        """The text that ``ids``, appended to the sequence, settle; with
        ``last`` (the sequence ends here), all of the text not yet handed out."""
        # Decoding skips special tokens: leaving them out changes no text,
        # and the window's ids are then never special tokens alone, which
        # would leave the next word at the start of the text, spaceless.
        self.pending += [token for token in ids if token not in self.special_ids]
        if not last and (not self.pending or self.pending[-1] in self.byte_ids):
            return ""
        window = self.window + self.pending
        text = self.decode(window)
        end = len(text) if last else self._settled_length(text)
        piece = text[self.sent : end]
        self.window, self.window_text, self.pending = window, text, []
        self.sent = max(self.sent, end)
        if len(self.window) >= 2 * CONTEXT:
            self._shorten_window()
        return piece

    def _settled_length(self, text: str) -> int:
        """The characters of ``text`` (the window's) that no later id changes."""
        # U+FFFD at the end: a character cut short, as byte-level decoders
        # (GPT-2's) mark one whose bytes have not all come.
        end = len(text.rstrip("\ufffd"))
        space = text.rfind(" ")
        if self.cleans_up_spaces and space >= 0:
            end = min(end, space)
        return end

    def _shorten_window(self) -> None:
        """Keep the last ``CONTEXT`` ids as the window, where they decode,
        alone, to the end of the window's text (the first of them may lose
        its space, and bytes their run's start) and hold the text not yet
        handed out; elsewhere the window stays whole until a later round."""
        kept = self.window[-CONTEXT:]
        kept_text = self.decode(kept)
        dropped = len(self.window_text) - len(kept_text)
        if self.window_text.endswith(kept_text) and dropped <= self.sent:
            self.window, self.window_text, self.sent = kept, kept_text, self.sent - dropped
