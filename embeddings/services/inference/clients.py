"""The process's Triton clients and per-model tokenizers, configured from settings (one place)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from functools import cache
from pathlib import Path

import numpy as np
from django.conf import settings

from embeddings.metrics import BATCH_ROWS, BATCH_TOKENS, QUEUE_SECONDS
from embeddings.services.inference.coalescing import Coalescer, remaining_s
from embeddings.services.inference.exports import model_export_versions
from embeddings.services.inference.scheduling import FairScheduler
from embeddings.tokenization import TextTokenizer, tokenizer_for
from embeddings.triton import PRIORITY_INTERACTIVE
from embeddings.triton.client import AsyncTritonClient, TritonClient
from embeddings.triton.targets import TritonTarget

_lock = threading.Lock()
_async_client: AsyncTritonClient | None = None
_sync_client: TritonClient | None = None


def _client_options() -> dict:
    return {
        "channels": settings.TRITON_GRPC_CHANNELS,
        "timeout_s": settings.TRITON_TIMEOUT_S,
        "retries": settings.TRITON_RETRIES,
        "max_message_bytes": settings.TRITON_MAX_MESSAGE_BYTES,
        "model_load_timeout_s": settings.TRITON_MODEL_LOAD_TIMEOUT_S,
        "attempt_timeout_s": triton_attempt_timeout_s(),
        "keepalive_s": triton_keepalive_s(),
    }


def triton_keepalive_s() -> float | None:
    """TRITON_KEEPALIVE_S, or by default 2 s with several replicas and 360 s (None) with one."""
    if settings.TRITON_KEEPALIVE_S:
        return settings.TRITON_KEEPALIVE_S
    return 2.0 if TritonTarget.of_grpc_target(settings.TRITON_GRPC_TARGET).replicated else None


def triton_attempt_timeout_s() -> float | None:
    """TRITON_ATTEMPT_TIMEOUT_S, or by default a third of the deadline with several replicas (a
    silent one costs a call a third of its time, then another replica answers), and the whole
    deadline with one (no other replica to try)."""
    if settings.TRITON_ATTEMPT_TIMEOUT_S:
        return settings.TRITON_ATTEMPT_TIMEOUT_S
    if TritonTarget.of_grpc_target(settings.TRITON_GRPC_TARGET).replicated:
        return settings.TRITON_TIMEOUT_S / 3
    return None


def triton_async_client() -> AsyncTritonClient:
    """The pooled grpc.aio client; its channels open lazily inside the running event loop."""
    global _async_client
    with _lock:
        if _async_client is None:
            _async_client = AsyncTritonClient(settings.TRITON_GRPC_TARGET, **_client_options())
        return _async_client


def triton_sync_client() -> TritonClient:
    """The blocking client, for Celery workers and management commands."""
    global _sync_client
    with _lock:
        if _sync_client is None:
            _sync_client = TritonClient(settings.TRITON_GRPC_TARGET, **_client_options())
        return _sync_client


# One per event loop: its waiters are futures of that loop (tests run many loops in one process).
_schedulers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FairScheduler] = weakref.WeakKeyDictionary()


def inference_scheduler() -> FairScheduler:
    """This process's (and event loop's) fair scheduler of sub-batches, MAX_TOKENS_IN_FLIGHT wide."""
    loop = asyncio.get_running_loop()
    scheduler = _schedulers.get(loop)
    if scheduler is None or scheduler.capacity != settings.MAX_TOKENS_IN_FLIGHT:
        scheduler = _schedulers[loop] = FairScheduler(settings.MAX_TOKENS_IN_FLIGHT)
    return scheduler


_coalescers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], Coalescer]] = (
    weakref.WeakKeyDictionary()
)


def request_coalescer(model: str, version: str, *, max_rows: int) -> Coalescer:
    """This event loop's coalescer of calls to (model, version), built from the current settings."""
    per_model = _coalescers.setdefault(asyncio.get_running_loop(), {})
    coalescer = per_model.get((model, version))
    wanted = (max_rows, settings.MAX_BATCH_TOKENS, settings.COALESCE_MAX_CALLS)
    if coalescer is None or (coalescer.max_rows, coalescer.max_tokens, coalescer.max_calls) != wanted:

        async def call(
            input_ids: np.ndarray,
            attention_mask: np.ndarray,
            token_type_ids: np.ndarray | None,
            deadline: float,
        ) -> np.ndarray:
            # The client of the moment: tests and settings changes replace it.
            return await triton_async_client().embed_tokens(
                model,
                input_ids,
                attention_mask,
                token_type_ids=token_type_ids,
                version=version,
                output_name=settings.OUTPUT_NAME,
                priority=PRIORITY_INTERACTIVE,
                timeout_s=remaining_s(deadline, settings.TRITON_TIMEOUT_S),
            )

        def observe(rows: int, tokens: int) -> None:
            BATCH_ROWS.labels(model).observe(rows)
            BATCH_TOKENS.labels(model).observe(tokens)

        def observe_queued(seconds: float) -> None:
            QUEUE_SECONDS.labels(model).observe(seconds)

        coalescer = per_model[(model, version)] = Coalescer(
            call,
            max_rows=max_rows,
            max_tokens=wanted[1],
            max_calls=wanted[2],
            observe=observe,
            observe_queued=observe_queued,
        )
    return coalescer


def reset_clients() -> None:
    """Forget the clients (settings changed, e.g. in tests); open channels are left to be collected."""
    global _async_client, _sync_client
    with _lock:
        if _sync_client is not None:
            _sync_client.close()
        _async_client = None
        _sync_client = None
    model_tokenizer.cache_clear()


@cache
def model_tokenizer(model: str, max_tokens: int | None = None, version: str = "") -> TextTokenizer:
    """The tokenizer exported beside the model's `version` (blank: its latest finished export),
    else the default model's (text-input ensembles).

    max_tokens: truncate there instead of at the tokenizer file's own maximum.
    """
    repository = Path(settings.TRITON_MODEL_REPOSITORY)
    if not version:
        versions = model_export_versions(repository_dir=repository, name=model)
        version = str(versions[-1]) if versions else "1"
    for candidate in (repository / model / version, repository / settings.MODEL_NAME / "1"):
        path = candidate / "tokenizer.json"
        if path.exists():
            return tokenizer_for(str(path), max_tokens)
    raise FileNotFoundError(
        f"No tokenizer.json for model {model!r} version {version} in {repository}; export the model first "
        "(python manage.py export_model)"
    )
