"""Texts to tokens and token ids to texts with a model's own tokenizer, no model run: the service
behind TEI's POST /tokenize and POST /decode.

Tokenising is untruncated, as TEI's is: each text's every token, with where it lies in the text
(UTF-8 byte offsets, as TEI gives them: embeddings.tokenization.Token), after the model's prompt
when one applies (the prompt's tokens included, and the offsets counted from the prompt's start,
as TEI counts them). What bounds the work is TEI's rule for one text (at most 250 characters per
token of the model's maximum) and ours for a request: its inputs (MAX_INPUTS_PER_REQUEST or the
model's) and its tokens in all (MAX_TOKENS_PER_REQUEST or the model's), counted as the texts are
tokenised, so a body of many long texts stops at the limit instead of being tokenised whole.

Metered as requests: a request is admitted by its caller's request rates and concurrency limits
(one quota reservation, after its texts or ids were found valid, as an embedding request's is) and
counted in usage under its own endpoint, with its inputs and no tokens: no model reads anything,
so token rates and budgets are neither charged nor asked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generic, TypeVar

from django.conf import settings

from embeddings.errors.service import LimitExceeded, ModelNotLoaded
from embeddings.metrics import TOKENIZATION_SECONDS
from embeddings.observability import context as request_context
from embeddings.observability import tracing
from embeddings.services.inference.clients import model_tokenizer
from embeddings.services.inference.embedding import TOKENIZE_IN_THREAD_ABOVE, EmbeddingTarget
from embeddings.tokenization import TextTokenizer, Token, TokenizationError

if TYPE_CHECKING:
    from embeddings.models import EmbeddingModel
    from embeddings.services.quotas.limits import RequestQuota

# TEI refuses a text to tokenise longer than this many characters per token of the model's maximum
# (its MAX_CHAR_MULTIPLIER): 64,000 for a 256-token model.
CHARACTERS_PER_TOKEN = 250

Result = TypeVar("Result")
Answer = TypeVar("Answer")


@dataclass(frozen=True)
class TokenizerResult(Generic[Answer]):
    """What the tokenizer answered for each input (a text's tokens, a sequence's text), in input
    order, and the time it took; no model ran."""

    model: str
    answers: list[Answer]
    tokenization_s: float
    inference_s: float = 0.0

    @property
    def inputs(self) -> int:
        return len(self.answers)

    @property
    def total_tokens(self) -> int:
        """Tokens a model read, which quotas, usage and the embedded-token counters count: none."""
        return 0


def _max_inputs(model: EmbeddingModel) -> int:
    return model.max_inputs_per_request or settings.MAX_INPUTS_PER_REQUEST


def _max_total_tokens(model: EmbeddingModel) -> int:
    return model.max_tokens_per_request or settings.MAX_TOKENS_PER_REQUEST


def _tokenizer(model: EmbeddingModel) -> TextTokenizer:
    """The model's own tokenizer; a model whose export is not in the repository is not served (the
    repository's default tokenizer, which text-input models share, would answer for it)."""
    not_served = ModelNotLoaded(
        model=model.name, triton_model=model.triton_model, version=model.triton_version
    )
    if not (Path(settings.TRITON_MODEL_REPOSITORY) / model.triton_model).is_dir():
        raise not_served
    try:
        return model_tokenizer(model.triton_model, model.max_tokens, model.triton_version)
    except FileNotFoundError as error:
        raise not_served from error


def _prompt(model: EmbeddingModel, name: str | None) -> str:
    """The prompt text `name` names (or the model's default prompt), as an embedding request's."""
    return EmbeddingTarget(
        triton_model=model.triton_model,
        name=model.name,
        prompts=tuple(sorted((model.prompts or {}).items())),
        default_prompt_name=model.default_prompt_name,
    ).prompt(name)


async def _timed(model: EmbeddingModel, size: int, work: Callable[[], Result]) -> tuple[Result, float]:
    """`work`'s result and seconds: in a thread when `size` (characters or ids) makes it take
    milliseconds, so the event loop serves other requests meanwhile."""

    def timed() -> tuple[Result, float]:
        started = time.perf_counter()
        with tracing.span("tokenize", model=model.triton_model):
            result = work()
        elapsed = time.perf_counter() - started
        TOKENIZATION_SECONDS.labels(model.triton_model).observe(elapsed)
        return result, elapsed

    return await asyncio.to_thread(timed) if size > TOKENIZE_IN_THREAD_ABOVE else timed()


