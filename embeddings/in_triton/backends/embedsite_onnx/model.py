"""Triton backend `embedsite_onnx`: ONNX Runtime on a version's model.onnx, requests of any length batched.

Triton runs it through the Python backend as a python-based backend (TritonServer installs it as
<backend-directory>/embedsite_onnx/model.py), so every exported model's config says
`backend: "embedsite_onnx"` and no model folder carries a copy of this file.

With `allow_ragged_batch`, Triton's dynamic batcher hands several requests of different shapes to one
`execute` call; each request keeps its own natural shape [batch_i, sequence_i] (nothing is flattened
or concatenated for us). The inputs are the config's: input_ids and attention_mask, and a
cross-encoder's token_type_ids; the one output is an embedding model's `embedding` [rows, dims] or a
cross-encoder's `score` [rows, 1], whatever the graph computes. This model pads them to a
common length, runs ONNX Runtime once per group of similar lengths, and splits the rows back per
request. A bad request gets its own error response; the rest of the batch is still served.

The config's `execution_provider` picks where ONNX Runtime runs the graph: `cpu` (the default),
`cuda` or `tensorrt` (onnxruntime-gpu's CUDA and TensorRT execution providers, on the instance's
GPU; configs/bundled-gpu-onnx.pbtxt and bundled-gpu-tensorrt.pbtxt). With `sequence_buckets` each
group runs padded up to one of those lengths, every one run once at load, so a GPU sees a few
shapes prepared in advance (the GPU providers default to buckets; the CPU to none). TensorRT builds
a float16 engine for one profile spanning every bucket and batch size, cached by engines.py beside
this file. A provider ONNX Runtime lacks fails the load, naming what to install: never a quiet CPU.
"""

import contextlib
import hashlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

MODEL_FILENAME = "model.onnx"
EXPORT_INFO_FILENAME = "export.json"
# export.json's dtype of a graph only ONNX Runtime's CPU provider runs (MatMulInteger).
CPU_ONLY_DTYPE = "int8"
# The config's execution_provider -> ONNX Runtime's name for it.
EXECUTION_PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
GPU_REQUIREMENTS = "pip install -r requirements-gpu.txt (onnxruntime-gpu in place of onnxruntime)"
MISSING_PROVIDER_HINTS = {
    "cuda": GPU_REQUIREMENTS,
    "tensorrt": f"{GPU_REQUIREMENTS}, and TensorRT 10 (its tensorrt-cu13 line, from pypi.nvidia.com)",
}
# Steps of 32 up to 256 (MiniLM's maximum) and of 64 past it: a group of ~130-token texts pads to 160.
DEFAULT_GPU_BUCKETS = "16,32,64,96,128,160,192,224,256,320,384,448,512"
TENSORRT_PRECISIONS = ("float16", "float32")


def _require_numpy_1() -> None:
    # The stub is built against the numpy 1.x C API. Under numpy 2 it reads garbage tensors without an
    # error, which happens when the stub's interpreter resolves `python3` on PATH to one outside our
    # virtualenv (the stub ignores PYTHONPATH). Refuse to load rather than serve wrong vectors.
    if int(np.__version__.split(".")[0]) >= 2:
        raise RuntimeError(
            f"the python backend stub loaded numpy {np.__version__} from {np.__file__}; it needs numpy<2. "
            "Start tritonserver with the project's virtualenv bin directory first on PATH."
        )


def _invalid_argument(message: str):
    """A per-request error that clients see as INVALID_ARGUMENT (HTTP 400), not an internal failure."""
    return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)


