"""What a served model does, as export.json, the catalog and the API name it.

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
