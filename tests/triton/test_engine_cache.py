"""Where embedsite_onnx keeps TensorRT engines (engines.py beside its model.py): a directory per
export, GPU, TensorRT version and precision, so a changed export or GPU never loads a stale engine;
the GPU asked through a fake CUDA driver with the real one's four functions."""

from __future__ import annotations

import ctypes
import json
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from embeddings.in_triton.backends.embedsite_onnx.engines import (
    KEY_FILENAME,
    EngineCacheError,
    EngineKey,
    GpuIdentity,
    engine_directory,
    engine_files,
    engine_lock,
    gpu_identity,
    prepare_engine_directory,
    tensorrt_profile,
    tensorrt_version_from_library,
)

pytestmark = pytest.mark.unit

H200 = GpuIdentity(name="NVIDIA H200", compute_capability=(9, 0))
PROFILE = tensorrt_profile(input_names=["input_ids", "attention_mask"], max_batch_size=512, buckets=(16, 256))


class FakeCudaDriver:
    """libcuda.so.1 as ctypes sees it: each function writes through the pointers it is given and
    returns a CUresult (0: success)."""

    def __init__(self, devices: dict[int, tuple[str, int, int]], failing: str = "") -> None:
        self.devices = devices
        self.failing = failing
        self.initialised = False

    def _status(self, function: str) -> int:
        return 100 if function == self.failing else 0  # 100: CUDA_ERROR_NO_DEVICE

    def cuInit(self, flags: int) -> int:
        self.initialised = flags == 0
        return self._status("cuInit")

    def cuDeviceGet(self, device_pointer, ordinal: int) -> int:
        if ordinal not in self.devices:
            return 101  # CUDA_ERROR_INVALID_DEVICE
        device_pointer._obj.value = ordinal
        return self._status("cuDeviceGet")

    def cuDeviceGetName(self, buffer, length: int, device: ctypes.c_int) -> int:
        buffer.value = self.devices[device.value][0].encode()[: length - 1]
        return self._status("cuDeviceGetName")

    def cuDeviceGetAttribute(self, value_pointer, attribute: int, device: ctypes.c_int) -> int:
        _, major, minor = self.devices[device.value]
        value_pointer._obj.value = {75: major, 76: minor}[attribute]
        return self._status("cuDeviceGetAttribute")


def fake_loader(driver):
    def load(name: str):
        assert name == "libcuda.so.1"
        return driver

    return load


def key(**changes) -> EngineKey:
    base = EngineKey.for_gpu(
        H200,
        export_sha256="a" * 64,
        tensorrt_version="10.16.1",
        onnxruntime_version="1.31.1",
        precision="float16",
        profile=PROFILE,
    )
    return replace(base, **changes)


# --- the GPU, through the CUDA driver API ------------------------------------------------------------


def test_the_gpu_is_named_with_its_compute_capability_by_the_driver():
    driver = FakeCudaDriver({0: ("NVIDIA H200", 9, 0), 1: ("NVIDIA L4", 8, 9)})

    second = gpu_identity(1, load_driver=fake_loader(driver))

    assert driver.initialised
    assert second == GpuIdentity(name="NVIDIA L4", compute_capability=(8, 9))
    assert second.architecture == "sm89"
    assert gpu_identity(0, load_driver=fake_loader(driver)).architecture == "sm90"


@pytest.mark.parametrize("failing", ["cuInit", "cuDeviceGetName", "cuDeviceGetAttribute"])
def test_a_driver_call_that_fails_is_named_not_guessed_around(failing):
    driver = FakeCudaDriver({0: ("NVIDIA H200", 9, 0)}, failing=failing)
    with pytest.raises(EngineCacheError, match=rf"{failing} failed with CUDA error 100 \(device 0\)"):
        gpu_identity(0, load_driver=fake_loader(driver))


def test_a_device_the_driver_does_not_have_is_refused():
    driver = FakeCudaDriver({0: ("NVIDIA H200", 9, 0)})
    with pytest.raises(EngineCacheError, match=r"cuDeviceGet failed with CUDA error 101 \(device 3\)"):
        gpu_identity(3, load_driver=fake_loader(driver))


def test_without_a_cuda_driver_the_error_says_so():
    # This machine has none: the real loader.
    with pytest.raises(EngineCacheError, match=r"libcuda\.so\.1\) cannot be loaded"):
        gpu_identity(0)


def test_tensorrts_version_is_read_from_libnvinfer():
    class FakeNvinfer:
        def getInferLibVersion(self) -> int:
            return 101601  # 10.16.1

    assert tensorrt_version_from_library(lambda name: FakeNvinfer()) == "10.16.1"

    def missing(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    assert tensorrt_version_from_library(missing) is None


# --- the key and its directory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"export_sha256": "b" * 64},
        {"gpu_name": "NVIDIA H100 80GB HBM3"},
        {"compute_capability": (8, 9)},
        {"tensorrt_version": "10.16.2"},
        {"onnxruntime_version": "1.32.0"},
        {"precision": "float32"},
        {"profile": ("input_ids:1x16", "input_ids:64x128", "input_ids:256x512")},
    ],
    ids=lambda change: next(iter(change)),
)
def test_whatever_invalidates_an_engine_names_another_directory(tmp_path, change):
    assert engine_directory(tmp_path, "1", key(**change)) != engine_directory(tmp_path, "1", key())


