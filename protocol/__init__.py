"""vintage's wire contract: typed, versioned messages (pydantic v2). Imports no torch, ray or vllm."""

from protocol.arrays import Float32Array, Int8Array, Int32Array
from protocol.messages import (
    NO_VERSION,
    SCHEMA_VERSION,
    EnvRef,
    EwmaStatus,
    FinishReason,
    JobStatus,
    Message,
    OldLogitAnswer,
    OldLogitItem,
    OldLogitRequest,
    OldLogitServiceStatus,
    ProtocolError,
    RolloutRequest,
    SamplingParams,
    ScaleRequest,
    ScaleResponse,
    TensorSpec,
    TokenStatus,
    Trajectory,
    WeightManifest,
    WorkerStatus,
    payload_checksum,
    verify_weight_payload,
)

__all__ = [name for name in dir() if not name.startswith("_")]
