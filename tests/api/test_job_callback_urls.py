"""POST /v1/jobs with a callback_url the address policy refuses: 422 `callback_url` with the reason
and no job, as JSON and as a multipart form field, in process and through the real uvicorn (whose
own resolver sees only literal addresses and localhost here). Nothing is ever connected to."""

from __future__ import annotations

import httpx2
import pytest
from asgiref.sync import sync_to_async

from embeddings.models import EmbeddingJob

MODEL = "all-MiniLM-L6-v2"

REFUSED = [
    ("http://127.0.0.1:6390/", "127.0.0.1 is not a public address (loopback)"),  # Redis
    ("http://127.0.0.1:8080/admin/", "127.0.0.1 is not a public address (loopback)"),
    ("http://[::1]:8080/", "::1 is not a public address (loopback)"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is not a public address (link-local)"),
    ("http://0177.0.0.1/", "ambiguous spelling of an IPv4 address"),
    ("http://2130706433/", "ambiguous spelling of an IPv4 address"),
    ("http://[::ffff:127.0.0.1]:6390/", "IPv4-mapped form of 127.0.0.1: loopback"),
    ("http://good.example@127.0.0.1/", "credentials"),
    # 127.0.0.1 or ::1, as the machine's /etc/hosts says: either one is loopback.
    ("http://localhost:6390/", "localhost resolves to * which is not a public address (loopback)"),
    ("https://10.1.2.3/hook", "10.1.2.3 is not a public address (private, RFC 1918)"),
    ("ftp://example.com/done", "the scheme must be http or https"),
]


def job_body(url: str) -> dict:
    return {"model": MODEL, "input": ["alpha", "beta"], "callback_url": url}


def assert_refused(response, reason: str) -> None:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "callback_url" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("callback_url: "), error
    assert all(part in error["message"] for part in reason.split("*")), error


@pytest.mark.parametrize(("url", "reason"), REFUSED)
async def test_refused_callback_urls_are_422_and_create_no_job(client, alpha, url, reason):
    assert_refused(await client.post("/v1/jobs", headers=alpha.headers, json=job_body(url)), reason)
    upload = await client.post(
        "/v1/jobs",
        headers=alpha.headers,
        files={"file": ("texts.txt", b"one\ntwo\n", "text/plain")},
        data={"model": MODEL, "callback_url": url},
    )
    assert_refused(upload, reason)
    assert await sync_to_async(EmbeddingJob.objects.count)() == 0


async def test_a_name_that_does_not_resolve_is_422(client, alpha):
    response = await client.post("/v1/jobs", headers=alpha.headers, json=job_body("https://0.com/hook"))
    assert_refused(response, "0.com does not resolve")


async def test_a_name_resolving_to_a_private_address_is_422(client, alpha, fake_dns):
    fake_dns.set("hooks.corp.example", ["93.184.215.14", "10.20.0.5"])
    response = await client.post(
        "/v1/jobs", headers=alpha.headers, json=job_body("https://hooks.corp.example/")
    )
    assert_refused(
        response, "hooks.corp.example resolves to 10.20.0.5, which is not a public address (private"
    )


async def test_an_allowed_loopback_target_is_accepted(client, alpha, settings):
    settings.JOB_CALLBACK_ALLOWED_NETWORKS = ("127.0.0.1/32",)
    response = await client.post("/v1/jobs", headers=alpha.headers, json=job_body("http://127.0.0.1:9/hook"))
    assert response.status_code == 202, response.text
    job = await sync_to_async(EmbeddingJob.objects.get)(public_id=response.json()["id"])
    assert job.callback_url == "http://127.0.0.1:9/hook"
    # Only the network named: another loopback address is still refused.
    other = await client.post("/v1/jobs", headers=alpha.headers, json=job_body("http://127.0.0.2:9/hook"))
    assert_refused(other, "127.0.0.2 is not a public address (loopback)")


async def test_a_public_target_is_accepted_without_being_contacted(client, alpha, fake_dns):
    fake_dns.set("hooks.example", ["93.184.215.14"])
    response = await client.post("/v1/jobs", headers=alpha.headers, json=job_body("https://hooks.example/in"))
    assert response.status_code == 202, response.text
    assert fake_dns.lookups == ["hooks.example"]


@pytest.mark.parametrize(("url", "reason"), REFUSED[:5] + REFUSED[8:9])
def test_refused_through_the_real_server(uvicorn_server, url, reason):
    with httpx2.Client(base_url=uvicorn_server.base_url, headers=uvicorn_server.headers, timeout=30) as http:
        assert_refused(http.post("/v1/jobs", json=job_body(url)), reason)
        upload = http.post(
            "/v1/jobs",
            files={"file": ("texts.txt", b"one\ntwo\n", "text/plain")},
            data={"model": MODEL, "callback_url": url},
        )
        assert_refused(upload, reason)
