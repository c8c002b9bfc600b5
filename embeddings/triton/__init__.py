"""Triton Inference Server: the gRPC client, tensor codecs and the local server launcher. Nothing Django."""

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
