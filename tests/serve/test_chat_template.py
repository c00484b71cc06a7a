"""Chat templates render as transformers' `apply_chat_template` renders them (no server needed)."""

import pytest

from jaxmodels.serve.chat_template import ChatTemplate, ChatTemplateError
from tests.serve.checkpoint import write_tokenizer

CONVERSATION = [
    {"role": "system", "content": "  You answer in French.  "},
    {"role": "user", "content": "Un café, s'il vous plaît 🙂", "name": "Zoë"},
    {"role": "assistant", "content": "Voilà !", "tool_calls": None},
    {"role": "user", "content": "Merci."},
]


def transformers_ids(directory, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, **kwargs)["input_ids"]


def our_ids(directory, messages, **kwargs) -> list[int]:
    from tokenizers import Tokenizer

    text = ChatTemplate.from_directory(directory).render(messages, **kwargs)
    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("template_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
@pytest.mark.parametrize("options", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                     dict(add_generation_prompt=True, enable_thinking=True)],
                         ids=["generation_prompt", "no_generation_prompt", "template_variable"])
def test_prompt_ids_equal_transformers(tmp_path, template_file, options):
    write_tokenizer(tmp_path, template_file=template_file)
    assert our_ids(tmp_path, CONVERSATION, **options) == transformers_ids(tmp_path, CONVERSATION, **options)


def test_raise_exception_in_the_template_is_a_chat_template_error(tmp_path):
    write_tokenizer(tmp_path)
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        ChatTemplate.from_directory(tmp_path).render([{"role": "robot", "content": "beep"}])


def test_a_checkpoint_without_a_template_has_none(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    assert ChatTemplate.from_directory(tmp_path) is None
