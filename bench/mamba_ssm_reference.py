"""The public mamba_ssm Triton kernels, timed on this GPU in a torch process of their own: the comparator of
`bench/mamba_kernels.py`'s scan and decode rows, measured in the same device call rather than quoted from issue 5.

    PYTHONPATH=.thirdparty python bench/mamba_ssm_reference.py --json OUT.json

mamba_ssm is not a dependency: `.thirdparty/` (in .gitignore; the device call must name it in `carry`) holds its
`mamba_ssm/ops/triton` (without `mamba3`) and `mamba_ssm/utils` folders from state-spaces/mamba at commit
e9594ce1c732d97440f0332fdc43170a2294dbfa (`git archive` of those paths), with empty `mamba_ssm/__init__.py` and
`mamba_ssm/ops/__init__.py` so that nothing imports its CUDA extensions, and the einops wheel unpacked beside them.
`bash bench/lab/h200_runs.sh scan_vs_mamba_ssm` runs this, then our table.

What is timed, as issue 5 measured it (bf16 inputs, fp32 final states, GPU time of CUDA-graph replays, the scan's
Triton autotuning done by a warm-up call before capture):
- `mamba_chunk_scan_combined` on one sequence of 8k and 32k tokens, and on 16 packed sequences of 512 (seq_idx,
  with the 16 final states through cu_seqlens), chunk 128, D and dt_bias, softplus on dt;
- `selective_state_update` at batch 64 and 256 on a pool of batch + 1 float32 states read through
  state_batch_indices, with dt, A, D and dt_bias tied across the head dim (stride 0), as Mamba2's decode calls it.
Shapes: Nano-9B (H=128, P=80, N=128, G=8) and Nano-30B (H=64, P=64, N=128, G=8), as in mamba_kernels.SHAPES.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {"nano9b": dict(H=128, P=80, N=128, G=8), "nano30b": dict(H=64, P=64, N=128, G=8)}
CHUNK = 128


def graph_time_us(fn, replays=20, trials=5) -> float:
    """Median GPU time of one call, from CUDA-graph replays of a graph that holds one call."""
    fn()  # warm-up: Triton compilation and autotuning happen outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # a second eager call on a side stream, as torch's graph capture recipe asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def scan_case(shape, T, S, gen):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    H, P, N, G = shape["H"], shape["P"], shape["N"], shape["G"]
    dev, bf16 = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)
    x, dt = rnd(1, T, H, P).to(bf16), (rnd(1, T, H) - 1.0).to(bf16)
    A = -torch.exp(torch.rand(H, device=dev, generator=gen) * 3.0 - 2.0)
    B, C = rnd(1, T, G, N).to(bf16), rnd(1, T, G, N).to(bf16)
    D, dt_bias = rnd(H), rnd(H)
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    if S == 1:
        kwargs.update(return_final_states=True)
    else:
        lens = torch.full((S,), T // S, dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).to(torch.int32)]).to(dev)
        seq_idx = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), lens).to(dev)[None]
        kwargs.update(seq_idx=seq_idx, cu_seqlens=cu, return_varlen_states=True)
    return lambda: mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, **kwargs)


def decode_case(shape, Bsz, gen):
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    H, P, N, G = shape["H"], shape["P"], shape["N"], shape["G"]
    dev, bf16 = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)
    state = rnd(Bsz + 1, H, P, N)
    x = rnd(Bsz, H, P).to(bf16)
    dt = (rnd(Bsz, H) - 1.0).to(bf16)[:, :, None].expand(Bsz, H, P)
    A = (-torch.exp(torch.rand(H, device=dev, generator=gen) * 3.0 - 2.0))[:, None, None].expand(H, P, N)
    B, C = rnd(Bsz, G, N).to(bf16), rnd(Bsz, G, N).to(bf16)
    D, dt_bias = rnd(H)[:, None].expand(H, P), rnd(H)[:, None].expand(H, P)
    ids = (torch.randperm(Bsz, device=dev, generator=gen) + 1).to(torch.int32)
    return lambda: selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                                          state_batch_indices=ids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--Ts", default="8192,32768")
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, shape in SHAPES.items():
        cases = [("scan", dict(T=int(T), S=1)) for T in a.Ts.split(",")]
        cases += [("scan", dict(T=8192, S=16))] if name == "nano9b" else []
        cases += [("decode", dict(B=b)) for b in (64, 256)]
        for kind, size in cases:
            fn = scan_case(shape, size["T"], size["S"], gen) if kind == "scan" else decode_case(shape, size["B"], gen)
            us = graph_time_us(fn)
            rows.append(dict(kind=kind, shape=name, **size, us=us))
            print(f"mamba_ssm {kind} {name} {size}: {us:.0f} us", flush=True)
            with open(a.json, "w") as f:  # after every row: a time limit keeps what was measured
                json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
            del fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
