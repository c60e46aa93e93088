"""The bus protocol: subject names and message schemas, versioned and validated on receipt."""

from shared.protocol.codec import PROTOCOL_VERSION, Message, decode, encode, from_dict, message, register
from shared.protocol.messages import (
    Abort,
    Ack,
    ErrorReply,
    GenerateTask,
    LoadReport,
    SamplingParams,
    ServiceInfo,
    TaskAck,
    TokenBatch,
    TokenDelta,
)
from shared.protocol.subjects import Subjects, check_token

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Ack",
    "ErrorReply",
    "GenerateTask",
    "LoadReport",
    "Message",
    "SamplingParams",
    "ServiceInfo",
    "Subjects",
    "TaskAck",
    "TokenBatch",
    "TokenDelta",
    "check_token",
    "decode",
    "encode",
    "from_dict",
    "message",
    "register",
]
