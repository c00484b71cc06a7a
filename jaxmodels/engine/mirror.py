"""One engine over the processes of a multi-process JAX job: process 0 decides, the others repeat.

Every process of the job must launch the same step programs in the same order, each feeding its own devices' rows
(engine.runner). The engine's schedule is a function of the calls made to it between steps (add_request, abort,
clear_prefix_cache, compile_remaining): nothing in it depends on time, on threads (with several processes, warm-up
compiles every bucket before serving, or each process compiles each program at the same step, and the launch thread
is off) or on chance (seeds come from a generator seeded the same everywhere). So process 0, the leader, records the
calls that change its engine's state, and before each step sends the calls made since the step before to the other
processes, the followers, which make the same calls and step too. Only the leader takes requests and reads the
tokens out; a follower's engine computes the same tokens and drops them.

Transport: a TCP connection from each follower to the leader, whose port and a secret the followers read from the
JAX coordinator's key-value store. Measured between two processes on the 2-core CPU machine: sending a step took
the leader 11 us (57 us with a new request of 1000 prompt tokens), a follower 31 us from one step to the next
(receiving, repeating the calls, acknowledging), where writing a key of the store took 0.56 ms and a round trip
through it 1.5 ms; a 9B model's decode step is 4 ms on an H200.

Failures end the job instead of hanging it. A follower that raises tells the leader why before it exits; one that
dies closes its connection; one whose steps stop finishing (it hangs) is noticed after `step_timeout_s`. Each is a
MirrorFailed on the leader's next step, with the process and the reason, and `on_failure` is called at once (the
leader may be waiting on the device for that follower: `serve` then stops the job). A leader whose engine raises
sends the reason to the followers, which raise MirrorFailed; a leader that dies closes their connections. (JAX's
coordination service also ends every process of a job one of whose processes stopped sending heartbeats.)
"""

import collections
import itertools
import logging
import os
import pickle
import secrets
import selectors
import socket
import struct
import threading
import time

from jaxmodels.engine.engine import InvalidRequest

log = logging.getLogger("jaxmodels.engine")

ADDRESS_KEY = "jaxmodels/mirror/{session}"  # in the coordinator's key-value store: "port secret"
PORT_ENV = "JAXMODELS_LEADER_PORT"  # the leader's port (default: any free one), e.g. for a firewall rule
CONNECT_TIMEOUT_S = 600  # for every process to reach the rendezvous: they load and compile the model meanwhile
STEP_TIMEOUT_S = 300  # a follower's step may take this long before the leader calls it hung
CLOSE_TIMEOUT_S = 10  # at a stop, for a follower to finish its last step and hang up
_HEADER = struct.Struct("<Q")
# The nth `lead` of process 0 meets the nth `follow` of each other process (a session of its own in the store).
_leads, _follows = itertools.count(), itertools.count()


class MirrorFailed(RuntimeError):
    """A process of the job failed, or they disagree: the engines can no longer step together."""


def engine_fingerprint(engine) -> dict:
    """What must be the same on every process for their step programs to be the same: the model and the limits."""
    runner = engine.runner
    return dict(config=repr(engine.config), dtype=str(runner.step.dtype), max_seq_len=engine.max_seq_len,
                pools=repr(engine.sizes), dp=runner.dp, decode_sizes=list(runner.decode_sizes),
                prefill_sizes=list(runner.prefill_sizes), speculative=engine.num_speculative_tokens,
                prefix_caching=engine.prefix_caching)


