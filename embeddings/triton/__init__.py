"""Triton Inference Server: the gRPC client, tensor codecs and the local server launcher. Nothing Django."""

from .client import AsyncTritonClient, ModelSpec, ModelStatistics, TensorSpec, TritonClient
from .errors import (
    TritonError,
    TritonInvalidInput,
    TritonModelError,
    TritonTimeout,
    TritonUnavailable,
)

__all__ = [
    "AsyncTritonClient",
    "ModelSpec",
    "ModelStatistics",
    "TensorSpec",
    "TritonClient",
    "TritonError",
    "TritonInvalidInput",
    "TritonModelError",
    "TritonTimeout",
    "TritonUnavailable",
]
