"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding each token alone breaks multi-byte characters and tokenizers that merge spaces across tokens, so
we decode a short window (a few tokens of context before the unread ones) and emit only the text past
what was already emitted, holding back while the text ends in an incomplete UTF-8 sequence. Works with any
object that has ``decode(ids, skip_special_tokens=...)`` (no torch needed).
"""

from __future__ import annotations

from typing import Any

_CONTEXT = 5  # tokens of left context; enough for every tokenizer's merge rules we know


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or a character still being spelled out byte by byte
        delta = full[len(prefix):]
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT)  # keep a little context for the next merge
        self.text += delta
        return delta
