"""Structured output's host side (jaxmodels.engine.grammar): random walks under the masks produce outputs that a
separate checker accepts (jsonschema, re.fullmatch, Python's own parser), padded and special ids are never allowed,
invalid specs are ValueErrors that say what is wrong, and equal specs share one compiled grammar."""

import ast
import json
import re
import statistics
import time

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")  # the GPU machine may lack the [serve] extra's packages
jsonschema = pytest.importorskip("jsonschema")

from tests.serve.checkpoint import byte_level_tokenizer  # noqa: E402
from jaxmodels.engine.grammar import (GrammarCompiler, GrammarSpec, GrammarViolation, allowed_token_mask,  # noqa: E402
                                     apply_bitmask, fill_next_masks)

SPECIAL_TOKENS = ["<s>", "</s>", "<|user|>", "<|assistant|>"]  # ids 0-3
BOS, EOS = 0, 1
PADDING = 45  # the model's vocabulary is the tokenizer's plus 45 ids: not a multiple of 32, so the last word is partial
TOKEN_BUDGET = 3000

# Text whose BPE merges make tokens that cross JSON's lexemes (`":`, `{"`, `"],`, ` "`...): the masks must allow a
# token that ends one lexeme and starts the next.
CORPUS = [
    '{"name": "Ada", "age": 36, "score": 9.5, "active": true, "address": {"city": "Paris", "zip": "75001"}}',
    '{"id": "AB-123", "tags": ["red", "green", "blue"], "label": null}',
    '[{"x": 1.5, "y": -2}, {"x": 0, "y": 3e2}], "kind": "line", "points": []',
    "The quick brown fox jumps over the lazy dog. Un café crème, s'il vous plaît. 日本語 🙂",
    "12 + 34 * (5 - 6) / 78, 100.00 EUR, -42 USD, yes no maybe, ada@example.org",
] * 4


def train_tokenizer():
    return byte_level_tokenizer(CORPUS, vocab_size=600, special_tokens=SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, vocab_size=tokenizer.get_vocab_size() + PADDING, eos_token_ids=[EOS])