async def _metered(quota: RequestQuota | None, *, inputs: int) -> None:
    """The request counted as one against its caller's request limits, with no tokens (raises
    QuotaExceeded, LimitExceeded or QuotaUnavailable when they refuse it), and in usage."""
    # The access log's inputs and tokens, as an embedding request's: the tokens a model read.
    request_context.annotate(inputs=inputs, tokens=0)
    if quota is None:
        return
    with tracing.span("quota.reserve"):
        await quota.reserve(inputs=inputs, tokens=0)
    with tracing.span("quota.settle", succeeded=True):
        await quota.settle(succeeded=True)


def _tokens_within(
    tokenizer: TextTokenizer, texts: Sequence[str], *, add_special_tokens: bool, max_total_tokens: int
) -> list[list[Token]]:
    rows: list[list[Token]] = []
    total = 0
    try:
        for tokens in tokenizer.tokenize(texts, add_special_tokens=add_special_tokens):
            total += len(tokens)
            if total > max_total_tokens:
                # The inputs after this one are never tokenised.
                raise LimitExceeded(
                    f"The inputs have more than {max_total_tokens} tokens in all (inputs 0 to {len(rows)} "
                    f"have {total}); a request may have at most {max_total_tokens}",
                    param="inputs",
                )
            rows.append(tokens)
    except TokenizationError as error:
        raise error.restated(str(error), param="inputs") from None
    return rows


async def texts_tokenize(
    *,
    model: EmbeddingModel,
    texts: Sequence[str],
    add_special_tokens: bool = True,
    prompt_name: str | None = None,
    quota: RequestQuota | None = None,
) -> TokenizerResult[list[Token]]:
    """Each text's tokens with `model`'s tokenizer (see the module docstring); metered by `quota`."""
    max_inputs = _max_inputs(model)
    if len(texts) > max_inputs:
        raise LimitExceeded(
            f"{len(texts)} inputs in one request; this model takes at most {max_inputs}", param="inputs"
        )
    max_characters = model.max_tokens * CHARACTERS_PER_TOKEN
    for index, text in enumerate(texts):
        if isinstance(text, str) and len(text) > max_characters:
            raise LimitExceeded(
                f"Input {index} has {len(text)} characters; a text to tokenize may have at most "
                f"{max_characters} ({CHARACTERS_PER_TOKEN} per token of the model's maximum of "
                f"{model.max_tokens}, as TEI allows)",
                param="inputs",
            )
    prompt = _prompt(model, prompt_name)
    tokenizer = _tokenizer(model)
    prompted = [prompt + text for text in texts] if prompt else list(texts)
    tokens, seconds = await _timed(
        model,
        sum(map(len, prompted)),
        lambda: _tokens_within(
            tokenizer,
            prompted,
            add_special_tokens=add_special_tokens,
            max_total_tokens=_max_total_tokens(model),
        ),
    )
    await _metered(quota, inputs=len(tokens))
    return TokenizerResult(model=model.name, answers=tokens, tokenization_s=seconds)


async def token_ids_decode(
    *,
    model: EmbeddingModel,
    ids: Sequence[Sequence[int]],
    skip_special_tokens: bool = True,
    quota: RequestQuota | None = None,
) -> TokenizerResult[str]:
    """Each sequence of `model`'s token ids as text; metered by `quota` (see the module docstring)."""
    max_inputs = _max_inputs(model)
    if len(ids) > max_inputs:
        raise LimitExceeded(
            f"{len(ids)} sequences in one request; this model takes at most {max_inputs}", param="ids"
        )
    count, max_total_tokens = sum(map(len, ids)), _max_total_tokens(model)
    if count > max_total_tokens:
        raise LimitExceeded(
            f"The sequences have {count} token ids in all; a request may have at most {max_total_tokens}",
            param="ids",
        )
    tokenizer = _tokenizer(model)
    texts, seconds = await _timed(
        model, count, lambda: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    )
    await _metered(quota, inputs=len(texts))
    return TokenizerResult(model=model.name, answers=texts, tokenization_s=seconds)
