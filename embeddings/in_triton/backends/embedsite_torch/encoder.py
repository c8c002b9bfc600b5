"""A BERT encoder in PyTorch built from the weights inside an exported model.onnx.

What the `embedsite_torch` Triton backend runs on a GPU (float16) and `bench/gpu.py` runs in process:
the same weights, the same pooling and normalisation as the ONNX graph `manage.py export_model`
wrote, so one exported version serves on CPU (ONNX Runtime) and on GPU (this) with nothing else to
ship. Only the BERT layout is read (MiniLM is one); other exported types fail to load with a clear
error and are served on GPU by the official container's onnxruntime configuration instead.

The ONNX exporter keeps each parameter's name except the matrix multiplications' weights, which it
stores transposed under generated names (`onnx::MatMul_908`); each of those feeds an `Add` with a
named bias (`...attention.self.query.bias`), which names the weight. Parameters with equal values
are stored once, the other names aliased to it by Identity nodes. Imported by the backend from its
own directory (no project imports: the Triton stub runs it outside Django), and by the project as
`embeddings.in_triton.backends.embedsite_torch.encoder`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EXPORT_INFO_FILENAME = "export.json"
SUPPORTED_MODEL_TYPES = ("bert",)
POOLINGS = ("mean", "cls", "last")
LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.")
# Each layer's tensors: names relative to `encoder.layer.<i>.`.
LAYER_TENSORS = (
    "attention.self.query.weight",
    "attention.self.query.bias",
    "attention.self.key.weight",
    "attention.self.key.bias",
    "attention.self.value.weight",
    "attention.self.value.bias",
    "attention.output.dense.weight",
    "attention.output.dense.bias",
    "attention.output.LayerNorm.weight",
    "attention.output.LayerNorm.bias",
    "intermediate.dense.weight",
    "intermediate.dense.bias",
    "output.dense.weight",
    "output.dense.bias",
    "output.LayerNorm.weight",
    "output.LayerNorm.bias",
)
EMBEDDING_TENSORS = (
    "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight",
    "embeddings.LayerNorm.weight",
    "embeddings.LayerNorm.bias",
)


class EncoderLoadError(RuntimeError):
    """The export cannot be run by this encoder (another architecture, or a graph it cannot read)."""


@dataclass(frozen=True)
class EncoderSpec:
    """What the forward pass needs besides the weights, from export.json and the graph."""

    layers: int
    attention_heads: int
    layer_norm_eps: float
    pooling: str


def read_onnx_weights(model_path: Path) -> tuple[dict[str, np.ndarray], float]:
    """The encoder's weights by their PyTorch names (matrices as [out, in], as torch.nn.Linear keeps
    them) and the graph's LayerNorm epsilon."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(model_path)).graph
    # Tensors by name: the initializers, and the names the exporter aliased to one of them with an
    # Identity node when several parameters held equal values (a fresh model's zero biases).
    tensors = {tensor.name: tensor for tensor in graph.initializer}
    consumers: dict[str, list] = defaultdict(list)
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in tensors:
            tensors[node.output[0]] = tensors[node.input[0]]
        for name in node.input:
            consumers[name].append(node)

    weights: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        if not name.startswith(("onnx::", "/")):
            # The export wraps the transformers model as `encoder`; drop that prefix.
            weights[name.removeprefix("encoder.")] = numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in tensors:
            continue
        biases = [
            name
            for add in consumers[node.output[0]]
            if add.op_type == "Add"
            for name in add.input
            if name in tensors and name.endswith(".bias")
        ]
        if len(biases) != 1:
            raise EncoderLoadError(
                f"{model_path}: MatMul {node.name or node.output[0]} is not followed by one named bias"
            )
        matrix = numpy_helper.to_array(tensors[node.input[1]])  # [in, out]
        weights[biases[0].removeprefix("encoder.").removesuffix("bias") + "weight"] = matrix.T

    epsilons = {
        attribute.f
        for node in graph.node
        if node.op_type == "LayerNormalization"
        for attribute in node.attribute
        if attribute.name == "epsilon"
    }
    if len(epsilons) != 1:
        raise EncoderLoadError(f"{model_path}: expected one LayerNorm epsilon, found {sorted(epsilons)}")
    return weights, epsilons.pop()


def encoder_spec(export_info: dict, weights: dict[str, np.ndarray], layer_norm_eps: float) -> EncoderSpec:
    model_type = export_info.get("model_type", "bert")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EncoderLoadError(
            f"the torch encoder runs {', '.join(SUPPORTED_MODEL_TYPES)} exports, not {model_type!r}; "
            "serve it on GPU with the official container's configs/gpu.pbtxt (onnxruntime backend)"
        )
    pooling = export_info.get("pooling", "mean")
    if pooling not in POOLINGS:
        raise EncoderLoadError(f"unknown pooling {pooling!r}")
    heads = export_info.get("attention_heads")
    if not isinstance(heads, int) or heads < 1:
        raise EncoderLoadError(
            "export.json records no attention_heads: re-export the model (manage.py export_model)"
        )
    layers = 1 + max((int(m.group(1)) for name in weights if (m := LAYER_NAME.match(name))), default=-1)
    missing = [name for name in EMBEDDING_TENSORS if name not in weights] + [
        f"encoder.layer.{i}.{name}" for i in range(layers) for name in LAYER_TENSORS
        if f"encoder.layer.{i}.{name}" not in weights
    ]  # fmt: skip
    if layers == 0 or missing:
        raise EncoderLoadError(f"not a BERT encoder graph: missing {', '.join(missing[:5]) or 'layers'}")
    hidden = weights["embeddings.word_embeddings.weight"].shape[1]
    if hidden % heads:
        raise EncoderLoadError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
    return EncoderSpec(layers=layers, attention_heads=heads, layer_norm_eps=layer_norm_eps, pooling=pooling)


