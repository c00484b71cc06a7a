"""Prefix caching (engine.prefix_cache): the cache and the scheduler on the host, then served tokens on both
families against transformers' with prefixes shared in every way the issue lists (a system prompt, a conversation's
turns, prefixes ending mid-page and on a page edge, identical prompts, a prompt that is a prefix of another), under a
pool small enough to evict cached pages and preempt requests, with aborts and with seeded sampling.
"""

import numpy as np
import pytest

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.engine.cache import PoolSizes
from jaxmodels.engine.prefix_cache import PrefixCache
from jaxmodels.engine.request import Request
from jaxmodels.engine.scheduler import GroupedScheduler, Scheduler
from jaxmodels.step_context import StepKind
from tests.engine.test_llm import hf_greedy
from tests.hf_models import make_dsa, make_nemotron_h, save

PAGE = 4


def tokens(n, start=10):
    return list(range(start, start + n))


def test_match_finds_whole_pages_and_a_hybrid_stops_at_its_last_snapshot():
    cache = PrefixCache(PAGE, snapshot_slots=[9, 10])
    prompt = tokens(11)
    parent = None
    path = []
    for i, page in enumerate([5, 6]):  # two full pages of `prompt`
        parent, new = cache.insert(parent, tuple(prompt[i * PAGE:(i + 1) * PAGE]), page)
        assert new
        path.append(parent)
    assert cache.match(prompt, 10) == cache.match(prompt, 8)
    match = cache.match(prompt, 10)
    assert match.pages == [] and match.tokens == 0 and match.shared == 2  # no snapshot yet
    assert cache.snapshot_slot(path[0]) in (9, 10)
    match = cache.match(prompt, 10)
    assert match.pages == path[:1] and match.tokens == PAGE and match.snapshot == path[0].snapshot
    assert cache.match(prompt, 7).tokens == PAGE and cache.match(prompt, 3).tokens == 0
    assert cache.match(tokens(11, start=11), 10).shared == 0  # other tokens, other pages
    attention_only = PrefixCache(PAGE, snapshot_slots=None)
    attention_only.insert(None, tuple(prompt[:PAGE]), 3)
    assert attention_only.match(prompt, 10).tokens == PAGE and attention_only.match(prompt, 10).snapshot is None


def test_idle_pages_are_evicted_least_recently_used_leaves_first():
    cache = PrefixCache(PAGE, snapshot_slots=None)
    a, _ = cache.insert(None, (1, 1, 1, 1), page=1)  # one request computes [a, b]
    b, _ = cache.insert(a, (2, 2, 2, 2), page=2)
    cache.hold([a])  # another finds a and computes c after it
    c, _ = cache.insert(a, (3, 3, 3, 3), page=3)
    d, _ = cache.insert(None, (4, 4, 4, 4), page=4)
    cache.release([a, b])  # b idle; a still held by [a, c]
    cache.release([d])
    assert cache.idle_pages == 2 and cache.evict(1) == [2]  # b: released before d
    cache.release([a, c])  # c, then a (the parent after its child)
    assert cache.evict(10) == [4, 3, 1] and len(cache) == 0


def test_a_page_computed_twice_is_cached_once_and_holding_removes_it_from_the_idle_list():
    cache = PrefixCache(PAGE, snapshot_slots=None)
    node, new = cache.insert(None, (1, 2, 3, 4), page=7)
    again, new_again = cache.insert(None, (1, 2, 3, 4), page=8)  # another request computed the same tokens
    assert new and not new_again and again is node and node.refs == 2 and node.page == 7
    cache.release([node]), cache.release([node])
    assert cache.idle_pages == 1
    cache.hold([node])
    assert cache.idle_pages == 0 and cache.evict(1) == []


def test_snapshots_are_reused_least_recently_used_and_go_with_their_page():
    cache = PrefixCache(PAGE, snapshot_slots=[20])
    a, _ = cache.insert(None, (1,) * PAGE, page=1)
    b, _ = cache.insert(None, (2,) * PAGE, page=2)
    assert cache.snapshot_slot(a) == 20 and cache.snapshot_slot(a) is None  # one already
    assert cache.snapshot_slot(b) == 20 and a.snapshot is None  # the only slot moved to b
    cache.release([a]), cache.release([b])
    assert cache.evict(2) == [1, 2] and cache.snapshots == 0 and cache.snapshot_slot(
        cache.insert(None, (3,) * PAGE, page=3)[0]) == 20


