"""Where the `embedsite_onnx` backend keeps TensorRT engines, and what it asks of the GPU to decide.

A TensorRT engine is compiled for one graph, one GPU architecture, one TensorRT version and one set
of input shapes, and ONNX Runtime's own engine cache cannot tell when the graph changed (it names
engine files by the model's path and node names, not its weights: an export replaced in place would
load the old engine). So each engine lives in a directory of its own whose name is derived from
everything that invalidates it: the export's SHA-256, the GPU's name and compute capability, the
TensorRT and ONNX Runtime versions, the precision and the optimisation profile. A changed export or
GPU names another directory, which starts empty, so ONNX Runtime builds a new engine there and never
reads a stale one. Directories of the same model version built for another export are removed;
those for other GPUs or TensorRT versions are kept (another replica may share the volume).

The GPU is asked through the CUDA driver API (libcuda.so.1, through ctypes): no torch in the
backend's process for the sake of a name. Nothing here imports Triton's pb_utils, so the project's
tests import it as `embeddings.in_triton.backends.embedsite_onnx.engines`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

KEY_FILENAME = "engine-key.json"
LOCK_SUFFIX = ".lock"
ENGINE_SUFFIX = ".engine"
# cuDeviceGetAttribute's CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR and _MINOR.
COMPUTE_CAPABILITY_MAJOR = 75
COMPUTE_CAPABILITY_MINOR = 76
CUDA_SUCCESS = 0
DEVICE_NAME_BYTES = 256


class EngineCacheError(RuntimeError):
    """The GPU could not be asked what it is, or the cache directory cannot be used."""


@dataclass(frozen=True)
class GpuIdentity:
    """What a TensorRT engine is compiled for: the device's name and compute capability."""

    name: str
    compute_capability: tuple[int, int]

    @property
    def architecture(self) -> str:
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


def gpu_identity(device_id: int, *, load_driver: Callable[[str], object] = ctypes.CDLL) -> GpuIdentity:
    """The name and compute capability of CUDA device `device_id`, from the CUDA driver API.

    `load_driver` loads libcuda.so.1 (tests pass a fake driver object with the same four functions)."""
    try:
        driver = load_driver("libcuda.so.1")
    except OSError as error:
        raise EngineCacheError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {error}") from error

    def check(function: str, status: int) -> None:
        if status != CUDA_SUCCESS:
            raise EngineCacheError(f"{function} failed with CUDA error {status} (device {device_id})")

    check("cuInit", driver.cuInit(0))
    device = ctypes.c_int()
    check("cuDeviceGet", driver.cuDeviceGet(ctypes.byref(device), int(device_id)))
    name = ctypes.create_string_buffer(DEVICE_NAME_BYTES)
    check("cuDeviceGetName", driver.cuDeviceGetName(name, DEVICE_NAME_BYTES, device))
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(
        "cuDeviceGetAttribute",
        driver.cuDeviceGetAttribute(ctypes.byref(major), COMPUTE_CAPABILITY_MAJOR, device),
    )
    check(
        "cuDeviceGetAttribute",
        driver.cuDeviceGetAttribute(ctypes.byref(minor), COMPUTE_CAPABILITY_MINOR, device),
    )
    return GpuIdentity(
        name=name.value.decode("utf-8", "replace").strip(), compute_capability=(major.value, minor.value)
    )


def tensorrt_version_from_library(load_library: Callable[[str], object] = ctypes.CDLL) -> str | None:
    """TensorRT's version as its libnvinfer says it (getInferLibVersion: major*10000 + minor*100 +
    patch), or None when no libnvinfer.so.10 can be loaded."""
    try:
        library = load_library("libnvinfer.so.10")
    except OSError:
        return None
    number = int(library.getInferLibVersion())
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}"


