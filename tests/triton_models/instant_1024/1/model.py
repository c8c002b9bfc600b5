"""Test-only Triton model: a 1024-d "embedding" per row, computed instantly.

Row i is filled with input_ids[i, 0] as float32, and element 1 is the number of attended
tokens (attention_mask[i].sum()), so a caller can check row order and that both inputs
arrived. With ragged batching, the dynamic batcher hands over several requests whose
sequence lengths differ; the Python backend does not merge them, so each request is
answered on its own with exactly its own number of rows.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

DIMENSIONS = 1024


class TritonPythonModel:
    def initialize(self, args):
        # The stub is built against numpy 1.x; under numpy 2 (a `python3` outside the virtualenv
        # first on PATH) tensors come back empty or garbled without an error. Refuse to load.
        if int(np.__version__.split(".")[0]) >= 2:
            raise RuntimeError(
                f"the python backend stub loaded numpy {np.__version__} from {np.__file__}; need <2"
            )

    def execute(self, requests):
        responses = []
        for request in requests:
            input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            attention_mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            rows = input_ids.shape[0]
            embedding = np.empty((rows, DIMENSIONS), dtype=np.float32)
            embedding[:] = input_ids[:, :1] if input_ids.shape[1] else 0
            embedding[:, 1] = attention_mask.sum(axis=1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", embedding)]))
        return responses
