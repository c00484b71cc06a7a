"""Multi-turn serving benchmark: conversations that share a system prompt and resend their history every turn.

    python -m jaxmodels bench --workload multiturn --config bench/configs/nemotron_h_nano9b.json

`--conversations` conversations of `--turns` turns run at once, each a closed loop: turn t's prompt is the system
prompt (`--system` tokens, the same for all), then for every earlier turn its user message (`--user` random
tokens) and the answer the engine gave (`--answer` tokens, greedy), then turn t's user message; turn t+1 is sent the
moment turn t's answer is complete. The same workload (same tokens) runs on the same random weights with prefix
caching on, then off, in one process: output tok/s, time to first token (from a turn's submission) p50 / p99, and
the hit rate (prompt tokens found in the prefix cache / prompt tokens admitted).
"""

import argparse
import json
import time

import numpy as np

from jaxmodels.benchmark import cut_layers, percentile_ms, random_model, table
from jaxmodels.engine.buckets import decode_buckets, prefill_buckets


def run_conversations(llm, system: list[int], users: list[list[list[int]]], answer_len: int, progress: bool) -> dict:
    """Serve every conversation's turns (users[c][t]: conversation c's message at turn t) to the end."""
    from tqdm.auto import tqdm

    from jaxmodels import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_new_tokens=answer_len, temperature=0.0, ignore_eos=True)
    turns = len(users[0])
    history = [list(system) for _ in users]
    done_turns = [0] * len(users)
    live: dict[int, list] = {}  # request id -> [conversation, submitted at, first token at]
    ttft = []

    def submit(conversation: int) -> None:
        history[conversation] += users[conversation][done_turns[conversation]]
        request = engine.add_request(history[conversation], params)
        live[request.request_id] = [conversation, time.perf_counter(), None]

    before = llm.metrics()
    start = time.perf_counter()
    for conversation in range(len(users)):
        submit(conversation)
    with tqdm(total=len(users) * turns * answer_len, desc="multi-turn", unit="tok", disable=not progress) as bar:
        while engine.has_work():
            updated = engine.step()
            now = time.perf_counter()
            bar.update(len(updated))
            for request in updated:
                entry = live[request.request_id]
                if entry[2] is None:
                    entry[2] = now
                    ttft.append(now - entry[1])
                if request.finished:
                    conversation = entry[0]
                    del live[request.request_id]
                    history[conversation] += request.output
                    done_turns[conversation] += 1
                    if done_turns[conversation] < turns:
                        submit(conversation)
    elapsed = time.perf_counter() - start
    after = llm.metrics()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    return dict(requests=len(users) * turns, seconds=elapsed, out_tok_s=len(users) * turns * answer_len / elapsed,
                ttft_p50_ms=percentile_ms(ttft, 50), ttft_p99_ms=percentile_ms(ttft, 99),
                hit_rate=hit / prompt if prompt else 0.0, prompt_tokens=prompt, hit_tokens=hit,
                preemptions=after["preemptions"] - before["preemptions"],
                final_prompt_tokens=max(map(len, history)) - answer_len)


def main(argv=None, prog: str | None = None) -> None:
    import gc

    import jaxmodels

    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["multiturn"], default="multiturn")
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=2000, help="tokens of the shared system prompt")
    parser.add_argument("--user", type=int, default=200, help="tokens of each user message")
    parser.add_argument("--answer", type=int, default=128, help="tokens of each answer")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per extend step")
    parser.add_argument("--modes", default="on,off", help="prefix caching on, off, or both (in this order)")
    parser.add_argument("--per-octave", type=int, default=1,
                        help="buckets per doubling of batch size and prefill tokens (each run compiles all first)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        raw = cut_layers(json.load(f), args.layers)
    rng = np.random.default_rng(0)
    vocab = raw["vocab_size"]
    system = rng.integers(3, vocab, size=args.system).tolist()
    users = [[rng.integers(3, vocab, size=args.user).tolist() for _ in range(args.turns)]
             for _ in range(args.conversations)]
    longest = args.system + args.turns * (args.user + args.answer)
    model = random_model(raw, args.dtype)
    results = dict(config=args.config, layers=args.layers or "all", dtype=args.dtype, conversations=args.conversations,
                   turns=args.turns, system=args.system, user=args.user, answer=args.answer, runs=[])
    for mode in args.modes.split(","):
        llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, max_batch_size=args.conversations,
                            max_seq_len=longest + 1, warmup="all", enable_prefix_caching=mode == "on",
                            decode_sizes=decode_buckets(args.conversations, args.per_octave),
                            prefill_sizes=prefill_buckets(args.prefill_chunk, args.per_octave),
                            progress=not args.no_progress)
        run = run_conversations(llm, system, users, args.answer, not args.no_progress)
        results["runs"].append(dict(prefix_caching=mode, **run))
        llm.engine.close()
        del llm
        gc.collect()
    print(f"\n### multi-turn: {args.conversations} conversations x {args.turns} turns, a {args.system}-token system "
          f"prompt, {args.user} user tokens and {args.answer} answer tokens a turn (prompts up to "
          f"{results['runs'][0]['final_prompt_tokens']} tokens)")
    print(table(results["runs"], [("prefix caching", "prefix_caching", "s"), ("requests", "requests", "d"),
                                  ("seconds", "seconds", ".1f"), ("output tok/s", "out_tok_s", ",.0f"),
                                  ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
                                  ("hit rate", "hit_rate", ".1%"), ("preemptions", "preemptions", "d")]))
    runs = {run["prefix_caching"]: run for run in results["runs"]}
    if {"on", "off"} <= set(runs):
        on, off = runs["on"], runs["off"]
        results["ttft_p50_ratio"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        results["tok_s_ratio"] = on["out_tok_s"] / off["out_tok_s"]
        print(f"headline: prefix caching: TTFT p50 {results['ttft_p50_ratio']:.1f}x lower, output tok/s "
              f"{results['tok_s_ratio']:.2f}x, hit rate {on['hit_rate']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
