"""The server's grammars (jaxmodels.serve.tool_grammar): random walks under each family's tool-call grammar always
give text that the family's own tool-call parser reads into calls of the given tools, whose arguments validate
against the tools' parameter schemas (one call only where parallel calls are off); after a think block, the
constraint holds for the content."""

import json
import re

import pytest

llguidance = pytest.importorskip("llguidance")  # the GPU machine may lack the [serve] extra's packages
jsonschema = pytest.importorskip("jsonschema")

from jaxmodels.engine.grammar import GrammarSpec  # noqa: E402
from jaxmodels.serve.reasoning import ReasoningParser  # noqa: E402
from jaxmodels.serve.tool_calls import DSML, TOOL_CALL_PARSERS  # noqa: E402
from jaxmodels.serve.tool_grammar import FORMATS, after_reasoning, tool_call_grammar  # noqa: E402
from tests.engine import test_grammar  # noqa: E402
from tests.engine.test_grammar import random_walk  # noqa: E402

tokenizer, compiler = test_grammar.tokenizer, test_grammar.compiler  # the grammar tests' fixtures

# Bounded values (maxLength, enums, maxItems): a random walk ends within its token budget.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["guests"],
        "properties": {"guests": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                             "properties": {"name": {"type": "string",
                                                                                     "maxLength": 5}},
                                                             "required": ["name"]},
                                  "minItems": 1, "maxItems": 2},
                       "vip": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 4}}}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters at all
]


def parameters_of(name: str) -> dict:
    function = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    return function.get("parameters") or {"type": "object", "additionalProperties": False}


@pytest.mark.parametrize("format_name", FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_random_calls_parse_and_validate(compiler, tokenizer, format_name, parallel):
    spec = tool_call_grammar(format_name, TOOLS, parallel=parallel, tokenizer=tokenizer,
                             json_options=compiler.json_options)
    seen = set()
    for seed in range(12):
        text = random_walk(compiler, tokenizer, spec, seed, eos_probability=0.7)
        content, calls = TOOL_CALL_PARSERS[format_name](tools=TOOLS, seed=0).parse(text)
        assert content == "" and calls, (format_name, text)
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), parameters_of(call["name"]))
            seen.add(call["name"])
    assert len(seen) >= 2  # the walks reach several of the tools


@pytest.mark.parametrize("format_name", FORMATS)
def test_a_named_function_is_the_only_one_called(compiler, tokenizer, format_name):
    spec = tool_call_grammar(format_name, [TOOLS[1]], tokenizer=tokenizer, json_options=compiler.json_options)
    for seed in range(4):
        _, calls = TOOL_CALL_PARSERS[format_name](tools=TOOLS).parse(random_walk(compiler, tokenizer, spec, seed))
        assert {call["name"] for call in calls} == {"book"}


def test_unknown_formats_and_no_tools_are_refused():
    with pytest.raises(ValueError, match="no tool-call grammar"):
        tool_call_grammar("llama", TOOLS)
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar("glm5", [])


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema({"type": "object", "additionalProperties": False,
                                                           "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}),
                                  GrammarSpec.regex(r"[ab]{2}/[0-9]"), GrammarSpec.choice(["yes", "no"])])
def test_reasoning_then_the_constraint(compiler, tokenizer, spec):
    """A think-open prompt: free text up to </think>, then the constrained answer, which the reasoning parser
    puts in content."""
    checks = {"json_schema": lambda text: json.loads(text) in ({"n": 1}, {"n": 2}),
              "regex": lambda text: re.fullmatch(r"[ab]{2}/[0-9]", text), "choice": lambda text: text in ("yes", "no")}
    wrapped = after_reasoning(spec, "</think>", tokenizer=tokenizer, json_options=compiler.json_options)
    for seed in range(6):
        # (A random walk would hardly ever write </think> itself.)
        thoughts = tokenizer.encode(f"The quick {seed} fox</think>").ids
        text = random_walk(compiler, tokenizer, wrapped, seed, eos_probability=0.9, prefix=thoughts)
        reasoning, content = ReasoningParser(think_open=True).split(text)
        assert reasoning == f"The quick {seed} fox" and checks[spec.kind](content), (reasoning, content)


def test_reasoning_may_end_with_the_special_token():
    """Where </think> is one special token, the reasoning ends with it (as the model writes it) or with its text."""
    from jaxmodels.engine.grammar import GrammarCompiler
    from tests.serve.checkpoint import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(vocab_size=300, special_tokens=["<s>", "</s>", "</think>"])
    compiler = GrammarCompiler(tokenizer, vocab_size=300, eos_token_ids=[1])
    matcher = compiler.matcher(after_reasoning(GrammarSpec.choice(["ok"]), "</think>", tokenizer=tokenizer))
    for token in tokenizer.encode("some thoughts").ids + [2] + tokenizer.encode("ok").ids:
        matcher.accept(token)
    assert matcher.is_finished()


SPECIAL_TAGS = ["<s>", "</s>", DSML, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>", "<TOOLCALL>", "</TOOLCALL>"]


@pytest.mark.parametrize("format_name", FORMATS)
def test_tags_that_are_special_tokens(format_name):
    """Where the format's tags (or DSML's marker inside them) are special tokens, as in the families' tokenizers,
    calls written with those tokens parse and validate (decoded with the special tokens kept, as the server does)."""
    import numpy as np

    from jaxmodels.engine.grammar import GrammarCompiler, allowed_token_mask
    from tests.engine.test_grammar import CORPUS
    from tests.serve.checkpoint import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(CORPUS, vocab_size=500, special_tokens=SPECIAL_TAGS)
    compiler = GrammarCompiler(tokenizer, vocab_size=512, eos_token_ids=[1])
    spec = tool_call_grammar(format_name, TOOLS, tokenizer=tokenizer, json_options=compiler.json_options)
    used_special = False
    for seed in range(8):
        rng, matcher, tokens = np.random.default_rng(seed), compiler.matcher(spec), []
        while not matcher.is_finished() and len(tokens) < 3000:
            allowed = allowed_token_mask(matcher.next_mask(), compiler.vocab_size)
            if allowed[1] and rng.random() < 0.7:
                break
            allowed[1] = False
            token = int(rng.choice(np.flatnonzero(allowed)))
            matcher.accept(token)
            tokens.append(token)
        assert matcher.can_finish()
        used_special |= any(2 <= t < len(SPECIAL_TAGS) for t in tokens)
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        content, calls = TOOL_CALL_PARSERS[format_name](tools=TOOLS).parse(text)
        assert content == "" and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), parameters_of(call["name"]))
    assert used_special  # the walks took the special-token spelling too
