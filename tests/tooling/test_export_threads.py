"""EXPORT_THREADS: the cores an export's own computing takes (embeddings/tooling/export_threads.py)."""

from __future__ import annotations

import pytest

from embeddings.services.inference.exports import ModelExportError
from embeddings.tooling.export_threads import EXPORT_THREADS_VARIABLE, export_threads


@pytest.mark.parametrize(("value", "threads"), [("", 0), ("0", 0), ("1", 1), (" 4 ", 4)])
def test_a_whole_number_of_threads_or_the_libraries_default(monkeypatch, value, threads):
    monkeypatch.setenv(EXPORT_THREADS_VARIABLE, value)
    assert export_threads() == threads


def test_unset_is_the_libraries_default(monkeypatch):
    monkeypatch.delenv(EXPORT_THREADS_VARIABLE, raising=False)
    assert export_threads() == 0


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "1e3"])
def test_anything_else_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(EXPORT_THREADS_VARIABLE, value)
    with pytest.raises(ModelExportError, match=f"EXPORT_THREADS must be a whole number.*{value!r}"):
        export_threads()


def test_the_exports_sessions_take_that_many_threads(monkeypatch):
    from embeddings.tooling.export_threads import cpu_session
    from tests.conftest import require_exported_model
    from tests.processes import REPO_ROOT

    model = require_exported_model(REPO_ROOT / "model_repository")
    monkeypatch.setenv(EXPORT_THREADS_VARIABLE, "3")
    assert cpu_session(model).get_session_options().intra_op_num_threads == 3
