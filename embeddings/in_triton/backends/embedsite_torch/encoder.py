"""A BERT encoder in PyTorch built from the weights inside an exported model.onnx.

What the `embedsite_torch` Triton backend runs on a GPU (float16) and `bench/gpu.py` runs in process:
the same weights, the same pooling and normalisation as the ONNX graph `manage.py export_model`
wrote, so one exported version serves on CPU (ONNX Runtime) and on GPU (this) with nothing else to
ship. Both kinds of export are read: an embedding model's (pooled, L2-normalised vectors) and a
cross-encoder's (`--task rerank`: BertForSequenceClassification's pooler and one-label classifier
on the pair's tokens and token types, the raw logit [rows, 1]). Only the BERT layout is read
(MiniLM is one); other exported types fail to load with a clear error and are served on GPU by the
official container's onnxruntime configuration instead.

The ONNX exporter keeps each parameter's name except the matrix multiplications' weights, which it
stores transposed under generated names (`onnx::MatMul_908`); each of those feeds an `Add` with a
named bias (`...attention.self.query.bias`), which names the weight. Linear layers on [rows, hidden]
(a cross-encoder's pooler and classifier) become Gemm nodes that keep their weights' names, stored
[out, in] (transB). Parameters with equal values are stored once, the other names aliased to it by
Identity nodes. The export wraps the transformers model as `encoder` (an embedding model's
BertModel) or `classifier` (a cross-encoder's BertForSequenceClassification, whose BertModel is its
`bert`); weights here go by their names inside the BertModel, the head's as `pooler.dense.*` and
`classifier.*`.

Imported by the backend from its own directory (no project imports: the Triton stub runs it outside
Django), and by the project as `embeddings.in_triton.backends.embedsite_torch.encoder`.
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
# export.json's "dtype" (absent: float32, exports from before it was recorded) of graphs whose
# weights are floats, which this encoder reads and casts to its precision. A quantised export
# (int8: MatMulInteger on int8 initializers) holds no float matrices to rebuild BERT from.
FLOAT_WEIGHT_DTYPES = ("float32", "float16")
DEFAULT_EXPORT_DTYPE = "float32"
POOLINGS = ("mean", "cls", "last")
# export.json's task (embeddings.model_tasks, not imported: the Triton stub runs this outside Django).
TASK_EMBED = "embed"
TASK_RERANK = "rerank"
# What model_export wraps the transformers model as, and a sequence classifier's name for its BertModel.
WRAPPER_PREFIXES = ("encoder.", "classifier.")
BASE_MODEL_PREFIX = "bert."
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
# A cross-encoder's head: BertPooler (dense + tanh on the first token) and the one-label classifier.
SCORE_HEAD_TENSORS = (
    "pooler.dense.weight",
    "pooler.dense.bias",
    "classifier.weight",
    "classifier.bias",
)


class EncoderLoadError(RuntimeError):
    """The export cannot be run by this encoder (another architecture, or a graph it cannot read)."""


@dataclass(frozen=True)
class EncoderSpec:
    """What the forward pass needs besides the weights, from export.json and the graph."""

    layers: int
    attention_heads: int
    layer_norm_eps: float
    # An embedding model's pooling, None for a cross-encoder (its head reads the first token).
    pooling: str | None
    task: str = TASK_EMBED
    # The export takes the pair's token_type_ids (a BERT cross-encoder with two token types).
    token_types: bool = False


def _pytorch_name(name: str) -> str:
    """A parameter's name inside the BertModel (or the head's, `classifier.weight`), without the
    export's wrapper: `encoder.embeddings...`, `classifier.bert.embeddings...` -> `embeddings...`."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return name.removeprefix(prefix).removeprefix(BASE_MODEL_PREFIX)
    return name


def _generated(name: str) -> bool:
    return name.startswith(("onnx::", "/"))


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
        if not _generated(name):
            weights[_pytorch_name(name)] = numpy_helper.to_array(tensor)
    for node in graph.node:
        if node.op_type == "Gemm" and node.input[1] in tensors:
            name, matrix = _gemm_weight(model_path, node, tensors)
            weights[_pytorch_name(name)] = matrix
            continue
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
        weights[_pytorch_name(biases[0]).removesuffix("bias") + "weight"] = matrix.T

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


