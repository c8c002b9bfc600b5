"""Triton python-backend model: UTF-8 text in, padded `input_ids` and `attention_mask` out.

The tokenizer is the tokenizer.json exported beside the target model (truncation at its max tokens,
padding to the longest text of each request), read from this model repository, never from a hub.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

TOKENIZER_FILENAME = "tokenizer.json"


def _invalid_argument(message: str):
    """A per-request error that clients see as INVALID_ARGUMENT (HTTP 400), not an internal failure."""
    return pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)


def _parameters(model_config: dict) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if int(np.__version__.split(".")[0]) >= 2:  # see minilm/1/model.py: the stub needs numpy<2
            raise RuntimeError(f"the python backend stub loaded numpy {np.__version__} from {np.__file__}")
        from tokenizers import Tokenizer

        parameters = _parameters(json.loads(args["model_config"]))
        target_model = parameters.get("target_model", "minilm")
        target_version = parameters.get("target_version", "1")
        tokenizer_path = (
            Path(args["model_repository"]).parent / target_model / target_version / TOKENIZER_FILENAME
        )
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"{tokenizer_path} is missing: run `python manage.py export_model` first")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        if self.tokenizer.padding is None:  # every request's rows must share one length
            self.tokenizer.enable_padding()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                input_ids, attention_mask = self._tokenize(request)
            except ValueError as error:
                responses.append(pb_utils.InferenceResponse(error=_invalid_argument(str(error))))
                continue
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("input_ids", input_ids),
                        pb_utils.Tensor("attention_mask", attention_mask),
                    ]
                )
            )
        return responses

    def _tokenize(self, request) -> tuple[np.ndarray, np.ndarray]:
        texts = pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)
        try:
            decoded = [text.decode("utf-8") if isinstance(text, bytes) else str(text) for text in texts]
        except UnicodeDecodeError as error:
            raise ValueError(f"text is not valid UTF-8: {error}") from error
        encodings = self.tokenizer.encode_batch(decoded)
        input_ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
        attention_mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
        return input_ids.reshape(len(decoded), -1), attention_mask.reshape(len(decoded), -1)