def tensorrt_profile(
    *, input_names: list[str], max_batch_size: int, buckets: tuple[int, ...], opt_shape: str = ""
) -> tuple[str, str, str]:
    """ONNX Runtime's trt_profile_min_shapes, _opt_ and _max_: one profile spanning 1..max_batch_size
    rows and the smallest bucket..the largest, so no bucket or batch size ever asks for another
    engine. `opt_shape` ("ROWSxTOKENS", each capped at the maximum) is the shape TensorRT picks its
    kernels for; by default the largest."""
    if not buckets:
        raise ValueError("a TensorRT profile needs sequence_buckets")
    rows = max(1, max_batch_size)
    opt_rows, separator, opt_length = opt_shape.partition("x")
    if opt_shape and not (separator and opt_rows.isdigit() and opt_length.isdigit()):
        raise ValueError(f"tensorrt_opt_shape must be ROWSxTOKENS, like 64x128, not {opt_shape!r}")
    shapes = (
        (1, buckets[0]),
        (
            max(1, min(rows, int(opt_rows or rows))),
            min(buckets[-1], max(buckets[0], int(opt_length or buckets[-1]))),
        ),
        (rows, buckets[-1]),
    )
    return tuple(",".join(f"{name}:{batch}x{length}" for name in input_names) for batch, length in shapes)


@dataclass(frozen=True)
class EngineKey:
    """Everything a TensorRT engine depends on; two loads with equal keys may share one engine."""

    export_sha256: str
    gpu_name: str
    compute_capability: tuple[int, int]
    tensorrt_version: str
    onnxruntime_version: str
    precision: str
    # ONNX Runtime's trt_profile_min_shapes / opt / max, as passed.
    profile: tuple[str, str, str]

    @classmethod
    def for_gpu(cls, gpu: GpuIdentity, **fields) -> EngineKey:
        return cls(gpu_name=gpu.name, compute_capability=gpu.compute_capability, **fields)

    def directory_name(self) -> str:
        """Readable at a glance (which GPU, which TensorRT) and unique by a digest of every field."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu_name.lower()).strip("-") or "gpu"
        major, minor = self.compute_capability
        return f"{gpu}-sm{major}{minor}-trt{self.tensorrt_version}-{self.precision}-{digest}"


def engine_directory(cache_root: Path, version: str, key: EngineKey) -> Path:
    """The directory of the engine `key` describes, for model version `version`, under `cache_root`."""
    return Path(cache_root) / str(version) / key.directory_name()


def engine_files(directory: Path) -> set[str]:
    """The engine files ONNX Runtime has written into `directory` (none when it does not exist)."""
    if not directory.is_dir():
        return set()
    return {path.name for path in directory.iterdir() if path.name.endswith(ENGINE_SUFFIX)}


def prepare_engine_directory(directory: Path, key: EngineKey) -> list[Path]:
    """Create `directory` with its key recorded, and remove its siblings that were built for another
    export of the same model version (they can never be used again). Returns the removed ones."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise EngineCacheError(
            f"the engine cache {directory} cannot be created ({error}): set the config's "
            "engine_cache_dir parameter to a writable directory"
        ) from error
    record = directory / KEY_FILENAME
    if not record.is_file():
        record.write_text(json.dumps(asdict(key), indent=2, sort_keys=True) + "\n")
    removed = []
    for sibling in directory.parent.iterdir():
        if sibling == directory or not sibling.is_dir():
            continue
        recorded = _recorded_key(sibling)
        if recorded is not None and recorded.get("export_sha256") != key.export_sha256:
            with engine_lock(sibling):
                shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


def _recorded_key(directory: Path) -> dict | None:
    try:
        recorded = json.loads((directory / KEY_FILENAME).read_text())
    except (OSError, ValueError):
        return None  # not one of ours, or still being created: left alone
    return recorded if isinstance(recorded, dict) else None


@contextmanager
def engine_lock(directory: Path) -> Iterator[None]:
    """Held while an engine is built or loaded: the model's instances load at once, and the first
    builds while the others wait and then read what it wrote, never a half-written engine."""
    lock_path = directory.with_name(directory.name + LOCK_SUFFIX)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
