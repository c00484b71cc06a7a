"""Incremental detokenization: text deltas for a growing list of token ids, never half a character.

Decoding each new token alone is wrong twice over: byte-level BPE splits a character's UTF-8 bytes over tokens (a
token may decode to an invalid fragment, shown as U+FFFD), and SentencePiece-style decoders drop the leading space
of the first token they see. So each step decodes a short window of tokens (from the last point where the text was
complete) with and without the new ones, and emits the difference once it does not end in U+FFFD.

Special tokens are dropped from the text by default, as `tokenizer.decode` drops them. Chat output that a reasoning
or tool-call parser reads keeps them (`skip_special_tokens=False`): many checkpoints make `<think>`, `</think>`,
`<tool_call>` or DSML tags special tokens, and a parser cannot find a tag that was never written out.
"""

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        # token_ids[:read_offset] have been emitted as text; decoding starts at prefix_offset so that the window's
        # first token is decoded in the same context both times.
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, token_ids) -> str:
        """Append tokens; returns the text they complete ("" while a character is still unfinished)."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character at the end of the output, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing printable yet (special tokens) or a character still incomplete
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix):]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
