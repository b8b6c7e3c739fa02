from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterInfoRequest(_message.Message):
    __slots__ = ("challenge",)
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    def __init__(self, challenge: _Optional[bytes] = ...) -> None: ...

class DrafterInfoResponse(_message.Message):
    __slots__ = ("name", "method", "model", "vocab_size", "vocab_hash", "max_k", "proof", "max_history_tokens", "feature_layers", "hidden_size", "target_layers", "target_fingerprint", "one_forward")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ONE_FORWARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    method: str
    model: str
    vocab_size: int
    vocab_hash: str
    max_k: int
    proof: bytes
    max_history_tokens: int
    feature_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    target_layers: int
    target_fingerprint: str
    one_forward: bool
    def __init__(self, name: _Optional[str] = ..., method: _Optional[str] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., max_k: _Optional[int] = ..., proof: _Optional[bytes] = ..., max_history_tokens: _Optional[int] = ..., feature_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., target_layers: _Optional[int] = ..., target_fingerprint: _Optional[str] = ..., one_forward: _Optional[bool] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ProposeEntry(_message.Message):
    __slots__ = ("seq_id", "new_tokens", "num_tokens", "k", "full_history", "num_prompt_tokens", "temperature", "seed", "features", "structured_outputs", "features_from", "cache_output")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FULL_HISTORY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FROM_FIELD_NUMBER: _ClassVar[int]
    CACHE_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    k: int
    full_history: bool
    num_prompt_tokens: int
    temperature: float
    seed: int
    features: Tensor
    structured_outputs: str
    features_from: int
    cache_output: bool
    def __init__(self, seq_id: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., k: _Optional[int] = ..., full_history: _Optional[bool] = ..., num_prompt_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., structured_outputs: _Optional[str] = ..., features_from: _Optional[int] = ..., cache_output: _Optional[bool] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("client_id", "batch_id", "entries", "release", "traceparent")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    batch_id: int
    entries: _containers.RepeatedCompositeFieldContainer[ProposeEntry]
    release: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    def __init__(self, client_id: _Optional[str] = ..., batch_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[ProposeEntry, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("seq_id", "token_ids", "q", "resync", "cached", "parents", "history_held")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_HELD_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    resync: bool
    cached: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    history_held: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., resync: _Optional[bool] = ..., cached: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ..., history_held: _Optional[int] = ...) -> None: ...

class ProposalBatch(_message.Message):
    __slots__ = ("batch_id", "proposals", "propose_ns")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_NS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    propose_ns: int
    def __init__(self, batch_id: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., propose_ns: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "seq_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