class LeadingEngine:
    """The leader's engine: the Engine's serving interface, whose state-changing calls the followers repeat.
    Anything else (config, metrics, warm-up status, the grammar compiler) is read from the engine itself."""

    def __init__(self, engine, followers: dict[int, socket.socket], *, step_timeout_s: float = STEP_TIMEOUT_S,
                 on_failure=None):
        self.engine = engine
        self.failure: str | None = None
        self._followers = followers  # process index -> its connection
        self._on_failure = on_failure
        self._step_timeout_s = step_timeout_s
        self._calls: list[tuple] = []  # since the last step
        self._steps = 0
        self._sent_at: collections.deque = collections.deque()  # (step, time sent) not yet finished everywhere
        self._finished = dict.fromkeys(followers, 0)  # the last step each follower finished
        self._closing = threading.Event()
        self._failing = threading.Lock()  # the engine thread and the watcher may both find a failure
        self._watcher = threading.Thread(target=self._watch, name="jaxmodels-followers", daemon=True)
        if followers:
            self._watcher.start()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, params):
        try:
            request = self.engine.add_request(prompt, params)
        except InvalidRequest:
            raise  # a refused request changed nothing: not repeated
        except Exception as error:  # the engine's state is unknown now
            self._fail(_failed_here(error))
            raise
        self._calls.append(("add_request", request.request_id, request.prompt, params))
        return request

    def abort(self, request_id: int) -> None:
        self.engine.abort(request_id)
        self._calls.append(("abort", request_id))

    def clear_prefix_cache(self) -> int:
        freed = self.engine.clear_prefix_cache()
        self._calls.append(("clear_prefix_cache",))
        return freed

    def compile_remaining(self) -> None:
        self.engine.compile_remaining()  # the buckets a step may pick change with it
        self._calls.append(("compile_remaining",))

    def step(self):
        if self._closing.is_set():
            raise MirrorFailed(self.failure or "process 0 stopped its followers (close())")
        self._steps += 1
        message = _frame(("step", self._steps, self._calls))
        self._calls = []
        self._sent_at.append((self._steps, time.monotonic()))
        for index, connection in self._followers.items():
            try:
                connection.sendall(message)
            except OSError as error:
                self._fail(f"process {index} is gone: sending it step {self._steps} failed ({error})")
                raise MirrorFailed(self.failure) from error
        try:
            return self.engine.step()
        except Exception as error:
            if self.failure is not None:  # a follower's failure is the cause: the device waited for it
                raise MirrorFailed(self.failure) from error
            self._fail(_failed_here(error))
            raise

    def close(self) -> None:
        """Stop the followers (their `follow` returns) and the engine's background compilation."""
        self._stop(None)
        self.engine.close()

    def _fail(self, reason: str) -> None:
        """The job cannot step any more: tell the followers and the owner (once)."""
        with self._failing:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("the job's engines cannot step together: %s", reason)
        self._stop(reason)
        if self._on_failure is not None:
            self._on_failure(reason)

    def _stop(self, reason: str | None) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        message = _frame(("stop", reason))
        for connection in self._followers.values():
            try:
                connection.sendall(message)
            except OSError:
                pass  # gone already
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join()
        for connection in self._followers.values():
            if reason is None:  # a normal stop: let each follower finish
                _hang_up(connection)
            else:  # a failed job: the owner hears of it now, not after a hung follower's timeout
                connection.close()

    def _watch(self) -> None:
        """Read what the followers send (a finished step, or why they failed) and call a follower hung once it has
        not finished a step for step_timeout_s."""
        readers = {index: _FrameReader(connection) for index, connection in self._followers.items()}
        with selectors.DefaultSelector() as selector:
            for index, connection in self._followers.items():
                selector.register(connection, selectors.EVENT_READ, index)
            while not self._closing.is_set():
                for key, _ in selector.select(timeout=0.5):
                    if self._closing.is_set():  # a failure closed the connections
                        break
                    index = key.data
                    try:
                        messages = readers[index].read()
                    except OSError:
                        messages = None
                    if messages is None:
                        selector.unregister(key.fileobj)
                        if not self._closing.is_set():
                            self._fail(f"process {index} closed its connection to process 0 (it exited or was "
                                       "killed; see its log)")
                        continue
                    for message in messages:
                        if message[0] == "failed":
                            self._fail(f"process {index} failed: {message[1]}")
                        else:  # ("finished", step)
                            self._finished[index] = message[1]
                if not self._closing.is_set():
                    self._check_progress()

    def _check_progress(self) -> None:
        while self._sent_at and self._sent_at[0][0] <= min(self._finished.values()):
            self._sent_at.popleft()
        if not self._sent_at:
            return
        first_step, now = self._sent_at[0][0], time.monotonic()
        for index, finished in self._finished.items():
            position = finished + 1 - first_step  # of its oldest unfinished step; past the end: none
            if position >= len(self._sent_at):
                continue
            late = now - self._sent_at[position][1]
            if late > self._step_timeout_s:
                self._fail(f"process {index} has not finished step {finished + 1} in {late:.0f} s (it hangs, or "
                           f"its steps take longer than {self._step_timeout_s:.0f} s)")
                return


