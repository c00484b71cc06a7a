"""Reasoning parsers: hand-written outputs of each family split into reasoning and content, at once and streamed
cut at every position."""

import pytest

from jaxmodels.serve.reasoning import (DeepSeekV32ReasoningParser, Glm5ReasoningParser, Nemotron3ReasoningParser,
                                       NemotronReasoningParser, ReasoningParser, prompt_leaves_think_open,
                                       reasoning_parser_for)

# Ends of real generation prompts, as each family's template renders them (see the module docstring for sources).
NANO2_THINK = "<SPECIAL_10>System\n\n\n<SPECIAL_11>User\nWhat is 2+2?\n<SPECIAL_11>Assistant\n<think>\n\n"
NANO2_NO_THINK = ("<SPECIAL_10>System\n\n\n<SPECIAL_11>User\nWhat is 2+2? /no_think\n<SPECIAL_11>Assistant\n"
                  "<think></think>")
NEMOTRON3_THINK = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
NEMOTRON3_NO_THINK = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think></think>"
DSV32_THINK = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>"
DSV32_CHAT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜></think>"
GLM5_THINK = "[gMASK]<sop><|user|>What is 2+2?<|assistant|><think>"
GLM5_NO_THINK = "[gMASK]<sop><|user|>What is 2+2?<|assistant|></think>"
GLM45_THINK = "[gMASK]<sop><|user|>\nWhat is 2+2?<|assistant|>"  # GLM-4.5/4.6: the model opens the block
GLM45_NO_THINK = "[gMASK]<sop><|user|>\nWhat is 2+2?/nothink<|assistant|>\n<think></think>"

CASES = [
    # Nemotron Nano 2
    pytest.param(NemotronReasoningParser, NANO2_THINK,
                 "The user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is **4**.",
                 "The user asks 2+2.\nThat is 4.\n", "The answer is **4**.", id="nano2-reasoning"),
    pytest.param(NemotronReasoningParser, NANO2_NO_THINK, "The answer is 4.", "", "The answer is 4.",
                 id="nano2-no-think"),
    pytest.param(NemotronReasoningParser, NANO2_THINK, "Quick check.</think>In XML, write </think> to close it.",
                 "Quick check.", "In XML, write </think> to close it.", id="nano2-stray-close-in-content"),
    pytest.param(NemotronReasoningParser, NANO2_THINK, "Still thinking about </thi", "Still thinking about </thi", "",
                 id="nano2-cut-off-inside-reasoning"),
    pytest.param(NemotronReasoningParser, NANO2_THINK, "Ünïcödé → 4 ✓ 🤔</think>Vier.", "Ünïcödé → 4 ✓ 🤔", "Vier.",
                 id="nano2-unicode"),
    # Nemotron 3 Nano
    pytest.param(Nemotron3ReasoningParser, NEMOTRON3_THINK, "Simple arithmetic.\n</think>\n2 + 2 = 4",
                 "Simple arithmetic.\n", "2 + 2 = 4", id="nemotron3-reasoning"),
    pytest.param(Nemotron3ReasoningParser, NEMOTRON3_NO_THINK, "2 + 2 = 4", "", "2 + 2 = 4", id="nemotron3-no-think"),
    pytest.param(Nemotron3ReasoningParser, NEMOTRON3_THINK, "<think>\nAgain.\n</think>\nFour.", "Again.\n", "Four.",
                 id="nemotron3-model-repeats-the-opening-tag"),
    pytest.param(Nemotron3ReasoningParser, NEMOTRON3_THINK, "Hmm.</think>", "Hmm.", "",
                 id="nemotron3-reasoning-only"),
    # DeepSeek-V3.2
    pytest.param(DeepSeekV32ReasoningParser, DSV32_THINK, "用户问2+2。答案是4。</think>答案是 4。",
                 "用户问2+2。答案是4。", "答案是 4。", id="dsv32-thinking"),
    pytest.param(DeepSeekV32ReasoningParser, DSV32_CHAT, "The answer is 4.", "", "The answer is 4.", id="dsv32-chat"),
    pytest.param(DeepSeekV32ReasoningParser, DSV32_THINK, "</think>Direct.", "", "Direct.",
                 id="dsv32-empty-reasoning"),
    pytest.param(DeepSeekV32ReasoningParser, DSV32_THINK, "ok</think>done </think> and </think>", "ok",
                 "done </think> and </think>", id="dsv32-stray-closes-in-content"),
    # GLM-5, and GLM-4.5/4.6 whose prompt does not open the block
    pytest.param(Glm5ReasoningParser, GLM5_THINK, "Add them.</think>4", "Add them.", "4", id="glm5-thinking"),
    pytest.param(Glm5ReasoningParser, GLM5_NO_THINK, "4", "", "4", id="glm5-no-think"),
    pytest.param(Glm5ReasoningParser, GLM45_THINK, "\n<think>Add them.</think>\n4", "Add them.", "4",
                 id="glm45-model-opens-the-block"),
    pytest.param(Glm5ReasoningParser, GLM45_THINK, "4, no thinking needed", "", "4, no thinking needed",
                 id="glm45-model-skips-the-block"),
    pytest.param(Glm5ReasoningParser, GLM45_NO_THINK, "\n4", "", "4", id="glm45-no-think"),
    pytest.param(Glm5ReasoningParser, GLM45_THINK, "Use <think> tags.", "", "Use <think> tags.",
                 id="glm45-tag-mentioned-in-content"),
]


