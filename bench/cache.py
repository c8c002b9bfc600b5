"""The embedding cache's benchmark (issue 35): throughput and latency with and without it, one run.

Run: `make bench-cache` (or `.venv/bin/python bench/cache.py [--quick] [--rounds 2] [--seconds 15]
[--hot-texts 1024] [--repeats 0,0.5,0.9] [--py-spy DIR]`). On the stack bench/configs.py measures
(Triton, both redis-servers, SQLite, quotas on with limits that never refuse, `manage.py serve
--workers 1`), wrk posts 32 x 8 short texts (32 connections, 8 texts a request, base64) to
/v1/embeddings with 0 %, 50 % and 90 % of the rows repeated, once with EMBEDDING_CACHE=false and
once with true, configurations interleaved round after round (the order reversed every other
round, A B B A, so a drift of the machine's load reaches each alike). `--py-spy` records the
measured server's stacks, a file per cell.

The workload: each row is drawn at random, with the cell's repeat fraction, from a pool of "hot"
texts that the cache already holds (posted through a second server before the cell, so they are in
its Redis but not in the measured process's LRU: the first hit of each comes from Redis, the later
ones from the LRU), or else is a text never sent before: wrk's Lua builds it from a counter of its
own, so no unique text repeats anywhere in the run. Every text is eight words of the peer
benchmark's vocabulary spelling a number in base 38, its size (~10 tokens, as peers.py's short
texts); each cell, wrk thread and hot pool numbers its texts in a range of its own. The 0 % cell
is the cost of a miss: with the cache on, every row is looked up (one MGET) and written (one
pipeline of SET), and found nowhere.

Before each cell the cache's entries are deleted from its Redis (the stack's job store; SCAN and
DEL of the cache's key prefix) and the measured server is started fresh, so no cell inherits
another's entries. Each cell reports embeddings and requests per second, wrk's p50/p99, the web
process's CPU and the cache Redis's CPU per request, how many rows reached Triton and its compute
time per execution (at equal rows an execution costs the same cached or not: where it rises, the
model was starved of CPU), the cores that something outside the bench took meanwhile (the
machine's busy time less this process tree's, as bench/gpu.py reads them), and where the server's
/metrics says each row was found (`embedsite_embedding_cache_rows_total{result}`, read before and
after) beside the share wrk actually drew from the hot pool. Then, per repeat fraction, on / off
from the means of the rounds, each round's, and, with three rounds or more, at no other load
(each configuration's line of emb/s against the other load's cores, at zero); and the issue's two
ratios: a miss's cost, (off at 0 %) / (on at 0 %) - 1, and the speed-up at 90 %, on / off.
Writes bench/results/cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
import redis
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from api import REAL_MODEL, Server, shipped_stack  # noqa: E402
from configs import start_profiler  # noqa: E402
from gpu import machine_busy_seconds, process_tree_cpu_seconds  # noqa: E402
from peers import SHORT_WORDS, Shape, parse_wrk, probe, wrk_script  # noqa: E402
from triton_client import WORDS  # noqa: E402
from triton_stats import triton_counts, triton_delta  # noqa: E402

from embeddings.services.inference.vector_cache import KEY_PREFIX  # noqa: E402
from embeddings.tooling.triton_server import free_port  # noqa: E402

SHAPE = Shape("32 x 8", 32, 8, SHORT_WORDS)
CONFIGS = (("off", {"EMBEDDING_CACHE": "false"}), ("on", {"EMBEDDING_CACHE": "true"}))
WRK_THREADS = 2
WARM_UP_REQUESTS = 3
WARM_BATCH = 32
# A text's number: (cell, stream) in the high part, a counter of that stream below it. Stream 0 is
# the hot pool, 1 the warm-up requests, 2.. wrk's threads; eight words of the vocabulary hold them all.
COUNTER_BITS = 28
STREAMS = 8
HOT_STREAM, WARM_UP_STREAM, FIRST_WRK_STREAM = 0, 1, 2
ROWS_RESULTS = ("local", "redis", "miss")
MIN_CELLS_FOR_FIT = 3


def text_for(number: int) -> str:
    """Eight words spelling `number` in base len(WORDS), lowest digit first (as the Lua does)."""
    words = []
    for _ in range(SHORT_WORDS):
        number, digit = divmod(number, len(WORDS))
        words.append(WORDS[digit])
    if number:
        raise ValueError("a text number beyond eight words")
    return " ".join(words)


def stream_base(cell: int, stream: int) -> int:
    return (cell * STREAMS + stream) << COUNTER_BITS


def stream_texts(cell: int, stream: int, count: int) -> list[str]:
    return [text_for(stream_base(cell, stream) + counter) for counter in range(count)]


def lua_string(text: str) -> str:
    return json.dumps(text)  # our texts and JSON are plain ASCII: a JSON string is a Lua one


def workload_script(cell: int, repeat: float, hot: list[str], headers: dict[str, str]) -> str:
    """peers.py's wrk script (headers, the RESULT line) with a body built per request: each row a
    random hot text with probability `repeat`, else the thread's next never-sent text; a ROWS line
    at the end says how many of each wrk sent."""
    prefix = json.dumps({"model": REAL_MODEL, "encoding_format": "base64", "input": []})[:-2] + '"'
    sample = {"model": REAL_MODEL, "encoding_format": "base64", "input": hot[:1] or ["x"]}
    return (
        wrk_script(sample, headers)
        + f"""
