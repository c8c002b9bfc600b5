"""Test-only Triton model: sleep `sleep_ms` milliseconds, then return `value` as `echo`."""

import time

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
            sleep_ms = int(pb_utils.get_input_tensor_by_name(request, "sleep_ms").as_numpy()[0])
            value = pb_utils.get_input_tensor_by_name(request, "value").as_numpy()
            time.sleep(sleep_ms / 1000)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("echo", value)]))
        return responses
