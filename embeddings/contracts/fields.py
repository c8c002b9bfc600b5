"""Request fields that take JSON types as they are, shared by every request contract and serializer.

And `validated`: a body read with a serializer, its refusal the API's 422 (errors/answers.py).
"""

from __future__ import annotations

import re

from django.core.validators import ProhibitNullCharactersValidator, RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from embeddings.errors.answers import ValidationFailed

# --- JSON types taken as they are ------------------------------------------------------------------
# DRF's fields coerce: "user": 0 becomes "0", "normalize": 0 becomes false, "dimensions": "64"
# becomes 64. A JSON body must send the type the schema names; multipart form fields are text by
# nature and keep DRF's reading (the serializer's context says `form`).


def _is_form(field: serializers.Field) -> bool:
    return bool(field.context.get("form"))


class StrictCharField(serializers.CharField):
    """A JSON string, taken as sent; a number or a boolean is refused.

    DRF would strip surrounding whitespace first: a model named " minilm" was found, and a "\v"
    refused as blank although the schema's minLength counts it.

    lookup: the value is only looked up or recorded (a model's name, a prompt's), never stored in
    the database, so a NUL (which PostgreSQL cannot store) is a character like any other: it names
    no model, where DRF would refuse it against the schema's word.
    """

    def __init__(self, *, lookup: bool = False, **options) -> None:
        super().__init__(trim_whitespace=False, **options)
        if lookup:
            self.validators = [
                validator
                for validator in self.validators
                if not isinstance(validator, ProhibitNullCharactersValidator)
            ]

    def to_internal_value(self, data):
        if not isinstance(data, str) and not _is_form(self):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """JSON true or false; 0, 1 and strings are refused. As a form field, `true` or `false` (DRF
    would also read 0, 1, yes, no, on, off...)."""

    default_error_messages = {"invalid": "Must be true or false."}
    FORM_VALUES = {"true": True, "false": False}

    def to_internal_value(self, data):
        if _is_form(self):
            if data not in self.FORM_VALUES:
                self.fail("invalid")
            return self.FORM_VALUES[data]
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


# The bound of every integer that counts a model's or a job's things (dimensions, token ids, inputs):
# the database keeps them in 32-bit columns, and no model or job comes near it.
INT32_MAX = 2**31 - 1

# An integer written as text (a query parameter, a form field): ASCII digits, a minus sign at most.
# Python's int() would also read " 1", "+1", "1_000" and other scripts' digits, and DRF's field
# "1.0": none of them is an integer as the schema writes one.
DECIMAL_INTEGER = re.compile(r"-?[0-9]+")
INTEGER_TEXT_ERROR = "A valid integer is required: decimal digits only, e.g. 20."


