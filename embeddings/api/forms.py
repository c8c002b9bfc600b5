"""Multipart forms, as the upload endpoints read them (/v1/jobs uploads, /v1/files)."""

from __future__ import annotations

from collections.abc import Collection

from embeddings.errors.answers import ValidationFailed


def form_fields(form, *, known: Collection[str]) -> dict[str, object]:
    """Each field of a multipart form (the first value of one it does not know). A field it reads
    must come once: a repeated one (two `file` parts, two `model`s) is refused rather than one of
    them silently dropped."""
    fields: dict[str, object] = {}
    for name, values in form.lists():
        if len(values) > 1 and name in known:
            raise ValidationFailed(f"{name}: sent {len(values)} times in the form; send it once", param=name)
        fields[name] = values[0]
    return fields
