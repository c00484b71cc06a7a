"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, tokenize / detokenize, health and
Prometheus metrics.

Requests are validated on the event loop (long texts tokenized on a thread beside it), then handed to the engine
thread (`EngineWorker`); their tokens come back as text deltas (`Generation`), streamed as server-sent events or
collected into one response. Chat output is read by the checkpoint's reasoning and tool-call parsers (chosen once the
model is loaded, from its model_type and chat template, or named by the command line) into `reasoning_content`,
`content` and `tool_calls`. Penalties, logit_bias, min_tokens and logprobs go to the engine's adjusting sampler; its
logprobs come back with the tokens and are answered in OpenAI's shapes (responses.py). Every failure is answered
with OpenAI's error JSON, and the server keeps serving. Before a request reaches the routes, `security.RequestGuard`
checks its API key and the size of its body.
"""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxmodels.engine.engine import InvalidRequest
from jaxmodels.engine.grammar import GrammarSpec
from jaxmodels.serve.chat_template import ChatTemplate, ChatTemplateError
from jaxmodels.serve.generation import AUTO, Generation, OutputParsers, Rejection
from jaxmodels.serve.limits import max_prompt_chars
from jaxmodels.serve.metrics import ServerStats, prometheus_text
from jaxmodels.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, validation_error)
from jaxmodels.serve.responses import ChatResponses, CompletionResponses, TokenStrings, sse, usage
from jaxmodels.serve.security import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from jaxmodels.serve.tool_grammar import after_reasoning, tool_call_grammar
from jaxmodels.serve.worker import EngineWorker


log = logging.getLogger("jaxmodels.serve")

# Texts longer than this are tokenized on a thread: `encode` holds the GIL throughout (a second or more per megabyte),
# which would stall the event loop and the engine thread; `encode_batch` lets go of it. Shorter ones take a few
# milliseconds, not worth a hop to a thread.
TOKENIZE_INLINE_CHARS = 4096


class _ClientGone(Exception):
    """The client closed the connection before its (non-streamed) response was ready."""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    text: str  # as the template rendered it: its end tells the reasoning parser where the output starts
    tokens: list[int]


class _Server:
    """What the routes share: the engine thread, the tokenizer and template, the output parsers, the limits and the
    counters. Until the model is attached (`attach`, once loaded) the routes that need it answer 503 with a
    "loading" reason."""

    def __init__(self, *, model_name: str, chat_template: ChatTemplate | None, max_queued_requests: int,
                 reasoning_parser: str = AUTO, tool_call_parser: str = AUTO):
        OutputParsers.check_names(reasoning_parser, tool_call_parser)  # a bad name fails before the model loads
        self.model_name = model_name
        self.chat_template = chat_template
        self.max_queued_requests = max_queued_requests
        self.parser_names = dict(reasoning=reasoning_parser, tool_calls=tool_call_parser)
        self.parsers = OutputParsers()  # chosen once the model is known (`attach`)
        self.stats = ServerStats()
        self.started = int(time.time())
        self.loading_since = time.monotonic()
        self.load_failure: str | None = None
        self.llm = None
        self.tokenizer = None
        self.token_strings: TokenStrings | None = None  # names the tokens of logprobs
        self.speculative = False  # a speculative engine serves no penalties, logit_bias, min_tokens or logprobs
        self.max_seq_len = None
        self.max_prompt_chars = None  # longer texts cannot fit in max_seq_len tokens (None: no such bound)
        self.capacity = 0
        self.worker: EngineWorker | None = None  # started with the model (it needs the running event loop)

    def attach(self, llm, prompt_chars: int | None) -> None:
        """Serve `llm` from now on (on the event loop: the engine thread needs it); `prompt_chars` is
        `prompt_char_bound(llm)`."""
        self.tokenizer = llm.tokenizer
        self.token_strings = TokenStrings(llm.tokenizer) if llm.tokenizer is not None else None
        self.speculative = llm.engine.num_speculative_tokens > 0
        self.max_seq_len = llm.engine.max_seq_len
        self.max_prompt_chars = prompt_chars
        template = self.chat_template.source if self.chat_template is not None else None
        self.parsers = OutputParsers.choose(getattr(llm.engine.config, "model_type", None), template,
                                            **self.parser_names)
        log.info("chat output: %s", self.parsers.describe())
        # The engine holds max_batch_size requests at once; the server queues at most max_queued_requests more.
        self.capacity = llm.metrics()["slots_total"] + self.max_queued_requests
        self.worker = EngineWorker(llm.engine, asyncio.get_running_loop())
        self.worker.start()
        self.llm = llm

    def require_engine(self) -> EngineWorker:
        """The engine thread, or APIError 503 while the model loads (or after loading or the engine failed)."""
        if self.load_failure is not None:
            raise APIError(503, f"the model failed to load: {self.load_failure}", code="load_failed")
        if self.worker is None:
            raise APIError(503, f"loading: the model is still loading ({time.monotonic() - self.loading_since:.0f} s "
                                "so far: weights, then the first step programs); retry later", code="loading")
        if self.worker.failure is not None:
            raise APIError(503, self.worker.failure)
        return self.worker

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """The token ids of completion prompts (texts or ids already), with the tokenizer's special tokens, as
        LLM.generate encodes them. A text that cannot fit in max_seq_len is refused before any is tokenized."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json: send the prompt as token ids", param="prompt")
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.check_prompt_length(prompt, "prompt", f"prompt {index}: " if len(prompts) > 1 else "")
        encoded = iter(await self.tokenize(texts))
        return [next(encoded) if isinstance(p, str) else p for p in prompts]

    def check_prompt_length(self, text: str, param: str, where: str = "") -> None:
        """APIError 400 for a text too long for max_seq_len tokens whatever they turn out to be, which counting its
        characters tells at once (see limits.py); shorter ones are counted in tokens by the engine."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise APIError(400, f"{where}the prompt has {len(text)} characters: more than fit in max_seq_len="
                                f"{self.max_seq_len} tokens (its {self.max_seq_len - 1} prompt tokens stand for at "
                                f"most {self.max_prompt_chars} characters with this model's tokenizer)",
                           param=param)

    async def tokenize(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        if sum(map(len, texts)) <= TOKENIZE_INLINE_CHARS:
            return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]
        encodings = await asyncio.to_thread(self.tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    async def chat_prompt(self, body) -> ChatPrompt:
        """A chat request's `messages` (and `tools`) rendered through the chat template, and their token ids
        (APIError 400 without a template, or when the template refuses them)."""
        if self.chat_template is None or self.tokenizer is None:
            raise APIError(400, "this model has no chat template (neither chat_template in tokenizer_config.json "
                                "nor chat_template.jinja, or no tokenizer.json): use /v1/completions",
                           param="messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = self.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=body.tool_definitions, **(body.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from e
        self.check_prompt_length(text, "messages")
        (tokens,) = await self.tokenize([text], add_special_tokens=False)  # the template wrote them
        return ChatPrompt(text, tokens)

    def check_tool_calls_readable(self, body) -> None:
        """APIError 400 for a request whose output should be read for tool calls when no parser knows how."""
        if body.reads_tool_calls and self.parsers.tool_calls is None:
            raise APIError(400, "this server reads no tool calls from this model's output (no known tool-call "
                                "format for its checkpoint; start the server with --tool-call-parser NAME): send "
                                "tool_choice \"none\" to only show the tools to the model", param="tool_choice")

    def chat_output(self, body, prompt: ChatPrompt):
        """What makes each choice's ChatOutput (its parsers, fresh per choice)."""
        return functools.partial(self.parsers.chat_output, prompt.text, tools=body.tool_definitions,
                                 read_tool_calls=body.reads_tool_calls, parallel_tool_calls=body.parallel_tool_calls)

    def chat_responses(self, body) -> ChatResponses:
        parsed = self.parsers.reasoning is not None or (body.reads_tool_calls and self.parsers.tool_calls is not None)
        return ChatResponses(self.model_name, return_token_ids=body.return_token_ids, parsed=parsed,
                             reasoning=self.parsers.reasoning is not None, token_strings=self.token_strings)

    def check_adjustments(self, body) -> None:
        """APIError 400 naming a field that adjusts the logits or asks for logprobs, where this server cannot serve
        it: logprobs without a tokenizer to name the tokens, any of them with a speculative engine (whose refusal
        would name them all at once)."""
        if body.top_logprobs_k is not None and self.token_strings is None:
            raise APIError(400, "logprobs need the model's tokenizer.json to name the tokens", param="logprobs")
        if self.speculative and body.adjustments:
            raise APIError(400, f"{body.adjustments[0]} is not supported with speculative decoding (the server runs "
                                f"with num_speculative_tokens > 0); neither are penalties, logit_bias, min_tokens "
                                f"and logprobs", param=body.adjustments[0])

    async def structured_output(self, body, prompt: ChatPrompt | None = None) -> GrammarSpec | None:
        """The grammar a request's output is constrained to (response_format, structured_outputs, or a forced tool
        call in the model's format; after the reasoning where the chat prompt leaves a think block open), compiled
        off the event loop so that the engine finds it in its cache; APIError 400 naming the field when it cannot
        be served."""
        asked = body.structured_output
        forced = getattr(body, "forced_tools", None)
        if asked is None and not forced:
            return None
        field = "tool_choice" if forced else asked[1]
        if self.speculative:
            raise APIError(400, f"{field}: structured output is not supported with speculative decoding (the server "
                                f"runs with num_speculative_tokens > 0)", param=field)
        reasoning = self.parsers.reasoning
        reasoning_end = (reasoning.END_TAG if reasoning is not None and prompt is not None
                         and reasoning(prompt.text).think_open else None)
        engine = self.llm.engine

        def build_and_compile():
            compiler = engine.grammar_compiler  # built on first use (about a second for a 128k vocabulary)
            if forced:
                spec = tool_call_grammar(self.parsers.tool_calls.name, forced,
                                         parallel=body.parallel_tool_calls is not False, tokenizer=self.tokenizer,
                                         json_options=compiler.json_options, reasoning_end=reasoning_end)
            else:
                spec = asked[0] if reasoning_end is None else after_reasoning(
                    asked[0], reasoning_end, tokenizer=self.tokenizer, json_options=compiler.json_options)
            compiler.compile(spec)
            return spec

        try:
            return await asyncio.to_thread(build_and_compile)
        except (ValueError, InvalidRequest) as error:
            raise APIError(400, f"{field}: {error}", param=field) from None

    def check_stops(self, stops: list[str]) -> list[str]:
        if stops and self.tokenizer is None:
            raise APIError(400, "stop strings need the model's tokenizer.json; use stop_token_ids", param="stop")
        return stops

    def max_new_tokens(self, max_tokens: int | None, prompt: list[int]) -> int:
        # At least 1, so that a prompt that is too long is reported as such (not as a bad max_tokens).
        room = max(self.max_seq_len - len(prompt), 1)
        return room if max_tokens is None else max_tokens

    async def start(self, work, stops: list[str], chat_output=None) -> Generation:
        """Queue the work in the engine (APIError 400 or 503 when it cannot be); `chat_output` as Generation
        takes it."""
        self.require_engine()
        if len(work) > self.capacity:
            raise APIError(400, f"{len(work)} choices exceed the {self.capacity} requests this server holds at "
                                f"once", param="n")
        if self.stats.pending + len(work) > self.capacity:
            raise APIError(503, f"the server is full ({self.stats.pending} requests in flight, at most "
                                f"{self.capacity}); retry later", code="queue_full")
        generation = Generation(self.worker, self.stats, work, tokenizer=self.tokenizer, stops=stops,
                                chat_output=chat_output)
        await generation.submit()
        return generation

    async def metrics(self) -> dict:
        worker = self.require_engine()
        return await asyncio.wrap_future(worker.call(worker.snapshot))