def test_the_same_key_names_the_same_directory_readably(tmp_path):
    directory = engine_directory(tmp_path, "2", key())
    assert directory == engine_directory(tmp_path, "2", key())
    assert directory.parent == tmp_path / "2"
    assert directory.name.startswith("nvidia-h200-sm90-trt10.16.1-float16-")


def test_preparing_records_the_key_and_removes_only_another_exports_engines(tmp_path):
    old_export = engine_directory(tmp_path, "1", key(export_sha256="0" * 64))
    other_gpu = engine_directory(tmp_path, "1", key(gpu_name="NVIDIA L4", compute_capability=(8, 9)))
    other_version = engine_directory(tmp_path, "2", key(export_sha256="0" * 64))
    for directory, built_for in ((old_export, "0" * 64), (other_gpu, "a" * 64), (other_version, "0" * 64)):
        directory.mkdir(parents=True)
        (directory / KEY_FILENAME).write_text(json.dumps(asdict(key(export_sha256=built_for))))
        (directory / "TensorrtExecutionProvider_TRTKernel_graph_1_sm90.engine").write_bytes(b"engine")
    not_ours = tmp_path / "1" / "someone-elses"
    not_ours.mkdir()
    current = engine_directory(tmp_path, "1", key())

    removed = prepare_engine_directory(current, key())

    assert removed == [old_export] and not old_export.exists()
    # Another GPU's engine of this export may serve a replica sharing the volume; another version's
    # export is not this one's to judge; a folder without our record is left alone.
    assert engine_files(other_gpu) and engine_files(other_version) and not_ours.is_dir()
    assert json.loads((current / KEY_FILENAME).read_text())["export_sha256"] == "a" * 64
    assert engine_files(current) == set()


def test_an_engine_cache_that_cannot_be_created_names_the_parameter(tmp_path):
    blocker = tmp_path / "read-only"
    blocker.write_text("a file, not a directory")
    with pytest.raises(EngineCacheError, match="engine_cache_dir"):
        prepare_engine_directory(engine_directory(blocker, "1", key()), key())


# --- the optimisation profile -------------------------------------------------------------------------


def test_the_profile_spans_every_batch_size_and_bucket():
    minimum, optimum, maximum = tensorrt_profile(
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        max_batch_size=512,
        buckets=(16, 32, 256),
        opt_shape="64x128",
    )
    assert minimum == "input_ids:1x16,attention_mask:1x16,token_type_ids:1x16"
    assert optimum == "input_ids:64x128,attention_mask:64x128,token_type_ids:64x128"
    assert maximum == "input_ids:512x256,attention_mask:512x256,token_type_ids:512x256"


def test_the_profiles_optimum_stays_inside_it():
    shapes = dict(input_names=["input_ids"], max_batch_size=32, buckets=(16, 128))
    assert tensorrt_profile(**shapes)[1] == "input_ids:32x128"  # none given: the largest
    assert tensorrt_profile(**shapes, opt_shape="64x512")[1] == "input_ids:32x128"
    assert tensorrt_profile(**shapes, opt_shape="0x8")[1] == "input_ids:1x16"
    with pytest.raises(ValueError, match="ROWSxTOKENS"):
        tensorrt_profile(**shapes, opt_shape="64")
    with pytest.raises(ValueError, match="sequence_buckets"):
        tensorrt_profile(input_names=["input_ids"], max_batch_size=32, buckets=())


# --- one build at a time ------------------------------------------------------------------------------


def test_a_second_instance_waits_for_the_first_to_finish_its_engine(tmp_path):
    directory = tmp_path / "engine"
    events: list[str] = []
    holding = threading.Event()

    def first() -> None:
        with engine_lock(directory):
            events.append("first builds")
            holding.set()
            time.sleep(0.3)
            events.append("first done")

    def second() -> None:
        holding.wait(10)
        with engine_lock(directory):
            events.append("second loads")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)

    assert events == ["first builds", "first done", "second loads"]


def test_engine_files_are_those_onnx_runtime_writes(tmp_path):
    assert engine_files(tmp_path / "missing") == set()
    (tmp_path / "TensorrtExecutionProvider_TRTKernel_graph_1_sm90.engine").write_bytes(b"x")
    (tmp_path / "TensorrtExecutionProvider_TRTKernel_graph_1_sm90.profile").write_bytes(b"x")
    (tmp_path / KEY_FILENAME).write_text("{}")
    assert engine_files(Path(tmp_path)) == {"TensorrtExecutionProvider_TRTKernel_graph_1_sm90.engine"}
