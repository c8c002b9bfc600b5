"""A small stdlib HTTP client for the jobs API (/v1/jobs): used by `manage.py embed_file` and
bench/jobs.py. Uploads and downloads stream in fixed-size blocks, so memory stays constant whatever
the file's size. Nothing Django in it."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from embeddings.errors import EmbedsiteError

BLOCK_BYTES = 1024 * 1024
FINISHED_STATUSES = frozenset({"completed", "failed", "cancelled", "expired"})


class JobsApiError(EmbedsiteError):
    """The API refused (status is its HTTP status) or could not be reached (status 0)."""

    def __init__(self, message: str, *, status: int = 0, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class JobsClient:
    base_url: str
    api_key: str
    timeout_s: float = 60.0  # per socket operation (connect, each read), not for a whole download

    def _request(
        self, method: str, path: str, *, data=None, headers: dict[str, str] | None = None
    ) -> urllib.request.Request:
        url = self.base_url.rstrip("/") + path
        if urllib.parse.urlsplit(url).scheme not in {"http", "https"}:
            raise JobsApiError(f"{self.base_url!r} is not an http(s) URL")
        headers = {"Authorization": f"Bearer {self.api_key}", **(headers or {})}
        return urllib.request.Request(url, data=data, headers=headers, method=method)

    def _open(self, request: urllib.request.Request):
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            with error:
                raise _api_error(error.code, error.read(64 * 1024)) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise JobsApiError(f"cannot reach {self.base_url}: {reason}") from error

    def _json(self, method: str, path: str, **kwargs) -> dict:
        with self._open(self._request(method, path, **kwargs)) as response:
            return json.loads(response.read())

    def submit_file(self, path: Path, *, model: str, options: dict[str, str] | None = None) -> dict:
        """POST /v1/jobs as a multipart upload of the file at `path` (streamed, not read into memory)."""
        content_type = "application/jsonl" if path.suffix.lower() in {".jsonl", ".ndjson"} else "text/plain"
        boundary = f"embedsite-{secrets.token_hex(16)}"
        fields = {"model": model, **(options or {})}
        head = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
            for name, value in fields.items()
        )
        filename = path.name.replace('"', "_").replace("\r", "_").replace("\n", "_")
        head += (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n"
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        length = len(head) + path.stat().st_size + len(tail)

        def body() -> Iterator[bytes]:
            yield head
            with path.open("rb") as file:
                while block := file.read(BLOCK_BYTES):
                    yield block
            yield tail

        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(length)}
        return self._json("POST", "/v1/jobs", data=body(), headers=headers)

    def job(self, job_id: str) -> dict:
        return self._json("GET", f"/v1/jobs/{urllib.parse.quote(job_id)}")

    def cancel(self, job_id: str) -> dict:
        return self._json("POST", f"/v1/jobs/{urllib.parse.quote(job_id)}/cancel", data=b"")

    def download(
        self, job_id: str, out: Path, *, result_format: str, encoding_format: str | None = None
    ) -> int:
        """Stream the job's results to `out` (written to `<out>.part`, renamed when whole); the bytes."""
        query = {"format": result_format}
        if encoding_format:
            query["encoding_format"] = encoding_format
        path = f"/v1/jobs/{urllib.parse.quote(job_id)}/results?{urllib.parse.urlencode(query)}"
        partial = out.with_name(out.name + ".part")
        written = 0
        try:
            with self._open(self._request("GET", path)) as response, partial.open("wb") as file:
                while block := response.read(BLOCK_BYTES):
                    file.write(block)
                    written += len(block)
            os.replace(partial, out)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return written


def _api_error(status: int, body: bytes) -> JobsApiError:
    """The OpenAI-shaped error body's message, or the start of whatever came back."""
    try:
        error = json.loads(body)["error"]
        return JobsApiError(f"{status}: {error['message']}", status=status, code=error.get("code"))
    except (ValueError, KeyError, TypeError):
        return JobsApiError(f"{status}: {body[:200].decode('utf-8', 'replace')}", status=status)