def _gemm_weight(model_path: Path, node, tensors: dict) -> tuple[str, np.ndarray]:
    """A Gemm's weight as [out, in] under its parameter's name: the weight's own name, or where the
    exporter generated one, its named bias's (as for MatMul)."""
    from onnx import helper, numpy_helper

    attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
    label = node.name or node.output[0]
    if attributes.get("alpha", 1.0) != 1.0 or attributes.get("beta", 1.0) != 1.0 or attributes.get("transA"):
        raise EncoderLoadError(f"{model_path}: Gemm {label} is not a plain linear layer")
    matrix = numpy_helper.to_array(tensors[node.input[1]])
    if not attributes.get("transB"):
        matrix = matrix.T  # stored [in, out]
    if not _generated(node.input[1]):
        return node.input[1], matrix
    bias = node.input[2] if len(node.input) > 2 else ""
    if bias not in tensors or _generated(bias) or not bias.endswith(".bias"):
        raise EncoderLoadError(f"{model_path}: Gemm {label} has neither a named weight nor a named bias")
    return bias.removesuffix("bias") + "weight", matrix


def encoder_spec(export_info: dict, weights: dict[str, np.ndarray], layer_norm_eps: float) -> EncoderSpec:
    model_type = export_info.get("model_type", "bert")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EncoderLoadError(
            f"the torch encoder runs {', '.join(SUPPORTED_MODEL_TYPES)} exports, not {model_type!r}; "
            "serve it on GPU with the official container's configs/gpu.pbtxt (onnxruntime backend)"
        )
    task = export_info.get("task", TASK_EMBED)
    if task not in (TASK_EMBED, TASK_RERANK):
        raise EncoderLoadError(f"unknown task {task!r}: re-export the model (manage.py export_model)")
    pooling = export_info.get("pooling", "mean") if task == TASK_EMBED else None
    if task == TASK_EMBED and pooling not in POOLINGS:
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
    if task == TASK_RERANK:
        missing += [name for name in SCORE_HEAD_TENSORS if name not in weights]
    if layers == 0 or missing:
        kind = "BERT sequence classifier" if task == TASK_RERANK else "BERT encoder"
        raise EncoderLoadError(f"not a {kind} graph: missing {', '.join(missing[:5]) or 'layers'}")
    hidden = weights["embeddings.word_embeddings.weight"].shape[1]
    if hidden % heads:
        raise EncoderLoadError(f"hidden size {hidden} is not a multiple of {heads} attention heads")
    if task == TASK_RERANK and weights["classifier.weight"].shape != (1, hidden):
        raise EncoderLoadError(
            f"the classifier's weight is {list(weights['classifier.weight'].shape)}, not [1, {hidden}]: "
            "a cross-encoder for reranking has one output logit"
        )
    return EncoderSpec(
        layers=layers,
        attention_heads=heads,
        layer_norm_eps=layer_norm_eps,
        pooling=pooling,
        task=task,
        token_types="token_type_ids" in export_info.get("inputs", ()),
    )


