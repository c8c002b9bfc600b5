"""deploy/grafana's dashboard and deploy/prometheus's alert rules: they load, and every metric they
name exists in the /metrics of the service as shipped (uvicorn with two workers, summed), the
embedding cache's in that of one with the cache on."""

from __future__ import annotations

import json
import re

import httpx2
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.processes import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
MODEL = "all-MiniLM-L6-v2"
# Grafana's interval variables, replaced as Grafana replaces them before sending a query.
GRAFANA_INTERVALS = re.compile(r"\$__(?:rate_interval|interval|range)\b")


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects, read from its syntax tree (promql-parser,
    which refuses an expression Prometheus would refuse)."""
    tree = promql_parser.parse(GRAFANA_INTERVALS.sub("5m", expression))
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(tree, visit)
    return names


def dashboard_expressions() -> dict[str, list[str]]:
    found = {}
    for path in sorted((DEPLOY / "grafana").glob("*.json")):
        dashboard = json.loads(path.read_text())
        expressions = []
        panels = dashboard["panels"]
        assert len({panel["id"] for panel in panels}) == len(panels), f"{path.name}: panel ids repeat"
        for panel in panels:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            expressions += [target["expr"] for target in panel["targets"]]
        found[path.name] = expressions
    return found


def alert_expressions() -> dict[str, list[str]]:
    found = {}
    for path in sorted((DEPLOY / "prometheus").glob("*.yml")):
        rules = [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
        for rule in rules:
            assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule
            assert rule["annotations"]["summary"], rule
        found[path.name] = [rule["expr"] for rule in rules]
    return found


def test_metric_names_are_read_from_promql():
    assert metric_names(
        "histogram_quantile(0.99, sum by (le, endpoint) "
        '(rate(a_seconds_bucket{endpoint=~"x|y"}[$__rate_interval])))'
        " / clamp_min(sum(rate(b_total[5m])), 1e-9) > 0.5 and c_gauge offset 5m"
    ) == {"a_seconds_bucket", "b_total", "c_gauge"}
    with pytest.raises(ValueError):
        metric_names("sum(rate(a_total[5m])")


def test_the_files_name_the_alerts_and_panels_the_issue_asks_for():
    groups = yaml.safe_load((DEPLOY / "prometheus/embedsite-alerts.yml").read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"]}
    assert alerts == {
        "EmbedsiteHighErrorRate",
        "EmbedsiteSlowRequestsP99",
        "EmbedsiteManyRateLimited",
        "EmbedsiteTritonUnavailable",
        "EmbedsiteJobBacklog",
    }
    assert sum(map(len, dashboard_expressions().values())) >= 15


def served_names(server) -> set[str]:
    """The sample names in the server's /metrics, after an embedding request, so every label set an
    embedding makes exists."""
    answer = httpx2.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": MODEL, "input": ["hello"]},
        headers=server.headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    scraped = httpx2.get(f"{server.base_url}/metrics", timeout=30)
    assert scraped.status_code == 200
    return {
        sample.name for family in text_string_to_metric_families(scraped.text) for sample in family.samples
    }


# The figures of the embedding cache's Redis, read at the scrape only with EMBEDDING_CACHE on: checked
# against `cache_server` below.
CACHE_REDIS_FIGURES = "embedsite_embedding_cache_redis_"


def test_every_metric_the_dashboard_and_alerts_name_is_served(uvicorn_server):
    expressions = {**dashboard_expressions(), **alert_expressions()}
    assert set(expressions) == {"embedsite.json", "embedsite-alerts.yml"}
    served = served_names(uvicorn_server)
    missing = {
        f"{source}: {name}"
        for source, exprs in expressions.items()
        for expression in exprs
        for name in metric_names(expression)
        if name not in served and not name.startswith(CACHE_REDIS_FIGURES)
    }
    assert not missing, sorted(missing)
    named = {
        name for exprs in expressions.values() for expression in exprs for name in metric_names(expression)
    }
    assert {
        "embedsite_request_seconds_bucket",
        "embedsite_queue_seconds_bucket",
        "embedsite_jobs_active",
    } <= named


def test_every_cache_metric_the_dashboard_names_is_served_with_the_cache_on(cache_server):
    named = {
        name
        for expression in dashboard_expressions()["embedsite.json"]
        for name in metric_names(expression)
        if name.startswith("embedsite_embedding_cache_")
    }
    # The issue's panels: hit ratio, latency, failures, evictions (both tiers), the Redis's memory.
    assert named == {
        "embedsite_embedding_cache_rows_total",
        "embedsite_embedding_cache_seconds_bucket",
        "embedsite_embedding_cache_failures_total",
        "embedsite_embedding_cache_evictions_total",
        "embedsite_embedding_cache_redis_evicted_keys_total",
        "embedsite_embedding_cache_redis_memory_used_bytes",
        "embedsite_embedding_cache_redis_memory_max_bytes",
        "embedsite_embedding_cache_redis_up",
    }
    assert sorted(named - served_names(cache_server)) == []


def test_the_job_backlog_is_served_for_every_active_status(uvicorn_server):
    scraped = httpx2.get(f"{uvicorn_server.base_url}/metrics", timeout=30).text
    families = {family.name: family for family in text_string_to_metric_families(scraped)}
    statuses = {sample.labels["status"] for sample in families["embedsite_jobs_active"].samples}
    assert statuses == {"queued", "running", "cancelling"}
    (pending,) = families["embedsite_job_inputs_pending"].samples
    assert pending.value >= 0
