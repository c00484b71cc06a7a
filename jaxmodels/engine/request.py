"""Requests and their sampling parameters, with the validation that keeps bad input away from the device."""

import dataclasses
import enum
import logging
import math

from jaxmodels.engine.grammar import GrammarSpec, GrammarViolation

log = logging.getLogger("jaxmodels.engine")


# Top logprobs a token can come with (OpenAI's limit).
MAX_LOGPROBS = 20
# Width of a request's row of logit biases on the device: its logit_bias entries, and while min_tokens holds, one
# per stop token (EOS and stop_token_ids), which get -inf.
BIAS_ENTRIES = 128


@dataclasses.dataclass
class SamplingParams:
    """How a request's tokens are drawn. The logits go through, in this order (engine.sampler.adjust_logits):
    `logit_bias` (token id -> a number added to its logit), `min_tokens` (its stop tokens, EOS among them unless
    `ignore_eos`, cannot be drawn before that many tokens), `repetition_penalty` (a logit of a token seen in the
    prompt or the output so far is divided by it where positive, multiplied where negative),
    `frequency_penalty` and `presence_penalty` (subtracted from a token's logit, times its count in the output so
    far, and once if it is there at all), then temperature, top-k and top-p. `logprobs` k: each output token comes
    with its log probability and the k most likely tokens' under the distribution after the penalties and the
    temperature, before top-k and top-p (a greedy request's: at temperature 1). `structured_output` (a
    GrammarSpec: a JSON schema, any JSON object, a regex, a grammar or a choice of strings) keeps the output inside
    it: the tokens it does not allow next are set to -inf after the penalties (logprobs are then those of the
    tokens it allows), and the request stops ("stop") as soon as the output is complete and nothing else may
    follow (engine.grammar)."""

    max_new_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: none; k: the drawn token's and the k most likely ones'
    structured_output: GrammarSpec | None = None

    @property
    def penalized(self) -> bool:
        """Whether its logits depend on the tokens before (penalties): the device keeps counts for it."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusted(self) -> bool:
        """Whether it needs the sampler that adjusts logits and reports logprobs (engine.sampler.sample_adjusted)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.logprobs is not None
                or self.structured_output is not None)

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when nothing is)."""
        out = self._adjustment_problems()
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

    def _adjustment_problems(self) -> list[str]:
        out = []
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                out.append(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            out.append(f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            out.append(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        elif isinstance(self.max_new_tokens, int) and self.min_tokens > self.max_new_tokens:
            out.append(f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                out.append(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            else:
                if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.logit_bias):
                    out.append("logit_bias keys must be token ids (ints >= 0)")
                if any(not _finite(v) or not -100 <= v <= 100 for v in self.logit_bias.values()):
                    out.append("logit_bias values must be numbers in [-100, 100]")
                if len(self.logit_bias) > BIAS_ENTRIES:
                    out.append(f"logit_bias has {len(self.logit_bias)} entries; at most {BIAS_ENTRIES}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            out.append(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, GrammarSpec):
            out.append(f"structured_output must be a GrammarSpec, got {type(self.structured_output).__name__}")
        return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def stop_tokens(params: SamplingParams, eos_ids) -> list[int]:
    """The tokens that end a request with `params` on a model whose EOS ids are `eos_ids`."""
    return list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_ids))


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
    # With params.logprobs: per output token (its log probability, [(token id, log probability)] of the most likely).
    logprobs: list = dataclasses.field(default_factory=list)
    # With params.structured_output: its engine.grammar.GrammarMatcher, which has accepted every output token.
    grammar: object = None

    def __post_init__(self):
        self.token_ids = list(self.prompt) + list(self.output)

    @property
    def stop_tokens(self) -> list[int]:
        """The tokens that end it (those min_tokens holds back)."""
        return stop_tokens(self.params, self.eos_ids)

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
        # (Before min_tokens, the sampler never draws a stop token: it holds them at -inf.)
        if token in self.params.stop_token_ids or (token in self.eos_ids and not self.params.ignore_eos):
            return "stop"
        if self.grammar is not None:
            try:
                self.grammar.accept(token)
            except GrammarViolation as error:  # the step's mask should have made this impossible
                log.error("request %d drew a token its structured output does not allow: %s", self.request_id, error)
                return "abort"
            if self.grammar.is_finished():  # only EOS could follow: stop without drawing it
                return "stop"
        if len(self.output) >= self.params.max_new_tokens or len(self.token_ids) >= max_seq_len:
            return "length"
        return None
