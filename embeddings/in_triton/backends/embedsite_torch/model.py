"""Triton backend `embedsite_torch`: the exported model on a GPU in PyTorch (float16), batched as
`embedsite_onnx` batches.

The GPU variant of the local model (configs/bundled-gpu.pbtxt, chosen by
TRITON_MODEL_CONFIG_NAME=bundled-gpu): the same version folder, its model.onnx read into a PyTorch
BERT (encoder.py beside this file), so nothing but the configuration changes between CPU and GPU.
An embedding model answers `embedding` [rows, dims]; a BERT cross-encoder (`--task rerank`) answers
`score` [rows, 1] from input_ids, attention_mask and, where its config lists them, the pairs'
token_type_ids.
Requests reach it as they reach `embedsite_onnx` (ragged, validated, cancelled and grouped there:
this backend subclasses that one), and each group runs padded up to a sequence-length bucket, so
the GPU sees a few shapes whose kernels were chosen once, at load.

On an instance of `kind: KIND_GPU` it runs on that instance's GPU, else on the CPU (how the tests
check it on machines without one); `precision` picks float16 (the GPU default) or float32.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np

BACKENDS_DIR = Path(__file__).resolve().parent.parent
PRECISIONS = ("float16", "bfloat16", "float32")
DEFAULT_BUCKETS = "16,32,64,96,128,160,192,224,256,320,384,448,512"


def _load_module(name: str, path: Path):
    """Import a file by path (the stub puts neither directory on sys.path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


onnx_backend = _load_module("embedsite_onnx_model", BACKENDS_DIR / "embedsite_onnx" / "model.py")
encoder_module = _load_module("embedsite_torch_encoder", Path(__file__).resolve().parent / "encoder.py")


def parse_buckets(text: str, max_tokens: int | None) -> tuple[int, ...]:
    """Ascending bucket lengths from "16,32,...", none past the model's maximum."""
    buckets = sorted({int(part) for part in text.split(",") if part.strip()})
    if any(bucket < 1 for bucket in buckets):
        raise ValueError(f"sequence_buckets must be positive lengths, not {text!r}")
    if max_tokens is not None:
        buckets = [bucket for bucket in buckets if bucket < max_tokens] + [max_tokens]
    return tuple(buckets)


class TritonPythonModel(onnx_backend.TritonPythonModel):
    runtime_name = "PyTorch"

    def load_runtime(self, args: dict, model_path: Path, parameters: dict[str, str]) -> None:
        import torch

        precision = parameters.get("precision", "float16")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        if args.get("model_instance_kind") == "GPU":
            device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            threads = int(parameters.get("intra_op_threads", "0"))
            if threads:
                torch.set_num_threads(threads)
        self.encoder = encoder_module.load_encoder(model_path, device=device, dtype=getattr(torch, precision))
        self.buckets = parse_buckets(parameters.get("sequence_buckets", DEFAULT_BUCKETS), self.max_tokens)
        self._warm_up()
        onnx_backend.pb_utils.Logger.log_info(
            f"embedsite_torch: {model_path} ({self.encoder.spec.task}) on {device} in {precision}, "
            f"sequence buckets {list(self.buckets)}"
        )

    def _warm_up(self) -> None:
        """One run per bucket, so the first requests don't pay for CUDA's start and kernel choice;
        every input the config lists (a cross-encoder's token types all 0), so a config that leaves
        out one the export needs fails here, at load, and not on the first request."""
        for length in self.buckets:
            inputs = {name: np.zeros((1, length), dtype=np.int64) for name in self.input_names}
            inputs["attention_mask"] = np.ones((1, length), dtype=np.int64)
            self.run_padded(inputs)

    def padded_length(self, longest: int) -> int:
        return next((bucket for bucket in self.buckets if bucket >= longest), longest)

    def run_padded(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.encoder.embed(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"))
