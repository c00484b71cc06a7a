"""How many characters of text a prompt can have and still fit in max_seq_len tokens, so that the server refuses a
prompt of megabytes at once instead of tokenizing it first (a second per megabyte, on one core).

The bound is read off the tokenizer: each token stands for at most as many characters of the text the model sees
as its longest entry in the vocabulary has (a byte-level token's characters are bytes, and a character is at least
one byte; a byte-fallback entry "<0xE3>" stands for one byte but counts 6), and Unicode normalization (NFC, NFKC)
makes one character out of at most 4 (Unicode's longest canonical decomposition, Greek like U+1F82). So a text of
more than (max_seq_len - 1) * longest * shrink characters cannot fit in the max_seq_len - 1 tokens a prompt may
have. That only holds if the tokenizer never drops text: not with a normalizer that strips or collapses whitespace
or deletes characters, a pre-tokenizer that drops whitespace, a model that maps a run of unknown characters (or a
long word) to one token or leaves unknown characters out, added tokens that swallow the whitespace next to them,
or truncation. Such a tokenizer gets no bound (None): its prompts are tokenized whole, off the event loop.
"""

import json

# Normalizers that can make the text shorter by at most this factor; any other (Strip, StripAccents, BertNormalizer,
# Precompiled, ...) may delete characters without limit. Replace is judged by its pattern (see _replace_shrink).
NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that split the text without dropping any of it (Split and Punctuation unless behavior "Removed").
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def max_prompt_chars(tokenizer, max_seq_len: int) -> int | None:
    """The most characters a text prompt that fits in max_seq_len tokens can have, or None where the tokenizer
    gives no such bound."""
    chars = max_chars_per_token(tokenizer)
    return None if chars is None else (max_seq_len - 1) * chars


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of input text one token of `tokenizer` (a `tokenizers.Tokenizer`) can stand for, or None
    when the tokenizer may drop text (see the module's docstring)."""
    config = json.loads(tokenizer.to_str())
    shrink = _normalizer_shrink(config.get("normalizer"))
    pre_tokenizers = list(_components(config.get("pre_tokenizer")))
    if (shrink is None or config.get("truncation") is not None
            or not all(_keeps_text(p) for p in pre_tokenizers)
            or not _covers_every_character(config["model"], pre_tokenizers)
            or any(t.get("lstrip") or t.get("rstrip") for t in config.get("added_tokens", []))):
        return None
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)))
    return shrink * longest


def _components(config):
    """The normalizers or pre-tokenizers of a config, Sequences flattened."""
    if config is None:
        return
    if config["type"] == "Sequence":
        for part in config.get("normalizers") or config.get("pretokenizers") or []:
            yield from _components(part)
    else:
        yield config


def _normalizer_shrink(config) -> int | None:
    shrink = 1
    for normalizer in _components(config):
        factor = (_replace_shrink(normalizer) if normalizer["type"] == "Replace"
                  else NORMALIZER_SHRINK.get(normalizer["type"]))
        if factor is None:
            return None
        shrink *= factor
    return shrink


def _replace_shrink(normalizer) -> int | None:
    """A literal pattern replaced by non-empty content shortens the text by at most len(pattern) / len(content)
    (Llama's and Gemma's " " -> "▁": not at all); a regex may match any length."""
    pattern, content = normalizer["pattern"].get("String"), normalizer["content"]
    if not pattern or not content:
        return None
    return -(-len(pattern) // len(content))


def _keeps_text(pre_tokenizer) -> bool:
    return pre_tokenizer["type"] in KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _covers_every_character(model, pre_tokenizers) -> bool:
    """Whether every character of the text ends up in its own tokens: through byte fallback, a vocabulary with all
    256 byte-level characters, or an unknown token per unknown character (BPE without fuse_unk). Unigram merges a
    run of unknown characters into one token, WordPiece and WordLevel a whole unknown word."""
    if model.get("byte_fallback"):
        return True
    if model["type"] != "BPE":
        return False
    if any(p["type"] == "ByteLevel" for p in pre_tokenizers):
        from tokenizers.pre_tokenizers import ByteLevel

        return set(ByteLevel.alphabet()) <= set(model["vocab"])
    return model.get("unk_token") is not None and not model.get("fuse_unk")