def test_a_snapshot_superseded_on_an_unbranched_path_is_reused_first():
    cache = PrefixCache(PAGE, snapshot_slots=[1, 2, 3])
    a1, _ = cache.insert(None, (1,) * PAGE, page=1)  # conversation A's first turn
    b1, _ = cache.insert(None, (2,) * PAGE, page=2)  # conversation B's
    cache.snapshot_slot(a1), cache.snapshot_slot(b1)
    cache.hold([a1])  # A's next turn resumes from a1 (touching it: B's is now the least recently used)...
    a2, _ = cache.insert(a1, (3,) * PAGE, page=3)
    cache.snapshot_slot(a2)  # ... and saves its own after it
    cache.supersede(a2)
    c1, _ = cache.insert(None, (4,) * PAGE, page=4)
    cache.snapshot_slot(c1)
    assert a1.snapshot is None and b1.snapshot is not None  # B's next turn still finds its snapshot
    shared, _ = cache.insert(None, (5,) * PAGE, page=5)  # a system prompt's end, two prompts after it
    cache.insert(shared, (6,) * PAGE, page=6), cache.insert(shared, (7,) * PAGE, page=7)
    cache.snapshot_slot(shared)
    cache.supersede(cache.insert(shared, (8,) * PAGE, page=8)[0])
    assert list(cache._snapshots)[-1] == shared.snapshot  # parted there: not superseded


def make_scheduler(num_pages=12, recurrent=True, budget=64, snapshots=3, max_seq_len=32):
    sizes = PoolSizes.from_limits(max_batch_size=2, max_seq_len=max_seq_len, page_size=PAGE, num_pages=num_pages,
                                  num_snapshots=snapshots if recurrent else 0)
    return Scheduler(sizes, max_batch_size=2, max_prefill_tokens=budget, max_seq_len=max_seq_len, prefix_caching=True,
                     recurrent=recurrent, state_copies=2 if recurrent else 0)


def run_prompt(s, request_id, prompt, output):
    """Serve `prompt` alone on host scheduler `s` until `output` (the tokens its steps 'sample') is out; returns
    its chunks (request, start, length, restore, save)."""
    request = Request(request_id, prompt, SamplingParams(max_new_tokens=len(output)), seed=0)
    s.add(request)
    chunks, sampled = [], iter(output)
    while s.has_work():
        kind, work = s.schedule()
        if kind is StepKind.EXTEND:
            chunks += work
            s.finish_extend(work, [next(sampled) if c.start + c.length == len(request.token_ids) else -1
                                   for c in work])
        else:
            s.finish_decode(work, [next(sampled)])
    assert request.output == output and request.pages == [] and request.slot == 0
    return chunks


def test_a_hybrid_saves_snapshots_where_prompts_part_and_before_the_last_token_then_resumes_there():
    s = make_scheduler()  # snapshot slots 3, 4, 5
    system = tokens(9)  # two full pages and one token
    first = run_prompt(s, 0, system + [50, 51, 52, 53], [60, 61])
    # 13 tokens: a snapshot at the last page edge before the last token (12), so the chunk stops there.
    assert [(c.start, c.length, c.restore, c.save) for c in first] == [(0, 12, 0, 5), (12, 1, 0, 0)]
    second = run_prompt(s, 1, system + [70, 71, 72, 73, 74], [62])
    # Shares two pages (8 tokens) but no snapshot there: computed from 0, saving one at 8 where it parts, and at 12.
    assert [(c.start, c.length, c.restore, c.save) for c in second] == [(0, 8, 0, 4), (8, 4, 0, 3), (12, 2, 0, 0)]
    # Resumes where the system prompt ends. Both request slots (1, 2) keep the state of the request that ended in
    # them (its tail's), so it takes slot 1, stashing the first's state first, in the least recently used snapshot
    # slot (5: the first's own at 12, superseded by its tail).
    third = run_prompt(s, 2, system + [80], [63])
    assert [(c.start, c.length, c.restore, c.save, c.stash) for c in third] == [(8, 2, 4, 0, (1, 5))]
    # The first one's next turn resumes after its answer's first token (its tail: 14 computed tokens) from that
    # stash, taking slot 2 and stashing the second's state on the way.
    turn = run_prompt(s, 3, system + [50, 51, 52, 53, 60, 90, 91], [64])
    assert [(c.start, c.length, c.restore, c.save, c.stash) for c in turn] == [(14, 2, 5, 0, (2, 3))]
    assert s.cache.hit_tokens == 8 + 14 and s.prompt_tokens == 13 + 14 + 10 + 16


