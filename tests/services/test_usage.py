"""Usage accounting against the real Redis and database: counters, the fold, its crash safety."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from embeddings.models import UsageBucket, UsageFold
from embeddings.redis.connections import redis_sync
from embeddings.services.quotas import usage
from embeddings.services.quotas.limits import quota_release_sync
from embeddings.services.quotas.usage import (
    FOLDING_BATCHES_KEY,
    LIVE_USAGE_KEY,
    UsageEvent,
    usage_fold,
)
from tests.database_backend import wait_for_lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = 1_767_225_600  # 2026-01-01 00:00 UTC
METRICS = ("requests", "succeeded", "rejected", "failed", "inputs", "tokens", "latency_ms_total")


class Interrupted(Exception):
    """Stands for a crash of the fold's process at one point."""


@pytest.fixture
def tenants(service_redis, two_tenants):
    alpha, beta = two_tenants.alpha, two_tenants.beta
    return {"alpha": alpha.tenant, "alpha_key": alpha.api_key, "beta": beta.tenant, "beta_key": beta.api_key}


def record_mix(tenants) -> dict[str, int]:
    """A mix of outcomes, keys, models, endpoints and hours; the totals it adds up to."""
    events = [
        UsageEvent(
            tenants["alpha"].pk, tenants["alpha_key"].pk, "minilm", "openai", "succeeded", 2, 10, 5, HOUR
        ),
        UsageEvent(
            tenants["alpha"].pk, tenants["alpha_key"].pk, "minilm", "openai", "succeeded", 1, 7, 3, HOUR + 60
        ),
        UsageEvent(
            tenants["alpha"].pk, tenants["alpha_key"].pk, "minilm", "openai", "rejected", 4, 0, 1, HOUR + 3600
        ),
        UsageEvent(tenants["alpha"].pk, None, "other|model", "tei", "failed", 3, 12, 40, HOUR),
        UsageEvent(tenants["beta"].pk, tenants["beta_key"].pk, "minilm", "seed", "succeeded", 5, 50, 9, HOUR),
    ]
    for event in events:
        quota_release_sync(reservation=None, refund=False, usage=event)
    return {
        "requests": 5, "succeeded": 3, "rejected": 1, "failed": 1,
        "inputs": 15, "tokens": 79, "latency_ms_total": 58,
    }  # fmt: skip


def database_totals(**filters) -> dict[str, int]:
    sums = UsageBucket.objects.filter(**filters).aggregate(**{metric: Sum(metric) for metric in METRICS})
    return {metric: value or 0 for metric, value in sums.items()}


def redis_is_empty() -> bool:
    client = redis_sync()
    return (
        not client.exists(LIVE_USAGE_KEY)
        and not client.smembers(FOLDING_BATCHES_KEY)
        and not list(client.scan_iter(match="usage:folding:*"))
    )


def test_fold_moves_every_counter_into_buckets(tenants):
    expected = record_mix(tenants)
    result = usage_fold()
    assert result.batches == 1
    assert result.buckets == 4  # alpha key hour 0, alpha key hour 1, alpha keyless, beta
    assert database_totals() == expected
    assert redis_is_empty()
    first = UsageBucket.objects.get(api_key=tenants["alpha_key"], hour=datetime.fromtimestamp(HOUR, UTC))
    assert (first.requests, first.succeeded, first.inputs, first.tokens, first.latency_ms_total) == (
        2, 2, 3, 17, 8,
    )  # fmt: skip
    keyless = UsageBucket.objects.get(tenant=tenants["alpha"], api_key=None)
    assert (keyless.model, keyless.endpoint, keyless.failed, keyless.tokens) == ("other|model", "tei", 1, 12)
    assert database_totals(tenant=tenants["beta"])["tokens"] == 50
    assert UsageFold.objects.get().rows == 4


def test_fold_adds_to_existing_rows_and_twice_counts_nothing_twice(tenants):
    expected = record_mix(tenants)
    usage_fold()
    assert usage_fold().batches == 0  # nothing new: no batch, no UsageFold row
    assert UsageFold.objects.count() == 1
    record_mix(tenants)
    usage_fold()
    usage_fold()
    assert database_totals() == {metric: 2 * amount for metric, amount in expected.items()}
    assert UsageBucket.objects.count() == 4


