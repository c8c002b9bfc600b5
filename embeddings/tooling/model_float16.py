"""An embedding model's float16 graph from its verified float32 one, for GPUs: ONNX Runtime's own
converter (onnxruntime.transformers), int64 ids in and the float32 `embedding` out as before, and
the pooling and L2 normalisation after the encoder's last LayerNormalization kept float32
(model_variants.py measures it against float32 and keeps it or refuses).

The tail stays float32 because a float16 normalisation leaves unit vectors' norms off by up to
4.7e-4 on MiniLM's held-out texts (float32: 4e-7), and clients take the vectors as unit length.
LayerNormalization and Softmax run float16 with the rest: keeping them float32 as well raised
MiniLM's min cosine to float32 only from 0.9999990 to 0.9999995 (README: the table), for a pair of
Casts around each of them on every batch.

The converter keeps a node float32 by casting its inputs to float32 and its outputs back to
float16, so each value between two kept nodes would round-trip through float16; OnnxModel's
conversion joins such Cast pairs and drops Casts to the type a value already has. It joins every
Cast feeding a Cast, so a graph that has one of its own is refused rather than changed."""

from __future__ import annotations

from pathlib import Path

from embeddings.services.inference.exports import ModelExportError

FLOAT16_METHOD = (
    "onnxruntime.transformers float16 conversion: float16 weights and activations; int64 inputs, "
    "float32 embedding; pooling and L2 normalisation (after the last LayerNormalization) float32"
)


def float16_graph_write(source: Path, target: Path) -> dict:
    """Write the float16 conversion of the float32 graph at `source` to `target`; returns how it was
    made, for export.json."""
    import onnx
    from onnx.external_data_helper import uses_external_data
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = onnx.load(str(source), load_external_data=False)
    if any(uses_external_data(tensor) for tensor in model.graph.initializer):
        # Converting needs the whole graph in one protobuf, which stops at 2 GB.
        raise ModelExportError(
            "the float32 graph keeps its weights outside model.onnx (over 2 GB): a float16 export of it "
            "is not supported"
        )
    chained = cast_chains(model.graph)
    if chained:
        raise ModelExportError(
            f"the float32 graph casts a cast's output again ({', '.join(chained)}); the float16 "
            "conversion would change it"
        )
    kept = float32_tail(model.graph)
    converted = OnnxModel(model)
    # ONNX's own shape inference: the types are all the converter needs, and it knows every op here.
    converted.convert_float_to_float16(
        use_symbolic_shape_infer=False, keep_io_types=True, node_block_list=kept
    )
    onnx.save(converted.model, str(target))
    return {"method": FLOAT16_METHOD, "float32_nodes": len(kept)}


def float32_tail(graph) -> list[str]:
    """The names of the nodes after the encoder's last LayerNormalization (in the graph's order,
    which is topological): an embedding model's pooling and L2 normalisation."""
    nodes = list(graph.node)
    layer_norms = [index for index, node in enumerate(nodes) if node.op_type == "LayerNormalization"]
    if not layer_norms:
        raise ModelExportError(
            "the float32 graph has no LayerNormalization: its pooling cannot be told from its encoder, "
            "which the float16 export needs to keep the pooling float32"
        )
    return [node.name for node in nodes[layer_norms[-1] + 1 :]]


def cast_chains(graph) -> list[str]:
    """The names of the Cast nodes whose input is another Cast's output."""
    cast_outputs = {output for node in graph.node if node.op_type == "Cast" for output in node.output}
    return [node.name for node in graph.node if node.op_type == "Cast" and node.input[0] in cast_outputs]
