"""The bodies of rerank requests in the three shapes clients send: Cohere's v2 (POST /v2/rerank),
the one Jina and Cohere's v1 share (POST /v1/rerank) and TEI's (POST /rerank).

Documents can be a thousand items long, so the documents field checks types in one pass instead
of running a DRF field per item.
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.contracts.embeddings_request import TEXT_ERRORS, TEXT_SCHEMA, refuse_empty_texts
from embeddings.contracts.fields import StrictBooleanField, StrictCharField, StrictIntegerField

DOCUMENTS_HELP = "The documents to rank against the query: strings, or objects with a `text` string."
TOP_N_HELP = "Answer only the best N documents (default: all of them, best first)."
MAX_TOKENS_PER_DOC_HELP = (
    "Truncate each document to this many tokens (default and most: RERANK_MAX_TOKENS_PER_DOCUMENT, "
    "4096; the model's own maximum is the limit either way)."
)


@extend_schema_field(
    {
        "type": "array",
        "items": {
            "oneOf": [
                TEXT_SCHEMA,
                {"type": "object", "properties": {"text": TEXT_SCHEMA}, "required": ["text"]},
            ]
        },
        "minItems": 1,
        "example": ["Paris is the capital of France.", "Berlin is the capital of Germany."],
    }
)
class DocumentsField(serializers.Field):
    default_error_messages = {
        "invalid": 'must be an array of strings or of objects like {{"text": "..."}}',
        "empty": "must not be empty",
        **TEXT_ERRORS,
    }

    def to_internal_value(self, data: object) -> list[str]:
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        if all(type(item) is str for item in data):
            texts = data
        else:
            try:
                texts = [item if type(item) is str else item["text"] for item in data]
            except (TypeError, KeyError):
                self.fail("invalid")
            if not all(type(text) is str for text in texts):
                self.fail("invalid")
        refuse_empty_texts(texts, self)
        return texts

    def to_representation(self, value):
        return value


def query_field(**options) -> StrictCharField:
    return StrictCharField(
        min_length=1, help_text="The search query the documents are ranked against.", **options
    )


def max_tokens_per_doc_field() -> StrictIntegerField:
    # The server's ceiling is in the schema, so a client (and the fuzzer) knows what is valid.
    return StrictIntegerField(
        min_value=2,
        max_value=settings.RERANK_MAX_TOKENS_PER_DOCUMENT,
        required=False,
        help_text=MAX_TOKENS_PER_DOC_HELP,
    )


def top_n_field() -> StrictIntegerField:
    return StrictIntegerField(min_value=1, required=False, help_text=TOP_N_HELP)


class CohereRerankRequest(serializers.Serializer):
    """Cohere's v2 rerank (what `cohere.ClientV2.rerank` sends)."""

    model = StrictCharField(lookup=True, help_text="A model that ranks (GET /v1/models: `rerank`).")
    query = query_field()
    documents = DocumentsField(help_text=DOCUMENTS_HELP)
    top_n = top_n_field()
    max_tokens_per_doc = max_tokens_per_doc_field()


class RerankRequest(serializers.Serializer):
    """The shape Jina's and Cohere's v1 rerank share."""

    model = StrictCharField(
        lookup=True,
        required=False,
        help_text="A model that ranks (GET /v1/models: `rerank`); default: a rerank model this key may "
        "use, else the default embedding model if it ranks.",
    )
    query = query_field()
    documents = DocumentsField(help_text=DOCUMENTS_HELP)
    top_n = top_n_field()
    return_documents = StrictBooleanField(default=False, help_text="Add each result's document text.")
    max_tokens_per_doc = max_tokens_per_doc_field()


class TeiRerankRequest(serializers.Serializer):
    """TEI's rerank."""

    query = query_field()
    texts = DocumentsField(help_text=DOCUMENTS_HELP)
    raw_scores = StrictBooleanField(
        default=False,
        help_text="A cross-encoder's logits, its activation (sigmoid, GET /v1/models) not applied; "
        "similarity scores are the same either way.",
    )
    return_text = StrictBooleanField(default=False, help_text="Add each result's text.")
    truncate = StrictBooleanField(
        default=False, help_text="Truncate texts longer than the model takes; false: refuse them (413)."
    )
    truncation_direction = serializers.ChoiceField(choices=["Left", "Right"], default="Right")
