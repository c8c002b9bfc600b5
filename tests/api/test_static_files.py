"""Static files as uvicorn serves them (WhiteNoise): content-hashed names cached for a year, gzip and
Brotli by Accept-Encoding, conditional requests, and nothing outside STATIC_ROOT."""

import gzip
import re

import brotli
import httpx2
import pytest
from django.conf import settings

from tests.api.raw_http import RawHttp

ONE_YEAR_IMMUTABLE = "max-age=315360000, public, immutable"


@pytest.fixture(scope="module")
def stylesheet(uvicorn_server) -> tuple[str, bytes]:
    """The admin's base.css as its login page names it (hashed), and the collected file's bytes."""
    page = httpx2.get(f"{uvicorn_server.base_url}/admin/login/", timeout=30)
    assert page.status_code == 200
    match = re.search(r'href="(/static/admin/css/base\.[0-9a-f]{12}\.css)"', page.text)
    assert match, "the login page names no content-hashed base.css"
    url = match.group(1)
    return url, (settings.STATIC_ROOT / url.removeprefix("/static/")).read_bytes()


def fetch(server, path: str, **headers: str) -> httpx2.Response:
    # The raw bytes as sent: httpx would undo the compression this test is about.
    with httpx2.stream("GET", f"{server.base_url}{path}", headers=headers, timeout=30) as response:
        response.raw_body = b"".join(response.iter_raw())
    return response


@pytest.mark.parametrize(
    ("accept_encoding", "content_encoding", "decode"),
    [("br", "br", brotli.decompress), ("gzip", "gzip", gzip.decompress), ("identity", None, bytes)],
)
def test_hashed_files_compressed_and_cached_for_a_year(
    uvicorn_server, stylesheet, accept_encoding, content_encoding, decode
):
    url, original = stylesheet
    response = fetch(uvicorn_server, url, **{"Accept-Encoding": accept_encoding})
    assert response.status_code == 200
    assert response.headers.get("content-encoding") == content_encoding
    assert decode(response.raw_body) == original
    if content_encoding:
        assert len(response.raw_body) < len(original) / 2
    assert response.headers["cache-control"] == ONE_YEAR_IMMUTABLE
    assert response.headers["content-type"].startswith("text/css")
    assert "Accept-Encoding" in response.headers["vary"]


def test_unhashed_name_is_served_but_cached_briefly(uvicorn_server):
    response = fetch(uvicorn_server, "/static/admin/css/base.css")
    assert response.status_code == 200
    assert "immutable" not in response.headers["cache-control"]


def test_a_revalidation_costs_no_body(uvicorn_server, stylesheet):
    url, _ = stylesheet
    first = fetch(uvicorn_server, url)
    again = fetch(uvicorn_server, url, **{"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.raw_body == b""


def test_bundles_compressed_but_their_source_maps_sent_as_they_are(uvicorn_server):
    """Only developer tools fetch a source map; compressing them was half of collectstatic's time."""
    swagger = "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js"
    bundle = fetch(uvicorn_server, swagger, **{"Accept-Encoding": "br"})
    assert bundle.status_code == 200 and bundle.headers.get("content-encoding") == "br"
    source_map = fetch(uvicorn_server, f"{swagger}.map", **{"Accept-Encoding": "br, gzip"})
    assert source_map.status_code == 200 and "content-encoding" not in source_map.headers
    assert source_map.raw_body.startswith(b"{") and b'"mappings"' in source_map.raw_body
    compressed_maps = [*settings.STATIC_ROOT.rglob("*.map.br"), *settings.STATIC_ROOT.rglob("*.map.gz")]
    assert not compressed_maps


def test_every_compressed_copy_is_its_files_bytes_and_twins_are_compressed_alike():
    """collectstatic compresses each distinct content once and copies the result to the files with
    the same bytes (embedsite/static_files.py): each .br and .gz decompresses to its own file, and
    files of one content have the same compressed siblings."""
    decoders = {".br": brotli.decompress, ".gz": gzip.decompress}
    siblings_by_content: dict[bytes, set[tuple[str, bytes]]] = {}
    for path in settings.STATIC_ROOT.rglob("*"):
        if not path.is_file() or path.suffix in decoders:
            continue
        content = path.read_bytes()
        siblings = set()
        for suffix, decode in decoders.items():
            compressed = path.with_name(path.name + suffix)
            if compressed.exists():
                assert decode(compressed.read_bytes()) == content, compressed
                siblings.add((suffix, compressed.read_bytes()))
        siblings_by_content.setdefault(content, siblings)
        assert siblings_by_content[content] == siblings, path
    assert sum(1 for _ in settings.STATIC_ROOT.rglob("*.br")) > 100


@pytest.mark.parametrize(
    "path",
    [
        "/static/admin/css/missing.css",
        "/static/../embedsite/settings.py",
        "/static/..%2f..%2fembedsite%2fsettings.py",
        "/static/staticfiles.json/../../secret_key",
        "/static/%00",
    ],
)
def test_nothing_outside_the_collected_files(uvicorn_server, path):
    # Sent as written (a client library would normalise the dots away).
    with RawHttp(uvicorn_server) as connection:
        connection.head("GET", path, {})
        status, _, body = connection.answer()
    assert status in {400, 404}, body
    assert b"SECRET_KEY" not in body and settings.SECRET_KEY.encode() not in body
