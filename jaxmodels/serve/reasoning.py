"""Splitting a chat model's generated text into reasoning and content, streamed or at once.

All three families served here write their reasoning between `<think>` and `</think>`, and all of their chat
templates can open the think block in the prompt itself, so the generated text may hold only `...</think>content`
with no opening tag. Where each format was read (the checkpoints' own templates and encoding code):

- Nemotron Nano 2 ("nemotron"): nvidia/NVIDIA-Nemotron-Nano-9B-v2, `chat_template` in tokenizer_config.json (the
  same text as llama.cpp's models/templates/NVIDIA-Nemotron-Nano-v2.jinja). Reasoning is on unless a system or user
  message says `/no_think`; the generation prompt ends `<SPECIAL_11>Assistant\\n<think>\\n\\n`, or with
  `<think></think>` when reasoning is off.
- Nemotron 3 Nano ("nemotron3"): nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, chat_template.jinja (the same text as
  llama.cpp's models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja). `enable_thinking` (default true) makes
  the prompt end `<|im_start|>assistant\\n<think>\\n`, otherwise `<|im_start|>assistant\\n<think></think>`; past
  turns are written `<think>\\nREASONING\\n</think>\\nCONTENT`.
- DeepSeek-V3.2 ("deepseek_v32"): deepseek-ai/DeepSeek-V3.2, encoding/encoding_dsv32.py (the checkpoint ships no
  jinja template). In thinking mode the prompt ends `<｜Assistant｜><think>`, in chat mode `<｜Assistant｜></think>`;
  the completion is `REASONING</think>CONTENT`.
- GLM-5 ("glm5"): zai-org/GLM-5, chat_template.jinja: the prompt ends `<|assistant|><think>`, or
  `<|assistant|></think>` with `enable_thinking` false. GLM-4.5/4.6 (zai-org/GLM-4.5, GLM-4.6 chat_template.jinja)
  end the prompt at `<|assistant|>` and the model writes `<think>` itself (`\\n<think>...` in their past turns), or
  the prompt ends `<think></think>` with thinking off; the same parser reads both.

Whitespace at the start of the output and right after a think tag is dropped: the templates put newlines there as
layout (`<think>\\n`, `</think>\\n`), not as text. Nothing else is changed, and a `</think>` after the reasoning has
ended is content like any other text.
"""

