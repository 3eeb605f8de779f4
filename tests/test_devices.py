"""Device choice, with CUDA, DirectML and MPS faked where the hardware is absent."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from bladesmith import devices
from bladesmith.devices import available_devices, device_kind, resolve_device
from bladesmith.errors import DeviceUnavailableError


def fake_directml(count: int) -> types.ModuleType:
    """A stand-in for torch_directml with its public API; its devices are privateuseone."""
    module = types.ModuleType("torch_directml")
    module.device_count = lambda: count
    module.is_available = lambda: count > 0
    module.default_device = lambda: 0
    module.device = lambda index=0: torch.device("privateuseone", index)
    module.device_name = lambda index: f"Fake DirectML GPU {index}"
    return module


@pytest.fixture
def machine(monkeypatch):
    """Configure the fake machine: machine(cuda=2, dml=1, mps=True)."""

    def configure(cuda: int = 0, dml: int | None = None, mps: bool = False) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda index: types.SimpleNamespace(
                name=f"Fake H200 {index}", total_memory=141 * 2**30, major=9, minor=0
            ),
        )
        # None in sys.modules makes `import torch_directml` fail as if it were not installed.
        monkeypatch.setitem(
            sys.modules, "torch_directml", None if dml is None else fake_directml(dml)
        )
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        monkeypatch.setattr(torch.backends.mps, "is_built", lambda: mps)

    return configure


@pytest.mark.parametrize(
    ("cuda", "dml", "mps", "expected"),
    [
        (1, 1, True, torch.device("cuda")),
        (0, 1, True, torch.device("privateuseone", 0)),
        (0, 0, True, torch.device("mps")),
        (0, None, True, torch.device("mps")),
        (0, None, False, torch.device("cpu")),
    ],
)
def test_auto_prefers_cuda_then_directml_then_mps_then_cpu(machine, cuda, dml, mps, expected):
    machine(cuda=cuda, dml=dml, mps=mps)
    assert resolve_device() == expected
    assert resolve_device("AUTO") == expected


def test_auto_is_the_first_of_available_devices(machine):
    machine(cuda=0, dml=2, mps=True)
    listed = available_devices()
    assert [device.name for device in listed] == ["dml:0", "dml:1", "mps", "cpu"]
    assert device_kind(resolve_device()) == listed[0].kind


def test_auto_on_this_machine_matches_torch():
    if torch.cuda.is_available():
        assert resolve_device().type == "cuda"
    elif not torch.backends.mps.is_available() and "torch_directml" not in sys.modules:
        assert resolve_device() == torch.device("cpu")
    assert available_devices()[-1].kind == "cpu"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
        (" CUDA:0 ", torch.device("cuda", 0)),
        (torch.device("cuda", 1), torch.device("cuda", 1)),
        ("dml", torch.device("privateuseone", 0)),
        ("dml:1", torch.device("privateuseone", 1)),
        (torch.device("privateuseone", 1), torch.device("privateuseone", 1)),
        ("mps", torch.device("mps")),
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
    ],
)
def test_explicit_names(machine, name, expected):
    machine(cuda=2, dml=2, mps=True)
    assert resolve_device(name) == expected


@pytest.mark.parametrize(
    ("device", "kind"),
    [("cuda:3", "cuda"), (torch.device("privateuseone", 0), "dml"), ("mps", "mps"), ("cpu", "cpu")],
)
def test_device_kind(device, kind):
    assert device_kind(device) == kind


def test_cuda_index_beyond_the_devices_names_those_there(machine):
    machine(cuda=1)
    with pytest.raises(DeviceUnavailableError) as error:
        resolve_device("cuda:1")
    assert str(error.value) == "cuda:1 requested but this machine has 1 CUDA device (cuda:0)"


def test_cuda_on_a_cpu_build_of_torch_says_so(machine, monkeypatch):
    machine(cuda=0)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    with pytest.raises(DeviceUnavailableError, match=r"built without CUDA \(torch 2\.6\.0\+cpu\)"):
        resolve_device("cuda")


def test_cuda_build_without_a_visible_gpu_points_at_cuda_visible_devices(machine, monkeypatch):
    machine(cuda=0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailableError, match="sees no CUDA GPU; CUDA_VISIBLE_DEVICES=''"):
        resolve_device("cuda:0")


def test_directml_without_the_package_names_it(machine):
    machine(dml=None)
    with pytest.raises(DeviceUnavailableError, match="pip install torch-directml"):
        resolve_device("dml")


def test_directml_index_and_empty_adapter_list(machine):
    machine(dml=2)
    with pytest.raises(DeviceUnavailableError) as error:
        resolve_device("dml:2")
    assert (
        str(error.value) == "dml:2 requested but this machine has 2 DirectML devices (dml:0, dml:1)"
    )
    machine(dml=0)
    with pytest.raises(DeviceUnavailableError, match="finds no DirectML device"):
        resolve_device("dml")


def test_mps_errors(machine):
    machine(mps=False)
    with pytest.raises(
        DeviceUnavailableError, match="mps requested but torch .* built without MPS"
    ):
        resolve_device("mps")
    machine(mps=True)
    with pytest.raises(DeviceUnavailableError, match=r"has 1 MPS device \(mps:0\)"):
        resolve_device("mps:1")


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cuda:", 3, torch.device("meta")])
def test_unknown_names_say_what_is_accepted(name):
    with pytest.raises(DeviceUnavailableError, match="device: expected 'auto', 'cuda'"):
        resolve_device(name)


def test_available_devices_describe_each_kind(machine):
    machine(cuda=2, dml=1, mps=True)
    listed = {device.name: device for device in available_devices()}
    assert list(listed) == ["cuda:0", "cuda:1", "dml:0", "mps", "cpu"]
    assert listed["cuda:1"].description == "Fake H200 1"
    assert listed["cuda:1"].compute_capability == "9.0"
    assert listed["cuda:1"].total_memory == 141 * 2**30
    assert listed["dml:0"].description == "Fake DirectML GPU 0"
    cpu = listed["cpu"].to_dict()
    assert cpu["torch_threads"] == torch.get_num_threads() and cpu["logical_cores"] >= 1


def test_cpu_model_reads_the_name_not_the_model_number(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel\t\t: 17\nmodel name\t: Fancy CPU 9000\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nHardware\t: BCM2835\nModel\t: Raspberry Pi 4\n")
    assert devices.cpu_model(x86) == "Fancy CPU 9000"
    assert devices.cpu_model(arm) == "BCM2835"
    assert devices.cpu_model(tmp_path / "missing")  # falls back to what platform knows


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_device():
    assert resolve_device().type == "cuda"
    first = available_devices()[0]
    assert first.kind == "cuda" and first.total_memory > 0
    assert resolve_device(first.name) == torch.device(first.name)


def test_gpu_is_pai_blade_s_name_for_cuda(machine):
    machine(cuda=2)
    assert resolve_device("gpu") == torch.device("cuda")
    assert resolve_device("GPU:1") == torch.device("cuda", 1)
    machine(cuda=0)
    with pytest.raises(DeviceUnavailableError, match="cuda"):
        resolve_device("gpu")
