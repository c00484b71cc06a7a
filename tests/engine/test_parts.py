"""Engine parts on their own: buckets, allocators and scheduler (host only), sampler, Mamba recompute semantics,
the launch thread's default."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodels.engine.buckets import bucket_for, decode_buckets, prefill_buckets
from jaxmodels.engine.cache import FreeList, PoolSizes
from jaxmodels.engine.request import Request, SamplingParams
from jaxmodels.engine.runner import uses_launch_thread
from jaxmodels.engine.sampler import sample
from jaxmodels.engine.scheduler import Scheduler


def test_buckets():
    # Two sizes per doubling: powers of two and 1.5 times them, capped at (and always including) the limit.
    assert decode_buckets(40) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40]
    assert decode_buckets(6) == [1, 2, 3, 4, 6]
    assert decode_buckets(1) == [1]
    assert decode_buckets(256, per_octave=1) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_buckets(16, per_octave=4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert prefill_buckets(64) == [16, 24, 32, 48, 64]
    assert prefill_buckets(300)[-3:] == [192, 256, 300]
    assert prefill_buckets(8) == [8]
    assert bucket_for([4, 8, 16], 5) == 8 and bucket_for([4, 8, 16], 16) == 16
    with pytest.raises(ValueError):
        bucket_for([4, 8], 9)


def test_free_list_never_hands_out_the_null_id():
    free = FreeList(4, "page")
    assert sorted(free.take(3)) == [1, 2, 3] and len(free) == 0
    with pytest.raises(RuntimeError):
        free.take()
    with pytest.raises(RuntimeError):
        free.give_back([0])


def make_scheduler(num_pages=9, page_size=4, max_batch_size=2, budget=6, max_seq_len=32):
    sizes = PoolSizes.from_limits(max_batch_size=max_batch_size, max_seq_len=max_seq_len, page_size=page_size,
                                  num_pages=num_pages)
    return Scheduler(sizes, max_batch_size=max_batch_size, max_prefill_tokens=budget, max_seq_len=max_seq_len)


def request(i, n, max_new_tokens=4):
    return Request(i, list(range(3, 3 + n)), SamplingParams(max_new_tokens=max_new_tokens), seed=i)


def test_chunked_prefill_respects_the_token_budget_and_batch_limit():
    s = make_scheduler()
    a, b, c = request(0, 10), request(1, 3), request(2, 2)
    for r in (a, b, c):
        s.add(r)
    kind, chunks = s.schedule()
    assert kind == "extend" and [(r.request_id, st, n) for r, st, n, *_ in chunks] == [(0, 0, 6)]
    s.finish_extend(chunks, [0])
    kind, chunks = s.schedule()  # a's rest (4) then 2 of b's 3 tokens; c waits for a slot
    assert [(r.request_id, st, n) for r, st, n, *_ in chunks] == [(0, 6, 4), (1, 0, 2)]
    s.finish_extend(chunks, [7, 0])
    assert a.output == [7] and a.decoding and b.output == [] and a.num_computed == 10
    assert len(a.pages) == 3 and a.slot != 0 and b.slot not in (0, a.slot)


def test_decode_preempts_the_newest_request_when_pages_run_out():
    s = make_scheduler(num_pages=5, budget=8, max_seq_len=16)  # 4 usable pages of 4 tokens
    a, b = request(0, 8, max_new_tokens=8), request(1, 7, max_new_tokens=8)
    s.add(a), s.add(b)
    kind, chunks = s.schedule()
    assert [n for _, _, n, *_ in chunks] == [8]  # b would need pages a took; budget is 8 anyway
    s.finish_extend(chunks, [5])
    kind, chunks = s.schedule()
    s.finish_extend(chunks, [6])
    assert a.decoding and b.decoding and len(s.free_pages) == 0
    kind, batch = s.schedule()  # a needs a 3rd page at position 8: b (newest) is preempted
    assert kind == "decode" and batch == [a] and s.num_preemptions == 1
    assert b.slot == 0 and b.pages == [] and b.num_computed == 0 and b.output == [6] and s.waiting[0] is b


def test_finished_requests_give_everything_back():
    s = make_scheduler()
    r = request(0, 3, max_new_tokens=2)
    s.add(r)
    kind, chunks = s.schedule()
    s.finish_extend(chunks, [9])
    kind, batch = s.schedule()
    s.finish_decode(batch, [10])
    assert r.finish_reason == "length" and r.output == [9, 10]
    assert not s.has_work() and len(s.free_pages) == 8 and len(s.free_slots) == 2


def test_stop_conditions():
    r = Request(0, [5], SamplingParams(max_new_tokens=5, stop_token_ids=(7,)), seed=0, eos_ids=frozenset({2}))
    assert r.stop_reason(7, 100) == "stop" and r.stop_reason(2, 100) == "stop" and r.stop_reason(3, 100) is None
    r.params.ignore_eos = True
    assert r.stop_reason(2, 100) is None
    r.token_ids = [1] * 100
    assert r.stop_reason(3, 100) == "length"


def test_sampler():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    ones, zeros = jnp.ones(4), jnp.zeros(4, jnp.int32)
    seeds = jnp.asarray([1, 2, 3, 4], jnp.uint32)
    greedy = jnp.argmax(logits, -1)
    run = jax.jit(sample)
    assert (run(logits, jnp.zeros(4), zeros, ones, seeds, zeros) == greedy).all()
    assert (run(logits, ones, zeros + 1, ones, seeds, zeros) == greedy).all()  # top-k 1
    assert (run(logits, ones, zeros, ones * 1e-6, seeds, zeros) == greedy).all()  # tiny top-p
    a = run(logits, ones, zeros, ones, seeds, zeros)
    assert (a == run(logits, ones, zeros, ones, seeds, zeros)).all()  # same seed and step, same token
    draws = np.stack([np.asarray(run(logits, ones * 2, zeros, ones, seeds, zeros + i)) for i in range(20)])
    assert len(np.unique(draws)) > 4  # steps draw different tokens
    top3 = np.asarray(jax.lax.top_k(logits, 3)[1])
    k3 = np.stack([np.asarray(run(logits, ones * 5, zeros + 3, ones, seeds, zeros + i)) for i in range(20)])
    assert all(k3[i, row] in top3[row] for i in range(20) for row in range(4))


@pytest.mark.usefixtures("float32_matmuls")
def test_recompute_reproduces_decoded_mamba_state():
    """Preemption recompute: prompt + decoded tokens through forward_packed with the dt floor on prompt tokens only
    gives the state that prefill + token-by-token forward_decode left (and flooring all of them would not)."""
    from jaxmodels.layers.mamba2 import Mamba2Mixer

    mixer = Mamba2Mixer(hidden_size=16, num_heads=4, head_dim=4, state_size=8, n_groups=2, conv_kernel=4,
                        chunk_size=4, dt_limit=(0.05, math.inf), eps=1e-5, rngs=nnx.Rngs(0))
    mixer.dt_bias[...] = jnp.asarray([-6.0, -4.0, -1.0, 0.5])  # softplus well below the floor on two heads
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(9, 16)), jnp.float32)
    prompt_len = 5
    _, conv, ssm = mixer.forward_packed(hidden[:prompt_len], jnp.asarray([0, prompt_len], jnp.int32))
    conv = jnp.concatenate([jnp.zeros_like(conv), conv])  # slot 0 is the null slot
    ssm = jnp.concatenate([jnp.zeros_like(ssm), ssm])
    slot = jnp.asarray([1], jnp.int32)
    for t in range(prompt_len, 9):
        _, conv, ssm = mixer.forward_decode(hidden[t:t + 1], conv, ssm, slot)
    cu = jnp.asarray([0, 9], jnp.int32)
    in_prompt = jnp.arange(9) < prompt_len
    _, conv_re, ssm_re = mixer.forward_packed(hidden, cu, dt_limit_mask=in_prompt)
    np.testing.assert_allclose(ssm_re[0], ssm[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(conv_re[0], conv[1], rtol=1e-6, atol=1e-6)
    _, _, ssm_all_floored = mixer.forward_packed(hidden, cu)
    low = np.asarray(ssm[1, :2])  # the heads whose dt sits below the floor hold small states: compare relatively
    assert np.abs(np.asarray(ssm_all_floored[0, :2]) - low).max() > 0.1 * np.abs(low).max()


def test_launch_thread_is_on_by_default_in_one_process_only(monkeypatch):
    """A multi-process job reads every step through a collective, which a second launching thread could order
    differently on different processes: there the default is off; an explicit choice is kept either way."""
    assert uses_launch_thread(None) and not uses_launch_thread(False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not uses_launch_thread(None) and uses_launch_thread(True)
