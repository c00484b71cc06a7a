"""Tiny checkpoints whose greedy output is scripted: each family's tokenizer (its tags as special tokens), a short
chat template with the structure of the family's own, and random weights changed so that greedy decoding writes a
chosen token sequence, through the real engine.

The trick: the next token depends only on the current one. Every embedding is one large basis vector (one basis
vector per scripted token, a shared one for all others), so the residual stream at the last position is that vector
plus the layers' outputs, which are small beside it; the final norm keeps its direction, and the lm_head row of each
token's successor points along the current token's vector. So the prompt's last token picks the first output token,
and each output token the next. A token can have only one successor, so every token of a script is distinct: the
scripts' phrases are added tokens of their own (non-special, as a model's words are), the tags special tokens.
"""

import dataclasses
import json

EMBEDDING_SCALE = 1e4  # makes the layers' outputs (order 1-10) negligible beside the embedding

# A few sentences to train the byte-level BPE on, as tests/serve/checkpoint.py does.
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is the weather in Paris today?",
          "Un café crème, s'il vous plaît.", "Hello world! How are you today?"] * 3


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    special_tokens: list[str]  # the tags, as special tokens
    eos: list[str]  # end-of-sequence tokens (config.json's eos_token_id), the first being eos_token
    template: str
    # Scripted outputs: {the prompt's last token: [output tokens]}; the tokens after the first are phrases (added
    # tokens) or special tokens. Scripts may share a tail (one token, one successor).
    scripts: dict[str, list[str]]


# Nemotron 3 Nano: ChatML with Qwen3-style thinking and Qwen3-Coder-style XML tool calls (chat_template.jinja of
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, shortened): tools as <function> blocks in the system turn, past calls
# as <tool_call><function=...><parameter=...>, tool results as <tool_response> in a user turn, and the generation
# prompt ending "<think>\n", or "<think></think>" with enable_thinking false.
NEMOTRON3_TEMPLATE = """{%- macro render_value(value) -%}
{%- if value is mapping or (value is iterable and value is not string) -%}{{ value | tojson }}
{%- else -%}{{ value | string }}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You have access to the following functions:

<tools>
{% for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<description>{{ tool.function.description }}</description>
<parameters>
{% for name, schema in tool.function.parameters.properties | items %}
<parameter>
<name>{{ name }}</name>
<type>{{ schema.type }}</type>
</parameter>
{% endfor %}
</parameters>
</function>
{% endfor %}
</tools>

If you choose to call a function ONLY reply in the following format:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
<think>
{{ message.reasoning_content | default('') }}
</think>
{{ message.content or '' }}
{%- for tool_call in message.tool_calls | default([]) %}
{% set call = tool_call.function %}
<tool_call>
<function={{ call.name }}>
{% for name, value in call.arguments | items %}
<parameter={{ name }}>
{{ render_value(value) }}
</parameter>
{% endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' -%}
{{ raise_exception('unknown role: ' + message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>
{% endif -%}
{%- endif -%}"""

