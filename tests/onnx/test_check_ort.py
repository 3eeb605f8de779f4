"""`check --target ort-cpu` against the installed ONNX Runtime: each verdict is
confirmed by creating a session on the same model."""

from __future__ import annotations

import check_models as models
import onnx
import onnxruntime as ort
import pytest

from bladesmith.onnx.checker import check

h = onnx.helper
T = onnx.TensorProto


def single(op, inputs, outputs, opset, domain="", **attributes):
    """One node; inputs/outputs as (name, elem_type, shape)."""
    node = h.make_node(op, [n for n, *_ in inputs], [n for n, *_ in outputs], name="n",
                       domain=domain, **attributes)  # fmt: skip
    graph = h.make_graph(
        [node],
        "g",
        [h.make_tensor_value_info(*spec) for spec in inputs],
        [h.make_tensor_value_info(*spec) for spec in outputs],
    )
    imports = [h.make_opsetid("", opset)] + ([h.make_opsetid(domain, 1)] if domain else [])
    model = h.make_model(graph, opset_imports=imports)
    model.ir_version = 10
    return model


def calls_local_function(op, elem_type):
    """y = Block(x), Block a model-local function (model.functions) whose body is one
    node `op`(a, a), named body_op."""
    inputs = ["a", "a"] if op in ("Add", "Mul") else ["a"]
    body = [h.make_node(op, inputs, ["b"], name="body_op")]
    function = h.make_function("my.blocks", "Block", ["a"], ["b"], body, [h.make_opsetid("", 17)])
    graph = h.make_graph(
        [h.make_node("Block", ["x"], ["y"], name="call", domain="my.blocks")],
        "g",
        [h.make_tensor_value_info("x", elem_type, [2])],
        [h.make_tensor_value_info("y", elem_type, [2])],
    )
    imports = [h.make_opsetid("", 17), h.make_opsetid("my.blocks", 1)]
    model = h.make_model(graph, opset_imports=imports, functions=[function])
    model.ir_version = 10
    return model


def ort_loads(model) -> bool:
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime's own exception types
        return False
    return True


def errors(model):
    return [f for f in check(model, "ort-cpu") if f.severity == "error"]


CASES = {
    # ONNX function operators without a kernel run as their function bodies.
    "castlike": single("CastLike", [("x", T.FLOAT, [2]), ("y", T.FLOAT16, [1])],
                       [("z", T.FLOAT16, [2])], 21),
    "hardswish": single("HardSwish", [("x", T.FLOAT, [2])], [("y", T.FLOAT, [2])], 22),
    "mish": single("Mish", [("x", T.FLOAT, [2])], [("y", T.FLOAT, [2])], 22),
    # float16 without a float16 kernel runs in float32 between inserted Casts.
    "float16_mul": single("Mul", [("a", T.FLOAT16, [2]), ("b", T.FLOAT16, [2])],
                          [("c", T.FLOAT16, [2])], 14),
    # A kernel for the operator but not for the element type.
    "int16_max": single("Max", [("a", T.INT16, [2]), ("b", T.INT16, [2])],
                        [("c", T.INT16, [2])], 13),
    "bfloat16_add": single("Add", [("a", T.BFLOAT16, [2]), ("b", T.BFLOAT16, [2])],
                           [("c", T.BFLOAT16, [2])], 14),
    # A preview/training domain operator ONNX Runtime does not register.
    "adam": single("Adam", [("r", T.FLOAT, []), ("t", T.INT64, []), ("x", T.FLOAT, [2]),
                            ("g", T.FLOAT, [2]), ("v", T.FLOAT, [2]), ("s", T.FLOAT, [2])],
                   [("x2", T.FLOAT, [2]), ("v2", T.FLOAT, [2]), ("s2", T.FLOAT, [2])],
                   17, domain="ai.onnx.preview.training"),
    # A model-local function runs as its body.
    "local_function_relu": calls_local_function("Relu", T.FLOAT),
    "local_function_bfloat16_add": calls_local_function("Add", T.BFLOAT16),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_verdict_matches_onnxruntime(name):
    model = CASES[name]
    assert bool(errors(model)) == (not ort_loads(model))


def test_type_errors_name_the_type_and_function_errors_name_the_op():
    (finding,) = errors(CASES["int16_max"])
    assert "Max-13" in finding.message and "tensor(int16)" in finding.message
    assert "installed onnxruntime" in finding.source
    (preview,) = errors(CASES["adam"])
    assert "Adam" in preview.message and preview.node == "n"
    assert not [f for f in check(CASES["adam"], "ort-cpu") if f.rule == "custom-op"]


def test_a_local_functions_call_is_not_a_custom_operator_its_body_is_judged():
    assert check(CASES["local_function_relu"], "all") == []
    findings = check(CASES["local_function_bfloat16_add"], "all")
    assert {f.rule for f in findings} == {"unsupported-op", "unsupported-usage"}  # + TRT types
    (cpu,) = [f for f in findings if f.target == "ort-cpu"]
    assert cpu.node.startswith("body_op") and "Add-14" in cpu.message


def test_a_torch_export_of_modules_as_functions_has_no_custom_operators(tmp_path):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x)) + x

    model = torch.nn.Sequential(Block(), Block()).eval()
    path = tmp_path / "blocks.onnx"
    torch.onnx.export(model, (torch.rand(1, 3, 8, 8),), path, opset_version=17, dynamo=False,
                      export_modules_as_functions={Block})  # fmt: skip
    assert onnx.load(path).functions
    assert check(path, "all") == []


def test_batch_first_lstm_is_an_error_on_ort_cpu_and_tensorrt():
    x = ("x", T.FLOAT, [2, 3, 4])
    weights = [("w", T.FLOAT, [1, 20, 4]), ("r", T.FLOAT, [1, 20, 5])]
    out = [("y", T.FLOAT, None)]
    batch_first = single("LSTM", [x, *weights], out, 14, hidden_size=5, layout=1)
    assert not ort_loads(batch_first)
    findings = check(batch_first, ["ort-cpu", "tensorrt"])
    assert {(f.target, f.rule) for f in findings if f.severity == "error"} == {
        ("ort-cpu", "unsupported-usage"),
        ("tensorrt", "unsupported-usage"),
    }
    assert "layout=1" in findings[0].message and "onnxruntime" in findings[0].source
    assert not errors(single("LSTM", [x, *weights], out, 14, hidden_size=5))


def test_custom_domain_stays_a_warning():
    (finding,) = check(models.plugin_feeds_reshape(), "ort-cpu")
    assert (finding.rule, finding.severity) == ("custom-op", "warning")