def _load_module(name: str, path: Path):
    """Import a file by path, once (the stub puts no backend's directory on sys.path)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


engines = _load_module("embedsite_onnx_engines", Path(__file__).resolve().parent / "engines.py")


def parse_buckets(text: str, max_tokens: int | None) -> tuple[int, ...]:
    """Ascending bucket lengths from "16,32,...", none past the model's maximum, which closes the
    list; () for "" (each group runs at its longest request's length)."""
    buckets = sorted({int(part) for part in text.split(",") if part.strip()})
    if any(bucket < 1 for bucket in buckets):
        raise ValueError(f"sequence_buckets must be positive lengths, not {text!r}")
    if buckets and max_tokens is not None:
        buckets = [bucket for bucket in buckets if bucket < max_tokens] + [max_tokens]
    return tuple(buckets)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _log_export_check(model_path: Path, export_info: dict) -> str:
    """Say in Triton's log whether model.onnx is the file export.json describes, and return its
    SHA-256. A mismatch is logged, not refused: the model still loads (`register_local_model`
    refuses it at setup)."""
    logger = pb_utils.Logger
    recorded = export_info.get("sha256")
    actual = _sha256(model_path)
    if not recorded:
        logger.log_warn(
            f"{model_path} (sha256 {actual}): export.json records no checksum to check it against"
        )
    elif actual != recorded:
        logger.log_warn(
            f"{model_path} has sha256 {actual} but export.json records {recorded}: this is not the exported "
            "model; re-export it (manage.py export_model)"
        )
    else:
        logger.log_info(
            f"{model_path} sha256 {actual} matches export.json "
            f"({export_info.get('pooling')} pooling, {export_info.get('dims')} dims)"
        )
    return actual


def _parameters(model_config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    runtime_name = "ONNX Runtime"
    # Lengths each group is padded up to (see padded_length); () pads to the group's longest.
    buckets: tuple[int, ...] = ()

    def initialize(self, args: dict) -> None:
        _require_numpy_1()
        model_config = json.loads(args["model_config"])
        parameters = _parameters(model_config)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        export_info_path = version_dir / EXPORT_INFO_FILENAME
        export_info = json.loads(export_info_path.read_text()) if export_info_path.is_file() else {}

        self.export_sha256 = _log_export_check(version_dir / MODEL_FILENAME, export_info)
        self.export_info = export_info
        self.max_batch_size = int(model_config.get("max_batch_size", 0))
        self.output_name = model_config["output"][0]["name"]
        # input_ids and attention_mask first (read and checked by name), then any others.
        names = [tensor["name"] for tensor in model_config["input"]]
        self.input_names = ["input_ids", "attention_mask"] + [
            name for name in names if name not in ("input_ids", "attention_mask")
        ]
        self.max_tokens = export_info.get("max_tokens")
        self.vocab_size = export_info.get("vocab_size")
        self.type_vocab_size = export_info.get("type_vocab_size")
        # Merging a longer request into a group pads every row already there; above this many padding
        # tokens it is cheaper to run the longer request in a group of its own.
        self.merge_padding_tokens = int(parameters.get("merge_padding_tokens", "512"))
        # Requests with fewer tokens than this are computed even if their client has gone: on a GPU
        # asking Triton whether one was cancelled costs more than computing it.
        self.cancel_check_min_tokens = int(parameters.get("cancel_check_min_tokens", "0"))
        self.load_runtime(args, version_dir / MODEL_FILENAME, parameters)

    def load_runtime(self, args: dict, model_path: Path, parameters: dict[str, str]) -> None:
        """Load what runs the model: ONNX Runtime on the config's execution provider (the GPU backend
        overrides it)."""
        import onnxruntime

        provider = parameters.get("execution_provider", "cpu")
        if provider not in EXECUTION_PROVIDERS:
            raise ValueError(
                f"execution_provider must be one of {list(EXECUTION_PROVIDERS)}, not {provider!r}"
            )
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = int(parameters.get("intra_op_threads", "0"))
        options.inter_op_num_threads = 1
        # Without spinning, idle intra-op threads sleep instead of burning the other instance's core.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", parameters.get("allow_spinning", "1")
        )
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        default_buckets = "" if provider == "cpu" else DEFAULT_GPU_BUCKETS
        self.buckets = parse_buckets(parameters.get("sequence_buckets", default_buckets), self.max_tokens)
        if provider == "cpu":
            self.session = onnxruntime.InferenceSession(
                str(model_path), options, providers=["CPUExecutionProvider"]
            )
            if self.buckets:
                self.warm_up()
            _log_info(
                f"embedsite_onnx: {model_path} on CPUExecutionProvider, sequence buckets {list(self.buckets)}"
            )
            return
        self._load_on_gpu(onnxruntime, options, provider, args, model_path, parameters)

    def _load_on_gpu(
        self, onnxruntime, options, provider: str, args: dict, model_path: Path, parameters
    ) -> None:
        """ONNX Runtime's CUDA or TensorRT provider on the instance's GPU, every bucket run once."""
        dtype = self.export_info.get("dtype") or "float32"
        if dtype == CPU_ONLY_DTYPE:
            raise RuntimeError(
                f"{model_path} is an {dtype} export, which ONNX Runtime runs on CPU only (MatMulInteger): "
                f"execution_provider {provider} cannot serve it. Serve it with config.pbtxt, or pin a "
                "float32 or float16 version (register_model --dtype)"
            )
        if not self.buckets:
            raise ValueError(f"execution_provider {provider} needs sequence_buckets (the shapes run at load)")
        wanted = EXECUTION_PROVIDERS[provider]
        available = onnxruntime.get_available_providers()
        if wanted not in available:
            raise RuntimeError(
                f"execution_provider {provider} needs ONNX Runtime's {wanted}, which this onnxruntime "
                f"{onnxruntime.__version__} lacks (it has {available}): {MISSING_PROVIDER_HINTS[provider]}"
            )
        if args.get("model_instance_kind") != "GPU":
            raise RuntimeError(
                f"execution_provider {provider} runs on a GPU: its instance_group needs kind: KIND_GPU"
            )
        if hasattr(onnxruntime, "preload_dlls"):
            # CUDA and cuDNN from the nvidia-* wheels beside onnxruntime-gpu (requirements-gpu.txt),
            # when the system's loader path does not have them.
            onnxruntime.preload_dlls()
        device_id = int(args.get("model_instance_device_id", 0))
        cuda_options = {"device_id": device_id}
        if provider == "cuda":
            providers = [(wanted, cuda_options)]
            started = time.monotonic()
            self.session = self._gpu_session(onnxruntime, model_path, options, providers, wanted)
            self.warm_up()
            _log_info(
                f"embedsite_onnx: {model_path} ({dtype}) on {wanted}, GPU {device_id}, sequence buckets "
                f"{list(self.buckets)}; loaded and warmed up in {time.monotonic() - started:.1f} s"
            )
            return
        self._load_tensorrt(onnxruntime, options, model_path, parameters, device_id, cuda_options)

    def _load_tensorrt(
        self, onnxruntime, options, model_path: Path, parameters, device_id: int, cuda_options
    ) -> None:
        precision = parameters.get("precision", "float16")
        if precision not in TENSORRT_PRECISIONS:
            raise ValueError(f"precision must be one of {TENSORRT_PRECISIONS}, not {precision!r}")
        tensorrt_version = _tensorrt_version()
        if tensorrt_version is None:
            raise RuntimeError(
                "execution_provider tensorrt needs TensorRT 10, which is not installed: "
                + MISSING_PROVIDER_HINTS["tensorrt"]
            )
        gpu = engines.gpu_identity(device_id)
        profile = engines.tensorrt_profile(
            input_names=self.input_names,
            max_batch_size=self.max_batch_size,
            buckets=self.buckets,
            opt_shape=parameters.get("tensorrt_opt_shape", ""),
        )
        key = engines.EngineKey.for_gpu(
            gpu,
            export_sha256=self.export_sha256,
            tensorrt_version=tensorrt_version,
            onnxruntime_version=onnxruntime.__version__,
            precision=precision,
            profile=profile,
        )
        cache_root = Path(parameters.get("engine_cache_dir") or model_path.parent.parent / "engines")
        directory = engines.engine_directory(cache_root, model_path.parent.name, key)
        trt_options = {
            "device_id": device_id,
            "trt_fp16_enable": precision == "float16",
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(directory),
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(directory),
            "trt_profile_min_shapes": profile[0],
            "trt_profile_opt_shapes": profile[1],
            "trt_profile_max_shapes": profile[2],
        }
        # The few nodes TensorRT cannot take run on CUDA, never on the CPU.
        providers = [("TensorrtExecutionProvider", trt_options), ("CUDAExecutionProvider", cuda_options)]
        for removed in engines.prepare_engine_directory(directory, key):
            _log_info(f"embedsite_onnx: removed {removed}, engines of another export of this version")
        with engines.engine_lock(directory):
            cached = engines.engine_files(directory)
            started = time.monotonic()
            self.session = self._gpu_session(
                onnxruntime, model_path, options, providers, "TensorrtExecutionProvider"
            )
            self.warm_up()
            elapsed = time.monotonic() - started
            built = engines.engine_files(directory) - cached
        origin = f"built in {elapsed:.1f} s" if built else f"loaded from the cache in {elapsed:.1f} s"
        _log_info(
            f"embedsite_onnx: {model_path} on TensorrtExecutionProvider (TensorRT {tensorrt_version}, "
            f"GPU {device_id}: {gpu.name}, {gpu.architecture}), {precision} engine {origin}: {directory}; "
            f"profile {profile[0]} .. {profile[2]}, sequence buckets {list(self.buckets)}"
        )

    @staticmethod
    def _gpu_session(onnxruntime, model_path: Path, options, providers: list, wanted: str):
        session = onnxruntime.InferenceSession(str(model_path), options, providers=providers)
        # ONNX Runtime falls back to the CPU, with a warning only, when a provider's libraries fail to
        # load (no CUDA, cuDNN or TensorRT found): refuse instead of serving from the CPU.
        if wanted not in session.get_providers():
            raise RuntimeError(
                f"ONNX Runtime could not start {wanted} (running on {session.get_providers()} instead): "
                f"its libraries did not load; Triton's log holds ONNX Runtime's reason. "
                f"{MISSING_PROVIDER_HINTS['tensorrt' if wanted.startswith('Tensorrt') else 'cuda']}"
            )
        return session

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        # (request index, its input arrays in self.input_names order: input_ids, attention_mask, ...)
        valid: list[tuple[int, tuple[np.ndarray, ...]]] = []
        for index, request in enumerate(requests):
            try:
                arrays = self._read(request)
            except ValueError as error:
                responses[index] = pb_utils.InferenceResponse(error=_invalid_argument(str(error)))
                continue
            # The client gave up (its deadline passed, or its own client went away) after the
            # batcher took the request: answer it without computing it. Asking costs a round trip
            # to Triton's process, so only requests that cost more to compute are asked about.
            if arrays[0].size >= self.cancel_check_min_tokens and request.is_cancelled():
                responses[index] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
                )
                continue
            valid.append((index, arrays))
        # Token values are checked for the whole batch at once (per request they cost more than a GPU
        # run); only a batch that fails is checked request by request, to answer the bad ones alone.
        if valid and self._values_error(valid) is not None:
            checked = []
            for item in valid:
                error = self._values_error([item])
                if error is None:
                    checked.append(item)
                else:
                    responses[item[0]] = pb_utils.InferenceResponse(error=_invalid_argument(error))
            valid = checked

        for group in self._length_groups(valid):
            try:
                outputs = self._run(group)
            except Exception as error:  # one failed run must answer its own requests, not the whole batch
                for index, _ in group:
                    responses[index] = pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(f"{self.runtime_name} failed: {error}")
                    )
                continue
            offset = 0
            for index, arrays in group:
                rows = arrays[0].shape[0]
                output = pb_utils.Tensor(self.output_name, outputs[offset : offset + rows])
                responses[index] = pb_utils.InferenceResponse(output_tensors=[output])
                offset += rows
        return responses

    def _read(self, request) -> tuple[np.ndarray, ...]:
        """The request's tensors, their shapes checked (their values: `_values_error`)."""
        arrays = tuple(
            pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names
        )
        input_ids = arrays[0]
        if input_ids.ndim != 2 or any(array.shape != input_ids.shape for array in arrays[1:]):
            shapes = " and ".join(
                f"{name} {list(array.shape)}" for name, array in zip(self.input_names, arrays, strict=True)
            )
            raise ValueError(f"{shapes} must have the same [batch, sequence] shape")
        length = input_ids.shape[1]
        if length == 0:
            raise ValueError("input_ids has no tokens")
        if self.max_tokens is not None and length > self.max_tokens:
            raise ValueError(
                f"sequence length {length} is over the model's maximum of {self.max_tokens} tokens"
            )
        return arrays

    def _values_error(self, items: list) -> str | None:
        """What is wrong with the token values of `items` taken together, or None."""
        ids = np.concatenate([arrays[0].ravel() for _, arrays in items])
        masks = [arrays[1] for _, arrays in items if arrays[1].size]
        if ids.size and (ids.min() < 0 or (self.vocab_size is not None and ids.max() >= self.vocab_size)):
            return f"input_ids must be token ids in [0, {self.vocab_size})"
        if "token_type_ids" in self.input_names:
            position = self.input_names.index("token_type_ids")
            types = np.concatenate([arrays[position].ravel() for _, arrays in items])
            limit = self.type_vocab_size or 1
            if types.size and (types.min() < 0 or types.max() >= limit):
                return f"token_type_ids must be in [0, {limit})"
        if not masks:
            return None
        values = np.concatenate([mask.ravel() for mask in masks])
        if values.min() < 0 or values.max() > 1:
            return "attention_mask must hold only 0 and 1"
        row_lengths = np.repeat([mask.shape[1] for mask in masks], [mask.shape[0] for mask in masks])
        row_starts = np.concatenate(([0], np.cumsum(row_lengths)[:-1]))
        if not np.add.reduceat(values, row_starts).all():
            return "every row of attention_mask must mark at least one token"
        return None

    def _length_groups(self, valid: list) -> list[list]:
        """Requests sorted by length, split where merging would cost more padding than a separate run."""
        groups: list[list] = []
        group_rows = 0
        group_length = 0
        for item in sorted(valid, key=lambda item: item[1][0].shape[1]):
            rows, length = item[1][0].shape
            if groups and group_rows * (length - group_length) <= self.merge_padding_tokens:
                groups[-1].append(item)
                group_rows += rows
            else:
                groups.append([item])
                group_rows = rows
            group_length = length
        return groups

    def _run(self, group: list) -> np.ndarray:
        length = self.padded_length(max(arrays[0].shape[1] for _, arrays in group))
        inputs = {
            name: np.concatenate([_pad(arrays[position], length) for _, arrays in group])
            for position, name in enumerate(self.input_names)
        }
        return self.run_padded(inputs)

    def padded_length(self, longest: int) -> int:
        """The sequence length a group runs at: the first bucket that holds its longest request, or
        that request's length past the buckets or without any."""
        return next((bucket for bucket in self.buckets if bucket >= longest), longest)

    def warm_up(self) -> None:
        """One run per bucket, so the first requests don't pay for the GPU's start and kernel (or
        engine) choice; every input the config lists (a cross-encoder's token types all 0), so a config
        that leaves out one the export needs fails here, at load, and not on the first request."""
        for length in self.buckets:
            inputs = {name: np.zeros((1, length), dtype=np.int64) for name in self.input_names}
            inputs["attention_mask"] = np.ones((1, length), dtype=np.int64)
            self.run_padded(inputs)

    def run_padded(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Input name -> [rows, length] int64; returns [rows, dims] float32 (a score: dims 1)."""
        (outputs,) = self.session.run([self.output_name], inputs)
        return outputs.astype(np.float32, copy=False)


def _log_info(message: str) -> None:
    pb_utils.Logger.log_info(message)


def _tensorrt_version() -> str | None:
    """The TensorRT that ONNX Runtime's provider will load: the `tensorrt` package's (importing it
    loads its libraries, which the provider then finds by name), else that of a libnvinfer.so.10
    loaded from the tensorrt_libs wheel alone or found on the loader's path."""
    try:
        import tensorrt

        return tensorrt.__version__
    except ImportError:
        pass
    with contextlib.suppress(ImportError):
        import tensorrt_libs  # noqa: F401 (its import loads libnvinfer.so.10 from the wheel)
    return engines.tensorrt_version_from_library()


def _pad(array: np.ndarray, length: int) -> np.ndarray:
    array = array.astype(np.int64, copy=False)
    if array.shape[1] == length:
        return array
    return np.pad(array, ((0, 0), (0, length - array.shape[1])))