WHITESPACE = " \t\r\n"


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`: what a stream must hold back
    because the next delta could complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_leaves_think_open(prompt: str, start_tag: str = "<think>") -> bool:
    """Whether the rendered prompt ends inside an open think block, so that the output starts with reasoning.

    Only the end of the prompt is read: a tag inside an earlier message (a user quoting `<think>`) says nothing.
    """
    return prompt.rstrip(WHITESPACE).endswith(start_tag)


class ReasoningParser:
    """Routes generated text to reasoning or content, one delta at a time.

    `feed(delta)` returns the `(reasoning, content)` text it can release now and `finish()` what was held back once
    the output has ended. The only text ever held back is a possible tag cut at the end of a delta (`</th`), and, at
    the very start of the output, whitespace that may precede an opening `<think>`.

    The prompt decides where the output starts: pass the rendered `prompt` (its end is read), or say `think_open`
    outright; with neither, the template's default (reasoning on) is assumed. An opening `<think>` at the start of
    the output is accepted either way, since models write one even when the prompt already opened the block.
    """

    name = "think"
    START_TAG = "<think>"
    END_TAG = "</think>"
    # The families served here all open the think block in the prompt unless reasoning was turned off.
    THINK_OPEN_BY_DEFAULT = True

    def __init__(self, prompt: str | None = None, *, think_open: bool | None = None):
        if think_open is None:
            think_open = (prompt_leaves_think_open(prompt, self.START_TAG) if prompt is not None
                          else self.THINK_OPEN_BY_DEFAULT)
        self.think_open = think_open
        self._phase = "opening"  # then "reasoning" or "content"
        self._pending = ""  # text received but not yet routed
        self._drop_leading_whitespace = True

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of output; returns the (reasoning, content) text it releases."""
        self._pending += delta
        reasoning, content = [], []
        while self._pending:
            if self._phase == "opening":
                if not self._leave_opening():
                    break  # still a possible opening tag
            elif self._phase == "reasoning":
                end = self._pending.find(self.END_TAG)
                if end < 0:
                    keep = partial_tag_length(self._pending, self.END_TAG)
                    reasoning.append(self._take(len(self._pending) - keep))
                    break
                reasoning.append(self._take(end))
                self._pending = self._pending[len(self.END_TAG):]
                self._phase = "content"
                self._drop_leading_whitespace = True
            else:
                content.append(self._take(len(self._pending)))
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output has ended: release what was held back (an unfinished tag is plain text after all)."""
        rest = self._take(len(self._pending))
        in_reasoning = self._phase == "reasoning" or (self._phase == "opening" and self.think_open)
        return (rest, "") if in_reasoning else ("", rest)

    def split(self, text: str) -> tuple[str, str]:
        """The whole output at once: (reasoning, content). Leaves this parser untouched."""
        parser = type(self)(think_open=self.think_open)
        reasoning, content = parser.feed(text)
        reasoning_rest, content_rest = parser.finish()
        return reasoning + reasoning_rest, content + content_rest

    def _leave_opening(self) -> bool:
        """At the start of the output: consume an opening tag, or decide there is none. False while undecided."""
        stripped = self._pending.lstrip(WHITESPACE)
        if stripped.startswith(self.START_TAG):
            self._pending = stripped[len(self.START_TAG):]
            self._phase = "reasoning"
            self._drop_leading_whitespace = True
            return True
        if self.START_TAG.startswith(stripped):  # only whitespace, or a tag cut short
            return False
        self._phase = "reasoning" if self.think_open else "content"
        return True

    def _take(self, n: int) -> str:
        """Remove the first n pending characters and return them as text to emit (minus dropped layout)."""
        text, self._pending = self._pending[:n], self._pending[n:]
        if self._drop_leading_whitespace:
            text = text.lstrip(WHITESPACE)
            if text:
                self._drop_leading_whitespace = False
        return text


class NemotronReasoningParser(ReasoningParser):
    """NVIDIA Nemotron Nano 2 (nemotron_h): `<think>` opened by the prompt unless `/no_think`."""

    name = "nemotron"


class Nemotron3ReasoningParser(ReasoningParser):
    """NVIDIA Nemotron 3 Nano (nemotron_h): Qwen3-style `<think>`, opened by the prompt unless thinking is off."""

    name = "nemotron3"


class DeepSeekV32ReasoningParser(ReasoningParser):
    """DeepSeek-V3.2: the prompt ends `<think>` in thinking mode, `</think>` in chat mode."""

    name = "deepseek_v32"


class Glm5ReasoningParser(ReasoningParser):
    """GLM-5 (and GLM-4.5/4.6/4.7): `<think>` opened by the prompt (GLM-4.7, GLM-5) or written by the model."""

    name = "glm5"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (NemotronReasoningParser, Nemotron3ReasoningParser, DeepSeekV32ReasoningParser,
                              Glm5ReasoningParser)
}


def format_name_for(model_type: str | None, chat_template: str | None) -> str | None:
    """The published output format of a checkpoint ("nemotron", "nemotron3", "deepseek_v32", "glm5"), or None.

    Nemotron Nano 2 and Nemotron 3 Nano share `model_type: nemotron_h` and differ only in their templates: the
    first calls tools with `<TOOLCALL>`, the second with `<tool_call>`.
    """
    if model_type == "nemotron_h":
        if chat_template and "<TOOLCALL>" in chat_template:
            return "nemotron"
        if chat_template and "<tool_call>" in chat_template:
            return "nemotron3"
        return None
    if model_type == "deepseek_v32":
        return "deepseek_v32"
    if model_type in ("glm_moe_dsa", "glm4_moe"):  # GLM-5; GLM-4.5/4.6/4.7
        return "glm5"
    return None


def named_parser(kind: str, registry: dict, override: str):
    """The registry entry called `override`, or a ValueError naming the valid ones (for a command-line flag)."""
    if override not in registry:
        raise ValueError(f"unknown {kind} parser {override!r}; valid names: {', '.join(sorted(registry))}")
    return registry[override]


def reasoning_parser_for(model_type: str | None, chat_template: str | None = None,
                         override: str | None = None) -> type[ReasoningParser] | None:
    """The reasoning parser class for a checkpoint (call it with the rendered prompt to get a parser), or None
    where the model writes no reasoning. `override` names one outright (a `--reasoning-parser` flag)."""
    if override is not None:
        return named_parser("reasoning", REASONING_PARSERS, override)
    name = format_name_for(model_type, chat_template)
    if name is None:
        return None
    if chat_template is not None and ReasoningParser.START_TAG not in chat_template:
        return None  # a template that never writes a think block: a model without reasoning
    return REASONING_PARSERS[name]
