"""Triton model configurations of an exported embedding model, rendered from one set of templates.

Every exported model gets the same four files, so a second model is served with MiniLM's tuned
settings and the bundled and official-container configurations never drift apart:
`config.pbtxt` (the bundled CPU Triton, embedsite_onnx backend), `configs/bundled-gpu.pbtxt` (the
bundled Triton on a GPU, embedsite_torch backend, `--model-config-name bundled-gpu`), and
`configs/cpu.pbtxt` and `configs/gpu.pbtxt` (the official container, `--model-config-name cpu|gpu`,
onnxruntime backend).
"""

from __future__ import annotations

import os
import tempfile
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
    "configs/bundled-gpu.pbtxt": "bundled_gpu.pbtxt",
}


def model_config_texts(*, name: str, dims: int) -> dict[str, str]:
    """The configuration files of model `name` with a `dims`-wide embedding, keyed by their
    path in the model's folder."""
    if not model_name_is_valid(name):
        raise ValueError(f"invalid Triton model name {name!r}: letters, digits, '_', '.', '-' only")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
        raise ValueError(f"dims must be a positive integer, not {dims!r}")
    return {
        path: Template((TEMPLATE_DIR / template).read_text(encoding="utf-8")).substitute(name=name, dims=dims)
        for path, template in CONFIG_TEMPLATES.items()
    }


def model_configs_write(*, model_dir: Path, name: str, dims: int) -> list[Path]:
    """Write (atomically, each file whole or not at all) the configurations into `model_dir`;
    files already equal to their rendering are left untouched. Returns the paths written."""
    written = []
    for relative, text in model_config_texts(name=name, dims=dims).items():
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
