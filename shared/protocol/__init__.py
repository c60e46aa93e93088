"""The bus protocol: subject names and message schemas, versioned and validated on receipt."""

from shared.protocol.codec import PROTOCOL_VERSION, Message, decode, encode, from_dict, message, register
from shared.protocol.messages import (
    COMPUTE_RATE,
    PROMPT_RATE,
    Abort,
    Ack,
    ErrorReply,
    KvFormat,
    LoadReport,
    RouteCapability,
    SamplingParams,
    ServiceInfo,
    TokenBatch,
    TokenDelta,
    TokenResend,
)
from shared.protocol.subjects import Subjects, check_token
from shared.protocol.tasks import GenerateTask, KvPlan, RequestPlan, TaskAck

__all__ = [
    "COMPUTE_RATE",
    "PROMPT_RATE",
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "ErrorReply",
    "GenerateTask",
    "KvFormat",
    "KvPlan",
    "LoadReport",
    "Message",
    "RequestPlan",
    "RouteCapability",
    "SamplingParams",
    "ServiceInfo",
    "Subjects",
    "TaskAck",
    "TokenBatch",
    "TokenDelta",
    "TokenResend",
    "check_token",
    "decode",
    "encode",
    "from_dict",
    "message",
    "register",
]
