"""Whose an operator namespace is, decided from where the dispatcher says it was
registered: every namespace torch and torchvision register is theirs (those a fixed list
once missed included), the user's C++ and Python registrations are the user's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from bladesmith.errors import BladesmithError
from bladesmith.ops import libraries
from bladesmith.ops.namespaces import is_builtin, registered_from_python_only
from bladesmith.serve import repository
from engine_testing import USER_OPERATOR

# torch namespaces the hand-written list had not named: C++ ones and lazily registered
# Python ones (quantized_decomposed: PT2E quantization's quantize/dequantize).
_MISSED_CPP = ("sparse", "onednn", "mkldnn_prepacked", "symm_mem", "static_runtime", "quantization")
_MISSED_PYTHON = ("quantized_decomposed", "_native", "export")


def test_every_namespace_torch_and_torchvision_register_is_builtin():
    # A new process: this one holds the namespaces other tests registered.
    script = textwrap.dedent(
        """
        import torch, torchvision
        import torch.ao.quantization.fx._decomposed, torch._inductor.test_operators
        from bladesmith.ops.namespaces import is_builtin
        names = {name.partition("::")[0] for name in torch._C._dispatch_get_all_op_names()}
        print(len(names), sorted(name for name in names if not is_builtin(name)))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    count, users = result.stdout.split(" ", 1)
    assert int(count) > 30 and users.strip() == "[]"


def test_namespaces_a_fixed_list_missed_are_told_by_where_they_were_registered():
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed

    for namespace in (*_MISSED_CPP, *_MISSED_PYTHON):
        assert is_builtin(namespace), namespace
    assert not any(map(registered_from_python_only, _MISSED_CPP))
    assert all(map(registered_from_python_only, _MISSED_PYTHON))
    assert not registered_from_python_only("aten") and not registered_from_python_only("prims")


def test_the_users_registrations_are_the_users(user_library):
    namespace = USER_OPERATOR.split("::")[0]
    assert not is_builtin(namespace)  # C++, TORCH_LIBRARY in a library built here
    definition = torch.library.Library("namespaces_test_def", "DEF")
    definition.define("twice(Tensor x) -> Tensor")
    torch.library.define("namespaces_test_fn::twice", "(Tensor x) -> Tensor")

    @torch.library.custom_op("namespaces_test_op::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    for user in ("namespaces_test_def", "namespaces_test_fn", "namespaces_test_op", namespace):
        assert not is_builtin(user) and not registered_from_python_only(user), user
    assert not is_builtin("namespaces_test_not_loaded_yet")


class Quantizes(nn.Module):
    """PT2E quantization's quantize/dequantize around a convolution."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        ops = torch.ops.quantized_decomposed
        q = ops.quantize_per_tensor(x, 0.02, 0, -128, 127, torch.int8)
        return self.conv(ops.dequantize_per_tensor(q, 0.02, 0, -128, 127, torch.int8))


def test_torchs_python_operators_are_not_the_users_and_libtorch_refuses_them(tmp_path):
    import torch.ao.quantization.fx._decomposed  # noqa: F401

    model, x = Quantizes().eval(), torch.rand(1, 3, 8, 8)
    assert libraries.operators_called(model, (x,)) == set()
    path = tmp_path / "quantizes.pt"
    torch.jit.save(torch.jit.trace(model, (x,)), str(path))
    called = repository.custom_operators(path)
    assert called == {
        "quantized_decomposed::quantize_per_tensor",
        "quantized_decomposed::dequantize_per_tensor",
    }
    with pytest.raises(BladesmithError, match="registers from Python only.*--backend python"):
        repository._libraries_defining(called, path)
