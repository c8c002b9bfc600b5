"""`manage.py register_model`: register an export, load it into the running Triton, say what happened."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from embeddings.models import EmbeddingModel
from embeddings.services.inference.clients import reset_clients, triton_sync_client
from embeddings.tooling.triton_server import free_port
from tests.conftest import write_finished_export

pytestmark = pytest.mark.django_db


def register(*arguments: str) -> str:
    out = io.StringIO()
    call_command("register_model", *arguments, stdout=out)
    return out.getvalue()


def test_registers_and_loads_with_aliases_and_prompts(explicit_triton):
    output = register(
        "--triton-model", "minilm", "--version", "1", "--name", "mini", "--alias", "m1", "--alias", "m2",
        "--prompt", "query=query: ", "--prompt", "passage=", "--default-prompt", "query",
    )  # fmt: skip
    assert "registered mini -> Triton model minilm version 1 (384-d, 256 tokens)" in output
    assert "mini is loaded in Triton and serving" in output
    model = EmbeddingModel.objects.get(name="mini")
    assert (model.aliases, model.prompts, model.default_prompt_name, model.enabled) == (
        ["m1", "m2"],
        {"query": "query: ", "passage": ""},
        "query",
        True,
    )
    assert {m.version for m in triton_sync_client().repository_index() if m.state == "READY"} == {"1"}
    assert model.input_types == {}  # none given: every input type embeds alike


def test_input_types_map_to_the_models_prompts(explicit_triton):
    register(
        "--triton-model", "minilm", "--name", "e5ish",
        "--prompt", "query=query: ", "--prompt", "passage=passage: ",
        "--input-type", "query=query", "--input-type", "document=passage",
    )  # fmt: skip
    assert EmbeddingModel.objects.get(name="e5ish").input_types == {"query": "query", "document": "passage"}
    with pytest.raises(
        CommandError, match="input types: 'clustering' names the prompt 'cluster', which is not one"
    ):
        register("--triton-model", "minilm", "--name", "e5ish", "--input-type", "clustering=cluster")
    with pytest.raises(CommandError, match="unknown input type 'search'"):
        register("--triton-model", "minilm", "--name", "e5ish", "--input-type", "search=query")
    # Registering again without --input-type keeps the mapping.
    register("--triton-model", "minilm", "--name", "e5ish")
    assert EmbeddingModel.objects.get(name="e5ish").input_types == {"query": "query", "document": "passage"}


def test_a_load_triton_refuses_exits_non_zero_and_leaves_the_row_disabled(explicit_triton):
    # `broken` is a finished export whose configuration names a backend Triton does not have.
    with pytest.raises(CommandError, match=r"Triton could not load broken version 1: .*no_such_backend"):
        register("--triton-model", "broken")
    assert not EmbeddingModel.objects.get(name="broken").enabled


def test_triton_not_running_registers_to_load_at_start(explicit_triton, settings):
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"
    reset_clients()
    output = register("--triton-model", "minilm_copy")
    assert "Triton is not reachable (TritonUnavailable): minilm_copy loads when the stack starts" in output
    assert EmbeddingModel.objects.get(name="minilm_copy").enabled


def test_bad_arguments_are_clear_errors(explicit_triton):
    with pytest.raises(CommandError, match="no finished export version 9"):
        register("--triton-model", "minilm", "--version", "9")
    with pytest.raises(CommandError, match=r"--prompt"):
        register("--triton-model", "minilm", "--prompt", "no-equals-sign")
    assert not EmbeddingModel.objects.exists()


def test_dtype_pins_the_newest_export_of_it_or_is_refused_naming_export_model(tmp_path, settings):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"  # nothing to load into: the pin is the point
    reset_clients()
    write_finished_export(tmp_path, version=1)
    with pytest.raises(
        CommandError, match=r"no finished int8 export .*export_model --name minilm --dtype int8"
    ):
        register("--triton-model", "minilm", "--dtype", "int8")
    write_finished_export(tmp_path, version=2, extra={"dtype": "int8"})
    write_finished_export(tmp_path, version=3, extra={"dtype": "float32"})
    output = register("--triton-model", "minilm", "--dtype", "int8")
    assert "registered minilm -> Triton model minilm version 2 (384-d, 256 tokens, int8)" in output
    register("--triton-model", "minilm", "--dtype", "float32")
    assert EmbeddingModel.objects.get(name="minilm").triton_version == "3"
    write_finished_export(tmp_path, version=4, extra={"dtype": "float16"})
    output = register("--triton-model", "minilm", "--name", "minilm-gpu", "--dtype", "float16")
    assert "registered minilm-gpu -> Triton model minilm version 4 (384-d, 256 tokens, float16)" in output
    assert EmbeddingModel.objects.get(name="minilm").triton_version == "3"
    with pytest.raises(CommandError, match="invalid choice: 'int4'"):
        register("--triton-model", "minilm", "--dtype", "int4")
    reset_clients()


@pytest.mark.parametrize("config_name", ["bundled-gpu", "", "gpu"])
def test_pinning_int8_for_the_torch_gpu_config_warns_and_still_registers(tmp_path, settings, config_name):
    settings.TRITON_MODEL_REPOSITORY = str(tmp_path)
    settings.TRITON_MODEL_CONFIG_NAME = config_name
    settings.TRITON_GRPC_TARGET = f"127.0.0.1:{free_port()}"  # nothing to load into: the warning is the point
    reset_clients()
    write_finished_export(tmp_path, version=1, extra={"dtype": "float32"})
    write_finished_export(tmp_path, version=2, extra={"dtype": "int8"})
    warnings = io.StringIO()

    call_command(
        "register_model", "--triton-model", "minilm", "--dtype", "int8", stdout=io.StringIO(), stderr=warnings
    )
    call_command(
        "register_model",
        "--triton-model",
        "minilm",
        "--dtype",
        "float32",
        stdout=io.StringIO(),
        stderr=warnings,
    )

    expected = (
        "warning: minilm version 2 is an int8 export and TRITON_MODEL_CONFIG_NAME=bundled-gpu loads it with "
        "embedsite_torch"
    )
    # Only for the int8 pin and the config whose backend cannot run it (the official gpu config's can).
    assert warnings.getvalue().count(expected) == (config_name == "bundled-gpu")
    assert "warning" not in warnings.getvalue().replace(expected, "")
    assert EmbeddingModel.objects.get(name="minilm").triton_version == "1"
    reset_clients()
