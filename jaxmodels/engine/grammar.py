"""Structured output: token masks that keep a request's output inside a JSON schema, a regex or a grammar.

The grammar engine is llguidance (a maintained Rust library with Python bindings; it reads a Hugging Face
`tokenizer.json` itself, covers most of JSON Schema, and computes a mask for a 128k vocabulary in tens of
microseconds). This module is the host-side half:

    compiler = GrammarCompiler(llm.tokenizer, vocab_size=config.vocab_size, eos_token_ids=engine.eos_ids)
    matcher = compiler.matcher(GrammarSpec.json_schema(schema))   # ValueError: a 400 naming the field
    mask = matcher.next_mask()       # int32[ceil(vocab_size / 32)], bit i % 32 of word i // 32 set: token i allowed
    ... sample under the mask (apply_bitmask is the numpy reference of what the compiled step does) ...
    matcher.accept(token)            # GrammarViolation when the token was not allowed
    matcher.is_finished()            # nothing but EOS can follow: the request stops

A mask depends on every token before it: the mask for the token at position p is ready only once the token at
p - 1 was accepted. Compiled grammars are cached by spec (clients resend the same schema): a request's matcher is a
copy of the cached one, so it does not build the grammar's lexer again.

For the device: a batch's masks are one int32[batch, ceil(vocab_size / 32)] array (fill_next_masks writes the rows
of constrained requests in parallel; -1, every bit set, is the row of an unconstrained one), applied to the logits
before temperature, top-k/top-p and sampling, as apply_bitmask does.

Costs measured on the development machine (a shared 2-core x86 CPU, llguidance 1.9.1) with a byte-level BPE
tokenizer of 128,000 tokens (trained on Python sources and docs) and a model vocabulary of 128,256, over random walks
(uniform among the allowed tokens) through the schemas, regex and Lark grammar of tests/engine/test_grammar.py:
    next_mask            p50 15-70 us, p90 30-170 us, p99 0.1-2 ms, worst seen ~6 ms
    first mask           50-300 us
    accept               5-10 us
    matcher from cache   10-30 us (a copy of the compiled template)
    compile (cache miss) 0.6-2 ms for these schemas
    GrammarCompiler      ~1 s (llguidance indexes the 128k vocabulary): once per served model, off the event loop
`pytest -s tests/engine/test_grammar.py` prints next_mask's cost for the tests' small vocabulary.
"""

import dataclasses
import functools
import json
import threading

import numpy as np

__all__ = ["GrammarCompiler", "GrammarMatcher", "GrammarSpec", "GrammarViolation", "CompiledGrammar",
           "apply_bitmask", "allowed_token_mask", "bitmask_words", "fill_next_masks", "KINDS"]

JSON_OBJECT = "json_object"  # response_format {"type": "json_object"}: any JSON object
JSON_SCHEMA = "json_schema"  # response_format {"type": "json_schema"}, vLLM guided_json / structured_outputs.json
REGEX = "regex"  # vLLM guided_regex / structured_outputs.regex, SGLang regex
GRAMMAR = "grammar"  # Lark or GBNF: vLLM guided_grammar / structured_outputs.grammar, SGLang ebnf
CHOICE = "choice"  # one of a list of strings: vLLM guided_choice / structured_outputs.choice
KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, GRAMMAR, CHOICE)

# Flexible JSON whitespace lets a model write the JSON it was trained on (pretty-printed or not), but an unbounded
# run of it lets a sampled model loop on newlines until max_tokens. A run of at most this many whitespace characters
# between two JSON tokens still pretty-prints several levels deep.
DEFAULT_JSON_MAX_WHITESPACE = 20
DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 1000  # a grammar error goes back to the client: its own text, but bounded


