"""The usage hash's fields (embeddings/services/quotas/usage.py): what an event writes reads back
as its bucket and metric, the variant that served included, and a previous release's fields still read."""

from __future__ import annotations

import pytest

from embeddings.services.quotas import usage
from embeddings.services.quotas.usage import UsageEvent

pytestmark = pytest.mark.unit

HOUR = 1_767_225_600  # 2026-01-01 00:00 UTC


def test_a_field_keeps_its_variant_and_reads_back_whatever_the_model_name():
    event = UsageEvent(
        1,
        2,
        "odd|model|name",
        "openai",
        "succeeded",
        3,
        40,
        5,
        HOUR,
        model_version="12",
        model_dtype="float16",
    )
    fields = usage.usage_increments(event)
    parsed = {usage.parse_usage_field(field) for field in fields}
    bucket = usage.BucketKey(1, 2, "odd|model|name", "openai", HOUR, "12", "float16")
    assert parsed == {
        (bucket, metric) for metric in ("requests", "succeeded", "inputs", "tokens", "latency_ms_total")
    }
    # A previous release's field, a "|" in its model's name too: read with a blank variant.
    assert usage.parse_usage_field(f"1|2|{HOUR}|openai|tokens|odd|model") == (
        usage.BucketKey(1, 2, "odd|model", "openai", HOUR),
        "tokens",
    )


def test_a_variant_that_could_not_be_folded_is_not_recorded():
    def variant_of(**fields) -> tuple[str, str]:
        (field, *_) = usage.usage_increments(UsageEvent(1, None, "m", "openai", "rejected", **fields))
        bucket, _ = usage.parse_usage_field(field)
        return bucket.model_version, bucket.model_dtype

    assert variant_of(model_version="3", model_dtype="int8") == ("3", "int8")
    # A separator would shift the model's name; longer than the columns could never be folded.
    assert variant_of(model_version="3", model_dtype="in|t8") == ("3", "")
    assert variant_of(model_version="3", model_dtype="x" * 33) == ("3", "")
    assert variant_of(model_version="latest", model_dtype="int8") == ("", "int8")
    assert variant_of(model_version="1" * 21, model_dtype="int8") == ("", "int8")
    # Read back, such a field is not ours (dropped and logged by the fold, never a failing insert).
    assert usage.parse_usage_field(f"1||{HOUR}|openai|v3|int8|tokens|m") is None
    assert usage.parse_usage_field(f"1||{HOUR}|openai|3|{'x' * 33}|tokens|m") is None
