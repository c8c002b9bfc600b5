"""Triton Inference Server at run time: the gRPC client, tensor codecs, targets. Nothing Django.

The local server launcher is embeddings/tooling/triton_server.py; what runs inside Triton's
process (our backends, the model configuration templates), embeddings/in_triton/.

The client's names below load the client module (grpc, the protobuf stubs, numpy) on first use,
not with the package: Django's start-up imports the package (settings parse TRITON_SERVER_URL with
.targets, the admin catches TritonError) in every process, and most commands never call Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import (
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonModelLoadFailed,
    TritonModelMismatch,
    TritonModelNotLoaded,
    TritonTimeout,
    TritonUnavailable,
)

if TYPE_CHECKING:
    from .client import (
        PRIORITY_BULK,
        PRIORITY_INTERACTIVE,
        PRIORITY_LARGE,
        AsyncTritonClient,
        ModelSpec,
        ModelStatistics,
        RepositoryModel,
        TensorSpec,
        TritonClient,
    )

__all__ = [
    "PRIORITY_BULK",
    "PRIORITY_INTERACTIVE",
    "PRIORITY_LARGE",
    "AsyncTritonClient",
    "ModelSpec",
    "ModelStatistics",
    "RepositoryModel",
    "TensorSpec",
    "TritonClient",
    "TritonError",
    "TritonInvalidInput",
    "TritonModelError",
    "TritonModelLoadFailed",
    "TritonModelMismatch",
    "TritonModelNotLoaded",
    "TritonTimeout",
    "TritonUnavailable",
]


def __getattr__(name: str):
    # Only the client's names get here: the errors are attributes already.
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