def test_a_next_turn_resumes_after_the_previous_answer_in_the_slot_that_kept_its_state():
    s = make_scheduler()
    prompt = tokens(13)
    answer = [60, 61, 62, 63, 64, 65, 66]
    run_prompt(s, 0, prompt, answer)  # 19 tokens computed: four pages cached, and a tail of 3 tokens (16-18)
    assert s.cache.idle_pages == 5 and list(s.keeping) == [1]
    turn = run_prompt(s, 1, prompt + answer + [90, 91, 92], [67])
    # It resumes at 19 in slot 1, which still holds the state there: no copy. It saves a snapshot only before its
    # last token (20); page edge 16 only extends the cached path.
    assert [(c.start, c.length, c.restore, c.save > 0, c.stash) for c in turn] == [(19, 1, 0, True, None),
                                                                                   (20, 3, 0, False, None)]
    assert s.cache.hit_tokens == 19


def test_tail_states_are_stashed_when_their_slot_is_needed_and_resumed_from_there():
    s = make_scheduler(snapshots=2)  # request slots 1, 2; snapshot slots 3, 4
    a, b = tokens(6), tokens(6, start=40)
    run_prompt(s, 0, a, [60, 61])  # its snapshot at 4 in slot 4; its tail (14, 15, 60) kept in slot 1
    run_prompt(s, 1, b, [62])  # snapshot at 4 in slot 3; tail (44, 45) in slot 2
    assert [tail.tokens for tail in s.keeping.values()] == [(14, 15, 60), (44, 45)]
    second_a = run_prompt(s, 2, a + [60, 61, 90], [63])  # in slot 1: no copy
    assert [(c.start, c.length, c.restore, c.save, c.stash) for c in second_a] == [(7, 1, 0, 3, None),
                                                                                    (8, 1, 0, 0, None)]
    # Both slots keep a state: a new prompt takes the one kept longest (b's), stashing b's state in the least
    # recently used snapshot slot (4: a's at 4, superseded by the snapshot at 8 on the same path).
    other = run_prompt(s, 3, tokens(5, start=70), [64])
    assert [(c.start, c.length, c.restore, c.save, c.stash) for c in other] == [(0, 4, 0, 3, (2, 4)),
                                                                                 (4, 1, 0, 0, None)]
    # b's next turn restores b's state from its stash, and takes slot 1, stashing the state kept there in the same
    # slot 4: every copy before a step reads the states before any is written.
    second_b = run_prompt(s, 4, b + [62, 91], [65])
    assert [(c.start, c.length, c.restore, c.save, c.stash) for c in second_b] == [(6, 2, 4, 0, (1, 4))]
    assert s.cache.hit_tokens == 7 + 6


def test_a_tail_whose_snapshot_is_reused_is_no_longer_resumed_from_and_its_page_is_evicted():
    cache = PrefixCache(PAGE, snapshot_slots=[7])
    node, _ = cache.insert(None, (1, 2, 3, 4), page=1)
    cache.snapshot_slot(node)
    tail = cache.add_tail(node, (5, 6), page=2, slot=1)
    cache.release([node])
    prompt = [1, 2, 3, 4, 5, 6, 9]
    match = cache.match(prompt, 6)
    assert (match.tokens, match.tail, match.snapshot, match.pages) == (6, tail, None, [node])
    assert cache.match(prompt, 5).tail is None and cache.match(prompt, 5).tokens == 4  # past the limit
    assert cache.stash(tail) == 7 and node.snapshot is None  # the only snapshot slot, taken from the node
    assert cache.match(prompt, 6).snapshot == 7
    other, _ = cache.insert(None, (8, 8, 8, 8), page=3)
    cache.snapshot_slot(other)  # takes slot 7 back: the tail's state is gone
    assert cache.match(prompt, 6).tokens == 0 and tail.snapshot is None
    assert len(cache) == 3 and cache.evict(1) == [2]  # the tail's page, the least recently used idle one
    zero = cache.add_tail(node, (), page=None, slot=2)  # ended on a page edge: only a state
    assert cache.match(prompt, 6).tail is zero and cache.match(prompt, 6).tokens == 4
    cache.release([other])
    assert cache.clear() == [1, 3] and zero.dropped and len(cache) == 0 and cache.snapshots == 0