def _crash(monkeypatch, name: str, *, before: bool) -> None:
    """Make the fold's step `name` raise, before or after doing its work."""
    original = getattr(usage, name)

    def crash(*args, **kwargs):
        if not before:
            original(*args, **kwargs)
        raise Interrupted(name)

    monkeypatch.setattr(usage, name, crash)


@pytest.mark.parametrize(
    ("step", "before", "in_database"),
    [
        ("_claim_live_counters", False, False),  # after the rename, nothing in the database yet
        ("_add_counters_to_buckets", False, False),  # inside the transaction, before the commit
        ("_forget_batch", True, True),  # after the commit, before the batch is deleted in Redis
    ],
)
def test_an_interrupted_fold_loses_nothing_and_counts_nothing_twice(
    tenants, monkeypatch, step, before, in_database
):
    expected = record_mix(tenants)
    with monkeypatch.context() as patched:
        _crash(patched, step, before=before)
        with pytest.raises(Interrupted):
            usage_fold()
    assert redis_sync().smembers(FOLDING_BATCHES_KEY)  # the batch is left over
    assert database_totals() == (expected if in_database else dict.fromkeys(METRICS, 0))
    assert UsageFold.objects.exists() == in_database  # the transaction committed whole, or not at all
    # Counted meanwhile: lands in a new live hash, beside the left-over batch.
    more = record_mix(tenants)
    result = usage_fold()
    assert result.batches == 2
    assert database_totals() == {metric: expected[metric] + more[metric] for metric in METRICS}
    assert redis_is_empty()
    assert usage_fold().batches == 0
    assert database_totals()["requests"] == 10


def test_a_left_over_batch_already_in_the_database_is_only_forgotten(tenants, monkeypatch):
    expected = record_mix(tenants)
    with monkeypatch.context() as patched:
        _crash(patched, "_forget_batch", before=True)
        with pytest.raises(Interrupted):
            usage_fold()
    result = usage_fold()
    assert (result.batches, result.buckets) == (1, 0)
    assert database_totals() == expected
    assert redis_is_empty()


def test_recording_while_folding_loses_nothing(tenants):
    events = 3000
    alpha, key = tenants["alpha"].pk, tenants["alpha_key"].pk
    done = threading.Event()

    def record() -> None:
        try:
            for index in range(events):
                quota_release_sync(
                    reservation=None,
                    refund=False,
                    usage=UsageEvent(alpha, key, "minilm", "openai", "succeeded", 1, index % 7, 0),
                )
        finally:
            done.set()

    recorder = threading.Thread(target=record)
    recorder.start()
    folds = 0
    while not done.is_set():
        usage_fold()
        folds += 1
    recorder.join()
    usage_fold()
    assert folds > 1
    totals = database_totals()
    assert totals["requests"] == totals["succeeded"] == totals["inputs"] == events
    assert totals["tokens"] == sum(index % 7 for index in range(events))


def test_deleted_key_folds_keyless_and_deleted_tenant_is_dropped(tenants, caplog):
    alpha, beta = tenants["alpha"], tenants["beta"]
    key = tenants["alpha_key"]
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha.pk, key.pk, "minilm", "openai", "succeeded", 1, 10, 0, HOUR),
    )
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha.pk, None, "minilm", "openai", "succeeded", 1, 5, 0, HOUR),
    )
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(beta.pk, None, "minilm", "openai", "succeeded", 1, 99, 0, HOUR),
    )
    # Another tenant's key id is not this tenant's key: keyless too, never credited to beta's key.
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha.pk, tenants["beta_key"].pk, "minilm", "openai", "succeeded", 1, 1, 0, HOUR),
    )
    beta_id = beta.pk
    key.delete()
    beta.delete()
    result = usage_fold()
    bucket = UsageBucket.objects.get()
    assert (bucket.tenant_id, bucket.api_key_id, bucket.requests, bucket.tokens) == (alpha.pk, None, 3, 16)
    assert result.dropped == 4  # beta's requests, succeeded, inputs and tokens counters
    assert f"tenant {beta_id} no longer exists" in caplog.text
    assert redis_is_empty()


def test_unreadable_fields_are_dropped_not_fatal(tenants):
    record_mix(tenants)
    redis_sync().hincrby(LIVE_USAGE_KEY, "garbage", 3)
    redis_sync().hincrby(LIVE_USAGE_KEY, f"{tenants['alpha'].pk}||{HOUR}|openai|bogus_metric|minilm", 1)
    result = usage_fold()
    assert result.dropped == 2
    assert database_totals()["requests"] == 5


