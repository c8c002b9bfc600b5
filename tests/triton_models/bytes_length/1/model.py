"""Test-only Triton model: per text, [its length in bytes, its first byte or -1] as FP32."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # See instant_1024: under numpy 2 the stub returns empty tensors without an error.
        if int(np.__version__.split(".")[0]) >= 2:
            raise RuntimeError(
                f"the python backend stub loaded numpy {np.__version__} from {np.__file__}; need <2"
            )

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            embedding = np.array([[len(text), text[0] if text else -1] for text in texts], dtype=np.float32)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("embedding", embedding.reshape(-1, 2))])
            )
        return responses
