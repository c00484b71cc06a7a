"""An OpenAI-compatible HTTP server over the engine: `python -m jaxmodels serve --model DIR` (the [serve] extra).

app: routes and errors; worker: the engine thread; generation: one request's tokens -> text deltas per choice;
detokenizer and stop_strings: the text; chat_template: prompts from messages; protocol and responses: OpenAI's
request and response formats; metrics: /metrics; server: uvicorn in the foreground or on a thread; benchmark and
load_client: HTTP streams vs LLM.generate on the same work (bench/serve_load.py).
"""
