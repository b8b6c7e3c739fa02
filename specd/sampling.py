"""SamplingParams: one definition for the offline API, the gateway and the verifier.

Validation lives here so every entry point rejects the same bad values with the
same message (the message names the field and says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.structured import StructuredOutput

# Bounds for "absurd" values: large enough for any real use, small enough that a
# typo (temperature=1e9, max_tokens=10**12) is caught instead of silently accepted.
MAX_TEMPERATURE = 100.0
MAX_TOKENS_LIMIT = 1 << 24
MAX_SEED = (1 << 63) - 1
MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 32
# The wire types bound these (int32 top_k, uint32 token ids): a larger value must be a
# client error here, not an overflow where the gRPC message is built.
MAX_TOP_K = (1 << 31) - 1
MAX_TOKEN_ID = (1 << 32) - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 10.0  # (0, 10]: 1 is off; vLLM only asks > 0, a larger one flattens every logit it touches
MAX_LOGIT_BIAS = 100.0  # OpenAI's: a bias is clamped to [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 16  # choices per request (each a sequence of its own, sharing the prompt's KV)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Text that ends generation at the token completing it (that token counts, none after it);
    # the text returned stops before it.
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # None/False: no logprobs; True or 0: the logprob of each chosen token; an int n > 0: also
    # the n most likely tokens at each position with theirs (vLLM's `logprobs=n`).
    logprobs: bool | int | None = None
    # Per-request speculation override: None = the controller decides, 0 = off, k = up to k drafts.
    num_speculative_tokens: int | None = None
    # Output constrained to a JSON schema, regex, choice or grammar: a StructuredOutput, or
    # vLLM's dict of one key (json, json_object, regex, choice, grammar).
    structured_outputs: StructuredOutput | dict | None = None
    # False: the answer is not kept in the drafters' cache of finished answers (the suffix index's
    # global cache), which later requests draft from; this request still drafts from it.
    cache_output: bool = True
    # Part of the target distribution at every position (specd/engine/penalties.py says how):
    presence_penalty: float = 0.0  # OpenAI's, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, [-2, 2]
    repetition_penalty: float = 1.0  # vLLM's / transformers', over prompt and output; 1: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias, clamped to [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids blocked until this many tokens were generated
    # Choices: n sequences from one prompt, its prefill computed once; choice i > 0 with a seed draws
    # from seed + i, so a seed gives the same n choices on every run (greedy: n identical ones).
    n: int = 1

    def __post_init__(self) -> None:
        self._check_number("max_tokens", self.max_tokens, integer=True)
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        self._check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g}, got {self.temperature}")
        self._check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self._check_number("top_k", self.top_k, integer=True)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer up to {MAX_TOP_K}, got {self.top_k}")
        self._check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self._check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be between 0 and 2**63-1, got {self.seed}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers in [0, {MAX_TOKEN_ID}]), "
                             f"got {str(self.stop_token_ids)[:100]}")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {str(self.stop)[:100]}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                             "characters each")
        self.stop = [s for s in self.stop if s]
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            self._check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")

        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutput.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutput):
            raise ValueError("structured_outputs must be an object with one of json, json_object, regex, choice, "
                             "grammar")
        if self.num_speculative_tokens is not None:
            self._check_number("num_speculative_tokens", self.num_speculative_tokens, integer=True)
            if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens must be between 0 and {MAX_SPECULATIVE_TOKENS}, "
                                 f"got {self.num_speculative_tokens}")

        for name in ("presence_penalty", "frequency_penalty"):
            self._check_number(name, getattr(self, name))
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        self._check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1: off), "
                             f"got {self.repetition_penalty}")
        self.logit_bias = self._checked_bias(self.logit_bias)
        self._check_number("n", self.n, integer=True)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(f"seed must be at most 2**63-1 - (n - 1) with n choices, got {self.seed}")
        self._check_number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @classmethod
    def _checked_bias(cls, bias) -> dict[int, float]:
        """Token id -> bias, the keys as ints (JSON gives strings) and the biases clamped to [-100, 100]."""
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be an object of token id -> bias, got {str(bias)[:100]}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {str(key)[:50]!r}")
            cls._check_number(f"logit_bias[{token}]", value)
            if value in (float("inf"), float("-inf")):
                raise ValueError(f"logit_bias[{token}] must be a finite number, got {value}")
            out[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(value)))
        return out

    @staticmethod
    def _check_number(name: str, value: object, integer: bool = False) -> None:
        ok_types = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            kind = "an integer" if integer else "a number"
            raise ValueError(f"{name} must be {kind}, got {value!r}")
        if not integer and value != value:  # NaN
            raise ValueError(f"{name} must be a number, got NaN")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None and self.logprobs is not False

    @property
    def num_top_logprobs(self) -> int:
        """How many most-likely alternatives to report per emitted token (0: none)."""
        if not self.want_logprobs or isinstance(self.logprobs, bool):
            return 0
        return self.logprobs
