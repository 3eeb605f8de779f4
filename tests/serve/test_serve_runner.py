"""The runner each model instance owns: buckets, padding, per-request refusals, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import NET_BATCH, tiny_net

import bladesmith
from bladesmith.errors import BladesmithError
from bladesmith.serve.signature import BucketRunner, signature_of


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, 8, 8), dtype=np.float32)


def expected(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        scores, best = tiny_net()(torch.from_numpy(x))
    return scores.numpy(), best.numpy()


def test_signature_has_real_dtypes_fixed_rows_and_the_artifacts_batch(net_artifacts):
    signature = signature_of(bladesmith.load(net_artifacts[".pt"]))
    assert signature.bucket == NET_BATCH and not signature.detections
    [image] = signature.inputs
    assert (image.name, image.triton_dtype, image.dims) == ("input_0", "FP32", (3, 8, 8))
    scores, best = signature.outputs
    assert (scores.triton_dtype, scores.dims, scores.scalar) == ("FP32", (5,), False)
    assert (best.triton_dtype, best.dims, best.scalar) == ("INT64", (1,), True)


@pytest.mark.parametrize("suffix", [".pt", ".onnx"])
def test_requests_are_cut_into_buckets_padded_and_given_back_their_own_rows(net_artifacts, suffix):
    runner = BucketRunner(bladesmith.load(net_artifacts[suffix]))
    requests = [rows(1, 1), rows(3, 2), rows(5, 3)]  # 9 rows: 3 buckets, the last padded
    answers = runner.answer([[x] for x in requests])
    for x, answer in zip(requests, answers):
        scores, best = expected(x)
        np.testing.assert_allclose(answer["output_0"], scores, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(answer["output_1"], best.reshape(-1, 1))
        assert answer["output_1"].dtype == np.int64


def test_a_bad_request_is_refused_alone(net_artifacts):
    runner = BucketRunner(bladesmith.load(net_artifacts[".pt"]))
    good = rows(2, 4)
    nan = rows(1, 5)
    nan[0, 1, 2, 3] = np.nan
    infinite = rows(1, 6)
    infinite[0, 0, 0, 0] = np.inf
    answers = runner.answer(
        [
            [good],
            [nan],
            [infinite],
            [rows(1, 7)[:, :, :4]],  # wrong shape
            [rows(1, 8).astype(np.float64)],  # wrong dtype
            [rows(0, 9)],  # no rows
            [],  # no input
        ]
    )
    np.testing.assert_allclose(answers[0]["output_0"], expected(good)[0], rtol=1e-4, atol=1e-5)
    assert "non-finite" in answers[1] and "non-finite" in answers[2]
    assert "expected shape [N, 3, 8, 8], got [1, 3, 4, 8]" in answers[3]
    assert "expected FP32, got float64" in answers[4]
    assert "empty" in answers[5]
    assert "expected 1 inputs, got 0" in answers[6]


def test_a_failing_model_fails_its_batch_with_a_one_line_reason():
    class Broken:
        def __call__(self, x):
            raise RuntimeError("kernel exploded\nwith a long second line")

    runner = BucketRunner.__new__(BucketRunner)
    runner.run = Broken()
    runner.signature = signature_of_net()
    assert runner.answer([[rows(1, 0)]]) == ["the model failed: RuntimeError: kernel exploded"]


def signature_of_net():
    from bladesmith.serve.signature import INPUT_DTYPE, Signature, TensorSpec

    return Signature(
        (TensorSpec("input_0", INPUT_DTYPE, (3, 8, 8)),),
        (TensorSpec("output_0", np.dtype(np.float32), (5,)),),
        NET_BATCH,
        detections=False,
    )


@pytest.mark.parametrize("suffix", [".pt", ".onnx"])
def test_one_loaded_artifact_called_from_8_threads_gives_each_caller_its_answer(
    net_artifacts, suffix
):
    loaded = bladesmith.load(net_artifacts[suffix])
    inputs = [torch.from_numpy(rows(NET_BATCH, 100 + i)) for i in range(8)]
    serial = [loaded(x)[0].clone() for x in inputs]
    mismatches, errors = [], []
    start = threading.Barrier(8)

    def call(i: int) -> None:
        try:
            start.wait()
            for _ in range(25):
                scores, _ = loaded(inputs[i])
                if not torch.allclose(scores, serial[i], rtol=1e-5, atol=1e-6):
                    mismatches.append(i)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and not mismatches
    assert len({tuple(s[0].tolist()) for s in serial}) == 8  # the answers do differ


def test_outputs_without_a_batch_dimension_cannot_be_served(tmp_path):
    from conftest import QUICK
    from torch import nn

    class Pooled(nn.Module):
        def forward(self, x):
            return x.mean(), x * 2

    x = torch.randn(2, 3)
    optimized, _, _ = bladesmith.optimize(
        Pooled(), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    loaded = bladesmith.load(bladesmith.save(optimized, tmp_path / "pooled.pt"))
    with pytest.raises(BladesmithError, match="output 'output_0' has shape \\[\\]"):
        signature_of(loaded)
