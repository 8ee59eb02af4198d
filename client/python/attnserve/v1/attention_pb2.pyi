from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

ATTENTION_MAP_MODE_MEAN: AttentionMapMode
ATTENTION_MAP_MODE_NONE: AttentionMapMode
ATTENTION_MAP_MODE_PER_HEAD: AttentionMapMode
DATA_TYPE_BF16: DataType
DATA_TYPE_BOOL: DataType
DATA_TYPE_FP32: DataType
DATA_TYPE_UNSPECIFIED: DataType
DESCRIPTOR: _descriptor.FileDescriptor
MODEL_STATE_FAILED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_UNSPECIFIED: ModelState
PRECISION_BF16: Precision
PRECISION_FP32: Precision
PRECISION_UNSPECIFIED: Precision

class AttendRequest(_message.Message):
    __slots__ = ["attention_maps", "causal", "context", "context_lengths", "head_mask", "hidden_states", "layer", "mask", "model", "output_dtype", "position_offsets", "precision", "projected", "sequence_lengths"]
    ATTENTION_MAPS_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    HEAD_MASK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    POSITION_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    attention_maps: AttentionMapRequest
    causal: bool
    context: Tensor
    context_lengths: _containers.RepeatedScalarFieldContainer[int]
    head_mask: _containers.RepeatedScalarFieldContainer[float]
    hidden_states: Tensor
    layer: LayerSpec
    mask: AttentionMask
    model: str
    output_dtype: DataType
    position_offsets: _containers.RepeatedScalarFieldContainer[int]
    precision: Precision
    projected: ProjectedHeads
    sequence_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., attention_maps: _Optional[_Union[AttentionMapRequest, _Mapping]] = ..., sequence_lengths: _Optional[_Iterable[int]] = ..., context: _Optional[_Union[Tensor, _Mapping]] = ..., context_lengths: _Optional[_Iterable[int]] = ..., causal: bool = ..., mask: _Optional[_Union[AttentionMask, _Mapping]] = ..., head_mask: _Optional[_Iterable[float]] = ..., position_offsets: _Optional[_Iterable[int]] = ..., precision: _Optional[_Union[Precision, str]] = ..., output_dtype: _Optional[_Union[DataType, str]] = ..., layer: _Optional[_Union[LayerSpec, _Mapping]] = ..., projected: _Optional[_Union[ProjectedHeads, _Mapping]] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ["attention_maps", "head_statistics", "kernel_path", "model", "output", "precision", "timing"]
    ATTENTION_MAPS_FIELD_NUMBER: _ClassVar[int]
    HEAD_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    attention_maps: Tensor
    head_statistics: HeadStatistics
    kernel_path: str
    model: str
    output: Tensor
    precision: Precision
    timing: Timing
    def __init__(self, model: _Optional[str] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., attention_maps: _Optional[_Union[Tensor, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., kernel_path: _Optional[str] = ..., head_statistics: _Optional[_Union[HeadStatistics, _Mapping]] = ..., precision: _Optional[_Union[Precision, str]] = ...) -> None: ...

class AttendStreamResponse(_message.Message):
    __slots__ = ["map_chunk", "response"]
    MAP_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    map_chunk: AttentionMapChunk
    response: AttendResponse
    def __init__(self, response: _Optional[_Union[AttendResponse, _Mapping]] = ..., map_chunk: _Optional[_Union[AttentionMapChunk, _Mapping]] = ...) -> None: ...

class AttentionMapChunk(_message.Message):
    __slots__ = ["first_head", "first_row", "maps", "sequence"]
    FIRST_HEAD_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    first_head: int
    first_row: int
    maps: Tensor
    sequence: int
    def __init__(self, sequence: _Optional[int] = ..., first_head: _Optional[int] = ..., first_row: _Optional[int] = ..., maps: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AttentionMapRequest(_message.Message):
    __slots__ = ["head_statistics", "heads", "mode", "query_rows"]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    QUERY_ROWS_FIELD_NUMBER: _ClassVar[int]
    head_statistics: bool
    heads: _containers.RepeatedScalarFieldContainer[int]
    mode: AttentionMapMode
    query_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, mode: _Optional[_Union[AttentionMapMode, str]] = ..., heads: _Optional[_Iterable[int]] = ..., query_rows: _Optional[_Iterable[int]] = ..., head_statistics: bool = ...) -> None: ...

class AttentionMask(_message.Message):
    __slots__ = ["kind", "values"]
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = []
    KIND_ADDITIVE: AttentionMask.Kind
    KIND_ALLOWED: AttentionMask.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KIND_UNSPECIFIED: AttentionMask.Kind
    VALUES_FIELD_NUMBER: _ClassVar[int]
    kind: AttentionMask.Kind
    values: Tensor
    def __init__(self, kind: _Optional[_Union[AttentionMask.Kind, str]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ["session_id"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ["output_dtype", "precision", "steps"]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    output_dtype: DataType
    precision: Precision
    steps: _containers.RepeatedCompositeFieldContainer[ExtendStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[ExtendStep, _Mapping]]] = ..., precision: _Optional[_Union[Precision, str]] = ..., output_dtype: _Optional[_Union[DataType, str]] = ...) -> None: ...

class ExtendResponse(_message.Message):
    __slots__ = ["kernel_path", "precision", "results", "timing"]
    KERNEL_PATH_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    kernel_path: str
    precision: Precision
    results: _containers.RepeatedCompositeFieldContainer[ExtendResult]
    timing: Timing
    def __init__(self, results: _Optional[_Iterable[_Union[ExtendResult, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., kernel_path: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ...) -> None: ...

class ExtendResult(_message.Message):
    __slots__ = ["attention_maps", "code", "head_statistics", "length", "message", "output", "replayed"]
    ATTENTION_MAPS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    HEAD_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    attention_maps: Tensor
    code: int
    head_statistics: HeadStatistics
    length: int
    message: str
    output: Tensor
    replayed: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., attention_maps: _Optional[_Union[Tensor, _Mapping]] = ..., length: _Optional[int] = ..., replayed: bool = ..., head_statistics: _Optional[_Union[HeadStatistics, _Mapping]] = ...) -> None: ...

class ExtendStep(_message.Message):
    __slots__ = ["attention_maps", "expected_length", "head_mask", "head_statistics", "hidden_states", "layer", "session_id"]
    ATTENTION_MAPS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HEAD_MASK_FIELD_NUMBER: _ClassVar[int]
    HEAD_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    attention_maps: bool
    expected_length: int
    head_mask: _containers.RepeatedScalarFieldContainer[float]
    head_statistics: bool
    hidden_states: Tensor
    layer: int
    session_id: str
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ..., expected_length: _Optional[int] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., attention_maps: bool = ..., head_mask: _Optional[_Iterable[float]] = ..., head_statistics: bool = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ["session_id"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ["session_id"]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeadConfig(_message.Message):
    __slots__ = ["context_dim", "d_model", "head_dim", "num_heads", "num_kv_heads", "rotary", "scale"]
    CONTEXT_DIM_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    ROTARY_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    context_dim: int
    d_model: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    rotary: RotaryConfig
    scale: float
    def __init__(self, d_model: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., scale: _Optional[float] = ..., rotary: _Optional[_Union[RotaryConfig, _Mapping]] = ..., context_dim: _Optional[int] = ...) -> None: ...

class HeadStatistics(_message.Message):
    __slots__ = ["contribution", "entropy", "max_weight"]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    contribution: Tensor
    entropy: Tensor
    max_weight: Tensor
    def __init__(self, entropy: _Optional[_Union[Tensor, _Mapping]] = ..., max_weight: _Optional[_Union[Tensor, _Mapping]] = ..., contribution: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LatestAttention(_message.Message):
    __slots__ = ["head_statistics", "layer", "length", "maps", "position", "session_id"]
    HEAD_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    head_statistics: HeadStatistics
    layer: int
    length: int
    maps: Tensor
    position: int
    session_id: str
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ..., length: _Optional[int] = ..., position: _Optional[int] = ..., maps: _Optional[_Union[Tensor, _Mapping]] = ..., head_statistics: _Optional[_Union[HeadStatistics, _Mapping]] = ...) -> None: ...

class LatestAttentionRequest(_message.Message):
    __slots__ = ["layer", "session_id"]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    layer: int
    session_id: str
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ["head_config", "inline_weights", "seed"]
    HEAD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    INLINE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    head_config: HeadConfig
    inline_weights: LayerWeights
    seed: int
    def __init__(self, head_config: _Optional[_Union[HeadConfig, _Mapping]] = ..., seed: _Optional[int] = ..., inline_weights: _Optional[_Union[LayerWeights, _Mapping]] = ...) -> None: ...

class LayerWeights(_message.Message):
    __slots__ = ["b_k", "b_o", "b_q", "b_v", "w_k", "w_o", "w_q", "w_v"]
    B_K_FIELD_NUMBER: _ClassVar[int]
    B_O_FIELD_NUMBER: _ClassVar[int]
    B_Q_FIELD_NUMBER: _ClassVar[int]
    B_V_FIELD_NUMBER: _ClassVar[int]
    W_K_FIELD_NUMBER: _ClassVar[int]
    W_O_FIELD_NUMBER: _ClassVar[int]
    W_Q_FIELD_NUMBER: _ClassVar[int]
    W_V_FIELD_NUMBER: _ClassVar[int]
    b_k: Tensor
    b_o: Tensor
    b_q: Tensor
    b_v: Tensor
    w_k: Tensor
    w_o: Tensor
    w_q: Tensor
    w_v: Tensor
    def __init__(self, w_q: _Optional[_Union[Tensor, _Mapping]] = ..., b_q: _Optional[_Union[Tensor, _Mapping]] = ..., w_k: _Optional[_Union[Tensor, _Mapping]] = ..., b_k: _Optional[_Union[Tensor, _Mapping]] = ..., w_v: _Optional[_Union[Tensor, _Mapping]] = ..., b_v: _Optional[_Union[Tensor, _Mapping]] = ..., w_o: _Optional[_Union[Tensor, _Mapping]] = ..., b_o: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ["models"]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ["layers", "model"]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    model: ModelInfo
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ["causal", "description", "failure_reason", "head_config", "input_dtypes", "limits", "name", "state"]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    HEAD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    INPUT_DTYPES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    causal: bool
    description: str
    failure_reason: str
    head_config: HeadConfig
    input_dtypes: _containers.RepeatedScalarFieldContainer[DataType]
    limits: ModelLimits
    name: str
    state: ModelState
    def __init__(self, name: _Optional[str] = ..., head_config: _Optional[_Union[HeadConfig, _Mapping]] = ..., limits: _Optional[_Union[ModelLimits, _Mapping]] = ..., description: _Optional[str] = ..., input_dtypes: _Optional[_Iterable[_Union[DataType, str]]] = ..., state: _Optional[_Union[ModelState, str]] = ..., failure_reason: _Optional[str] = ..., causal: bool = ...) -> None: ...

class ModelLimits(_message.Message):
    __slots__ = ["max_attention_map_bytes", "max_batch", "max_seq_len"]
    MAX_ATTENTION_MAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    max_attention_map_bytes: int
    max_batch: int
    max_seq_len: int
    def __init__(self, max_batch: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_attention_map_bytes: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ["first_position", "idle_ttl", "kv_dtype", "max_tokens", "models"]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    idle_ttl: _duration_pb2.Duration
    kv_dtype: DataType
    max_tokens: int
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[str]] = ..., kv_dtype: _Optional[_Union[DataType, str]] = ..., max_tokens: _Optional[int] = ..., idle_ttl: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., first_position: _Optional[int] = ...) -> None: ...

class ProjectedHeads(_message.Message):
    __slots__ = ["k", "q", "v"]
    K_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    k: Tensor
    q: Tensor
    v: Tensor
    def __init__(self, q: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RotaryConfig(_message.Message):
    __slots__ = ["rotary_dim", "theta"]
    ROTARY_DIM_FIELD_NUMBER: _ClassVar[int]
    THETA_FIELD_NUMBER: _ClassVar[int]
    rotary_dim: int
    theta: float
    def __init__(self, rotary_dim: _Optional[int] = ..., theta: _Optional[float] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ["first_position", "idle_ttl", "kv_blocks", "kv_bytes", "kv_dtype", "last_used", "layer_lengths", "max_tokens", "models", "session_id"]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    LAYER_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    first_position: int
    idle_ttl: _duration_pb2.Duration
    kv_blocks: int
    kv_bytes: int
    kv_dtype: DataType
    last_used: _timestamp_pb2.Timestamp
    layer_lengths: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    models: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., layer_lengths: _Optional[_Iterable[int]] = ..., kv_dtype: _Optional[_Union[DataType, str]] = ..., max_tokens: _Optional[int] = ..., idle_ttl: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., first_position: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., last_used: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ["dtype", "float_data", "raw_data", "shape"]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_DATA_FIELD_NUMBER: _ClassVar[int]
    RAW_DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    float_data: _containers.RepeatedScalarFieldContainer[float]
    raw_data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., raw_data: _Optional[bytes] = ..., float_data: _Optional[_Iterable[float]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ["batch_size", "batch_tokens", "compute", "queue"]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    batch_tokens: int
    compute: _duration_pb2.Duration
    queue: _duration_pb2.Duration
    def __init__(self, queue: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., compute: _Optional[_Union[_duration_pb2.Duration, _Mapping]] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class TruncateSessionRequest(_message.Message):
    __slots__ = ["all_layers", "layer", "length", "session_id"]
    ALL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    all_layers: bool
    layer: int
    length: int
    session_id: str
    def __init__(self, session_id: _Optional[str] = ..., layer: _Optional[int] = ..., all_layers: bool = ..., length: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class AttentionMapMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