def _integer_text(field: serializers.IntegerField, data: object) -> None:
    if not isinstance(data, str) or not DECIMAL_INTEGER.fullmatch(data):
        field.fail("invalid")


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer (5.0 is one, as JSON Schema reads it); strings and booleans are refused. As a
    form field, decimal digits only."""

    default_error_messages = {"invalid": INTEGER_TEXT_ERROR}

    def to_internal_value(self, data):
        if _is_form(self):
            _integer_text(self, data)
        elif isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        elif isinstance(data, float):
            # JSON integers past 64 bits arrive as floats (orjson): still integers, held to the bounds.
            if not data.is_integer():
                self.fail("invalid")
            data = int(data)
        return super().to_internal_value(data)


class QueryIntegerField(serializers.IntegerField):
    """An integer query parameter: decimal digits only, and bounded (the schema's `maximum`), so
    that no value outgrows what the response can echo (orjson renders at most 64-bit integers)."""

    default_error_messages = {"invalid": INTEGER_TEXT_ERROR}

    def __init__(self, *, min_value: int, max_value: int, **options) -> None:
        super().__init__(min_value=min_value, max_value=max_value, **options)

    def to_internal_value(self, data):
        _integer_text(self, data)
        return super().to_internal_value(data)


def id_schema(pattern: str) -> dict:
    """The schema of a path parameter that is an object's id (`pattern`, as its service draws it)."""
    return {"type": "string", "pattern": f"^{pattern}$"}


def cursor_field(*, pattern: str, what: str) -> serializers.CharField:
    """A list's `after`: an id from the previous page (its last_id), or empty for the first page. A
    string that cannot be an id is 422; an id of no object of yours, 404 (as in a path)."""
    # \A and \Z: the whole value (a "$" would also match before a trailing newline); the schema
    # shows them as ^ and $, beside the empty string allow_blank adds.
    return serializers.CharField(
        required=False,
        allow_blank=True,
        trim_whitespace=False,
        validators=[RegexValidator(rf"\A{pattern}\Z", message=f"must be {what} from a previous page")],
        help_text=f"{what[0].upper()}{what[1:]} from the previous page (its `last_id`): the page "
        "after it. Empty: the first page.",
    )


def dimensions_field(help_text: str = "") -> StrictIntegerField:
    """The optional `dimensions` of requests and jobs: an integer from 1. Whether the model has that
    many is the services' rule (embeddings.services.inference.embedding.dimensions_check: 422
    unsupported_by_model)."""
    return StrictIntegerField(
        min_value=1,
        max_value=INT32_MAX,
        required=False,
        allow_null=True,
        help_text=help_text
        or "Keep the first N dimensions, re-normalised: at most the model's `dimensions` "
        "(GET /v1/models; more is 422 unsupported_by_model).",
    )


def validated(serializer_class: type, data: object, *, form: bool = False) -> dict:
    """The serializer's validated data. form: the values are multipart form fields (text), read
    as DRF reads them; otherwise JSON values must have the type the schema names.

    Raises ValidationFailed (not an object) or DRF's ValidationError, as `is_valid` would."""
    if not isinstance(data, dict):
        raise ValidationFailed("The request body must be a JSON object.")
    return bound_contract(serializer_class, form=form).run_validation(data)


# Serializers whose fields are bound once, by class and reading (see bound_contract).
_bound_contracts: dict[tuple[type, bool], serializers.Serializer] = {}


def bound_contract(serializer_class: type, *, form: bool = False) -> serializers.Serializer:
    """One instance of the serializer per process (and reading), to validate with: DRF copies a
    serializer's declared fields for every instance it makes (deep copies, validators and all),
    which cost a one-text embeddings request as much web CPU as its quota round trip. Its fields
    keep no state between validations (our contracts read no `initial_data`), so one instance
    validates every request, from any thread, as a fresh one would."""
    key = (serializer_class, form)
    contract = _bound_contracts.get(key)
    if contract is None:
        contract = serializer_class(context={"form": form})
        contract.fields  # noqa: B018  bound now, not by two threads at once later
        _bound_contracts[key] = contract
    return contract


# As OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


@extend_schema_field(
    {
        "type": "object",
        # Keys' bounds cannot be written in OpenAPI 3.0 (propertyNames is 3.1's): the description says them.
        "additionalProperties": {
            "type": "string",
            "maxLength": METADATA_MAX_VALUE_CHARS,
            "pattern": "^[^\\u0000]*$",
        },
        "maxProperties": METADATA_MAX_PAIRS,
        "description": f"Up to {METADATA_MAX_PAIRS} string pairs of your own, returned with the job "
        f"(keys up to {METADATA_MAX_KEY_CHARS} characters, values up to {METADATA_MAX_VALUE_CHARS}; "
        "no NUL character).",
        "example": {"corpus": "wiki-2026-11"},
    }
)
class MetadataField(serializers.Field):
    default_error_messages = {
        "invalid": "must be an object of string keys and string values",
        "too_many": f"may have at most {METADATA_MAX_PAIRS} pairs",
        "key_too_long": f"keys may have at most {METADATA_MAX_KEY_CHARS} characters",
        "value_too_long": f"values may have at most {METADATA_MAX_VALUE_CHARS} characters",
        # PostgreSQL's jsonb cannot hold U+0000 (it would fail the insert, a 500).
        "key_null_character": "keys may not contain the NUL character (U+0000)",
        "value_null_character": "values may not contain the NUL character (U+0000)",
    }

    def to_internal_value(self, data: object) -> dict[str, str]:
        if not isinstance(data, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in data.items()
        ):
            self.fail("invalid")
        if len(data) > METADATA_MAX_PAIRS:
            self.fail("too_many")
        if any(len(key) > METADATA_MAX_KEY_CHARS for key in data):
            self.fail("key_too_long")
        if any(len(value) > METADATA_MAX_VALUE_CHARS for value in data.values()):
            self.fail("value_too_long")
        if any("\x00" in key for key in data):
            self.fail("key_null_character")
        if any("\x00" in value for value in data.values()):
            self.fail("value_null_character")
        return data

    def to_representation(self, value):
        return value
