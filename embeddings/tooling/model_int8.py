"""An embedding model's int8 graph from its verified float32 one: ONNX Runtime's dynamic
quantisation (model_variants.py measures it against float32 and keeps it or refuses).

Dynamic, not static: on all-MiniLM-L6-v2 and the held-out texts, dynamic quantisation (int8
weights per output channel, activations' uint8 range taken per batch at run time) kept mean cosine
0.993 and recall@10 0.90 against float32, where static QDQ calibrated on 400 of the shipped
calibration texts (MinMax, weights per channel) kept 0.936 and 0.73 with only its MatMuls
quantised, 0.376 and 0.23 with every operator (README: the table). The feed-forward
down-projections stay float32 (see `float32_matmuls`): quantised, they alone took MiniLM's min
cosine from 0.991 to 0.979.

Export-only: onnxruntime.quantization is never imported by the service."""

from __future__ import annotations

from pathlib import Path

QUANTIZATION_METHOD = (
    "onnxruntime dynamic: int8 weights per output channel, uint8 activations ranged per batch; "
    "feed-forward down-projections float32"
)


def int8_graph_write(source: Path, target: Path) -> dict:
    """Write the int8 quantisation of the float32 graph at `source` to `target`; returns how it was
    made, for export.json (model_variants.py measures it against `source` and decides)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    kept = float32_matmuls(source)
    quantize_dynamic(
        str(source), str(target), weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=kept
    )
    return {"method": QUANTIZATION_METHOD, "float32_matmuls": len(kept)}


def float32_matmuls(model_path: Path) -> list[str]:
    """The MatMuls left in float32: each layer's feed-forward down-projection (a constant weight
    with more rows than columns, e.g. 1536 -> 384). Their input is the GELU's output, whose few
    large values stretch the one uint8 range a batch's activations share, so the many small ones
    lose their precision."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    shapes = {tensor.name: tuple(tensor.dims) for tensor in graph.initializer}
    return [
        node.name
        for node in graph.node
        if node.op_type == "MatMul"
        and len(shapes.get(node.input[1], ())) == 2
        and shapes[node.input[1]][0] > shapes[node.input[1]][1]
    ]
