"""Every Redis key embedsite writes: its layout, type and lifetime, and the one function that names it.

Nobody else formats a key string: a key's shape changes here or nowhere. Two servers (README "Job
store and critical Redis"): the critical Redis (REDIS_URL) and the job store (JOB_STORE_URL, by
default the same server). Braces are Redis Cluster hash tags: every key one script touches shares
one, so the script stays on one slot. Times: `<start>` is a window's start in epoch seconds.

Critical Redis (REDIS_URL)

    key                                   type     TTL                       written by
    quota:{t<tenant>}:t:rate:<r>          string   until the bucket is full  quota reserve (r: rps,
    quota:{t<tenant>}:k<key>:rate:<r>     string   + 1 s                     rpm, tpm; the rate's
                                                                             theoretical arrival time,
                                                                             µs, Redis clock), settle
    quota:{t<tenant>}:t:<w>:<start>       string   rest of window + 60 s     quota reserve (w: tpd,
    quota:{t<tenant>}:k<key>:<w>:<start>  string   rest of window + 60 s     tpmo), settle
    quota:{t<tenant>}:t:concurrent        zset     QUOTA_LEASE_SECONDS + 1 s quota reserve (member:
    quota:{t<tenant>}:k<key>:concurrent   zset     QUOTA_LEASE_SECONDS + 1 s a lease, score: expiry ms)
    usage:live                            hash     none (folded away)        quota settle, count once
    usage:folding:<batch id>              hash     none (deleted after fold) usage fold (claim)
    usage:folding-batches                 set      none                      usage fold
    usage:counted:{<job id>}              bitmap   the job's TTL             usage count once (a bit
                                                                             per chunk)
    job:{<job id>}:settled                string   the job's TTL             job refund (once marker;
    job:{<job id>:retry<n>}:settled                                          a retry round's own)
    jobs:{t<tenant>}:submit               string   30 s (a redis-py Lock)    job submission lock
    activity:models:<minute>              hash     12 minutes after it ends  quota settle (each request's
                                                                             model counters: the admin's
                                                                             operations overview)
    activity:refusals:<minute>            hash     61 minutes after it ends  quota settle of a request a
                                                                             limit refused (429)

The usage hash's fields are
"<tenant>|<key or empty>|<hour epoch>|<endpoint>|<version>|<dtype>|<metric>|<model>"
(embeddings.services.quotas.usage). The activity hashes' (embeddings.services.quotas.activity):
"<metric>|<model>" and "<tenant>|<level>|<limit>"; `<minute>` is epoch seconds // 60. Celery's broker
and the channel layer keep their own keys there.

Job store (JOB_STORE_URL); the job's TTL is JOB_RESULT_TTL_S + 1 day, or a day past an expires_at
an operator moved later (expiry deletes it first)

    key                          type     TTL          holds
    job:{<id>}:in:<chunk>        string   job's TTL    orjson list of the chunk's texts (deleted
                                                       when the job ends; a failed job's failed
                                                       chunks' stay, for a retry)
    job:{<id>}:ids:<chunk>       string   job's TTL    orjson list of the client's ids (JSONL)
    job:{<id>}:out:<chunk>       string   job's TTL    the chunk's vectors (float32 or float16 bytes)
    job:{<id>}:done              set      job's TTL    finished chunk numbers
    job:{<id>}:progress          hash     job's TTL    completed, failed, tokens, chunks_done
    job:{<id>}:uncounted         hash     job's TTL    chunk -> usage increments not yet counted
    job:{<id>}:reservation       string   job's TTL    orjson list of the reserved token counters
    job:{<id>}:cancel            string   job's TTL    present once the job is cancelled
    job:{<id>}:next              string   job's TTL    the next chunk number to hand out
    job:{<id>}:handoff           hash     job's TTL    chunk -> 1 once it handed out its successor
    job:{<id>}:event             string   0.5 s        progress events' rate limit (SET NX PX)
    job:{<id>}:sent              hash     job's TTL    chunk -> when handed out (ms, Redis clock)
    job:{<id>}:lease             hash     job's TTL    chunk -> "<deadline ms> <host>:<pid>"
    job:{<id>}:runs              hash     job's TTL    chunk -> how often its embedding started
    job:{<id>}:started           hash     job's TTL    chunk -> when it last started (ms)
    job:{<id>}:failed            set      job's TTL    chunks counted failed
    job:{<id>}:errors            hash     job's TTL    chunk -> its last error (a failure, or a
                                                       retry's cause), for operators
    job:{<id>}:events            list     job's TTL    its last JOB_EVENTS_KEPT events, oldest first
                                                       (orjson {at, event, detail}: state changes,
                                                       chunk failures, re-sends, operators' acts)
    job:{<id>}:requeue           list     job's TTL    failed chunks an operator re-opened: handed
                                                       out, as successors, once `next` is spent
    job:{<id>}:retry             hash     job's TTL    retry round (1, 2, ...) -> orjson of what it
                                                       reserved, settled once at the job's next end

`job_keys` lists every job store key of a job, so deleting a job forgets none of them.
"""

