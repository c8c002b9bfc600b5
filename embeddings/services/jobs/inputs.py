"""A job's inputs from an uploaded file: plain text (one input per line) or JSONL ({"id", "text"} lines).

Every problem is a `JobInputError` (422) or `JobInputTooLarge` (413) naming the line, raised
before anything is stored, so a bad upload creates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import orjson
from django.conf import settings

from embeddings.callers import Caller
from embeddings.errors.service import InvalidRequest, LimitExceeded

UTF8_BOM = b"\xef\xbb\xbf"


class JobInputError(InvalidRequest):
    """The upload cannot become a job's inputs (the message says where and why): 422."""


class JobInputTooLarge(LimitExceeded):
    """Too many inputs, or a line over the limit: 413."""


@dataclass(frozen=True)
class JobInputs:
    texts: list[str]
    ids: list[str] | None  # the client's ids, in order (JSONL uploads); None for plain text


def job_max_inputs(caller: Caller) -> tuple[int, str]:
    """The most inputs one job of `caller` may have, and whose limit that is: the smaller of its
    key's and its tenant's max_inputs_per_job, JOB_MAX_INPUTS when neither sets one."""
    limits = [
        (limit, who)
        for limit, who in (
            (caller.tenant_limits.max_inputs_per_job, "this tenant"),
            (caller.key_limits.max_inputs_per_job, "this API key"),
        )
        if limit is not None
    ]
    return min(limits, key=lambda pair: pair[0]) if limits else (settings.JOB_MAX_INPUTS, "a job")


def job_inputs_count_check(*, count: int, caller: Caller) -> None:
    """Refuse a job of more inputs than `job_max_inputs` allows (413), JSON body or service call."""
    limit, who = job_max_inputs(caller)
    if count > limit:
        raise JobInputTooLarge(f"{count} inputs in one job; {who} may submit at most {limit}", param="input")


def _decoded(raw: bytes, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JobInputError(f"line {number}: not UTF-8 (byte {error.start + 1})", param="file") from None


def _jsonl_record(line: str, number: int) -> tuple[str, str | None]:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise JobInputError(f"line {number}: not a JSON object", param="file") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise JobInputError(f'line {number}: expected {{"id": ..., "text": "..."}}', param="file")
    if not record["text"]:
        # As a JSON body's "" is refused: an empty text has nothing to embed.
        raise JobInputError(f"line {number}: text is an empty string", param="file")
    identifier = record.get("id")
    if identifier is None:
        return record["text"], None
    if isinstance(identifier, bool) or not isinstance(identifier, str | int):
        raise JobInputError(f"line {number}: id must be a string or an integer", param="file")
    return record["text"], str(identifier)


def job_inputs_parse(
    lines: Iterable[bytes], *, max_inputs: int, max_line_bytes: int, jsonl: bool | None = None
) -> JobInputs:
    """Read an upload line by line (a binary file object is an iterable of lines).

    jsonl: None decides from the first non-blank line (JSONL when it starts with "{").
    Blank lines are skipped; in JSONL every record gets an id (its line number when it has none)
    and ids must be unique.
    """
    texts: list[str] = []
    ids: list[str] = []
    seen_ids: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        if number == 1 and raw.startswith(UTF8_BOM):
            raw = raw[len(UTF8_BOM) :]
        if len(raw.rstrip(b"\r\n")) > max_line_bytes:
            raise JobInputTooLarge(f"line {number}: longer than {max_line_bytes} bytes", param="file")
        line = _decoded(raw, number).rstrip("\r\n")
        if not line.strip():
            continue
        if jsonl is None:
            jsonl = line.lstrip().startswith("{")
        if len(texts) >= max_inputs:
            raise JobInputTooLarge(f"more than {max_inputs} inputs (at line {number})", param="file")
        if not jsonl:
            texts.append(line)
            continue
        text, identifier = _jsonl_record(line, number)
        identifier = identifier if identifier is not None else str(number)
        if identifier in seen_ids:
            raise JobInputError(f"line {number}: id {identifier!r} appears twice", param="file")
        seen_ids.add(identifier)
        texts.append(text)
        ids.append(identifier)
    if not texts:
        raise JobInputError("the file has no inputs", param="file")
    return JobInputs(texts=texts, ids=ids if jsonl else None)
