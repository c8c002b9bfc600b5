"""What a served model does, and what its inputs are for, as export.json, the catalog and the API
name them.

An embedding model (`embed`) turns texts into vectors; a rerank model (`rerank`, a cross-encoder)
scores a (query, document) pair with one logit, turned into a relevance score by its activation.
Plain constants: export tooling, the Django models and the Triton backends' callers all read them.
"""

TASK_EMBED = "embed"
TASK_RERANK = "rerank"
TASKS = (TASK_EMBED, TASK_RERANK)

# A cross-encoder's raw score is a logit; `sigmoid` maps it into (0, 1) as sentence-transformers'
# CrossEncoder does by default for one-label models, `identity` leaves it as it is.
ACTIVATION_SIGMOID = "sigmoid"
ACTIVATION_IDENTITY = "identity"
ACTIVATIONS = (ACTIVATION_SIGMOID, ACTIVATION_IDENTITY)

# What an input is for, as retrieval APIs name it in one word: a catalog model maps each to one of
# its prompts (EmbeddingModel.input_types). Cohere's names for the first two are accepted too.
INPUT_TYPES = ("query", "document", "classification", "clustering")
INPUT_TYPE_ALIASES = {"search_query": "query", "search_document": "document"}
# Every input_type a request may name (the schema's one InputTypeEnum: settings.SPECTACULAR_SETTINGS).
INPUT_TYPE_NAMES = (*INPUT_TYPES, *INPUT_TYPE_ALIASES)

# What an embedding is returned as: float32, or quantised (embeddings.services.inference.quantization):
# int8/uint8 one byte a dimension, binary/ubinary one bit (signs packed eight to a byte).
OUTPUT_TYPES = ("float", "int8", "uint8", "binary", "ubinary")
