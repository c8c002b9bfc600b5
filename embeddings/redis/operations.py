"""Typed Redis operations of quotas, usage and jobs, each written once as a generator.

Run one with `operation_run_sync(operation, client)` or `await operation_run(operation)`
(embeddings.redis.transport). Keys come from embeddings.redis.keys, scripts from
embeddings.redis.scripts; what the numbers mean (windows, plans, refusals) is the services' policy.
Replies are raw RESP from the asyncio transport and redis-py's parsed ones from the blocking one:
each operation reads both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from embeddings.redis import keys, scripts
from embeddings.redis.transport import Command, Operation, PackedRun, ScriptCall


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pairs(reply) -> list[tuple]:
    """HGETALL's reply as (field, value) pairs: a dict (redis-py) or a flat list (raw)."""
    if isinstance(reply, dict):
        return list(reply.items())
    return list(zip(reply[::2], reply[1::2], strict=True))


def _increment_arguments(increments: Mapping[str, int]) -> list:
    arguments: list = []
    for field, amount in increments.items():
        arguments += [field, amount]
    return arguments


# --- Quotas ----------------------------------------------------------------------------------------


def quota_reserve(*, plan_keys: PackedRun, head: Sequence, tail: PackedRun) -> Operation[list[int]]:
    """Admit one request to its rate cells, budget counters and lease sets if all have room
    (QUOTA_RESERVE).

    `plan_keys`: cells, counters, then lease sets; `head` and `tail` the script's ARGV before and
    after the per-request part. Returns [admitted, each cell's TAT ahead of the clock (µs), each
    counter before, each set's live leases].
    """
    reply = yield ScriptCall(scripts.QUOTA_RESERVE, (plan_keys,), (*head, tail))
    return [int(value) for value in _text(reply).split(",")]


@dataclass(frozen=True)
class CounterHash:
    """Increments to one hash of counters that deletes itself at `expire_at` (epoch seconds)."""

    key: str
    expire_at: int
    increments: Mapping[str, int]


def quota_settle(
    *,
    refunds: Sequence[tuple[str, int]] = (),
    lease_sets: Sequence[str] = (),
    lease_member: str = "",
    usage: Mapping[str, int] | None = None,
    counters: Sequence[CounterHash] = (),
) -> Operation[None]:
    """Refund to cells (µs) and counters (tokens), drop a lease from its sets, count usage and add
    to the expiring `counters` hashes, in one round trip."""
    usage = usage or {}
    script_keys = [key for key, _ in refunds] + list(lease_sets) + [keys.LIVE_USAGE]
    script_keys += [counter.key for counter in counters]
    arguments = [len(refunds), lease_member, len(counters), *(amount for _, amount in refunds)]
    arguments += [len(usage), *_increment_arguments(usage)]
    for counter in counters:
        arguments += [len(counter.increments), counter.expire_at, *_increment_arguments(counter.increments)]
    yield ScriptCall(scripts.QUOTA_SETTLE, script_keys, arguments)


def quota_refund_once(*, job_id: str, counters: Sequence[str], amount: int, ttl_s: int) -> Operation[bool]:
    """Refund `amount` to each counter unless the job's reservation was settled before."""
    reply = yield ScriptCall(
        scripts.QUOTA_REFUND_ONCE, [keys.job_settled(job_id), *counters], [ttl_s, amount]
    )
    return reply == 1


def quota_forget_settled(job_id: str) -> Operation[None]:
    yield Command.of("DEL", keys.job_settled(job_id))


@dataclass(frozen=True)
class QuotaState:
    clock_us: int  # Redis's clock
    arrivals_us: list[int]  # each cell's TAT (0: none, its bucket is full)
    counts: list[int]  # each counter (0 for a counter not created yet)
    live: list[int]  # each lease set's leases alive at now_ms


def quota_state(
    cells: Sequence[str], counters: Sequence[str], lease_sets: Sequence[str], *, now_ms: int
) -> Operation[QuotaState]:
    """The cells, counters and lease sets as they stand, and Redis's clock, in one round trip."""
    commands = [Command.of("GET", key) for key in (*cells, *counters)]
    commands += [Command.of("ZCOUNT", key, f"({now_ms}", "+inf") for key in lease_sets]
    commands.append(Command.of("TIME"))
    values = yield commands
    seconds, microseconds = values[-1]
    numbers = [int(value or 0) for value in values[:-1]]
    return QuotaState(
        clock_us=int(seconds) * 1_000_000 + int(microseconds),
        arrivals_us=numbers[: len(cells)],
        counts=numbers[len(cells) : len(cells) + len(counters)],
        live=numbers[len(cells) + len(counters) :],
    )


def counter_hashes_read(names: Sequence[str]) -> Operation[list[list[tuple]]]:
    """Each hash's (field, value) pairs, in one round trip ([] for a hash that is gone)."""
    replies = yield [Command.of("HGETALL", name) for name in names]
    return [_pairs(reply) for reply in replies]


# --- Usage -----------------------------------------------------------------------------------------


