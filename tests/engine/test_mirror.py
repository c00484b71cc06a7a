"""The leader / follower protocol of engine.mirror between two threads of this process, over fake engines: what the
followers repeat, and how each side learns of the other's failure. (tests/sharding/multihost_check.py runs it
between the two processes of a JAX job, on real engines.)"""

import dataclasses
import itertools
import socket
import threading
import time
import types

import pytest

from jaxmodels.engine.engine import InvalidRequest
from jaxmodels.engine import mirror
from jaxmodels.engine.mirror import MirrorFailed, follow, lead

WAIT_S = 10  # for a thread to get where a test expects it; every test takes well under a second


@pytest.fixture(autouse=True)
def fresh_sessions(monkeypatch):
    """Each test's leader and follower meet in session 0 of a fresh board, whatever the tests before did."""
    monkeypatch.setattr(mirror, "_leads", itertools.count())
    monkeypatch.setattr(mirror, "_follows", itertools.count())


class Board:
    """The coordinator's key-value store, as the mirror uses it."""

    def __init__(self):
        self.values = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.changed:
            assert self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000), key
            return self.values[key]


@dataclasses.dataclass
class FakeRequest:
    request_id: int
    prompt: list


class FakeEngine:
    """Logs the calls that change its state; `step` runs `on_step(n)` for the nth step, if given."""

    def __init__(self, max_seq_len: int = 64, on_step=None):
        self.max_seq_len = max_seq_len
        self.config = "tiny"
        self.sizes = "pools"
        self.num_speculative_tokens = 0
        self.prefix_caching = True
        self.runner = types.SimpleNamespace(step=types.SimpleNamespace(dtype="float32"), dp=2, decode_sizes=[4],
                                            prefill_sizes=[8])
        self.log = []
        self.pending = 0
        self.steps = 0
        self.on_step = on_step

    def add_request(self, prompt, params):
        if not prompt:
            raise InvalidRequest("empty prompt")
        self.log.append(("add", list(prompt), params))
        self.pending += 1
        return FakeRequest(len([c for c in self.log if c[0] == "add"]) - 1, list(prompt))

    def abort(self, request_id):
        self.log.append(("abort", request_id))

    def has_work(self):
        return self.pending > 0

    def step(self):
        self.steps += 1
        self.log.append(("step",))
        if self.on_step is not None:
            self.on_step(self.steps)
        self.pending = max(self.pending - 1, 0)
        return []

    def close(self):
        self.log.append(("close",))


class Follower:
    """`follow` on a thread; `error` is what it raised."""

    def __init__(self, engine, board):
        self.engine, self.error = engine, None
        self.thread = threading.Thread(target=self._run, args=(board,), daemon=True)
        self.thread.start()

    def _run(self, board):
        try:
            follow(self.engine, process_index=1, board=board, host="127.0.0.1", timeout_s=WAIT_S)
        except BaseException as error:  # noqa: BLE001 - the test reads it
            self.error = error

    def join(self):
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        return self


def leader_and_follower(leading=None, following=None, **options):
    board = Board()
    follower = Follower(following or FakeEngine(), board)
    leader = lead(leading or FakeEngine(), num_processes=2, board=board, host="127.0.0.1", timeout_s=WAIT_S,
                  **options)
    return leader, follower


def failures():
    """An on_failure that keeps the reasons, and an event set once it is called."""
    reasons, called = [], threading.Event()

    def on_failure(reason):
        reasons.append(reason)
        called.set()

    return on_failure, reasons, called


def test_the_follower_repeats_the_leaders_calls_and_steps_until_it_stops():
    leader, follower = leader_and_follower()
    first = leader.add_request([5, 6], "greedy")
    with pytest.raises(InvalidRequest):
        leader.add_request([], "greedy")  # refused: nothing to repeat
    leader.add_request([7], "sampled")
    leader.step()
    leader.abort(first.request_id)
    leader.step()
    leader.close()
    follower.join()
    assert follower.error is None
    assert follower.engine.log == [entry for entry in leader.engine.log if entry != ("close",)]
    assert follower.engine.log.count(("step",)) == 2


def test_a_follower_still_finishing_its_last_step_at_a_close_stops_cleanly():
    """The close's stop goes out while the follower is in its last step; its "finished" then reaches a leader that
    has stopped reading. Closing over that unread message reset the connection, and the follower's send failed with
    a broken pipe (seen once in the suite); the leader now reads until the follower hangs up."""
    leader, follower = leader_and_follower(following=FakeEngine(on_step=lambda n: time.sleep(0.3)))
    for _ in range(2):
        leader.add_request([1], "greedy")
        leader.step()
    leader.close()
    follower.join()
    assert follower.error is None
    assert follower.engine.log.count(("step",)) == 2