local WORDS = {{{", ".join(map(lua_string, WORDS))}}}
local HOT = {{{", ".join(map(lua_string, hot))}}}
local REPEAT, ROWS, WORD_COUNT = {repeat!r}, {SHAPE.texts_per_request}, {SHORT_WORDS}
local PREFIX, SUFFIX = {lua_string(prefix)}, '"]}}'

local threads, next_stream = {{}}, {FIRST_WRK_STREAM}
setup = function(thread)
  thread:set("stream", next_stream)
  next_stream = next_stream + 1
  table.insert(threads, thread)
end

local counter, base = 0, 0
hot_rows, unique_rows = 0, 0
init = function(args)
  base = ({cell} * {STREAMS} + stream) * {2**COUNTER_BITS}
  math.randomseed(stream)
end

local function text_for(number)
  local words = {{}}
  for i = 1, WORD_COUNT do
    local digit = number % #WORDS
    words[i] = WORDS[digit + 1]
    number = (number - digit) / #WORDS
  end
  return table.concat(words, " ")
end

request = function()
  local texts = {{}}
  for i = 1, ROWS do
    if math.random() < REPEAT then
      texts[i] = HOT[math.random(#HOT)]
      hot_rows = hot_rows + 1
    else
      texts[i] = text_for(base + counter)
      counter = counter + 1
      unique_rows = unique_rows + 1
    end
  end
  return wrk.format(nil, nil, nil, PREFIX .. table.concat(texts, '", "') .. SUFFIX)
end

local print_result = done
done = function(summary, latency, requests)
  print_result(summary, latency, requests)
  local hot, unique = 0, 0
  for _, thread in ipairs(threads) do
    hot = hot + thread:get("hot_rows")
    unique = unique + thread:get("unique_rows")
  end
  io.write(string.format("ROWS %d %d\\n", hot, unique))
end
"""
    )


def run_wrk(url: str, script: str, seconds: float, workdir: Path) -> dict:
    path = workdir / "cache.lua"
    path.write_text(script)
    output = subprocess.run(
        ["wrk", "-t", str(WRK_THREADS), "-c", str(SHAPE.clients), "-d", f"{int(seconds)}s",
         "--timeout", "120s", "-s", str(path), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    cell = parse_wrk(output, SHAPE.texts_per_request)
    rows = next(line for line in output.splitlines() if line.startswith("ROWS")).split()
    cell.update(hot_rows_sent=int(rows[1]), unique_rows_sent=int(rows[2]))
    return cell


def cache_flush(client: redis.Redis) -> int:
    """Delete every embedding-cache entry from its Redis; how many there were."""
    deleted = 0
    batch = []
    for key in client.scan_iter(match=KEY_PREFIX + b"*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            deleted += client.delete(*batch)
            batch.clear()
    if batch:
        deleted += client.delete(*batch)
    return deleted


def cache_entries(client: redis.Redis) -> int:
    return sum(1 for _ in client.scan_iter(match=KEY_PREFIX + b"*", count=1000))


def redis_cpu_seconds(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def cache_counts(url: str) -> dict[str, float]:
    """The server's cache counters from /metrics: rows by result, failed operations."""
    counts = {result: 0.0 for result in ROWS_RESULTS} | {"lookup_failures": 0.0, "write_failures": 0.0}
    text = httpx2.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "embedsite_embedding_cache_rows_total":
                counts[sample.labels["result"]] = sample.value
            elif sample.name == "embedsite_embedding_cache_failures_total":
                counts[f"{sample.labels['operation']}_failures"] = sample.value
    return counts


def warm_hot_pool(url: str, hot: list[str], headers: dict[str, str]) -> None:
    with httpx2.Client(headers=headers, timeout=120) as http:
        for start in range(0, len(hot), WARM_BATCH):
            body = {
                "model": REAL_MODEL,
                "input": hot[start : start + WARM_BATCH],
                "encoding_format": "base64",
            }
            http.post(f"{url}/v1/embeddings", json=body).raise_for_status()


def bench_cpu_seconds() -> float:
    """CPU of this process and all it started (Triton, the redis-servers, the servers, wrk)."""
    return process_tree_cpu_seconds(os.getpid())


def measure_cell(
    env: dict[str, str], headers: dict[str, str], triton_http: str, cache: redis.Redis, warmer: Server,
    *, cell: int, repeat: float, hot_texts: int, seconds: float, workdir: Path, profile: Path | None,
) -> dict:  # fmt: skip
    """One cell on a fresh server over a cache Redis holding only this cell's hot pool."""
    flushed = cache_flush(cache)
    hot = stream_texts(cell, HOT_STREAM, hot_texts) if repeat > 0 else []
    if hot:
        warm_hot_pool(warmer.url, hot, headers)
    entries = cache_entries(cache)
    server = Server(env, free_port())
    try:
        url = f"{server.url}/v1/embeddings"
        # A fresh server's first requests load the tokenizer, the catalog and the key: not measured.
        warm_up = stream_texts(cell, WARM_UP_STREAM, WARM_UP_REQUESTS * SHAPE.texts_per_request)
        for start in range(0, len(warm_up), SHAPE.texts_per_request):
            texts = warm_up[start : start + SHAPE.texts_per_request]
            probe(url, {"model": REAL_MODEL, "input": texts, "encoding_format": "base64"}, headers)
        counts_before = cache_counts(server.url)
        stats_before, redis_before = triton_counts(triton_http), redis_cpu_seconds(cache)
        cpu_before = server.cpu_seconds()
        machine_before, bench_before, started = machine_busy_seconds(), bench_cpu_seconds(), time.monotonic()
        profiler = None if profile is None else start_profiler(server.process.pid, seconds, profile)
        result = run_wrk(url, workload_script(cell, repeat, hot, headers), seconds, workdir)
        if profiler is not None:
            profiler.wait(timeout=60)
        cpu = server.cpu_seconds() - cpu_before
        machine, bench = machine_busy_seconds() - machine_before, bench_cpu_seconds() - bench_before
        other_load = (machine - bench) / (time.monotonic() - started)
        redis_cpu = redis_cpu_seconds(cache) - redis_before
        result.update(triton_delta(stats_before, triton_counts(triton_http)))
        counts_after = cache_counts(server.url)
    finally:
        server.stop()
    requests = max(result["requests"], 1)
    counts = {name: counts_after[name] - counts_before[name] for name in counts_before}
    looked_up = sum(counts[name] for name in ROWS_RESULTS)
    sent = result["hot_rows_sent"] + result["unique_rows_sent"]
    result.update(
        repeat=repeat,
        requests_per_s=result["requests"] / result["seconds"],
        web_cpu_ms_per_request=cpu * 1000 / requests,
        redis_cpu_ms_per_request=redis_cpu * 1000 / requests,
        other_load_cores=other_load,
        triton_rows_per_request=result["rows_per_execution"] * result["triton_executions"] / requests,
        drawn_repeat=result["hot_rows_sent"] / sent if sent else 0.0,
        cache_rows=counts,
        hit_ratio={name: counts[name] / looked_up for name in ROWS_RESULTS} if looked_up else None,
        entries_deleted_before=flushed,
        entries_at_start=entries,
    )
    return result


def format_cell(cell: dict) -> str:
    hits = cell["hit_ratio"]
    found = (
        " / ".join(f"{100 * hits[name]:.1f}" for name in ROWS_RESULTS)
        if hits is not None
        else "not looked up"
    )
    failures = cell["cache_rows"]["lookup_failures"] + cell["cache_rows"]["write_failures"]
    errors = f" | {cell['errors']} ERRORS" if cell["errors"] else ""
    return (
        f"| {cell['config']} | {100 * cell['repeat']:.0f} % | {cell['round']} | {cell['emb_per_s']:.0f} | "
        f"{cell['requests_per_s']:.0f} | {cell['p50_ms']:.0f} | {cell['p99_ms']:.0f} | "
        f"{cell['web_cpu_ms_per_request']:.2f} | {cell['redis_cpu_ms_per_request']:.3f} | "
        f"{cell['triton_rows_per_request']:.2f} | {cell['compute_infer_ms_per_execution']:.0f} | "
        f"{100 * cell['drawn_repeat']:.1f} | {found} | {cell['other_load_cores']:.2f} | "
        f"{failures:.0f}{errors} |"
    )


TABLE_HEADER = (
    "| cache | repeated | round | emb/s | requests/s | p50 ms | p99 ms | web CPU ms/request | "
    "Redis CPU ms/request | Triton rows/request | Triton ms/execution | drawn repeated % | "
    "local / redis / miss % | other load, cores | cache failures |\n"
    "| --- |" + " ---: |" * 14
)


def mean_of(cells: list[dict], config: str, repeat: float, field: str) -> float:
    return statistics.fmean(c[field] for c in cells if c["config"] == config and c["repeat"] == repeat)


def round_ratios(cells: list[dict], repeat: float) -> list[float]:
    """Each round's on / off at `repeat`: the two cells of a round run back to back, so the spread of
    these says how far the machine's drift reaches the mean's ratio."""
    rounds = sorted({c["round"] for c in cells})
    by_round = {(c["config"], c["round"]): c["emb_per_s"] for c in cells if c["repeat"] == repeat}
    return [by_round["on", r] / by_round["off", r] for r in rounds]


def unloaded_emb_per_s(cells: list[dict], config: str, repeat: float) -> float | None:
    """Embeddings/s with nothing else on the machine: the line through the configuration's cells,
    emb/s against the cores other load took (on the shared 2-core machine they lie on one, r about
    -0.98), at zero. None below MIN_CELLS_FOR_FIT cells or when the other load never varied."""
    picked = [c for c in cells if c["config"] == config and c["repeat"] == repeat]
    if len(picked) < MIN_CELLS_FOR_FIT:
        return None
    try:
        fit = statistics.linear_regression(
            [c["other_load_cores"] for c in picked], [c["emb_per_s"] for c in picked]
        )
    except statistics.StatisticsError:
        return None
    return fit.intercept


def ratios(cells: list[dict], repeats: list[float]) -> dict:
    """Per repeat fraction, cache on's throughput over off's (means of the rounds; each round's; and
    at no other load, where there are cells enough); the miss cost from each."""
    result = {}
    for repeat in repeats:
        name = f"on_over_off_{100 * repeat:.0f}"
        on, off = mean_of(cells, "on", repeat, "emb_per_s"), mean_of(cells, "off", repeat, "emb_per_s")
        result[name] = on / off
        result[f"{name}_per_round"] = round_ratios(cells, repeat)
        on, off = unloaded_emb_per_s(cells, "on", repeat), unloaded_emb_per_s(cells, "off", repeat)
        result[f"{name}_unloaded"] = on / off if on and off else None
    if 0.0 in repeats:
        result["miss_cost"] = 1 / result["on_over_off_0"] - 1
        unloaded = result["on_over_off_0_unloaded"]
        result["miss_cost_unloaded"] = 1 / unloaded - 1 if unloaded else None
    return result


def format_summary(cells: list[dict], repeats: list[float]) -> str:
    fields = ("emb_per_s", "p50_ms", "p99_ms", "web_cpu_ms_per_request")
    summary = ratios(cells, repeats)
    lines = ["| repeated | off emb/s | on emb/s | on / off | each round's | at no other load | "
             "off p50 / p99 ms | on p50 / p99 ms | web CPU ms/request off / on |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for repeat in repeats:
        off, on = (
            {field: mean_of(cells, config, repeat, field) for field in fields} for config in ("off", "on")
        )
        name = f"on_over_off_{100 * repeat:.0f}"
        unloaded = summary[f"{name}_unloaded"]
        lines.append(
            f"| {100 * repeat:.0f} % | {off['emb_per_s']:.0f} | {on['emb_per_s']:.0f} | "
            f"{summary[name]:.2f} | "
            f"{', '.join(f'{ratio:.2f}' for ratio in summary[f'{name}_per_round'])} | "
            f"{'-' if unloaded is None else f'{unloaded:.2f}'} | "
            f"{off['p50_ms']:.0f} / {off['p99_ms']:.0f} | {on['p50_ms']:.0f} / {on['p99_ms']:.0f} | "
            f"{off['web_cpu_ms_per_request']:.2f} / {on['web_cpu_ms_per_request']:.2f} |"
        )
    if "miss_cost" in summary:
        unloaded = summary["miss_cost_unloaded"]
        at_rest = "" if unloaded is None else f", at no other load {100 * unloaded:+.1f} %"
        lines.append(
            f"\nmiss cost (off / on at 0 % - 1): {100 * summary['miss_cost']:+.1f} %{at_rest} (aim <= 5 %)"
        )
    if "on_over_off_90" in summary:
        unloaded = summary["on_over_off_90_unloaded"]
        at_rest = "" if unloaded is None else f", at no other load {unloaded:.2f}x"
        lines.append(
            f"speed-up at 90 % repeated (on / off): {summary['on_over_off_90']:.2f}x{at_rest} (aim >= 3x)"
        )
    return "\n".join(lines)


def parse_repeats(text: str) -> list[float]:
    repeats = [float(part) for part in text.split(",")]
    if any(not 0 <= repeat < 1 for repeat in repeats):
        raise argparse.ArgumentTypeError("repeat fractions are in [0, 1)")
    return repeats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3-second cells, one round")
    parser.add_argument("--rounds", type=int, help="rounds of all cells (default 2, --quick 1)")
    parser.add_argument("--seconds", type=float, help="seconds per cell (default 15, --quick 3)")
    parser.add_argument("--hot-texts", type=int, default=1024, help="texts in the repeated pool")
    parser.add_argument("--repeats", type=parse_repeats, default=[0.0, 0.5, 0.9],
                        help="repeated fractions, comma-separated (default 0,0.5,0.9)")  # fmt: skip
    parser.add_argument("--py-spy", type=Path, dest="py_spy",
                        help="py-spy stacks of the measured server, a file per cell, here")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache.json")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.seconds = args.seconds or (3.0 if args.quick else 15.0)
    if args.seconds < 1:
        parser.error("--seconds must be at least 1 (wrk counts whole seconds)")
    return args


def main() -> None:
    args = parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/cache.py needs wrk: apt-get install wrk (make bench-cache installs it)")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "embedsite.settings")
    order = [(config, repeat) for repeat in args.repeats for config in CONFIGS]
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="embedsite-bench-cache-") as tmp:
        workdir = Path(tmp)
        with shipped_stack(workdir) as (env, key, triton):
            # Named, though it is the default: the bench empties this server between cells.
            env = {**env, "EMBEDDING_CACHE_REDIS_URL": env["JOB_STORE_URL"]}
            headers = {"Authorization": f"Bearer {key}"}
            cache = redis.Redis.from_url(env["EMBEDDING_CACHE_REDIS_URL"])
            warmer = Server({**env, "EMBEDDING_CACHE": "true"}, free_port())
            try:
                print(TABLE_HEADER, flush=True)
                for round_number in range(1, args.rounds + 1):
                    for (name, overrides), repeat in order if round_number % 2 else order[::-1]:
                        profile = None
                        if args.py_spy is not None:
                            args.py_spy.mkdir(parents=True, exist_ok=True)
                            profile = args.py_spy / f"{name}-{100 * repeat:.0f}-r{round_number}.txt"
                        cell = measure_cell(
                            {**env, **overrides}, headers, triton.http_url, cache, warmer,
                            cell=len(cells), repeat=repeat, hot_texts=args.hot_texts,
                            seconds=args.seconds, workdir=workdir, profile=profile,
                        )  # fmt: skip
                        cell.update(config=name, round=round_number)
                        cells.append(cell)
                        print(format_cell(cell), flush=True)
            finally:
                warmer.stop()
                cache.close()
    print()
    print(format_summary(cells, args.repeats))
    result = {
        "cells": cells,
        "ratios": ratios(cells, args.repeats),
        "shape": SHAPE.name,
        "seconds_per_cell": args.seconds,
        "rounds": args.rounds,
        "hot_texts": args.hot_texts,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