class GrammarViolation(ValueError):
    """A token the grammar does not allow at this point (a sampler that ignored the mask, or a wrong draft)."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `source` is canonical text (a schema as compact JSON in the order
    the client wrote its keys: the order of properties is the order they are generated in), so equal specs are equal
    cache keys. Build one with the class methods, which check the client's value."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}: one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise ValueError(f"a {self.kind} spec is text, not {type(self.source).__name__}")

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls(JSON_OBJECT)

    @classmethod
    def json_schema(cls, schema: dict | str) -> "GrammarSpec":
        """A JSON schema, as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        return cls(JSON_SCHEMA, json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """A regular expression the whole output matches (Rust `regex` syntax, close to Python's `re`)."""
        return cls(REGEX, _nonempty_text(pattern, "regex"))

    @classmethod
    def grammar(cls, text: str) -> "GrammarSpec":
        """A context-free grammar in Lark syntax (llguidance's variant), or in GBNF (llama.cpp / SGLang `ebnf`)."""
        return cls(GRAMMAR, _nonempty_text(text, "grammar"))

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        """One of these strings exactly."""
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
            raise ValueError("choice is a non-empty list of strings")
        return cls(CHOICE, json.dumps(list(options), ensure_ascii=False))


def _nonempty_text(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"the {what} is a non-empty string")
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A spec compiled for one tokenizer. `template` is a matcher at the start of the output that nothing consumes
    from: each request copies it."""

    spec: GrammarSpec
    grammar: str  # llguidance's serialized grammar
    template: object  # llguidance.LLMatcher
    vocab_size: int
    eos_token_ids: frozenset


class GrammarCompiler:
    """Built once per served model: the tokenizer as llguidance sees it (vocabulary padded to the model's, EOS ids)
    and a bounded LRU of compiled grammars. Thread-safe: compile from a worker thread (a complex grammar can take
    100 ms or more to build, with the GIL released), not on the event loop."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 json_max_whitespace: int | None = DEFAULT_JSON_MAX_WHITESPACE):
        """`tokenizer`: a `tokenizers.Tokenizer` (what jaxmodels.llm.load_tokenizer returns) or a transformers fast
        tokenizer. `vocab_size`: the model's (its logits' width): ids past the tokenizer's vocabulary are padding
        and never allowed. `eos_token_ids`: the ids that end a request (the config's eos_token_id, one or a list);
        the mask allows them exactly when the grammar is complete. `json_max_whitespace`: the longest run of
        whitespace between JSON tokens (None: unbounded; 0: compact JSON only)."""
        import llguidance

        self.vocab_size = int(vocab_size)
        self.eos_token_ids = _eos_list(eos_token_ids)
        self.tokenizer = _llguidance_tokenizer(llguidance, tokenizer, self.vocab_size, self.eos_token_ids)
        self.json_options = _json_options(json_max_whitespace)
        # No parser state or grammar text in the errors of consumed tokens: they end up in logs, and can be large.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compile_cached = functools.lru_cache(maxsize=cache_size)(self._compile)
        self._executor = None
        self._executor_lock = threading.Lock()

    @property
    def mask_words(self) -> int:
        return bitmask_words(self.vocab_size)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The spec compiled (from the cache when an equal spec was compiled recently). ValueError when the spec is
        invalid (a bad regex, an unknown JSON schema keyword, a Lark syntax error...), with llguidance's message."""
        if not isinstance(spec, GrammarSpec):
            raise TypeError(f"compile takes a GrammarSpec, not {type(spec).__name__}")
        return self._compile_cached(spec)

    def matcher(self, spec: GrammarSpec | CompiledGrammar) -> "GrammarMatcher":
        """A fresh matcher for one request."""
        compiled = spec if isinstance(spec, CompiledGrammar) else self.compile(spec)
        return GrammarMatcher(compiled)

    def cache_info(self):
        return self._compile_cached.cache_info()

    def executor(self):
        """A pool of llguidance threads that compute a batch's masks in parallel (created on first use)."""
        with self._executor_lock:
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            return self._executor

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        try:
            grammar = self._llguidance_grammar(llguidance, spec)
        except ValueError as error:  # a GBNF grammar that does not convert to Lark
            raise ValueError(f"invalid {spec.kind}: {_bounded(str(error))}") from None
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        # The matcher's constructor never raises on a bad grammar: it starts in an error state that says why.
        if template.is_error():
            raise ValueError(f"invalid {spec.kind}: {_bounded(template.get_error())}")
        return CompiledGrammar(spec, grammar, template, self.vocab_size, frozenset(self.eos_token_ids))

    def _llguidance_grammar(self, llguidance, spec: GrammarSpec) -> str:
        if spec.kind == JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=self.json_options)
        if spec.kind == JSON_SCHEMA:
            # Our whitespace bound overrides the schema's own "x-guidance" options: it protects the server.
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=self.json_options)
        if spec.kind == REGEX:
            return llguidance.grammar_from("regex", spec.source)
        if spec.kind == GRAMMAR:
            # "grammar" takes Lark as it is and converts GBNF (rules written `name ::= ...`) to Lark.
            return llguidance.grammar_from("grammar", spec.source)
        return llguidance.grammar_from("choice", spec.source)


