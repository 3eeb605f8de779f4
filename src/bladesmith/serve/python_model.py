"""Triton Python-backend model for a bladesmith artifact (copied as ``model.py``).

Each model instance is its own process with its own loaded artifact and runner: no
buffer is shared between instances. The config's parameters name the artifact (beside
this file, with the operator libraries saved with it, which ``bladesmith.load`` loads),
operator libraries to load first (``--load-library``), and the torch threads per instance.
Each request is answered on its own: a bad one gets an error response, the rest of its
dynamic batch is still run. Once bladesmith serve is stopping, a batch of requests that
arrived after the stop is refused as unavailable (``bladesmith.serve.stopping`` says how).
"""

import json
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        # The stub ignores PYTHONPATH: a server for this machine names bladesmith's source.
        if parameters.get("bladesmith_source"):
            sys.path.insert(0, parameters["bladesmith_source"])
        import torch

        import bladesmith
        from bladesmith.serve.signature import BadRequest, BucketRunner
        from bladesmith.serve.stopping import admission
        from bladesmith.trust import QUIET

        self._bad_request = BadRequest
        self._name = args["model_name"]
        self._admitted = admission(
            self._name, args["model_version"], int(config.get("max_batch_size", 0))
        )

        here = Path(args["model_repository"]) / args["model_version"]
        for library in json.loads(parameters.get("libraries", "[]")):
            torch.ops.load_library(str(here / library))
        threads = int(parameters.get("torch_threads", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        if args["model_instance_kind"] == "GPU":
            torch.cuda.set_device(int(args["model_instance_device_id"]))
        # serve said what it trusts, once, before the instances started.
        trust = QUIET if parameters.get("trust") == "true" else False
        self.runner = BucketRunner(
            bladesmith.load(here / parameters["artifact"], trust=trust),
            image_dtype=parameters.get("image_dtype", "float32"),
        )
        self.input_names = [spec.name for spec in self.runner.signature.inputs]

    def execute(self, requests):
        with self._admitted(len(requests)) as admitted:
            if not admitted:
                # An error of its own for each response: the backend frees it with the
                # response (one shared by several crashed tritonserver).
                return [pb_utils.InferenceResponse(error=self._shutting_down()) for _ in requests]
            return self._answer(requests)

    def _answer(self, requests):
        arrays = [
            [
                pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                for name in self.input_names
            ]
            for request in requests
        ]
        responses = []
        for answer in self.runner.answer(arrays):
            if isinstance(answer, str):
                responses.append(pb_utils.InferenceResponse(error=self._error(answer)))
            else:
                tensors = [_tensor(name, value) for name, value in answer.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _shutting_down(self):
        """UNAVAILABLE: HTTP 503, gRPC UNAVAILABLE, which clients may send again."""
        return pb_utils.TritonError(
            f"{self._name}: the server is shutting down; send the request again, to another server",
            pb_utils.TritonError.UNAVAILABLE,
        )

    def _error(self, answer):
        """A refused request is the client's error (INVALID_ARG: HTTP 400, gRPC
        INVALID_ARGUMENT); the model failing is the server's (INTERNAL: 500)."""
        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
        if code is not None and isinstance(answer, self._bad_request):
            return pb_utils.TritonError(str(answer), code)
        return pb_utils.TritonError(str(answer))


def _tensor(name, array):
    """An output tensor, handed over through DLPack: the stub's pybind11 reads a NumPy
    array's item size from NumPy 1's struct layout, so under NumPy 2 an array arrived
    with no bytes. DLPack carries no bool; those go as arrays."""
    import numpy as np
    import torch

    if array.dtype == np.bool_:
        return pb_utils.Tensor(name, array)
    return pb_utils.Tensor.from_dlpack(name, torch.from_numpy(np.ascontiguousarray(array)))