class BertEncoder(torch.nn.Module):
    """Embeddings, `layers` post-norm transformer layers (query, key and value in one matrix), then
    an embedding model's pooling and L2 normalisation ([batch, hidden]) or a cross-encoder's pooler
    and classifier ([batch, 1] logits); input_ids, attention_mask and token_type_ids (None: all of
    type 0) [batch, sequence], right-padded."""

    def __init__(self, weights: dict[str, np.ndarray], spec: EncoderSpec) -> None:
        super().__init__()
        self.spec = spec

        def tensor(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(weights[name], dtype=np.float32))  # a writable copy

        head = SCORE_HEAD_TENSORS if spec.task == TASK_RERANK else ()
        for name in EMBEDDING_TENSORS + head:
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

    @property
    def output_dims(self) -> int:
        if self.spec.task == TASK_RERANK:
            return self.classifier_weight.shape[0]
        return self.embeddings_word_embeddings_weight.shape[1]

    def _layer(self, index: int, key: str) -> torch.Tensor:
        return getattr(self, f"layer{index}_{key}")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, length = input_ids.shape
        hidden_size = self.embeddings_word_embeddings_weight.shape[1]
        heads = self.spec.attention_heads
        eps = self.spec.layer_norm_eps
        token_types = self.embeddings_token_type_embeddings_weight
        x = (
            self.embeddings_word_embeddings_weight[input_ids]
            + self.embeddings_position_embeddings_weight[:length]
            + (token_types[0] if token_type_ids is None else token_types[token_type_ids])
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
        if self.spec.task == TASK_RERANK:
            return self._score(x[:, 0])
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

    def _score(self, first: torch.Tensor) -> torch.Tensor:
        """BertPooler then the classifier on each row's first token ([CLS]): [batch, 1] logits. In
        float32, like the pooling above: a float16 tanh and dot product would round the logit."""
        pooled = torch.tanh(
            F.linear(first.float(), self.pooler_dense_weight.float(), self.pooler_dense_bias.float())
        )
        return F.linear(pooled, self.classifier_weight.float(), self.classifier_bias.float())


class Encoder:
    """A BertEncoder on one device and precision, fed and read as numpy."""

    def __init__(self, module: BertEncoder, *, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.module = module.to(device=device, dtype=dtype).eval()
        self.spec = module.spec
        self.dims = module.output_dims

    @torch.inference_mode()
    def embed_tensors(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[rows, sequence] int64 on any device -> [rows, dims] float32 on this encoder's device (a
        cross-encoder's: [rows, 1] logits, from the pairs' token_type_ids where its export takes them)."""
        if self.spec.token_types and token_type_ids is None:
            # All of type 0 would score every pair as if the document were part of the query.
            raise ValueError("this cross-encoder's export takes token_type_ids; none were given")
        input_ids = input_ids.to(self.device, non_blocking=True)
        attention_mask = attention_mask.to(self.device, non_blocking=True)
        if token_type_ids is not None:
            token_type_ids = token_type_ids.to(self.device, non_blocking=True)
        return self.module(input_ids, attention_mask, token_type_ids)

    def embed(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray | None = None
    ) -> np.ndarray:
        """[rows, sequence] int64 numpy -> [rows, dims] float32 numpy (a cross-encoder: [rows, 1])."""
        vectors = self.embed_tensors(
            torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(attention_mask, dtype=np.int64)),
            None
            if token_type_ids is None
            else torch.from_numpy(np.ascontiguousarray(token_type_ids, dtype=np.int64)),
        )
        return vectors.cpu().numpy()


def check_export_dtype(model_path: Path, export_info: dict) -> None:
    """Refuse, before reading any weight, an export whose graph holds no float weights (export.json's
    "dtype"), naming it and how to serve it instead."""
    dtype = export_info.get("dtype") or DEFAULT_EXPORT_DTYPE
    if dtype in FLOAT_WEIGHT_DTYPES:
        return
    version_dir = model_path.parent
    name, version = version_dir.parent.name, version_dir.name
    raise EncoderLoadError(
        f"{model_path}: export.json records dtype {dtype!r}; the torch encoder (embedsite_torch, the "
        f"bundled-gpu config) rebuilds BERT from float weights ({', '.join(FLOAT_WEIGHT_DTYPES)}) and "
        f"cannot run this {dtype} graph. Serve version {version} of {name} with the CPU config "
        "(config.pbtxt or configs/cpu.pbtxt: ONNX Runtime runs it), or pin a float32 export for the "
        f"GPU: manage.py register_model --triton-model {name} --dtype float32"
    )


def load_encoder(model_path: Path, *, device: str | torch.device, dtype: torch.dtype) -> Encoder:
    """The encoder of an exported version: its model.onnx and the export.json beside it."""
    model_path = Path(model_path)
    info_path = model_path.parent / EXPORT_INFO_FILENAME
    export_info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    check_export_dtype(model_path, export_info)
    weights, layer_norm_eps = read_onnx_weights(model_path)
    spec = encoder_spec(export_info, weights, layer_norm_eps)
    return Encoder(BertEncoder(weights, spec), device=torch.device(device), dtype=dtype)