def _eos_list(eos_token_ids) -> list[int]:
    if isinstance(eos_token_ids, (int, np.integer)):
        return [int(eos_token_ids)]
    ids = sorted(int(t) for t in eos_token_ids or ())
    if not ids:
        raise ValueError("structured output needs the model's EOS token id(s): the grammar ends the output with one")
    return ids


def _llguidance_tokenizer(llguidance, tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance reads the tokenizer.json text itself (vocabulary, byte-level or byte-fallback decoding, added
    tokens), so no transformers is needed; a transformers fast tokenizer is read through its Rust backend."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"structured output needs a `tokenizers` tokenizer (tokenizer.json), not "
                        f"{type(tokenizer).__name__}")
    if backend.padding is not None or backend.truncation is not None:
        # llguidance tokenizes forced text with it, which must not be cut or padded; copying costs ~0.5 s for a
        # 128k vocabulary, so only when needed.
        backend = Tokenizer.from_str(backend.to_str())
        backend.no_padding()
        backend.no_truncation()
    tokenizer_size = backend.get_vocab_size(with_added_tokens=True)
    if vocab_size < tokenizer_size:
        raise ValueError(f"the model's vocabulary ({vocab_size}) is smaller than its tokenizer's ({tokenizer_size})")
    if max(eos_token_ids) >= vocab_size:
        raise ValueError(f"EOS token id {max(eos_token_ids)} is past the vocabulary ({vocab_size})")
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)


def _json_options(json_max_whitespace: int | None) -> dict:
    if json_max_whitespace is None:
        return {"whitespace_flexible": True}
    if json_max_whitespace == 0:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True, "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{int(json_max_whitespace)}}}"}


