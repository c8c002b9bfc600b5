"""The ranking service's own rules, without Triton: order, ties, limits, the model's task."""

from __future__ import annotations

import numpy as np
import pytest

from embeddings.errors.service import InvalidRequest, LimitExceeded, UnsupportedByModel
from embeddings.models import EmbeddingModel
from embeddings.services.inference.ranking import RankingResult, ranking_check, scores_activated

pytestmark = pytest.mark.unit

RANKS = EmbeddingModel(name="ranks", triton_model="m", dimensions=4, max_tokens=16, rerank_by_similarity=True)
EMBEDS_ONLY = EmbeddingModel(name="embeds", triton_model="m", dimensions=4, max_tokens=16)


def result(scores: list[float]) -> RankingResult:
    counts = np.array([3, *[1] * len(scores)])  # a similarity ranking's: the query, then each document
    return RankingResult("m", np.array(scores, dtype=np.float32), counts, 0.0, 0.0)


def test_ranked_is_best_first_ties_in_input_order_and_cut_at_top_n():
    ranked = result([0.1, 0.9, 0.5, 0.9, -0.2])
    assert ranked.ranked() == [1, 3, 2, 0, 4]
    assert ranked.ranked(2) == [1, 3]
    assert ranked.ranked(99) == [1, 3, 2, 0, 4]
    assert ranked.total_tokens == 3 + 5
    assert ranked.inputs == 6


def test_a_cross_encoders_sigmoid_holds_for_logits_of_any_size():
    logits = np.array([-1000.0, -2.0, 0.0, 2.0, 1000.0])
    scores = scores_activated(logits, "sigmoid")
    assert scores.dtype == np.float32
    np.testing.assert_allclose(scores, [0.0, 0.11920292, 0.5, 0.88079708, 1.0], rtol=1e-6)
    assert np.isfinite(scores).all()
    np.testing.assert_array_equal(scores_activated(logits, "identity"), logits.astype(np.float32))


def test_limits_and_task_are_checked_before_any_work(settings):
    settings.RERANK_MAX_DOCUMENTS = 3
    settings.RERANK_MAX_TOKENS_PER_DOCUMENT = 100
    ranking_check(model=RANKS, documents=3, max_tokens_per_document=100)
    with pytest.raises(LimitExceeded, match="4 documents in one request; at most 3"):
        ranking_check(model=RANKS, documents=4, max_tokens_per_document=None)
    with pytest.raises(LimitExceeded, match="at most 100"):
        ranking_check(model=RANKS, documents=1, max_tokens_per_document=101)
    with pytest.raises(InvalidRequest, match="at least 2"):
        ranking_check(model=RANKS, documents=1, max_tokens_per_document=1)
    with pytest.raises(UnsupportedByModel, match="does not rank"):
        ranking_check(model=EMBEDS_ONLY, documents=1, max_tokens_per_document=None)
