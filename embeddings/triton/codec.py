"""Tensor codecs for the Triton protocol: numpy arrays to and from raw request/response bytes.

Tensors travel as `raw_input_contents` / `raw_output_contents`: one bytes blob per tensor,
row-major, little-endian, no padding; BYTES elements are each prefixed by their length as a
4-byte little-endian unsigned integer. Decoding is `numpy.frombuffer` plus a reshape, never
a loop over per-element protobuf lists. Also here: splitting a request into batches the
model accepts, and putting the answers back together in order.
"""

import struct
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .errors import TritonInvalidInput, TritonModelError
from .protocol import grpc_service_pb2 as pb

# Triton datatype name -> numpy dtype, with the byte order Triton uses on the wire.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
BYTES = "BYTES"
_LENGTH_PREFIX = struct.Struct("<I")


def triton_datatype(array: np.ndarray) -> str:
    """The Triton datatype name for a numpy array (str, bytes and object arrays are BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return BYTES
    for name, dtype in NUMPY_DTYPES.items():
        if array.dtype.kind == dtype.kind and array.dtype.itemsize == dtype.itemsize:
            return name
    raise TritonInvalidInput(f"numpy dtype {array.dtype} has no Triton datatype")


def serialize_bytes_tensor(elements: Iterable[str | bytes]) -> bytes:
    """BYTES wire format: for each element, its length (uint32 LE) then its bytes; str as UTF-8."""
    parts = []
    for element in elements:
        data = element.encode("utf-8") if isinstance(element, str) else bytes(element)
        parts.append(_LENGTH_PREFIX.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(buffer: bytes) -> list[bytes]:
    """Inverse of `serialize_bytes_tensor`; elements come back as bytes (they need not be UTF-8)."""
    elements = []
    view = memoryview(buffer)
    offset = 0
    while offset < len(view):
        if offset + _LENGTH_PREFIX.size > len(view):
            raise ValueError(f"BYTES tensor truncated in a length prefix at offset {offset}")
        (length,) = _LENGTH_PREFIX.unpack_from(view, offset)
        offset += _LENGTH_PREFIX.size
        if offset + length > len(view):
            raise ValueError(f"BYTES element at offset {offset} runs past the end of the tensor")
        elements.append(bytes(view[offset : offset + length]))
        offset += length
    return elements


def encode_tensor(array: np.ndarray, datatype: str | None = None, *, name: str = "") -> tuple[str, bytes]:
    """(datatype, raw bytes) for one input tensor.

    Given a `datatype` (the model's), numbers are cast to it within their kind (int32 to INT64,
    float64 to FP32); anything else (floats as INT64, numbers as BYTES) is refused here.
    """
    given = triton_datatype(array)
    datatype = datatype or given
    if (datatype == BYTES) != (given == BYTES):
        raise TritonInvalidInput(f"input {name!r}: {array.dtype} data cannot be sent as {datatype}")
    if datatype == BYTES:
        return BYTES, serialize_bytes_tensor(np.asarray(array, dtype=object).ravel())
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise TritonInvalidInput(f"input {name!r}: unsupported datatype {datatype}")
    if not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise TritonInvalidInput(f"input {name!r}: {array.dtype} data cannot be sent as {datatype}")
    return datatype, np.ascontiguousarray(array, dtype=dtype).tobytes()


def decode_tensor(raw: bytes, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """The numpy array held by one raw output blob (BYTES as an object array of bytes).

    Numeric arrays are read-only views over `raw` (no copy).
    """
    shape = tuple(int(dim) for dim in shape)
    if datatype == BYTES:
        array = np.empty(len(elements := deserialize_bytes_tensor(raw)), dtype=object)
        array[:] = elements
        return array.reshape(shape)
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise ValueError(f"unsupported output datatype {datatype}")
    # Native byte order for the caller; a no-op view on little-endian machines.
    return np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="), copy=False)


def build_infer_request(
    model: str,
    inputs: Mapping[str, np.ndarray],
    *,
    version: str = "",
    datatypes: Mapping[str, str] | None = None,
    output_names: Sequence[str] = (),
    priority: int = 0,
) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying every input as raw bytes; asks only for `output_names`.

    priority: the queue level Triton's dynamic batcher serves it at (0: the model's default).
    """
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    if priority:
        request.parameters["priority"].int64_param = priority
    for name, array in inputs.items():
        array = np.asarray(array)
        datatype, raw = encode_tensor(array, (datatypes or {}).get(name), name=name)
        request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        request.raw_input_contents.append(raw)
    for name in output_names:
        request.outputs.add(name=name)
    return request


def decode_infer_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Output name -> array; raw blob i belongs to `outputs[i]`, whatever order Triton chose."""
    if len(response.raw_output_contents) != len(response.outputs):
        raise TritonModelError(
            f"model {response.model_name!r} answered {len(response.outputs)} outputs "
            f"but {len(response.raw_output_contents)} raw output blobs",
            model=response.model_name,
        )
    decoded = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        try:
            decoded[output.name] = decode_tensor(raw, output.datatype, output.shape)
        except ValueError as error:
            raise TritonModelError(
                f"model {response.model_name!r} output {output.name!r} "
                f"({output.datatype} {list(output.shape)}) cannot be decoded: {error}",
                model=response.model_name,
            ) from error
    return decoded


def split_batches(rows: int, max_batch_size: int) -> list[range]:
    """Consecutive row ranges of at most `max_batch_size` rows (one range if it is 0: no batching)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if max_batch_size <= 0:
        return [range(0, rows)] if rows else []
    return [range(start, min(start + max_batch_size, rows)) for start in range(0, rows, max_batch_size)]


def slice_rows(inputs: Mapping[str, np.ndarray], rows: range) -> dict[str, np.ndarray]:
    """The same rows of every input (axis 0 is the batch)."""
    return {name: array[rows.start : rows.stop] for name, array in inputs.items()}


def reassemble(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate per-batch results along the batch axis, in split order; always writable."""
    if len(parts) == 1:
        return parts[0] if parts[0].flags.writeable else parts[0].copy()
    return np.concatenate(parts, axis=0)
