"""What the server checks before a request reaches its routes, for a server that may face a network: the API key
(`--api-key`, or $JAXMODELS_API_KEY) and the size of the body (`--max-request-bytes`).

With an API key, every route answers 401 without `Authorization: Bearer <key>`, except /health and /metrics. Those
two stay open, as in vLLM: load balancers, Kubernetes probes and Prometheus scrapers poll them without
credentials, and neither exposes prompts or outputs, nor makes the model generate. (Everything else is closed by
default, so a route added later is closed too.) Block /metrics in the network or a proxy if the load counts must
stay private.

Only the standard library here: the command line imports this module for its defaults, also where the [serve]
extra is not installed.
"""

import dataclasses
import hashlib
import hmac
import ipaddress
import json

OPEN_PATHS = frozenset({"/health", "/metrics"})
# A body over this is refused before anything parses it. 16 MiB holds, as JSON, a prompt of a million token ids
# (at most 8 bytes each with the ", " after it) or of a million tokens of text written with \uXXXX escapes (about 2
# characters per token, 6 bytes each): longer than the contexts the engine serves, or a batch of long prompts.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
BEARER_CHALLENGE = ((b"www-authenticate", b"Bearer"),)  # RFC 6750: the scheme a 401 asks for


class RequestGuard:
    """ASGI middleware: 401 for a missing or wrong API key, 413 for a body over `max_request_bytes` (declared by
    Content-Length, or counted while it arrives in chunks), each with OpenAI's error JSON; `on_refusal(status)` is
    called for each (the server counts them). The body is read here, whole, and handed on to the app: the routes
    read it whole anyway, and this way no route can see more than the limit.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which runs the app in a task of its own and gets in the
    way of streamed responses and of noticing a client that left."""

    def __init__(self, app, *, api_key: str | None, max_request_bytes: int, on_refusal=None):
        self.check_options(api_key, max_request_bytes)
        self.app = app
        # Digests of the same length whatever the key's: comparing them takes the same time for any wrong key, so
        # it tells nothing of the key, not even its length.
        self.key_digest = None if api_key is None else _digest(api_key.encode())
        self.max_request_bytes = max_request_bytes
        self.on_refusal = on_refusal

    @staticmethod
    def check_options(api_key: str | None, max_request_bytes: int) -> None:
        """ValueError for options that cannot be meant (Starlette builds its middleware on the first request only:
        call this where the app is built, to fail there)."""
        if api_key == "":
            raise ValueError("the API key is empty; give none to serve without one")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan; no websocket routes exist
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        refusal = self.unauthorized(scope["path"], headers) or self.declared_too_large(headers)
        if refusal is not None:
            return await self.refuse(send, refusal)
        chunks, size = [], 0
        while True:  # ASGI hands the body over in chunks, whether or not it came with a Content-Length
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                # The rest is left unread: the server discards it, and the client then reads this answer.
                return await self.refuse(send, Refusal(413, f"the request body is over the {self.max_request_bytes} "
                                                            "bytes this server accepts (--max-request-bytes)",
                                                       "request_too_large"))
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def unauthorized(self, path: str, headers: dict[bytes, bytes]) -> "Refusal | None":
        if self.key_digest is None or path in OPEN_PATHS:
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return Refusal(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                           "invalid_api_key", BEARER_CHALLENGE)
        if not hmac.compare_digest(_digest(token), self.key_digest):
            return Refusal(401, "the API key is not valid", "invalid_api_key", BEARER_CHALLENGE)
        return None

    def declared_too_large(self, headers: dict[bytes, bytes]) -> "Refusal | None":
        declared = headers.get(b"content-length", b"")
        # uvicorn refuses a malformed Content-Length itself; what is not a number here is left to the counting.
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return Refusal(413, f"the request body has {int(declared)} bytes, over the {self.max_request_bytes} "
                                "this server accepts (--max-request-bytes)", "request_too_large")
        return None

    async def refuse(self, send, refusal: "Refusal") -> None:
        if self.on_refusal is not None:
            self.on_refusal(refusal.status)
        body = json.dumps(refusal.body()).encode()
        await send({"type": "http.response.start", "status": refusal.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), *refusal.headers]})
        await send({"type": "http.response.body", "body": body})


@dataclasses.dataclass
class Refusal:
    status: int
    message: str
    code: str
    headers: tuple = ()

    def body(self) -> dict:
        # The shape of protocol.APIError's body (not imported: see the module's docstring).
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": None,
                          "code": self.code}}


def faces_network(host: str) -> bool:
    """Whether listening on `host` accepts connections from other machines (anything but a loopback address)."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it resolves to an outside address
        return True


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _headers(scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (ASGI servers lower-case them); the first of repeated ones."""
    headers = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.lower(), value)
    return headers


def _replay(body: bytes, receive):
    """A `receive` that gives the app the body already read, then passes on what the server sends next (the
    disconnect that the routes wait for)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
