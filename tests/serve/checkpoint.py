"""A tiny served checkpoint: a random Nemotron-H with a real byte-level BPE tokenizer and a chat template.

The tokenizer is trained with `tokenizers` on a few sentences with accents, CJK and emoji, so that many characters
stay split over several byte tokens: the detokenizer meets tokens that are half a UTF-8 character.
"""

import json

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Un café crème, s'il vous plaît, dit le garçon naïf.",
    "日本語のテキストも少し。",
    "Emoji: 🙂🚀 and math: ∑ x² ≤ ∞.",
    "Hello world! Hello there, how are you today?",
] * 3
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]  # ids 0-4: bos 0, eos 1

# Exercises what transformers' rendering sets up: trim_blocks / lstrip_blocks (indented block tags on their own
# lines), bos/eos variables, raise_exception, the tojson filter, extra variables (enable_thinking) and
# add_generation_prompt.
CHAT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>
    {% if message.name is defined %}
name={{ message.name | tojson }}
    {% endif %}
{{ message['content'] | trim }}
    {% if message['role'] == 'assistant' %}
{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
    {% if enable_thinking is defined and enable_thinking %}
<think>
    {% endif %}
{% endif %}"""


def byte_level_tokenizer(corpus=SENTENCES, *, vocab_size: int = 320, special_tokens=SPECIAL_TOKENS):
    """A byte-level BPE tokenizer (as the served families' are) trained on `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def write_tokenizer(directory, *, chat_template: str | None = CHAT_TEMPLATE, template_file: bool = False):
    """tokenizer.json and tokenizer_config.json as transformers writes them; the template goes into
    tokenizer_config.json (where most Hub checkpoints have it) or, with template_file, into chat_template.jinja (as
    transformers 5 saves it)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    template_path = directory / "chat_template.jinja"
    if chat_template is not None and not template_file:
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "chat_template": template_path.read_text()}, indent=2))
        template_path.unlink()
    return tokenizer


def write_checkpoint(directory, *, chat_template: str | None = CHAT_TEMPLATE):
    """A random dense Nemotron-H whose vocabulary is the tokenizer's, saved with its tokenizer."""
    from tests.hf_models import make_nemotron_h, save

    tokenizer = write_tokenizer(directory, chat_template=chat_template)
    model = make_nemotron_h("dense", vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return save(model, directory)
