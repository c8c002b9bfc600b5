"""Request contracts validated on one bound serializer per class (embeddings/contracts/fields.py)
answer exactly as a serializer made for the request would."""

from __future__ import annotations

import threading

import pytest
from rest_framework.exceptions import ValidationError

from embeddings.contracts.embeddings_request import OpenAIEmbeddingsRequest
from embeddings.contracts.fields import bound_contract, validated

pytestmark = pytest.mark.unit

BODIES = [
    {"model": "m", "input": "hello"},
    {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8, "user": "u"},
    {"model": "m", "input": [[1, 2], [3]]},
    {"model": "m", "input": ""},
    {"model": "", "input": "x"},
    {"input": "x"},
    {"model": "m", "input": "x", "dimensions": 0},
    {"model": "m", "input": "x", "dimensions": "8"},
    {"model": "m", "input": "x", "encoding_format": "int8"},
    {"model": 5, "input": [1, "a"], "user": "u" * 300},
]


def fresh(body: dict) -> list:
    """What DRF's own way gives: a serializer made for the body, is_valid; in order (the first
    error is the one the API answers with)."""
    serializer = OpenAIEmbeddingsRequest(data=body, context={"form": False})
    if serializer.is_valid():
        return ["valid", *serializer.validated_data.items()]
    return ["refused", *serializer.errors.items()]


def reused(body: dict) -> list:
    try:
        return ["valid", *validated(OpenAIEmbeddingsRequest, body).items()]
    except ValidationError as refusal:
        return ["refused", *refusal.detail.items()]


@pytest.mark.parametrize("body", BODIES)
def test_a_bound_contract_answers_as_a_fresh_serializer(body):
    assert reused(body) == fresh(body)
    assert reused(body) == fresh(body)  # and again, on the same instance


def test_one_instance_per_class_and_reading():
    assert bound_contract(OpenAIEmbeddingsRequest) is bound_contract(OpenAIEmbeddingsRequest)
    assert bound_contract(OpenAIEmbeddingsRequest, form=True) is not bound_contract(OpenAIEmbeddingsRequest)


def test_threads_validating_at_once_each_get_their_own_answer():
    answers: dict[int, object] = {}

    def validate_many(index: int) -> None:
        body = BODIES[index % len(BODIES)]
        answers[index] = all(reused(body) == fresh(body) for _ in range(200))

    threads = [threading.Thread(target=validate_many, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == dict.fromkeys(range(8), True)