def prompt_char_bound(llm) -> int | None:
    """The most characters a text prompt that fits can have (see limits.py). It reads the whole vocabulary, up to a
    second for the largest: computed before serving, on the loading thread where there is one."""
    if llm.tokenizer is None:
        return None
    try:
        return max_prompt_chars(llm.tokenizer, llm.engine.max_seq_len)
    except Exception:  # noqa: BLE001 - a tokenizer.json of a shape we did not foresee: serve, without the bound
        log.exception("no character bound for prompts: reading the tokenizer's configuration failed")
        return None


def build_app(llm=None, *, model_name: str, chat_template: ChatTemplate | None = None,
              max_queued_requests: int = 1024, load=None, on_load_failure=None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, reasoning_parser: str = AUTO,
              tool_call_parser: str = AUTO, on_shutdown=None) -> FastAPI:
    """The app serving `llm` (whose engine it takes over: from its start on, only its engine thread may touch the
    engine), or the LLM that `load()` returns: the app then answers at once, /health and the model routes with 503
    and a "loading" reason, and serves once `load` has returned (it runs on a thread of its own when the app
    starts; if it raises, `on_load_failure(message)` is called). `model_name` is the id clients send as `model`.
    With `api_key`, every route but /health and /metrics answers 401 without `Authorization: Bearer <api_key>`;
    a body over `max_request_bytes` is answered 413 unread (see security.py). `reasoning_parser` and
    `tool_call_parser` name the parsers of chat output: "auto" (the checkpoint's formats, if known), "none", or a
    format (generation.OutputParsers); an unknown name is a ValueError listing the valid ones. `on_shutdown()` is
    called last when the app shuts down, after the engine has stopped."""
    if (llm is None) == (load is None):
        raise ValueError("give exactly one of llm and load")
    server = _Server(model_name=model_name, chat_template=chat_template, max_queued_requests=max_queued_requests,
                     reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)

    def load_in_background(loop) -> None:
        try:
            loaded = load()
        except Exception as error:  # noqa: BLE001 - reported by /health and to on_load_failure
            log.exception("loading the model failed")
            server.load_failure = f"{type(error).__name__}: {error}"
            if on_load_failure is not None:
                on_load_failure(server.load_failure)
            return
        loop.call_soon_threadsafe(server.attach, loaded, prompt_char_bound(loaded))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if llm is not None:
            server.attach(llm, prompt_char_bound(llm))
        else:
            threading.Thread(target=load_in_background, args=(asyncio.get_running_loop(),), name="jaxmodels-load",
                             daemon=True).start()
        yield
        if server.worker is not None:
            await asyncio.to_thread(server.worker.stop)
        if server.llm is not None:
            server.llm.close()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="jaxmodels", lifespan=lifespan)
    app.state.server = server

    def count_refusal(status: int) -> None:
        server.stats.rejected[status] += 1

    RequestGuard.check_options(api_key, max_request_bytes)
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes, on_refusal=count_refusal)

    def error_response(error: APIError) -> JSONResponse:
        server.stats.rejected[error.status] += 1
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, error: RequestValidationError):
        return error_response(validation_error(error))

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(_ClientGone)
    async def client_gone(request, error):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed the request"

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return error_response(APIError(500, f"internal error: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health():
        """200 once the engine serves (the other buckets may still compile: their count is in the body), 503 with
        the reason before (loading) or after (the engine failed)."""
        server.require_engine()
        compiling = server.llm.engine.warmup.status()["buckets_compiling"]
        return {"status": "ok", "buckets_compiling": compiling}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        server.check_model(model)
        return model_card()

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.started, "owned_by": "jaxmodels",
                "max_model_len": server.max_seq_len}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(await server.metrics(), server.stats),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        server.require_engine()  # its tokenizer and limits come with the model
        server.check_adjustments(body)
        prompts = await server.encode_prompts(body.prompt)
        stops = server.check_stops(body.stop_strings)
        grammar = await server.structured_output(body)
        work = [(prompt, params) for prompt in prompts
                for params in body.sampling_params(server.max_new_tokens(body.max_tokens, prompt), grammar)]
        try:
            generation = await server.start(work, stops)
        except Rejection as e:
            if len(prompts) > 1 and e.choice is not None:  # say which prompt
                e.message = f"prompt {e.choice // body.n}: {e.message}"
            raise
        responses = CompletionResponses(server.model_name, return_token_ids=body.return_token_ids,
                                        token_strings=server.token_strings, top_logprobs=body.logprobs)
        if body.stream:
            return GenerationStream(generation, responses, include_usage_chunk=body.include_usage_chunk)
        choices = await collect(request, generation)
        return responses.body(choices, prompts, body.n, usage(generation.prompt_tokens, generation.completion_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        server.require_engine()
        server.check_adjustments(body)
        server.check_tool_calls_readable(body)
        prompt = await server.chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        tokens = prompt.tokens
        grammar = await server.structured_output(body, prompt)
        work = [(tokens, params) for params in body.sampling_params(server.max_new_tokens(max_tokens, tokens), grammar)]
        generation = await server.start(work, server.check_stops(body.stop_strings),
                                        chat_output=server.chat_output(body, prompt))
        responses = server.chat_responses(body)
        if body.stream:
            return GenerationStream(generation, responses, include_usage_chunk=body.include_usage_chunk)
        choices = await collect(request, generation)
        return responses.body(choices, tokens, usage(generation.prompt_tokens, generation.completion_tokens))

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The token ids a completions `prompt` or a chat's `messages` become (vLLM's /tokenize). Their count may
        pass max_seq_len, but a text too long to fit by its characters alone is refused as the generation routes
        refuse it, without tokenizing it."""
        server.check_model(body.model)
        server.require_engine()
        if body.messages is not None:
            tokens = (await server.chat_prompt(body)).tokens
        else:
            (tokens,) = await server.encode_prompts([body.prompt])
        answer = {"count": len(tokens), "max_model_len": server.max_seq_len, "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = [server.tokenizer.id_to_token(t) for t in tokens]
        return answer

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids, special tokens included (vLLM's /detokenize)."""
        server.check_model(body.model)
        server.require_engine()
        if server.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json", param="tokens")
        vocab = server.llm.engine.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": server.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app


class GenerationStream(StreamingResponse):
    """Server-sent events in OpenAI's chunk format, closed by `data: [DONE]`. The usage goes on the chunk that
    finishes the last choice, or, with stream_options.include_usage, on a closing chunk without choices (as OpenAI
    sends it). An error after the stream started arrives as an error event. However the response ends (done, client
    gone before or while streaming), the generation is closed: unfinished requests are aborted."""

    def __init__(self, generation: Generation, responses, *, include_usage_chunk: bool):
        super().__init__(self._events(generation, responses, include_usage_chunk), media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()

    @staticmethod
    async def _events(generation: Generation, responses, include_usage_chunk: bool):
        if isinstance(responses, ChatResponses):
            for index in range(len(generation.choices)):
                yield sse(responses.role_chunk(index))
        try:
            async for delta in generation.deltas():
                final = generation.done and not include_usage_chunk
                totals = usage(generation.prompt_tokens, generation.completion_tokens) if final else None
                for chunk in responses.chunks(delta, totals):
                    yield sse(chunk)
            if include_usage_chunk:
                yield sse(responses.usage_chunk(usage(generation.prompt_tokens, generation.completion_tokens)))
        except APIError as e:
            yield sse(e.body())
        yield sse("[DONE]")


async def collect(request: Request, generation: Generation) -> list:
    """The generation's choices, whole; if the client disconnects first, the generation is closed (its requests
    aborted) and nobody is answered."""
    try:
        return await unless_disconnected(request, generation.collect())
    finally:
        generation.close()


async def unless_disconnected(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it (its generation then aborts its requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise _ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next message the server sends the app is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
