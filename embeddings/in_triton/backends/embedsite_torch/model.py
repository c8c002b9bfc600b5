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


def _load_onnx_backend():
    """embedsite_onnx's model.py, imported by path (the stub puts neither directory on sys.path); its
    loader then imports the rest."""
    name = "embedsite_onnx_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BACKENDS_DIR / "embedsite_onnx" / "model.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


onnx_backend = _load_onnx_backend()
encoder_module = onnx_backend._load_module(
    "embedsite_torch_encoder", Path(__file__).resolve().parent / "encoder.py"
)


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
        self.buckets = onnx_backend.parse_buckets(
            parameters.get("sequence_buckets", onnx_backend.DEFAULT_GPU_BUCKETS), self.max_tokens
        )
        self.warm_up()
        onnx_backend.pb_utils.Logger.log_info(
            f"embedsite_torch: {model_path} ({self.encoder.spec.task}) on {device} in {precision}, "
            f"sequence buckets {list(self.buckets)}"
        )

    def run_padded(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return self.encoder.embed(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"))