def _hang_up(connection: socket.socket) -> None:
    """Close a follower's connection once it has hung up too. A follower may still be sending its last "finished"
    when the stop goes out: closing with that unread would reset the connection (TCP answers unread data with a
    reset), and the follower's send would fail with a broken pipe. So stop writing, read until the follower
    closes (it does on "stop") or CLOSE_TIMEOUT_S pass, then close."""
    try:
        connection.shutdown(socket.SHUT_WR)
        connection.settimeout(CLOSE_TIMEOUT_S)
        while connection.recv(1 << 16):
            pass
    except OSError:
        pass  # gone already, or silent past the timeout
    connection.close()


def _failed_here(error: Exception) -> str:
    return f"process 0's engine failed: {type(error).__name__}: {error}"


def lead(engine, *, num_processes: int, board=None, host: str = "", timeout_s: float = CONNECT_TIMEOUT_S,
         step_timeout_s: float = STEP_TIMEOUT_S, on_failure=None) -> LeadingEngine:
    """Process 0's engine for a job of `num_processes`: waits (up to timeout_s) until every other process follows
    (runs `follow` on an engine of the same model and limits). `board`: the coordinator's key-value store (default:
    this job's); `on_failure(reason)`: called once when the job can no longer step, from whichever thread found out."""
    session = next(_leads)
    followers = {}
    if num_processes > 1:
        board = board if board is not None else _coordinator_board()
        followers = _accept_followers(engine, session, num_processes, board, host, timeout_s)
    return LeadingEngine(engine, followers, step_timeout_s=step_timeout_s, on_failure=on_failure)


def _accept_followers(engine, session, num_processes, board, host, timeout_s) -> dict[int, socket.socket]:
    secret = secrets.token_hex(16)
    expected = engine_fingerprint(engine)
    followers = {}
    with socket.create_server((host, int(os.environ.get(PORT_ENV, 0)))) as server:
        board.key_value_set(ADDRESS_KEY.format(session=session), f"{server.getsockname()[1]} {secret}")
        deadline = time.monotonic() + timeout_s
        try:
            while len(followers) < num_processes - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    connection, peer = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, num_processes)) - set(followers))
                    raise MirrorFailed(f"process(es) {missing} did not follow process 0 within {timeout_s:.0f} s: "
                                       "each must run the same command with the same options") from None
                hello = _hello(connection, secret)
                if hello is None:
                    log.warning("refused a connection from %s: not a process of this job", peer)
                    connection.close()
                    continue
                index, fingerprint = hello
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection.settimeout(None)
                followers[index] = connection
                if fingerprint != expected:
                    differ = sorted(k for k in expected if fingerprint.get(k) != expected[k])
                    raise MirrorFailed(f"process {index} serves another model or other limits than process 0 "
                                       f"({', '.join(f'{k}: {fingerprint.get(k)} != {expected[k]}' for k in differ)}): "
                                       "every process must run with the same checkpoint and options")
        except MirrorFailed as error:
            for connection in followers.values():
                _send_quietly(connection, ("stop", str(error)))
                connection.close()
            raise
    return followers


def _hello(connection: socket.socket, secret: str):
    """A follower's first message: the secret, then (its process index, its engine's fingerprint); None from a
    connection that does not know the secret (nothing it sends is unpickled)."""
    connection.settimeout(10)
    try:
        shown = b""
        while len(shown) < len(secret) and (chunk := connection.recv(len(secret) - len(shown))):
            shown += chunk
        if not secrets.compare_digest(shown, secret.encode()):
            return None
        return _FrameReader(connection).read_one()
    except OSError:
        return None


