"""Triton model configurations of an exported model (embedding or cross-encoder), rendered from one
set of templates.

Every exported model gets the same seven files, so a second model is served with MiniLM's tuned
settings and the bundled and official-container configurations never drift apart:
`config.pbtxt` (the bundled CPU Triton, embedsite_onnx backend); for the bundled Triton on a GPU,
`configs/bundled-gpu.pbtxt` (embedsite_torch, PyTorch float16), `configs/bundled-gpu-onnx.pbtxt`
(embedsite_onnx on ONNX Runtime's CUDA provider) and `configs/bundled-gpu-tensorrt.pbtxt`
(embedsite_onnx on its TensorRT provider), each chosen by `--model-config-name <name>`; and for
the official container's onnxruntime backend `configs/cpu.pbtxt`, `configs/gpu.pbtxt` and
`configs/gpu-tensorrt.pbtxt` (`--model-config-name cpu|gpu|gpu-tensorrt`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from string import Template

from embeddings.in_triton import IN_TRITON_DIR
from embeddings.services.inference.exports import model_name_is_valid

TEMPLATE_DIR = IN_TRITON_DIR / "model_configs"
# Where each rendered file goes in the model's folder, and the template it comes from.
CONFIG_TEMPLATES = {
    "config.pbtxt": "bundled.pbtxt",
    "configs/cpu.pbtxt": "cpu.pbtxt",
    "configs/gpu.pbtxt": "gpu.pbtxt",
    "configs/gpu-tensorrt.pbtxt": "gpu_tensorrt.pbtxt",
    "configs/bundled-gpu.pbtxt": "bundled_gpu.pbtxt",
    "configs/bundled-gpu-onnx.pbtxt": "bundled_gpu_onnx.pbtxt",
    "configs/bundled-gpu-tensorrt.pbtxt": "bundled_gpu_tensorrt.pbtxt",
}


# The model's extra inputs beyond input_ids and attention_mask, and its output, by task: an
# embedding model returns `embedding` [dims]; a cross-encoder may also take the pair's token types
# and returns `score` [1] (embeddings/tooling/model_export.py writes both kinds).
EMBEDDING_OUTPUT = "embedding"
SCORE_OUTPUT = "score"
EXTRA_INPUTS = ("token_type_ids",)


def _extra_input_blocks(names: Sequence[str], *, ragged: bool) -> str:
    ragged_line = "    allow_ragged_batch: true\n" if ragged else ""
    return "".join(
        f',\n  {{\n    name: "{name}"\n    data_type: TYPE_INT64\n    dims: [ -1 ]\n{ragged_line}  }}'
        for name in names
    )


def model_config_texts(
    *, name: str, dims: int, output: str = EMBEDDING_OUTPUT, extra_inputs: Sequence[str] = ()
) -> dict[str, str]:
    """The configuration files of model `name` with a `dims`-wide output named `output`, keyed by
    their path in the model's folder; `extra_inputs` (token_type_ids) follow attention_mask."""
    if not model_name_is_valid(name):
        raise ValueError(f"invalid Triton model name {name!r}: letters, digits, '_', '.', '-' only")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
        raise ValueError(f"dims must be a positive integer, not {dims!r}")
    if output not in (EMBEDDING_OUTPUT, SCORE_OUTPUT):
        raise ValueError(f"output must be {EMBEDDING_OUTPUT!r} or {SCORE_OUTPUT!r}, not {output!r}")
    unknown = [extra for extra in extra_inputs if extra not in EXTRA_INPUTS]
    if unknown:
        raise ValueError(f"unknown extra inputs {unknown}; known: {list(EXTRA_INPUTS)}")
    texts = {}
    for path, template_name in CONFIG_TEMPLATES.items():
        template = (TEMPLATE_DIR / template_name).read_text(encoding="utf-8")
        # The bundled backends batch requests of different lengths: every input says so alike.
        blocks = _extra_input_blocks(extra_inputs, ragged="allow_ragged_batch" in template)
        texts[path] = Template(template).substitute(name=name, dims=dims, output=output, extra_inputs=blocks)
    return texts


def model_configs_write(
    *,
    model_dir: Path,
    name: str,
    dims: int,
    output: str = EMBEDDING_OUTPUT,
    extra_inputs: Sequence[str] = (),
) -> list[Path]:
    """Write (atomically, each file whole or not at all) the configurations into `model_dir`;
    files already equal to their rendering are left untouched. Returns the paths written."""
    written = []
    for relative, text in model_config_texts(
        name=name, dims=dims, output=output, extra_inputs=extra_inputs
    ).items():
        path = Path(model_dir) / relative
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
        ) as scratch:
            scratch.write(text)
        os.chmod(scratch.name, 0o644)
        os.replace(scratch.name, path)
        written.append(path)
    return written
