"""Input types without Triton: which prompt a request's input_type picks, and what is refused."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from embeddings.errors.service import InvalidRequest, UnsupportedByModel
from embeddings.models import EmbeddingModel
from embeddings.services.inference.embedding import EmbeddingTarget

pytestmark = pytest.mark.unit

PROMPTS = {"query": "query: ", "passage": "passage: ", "classify": "classify: "}


def target(**fields) -> EmbeddingTarget:
    model = EmbeddingModel(
        name="e5", triton_model="m", dimensions=8, max_tokens=16, prompts=PROMPTS, **fields
    )
    return EmbeddingTarget.for_model(model)


def test_an_input_type_picks_the_prompt_the_model_maps_it_to():
    mapped = target(input_types={"query": "query", "document": "passage"})
    assert mapped.prompt(None, "query") == "query: "
    assert mapped.prompt(None, "document") == "passage: "
    # Cohere's words for the same two.
    assert mapped.prompt(None, "search_query") == "query: "
    assert mapped.prompt(None, "search_document") == "passage: "
    # An input type the model does not map embeds as by default; a prompt named outright wins.
    assert mapped.prompt(None, "clustering") == ""
    assert mapped.prompt("classify", "query") == "classify: "


def test_a_model_without_a_mapping_embeds_every_input_type_alike():
    plain = target(default_prompt_name="classify")
    for input_type in ("query", "document", "classification", "clustering", "search_query"):
        assert plain.prompt(None, input_type) == "classify: "


def test_unknown_input_types_and_names_are_refused():
    with pytest.raises(InvalidRequest, match="Unknown input_type 'search'"):
        target(input_types={"query": "query"}).prompt(None, "search")
    with pytest.raises(UnsupportedByModel, match="Unknown prompt_name 'nope'"):
        target().prompt("nope", "query")


def test_the_catalog_refuses_a_mapping_to_no_prompt_or_of_no_input_type():
    with pytest.raises(ValidationError, match="names the prompt 'missing'"):
        EmbeddingModel(name="x", prompts=PROMPTS, input_types={"query": "missing"}).clean()
    with pytest.raises(ValidationError, match="unknown input type 'search'"):
        EmbeddingModel(name="x", prompts=PROMPTS, input_types={"search": "query"}).clean()
    with pytest.raises(ValidationError, match="a JSON object"):
        EmbeddingModel(name="x", prompts=PROMPTS, input_types=["query"]).clean()
    EmbeddingModel(name="x", prompts=PROMPTS, input_types={"document": "passage"}).clean()


def test_ranking_by_similarity_takes_the_prompts_the_input_types_map():
    from embeddings.services.inference.ranking import DOCUMENT_PROMPTS, _prompt

    mapped = target(input_types={"query": "classify", "document": "query"})
    assert _prompt(mapped, "query", ("query",)) == "classify: "
    assert _prompt(mapped, "document", DOCUMENT_PROMPTS) == "query: "
    # Without a mapping, the prompts named so.
    assert _prompt(target(), "query", ("query",)) == "query: "
    assert _prompt(target(), "document", DOCUMENT_PROMPTS) == "passage: "
