"""The public serving API: `LLM(path, ...)`, `llm.generate(prompts, SamplingParams(...))`, and a streaming variant."""

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from jaxmodels.compilation_cache import use_compilation_cache
from jaxmodels.engine.engine import Engine, InvalidRequest
from jaxmodels.engine.mirror import follow, lead
from jaxmodels.engine.request import SamplingParams
from jaxmodels.hub import resolve_model_path
from jaxmodels.loading import load_model
from sharding import make_mesh

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


@dataclasses.dataclass
class RequestOutput:
    index: int  # position of the prompt in the list given to generate
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the checkpoint has no tokenizer
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while streaming an unfinished request
    error: str | None = None
    # With SamplingParams(logprobs=k): per token, (its log probability, [(token id, log probability)] of the k
    # most likely), under the distribution SamplingParams describes.
    logprobs: list | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def load_tokenizer(path):
    """The checkpoint's tokenizer through `tokenizers`, or None when the directory has none."""
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.exists(file):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


def _tokenizer(tokenizer):
    """LLM's `tokenizer` argument -> a tokenizers.Tokenizer."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if os.path.isdir(tokenizer):
        found = load_tokenizer(tokenizer)
        if found is None:
            raise FileNotFoundError(f"no tokenizer.json in {tokenizer}")
        return found
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.fspath(tokenizer))


class LLM:
    def __init__(self, path, dtype="bfloat16", max_batch_size: int = 64, max_seq_len: int | None = None, dp: int = 1,
                 tp: int = 1, *, max_prefill_tokens: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, warmup: bool | str = True, progress: bool = True, model=None,
                 prefill_sizes: list[int] | None = None, decode_sizes: list[int] | None = None,
                 memory_fraction: float | None = None, matmul_precision: str | None = None, overlap: bool = True,
                 mamba_ssm_cache_dtype: str | None = None, num_speculative_tokens: int = 0,
                 quantization: str | None = None, compilation_cache_dir: str | None = None,
                 launch_thread: bool | None = None, enable_prefix_caching: bool = True,
                 mamba_cache_slots: int | None = None, tokenizer=None):
        """Load `path` (an HF checkpoint directory, or `model=` an already built model) and start the engine.

        `dtype` is the weights' and activations' dtype and the compute precision (float32 means full float32
        matmuls on the GPU too; `matmul_precision` overrides, see jaxmodels.precision). `overlap` schedules each
        step while the previous one runs on the device (same outputs); `launch_thread` also launches each step
        from a thread of its own (same outputs; None: on in a single-process job, see engine.runner).
        `mamba_ssm_cache_dtype` overrides the config's SSM state dtype ("bfloat16" halves the state traffic of
        Nemotron-H decode; float32 by default).
        `num_speculative_tokens` k (0: off) drafts k tokens per step with the checkpoint's multi-token-prediction
        layers and verifies them in one target step; outputs are those of plain decoding (see
        jaxmodels.engine.speculative), `metrics()` reports the accept rate.
        An FP8 checkpoint is served in FP8 (its quantized weights stay FP8 on the devices, `dtype` is that of the
        activations and the other params); `quantization="dequantize"` converts them to `dtype` on load instead.
        `max_seq_len` bounds prompt plus output of one request: by default 4096 or the model's
        max_position_embeddings if smaller, at most the latter.
        The compiled step programs are kept on disk (`compilation_cache_dir`, else $JAXMODELS_COMPILATION_CACHE_DIR,
        else JAX's own cache directory, else ~/.cache/jaxmodels/xla; "off" turns it off), so a later start with the
        same model and limits loads them instead of compiling (jaxmodels.compilation_cache).
        `warmup`: by default the constructor compiles the largest prefill and decode buckets and returns, ready to
        serve (smaller batches pad up to them), and the other buckets compile in the background, each used as soon
        as it is ready (`metrics()` reports `ready_s` and `buckets_compiling`; `wait_until_compiled()` waits for
        them); "all" compiles them all first, False compiles each on first use (jaxmodels.engine.warmup).
        `enable_prefix_caching` (on by default) keeps computed pages after their requests, so a request that starts
        with tokens computed before (a shared system prompt, the earlier turns of a conversation) computes only
        what follows them; a hybrid model also keeps recurrent-state snapshots (`mamba_cache_slots` per dp group,
        default 1.25 x max_batch_size / dp). `metrics()` reports `prompt_tokens` and `prefix_cache_hit_tokens`
        (jaxmodels.engine.prefix_cache).
        `tokenizer`: a tokenizer.json file (or a directory holding one, or a `tokenizers.Tokenizer`) to use instead
        of the checkpoint's (with `model=`, the only way to give one); text prompts, and structured output's
        grammars, go through it.
        The other options are the engine's (see jaxmodels.engine.engine.Engine). `self.model` is the model served,
        None when dp * tp > 1 (its params then live sharded in the engine only).
        """
        started = time.perf_counter()
        # dp x tp devices: each of the dp groups serves its own requests from its own cache pools (max_batch_size
        # / dp each), attention heads and KV pages split over the group's tp devices; MLP / MoE weights split over
        # all devices, their layers exchanging tokens between groups (see sharding.rules, engine.runner).
        use_compilation_cache(compilation_cache_dir)
        mesh = make_mesh(dp, tp) if dp * tp > 1 else None
        path = resolve_model_path(path) if path is not None else None  # a Hub id -> its snapshot directory
        # MTP layers are loaded only to draft with: otherwise they would only take memory (a DeepSeek one is an MoE
        # layer).
        model = model if model is not None else load_model(path, jnp.dtype(dtype), progress=progress,
                                                           matmul_precision=matmul_precision,
                                                           load_mtp=num_speculative_tokens > 0,
                                                           quantization=quantization)
        self.tokenizer = _tokenizer(tokenizer) if tokenizer is not None else \
            load_tokenizer(path) if path is not None else None
        self.engine = Engine(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                             max_prefill_tokens=max_prefill_tokens, page_size=page_size, num_pages=num_pages,
                             warmup=warmup, progress=progress, started=started, prefill_sizes=prefill_sizes,
                             decode_sizes=decode_sizes, mesh=mesh, memory_fraction=memory_fraction,
                             matmul_precision=matmul_precision, overlap=overlap,
                             mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                             num_speculative_tokens=num_speculative_tokens, launch_thread=launch_thread,
                             enable_prefix_caching=enable_prefix_caching, mamba_cache_slots=mamba_cache_slots,
                             tokenizer=self.tokenizer)
        # Over a mesh the engine holds the only copy of the weights, sharded: keeping the loaded model here would
        # keep a whole unsharded copy alive beside it.
        self.model = model if mesh is None else None

    def lead(self, *, on_failure=None) -> None:
        """Make this process (process 0 of a multi-process job) the one that takes requests: the other processes
        run `follow()` and repeat this engine's calls and steps, so only this one calls `generate` (or serves).
        Waits until they all follow; `close()` stops them. `on_failure(reason)` is called when a process fails
        (engine.mirror); the next step raises MirrorFailed."""
        self.engine = lead(self.engine, num_processes=jax.process_count(), on_failure=on_failure)

    def follow(self) -> None:
        """Repeat process 0's engine calls and steps (it runs `lead()`) until it stops; MirrorFailed when it fails.
        The other processes of a job run this instead of `generate`."""
        follow(self.engine, process_index=jax.process_index())

    def metrics(self) -> dict:
        """The engine's counters (steps, tokens, host and wall time per step) and its pools' use now."""
        return self.engine.metrics()

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until the buckets compiling in the background are all ready (True) or `timeout` seconds passed
        (False). Serving does not need it: a batch pads up to a ready bucket meanwhile."""
        return self.engine.wait_until_compiled(timeout)

    def close(self) -> None:
        """Stop the background compilation (the programs compiling now finish). The engine still serves, with the
        buckets it has; a leading one (`lead()`) stops its followers and serves no more."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("a text prompt needs a tokenizer.json in the checkpoint directory; "
                                     "pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        return list(prompt)

    def _output(self, index, request, prompt, error=None) -> RequestOutput:
        if error is not None:
            return RequestOutput(index, prompt, [], None, "error", error)
        tokens = list(request.output)
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        logprobs = list(request.logprobs) if request.params.logprobs is not None else None
        return RequestOutput(index, list(request.prompt), tokens, text, request.finish_reason, logprobs=logprobs)

    def generate_stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Yield a RequestOutput (all tokens so far) each time a request gets a token or is rejected; the last one
        yielded for each request has its finish_reason set."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        index_of = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids = self._encode(prompt)
                index_of[self.engine.add_request(ids, p).request_id] = i
            except InvalidRequest as e:
                yield self._output(i, None, prompt if not isinstance(prompt, str) else [], f"prompt {i}: {e}")
        while self.engine.has_work():
            for request in self.engine.step():
                if request.request_id in index_of:
                    yield self._output(index_of[request.request_id], request, None)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Serve all prompts to completion; outputs in prompt order (bad prompts get finish_reason "error")."""
        final = {}
        for out in self.generate_stream(prompts, params):
            if out.finished:
                final[out.index] = out
        return [final[i] for i in sorted(final)]
