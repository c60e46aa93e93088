"""One error hierarchy with stable codes.

Mapped once to NATS error replies (`ErrorReply` in `shared.protocol`) and once to OpenAI-style HTTP errors
(`to_openai_body`). Services raise these; handlers translate them at the edge.
"""

from __future__ import annotations

from typing import Any


class KvpathError(Exception):
    """Base of every error kvpath reports to a peer or a client."""

    code: str = "internal_error"
    http_status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class ConfigError(KvpathError):
    code = "config_error"


class InvalidRequestError(KvpathError):
    code = "invalid_request"
    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(InvalidRequestError):
    code = "model_not_found"
    http_status = 404  # as OpenAI answers an unknown model


class OverloadedError(KvpathError):
    """Queue full: the client should retry later (HTTP 429)."""

    code = "overloaded"
    http_status = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(KvpathError):
    """Nobody answers on a subject, or a dependency is down (HTTP 503 with Retry-After)."""

    code = "service_unavailable"
    http_status = 503
    error_type = "service_unavailable"


class NoEngineAvailableError(ServiceUnavailableError):
    """No live engine can take the request."""

    code = "no_engine_available"


class EngineFailedError(KvpathError):
    """An engine died or reported a failure while serving the request."""

    code = "engine_failed"
    http_status = 502
    error_type = "server_error"


class DeadlineExceededError(KvpathError):
    code = "deadline_exceeded"
    http_status = 504
    error_type = "timeout_error"


class AbortedError(KvpathError):
    code = "aborted"
    http_status = 499
    error_type = "server_error"


class ProtocolError(KvpathError):
    """A bus message that does not match its schema."""

    code = "bad_message"
    http_status = 400
    error_type = "invalid_request_error"


class StorageError(KvpathError):
    code = "storage_error"


class StorageFullError(StorageError):
    """The store has no room (capacity reached or the disk is full): writes are skipped, reads go on."""

    code = "storage_full"


class TransportError(KvpathError):
    """The KV data plane to a peer failed (a peer that died, a broken connection): retryable."""

    code = "transport_error"
    http_status = 502


class AuthenticationError(KvpathError):
    """No API key, or one the server does not know (OpenAI's 401)."""

    code = "invalid_api_key"
    http_status = 401
    error_type = "invalid_request_error"


class NotFoundError(InvalidRequestError):
    """An object the request names does not exist (OpenAI's 404 for a file or a batch)."""

    code = "not_found"
    http_status = 404


class RequestTooLargeError(InvalidRequestError):
    code = "request_too_large"
    http_status = 413


class RequestTimeoutError(InvalidRequestError):
    """The client did not send its whole request body within the server's read timeout."""

    code = "request_timeout"
    http_status = 408


_BY_CODE: dict[str, type[KvpathError]] = {}


def _register(cls: type[KvpathError]) -> None:
    _BY_CODE.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _register(sub)


_register(KvpathError)


def error_from_code(code: str, message: str, param: str | None = None) -> KvpathError:
    """Rebuild the error a peer reported (the inverse of `ErrorReply.from_error`)."""
    cls = _BY_CODE.get(code, KvpathError)
    return cls(message, param=param, code=code)