def follow(engine, *, process_index: int, board=None, host: str | None = None,
           timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Repeat process 0's engine calls and steps on this process's `engine` until process 0 stops (returns) or fails
    (MirrorFailed). `host`: where process 0 runs (default: the coordinator's host)."""
    session = next(_follows)
    board = board if board is not None else _coordinator_board()
    host = host if host is not None else _coordinator_host()
    try:
        address = board.blocking_key_value_get(ADDRESS_KEY.format(session=session), int(timeout_s * 1000))
    except Exception as error:  # noqa: BLE001 - the store's own error types differ between jax versions
        raise MirrorFailed(f"process 0 did not lead within {timeout_s:.0f} s ({type(error).__name__}: {error})") \
            from None
    port, secret = address.split()
    try:
        connection = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as error:
        raise MirrorFailed(f"cannot reach process 0 at {host}:{port} ({error}): the coordinator's host must be "
                           f"process 0's, and its port reachable from this host (${PORT_ENV} fixes it)") from None
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(None)
        connection.sendall(secret.encode() + _frame((process_index, engine_fingerprint(engine))))
        try:
            _repeat(engine, connection)
        except BaseException as error:  # process 0 may be gone already (then nobody reads this)
            _send_quietly(connection, ("failed", f"{type(error).__name__}: {error}"))
            raise


def _repeat(engine, connection: socket.socket) -> None:
    reader = _FrameReader(connection)
    while True:
        message = reader.read_one()
        if message is None:
            raise MirrorFailed("process 0 closed the connection (it exited or was killed; see its log)")
        if message[0] == "stop":
            if message[1] is not None:
                raise MirrorFailed(f"process 0 stopped the job: {message[1]}")
            return
        _, step, calls = message
        for call in calls:
            _replay(engine, call)
        if not engine.has_work():
            raise MirrorFailed(f"this process's engine has nothing to run at step {step}, where process 0's has: "
                               "their states differ")
        engine.step()
        connection.sendall(_frame(("finished", step)))


def _replay(engine, call: tuple) -> None:
    name, *args = call
    if name == "add_request":
        request_id, prompt, params = args
        got = engine.add_request(prompt, params).request_id
        if got != request_id:
            raise MirrorFailed(f"this process's engine numbered a request {got} where process 0's numbered it "
                               f"{request_id}: their states differ")
    elif name == "abort":
        engine.abort(*args)
    else:
        getattr(engine, name)(*args)


def _frame(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _send_quietly(connection: socket.socket, message) -> None:
    try:
        connection.sendall(_frame(message))
    except OSError:
        pass


class _FrameReader:
    """Length-prefixed pickles from a socket (of a process that showed the job's secret)."""

    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.buffer = bytearray()

    def read(self) -> list | None:
        """The messages complete after one recv (None at the end of the stream)."""
        chunk = self.connection.recv(1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        messages = []
        while (message := self._take()) is not None:
            messages.append(message)
        return messages

    def read_one(self):
        """The next message, waiting for it (None at the end of the stream)."""
        while (message := self._take()) is None:
            chunk = self.connection.recv(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        return message

    def _take(self):
        if len(self.buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self.buffer)
        if len(self.buffer) < _HEADER.size + size:
            return None
        body = bytes(self.buffer[_HEADER.size:_HEADER.size + size])
        del self.buffer[:_HEADER.size + size]
        return pickle.loads(body)


def _coordinator_board():
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise MirrorFailed("not a multi-process JAX job: call sharding.initialize_distributed() first")
    return global_state.client


def _coordinator_host() -> str:
    """Process 0's host: the coordinator runs there."""
    from jax._src.distributed import global_state

    host = global_state.coordinator_address.rsplit(":", 1)[0]
    return host.strip("[]")
