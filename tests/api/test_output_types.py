"""Output types, input types and Voyage's fields on POST /v1/embeddings, through the real ASGI app and
Triton: each quantised type against a numpy reference of the float vectors the same request gets."""

from __future__ import annotations

import base64

import numpy as np

from embeddings.models import EmbeddingModel
from embeddings.services.inference.exports import model_export_info
from tests.api.test_embeddings import assert_error
from tests.processes import REPO_ROOT

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "Bananas are yellow.", "日本語"]


def calibration_vectors() -> np.ndarray:
    """The bundled export's calibration vectors, read from the file its export.json names."""
    version_dir = REPO_ROOT / "model_repository" / "minilm" / "1"
    record = model_export_info(repository_dir=version_dir.parent.parent, name="minilm", version=1)[
        "quantization"
    ]
    return np.load(version_dir / record["vectors"]).astype(np.float64)


def int8_reference(floats: np.ndarray, calibration: np.ndarray, *, unsigned: bool = False) -> np.ndarray:
    """int8 written out: one scale for every dimension, the largest magnitude the calibration
    vectors reach, onto -127..127; uint8 the same + 128."""
    scale = np.abs(calibration).max()
    codes = np.clip(np.round(floats.astype(np.float64) * 127 / scale), -127, 127)
    return codes + 128 if unsigned else codes


async def embed(client, alpha, **fields) -> dict:
    response = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": TEXTS} | fields, headers=alpha.headers
    )
    assert response.status_code == 200, response.text
    return response.json()


def rows(body: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in body["data"]])


async def test_each_output_dtype_is_the_float_vectors_quantised(client, alpha):
    floats = rows(await embed(client, alpha)).astype(np.float32)
    calibration = calibration_vectors()

    binary = rows(await embed(client, alpha, output_dtype="binary"))
    assert binary.shape == (len(TEXTS), 48) and binary.min() >= -128 and binary.max() <= 127
    np.testing.assert_array_equal(binary, np.packbits(floats > 0, axis=1).astype(np.int16) - 128)
    ubinary = rows(await embed(client, alpha, output_dtype="ubinary"))
    np.testing.assert_array_equal(ubinary, np.packbits(floats > 0, axis=1))

    step = np.abs(calibration).max() / 127
    for dtype, unsigned in (("int8", False), ("uint8", True)):
        quantised = rows(await embed(client, alpha, output_dtype=dtype))
        assert quantised.shape == (len(TEXTS), 384)
        reference = int8_reference(floats, calibration, unsigned=unsigned)
        # The same formula in float32 on the server: a value on a rounding boundary may land one step off.
        assert np.abs(quantised - reference).max() <= 1, dtype
        assert (quantised == reference).mean() > 0.99, dtype
        # Each value within one step of the float it stands for.
        restored = (quantised - (128 if unsigned else 0)) * step
        assert np.abs(restored - floats).max() <= step, dtype
    # The integer dot product ranks the texts as the float one does.
    codes = rows(await embed(client, alpha, output_dtype="int8")).astype(np.int64)
    assert np.argsort(-(codes[1:] @ codes[0])).tolist() == np.argsort(-(floats[1:] @ floats[0])).tolist()


async def test_base64_carries_the_quantised_bytes(client, alpha):
    listed = rows(await embed(client, alpha, output_dtype="int8"))
    encoded = await embed(client, alpha, output_dtype="int8", encoding_format="base64")
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(item["embedding"]), dtype=np.int8) for item in encoded["data"]]
    )
    np.testing.assert_array_equal(decoded, listed)
    packed = await embed(client, alpha, output_dtype="ubinary", encoding_format="base64")
    assert len(base64.b64decode(packed["data"][0]["embedding"])) == 48


async def test_voyage_fields_beside_openais(client, alpha):
    plain = await embed(client, alpha)
    # output_dimension is dimensions by Voyage's name; input_type on a model that maps none changes nothing.
    short = await embed(client, alpha, output_dimension=128, input_type="query")
    assert rows(short).shape == (len(TEXTS), 128)
    assert np.allclose(rows(short), rows(await embed(client, alpha, dimensions=128)), atol=1e-6)
    assert np.allclose(rows(await embed(client, alpha, input_type="document")), rows(plain), atol=1e-6)
    assert (await embed(client, alpha, truncation=True))["usage"] == plain["usage"]

    async def refused(**fields):
        return await client.post(
            "/v1/embeddings", json={"model": MODEL, "input": TEXTS, **fields}, headers=alpha.headers
        )

    assert_error(await refused(dimensions=64, output_dimension=128), 422, param="output_dimension")
    assert_error(await refused(input_type="web"), 422, param="input_type")
    assert_error(await refused(output_dtype="float16"), 422, param="output_dtype")
    assert_error(
        await refused(output_dtype="binary", dimensions=100), 422, "unsupported_by_model", "output_dtype"
    )
    long_text = await client.post(
        "/v1/embeddings",
        json={"model": MODEL, "input": ["word " * 400], "truncation": False},
        headers=alpha.headers,
    )
    assert_error(long_text, 413, "context_length_exceeded")
    truncated = await client.post(
        "/v1/embeddings", json={"model": MODEL, "input": ["word " * 400]}, headers=alpha.headers
    )
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 256


async def test_models_say_which_output_and_input_types_they_take(client, alpha, model):
    listed = (await client.get(f"/v1/models/{MODEL}", headers=alpha.headers)).json()
    assert listed["output_types"] == ["float", "int8", "uint8", "binary", "ubinary"]
    assert listed["input_types"] is None


async def test_input_types_pick_the_prompts_a_model_maps_them_to(client, alpha, model, settings):
    settings.MODEL_CACHE_SECONDS = 0
    await EmbeddingModel.objects.acreate(
        name="minilm-e5",
        triton_model="minilm",
        dimensions=384,
        max_tokens=256,
        prompts={"query": "query: ", "passage": "passage: "},
        input_types={"query": "query", "document": "passage"},
    )

    async def v2(input_type: str) -> np.ndarray:
        response = await client.post(
            "/v2/embed",
            json={"model": "minilm-e5", "input_type": input_type, "texts": TEXTS},
            headers=alpha.headers,
        )
        assert response.status_code == 200, response.text
        return np.array(response.json()["embeddings"]["float"])

    async def prompted(prefix: str) -> np.ndarray:
        return rows(await embed(client, alpha, input=[prefix + text for text in TEXTS]))

    np.testing.assert_allclose(await v2("search_query"), await prompted("query: "), atol=1e-6)
    np.testing.assert_allclose(await v2("search_document"), await prompted("passage: "), atol=1e-6)
    np.testing.assert_allclose(await v2("clustering"), await prompted(""), atol=1e-6)  # not mapped
    voyage = await client.post(
        "/v1/embeddings",
        json={"model": "minilm-e5", "input": TEXTS, "input_type": "document"},
        headers=alpha.headers,
    )
    np.testing.assert_allclose(rows(voyage.json()), await prompted("passage: "), atol=1e-6)
    listed = (await client.get("/v1/models/minilm-e5", headers=alpha.headers)).json()
    assert listed["input_types"] == {"query": "query", "document": "passage"}