def test_two_folds_racing_on_one_batch_count_it_once(tenants, monkeypatch, caplog):
    """Fold A has read a batch when fold B folds the same batch and commits: A's transaction fails on
    UsageFold's unique batch id and adds nothing."""
    expected = record_mix(tenants)
    original = usage.counters_from_hash
    raced = []

    def read_then_let_another_fold_finish(*args, **kwargs):
        counters = original(*args, **kwargs)
        if not raced:
            raced.append(True)
            usage_fold()  # fold B, start to end
        return counters

    monkeypatch.setattr(usage, "counters_from_hash", read_then_let_another_fold_finish)
    usage_fold()  # fold A
    assert raced
    assert "was folded by another fold meanwhile" in caplog.text
    assert database_totals() == expected
    assert UsageFold.objects.count() == 1
    assert redis_is_empty()


def test_old_fold_records_are_pruned_unless_their_batch_is_still_in_redis(tenants):
    long_ago = timezone.now() - usage.USAGE_FOLD_RECORDS_KEPT - timedelta(hours=1)
    UsageFold.objects.create(batch_id="done-long-ago", folded_at=long_ago)
    UsageFold.objects.create(batch_id="done-recently")
    # Another fold's batch, committed and not yet deleted from Redis: its record still guards it.
    UsageFold.objects.create(batch_id="still-in-redis", folded_at=long_ago)
    redis_sync().sadd(FOLDING_BATCHES_KEY, "still-in-redis")
    usage._prune_fold_records(redis_sync())
    assert set(UsageFold.objects.values_list("batch_id", flat=True)) == {"done-recently", "still-in-redis"}
    record_mix(tenants)
    usage_fold()  # forgets the other batch (its record exists), folds the new one, prunes
    batch_ids = set(UsageFold.objects.values_list("batch_id", flat=True))
    assert "done-recently" in batch_ids and "still-in-redis" not in batch_ids
    assert len(batch_ids) == 2  # and the record of the fold just made
    assert database_totals()["requests"] == 5


def test_reading_usage_while_a_fold_commits_counts_it_once(tenants, monkeypatch):
    """The fold runs between usage_for_tenant's Redis snapshot and its database read: the snapshot
    holds the counters and the rows now hold them too; the read notices and reads again."""
    record_mix(tenants)
    original = usage._database_rows
    folds = []

    def fold_in_between(*args, **kwargs):
        if not folds:
            folds.append(usage_fold())
        return original(*args, **kwargs)

    monkeypatch.setattr(usage, "_database_rows", fold_in_between)
    report = usage.usage_for_tenant(
        tenant_id=tenants["alpha"].pk,
        start=datetime.fromtimestamp(HOUR, UTC),
        end=datetime.fromtimestamp(HOUR + 7200, UTC),
        group_by="model",
    )
    assert folds and folds[0].batches == 1
    assert report.includes_unfolded
    assert (report.totals["requests"], report.totals["tokens"]) == (4, 29)  # alpha's, once
    assert [(row.group, row.counters["requests"]) for row in report.rows] == [
        ("minilm", 3),
        ("other|model", 1),
    ]