def usage_count_once(*, owner: str, unit: int, increments: Mapping[str, int], ttl_s: int) -> Operation[bool]:
    """Add `increments` unless unit `unit` of `owner` was counted before; True if counted now."""
    arguments = [unit, int(ttl_s), *_increment_arguments(increments)]
    reply = yield ScriptCall(
        scripts.USAGE_COUNT_ONCE, [keys.usage_counted(owner), keys.LIVE_USAGE], arguments
    )
    return reply == 1


def usage_count_forget(*, owner: str, units: Sequence[int]) -> Operation[None]:
    """Forget that `units` of `owner` were counted: each counts once more, once."""
    if units:
        yield ScriptCall(scripts.USAGE_COUNT_FORGET, [keys.usage_counted(owner)], list(units))


def usage_fold_batches() -> Operation[list[str]]:
    """The ids of batches claimed and not yet forgotten, sorted."""
    members = yield Command.of("SMEMBERS", keys.FOLDING_BATCHES)
    return sorted(_text(member) for member in members)


def usage_fold_claim(batch_id: str) -> Operation[bool]:
    """Move the live counters into batch `batch_id`; False when nothing was counted since."""
    batch_keys = [keys.LIVE_USAGE, keys.usage_batch(batch_id), keys.FOLDING_BATCHES]
    return (yield ScriptCall(scripts.USAGE_CLAIM, batch_keys, [batch_id])) == 1


def usage_fold_read(batch_id: str) -> Operation[list[tuple]]:
    """A batch's (field, amount) pairs."""
    return _pairs((yield Command.of("HGETALL", keys.usage_batch(batch_id))))


def usage_fold_forget(batch_id: str) -> Operation[None]:
    """Forget a batch (after its counters were committed to the database)."""
    yield ScriptCall(scripts.USAGE_FORGET, [keys.usage_batch(batch_id), keys.FOLDING_BATCHES], [batch_id])


def usage_snapshot() -> Operation[tuple[list[tuple], dict[str, list[tuple]]]]:
    """The live counters and every unfinished batch's, read at one instant."""
    snapshot_keys = [keys.LIVE_USAGE, keys.FOLDING_BATCHES]
    out = yield ScriptCall(scripts.USAGE_SNAPSHOT, snapshot_keys, [keys.FOLDING_PREFIX])
    live, rest = out[0], out[1:]
    batches = {
        _text(batch_id): _pairs(fields) for batch_id, fields in zip(rest[::2], rest[1::2], strict=True)
    }
    return _pairs(live), batches


# --- Jobs (the job store) --------------------------------------------------------------------------


def job_chunk_finish(
    *,
    job_id: str,
    chunk: int,
    payload: bytes,
    ttl_s: int,
    rows: int,
    tokens: int,
    counter: str,
    increments: bytes,
    cached_tokens: int = 0,
    error: str = "",
) -> Operation[bool]:
    """Write a chunk's result, progress (its tokens, and of them those the embedding cache answered)
    and usage increments once, and a failed chunk's error; False if it was finished before."""
    chunk_keys = [
        keys.job_key(job_id, "done"),
        keys.job_chunk_key(job_id, "out", chunk),
        keys.job_key(job_id, "progress"),
        keys.job_key(job_id, "uncounted"),
        keys.job_key(job_id, "failed"),
        keys.job_key(job_id, "errors"),
    ]
    arguments = [chunk, payload, ttl_s, rows, tokens, counter, increments, cached_tokens, error]
    return (yield ScriptCall(scripts.JOB_CHUNK_FINISH, chunk_keys, arguments)) == 1


# Keys whose life is their own, not the job's: the progress events' rate limit lives half a second.
_SHORT_LIVED_JOB_KEYS = frozenset({"event"})


def job_extend(job_id: str, chunks: int, ttl_s: int) -> Operation[None]:
    """Make every job store key of the job (keys.job_keys) live at least `ttl_s` from now: EXPIRE GT
    only lengthens, and a missing key stays missing. A thousand keys per round trip."""
    names = [keys.job_key(job_id, kind) for kind in keys.JOB_KINDS if kind not in _SHORT_LIVED_JOB_KEYS]
    names += [keys.job_chunk_key(job_id, kind, chunk) for chunk in range(chunks) for kind in keys.CHUNK_KINDS]
    for start in range(0, len(names), 1000):
        yield [Command.of("EXPIRE", name, int(ttl_s), "GT") for name in names[start : start + 1000]]


def job_markers_extend(job_id: str, ttl_s: int, *, retry_rounds: int = 0) -> Operation[None]:
    """The job's markers in the critical Redis (usage counted once, its reservation and its retry
    rounds' settled) live at least `ttl_s` from now, as long as the job's data they guard."""
    markers = [keys.usage_counted(job_id), keys.job_settled(job_id)]
    markers += [keys.job_settled(keys.job_retry_settlement(job_id, n)) for n in range(1, retry_rounds + 1)]
    yield [Command.of("EXPIRE", name, int(ttl_s), "GT") for name in markers]


def job_delete(job_id: str, chunks: int) -> Operation[None]:
    """Delete every job store key of the job (keys.job_keys), a thousand per command."""
    names = keys.job_keys(job_id, chunks)
    for start in range(0, len(names), 1000):
        yield Command.of("DEL", *names[start : start + 1000])
