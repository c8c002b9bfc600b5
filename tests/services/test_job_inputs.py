"""Job uploads: plain text and JSONL parsed line by line; every bad file refused with the line named."""

from __future__ import annotations

import io

import pytest

from embeddings.callers import Caller, QuotaLimitValues
from embeddings.services.jobs.inputs import (
    JobInputError,
    JobInputTooLarge,
    job_inputs_count_check,
    job_inputs_parse,
    job_max_inputs,
)

pytestmark = pytest.mark.unit


def parse(data: bytes, **kwargs):
    options = {"max_inputs": 100, "max_line_bytes": 1000, **kwargs}
    return job_inputs_parse(io.BytesIO(data), **options)


def test_plain_text_one_input_per_line_blank_lines_skipped():
    parsed = parse(b"first line\r\nsecond\n\n  \nthird")
    assert parsed.texts == ["first line", "second", "third"]
    assert parsed.ids is None


def test_a_utf8_bom_is_dropped_and_unicode_kept():
    assert parse("\ufeffcafé ☕\nnaïve".encode()).texts == ["café ☕", "naïve"]


def test_jsonl_keeps_ids_and_numbers_missing_ones_by_line():
    data = b'{"id": "a", "text": "alpha"}\n{"id": 7, "text": "beta"}\n\n{"text": "gamma"}\n'
    parsed = parse(data)
    assert parsed.texts == ["alpha", "beta", "gamma"]
    assert parsed.ids == ["a", "7", "4"]


def test_jsonl_can_be_forced_or_refused():
    assert parse(b'{"text": "x"}', jsonl=False).texts == ['{"text": "x"}']
    with pytest.raises(JobInputError, match="line 1: not a JSON object"):
        parse(b"plain", jsonl=True)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"ok\n\xff\xfe broken\n", "line 2: not UTF-8"),
        (b"", "the file has no inputs"),
        (b"\n \n\r\n", "the file has no inputs"),
        (b'{"id": "a", "text": "x"}\nnot json\n', "line 2: not a JSON object"),
        (b'{"id": "a", "text": 3}\n', 'line 1: expected {"id": ..., "text": "..."}'),
        (b'{"id": "a", "text": "x"}\n{"id": "b", "text": ""}\n', "line 2: text is an empty string"),
        (b'{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "line 2: id 'a' appears twice"),
        (b'{"id": [1], "text": "x"}\n', "line 1: id must be a string or an integer"),
        (b'{"id": true, "text": "x"}\n', "line 1: id must be a string or an integer"),
    ],
)
def test_bad_files_name_the_problem(data, message):
    with pytest.raises(JobInputError) as refused:
        parse(data)
    assert message in refused.value.message
    assert refused.value.param == "file"


def test_limits_are_413_errors():
    with pytest.raises(JobInputTooLarge, match="more than 3 inputs"):
        parse(b"a\nb\nc\nd\n", max_inputs=3)
    assert len(parse(b"a\nb\nc\n", max_inputs=3).texts) == 3
    with pytest.raises(JobInputTooLarge, match="line 2: longer than 10 bytes"):
        parse(b"short\n" + b"x" * 11 + b"\n", max_line_bytes=10)
    assert parse(b"x" * 10 + b"\r\n", max_line_bytes=10).texts == ["x" * 10]


@pytest.mark.parametrize(
    ("tenant_limit", "key_limit", "expected"),
    [
        (None, None, (1000, "a job")),
        (50, None, (50, "this tenant")),
        (None, 20, (20, "this API key")),
        (50, 20, (20, "this API key")),
        (10, 20, (10, "this tenant")),
    ],
)
def test_a_jobs_inputs_are_capped_by_the_smaller_of_key_and_tenant(
    settings, tenant_limit, key_limit, expected
):
    settings.JOB_MAX_INPUTS = 1000
    caller = Caller(
        1,
        2,
        QuotaLimitValues(max_inputs_per_job=tenant_limit),
        QuotaLimitValues(max_inputs_per_job=key_limit),
    )
    assert job_max_inputs(caller) == expected
    limit, who = expected
    job_inputs_count_check(count=limit, caller=caller)
    with pytest.raises(JobInputTooLarge) as refused:
        job_inputs_count_check(count=limit + 1, caller=caller)
    assert refused.value.message == f"{limit + 1} inputs in one job; {who} may submit at most {limit}"
    assert refused.value.param == "input"