def test_attention_only_models_resume_at_any_cached_page_and_chunks_are_not_cut():
    s = make_scheduler(recurrent=False)
    system = tokens(9)
    run_prompt(s, 0, system + [50, 51, 52, 53], [60])
    second = run_prompt(s, 1, system + [70], [61])
    assert [(c.start, c.length, c.restore, c.save) for c in second] == [(8, 2, 0, 0)]
    same = run_prompt(s, 2, system + [50, 51, 52, 53], [60])  # the same prompt: all but its last page's token
    assert [(c.start, c.length) for c in same] == [(12, 1)]
    # A next turn resumes after the prompt (13 computed, the answer's one token not), in the tail page it left.
    turn = run_prompt(s, 3, system + [50, 51, 52, 53, 60, 99], [62])
    assert [(c.start, c.length) for c in turn] == [(13, 2)] and s.cache.hit_tokens == 8 + 12 + 13


def test_cached_pages_count_as_free_and_are_evicted_when_the_pool_needs_them():
    s = make_scheduler(num_pages=6, recurrent=False, max_seq_len=20)  # 5 usable pages of 4 tokens
    run_prompt(s, 0, tokens(12), [1, 2, 3])  # 14 tokens computed: 3 full pages cached and a tail of 2 tokens
    assert s.cache.idle_pages == 4 and len(s.free_pages) == 1 and s._free_count() == 5
    run_prompt(s, 1, tokens(17, start=40), [4])  # needs 5 pages: takes the 4 cached ones back (the tail first)
    assert s.cache.idle_pages == 5 and len(s.free_pages) == 0  # 4 full pages and a tail of 1 token
    assert s.clear_prefix_cache() == 5 and len(s.free_pages) == 5 and len(s.cache) == 0


def test_a_new_request_joins_the_group_holding_its_prefix_while_loads_allow():
    sizes = PoolSizes.from_limits(max_batch_size=4, max_seq_len=32, page_size=PAGE)
    grouped = GroupedScheduler(sizes, 2, max_batch_size=4, max_prefill_tokens=64, max_seq_len=32,
                               prefix_caching=True)
    prompt = tokens(13)
    run_prompt(grouped.groups[1], 0, prompt, [60])  # group 1 caches the prompt's pages
    for request_id in (1, 2):
        grouped.add(Request(request_id, prompt, SamplingParams(), seed=0))
    assert [len(group.waiting) for group in grouped.groups] == [0, 2]  # both within a quarter batch (1) of group 0
    grouped.add(Request(3, prompt, SamplingParams(), seed=0))
    assert [len(group.waiting) for group in grouped.groups] == [1, 2]  # group 1 is now 2 ahead: load wins
    grouped.add(Request(4, tokens(13, start=50), SamplingParams(), seed=0))  # nothing cached: the least loaded
    assert [len(group.waiting) for group in grouped.groups] == [2, 2]


# Served tokens. Pages of 16 tokens, 8-token prefill chunks, and a pool of 9 usable pages for 4 requests of up to 96
# tokens (6 pages each): the later turns evict cached pages and preempt requests.
LIMITS = dict(dtype="float32", max_batch_size=4, max_seq_len=96, max_prefill_tokens=8, num_pages=10, progress=False,
              warmup="all")
NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0)  # stops at EOS, as transformers' generate does


@pytest.fixture(scope="module", params=["nemotron_h_moe", "deepseek_v32"])
def served(request, tmp_path_factory):
    hf_model = make_nemotron_h("moe") if request.param == "nemotron_h_moe" else make_dsa("deepseek_v32")
    path = save(hf_model, tmp_path_factory.mktemp(request.param))
    return hf_model, jaxmodels.LLM(path, **LIMITS)


def check_against_transformers(served, prompts, params=GREEDY):
    hf_model, llm = served
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt, params.max_new_tokens), f"prompt of {len(prompt)}"
    return [out.token_ids for out in outs]


def hits(llm) -> int:
    return llm.metrics()["prefix_cache_hit_tokens"]


def assert_nothing_held(llm) -> None:
    metrics = llm.metrics()
    assert (metrics["running"], metrics["waiting"], metrics["slots_used"], metrics["kv_pages_used"]) == (0, 0, 0, 0)
    assert metrics["prefix_cache_pages"] == metrics["prefix_cache_idle_pages"]
    llm.engine.clear_prefix_cache()
    metrics = llm.metrics()
    assert metrics["prefix_cache_pages"] == metrics["prefix_cache_snapshots"] == 0
    assert llm.engine.scheduler.counts()["free_pages"] == metrics["kv_pages_total"]
    (group,) = llm.engine.scheduler.groups
    assert len(group.free_pages) == metrics["kv_pages_total"]