def stream(parser: ReasoningParser, pieces) -> tuple[str, str, list[str]]:
    """Feed the pieces, then finish; returns all reasoning, all content, and the content deltas one by one."""
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    reasoning.append(r)
    content.append(c)
    return "".join(reasoning), "".join(content), content


@pytest.mark.parametrize("parser_class, prompt, output, reasoning, content", CASES)
def test_split_at_once(parser_class, prompt, output, reasoning, content):
    assert parser_class(prompt).split(output) == (reasoning, content)


@pytest.mark.parametrize("parser_class, prompt, output, reasoning, content", CASES)
def test_streamed_in_two_pieces_cut_anywhere_and_char_by_char(parser_class, prompt, output, reasoning, content):
    # Deltas are only ever appended, so equal totals also mean that no piece of a tag went out as text; where the
    # content has no "<" at all, no content delta may have one either.
    for cut in range(len(output) + 1):
        got_reasoning, got_content, deltas = stream(parser_class(prompt), [output[:cut], output[cut:]])
        assert (got_reasoning, got_content) == (reasoning, content), f"cut: {output[:cut]!r} | {output[cut:]!r}"
        assert "<" in content or not any("<" in delta for delta in deltas)
    got_reasoning, got_content, deltas = stream(parser_class(prompt), list(output))
    assert (got_reasoning, got_content) == (reasoning, content)
    assert "<" in content or not any("<" in delta for delta in deltas)


def test_only_a_cut_tag_is_held_back():
    parser = DeepSeekV32ReasoningParser(think_open=True)
    assert parser.feed("Some reasoning</th") == ("Some reasoning", "")
    assert parser.feed("e") == ("</the", "")  # not a tag after all
    assert parser.feed("n more\n\n") == ("n more\n\n", "")  # whitespace inside reasoning is not held
    assert parser.feed("<") == ("", "")
    assert parser.feed("/think>") == ("", "")
    assert parser.feed("Answer <") == ("", "Answer <")  # content holds nothing back
    assert parser.feed("/think") == ("", "/think")
    assert parser.finish() == ("", "")


def test_a_possible_opening_tag_is_held_at_the_start_only():
    parser = Glm5ReasoningParser(think_open=False)
    assert parser.feed("\n<thi") == ("", "")
    assert parser.feed("s is <think") == ("", "<this is <think")
    assert parser.finish() == ("", "")

    parser = Glm5ReasoningParser(think_open=False)
    assert parser.feed("<think") == ("", "")
    assert parser.finish() == ("", "<think")  # the output ended: a cut tag is text

    parser = Glm5ReasoningParser(think_open=True)
    assert parser.feed("<thin") == ("", "")
    assert parser.finish() == ("<thin", "")