def test_two_folds_of_different_batches_racing_on_a_new_bucket_lose_nothing(
    tenants, monkeypatch, postgresql_only
):
    """Two folds started together each claim a batch of their own, and both batches count the same
    bucket row, which does not exist yet. Fold A has inserted it and waits (a row it updates next is
    locked); fold B's UPDATE cannot see A's uncommitted row, so B inserts too and waits for A. When A
    commits, B's INSERT fails on the unique constraint: B must add to A's row, not drop its batch."""
    alpha = tenants["alpha"].pk
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha, None, "b-model", "openai", "succeeded", 1, 1, 1, HOUR),
    )
    usage_fold()  # the row fold A updates second, and the test locks
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha, None, "a-model", "openai", "succeeded", 2, 20, 3, HOUR),
    )
    quota_release_sync(
        reservation=None,
        refund=False,
        usage=UsageEvent(alpha, None, "b-model", "openai", "succeeded", 1, 1, 1, HOUR),
    )

    claim = usage._claim_live_counters
    both_started = threading.Barrier(2)
    a_waits = threading.Event()

    def claim_in_order(client):
        # Both folds have looked for left-over batches (none) before either claims: A first, then
        # B once A waits inside its transaction and more usage was recorded.
        both_started.wait(timeout=30)
        if threading.current_thread().name == "fold-b":
            assert a_waits.wait(timeout=60)
        return claim(client)

    monkeypatch.setattr(usage, "_claim_live_counters", claim_in_order)
    errors = []

    def fold():
        from django.db import connection

        try:
            usage_fold()
        except Exception as error:
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=fold, name=name) for name in ("fold-a", "fold-b")]
    with transaction.atomic():
        UsageBucket.objects.select_for_update().get(model="b-model")
        threads[0].start()
        threads[1].start()
        wait_for_lock_waiters(1)  # A: the new a-model row inserted, the b-model row locked by us
        quota_release_sync(
            reservation=None,
            refund=False,
            usage=UsageEvent(alpha, None, "a-model", "openai", "succeeded", 5, 50, 7, HOUR),
        )
        a_waits.set()
        wait_for_lock_waiters(2)  # B: inserting the a-model row too, behind A
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert database_totals(model="a-model")["inputs"] == 7
    assert database_totals(model="a-model")["requests"] == 2
    assert database_totals(model="b-model")["requests"] == 2
    assert UsageBucket.objects.filter(model="a-model").count() == 1
    assert redis_is_empty()


def record(event: UsageEvent) -> None:
    quota_release_sync(reservation=None, refund=False, usage=event)


def test_each_variant_of_a_model_folds_into_its_own_row(tenants):
    """A switch from float32 to int8 (version 2 to 3) within one hour: two rows, each with its own
    counters; counters written before variants were recorded (a previous release's field) fold
    into a third row whose variant is blank, and folding again adds to the right rows only."""
    alpha, key = tenants["alpha"].pk, tenants["alpha_key"].pk

    def served(version: str, dtype: str, tokens: int) -> UsageEvent:
        return UsageEvent(
            alpha, key, "minilm", "openai", "succeeded", 1, tokens, 4, HOUR + 60,
            model_version=version, model_dtype=dtype,
        )  # fmt: skip

    record(served("2", "float32", 10))
    record(served("2", "float32", 5))
    record(served("3", "int8", 7))
    redis_sync().hincrby(LIVE_USAGE_KEY, f"{alpha}|{key}|{HOUR}|openai|tokens|minilm", 100)
    redis_sync().hincrby(LIVE_USAGE_KEY, f"{alpha}|{key}|{HOUR}|openai|requests|minilm", 1)

    result = usage_fold()
    record(served("3", "int8", 1))
    usage_fold()

    assert result.dropped == 0
    rows = UsageBucket.objects.filter(tenant_id=alpha).order_by("model_version")
    assert [(r.model_version, r.model_dtype, r.requests, r.tokens, r.api_key_id) for r in rows] == [
        ("", "", 1, 100, key),
        ("2", "float32", 2, 15, key),
        ("3", "int8", 2, 8, key),
    ]
    assert {row.hour for row in rows} == {datetime.fromtimestamp(HOUR, UTC)}
    assert redis_is_empty()


def test_usage_grouped_by_variant_counts_folded_and_unfolded_alike(tenants):
    alpha = tenants["alpha"].pk
    for version, dtype, tokens in (("2", "float32", 10), ("3", "int8", 7), ("10", "int8", 1), ("", "", 2)):
        record(
            UsageEvent(alpha, None, "minilm", "openai", "succeeded", 1, tokens, 0, HOUR,
                       model_version=version, model_dtype=dtype)
        )  # fmt: skip
    # Beta's int8 usage is not alpha's.
    beta_event = UsageEvent(tenants["beta"].pk, None, "minilm", "openai", "succeeded", 1, 99, 0, HOUR)
    record(replace(beta_event, model_version="3", model_dtype="int8"))

    def by_variant() -> list[tuple]:
        report = usage.usage_for_tenant(
            tenant_id=alpha,
            start=datetime.fromtimestamp(HOUR, UTC),
            end=datetime.fromtimestamp(HOUR + 3600, UTC),
            group_by="variant",
        )
        return [(*row.group, row.counters["tokens"]) for row in report.rows]

    expected = [
        ("minilm", "", "", 2),
        ("minilm", "2", "float32", 10),
        ("minilm", "3", "int8", 7),
        ("minilm", "10", "int8", 1),  # versions in numeric order
    ]
    assert by_variant() == expected
    usage_fold()
    assert by_variant() == expected
