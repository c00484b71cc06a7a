"""The load benchmark's client: all prompts at once as streaming completions, in its own process so that the
client's parsing does not share the server's interpreter lock; prints one JSON line of timings.

    python -m jaxmodels.serve.load_client --url http://127.0.0.1:8000 --prompts prompts.json --max-tokens 128
"""

import argparse
import asyncio
import json
import sys
import time


async def one_stream(client, url: str, prompt: list[int], max_tokens: int, start: float) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    arrivals, tokens = [], 0  # arrivals: seconds since start of each chunk that carried tokens
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code}: {(await response.aread()).decode()[:300]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            new = len(chunk["choices"][0].get("token_ids", []))
            if new:
                tokens += new
                arrivals.append(time.perf_counter() - start)
    return {"tokens": tokens, "arrivals": arrivals}


async def run(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, p, max_tokens, start) for p in prompts))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "results": results}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompts", required=True, help="a JSON file: a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, required=True)
    args = parser.parse_args(argv)
    with open(args.prompts) as f:
        prompts = json.load(f)
    json.dump(asyncio.run(run(args.url, prompts, args.max_tokens)), sys.stdout)
    print()


if __name__ == "__main__":
    main()