from __future__ import annotations

from typing import Literal, get_args

Level = Literal["tenant", "key"]

# --- Critical Redis --------------------------------------------------------------------------------

LIVE_USAGE = "usage:live"
FOLDING_BATCHES = "usage:folding-batches"
FOLDING_PREFIX = "usage:folding:"


def quota_scope(*, tenant_id: int, key_id: int | None, level: Level) -> str:
    """The prefix of one level's quota keys (the tenant's, or one of its API keys')."""
    tag = f"quota:{{t{tenant_id}}}"
    return f"{tag}:t" if level == "tenant" else f"{tag}:k{key_id}"


def quota_rate(scope: str, *, rate: str) -> str:
    """A rate's cell (GCRA): `rate` is the rate's short name (rps, rpm, tpm)."""
    return f"{scope}:rate:{rate}"


def quota_counter(scope: str, *, window: str, start: int) -> str:
    """A budget window counter: `window` is the window's short name (tpd, tpmo)."""
    return f"{scope}:{window}:{start}"


def quota_leases(scope: str) -> str:
    """The concurrent-requests lease set of one level."""
    return f"{scope}:concurrent"


def activity_models(minute: int) -> str:
    """One minute's per-model counters of every process (requests, tokens, errors, latency)."""
    return f"activity:models:{int(minute)}"


def activity_refusals(minute: int) -> str:
    """One minute's requests refused by a limit, per tenant, level and limit."""
    return f"activity:refusals:{int(minute)}"


def usage_batch(batch_id: str) -> str:
    """A claimed batch of usage counters, between the claim and the fold's commit."""
    return FOLDING_PREFIX + batch_id


def usage_counted(owner: str) -> str:
    """The bitmap of an owner's (a job's) units whose usage was counted."""
    return f"usage:counted:{{{owner}}}"


def job_settled(job_id: str) -> str:
    """The marker that a job's reservation was settled (beside the counters it refunds)."""
    return f"job:{{{job_id}}}:settled"


def job_retry_settlement(job_id: str, round_number: int) -> str:
    """Who settles a job's retry round: its own once-marker (job_settled) beside the job's."""
    return f"{job_id}:retry{int(round_number)}"


def job_submit_lock(tenant_id: int) -> str:
    return f"jobs:{{t{tenant_id}}}:submit"


# --- Job store -------------------------------------------------------------------------------------

JobKind = Literal[
    "done",
    "progress",
    "uncounted",
    "reservation",
    "cancel",
    "next",
    "handoff",
    "event",
    "sent",
    "lease",
    "runs",
    "started",
    "failed",
    "errors",
    "events",
    "requeue",
    "retry",
]
ChunkKind = Literal["in", "ids", "out"]
JOB_KINDS: tuple[JobKind, ...] = get_args(JobKind)
CHUNK_KINDS: tuple[ChunkKind, ...] = get_args(ChunkKind)


def job_key(job_id: str, kind: JobKind) -> str:
    """One of a job's keys in the job store (the table above)."""
    if kind not in JOB_KINDS:
        raise ValueError(f"no job key {kind!r}")
    return f"job:{{{job_id}}}:{kind}"


def job_chunk_key(job_id: str, kind: ChunkKind, chunk: int) -> str:
    """One chunk's texts (in), ids or vectors (out)."""
    if kind not in CHUNK_KINDS:
        raise ValueError(f"no chunk key {kind!r}")
    return f"job:{{{job_id}}}:{kind}:{int(chunk)}"


def job_keys(job_id: str, chunks: int) -> list[str]:
    """Every job store key a job of `chunks` chunks can have."""
    names = [job_key(job_id, kind) for kind in JOB_KINDS]
    for chunk in range(chunks):
        names += [job_chunk_key(job_id, kind, chunk) for kind in CHUNK_KINDS]
    return names