def test_the_prompt_end_decides_whether_the_think_block_is_open():
    assert prompt_leaves_think_open(NANO2_THINK)
    assert prompt_leaves_think_open(NEMOTRON3_THINK)
    assert prompt_leaves_think_open(DSV32_THINK)
    assert prompt_leaves_think_open(GLM5_THINK)
    assert not prompt_leaves_think_open(NANO2_NO_THINK)
    assert not prompt_leaves_think_open(NEMOTRON3_NO_THINK)
    assert not prompt_leaves_think_open(DSV32_CHAT)
    assert not prompt_leaves_think_open(GLM5_NO_THINK)
    assert not prompt_leaves_think_open(GLM45_THINK)
    assert not prompt_leaves_think_open("<|user|>What does <think> mean?<|assistant|>")
    assert not prompt_leaves_think_open("")


def test_think_open_is_taken_from_the_argument_then_the_prompt_then_the_default():
    assert NemotronReasoningParser().think_open  # the templates open the block unless told not to
    assert not NemotronReasoningParser(NANO2_NO_THINK).think_open
    assert NemotronReasoningParser(NANO2_NO_THINK, think_open=True).think_open
    assert NemotronReasoningParser().split("Thinking.</think>Done.") == ("Thinking.", "Done.")


def test_split_leaves_the_parser_untouched():
    parser = Nemotron3ReasoningParser(NEMOTRON3_THINK)
    assert parser.feed("Partly </th") == ("Partly ", "")
    assert parser.split("a</think>b") == ("a", "b")
    assert parser.feed("ink>rest") == ("", "rest")


# Fragments of the families' templates, enough to tell them apart.
NANO2_TEMPLATE = "{{- '<TOOLCALL>[' -}}{{- '<SPECIAL_11>Assistant\\n' -}}{{- '<think>\\n\\n' -}}"
NEMOTRON3_TEMPLATE = "{{- '<tool_call>\\n<function=' ~ tool_call.name ~ '>\\n' -}}{{- '<think>\\n' }}"
NEMOTRON_H_BASE_TEMPLATE = "{% for m in messages %}<SPECIAL_11>{{ m.content }}{% endfor %}"
GLM5_TEMPLATE = "{{- '<tool_call>' + tc.name -}}<arg_key>{{ k }}</arg_key>{{- '</think>' if x else '<think>' -}}"


def test_parser_chosen_from_model_type_and_template():
    assert reasoning_parser_for("nemotron_h", NANO2_TEMPLATE) is NemotronReasoningParser
    assert reasoning_parser_for("nemotron_h", NEMOTRON3_TEMPLATE) is Nemotron3ReasoningParser
    assert reasoning_parser_for("nemotron_h", NEMOTRON_H_BASE_TEMPLATE) is None
    assert reasoning_parser_for("nemotron_h", None) is None
    assert reasoning_parser_for("deepseek_v32", None) is DeepSeekV32ReasoningParser  # it ships no jinja template
    assert reasoning_parser_for("glm_moe_dsa", GLM5_TEMPLATE) is Glm5ReasoningParser
    assert reasoning_parser_for("llama", "{{ messages }}") is None


def test_parser_named_outright():
    assert reasoning_parser_for("llama", None, override="glm5") is Glm5ReasoningParser
    assert reasoning_parser_for("nemotron_h", NANO2_TEMPLATE, override="deepseek_v32") is DeepSeekV32ReasoningParser
    with pytest.raises(ValueError) as error:
        reasoning_parser_for("nemotron_h", NANO2_TEMPLATE, override="qwen3")
    assert "'qwen3'" in str(error.value)
    assert "deepseek_v32, glm5, nemotron, nemotron3" in str(error.value)
