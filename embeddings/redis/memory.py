"""What a Redis server holds against its limit: INFO memory and stats, read in one round trip.

One reader for every server embedsite talks to (the critical Redis, the job store, the embedding
cache): /metrics exports the cache's figures, the admin's operations overview shows all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis


def redis_info(client: redis.Redis) -> dict:
    """INFO memory and INFO stats merged, in one round trip (raises redis.exceptions.RedisError)."""
    with client.pipeline(transaction=False) as pipeline:
        memory, stats = pipeline.info("memory").info("stats").execute()
    return {**memory, **stats}


@dataclass(frozen=True)
class RedisMemory:
    used_bytes: int
    peak_bytes: int
    max_bytes: int  # maxmemory; 0: no limit, the server grows until the machine runs out
    policy: str  # maxmemory-policy: noeviction refuses writes when full, the others evict keys
    evicted_keys: int  # since the server started
    fragmentation_ratio: float

    @classmethod
    def of(cls, info: dict) -> RedisMemory:
        return cls(
            used_bytes=int(info.get("used_memory", 0)),
            peak_bytes=int(info.get("used_memory_peak", 0)),
            max_bytes=int(info.get("maxmemory", 0)),
            policy=str(info.get("maxmemory_policy", "")),
            evicted_keys=int(info.get("evicted_keys", 0)),
            fragmentation_ratio=float(info.get("mem_fragmentation_ratio", 0.0)),
        )

    @property
    def percent_of_max(self) -> float | None:
        """Used memory as a percentage of maxmemory; None when there is no limit."""
        return 100.0 * self.used_bytes / self.max_bytes if self.max_bytes else None


def redis_memory(client: redis.Redis) -> RedisMemory:
    """The server's memory against its limit (raises redis.exceptions.RedisError)."""
    return RedisMemory.of(redis_info(client))
