"""Errors raised by the Triton client; the API maps them to HTTP statuses.

    TritonError                 anything that went wrong talking to Triton
    ├── TritonUnavailable       no connection: server down, restarting, unreachable (503)
    ├── TritonTimeout           the call's deadline passed before Triton answered (504)
    ├── TritonModelError        unknown or unready model, unexpected model signature,
    │                           server-side failure, malformed response (503)
    └── TritonInvalidInput      Triton (or the client, before sending) refused the
                                input tensors: wrong name, type or shape (422)

Errors from gRPC are raised `from` the original `grpc.RpcError`; the message names the
target, the method, the model and the gRPC status so a log line alone explains the cause.
"""


class TritonError(Exception):
    """Base class: a call to Triton did not produce a usable answer."""

    def __init__(
        self,
        message: str,
        *,
        target: str = "",
        model: str = "",
        status: str = "",
        details: str = "",
    ) -> None:
        super().__init__(message)
        self.target = target
        self.model = model
        self.status = status
        self.details = details


class TritonUnavailable(TritonError):
    """Triton could not be reached, or dropped the connection (after retries)."""


class TritonTimeout(TritonError):
    """The call's deadline passed before Triton answered."""


class TritonModelError(TritonError):
    """The model is unknown, not ready, failed while running, or answered unexpectedly."""


class TritonInvalidInput(TritonError):
    """The input tensors do not fit the model: wrong name, datatype, shape or batch."""
