from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "num_speculative_tokens", "drafter", "top_logprobs", "stop", "structured_outputs", "cache_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    num_speculative_tokens: int
    drafter: str
    top_logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    structured_outputs: str
    cache_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    n: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., num_speculative_tokens: _Optional[int] = ..., drafter: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., structured_outputs: _Optional[str] = ..., cache_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class SpecCounters(_message.Message):
    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos", "drafts_by_drafter")
    class DraftsByDrafterEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_BY_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    drafts_by_drafter: _containers.ScalarMap[str, int]
    def __init__(self, drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., drafts_by_drafter: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs", "finish_reason", "prompt_tokens", "completion_tokens", "spec", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec: SpecCounters
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., spec: _Optional[_Union[SpecCounters, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "model_name", "max_model_len", "vocab_size", "vocab_hash", "eos_token_ids", "speculation", "load", "exact", "dtype", "quantization")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    max_model_len: int
    vocab_size: int
    vocab_hash: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculation: bool
    load: Load
    exact: bool
    dtype: str
    quantization: str
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., speculation: _Optional[bool] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., exact: _Optional[bool] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerChunk(_message.Message):
    __slots__ = ("name", "data", "vocab_hash")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    vocab_hash: str
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., vocab_hash: _Optional[str] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("num_requests", "num_waiting", "kv_blocks_used", "kv_blocks_total")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    def __init__(self, num_requests: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("name", "address", "method", "model", "state", "healthy", "proposals", "draft_tokens", "accepted_tokens", "acceptance_rate", "propose_p50_ms", "propose_p99_ms", "timeouts", "last_error", "trusted", "violations")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_P50_MS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    method: str
    model: str
    state: str
    healthy: bool
    proposals: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    propose_p50_ms: float
    propose_p99_ms: float
    timeouts: int
    last_error: str
    trusted: bool
    violations: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., method: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., healthy: _Optional[bool] = ..., proposals: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., propose_p50_ms: _Optional[float] = ..., propose_p99_ms: _Optional[float] = ..., timeouts: _Optional[int] = ..., last_error: _Optional[str] = ..., trusted: _Optional[bool] = ..., violations: _Optional[int] = ...) -> None: ...

class RegisterDrafterRequest(_message.Message):
    __slots__ = ("name", "address", "trusted")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    trusted: bool
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., trusted: _Optional[bool] = ...) -> None: ...

class RegisterDrafterResponse(_message.Message):
    __slots__ = ("drafter",)
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    drafter: DrafterStatus
    def __init__(self, drafter: _Optional[_Union[DrafterStatus, _Mapping]] = ...) -> None: ...

class RemoveDrafterRequest(_message.Message):
    __slots__ = ("name", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain: bool
    def __init__(self, name: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class RemoveDrafterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDraftersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDraftersResponse(_message.Message):
    __slots__ = ("drafters",)
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStatus]
    def __init__(self, drafters: _Optional[_Iterable[_Union[DrafterStatus, _Mapping]]] = ...) -> None: ...