def test_shared_system_prompt_and_identical_prompts(served):
    rng = np.random.default_rng(1)
    system = rng.integers(3, 97, size=37).tolist()  # two pages and 5 tokens
    before = hits(served[1])
    questions = [rng.integers(3, 97, size=n).tolist() for n in (5, 11, 20)]
    check_against_transformers(served, [system + q for q in questions])
    again = [system + questions[1], system + rng.integers(3, 97, size=9).tolist(), system + questions[1]]
    check_against_transformers(served, again)
    assert hits(served[1]) - before >= 3 * 32
    assert_nothing_held(served[1])


def test_conversation_turns_resume_after_the_previous_turns(served):
    rng = np.random.default_rng(2)
    conversation = rng.integers(3, 97, size=21).tolist()
    for turn in range(4):
        before = hits(served[1])
        computed = len(conversation) - 1  # the previous answer's last token was not fed back
        conversation += rng.integers(3, 97, size=5 + turn).tolist()  # the user's message
        (answer,) = check_against_transformers(served, [conversation])
        assert turn == 0 or hits(served[1]) - before >= computed  # resumed after the previous answer
        conversation += answer
    assert_nothing_held(served[1])


def test_a_conversation_whose_slot_was_taken_resumes_from_its_stashed_state(served):
    hf_model, llm = served
    llm.engine.clear_prefix_cache()  # every request slot free
    (group,) = llm.engine.scheduler.groups
    rng = np.random.default_rng(6)
    conversation = rng.integers(3, 97, size=5).tolist()
    (answer,) = check_against_transformers(served, [conversation])
    conversation += answer + [7, 8]
    # Four other prompts take the three free slots and the one that kept the conversation's state, stashing it.
    check_against_transformers(served, [rng.integers(3, 97, size=5).tolist() for _ in range(4)])
    match = group.prefix_match(Request(99, conversation, GREEDY, seed=0))
    if group.cache.recurrent:
        assert match.tail is not None and match.tail.slot is None and match.snapshot is not None
    before = hits(llm)
    check_against_transformers(served, [conversation])
    assert hits(llm) - before == match.tokens >= len(conversation) - 3  # the tail: all but the answer's last token
    assert_nothing_held(llm)


def test_prefixes_on_a_page_edge_and_prompts_that_are_prefixes_of_others(served):
    rng = np.random.default_rng(3)
    long = rng.integers(3, 97, size=49).tolist()
    prompts = [long[:32], long[:33], long, long[:20], long[:32]]  # edges at 16, 32, 48
    for prompt in prompts:
        check_against_transformers(served, [prompt])
    check_against_transformers(served, prompts)  # all at once, each finding the others' pages
    assert_nothing_held(served[1])


def test_pool_pressure_evicts_and_preempts_and_aborts_leave_nothing_held(served):
    hf_model, llm = served
    engine = llm.engine
    rng = np.random.default_rng(4)
    system = rng.integers(3, 97, size=30).tolist()
    prompts = [system + rng.integers(3, 97, size=n).tolist() for n in (12, 25, 7, 31, 18)]
    preempted = engine.scheduler.num_preemptions
    params = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    aborted = engine.add_request(system + [5, 6, 7], params)
    for _ in range(3):
        engine.step()
    engine.abort(aborted.request_id)
    while engine.has_work():
        engine.step()
    assert engine.scheduler.num_preemptions > preempted
    assert aborted.finish_reason == "abort"
    for prompt, request in zip(prompts, requests):
        expected = hf_greedy(hf_model, prompt, 14)  # stops at EOS, which these requests ignore
        assert len(request.output) == 14 and request.output[:len(expected)] == expected
    assert_nothing_held(llm)


def test_seeded_sampling_gives_the_same_tokens_from_the_cache(served):
    _, llm = served
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 97, size=40).tolist()
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11)
    (first,) = llm.generate([prompt], params)  # computed whole (its pages are new)
    before = hits(llm)
    (second,) = llm.generate([prompt], params)  # from the cache
    assert hits(llm) - before >= 32 and second.token_ids == first.token_ids
    assert_nothing_held(llm)


def test_prefix_caching_off(tmp_path):
    path = save(make_dsa("deepseek_v32"), tmp_path / "dsa")
    llm = jaxmodels.LLM(path, **{**LIMITS, "enable_prefix_caching": False, "warmup": False})
    prompt = list(range(3, 43))
    first, second = llm.generate([prompt, prompt], GREEDY)
    assert first.token_ids == second.token_ids and hits(llm) == 0 and llm.metrics()["prefix_cache_pages"] == 0
    assert llm.engine.scheduler.counts()["free_pages"] == llm.metrics()["kv_pages_total"]
