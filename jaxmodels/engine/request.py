"""Requests and their sampling parameters, with the validation that keeps bad input away from the device."""

import dataclasses
import enum
import math


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when nothing is)."""
        out = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            out.append(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            out.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            out.append(f"top_k must be an int >= -1 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            out.append(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            out.append(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def prompt_problems(prompt, *, vocab_size: int, max_seq_len: int) -> list[str]:
    if len(prompt) == 0:
        return ["prompt is empty"]
    if len(prompt) >= max_seq_len:
        return [f"prompt has {len(prompt)} tokens; max_seq_len={max_seq_len} leaves no room to generate "
                f"(at most {max_seq_len - 1} prompt tokens)"]
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        return [f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"]
    return []


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no slot or page (new, or preempted and waiting to be recomputed)
    PREFILLING = "prefilling"  # admitted: its caches are being filled from token_ids, chunk by chunk
    DECODING = "decoding"  # its caches hold every token: one new token per step
    FINISHED = "finished"  # finish_reason says why; holds nothing


# Identity semantics (eq=False): the scheduler keys requests by id and never compares them field by field; a
# generated __eq__ over the token lists made membership tests O(tokens) and cost half of a B=256 step.
@dataclasses.dataclass(eq=False)
class Request:
    """One request's host-side state. `token_ids` = prompt + output; the first `num_computed` of them are in the
    caches, or on their way there in a step already sent to the device (with overlapped scheduling the last
    output tokens may still be on the device, so `num_computed` can run one ahead of `len(token_ids)`).
    Preemption drops the caches and sets num_computed back to 0; the output is kept and recomputed."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset = frozenset()
    output: list[int] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    slot: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    verifying: int = 0  # speculative VERIFY steps sent whose tokens have not come back (each yields 1 to k+1)
    # With prefix caching: the cached pages it holds (engine.prefix_cache nodes, one per page from its first; a
    # node's page may be a copy it computed itself), and where its hybrid state is still to be saved.
    cached: list = dataclasses.field(default_factory=list)
    snapshot_points: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING

    def __post_init__(self):
        self.token_ids = list(self.prompt) + list(self.output)

    @property
    def decoding(self) -> bool:
        return self.status is RequestStatus.DECODING

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def may_grow(self, max_seq_len: int) -> bool:
        """Whether one more decode step of this decoding request can still yield a token within the length limits.

        Its steps sent so far (some perhaps still on the device) end with the token at position num_computed - 1,
        which samples token number num_computed of token_ids; one more step is useful while that token leaves
        room under both limits. A speculative VERIFY step in flight yields at least one token more than
        num_computed counts (`verifying`).
        """
        return self.num_computed + self.verifying + 1 < min(len(self.prompt) + self.params.max_new_tokens,
                                                            max_seq_len)

    def stop_reason(self, token: int, max_seq_len: int) -> str | None:
        if token in self.params.stop_token_ids or (token in self.eos_ids and not self.params.ignore_eos):
            return "stop"
        if len(self.output) >= self.params.max_new_tokens or len(self.token_ids) >= max_seq_len:
            return "length"
        return None
