"""An OpenAI-compatible HTTP server over the engine: `python -m jaxmodels serve --model DIR` (the [serve] extra).

app: routes and errors; worker: the engine thread; generation: one request's tokens -> text deltas per choice (and
for chat, reasoning / content / tool-call parts); detokenizer and stop_strings: the text; reasoning and tool_calls:
the parsers of each family's reasoning and tool-call formats; chat_template: prompts from messages and tools;
protocol and responses: OpenAI's request and response formats; security: the API key and the body size limit;
limits: the longest text prompt that can fit; metrics: /metrics; server: uvicorn in the foreground or on a thread;
benchmark and load_client: HTTP streams vs LLM.generate on the same work (bench/serve_load.py).
"""