def test_the_leader_reads_through_to_its_engine():
    leader, follower = leader_and_follower()
    assert leader.max_seq_len == 64 and leader.has_work() is False
    leader.close()
    follower.join()


def test_a_follower_that_raises_fails_the_leaders_next_step():
    def fail_second(n):
        if n == 2:
            raise ValueError("boom")

    on_failure, reasons, called = failures()
    leader, follower = leader_and_follower(following=FakeEngine(on_step=fail_second), on_failure=on_failure)
    for _ in range(2):
        leader.add_request([1], "greedy")
        leader.step()
    assert called.wait(WAIT_S)
    assert reasons == ["process 1 failed: ValueError: boom"]
    with pytest.raises(MirrorFailed, match="process 1 failed: ValueError: boom"):
        leader.step()
    assert isinstance(follower.join().error, ValueError)


def test_a_follower_that_dies_fails_the_leader():
    on_failure, reasons, called = failures()

    def die(n):
        raise SystemExit("killed")  # like a kill: the follower's connection closes

    leader, follower = leader_and_follower(following=FakeEngine(on_step=die), on_failure=on_failure)
    leader.add_request([1], "greedy")
    leader.step()
    assert called.wait(WAIT_S)
    assert reasons[0].startswith("process 1 failed: SystemExit") or "closed its connection" in reasons[0]
    follower.join()


def test_a_hung_follower_fails_the_leader_after_the_step_timeout():
    release = threading.Event()
    on_failure, reasons, called = failures()
    leader, follower = leader_and_follower(following=FakeEngine(on_step=lambda n: release.wait(WAIT_S)),
                                           on_failure=on_failure, step_timeout_s=0.2)
    leader.add_request([1], "greedy")
    leader.step()
    assert called.wait(WAIT_S)
    assert reasons == [reasons[0]] and reasons[0].startswith("process 1 has not finished step 1 in ")
    release.set()
    follower.join()


def test_a_leader_whose_engine_fails_stops_the_follower_with_the_reason():
    def fail(n):
        raise RuntimeError("device lost")

    leader, follower = leader_and_follower(leading=FakeEngine(on_step=fail))
    leader.add_request([1], "greedy")
    with pytest.raises(RuntimeError, match="device lost"):
        leader.step()
    error = follower.join().error
    assert isinstance(error, MirrorFailed)
    assert str(error) == "process 0 stopped the job: process 0's engine failed: RuntimeError: device lost"


def test_a_follower_with_other_limits_is_refused_by_name():
    board = Board()
    follower = Follower(FakeEngine(max_seq_len=128), board)
    with pytest.raises(MirrorFailed, match=r"process 1 serves another model or other limits .*max_seq_len: 128 != 64"):
        lead(FakeEngine(), num_processes=2, board=board, host="127.0.0.1", timeout_s=WAIT_S)
    assert "max_seq_len: 128 != 64" in str(follower.join().error)


def test_a_connection_without_the_secret_is_refused_and_the_follower_still_joins():
    """A stranger connects first and shows a wrong secret: the leader closes its connection and goes on waiting, and
    the follower, which reads the leader's address only once the stranger is done, joins."""
    board, knocked, refused = Board(), threading.Event(), []
    stranger = threading.Thread(target=_knock, args=(board, knocked, refused), daemon=True)
    stranger.start()
    follower = Follower(FakeEngine(), _SeenAfter(board, knocked))
    leader = lead(FakeEngine(), num_processes=2, board=board, host="127.0.0.1", timeout_s=WAIT_S)
    leader.close()
    assert follower.join().error is None
    stranger.join(WAIT_S)
    assert refused == [True]


class _SeenAfter:
    """`board` as it reads once `event` is set."""

    def __init__(self, board, event):
        self.board, self.event = board, event

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        assert self.event.wait(timeout_ms / 1000), key
        return self.board.blocking_key_value_get(key, timeout_ms)


def _knock(board, knocked, refused):
    """Connect to the leader's port once it is published, show a wrong secret, and append whether the leader closed
    the connection (the end of the stream, or a reset: it closes with the rest of what was sent unread)."""
    try:
        port = board.blocking_key_value_get("jaxmodels/mirror/0", WAIT_S * 1000).split()[0]
        with socket.create_connection(("127.0.0.1", int(port)), timeout=WAIT_S) as connection:
            connection.sendall(b"x" * 64)
            try:
                refused.append(connection.recv(1) == b"")
            except ConnectionResetError:
                refused.append(True)
    finally:
        knocked.set()


def test_missing_followers_time_out_with_their_process_ids():
    with pytest.raises(MirrorFailed, match=r"process\(es\) \[1\] did not follow process 0 within 0 s"):
        lead(FakeEngine(), num_processes=2, board=Board(), host="127.0.0.1", timeout_s=0.2)
