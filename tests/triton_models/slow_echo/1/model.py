"""Test-only Triton model: sleep `sleep_ms` milliseconds, then return `value` as `echo`; create the
file `started_path` names (if given) as the request starts; stop sleeping once the request is cancelled."""

import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# How often a sleeping request checks whether its client gave up.
CANCEL_CHECK_S = 0.05


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
            started_path = pb_utils.get_input_tensor_by_name(request, "started_path")
            if started_path is not None:
                Path(started_path.as_numpy()[0].decode()).touch()
            wake_at = time.monotonic() + sleep_ms / 1000
            while (left := wake_at - time.monotonic()) > 0:
                if request.is_cancelled():
                    break
                time.sleep(min(left, CANCEL_CHECK_S))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("echo", value)]))
        return responses
