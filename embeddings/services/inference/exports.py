"""The finished exports in a Triton model repository: their versions, files and export.json, read
and checked. What serving reads; writing an export is embeddings/tooling/model_export.py's."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Literal

from embeddings.errors import EmbedsiteError

# last: the last real token of each row (right padding), for models trained that way.
Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("mean", "cls", "last")

MODEL_FILENAME = "model.onnx"
TOKENIZER_FILENAME = "tokenizer.json"
EXPORT_INFO_FILENAME = "export.json"
# An embedding model's vectors of the calibration corpus: int8/uint8 ranges (inference/quantization.py).
CALIBRATION_FILENAME = "calibration.npy"
# A Triton model name is a directory name and a quoted string in the config: keep it plain.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# The graph's weights: export.json's "dtype" (absent in exports made before int8: float32). The
# others are variants of an export's float32 graph, export.json's record under their name saying
# how well they agree with it.
DTYPE_FLOAT32 = "float32"
DTYPE_INT8 = "int8"
DTYPE_FLOAT16 = "float16"
DTYPES: tuple[str, ...] = (DTYPE_FLOAT32, DTYPE_INT8, DTYPE_FLOAT16)


def model_name_is_valid(name: str) -> bool:
    return isinstance(name, str) and MODEL_NAME_PATTERN.fullmatch(name) is not None


class ModelExportError(EmbedsiteError):
    """The source is unusable or the exported graph does not match the PyTorch reference."""


class ModelExportMismatch(ModelExportError):
    """The model.onnx in place is not the one its export.json describes (replaced, or half-written)."""


def model_version_number(version: int | str) -> int:
    """A Triton version as a number; the catalog keeps it as text ("3")."""
    if isinstance(version, str) and version.isascii() and version.isdigit():
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ModelExportError(f"a model version is a whole number from 1, not {version!r}")
    return version


def _is_finished(version_dir: Path) -> bool:
    # export.json is written last, after model.onnx and the tokenizer.
    return all(
        (version_dir / filename).is_file()
        for filename in (MODEL_FILENAME, TOKENIZER_FILENAME, EXPORT_INFO_FILENAME)
    )


def model_export_dir(repository_dir: Path, name: str) -> Path:
    # The name becomes a path: nothing that could leave the repository.
    if not model_name_is_valid(name):
        raise ModelExportError(f"invalid model name {name!r}: letters, digits, '_', '.', '-' only")
    return Path(repository_dir) / name


def model_export_versions(*, repository_dir: Path, name: str) -> list[int]:
    """The finished exported versions of model `name`, oldest first."""
    model_dir = model_export_dir(repository_dir, name)
    if not model_dir.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in model_dir.iterdir()
        # Triton reads version folders as plain decimal numbers.
        if entry.name.isascii()
        and entry.name.isdigit()
        and entry.name == str(int(entry.name))
        and int(entry.name) >= 1
        and _is_finished(entry)
    )


def model_export_latest(repository_dir: Path, name: str) -> int | None:
    versions = model_export_versions(repository_dir=repository_dir, name=name)
    return versions[-1] if versions else None


def model_export_dtype(info: dict) -> str:
    """An export's dtype as its export.json records it; float32 when it predates the record."""
    return info.get("dtype") or DTYPE_FLOAT32


def dtype_with_article(dtype: str) -> str:
    """The dtype with its article ("a float32", "an int8"), for messages naming an export's."""
    return f"{'an' if dtype[:1].lower() in 'aeiou' else 'a'} {dtype}"


def model_export_dtypes(*, repository_dir: Path, name: str) -> dict[int, str]:
    """Each finished version of model `name` -> its dtype, oldest first (an unreadable export.json
    left out). export.json only: the model.onnx checks are model_export_info's, for the one served."""
    dtypes = {}
    for version in model_export_versions(repository_dir=repository_dir, name=name):
        info_path = model_export_dir(repository_dir, name) / str(version) / EXPORT_INFO_FILENAME
        try:
            dtypes[version] = model_export_dtype(json.loads(info_path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return dtypes


def model_export_latest_of_dtype(*, repository_dir: Path, name: str, dtype: str) -> int | None:
    """The newest finished version of model `name` whose export.json records `dtype`; None when none does."""
    versions = model_export_dtypes(repository_dir=repository_dir, name=name)
    return max((version for version, found in versions.items() if found == dtype), default=None)


def model_export_version_dir(*, repository_dir: Path, name: str, version: int | str) -> Path:
    return model_export_dir(repository_dir, name) / str(model_version_number(version))


def model_export_path(*, repository_dir: Path, name: str, version: int | str | None = None) -> Path:
    """model.onnx of `version`; without one, of the latest finished version (version 1 when none is)."""
    if version is None:
        version = model_export_latest(repository_dir, name) or 1
    return (
        model_export_version_dir(repository_dir=repository_dir, name=name, version=version) / MODEL_FILENAME
    )


def model_export_exists(*, repository_dir: Path, name: str, version: int | str | None = None) -> bool:
    """True when a finished export of `version` (without one: of any version) is in place."""
    if version is None:
        return model_export_latest(repository_dir, name) is not None
    return _is_finished(model_export_version_dir(repository_dir=repository_dir, name=name, version=version))


def model_export_info(*, repository_dir: Path, name: str, version: int | str | None = None) -> dict:
    """The export.json of `version` (without one: the latest finished version), checked against the
    model.onnx beside it.

    Raises FileNotFoundError when there is no such export, and ModelExportMismatch when export.json
    records a checksum and model.onnx is missing or differs (a stale or hand-replaced model would
    otherwise be served under the recorded pooling).
    """
    if version is None:
        version = model_export_latest(repository_dir, name) or 1
    version_dir = model_export_version_dir(repository_dir=repository_dir, name=name, version=version)
    info_path = version_dir / EXPORT_INFO_FILENAME
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} is missing: export the model first (manage.py export_model)")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    if info.get("task", "embed") == "embed" and info.get("pooling", "mean") not in POOLINGS:
        raise ModelExportMismatch(f"{info_path} names an unknown pooling {info['pooling']!r}")
    recorded = info.get("sha256")
    if recorded:
        model_path = version_dir / MODEL_FILENAME
        if not model_path.is_file():
            raise ModelExportMismatch(f"{model_path} is missing; {info_path} describes one")
        actual = file_sha256(model_path)
        if actual != recorded:
            raise ModelExportMismatch(
                f"{model_path} has SHA-256 {actual}, but {info_path} records {recorded}: it is not the "
                "model that was exported; re-export it (manage.py export_model)"
            )
    return info


# SHA-256 by file version: (device, inode, size, modification time, change time) -> hex digest.
_digests: dict[tuple[int, int, int, int, int], str] = {}
_DIGESTS_KEPT = 64


def file_sha256(path: Path) -> str:
    """The file's SHA-256, remembered per file version: every registration checks a model.onnx
    (tens to hundreds of MB), and hashing it each time cost more than the rest of registering. Any
    write to the file or a replacement of it changes its change time (which no caller can set) or
    its inode, so a changed file is hashed again."""
    with path.open("rb") as file:
        stat = os.fstat(file.fileno())
        version = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
        digest = _digests.get(version)
        if digest is None:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
            if len(_digests) >= _DIGESTS_KEPT:
                _digests.clear()
            _digests[version] = digest
        return digest