def _bounded(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


class GrammarMatcher:
    """One request's place in its grammar. Not thread-safe: one thread at a time drives it (the engine's)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._matcher = compiled.template.deep_copy()
        self._consumed = 0  # tokens accepted (EOS included): how far rollback may go

    @property
    def spec(self) -> GrammarSpec:
        return self.compiled.spec

    def next_mask(self) -> np.ndarray:
        """The tokens allowed next, as a new int32[ceil(vocab_size / 32)] bitmask (bit set: allowed). EOS is
        allowed when the grammar may end here; padded ids never are."""
        mask = np.zeros((1, bitmask_words(self.vocab_size)), np.int32)
        self.fill_mask(mask, 0)
        return mask[0]

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the next mask into row `row` of a batch's int32[batch, ceil(vocab_size / 32)] bitmask, without
        allocating (see fill_next_masks for a whole batch in parallel)."""
        from llguidance.numpy import fill_next_token_bitmask

        _check_bitmask(bitmask, self.vocab_size)
        fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`. GrammarViolation when the grammar does not allow it; the matcher then stays
        where it was (llguidance's plain consume would leave it in an error state for good)."""
        token_id = int(token_id)
        if self._matcher.is_stopped():
            # llguidance takes EOS after a complete output without recording it (there is nothing to roll back), and
            # its try_consume_tokens refuses it there: check it ourselves.
            if token_id not in self.compiled.eos_token_ids:
                raise GrammarViolation(f"token {token_id} after the end of the {self.spec.kind}: only EOS may follow")
            return
        if self._matcher.try_consume_tokens([token_id]) != 1:
            raise GrammarViolation(f"token {token_id} is not allowed by the {self.spec.kind} here")
        self._consumed += 1

    def accept_prefix(self, token_ids: list[int]) -> int:
        """Advance past the longest allowed prefix of `token_ids` (a speculative draft); how many were accepted.
        After the end of the grammar it accepts nothing, not even EOS (the request ends there anyway)."""
        accepted = self._matcher.try_consume_tokens([int(t) for t in token_ids])
        self._consumed += accepted
        return accepted

    def can_finish(self) -> bool:
        """The output so far is complete: EOS is allowed now (more may still be allowed too, as after `12` in a
        number)."""
        return self._matcher.is_accepting()

    def is_finished(self) -> bool:
        """Nothing but EOS can follow (or EOS was accepted): the request must stop; it may stop without sampling
        the EOS."""
        return self._matcher.is_stopped()

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a speculative draft's rejected tail)."""
        if not 0 <= n <= self._consumed:
            raise ValueError(f"cannot roll back {n} tokens: {self._consumed} accepted")
        if n and not self._matcher.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self._matcher.get_error()}")
        self._consumed -= n

    def forced_bytes(self) -> bytes:
        """The bytes the grammar forces next whatever is sampled (e.g. `{"name":` of a schema with one required
        first property): a jump-forward optimization may append their tokens without sampling."""
        return self._matcher.compute_ff_bytes()


def fill_next_masks(compiler: GrammarCompiler, matchers: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray):
    """Each matcher's next mask into its row of `bitmask` (int32[batch, ceil(vocab_size / 32)]), in parallel on
    llguidance's threads with the GIL released. Rows not named are left as they are (fill them with -1, all
    allowed, for unconstrained requests)."""
    from llguidance.numpy import fill_next_token_bitmask_par

    _check_bitmask(bitmask, compiler.vocab_size)
    rows = [row for _, row in matchers]
    if len(set(rows)) != len(rows) or any(not 0 <= row < bitmask.shape[0] for row in rows):
        raise ValueError(f"matcher rows must be distinct rows of the {bitmask.shape[0]}-row bitmask: {rows}")
    if matchers:  # (llguidance refuses an empty batch)
        fill_next_token_bitmask_par(compiler.executor(), [(m._matcher, row) for m, row in matchers], bitmask)


def _check_bitmask(bitmask: np.ndarray, vocab_size: int) -> None:
    # llguidance writes through a raw pointer: a wrong shape or layout would write out of bounds.
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"] \
            or bitmask.shape[1] != bitmask_words(vocab_size):
        raise ValueError(f"a bitmask is a C-contiguous int32[batch, {bitmask_words(vocab_size)}] array, not "
                         f"{bitmask.dtype}{list(bitmask.shape)}")


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_token_mask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The bitmask (int32[..., words]) unpacked to bool[..., vocab_size]: token i is bit i % 32 of word i // 32.
    Ids past 32 * words are not allowed."""
    bitmask = np.asarray(bitmask, np.int32)
    shifts = np.arange(32, dtype=np.uint32)
    bits = (bitmask.view(np.uint32)[..., :, None] >> shifts) & 1  # [..., words, 32]
    allowed = bits.reshape(*bitmask.shape[:-1], -1).astype(bool)
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    padding = np.zeros((*allowed.shape[:-1], vocab_size - allowed.shape[-1]), bool)
    return np.concatenate([allowed, padding], axis=-1)


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """The numpy reference of the device's masking: `logits` ([..., V]) with the tokens the bitmask ([..., words])
    does not allow set to -inf (a new array; ids past 32 * words count as not allowed)."""
    logits = np.asarray(logits)
    allowed = allowed_token_mask(bitmask, logits.shape[-1])
    return np.where(allowed, logits, np.array(-np.inf, logits.dtype))