NEMOTRON3 = Family(
    model_type="nemotron_h",
    special_tokens=["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                    "<tool_response>", "</tool_response>"],
    eos=["<|im_end|>"],
    template=NEMOTRON3_TEMPLATE,
    scripts={
        # Thinking on: the prompt ends "<think>\n".
        "\n": ["The user wants the weather in Paris.", "</think>", "Let me look that up.", "<tool_call>",
               "\n<function=get_weather>\n", "<parameter=city>\nParis\n</parameter>\n",
               "<parameter=days>\n3\n</parameter>\n", "</function>\n", "</tool_call>", "<|im_end|>"],
        # Thinking off: the prompt ends "<think></think>", and the output is the same from there on.
        "</think>": ["Let me look that up."],
    },
)

# GLM-5 (chat_template.jinja of zai-org/GLM-5, shortened): tools as JSON lines in a system turn, calls as
# <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>, tool results after <|observation|>, and
# the generation prompt ending "<|assistant|><think>", or "<|assistant|></think>" with enable_thinking false. The
# model ends a turn that calls tools with <|observation|>, one of its end-of-sequence tokens.
GLM5_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>{%- else -%}</think>{%- endif -%}
{{ m.content or '' }}
{%- for tc in m.tool_calls or [] -%}
{%- set tc = tc.function -%}
<tool_call>{{ tc.name }}
{%- for k, v in tc.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- elif m.role == 'system' -%}<|system|>{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' }}
{%- endif -%}"""

GLM5 = Family(
    model_type="glm_moe_dsa",
    special_tokens=["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                    "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"],
    eos=["<|endoftext|>", "<|user|>", "<|observation|>"],
    template=GLM5_TEMPLATE,
    scripts={
        "<think>": ["The user asks about Paris.", "</think>", "<tool_call>", "get_weather", "<arg_key>", "city",
                    "</arg_key>", "<arg_value>", "Paris", "</arg_value>", "</tool_call>", "<|observation|>"],
        "</think>": ["<tool_call>"],
    },
)


def build_tokenizer(family: Family):
    """A byte-level BPE with the family's special tokens, and each scripted phrase as one added token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=family.special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    phrases = [token for script in family.scripts.values() for token in script
               if token not in family.special_tokens]
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in dict.fromkeys(phrases)])
    return tokenizer


def successors(family: Family, tokenizer) -> dict[int, int]:
    """{token id: the id that greedy decoding writes after it}, from the scripts (each a chain from the prompt's
    last token); raises where two scripts give a token different successors."""
    def token_id(text):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, f"{text!r} is not one token: {ids}"
        return ids[0]

    chain = {}
    for start, script in family.scripts.items():
        ids = [token_id(start)] + [token_id(t) for t in script]
        for current, following in zip(ids, ids[1:]):
            assert chain.setdefault(current, following) == following, f"token {current} has two successors"
    return chain


def script_weights(model, chain: dict[int, int], default: int) -> None:
    """Set `model`'s (a transformers causal LM) embeddings, lm_head and final norm so that greedy decoding writes
    chain[t] after each token t of the chain and `default` after every other token."""
    import torch

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    hidden = embed.shape[1]
    assert len(chain) < hidden, "one basis vector per scripted token, and one for all others"
    with torch.no_grad():
        embed.zero_()
        embed[:, 0] = EMBEDDING_SCALE  # every token off the script: basis vector 0
        head.zero_()
        head[default, 0] = 1.0
        for slot, (current, following) in enumerate(chain.items(), start=1):
            embed[current].zero_()
            embed[current, slot] = EMBEDDING_SCALE
            head[following, slot] = 1.0
        for name, parameter in model.named_parameters():
            if name in ("model.norm.weight", "model.norm_f.weight", "backbone.norm_f.weight"):
                parameter.fill_(1.0)


def write_scripted_checkpoint(directory, family: Family):
    """A random model of the family's architecture with scripted greedy output, saved with its tokenizer
    (tokenizer.json, tokenizer_config.json with the chat template) as transformers saves them."""
    from transformers import PreTrainedTokenizerFast

    from tests.hf_models import make_dsa, make_nemotron_h, save

    backend = build_tokenizer(family)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=family.eos[0])
    tokenizer.chat_template = family.template
    tokenizer.save_pretrained(directory)
    template_path = directory / "chat_template.jinja"
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template_path.read_text()}, indent=2))
    template_path.unlink()

    eos_ids = [backend.token_to_id(token) for token in family.eos]
    ids = dict(vocab_size=len(tokenizer), eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
               pad_token_id=eos_ids[0], bos_token_id=None)
    model = make_nemotron_h("dense", **ids) if family.model_type == "nemotron_h" else make_dsa("glm_moe_dsa", **ids)
    script_weights(model, successors(family, backend), default=eos_ids[0])
    return save(model, directory)