class BertEncoder(torch.nn.Module):
    """Embeddings, `layers` post-norm transformer layers (query, key and value in one matrix), pooling
    and L2 normalisation; input_ids and attention_mask [batch, sequence], right-padded."""

    def __init__(self, weights: dict[str, np.ndarray], spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec

        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(weights[name], dtype=np.float32))  # a writable copy

        for name in EMBEDDING_TENSORS:
            self.register_buffer(name.replace(".", "_"), tensor(name))
        for index in range(spec.layers):
            prefix = f"encoder.layer.{index}."
            layer = {name: tensor(prefix + name) for name in LAYER_TENSORS}
            qkv_weight = torch.cat([layer[f"attention.self.{p}.weight"] for p in ("query", "key", "value")])
            qkv_bias = torch.cat([layer[f"attention.self.{p}.bias"] for p in ("query", "key", "value")])
            parts = {
                "qkv_weight": qkv_weight,
                "qkv_bias": qkv_bias,
                "out_weight": layer["attention.output.dense.weight"],
                "out_bias": layer["attention.output.dense.bias"],
                "attention_norm_weight": layer["attention.output.LayerNorm.weight"],
                "attention_norm_bias": layer["attention.output.LayerNorm.bias"],
                "up_weight": layer["intermediate.dense.weight"],
                "up_bias": layer["intermediate.dense.bias"],
                "down_weight": layer["output.dense.weight"],
                "down_bias": layer["output.dense.bias"],
                "output_norm_weight": layer["output.LayerNorm.weight"],
                "output_norm_bias": layer["output.LayerNorm.bias"],
            }
            for key, value in parts.items():
                self.register_buffer(f"layer{index}_{key}", value)

    def _layer(self, index: int, key: str) -> torch.Tensor:
        return getattr(self, f"layer{index}_{key}")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length = input_ids.shape
        hidden_size = self.embeddings_word_embeddings_weight.shape[1]
        heads = self.spec.attention_heads
        eps = self.spec.layer_norm_eps
        x = (
            self.embeddings_word_embeddings_weight[input_ids]
            + self.embeddings_position_embeddings_weight[:length]
            + self.embeddings_token_type_embeddings_weight[0]
        )
        x = F.layer_norm(
            x, (hidden_size,), self.embeddings_LayerNorm_weight, self.embeddings_LayerNorm_bias, eps
        )
        # Keys a query may attend: the row's real tokens.
        keys = attention_mask.bool()[:, None, None, :]
        for i in range(self.spec.layers):
            qkv = F.linear(x, self._layer(i, "qkv_weight"), self._layer(i, "qkv_bias"))
            q, k, v = qkv.view(batch, length, 3, heads, hidden_size // heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
            attended = attended.transpose(1, 2).reshape(batch, length, hidden_size)
            x = F.layer_norm(
                F.linear(attended, self._layer(i, "out_weight"), self._layer(i, "out_bias")) + x,
                (hidden_size,),
                self._layer(i, "attention_norm_weight"),
                self._layer(i, "attention_norm_bias"),
                eps,
            )
            up = F.gelu(F.linear(x, self._layer(i, "up_weight"), self._layer(i, "up_bias")))
            x = F.layer_norm(
                F.linear(up, self._layer(i, "down_weight"), self._layer(i, "down_bias")) + x,
                (hidden_size,),
                self._layer(i, "output_norm_weight"),
                self._layer(i, "output_norm_bias"),
                eps,
            )
        # Pooling and normalisation in float32: a float16 sum over 256 tokens can lose the small ones.
        x = x.float()
        if self.spec.pooling == "cls":
            pooled = x[:, 0]
        elif self.spec.pooling == "last":
            last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
            pooled = x[torch.arange(batch, device=x.device), last]
        else:
            mask = attention_mask.unsqueeze(-1).to(x.dtype)
            pooled = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1)


class Encoder:
    """A BertEncoder on one device and precision, fed and read as numpy."""

    def __init__(self, module: BertEncoder, *, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.module = module.to(device=device, dtype=dtype).eval()
        self.dims = module.embeddings_word_embeddings_weight.shape[1]

    @torch.inference_mode()
    def embed_tensors(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[rows, sequence] int64 on any device -> [rows, dims] float32 on this encoder's device."""
        input_ids = input_ids.to(self.device, non_blocking=True)
        attention_mask = attention_mask.to(self.device, non_blocking=True)
        return self.module(input_ids, attention_mask)

    def embed(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[rows, sequence] int64 numpy -> [rows, dims] float32 numpy."""
        vectors = self.embed_tensors(
            torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)),
        )
        return vectors.cpu().numpy()


def load_encoder(model_path: Path, *, device: str | torch.device, dtype: torch.dtype) -> Encoder:
    """The encoder of an exported version: its model.onnx and the export.json beside it."""
    model_path = Path(model_path)
    info_path = model_path.parent / EXPORT_INFO_FILENAME
    export_info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    weights, layer_norm_eps = read_onnx_weights(model_path)
    spec = encoder_spec(export_info, weights, layer_norm_eps)
    return Encoder(BertEncoder(weights, spec), device=torch.device(device), dtype=dtype)
