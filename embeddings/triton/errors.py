"""Errors raised by the Triton client; the API maps them to HTTP statuses.

    TritonError                 anything that went wrong talking to Triton
    ├── TritonUnavailable       no connection: server down, restarting, unreachable (503)
    ├── TritonTimeout           the call's deadline passed before Triton answered (504)
    ├── TritonModelError        unexpected model signature, server-side failure,
    │   │                       malformed response (503)
    │   ├── TritonModelNotLoaded    Triton has no ready version of the model (or of the version
    │   │                           asked for): unknown, never loaded, unloaded, failed to load;
    │   │                           raised at once, never retried (503)
    │   ├── TritonModelMismatch     Triton's replicas serve different versions or signatures of
    │   │                           the model: refused rather than mixed (503)
    │   └── TritonModelLoadFailed   a load through the model repository API failed; `reason`
    │                               is Triton's
    └── TritonInvalidInput      Triton (or the client, before sending) refused the
                                input tensors: wrong name, type or shape (422)

Errors from gRPC are raised `from` the original `grpc.RpcError`; the message names the
target, the method, the model and the gRPC status so a log line alone explains the cause.
"""

from embeddings.errors import EmbedsiteError


class TritonError(EmbedsiteError):
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


class TritonModelNotLoaded(TritonModelError):
    """Triton serves no ready version of `model` (`version`: the one asked for, "" for any)."""

    def __init__(self, message: str, *, version: str = "", **context: str) -> None:
        super().__init__(message, **context)
        self.version = version


class TritonModelMismatch(TritonModelError):
    """Triton's replicas disagree about `model` (its versions, inputs, outputs or batch size)."""


class TritonModelLoadFailed(TritonModelError):
    """Triton could not load `model`; `reason` says why, in Triton's words."""

    @property
    def reason(self) -> str:
        return self.details


class TritonInvalidInput(TritonError):
    """The input tensors do not fit the model: wrong name, datatype, shape or batch."""
