from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[Compression]
    FLOAT16: _ClassVar[Compression]
    BFLOAT16: _ClassVar[Compression]
    INT8: _ClassVar[Compression]
NONE: Compression
FLOAT16: Compression
BFLOAT16: Compression
INT8: Compression

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data", "compression", "in_payload", "offset")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    IN_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    compression: Compression
    in_payload: bool
    offset: int
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ..., in_payload: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("model", "start", "end", "adapter")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    model: str
    start: int
    end: int
    adapter: str
    def __init__(self, model: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("span", "hidden_states", "attention_mask", "position_ids", "output_compression", "backward_id", "router_stats", "payload")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_STATS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    span: Span
    hidden_states: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    output_compression: Compression
    backward_id: str
    router_stats: bool
    payload: bytes
    def __init__(self, span: _Optional[_Union[Span, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[Tensor, _Mapping]] = ..., output_compression: _Optional[_Union[Compression, str]] = ..., backward_id: _Optional[str] = ..., router_stats: _Optional[bool] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("hidden_states", "router", "payload")
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    hidden_states: Tensor
    router: RouterStats
    payload: bytes
    def __init__(self, hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., router: _Optional[_Union[RouterStats, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("counts", "probs", "rows")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[float]
    probs: _containers.RepeatedScalarFieldContainer[float]
    rows: float
    def __init__(self, counts: _Optional[_Iterable[float]] = ..., probs: _Optional[_Iterable[float]] = ..., rows: _Optional[float] = ...) -> None: ...

class BackwardRequest(_message.Message):
    __slots__ = ("span", "hidden_states", "attention_mask", "position_ids", "grad_outputs", "output_compression", "backward_id", "run_id", "epoch", "micro_batch", "router_grad", "payload")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    ROUTER_GRAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    span: Span
    hidden_states: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    grad_outputs: Tensor
    output_compression: Compression
    backward_id: str
    run_id: str
    epoch: int
    micro_batch: MicroBatch
    router_grad: _containers.RepeatedScalarFieldContainer[float]
    payload: bytes
    def __init__(self, span: _Optional[_Union[Span, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[Tensor, _Mapping]] = ..., grad_outputs: _Optional[_Union[Tensor, _Mapping]] = ..., output_compression: _Optional[_Union[Compression, str]] = ..., backward_id: _Optional[str] = ..., run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., micro_batch: _Optional[_Union[MicroBatch, _Mapping]] = ..., router_grad: _Optional[_Iterable[float]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("trainer", "index", "samples")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    index: int
    samples: int
    def __init__(self, trainer: _Optional[str] = ..., index: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("peer_id", "held")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    held: _containers.RepeatedCompositeFieldContainer[TrainerIndices]
    def __init__(self, peer_id: _Optional[str] = ..., held: _Optional[_Iterable[_Union[TrainerIndices, _Mapping]]] = ...) -> None: ...

class TrainerIndices(_message.Message):
    __slots__ = ("trainer", "indices", "samples")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    samples: int
    def __init__(self, trainer: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., samples: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("run_id", "span", "epoch", "version", "trainer", "trainers", "members")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    span: Span
    epoch: int
    version: int
    trainer: str
    trainers: _containers.RepeatedScalarFieldContainer[str]
    members: _containers.RepeatedCompositeFieldContainer[Holding]
    def __init__(self, run_id: _Optional[str] = ..., span: _Optional[_Union[Span, _Mapping]] = ..., epoch: _Optional[int] = ..., version: _Optional[int] = ..., trainer: _Optional[str] = ..., trainers: _Optional[_Iterable[str]] = ..., members: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("epoch", "state", "round_id", "grad_digest", "grad_sq_norm", "samples", "reason", "trainers", "version", "split")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        IDLE: _ClassVar[RoundStatus.State]
        WAITING: _ClassVar[RoundStatus.State]
        AVERAGING: _ClassVar[RoundStatus.State]
        AVERAGED: _ClassVar[RoundStatus.State]
        FAILED: _ClassVar[RoundStatus.State]
        FENCED: _ClassVar[RoundStatus.State]
        APPLIED: _ClassVar[RoundStatus.State]
    IDLE: RoundStatus.State
    WAITING: RoundStatus.State
    AVERAGING: RoundStatus.State
    AVERAGED: RoundStatus.State
    FAILED: RoundStatus.State
    FENCED: RoundStatus.State
    APPLIED: RoundStatus.State
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    state: RoundStatus.State
    round_id: str
    grad_digest: str
    grad_sq_norm: float
    samples: int
    reason: str
    trainers: _containers.RepeatedScalarFieldContainer[str]
    version: int
    split: bool
    def __init__(self, epoch: _Optional[int] = ..., state: _Optional[_Union[RoundStatus.State, str]] = ..., round_id: _Optional[str] = ..., grad_digest: _Optional[str] = ..., grad_sq_norm: _Optional[float] = ..., samples: _Optional[int] = ..., reason: _Optional[str] = ..., trainers: _Optional[_Iterable[str]] = ..., version: _Optional[int] = ..., split: _Optional[bool] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RoundStatus
    def __init__(self, status: _Optional[_Union[RoundStatus, _Mapping]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("run_id", "span", "epoch", "round_id", "grad_digest", "clip_scale")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    GRAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CLIP_SCALE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    span: Span
    epoch: int
    round_id: str
    grad_digest: str
    clip_scale: float
    def __init__(self, run_id: _Optional[str] = ..., span: _Optional[_Union[Span, _Mapping]] = ..., epoch: _Optional[int] = ..., round_id: _Optional[str] = ..., grad_digest: _Optional[str] = ..., clip_scale: _Optional[float] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("epoch", "param_digest", "applied_samples")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    param_digest: str
    applied_samples: int
    def __init__(self, epoch: _Optional[int] = ..., param_digest: _Optional[str] = ..., applied_samples: _Optional[int] = ...) -> None: ...

class BackwardResponse(_message.Message):
    __slots__ = ("grad_inputs", "payload")
    GRAD_INPUTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    grad_inputs: Tensor
    payload: bytes
    def __init__(self, grad_inputs: _Optional[_Union[Tensor, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("open", "step", "close", "payload")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    step: InferenceStep
    close: CloseSession
    payload: bytes
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., close: _Optional[_Union[CloseSession, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("span", "session_id", "max_length", "batch_size", "alloc_timeout_s", "push_token")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    span: Span
    session_id: str
    max_length: int
    batch_size: int
    alloc_timeout_s: float
    push_token: bytes
    def __init__(self, span: _Optional[_Union[Span, _Mapping]] = ..., session_id: _Optional[str] = ..., max_length: _Optional[int] = ..., batch_size: _Optional[int] = ..., alloc_timeout_s: _Optional[float] = ..., push_token: _Optional[bytes] = ...) -> None: ...

class InferenceStep(_message.Message):
    __slots__ = ("session_id", "hidden_states", "attention_mask", "position_ids", "prefix_length", "step_id", "output_compression", "next")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    hidden_states: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    prefix_length: int
    step_id: int
    output_compression: Compression
    next: _containers.RepeatedCompositeFieldContainer[NextHop]
    def __init__(self, session_id: _Optional[str] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[Tensor, _Mapping]] = ..., prefix_length: _Optional[int] = ..., step_id: _Optional[int] = ..., output_compression: _Optional[_Union[Compression, str]] = ..., next: _Optional[_Iterable[_Union[NextHop, _Mapping]]] = ...) -> None: ...

class NextHop(_message.Message):
    __slots__ = ("endpoint", "session_id", "push_token", "step_id")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    session_id: str
    push_token: bytes
    step_id: int
    def __init__(self, endpoint: _Optional[str] = ..., session_id: _Optional[str] = ..., push_token: _Optional[bytes] = ..., step_id: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("push_token", "step", "payload")
    PUSH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    push_token: bytes
    step: InferenceStep
    payload: bytes
    def __init__(self, push_token: _Optional[bytes] = ..., step: _Optional[_Union[InferenceStep, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSession(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class InferenceResponse(_message.Message):
    __slots__ = ("opened", "step", "error", "forward_failed", "payload")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FAILED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    step: StepResult
    error: Error
    forward_failed: ForwardFailed
    payload: bytes
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., forward_failed: _Optional[_Union[ForwardFailed, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ForwardFailed(_message.Message):
    __slots__ = ("step_id", "endpoint", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    endpoint: str
    message: str
    def __init__(self, step_id: _Optional[int] = ..., endpoint: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "max_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_length: int
    def __init__(self, session_id: _Optional[str] = ..., max_length: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("hidden_states", "step_id", "position")
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    hidden_states: Tensor
    step_id: int
    position: int
    def __init__(self, hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., step_id: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("param_digest", "nonce", "held")
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    param_digest: bool
    nonce: bytes
    held: bool
    def __init__(self, param_digest: _Optional[bool] = ..., nonce: _Optional[bytes] = ..., held: _Optional[bool] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("peer_id", "model", "start", "end", "version", "dtype", "cache_tokens_left", "throughput", "max_message_bytes", "open_sessions", "run_id", "epoch", "samples", "param_digest", "train_mode", "updating", "identity_proof", "queued_work", "abandoned_work", "decode_batches", "batched_steps", "pushed_steps", "step_timings", "round", "held", "applied_samples", "applied_round", "expert_hits", "expert_misses", "expert_prefetched", "expert_prefetch_used")
    class StepTimings(_message.Message):
        __slots__ = ("steps", "parse_s", "wait_s", "compute_s", "reply_s")
        STEPS_FIELD_NUMBER: _ClassVar[int]
        PARSE_S_FIELD_NUMBER: _ClassVar[int]
        WAIT_S_FIELD_NUMBER: _ClassVar[int]
        COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
        REPLY_S_FIELD_NUMBER: _ClassVar[int]
        steps: int
        parse_s: float
        wait_s: float
        compute_s: float
        reply_s: float
        def __init__(self, steps: _Optional[int] = ..., parse_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., reply_s: _Optional[float] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MODE_FIELD_NUMBER: _ClassVar[int]
    UPDATING_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_PROOF_FIELD_NUMBER: _ClassVar[int]
    QUEUED_WORK_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_WORK_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    APPLIED_ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HITS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MISSES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    model: str
    start: int
    end: int
    version: str
    dtype: str
    cache_tokens_left: int
    throughput: float
    max_message_bytes: int
    open_sessions: int
    run_id: str
    epoch: int
    samples: int
    param_digest: str
    train_mode: str
    updating: bool
    identity_proof: bytes
    queued_work: int
    abandoned_work: int
    decode_batches: int
    batched_steps: int
    pushed_steps: int
    step_timings: InfoResponse.StepTimings
    round: RoundStatus
    held: _containers.RepeatedCompositeFieldContainer[TrainerIndices]
    applied_samples: int
    applied_round: RoundStatus
    expert_hits: int
    expert_misses: int
    expert_prefetched: int
    expert_prefetch_used: int
    def __init__(self, peer_id: _Optional[str] = ..., model: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., version: _Optional[str] = ..., dtype: _Optional[str] = ..., cache_tokens_left: _Optional[int] = ..., throughput: _Optional[float] = ..., max_message_bytes: _Optional[int] = ..., open_sessions: _Optional[int] = ..., run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., samples: _Optional[int] = ..., param_digest: _Optional[str] = ..., train_mode: _Optional[str] = ..., updating: _Optional[bool] = ..., identity_proof: _Optional[bytes] = ..., queued_work: _Optional[int] = ..., abandoned_work: _Optional[int] = ..., decode_batches: _Optional[int] = ..., batched_steps: _Optional[int] = ..., pushed_steps: _Optional[int] = ..., step_timings: _Optional[_Union[InfoResponse.StepTimings, _Mapping]] = ..., round: _Optional[_Union[RoundStatus, _Mapping]] = ..., held: _Optional[_Iterable[_Union[TrainerIndices, _Mapping]]] = ..., applied_samples: _Optional[int] = ..., applied_round: _Optional[_Union[RoundStatus, _Mapping]] = ..., expert_hits: _Optional[int] = ..., expert_misses: _Optional[int] = ..., expert_prefetched: _Optional[int] = ..., expert_prefetch_used: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("span", "adapters")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    span: Span
    adapters: bool
    def __init__(self, span: _Optional[_Union[Span, _Mapping]] = ..., adapters: _Optional[bool] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("name", "tensor", "last", "payload")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: Tensor
    last: bool
    payload: bytes
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., last: _Optional[bool] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("reachable", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class RelayRegistration(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayRegistered(_message.Message):
    __slots__ = ("ttl_s", "error")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    error: Error
    def __init__(self, ttl_s: _Optional[float] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class RelayOpen(_message.Message):
    __slots__ = ("peer_id",)
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    def __init__(self, peer_id: _Optional[str] = ...) -> None: ...

class RelayOpened(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: Error
    def __init__(self, error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...
