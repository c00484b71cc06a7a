"""Long prompts through the engine (chunked prefill over paged caches) give the greedy tokens of the model's own
full forward.

On CPU: a few thousand tokens on tiny models, in prefill chunks that do not divide the prompts; the DSA model's
indexer keeps 64 keys of thousands (sparse), and its YaRN rope runs far past its original context. On the GPU: a
32k-token prompt on a DSA model whose shapes take the Pallas kernels (exact bf16 index keys: the FP8 index cache is
off, so the forward and the engine score keys alike), and an 8k prompt on a Nemotron-H one.

The check is teacher-forced: one full forward over the prompt and the engine's tokens gives, at every position from
the prompt's last on, the logits the engine's next token was drawn from; the token must be their argmax. Both
compute in float32 with summation orders that differ (chunks vs whole sequence, paged vs contiguous), so a token
whose logit is within TIE of the maximum counts as a tie: float32 reassociation over a few layers moves logits by
~1e-6 of their scale, and the logits' spread is checked to be far above TIE, so a wrong token cannot pass as a tie.
"""

import numpy as np
import pytest

import jaxmodels
from jaxmodels import SamplingParams
from tests.hf_models import TINY_CONFIGS, build_from_config

TIE = 1e-4  # of the largest |logit|
NEW_TOKENS = 6


def teacher_forced_logits(model, ids: list[int]) -> np.ndarray:
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[0])
    return np.asarray(forward(state, np.asarray([ids], np.int32)))


def assert_greedy_follows_forward(model, prompt: list[int], tokens: list[int]) -> None:
    assert len(tokens) == NEW_TOKENS
    logits = teacher_forced_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
    scale = np.abs(logits).max()
    assert np.std(logits, axis=-1).min() > 100 * TIE * scale, "logits too flat for the check to mean anything"
    for i, (token, row) in enumerate(zip(tokens, logits)):
        best = int(row.argmax())
        assert token == best or row[best] - row[token] <= TIE * scale, (
            f"token {i} after a {len(prompt)}-token prompt: engine {token} ({row[token]:.6f}), forward's argmax "
            f"{best} ({row[best]:.6f})")


def serve(model, prompts, *, chunk: int, max_seq_len: int):
    # One bucket of each kind, compiled before serving: the default warm-up would go on compiling the smaller decode
    # buckets and the samplers of sampled requests in the background, which greedy requests of the largest batch
    # never use (on the CPU, more compile time than the two buckets served).
    llm = jaxmodels.LLM(None, model=model, dtype="float32", max_batch_size=len(prompts), max_seq_len=max_seq_len,
                        prefill_sizes=[chunk], decode_sizes=[len(prompts)], warmup="all", progress=False)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return [out.token_ids for out in outs]


def long_dsa(**overrides) -> dict:
    """The tiny DSA config with a YaRN rope stretched 8x from 512 tokens and 64 selected keys per query."""
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=512,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.7)
    return {**TINY_CONFIGS["deepseek_v32"], "rope_parameters": rope, "max_position_embeddings": 4096,
            "index_topk": 64, **overrides}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["nemotron_h", "deepseek_v32"])
def test_prompts_of_thousands_of_tokens_follow_the_full_forward(family):
    raw = long_dsa() if family == "deepseek_v32" else {**TINY_CONFIGS["nemotron_h"], "max_position_embeddings": 4096}
    model = build_from_config(raw)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, raw["vocab_size"], size=n).tolist() for n in (3001, 2050)]
    for prompt, tokens in zip(prompts, serve(model, prompts, chunk=384, max_seq_len=3100)):
        assert_greedy_follows_forward(model, prompt, tokens)


def test_max_seq_len_past_the_models_positions_is_an_error():
    model = build_from_config(long_dsa(max_position_embeddings=1024))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jaxmodels.LLM(None, model=model, dtype="float32", max_batch_size=1, max_seq_len=2048, warmup=False,
                      progress=False)


# Shapes the GPU kernels take (power-of-two heads, latent, rope and index dims), small enough for one GPU test.
GPU_DSA = long_dsa(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=64, index_n_heads=16, index_head_dim=64, index_topk=512, max_position_embeddings=65536,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=4096,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
GPU_NEMOTRON_H = {**TINY_CONFIGS["nemotron_h"], "vocab_size": 1024, "hidden_size": 256, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8, "mamba_head_dim": 64,
                  "ssm_state_size": 64, "n_groups": 2, "chunk_size": 128, "intermediate_size": 512,
                  "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 256,
                  "max_position_embeddings": 65536}


@pytest.mark.gpu
@pytest.mark.parametrize("raw,length", [(GPU_DSA, 32768), (GPU_NEMOTRON_H, 8192)], ids=["dsa_32k", "nemotron_h_8k"])
def test_long_prompt_on_gpu_follows_the_full_forward(raw, length):
    model = build_from_config(raw)
    # The forward's sequence (prompt + all tokens but the last) is a power of two: the contiguous index-key cache
    # of the DSA forward then takes the Pallas indexer too.
    prompt = np.random.default_rng(1).integers(3, raw["vocab_size"], size=length - NEW_TOKENS + 1).tolist()
    [tokens] = serve(model, [prompt], chunk=4096, max_seq_len=length + 64)
    assert_greedy_follows_forward(model, prompt, tokens)