def check_mask(mask, tokenizer, compiler):
    """The mask's shape, and the ids it must never allow: padding past the tokenizer, special tokens other than
    EOS."""
    assert mask.dtype == np.int32 and mask.shape == ((compiler.vocab_size + 31) // 32,)
    allowed = allowed_token_mask(mask, compiler.vocab_size)
    assert not allowed[tokenizer.get_vocab_size():].any(), "a padded id is allowed"
    assert not allowed[[BOS, 2, 3]].any(), "a special token is allowed"
    return allowed


def random_walk(compiler, tokenizer, spec, seed, *, eos_probability=0.5, timings=None, prefix=()):
    """Sample uniformly among the allowed tokens until the grammar allows only EOS or, when EOS is allowed, a coin
    says stop (as a model would); then accept EOS. The decoded text. `prefix`: tokens accepted first (part of the
    text)."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(spec)
    tokens = list(prefix)
    for token in tokens:
        matcher.accept(token)
    for _ in range(TOKEN_BUDGET):
        started = time.perf_counter()
        mask = matcher.next_mask()
        if timings is not None:
            timings.append(time.perf_counter() - started)
        allowed = check_mask(mask, tokenizer, compiler)
        assert allowed.any(), f"nothing allowed after {tokenizer.decode(tokens)!r}"
        eos_allowed = bool(allowed[EOS])
        assert eos_allowed == matcher.can_finish()
        allowed[EOS] = False
        if not allowed.any() or (eos_allowed and rng.random() < eos_probability):
            break
        token = int(rng.choice(np.flatnonzero(allowed)))
        matcher.accept(token)
        tokens.append(token)
    else:
        pytest.fail(f"{spec.kind} not finished in {TOKEN_BUDGET} tokens: {tokenizer.decode(tokens)[:300]!r}")
    assert eos_allowed, f"stopped where EOS is not allowed: {tokenizer.decode(tokens)!r}"
    matcher.accept(EOS)
    assert matcher.is_finished()
    return tokenizer.decode(tokens)


SCHEMAS = {
    "nested_required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "array_of_enums": {"type": "array", "items": {"enum": ["red", "green", "blue", 3, None]},
                       "minItems": 1, "maxItems": 4},
    "patterns": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 6},
                     "maxItems": 3},
            "label": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        },
        "required": ["id", "tags"],
        "additionalProperties": False,
    },
    "refs_and_numbers": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                           "y": {"type": "integer", "exclusiveMinimum": 0}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"kind": {"const": "line"},
                       "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2,
                                  "maxItems": 3}},
        "required": ["kind", "points"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_validate(compiler, tokenizer, name):
    schema = SCHEMAS[name]
    spec = GrammarSpec.json_schema(schema)
    for seed in range(6):
        text = random_walk(compiler, tokenizer, spec, seed)
        jsonschema.validate(json.loads(text), schema)


def test_required_fields_are_always_there(compiler, tokenizer):
    spec = GrammarSpec.json_schema(SCHEMAS["nested_required"])
    for seed in range(6):
        value = json.loads(random_walk(compiler, tokenizer, spec, seed))
        assert {"name", "age", "address"} <= value.keys() <= {"name", "age", "score", "active", "address"}
        assert value["address"].keys() == {"city", "zip"} and re.fullmatch("[0-9]{5}", value["address"]["zip"])


def test_json_object(compiler, tokenizer):
    lengths = []
    for seed in range(6):
        text = random_walk(compiler, tokenizer, GrammarSpec.json_object(), seed)
        assert isinstance(json.loads(text), dict), text
        lengths.append(len(text))
    assert max(lengths) > 2, "only empty objects: the walk did not exercise the grammar"


def test_json_whitespace_is_bounded(tokenizer):
    space = tokenizer.token_to_id("Ġ")  # a single space, byte-level
    open_brace = tokenizer.token_to_id("{")
    for bound, expected in [(0, 0), (3, 3), (20, 20)]:
        compiler = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [EOS], json_max_whitespace=bound)
        matcher = compiler.matcher(GrammarSpec.json_object())
        matcher.accept(open_brace)
        assert matcher.accept_prefix([space] * 30) == expected


@pytest.mark.parametrize("pattern", [
    r"(\+|-)?[0-9]{1,4}(\.[0-9]{2})? (EUR|USD)",
    r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)",
    r"(yes|no|maybe), [A-Z][a-z]{0,5}!?",
])
def test_regex_outputs_match(compiler, tokenizer, pattern):
    for seed in range(8):
        text = random_walk(compiler, tokenizer, GrammarSpec.regex(pattern), seed)
        assert re.fullmatch(pattern, text), (pattern, text)


def test_first_mask_is_exactly_the_prefixes(compiler, tokenizer):
    """The first tokens allowed by `(yes|no)` are the tokens whose text starts one of the two words (from the
    vocabulary itself, not from the code under test)."""
    allowed = allowed_token_mask(compiler.matcher(GrammarSpec.regex("(yes|no)")).next_mask(), compiler.vocab_size)
    words = ("yes", "no")
    expected = {token for token in range(tokenizer.get_vocab_size())
                if token not in (BOS, EOS, 2, 3) and (text := tokenizer.decode([token]))
                and any(word.startswith(text) for word in words)}
    assert set(np.flatnonzero(allowed)) == expected
    assert {tokenizer.decode([t]) for t in expected} >= {"y", "n", "yes"}  # "yes" is one token of this vocabulary


ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def only_arithmetic(node) -> bool:
    if isinstance(node, ast.Expression):
        return only_arithmetic(node.body)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)) and only_arithmetic(node.left) \
            and only_arithmetic(node.right)
    return isinstance(node, ast.Constant) and type(node.value) is int


def test_lark_grammar_outputs_parse(compiler, tokenizer):
    # Rarely stopping where the expression may end, so that walks go on to operators and parentheses.
    texts = [random_walk(compiler, tokenizer, GrammarSpec.grammar(ARITHMETIC), seed, eos_probability=0.1)
             for seed in range(10)]
    for text in texts:
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text
        assert only_arithmetic(ast.parse(text, mode="eval")), text
    assert any("(" in text for text in texts) and any("*" in text or "/" in text for text in texts), texts


def test_gbnf_grammar_and_choice(compiler, tokenizer):
    gbnf = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"\n'
    outputs = {random_walk(compiler, tokenizer, GrammarSpec.grammar(gbnf), seed) for seed in range(12)}
    assert outputs <= {"yes.", "no.", "maybe."} and len(outputs) >= 2
    choices = ["Paris", "Tokyo", "café crème"]
    outputs = {random_walk(compiler, tokenizer, GrammarSpec.choice(choices), seed) for seed in range(12)}
    assert outputs <= set(choices) and len(outputs) >= 2


def test_transformers_tokenizer_gives_the_same_masks(compiler, tokenizer):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    other = GrammarCompiler(fast, compiler.vocab_size, [EOS])
    spec = GrammarSpec.json_schema(SCHEMAS["patterns"])
    ours, theirs = compiler.matcher(spec), other.matcher(spec)
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = ours.next_mask()
        np.testing.assert_array_equal(mask, theirs.next_mask())
        allowed = np.flatnonzero(allowed_token_mask(mask, compiler.vocab_size))
        if ours.is_finished():
            break
        token = int(rng.choice(allowed[allowed != EOS]))
        ours.accept(token)
        theirs.accept(token)


def test_tokenizer_padding_and_truncation_are_dropped(tokenizer):
    """llguidance tokenizes with the tokenizer.json it is given: a padded or truncating one would cut forced text."""
    from tokenizers import Tokenizer

    padded = Tokenizer.from_str(tokenizer.to_str())
    padded.enable_padding(pad_id=BOS, length=64)
    padded.enable_truncation(4)
    compiler = GrammarCompiler(padded, tokenizer.get_vocab_size(), [EOS])
    text = "The quick brown fox, 12 + 34"
    assert compiler.tokenizer.tokenize_str(text) == tokenizer.encode(text).ids
    assert padded.padding is not None and padded.truncation is not None  # the caller's tokenizer is left as it was


def test_several_eos_ids(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.get_vocab_size() + PADDING, eos_token_ids=[3, EOS])
    matcher = compiler.matcher(GrammarSpec.regex("no"))
    for token in tokenizer.encode("no").ids:
        matcher.accept(token)
    allowed = allowed_token_mask(matcher.next_mask(), compiler.vocab_size)
    assert set(np.flatnonzero(allowed)) == {EOS, 3}
    assert matcher.is_finished()


@pytest.mark.parametrize("make_spec, message", [
    (lambda: GrammarSpec.regex("a(b"), "unclosed group"),
    (lambda: GrammarSpec.json_schema({"type": "objectx"}), "objectx"),
    (lambda: GrammarSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (lambda: GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
    (lambda: GrammarSpec.json_schema({"type": "string", "pattern": "[a-"}), "unclosed character class"),
    (lambda: GrammarSpec.grammar("start: item\n"), "item"),
    (lambda: GrammarSpec.grammar("start: (\n"), "Expected"),
    (lambda: GrammarSpec.grammar("root ::= answer\n"), "answer"),  # GBNF
])
def test_invalid_specs_raise_value_error(compiler, make_spec, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        compiler.compile(make_spec())
    assert str(error.value).startswith("invalid ")


@pytest.mark.parametrize("make_spec, message", [
    (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: GrammarSpec.json_schema("[1, 2]"), "JSON object"),
    (lambda: GrammarSpec.regex(""), "non-empty"),
    (lambda: GrammarSpec.grammar(None), "non-empty"),
    (lambda: GrammarSpec.choice([]), "non-empty list"),
    (lambda: GrammarSpec("xml"), "unknown structured output kind"),
])
def test_malformed_specs_raise_value_error(make_spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_spec()


def test_compiler_checks_its_tokenizer_and_vocabulary(tokenizer):
    with pytest.raises(ValueError, match="smaller than its tokenizer's"):
        GrammarCompiler(tokenizer, tokenizer.get_vocab_size() - 1, [EOS])
    with pytest.raises(ValueError, match="EOS"):
        GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [])
    with pytest.raises(ValueError, match="past the vocabulary"):
        GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [tokenizer.get_vocab_size() + 5])


def test_cache_shares_equal_specs(tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [EOS], cache_size=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    first = compiler.compile(GrammarSpec.json_schema(schema))
    # The same schema sent as JSON text with other spacing is the same spec...
    assert compiler.compile(GrammarSpec.json_schema(json.dumps(schema, indent=4))) is first
    # ...but not with its properties in another order: they are generated in the schema's order.
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert compiler.compile(GrammarSpec.json_schema(reordered)) is not first
    assert compiler.cache_info().hits == 1 and compiler.cache_info().misses == 2
    compiler.compile(GrammarSpec.regex("x+"))  # the third grammar pushes the least recently used out
    assert compiler.compile(GrammarSpec.json_schema(schema)) is not first
    # Matchers of one compiled grammar are independent.
    one, two = compiler.matcher(GrammarSpec.regex("x+")), compiler.matcher(GrammarSpec.regex("x+"))
    one.accept(tokenizer.token_to_id("x"))
    assert one.can_finish() and not two.can_finish()


def test_rejected_token_leaves_the_matcher_usable(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.regex("[0-9]{3}"))
    before = matcher.next_mask()
    with pytest.raises(GrammarViolation, match="not allowed"):
        matcher.accept(tokenizer.token_to_id("x"))
    np.testing.assert_array_equal(matcher.next_mask(), before)
    for digit in "123":
        matcher.accept(tokenizer.token_to_id(digit))
    assert matcher.is_finished()


def test_rollback_restores_earlier_masks(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.json_schema(SCHEMAS["refs_and_numbers"]))
    rng = np.random.default_rng(3)
    masks = []
    for _ in range(12):
        masks.append(matcher.next_mask())
        allowed = np.flatnonzero(allowed_token_mask(masks[-1], compiler.vocab_size))
        matcher.accept(int(rng.choice(allowed[allowed != EOS])))
    matcher.rollback(5)
    np.testing.assert_array_equal(matcher.next_mask(), masks[7])
    matcher.rollback(7)
    np.testing.assert_array_equal(matcher.next_mask(), masks[0])
    with pytest.raises(ValueError, match="cannot roll back 1"):
        matcher.rollback(1)


def test_forced_bytes(compiler):
    matcher = compiler.matcher(GrammarSpec.json_schema(SCHEMAS["refs_and_numbers"]))
    assert matcher.forced_bytes().startswith(b'{')


def test_batch_masks_match_single_masks(compiler, tokenizer):
    specs = [GrammarSpec.json_object(), GrammarSpec.regex("[a-z]+@x"), GrammarSpec.grammar(ARITHMETIC)]
    matchers = [compiler.matcher(spec) for spec in specs]
    for matcher, text in zip(matchers, ['{"a', "ab", "12+("]):
        for token in tokenizer.encode(text).ids:
            matcher.accept(token)
    bitmask = np.full((4, compiler.mask_words), -1, np.int32)  # row 1 unconstrained
    fill_next_masks(compiler, [(matchers[0], 0), (matchers[1], 2), (matchers[2], 3)], bitmask)
    np.testing.assert_array_equal(bitmask[1], -1)
    for matcher, row in zip(matchers, [0, 2, 3]):
        np.testing.assert_array_equal(bitmask[row], matcher.next_mask())
    with pytest.raises(ValueError, match="int32"):
        fill_next_masks(compiler, [(matchers[0], 0)], bitmask.astype(np.int64))
    with pytest.raises(ValueError, match="distinct rows"):
        fill_next_masks(compiler, [(matchers[0], 0), (matchers[1], 0)], bitmask)


def test_apply_bitmask_reference():
    # Word 0 allows ids 0, 2 and 31 (the sign bit); word 1 allows id 32 and id 33.
    bitmask = np.array([[0b101 | -(1 << 31), 0b11]], np.int32)
    logits = np.arange(70, dtype=np.float32)[None] + 1.0  # 70 > 64 ids: 64-69 are past the mask
    masked = apply_bitmask(logits, bitmask)
    expected = np.full((1, 70), -np.inf, np.float32)
    expected[0, [0, 2, 31, 32, 33]] = [1.0, 3.0, 32.0, 33.0, 34.0]
    np.testing.assert_array_equal(masked, expected)
    assert masked.dtype == np.float32
    # Fewer logits than the mask covers (the mask of a 34-id vocabulary), without a batch dimension.
    np.testing.assert_array_equal(apply_bitmask(logits[0, :34], bitmask[0]), expected[0, :34])


def test_mask_cost(compiler, tokenizer):
    """Prints the cost of next_mask on this machine (`-s`); asserts nothing about speed."""
    timings = []
    for name, schema in SCHEMAS.items():
        for seed in range(3):
            random_walk(compiler, tokenizer, GrammarSpec.json_schema(schema), seed, timings=timings)
    timings_us = sorted(t * 1e6 for t in timings)
    print(f"\nnext_mask over {len(timings_us)} steps, vocabulary {compiler.vocab_size}: "
          f"p50 {statistics.median(timings_us):.1f} us, p99 {timings_us[int(0.99 * len(timings_us))]:.1f} us, "
          f"max {timings_us[-1]:.1f} us")
