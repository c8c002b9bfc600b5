"""The bodies of TEI's POST /tokenize and POST /decode.

Ids can be tens of thousands long, so the ids field checks types in one pass instead of running a
DRF field per id.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.contracts.embeddings_request import TOKEN_ID_SCHEMA, TextsField, is_token_list
from embeddings.contracts.fields import INT32_MAX, StrictBooleanField, StrictCharField

MODEL_HELP = "Default: the server's default embedding model (as /embed's). A rerank model may be named."
IDS_HELP = (
    "Token ids of the model's tokenizer: one sequence, or an array of sequences (ids outside the "
    "model's vocabulary: 422 unsupported_by_model)."
)


@extend_schema_field(
    {
        "oneOf": [
            {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
            {
                "type": "array",
                "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
                "minItems": 1,
            },
        ],
        "description": IDS_HELP,
        "example": [101, 7592, 2088, 102],
    }
)
class TokenIdSequencesField(serializers.Field):
    """`[id, ...]` (one sequence) or `[[id, ...], ...]`, always read as a list of sequences."""

    default_error_messages = {
        "invalid": "must be an array of token ids or an array of arrays of token ids",
        "empty": "must not be empty",
        "empty_sequence": "item {index} is an empty array of token ids",
        "token_range": f"item {{index}} has a token id outside 0 to {INT32_MAX}",
    }

    def to_internal_value(self, data: object) -> list[list[int]]:
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        if is_token_list(data):
            rows = [data]
        elif all(is_token_list(item) for item in data):
            rows = data
        else:
            self.fail("invalid")
        for index, row in enumerate(rows):
            if not row:
                self.fail("empty_sequence", index=index)
            if min(row) < 0 or max(row) > INT32_MAX:
                self.fail("token_range", index=index)
        return rows

    def to_representation(self, value):
        return value


class TeiTokenizeRequest(serializers.Serializer):
    """TEI's tokenize."""

    inputs = TextsField(help_text="A text, or an array of texts, tokenised untruncated.")
    add_special_tokens = StrictBooleanField(
        default=True, help_text="Add the model's special tokens ([CLS] ... [SEP]), as it embeds a text."
    )
    prompt_name = StrictCharField(
        lookup=True,
        required=False,
        allow_null=True,
        help_text="A prompt of the model, e.g. `query`, prepended to each input and tokenised with it "
        "(default: the model's default prompt, if it has one; one it lacks: 422 unsupported_by_model).",
    )
    model = StrictCharField(lookup=True, required=False, help_text=MODEL_HELP)


class TeiDecodeRequest(serializers.Serializer):
    """TEI's decode."""

    ids = TokenIdSequencesField(help_text=IDS_HELP)
    skip_special_tokens = StrictBooleanField(
        default=True, help_text="Leave the model's special tokens ([CLS], [SEP], [PAD]) out of the text."
    )
    model = StrictCharField(lookup=True, required=False, help_text=MODEL_HELP)
