"""`bladesmith export triton`: repositories checked with Triton's own config definitions,
and the Python-backend one served by the bundled tritonserver."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

pytest.importorskip("pytriton", reason="serving needs nvidia-pytriton (bladesmith[serve])")

from serve_testing import NET_BATCH, QUICK, VOCABULARY, free_ports, tiny_net  # noqa: E402

import bladesmith  # noqa: E402
from bladesmith.cli import main  # noqa: E402
from bladesmith.errors import BladesmithError  # noqa: E402
from bladesmith.serve.repository import (  # noqa: E402
    Deployment,
    signature_from_config,
    write_repository,
)
from bladesmith.serve.server import Server  # noqa: E402
from engine_testing import USER_OPERATOR  # noqa: E402


def config_of(model_dir):
    return signature_from_config((model_dir / "config.pbtxt").read_text())


def test_torchscript_repository_declares_the_models_real_tensors(net_artifacts, tmp_path):
    from bladesmith import ops

    path = net_artifacts[".pt"]
    assert main(["export", "triton", str(path), str(tmp_path / "repo"), "--name", "net"]) == 0
    model_dir = tmp_path / "repo" / "net"
    config = config_of(model_dir)
    scripted = torch.jit.load(str(model_dir / "1" / "model.pt"))  # what the backend runs
    x = torch.zeros(NET_BATCH, 3, 8, 8)
    outputs = scripted(x)
    assert config.bucket == 0  # whole batches of the traced size
    [image] = config.inputs
    assert (image.name, image.dtype, image.dims) == ("INPUT__0", np.float32, tuple(x.shape))
    assert [(o.name, o.dtype, o.dims) for o in config.outputs] == [
        (f"OUTPUT__{i}", np.dtype(str(o.dtype).removeprefix("torch.")), tuple(o.shape))
        for i, o in enumerate(outputs)
    ]
    # The tiny net calls none of bladesmith's operators: no library, nothing to preload.
    assert not (model_dir / "1" / ops.library_path().rsplit("/", 1)[-1]).exists()
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "LD_PRELOAD" not in readme and "calls no custom operator" in readme
    assert "bladesmith's custom operators" not in readme
    assert 'platform: "pytorch_libtorch"' in (model_dir / "config.pbtxt").read_text()


def test_repositories_declare_the_dtypes_the_artifact_records(typed_artifacts, tmp_path):
    import json

    tagger, _ = typed_artifacts["tagger.pt"]
    native = config_of(write_repository(tagger, tmp_path / "repo", name="native"))
    assert [(i.name, i.dtype, i.dims) for i in native.inputs] == [
        ("INPUT__0", np.int64, (NET_BATCH, 7)),
        ("INPUT__1", np.float32, (NET_BATCH, 7)),
    ]
    python = write_repository(tagger, tmp_path / "repo", name="python", backend="python")
    assert [(i.dtype, i.dims) for i in config_of(python).inputs] == [
        (np.int64, (7,)),
        (np.float32, (7,)),
    ]
    # The ids' values in the test data, for a load test's rows (the mask has none).
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (python / "config.pbtxt").read_text()
    parameters = text_format.Parse(text, model_config_pb2.ModelConfig()).parameters
    [(name, (low, high))] = json.loads(parameters["input_ranges"].string_value).items()
    assert name == "input_0" and 0 <= low < high < VOCABULARY
    # One value per row (the lengths): [1] per row to the Python backend, [B] whole.
    laststep, _ = typed_artifacts["laststep.pt"]
    native = config_of(write_repository(laststep, tmp_path / "repo", name="lengths"))
    assert [(i.dtype, i.dims) for i in native.inputs] == [
        (np.float64, (NET_BATCH, 6, 5)),
        (np.int64, (NET_BATCH,)),
    ]


def test_onnx_repository_declares_the_models_real_tensors(net_artifacts, tmp_path):
    import onnxruntime

    model_dir = write_repository(net_artifacts[".onnx"], tmp_path / "repo", name="net")
    config = config_of(model_dir)
    session = onnxruntime.InferenceSession(str(model_dir / "1" / "model.onnx"))
    [image] = session.get_inputs()
    x = np.zeros([d if isinstance(d, int) else 2 for d in image.shape], np.float32)
    outputs = session.run(None, {image.name: x})
    assert [(i.name, i.dtype, i.dims) for i in config.inputs] == [
        (image.name, np.float32, triton_dims(image.shape))
    ]
    assert [(o.name, o.dtype, o.dims) for o in config.outputs] == [
        (meta.name, value.dtype, triton_dims(meta.shape))
        for meta, value in zip(session.get_outputs(), outputs)
    ]


def triton_dims(shape) -> tuple[int, ...]:
    """ONNX Runtime's shape as Triton declares it: a free dimension (a name) is -1."""
    return tuple(d if isinstance(d, int) else -1 for d in shape)


def test_onnx_with_custom_operators_is_refused_with_what_to_do(tmp_path):
    node = helper.make_node("Decode", ["x"], ["y"], domain="ai.onnx.contrib")
    graph = helper.make_graph(
        [node],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "custom.onnx"
    onnx.save(helper.make_model(graph), str(path))
    with pytest.raises(BladesmithError, match="--custom-ops standard"):
        write_repository(path, tmp_path / "repo")
    assert not (tmp_path / "repo" / "custom").exists()  # nothing half-written


def test_tensor_names_that_could_inject_config_fields_are_refused(tmp_path, capsys):
    # An ONNX graph's names go into config.pbtxt: a quote there once added fields.
    crafted = (
        'x" dims: [1] } ] parameters: { key: "EXECUTION_ENV_PATH" value: { string_value: "/tmp/evil'
    )
    for name in (crafted, "line\nbreak", "back\\slash"):
        graph = helper.make_graph(
            [helper.make_node("Relu", [name], ["y"])],
            "crafted",
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        )
        path = tmp_path / "crafted.onnx"
        onnx.save(helper.make_model(graph), str(path))
        assert main(["export", "triton", str(path), str(tmp_path / "repo")]) == 2
        err = capsys.readouterr().err
        assert "cannot be named in config.pbtxt" in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "repo" / "crafted").exists()
    # The names ONNX exporters write are kept.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["/body/input.1"], ["onnx::Relu_2:0"])],
        "plain",
        [helper.make_tensor_value_info("/body/input.1", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("onnx::Relu_2:0", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "plain.onnx"))
    model_dir = write_repository(tmp_path / "plain.onnx", tmp_path / "repo")
    assert [t.name for t in config_of(model_dir).inputs] == ["/body/input.1"]


def test_export_errors_are_one_line_for_the_user(net_artifacts, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["export", "triton", str(tmp_path / "missing.pt"), str(repo)]) == 2
    assert "no file" in capsys.readouterr().err
    assert main(["export", "triton", str(net_artifacts[".pt"]), str(repo)]) == 0
    assert main(["export", "triton", str(net_artifacts[".pt"]), str(repo)]) == 2
    assert "exists; choose another --name" in capsys.readouterr().err
    code = main(["export", "triton", str(net_artifacts[".pt"]), str(repo), "--name", "gpu",
                 "--device", "cuda"])  # fmt: skip
    assert code == 2 and "was optimized for cpu" in capsys.readouterr().err
    code = main(["export", "triton", str(net_artifacts[".pt"]), str(repo), "--name", "u8",
                 "--image-dtype", "uint8"])  # fmt: skip
    error = capsys.readouterr().err
    assert code == 2 and "only the python backend converts images" in error
    assert len(error.strip().splitlines()) == 1 and not (repo / "u8").exists()


def test_python_backend_repository_runs_on_the_bundled_tritonserver(net_artifacts, tmp_path):
    import tritonclient.http as triton

    model_dir = write_repository(
        net_artifacts[".pt"], tmp_path / "repo", name="net", backend="python"
    )
    config = config_of(model_dir)
    assert config.bucket == NET_BATCH  # max_batch_size: the artifact's batch by default
    assert [o.dims for o in config.outputs] == [(5,), (1,)]
    # A repository for another machine: the artifact is copied, not linked.
    assert not (model_dir / "1" / "net.pt").is_symlink()
    # The backend imports the installed bladesmith; this test's may be another checkout.
    with open(model_dir / "config.pbtxt", "a") as config_file:
        source = Path(bladesmith.__file__).parent.parent
        config_file.write(
            f'parameters: {{ key: "bladesmith_source" value: {{ string_value: "{source}" }} }}\n'
        )
    http, grpc, metrics = free_ports(3)
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8), dtype=np.float32)
    with Server(tmp_path / "repo", http_port=http, grpc_port=grpc, metrics_port=metrics,
                log=tmp_path / "triton.log") as server:  # fmt: skip
        client = triton.InferenceServerClient(server.url)
        tensor = triton.InferInput("input_0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("net", [tensor])
        client.close()
    with torch.no_grad():
        scores, best = tiny_net()(torch.from_numpy(x))
    np.testing.assert_allclose(result.as_numpy("output_0"), scores.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("output_1")[:, 0], best.numpy())
    assert not server.running()


def test_a_bladesmith_artifact_loads_in_the_repository_as_written(net_artifacts, tmp_path):
    """The copied artifact is the file bladesmith.load reads, in a new process too."""
    import subprocess
    import sys

    model_dir = write_repository(net_artifacts[".onnx"], tmp_path / "repo", backend="python")
    copied = model_dir / "1" / "net.onnx"
    code = (
        "import sys, torch, bladesmith; m = bladesmith.load(sys.argv[1]); "
        "print(tuple(m(torch.zeros(4, 3, 8, 8))[0].shape))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(copied)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "(4, 5)"
    assert bladesmith.load(copied).spec.input_shapes == ((NET_BATCH, 3, 8, 8),)


def test_a_python_repository_holds_the_operator_libraries_saved_with_the_artifact(
    user_op_artifact, user_library, tmp_path
):
    """The repository runs elsewhere: the libraries are copied beside the artifact, and
    bladesmith.load in a new process (as each model instance) loads them from there."""
    import subprocess
    import sys

    path, model = user_op_artifact
    trusted = Deployment(trust=True)  # its library is native code the instances load
    model_dir = write_repository(path, tmp_path / "repo", backend="python", deployment=trusted)
    copied = model_dir / "1" / "scaled.pt.libs"
    assert (copied / user_library.name).is_file() and not copied.is_symlink()
    assert "(scaled.pt.libs/)" in (tmp_path / "repo" / "README.md").read_text()
    x = torch.rand(4, 6)
    code = (  # its libraries are native code: loaded under trust, as serve --trust does
        "import sys, torch, bladesmith; m = bladesmith.load(sys.argv[1], trust=True); "
        "torch.save(m(torch.load(sys.argv[2])), sys.argv[3])"
    )
    torch.save(x, tmp_path / "x.pt")
    arguments = [model_dir / "1" / "scaled.pt", tmp_path / "x.pt", tmp_path / "y.pt"]
    subprocess.run([sys.executable, "-c", code, *map(str, arguments)], check=True)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model(x))


def test_a_backend_that_cannot_run_the_file_is_refused_in_one_line(net_artifacts, tmp_path, capsys):
    repo = tmp_path / "repo"
    aoti = tmp_path / "net.pt2"
    aoti.write_bytes(b"not opened: refused by its kind")
    for artifact, backend in [
        (net_artifacts[".onnx"], "pytorch_libtorch"),  # once: ONNX bytes copied as model.pt
        (aoti, "pytorch_libtorch"),  # once: the AOTInductor package copied as model.pt
        (aoti, "onnxruntime"),
        (net_artifacts[".pt"], "onnxruntime"),  # once: a DecodeError "please report it"
    ]:
        code = main(["export", "triton", str(artifact), str(repo), "--backend", backend])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"--backend {backend} cannot serve {artifact.name}" in err
        assert "pytorch_libtorch takes a .pt, onnxruntime takes a .onnx" in err
        assert len(err.strip().splitlines()) == 1 and "report" not in err
        assert not repo.exists() or not any(repo.iterdir())


def test_model_names_triton_cannot_serve_are_refused_before_any_work(
    net_artifacts, tmp_path, capsys
):
    repo = tmp_path / "repo"
    for name in ("a/b", "bad name/x", "../up", ".hidden", ""):
        code = main(["export", "triton", str(net_artifacts[".pt"]), str(repo), "--name", name])
        err = capsys.readouterr().err
        assert code == 2 and f"--name {name!r}" in err and "letters, digits" in err, err
        assert len(err.strip().splitlines()) == 1
    assert not repo.exists()
    spaced = tmp_path / "my net.pt"
    spaced.write_bytes(net_artifacts[".pt"].read_bytes())
    assert main(["export", "triton", str(spaced), str(repo)]) == 2
    assert "'my net' (the file's stem)" in capsys.readouterr().err
    assert main(["export", "triton", str(spaced), str(repo), "--name", "my-net.v2"]) == 0


def test_a_repository_path_that_is_a_file_is_refused_in_one_line(net_artifacts, capsys):
    artifact = str(net_artifacts[".pt"])
    assert main(["export", "triton", artifact, artifact]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and len(err.strip().splitlines()) == 1


def test_the_repository_readme_keeps_every_models_section(net_artifacts, tmp_path, monkeypatch):
    import shutil

    repo = tmp_path / "repo"
    monkeypatch.chdir(tmp_path)  # exported from elsewhere than the repository's parent
    for artifact, name, backend in [
        (net_artifacts[".pt"], "ts", "pytorch_libtorch"),
        (net_artifacts[".onnx"], "ox", "onnxruntime"),
        (net_artifacts[".pt"], "py", "python"),
    ]:
        args = ["export", "triton", str(artifact), "repo", "--name", name, "--backend", backend]
        assert main(args) == 0
    readme = (repo / "README.md").read_text()
    for header in ("## ts (pytorch_libtorch backend)", "## ox (onnxruntime backend)",
                   "## py (python backend)"):  # fmt: skip
        assert readme.count(header) == 1, readme
    assert f"REPO={repo.resolve()}\n" in readme  # absolute: right wherever it is read from
    assert 'tritonserver --model-repository "$REPO"' in readme
    # Exported again under a known name: its section replaced, not repeated.
    shutil.rmtree(repo / "ox")
    assert main(["export", "triton", str(net_artifacts[".onnx"]), "repo", "--name", "ox"]) == 0
    again = (repo / "README.md").read_text()
    assert again.count("## ox (onnxruntime backend)") == 1 and "## ts (" in again
    # A model whose folder was removed loses its section.
    shutil.rmtree(repo / "ts")
    assert main(["export", "triton", str(net_artifacts[".pt"]), "repo", "--name", "ts2"]) == 0
    assert "## ts (" not in (repo / "README.md").read_text()


def test_the_launch_line_preloads_each_libtorch_models_libraries_by_absolute_path(tmp_path):
    from bladesmith.serve.repository import _update_readme

    repo = tmp_path / "repo"
    for name in ("det", "plain"):
        (repo / name / "1").mkdir(parents=True)
    _update_readme(repo, "det", {"backend": "pytorch_libtorch", "torch_version": "2.6.0",
                                 "operators": ["bladesmith::retinanet_postprocess"],
                                 "preload": ["det/1/libbladesmith_ops.so"]})  # fmt: skip
    _update_readme(repo, "plain", {"backend": "pytorch_libtorch", "torch_version": "2.6.0",
                                   "operators": [], "preload": []})  # fmt: skip
    readme = (repo / "README.md").read_text()
    assert f"REPO={repo.resolve()}\n" in readme
    assert "LD_PRELOAD=$REPO/det/1/libbladesmith_ops.so \\\n" in readme
    det, plain = readme.split("## det (")[1].split("## plain (")
    assert "calls the custom operators bladesmith::retinanet_postprocess" in det
    assert "calls no custom operator" in plain and "bladesmith::" not in plain


def test_the_custom_operators_a_torchscript_file_calls_are_found(
    net_artifacts, user_op_artifact, tmp_path
):
    from bladesmith import ops
    from bladesmith.serve.repository import custom_operators

    ops.load_library()

    class Winograd(torch.nn.Module):
        def forward(self, x, w, b):
            return torch.ops.bladesmith.winograd_conv3x3(x, w, b, True)

    path = tmp_path / "winograd.pt"
    torch.jit.script(Winograd()).save(str(path))
    assert custom_operators(path) == {"bladesmith::winograd_conv3x3"}
    assert custom_operators(user_op_artifact[0]) == {USER_OPERATOR}
    assert custom_operators(net_artifacts[".pt"]) == set()


def test_a_libtorch_repository_preloads_the_users_operator_library(
    user_op_artifact, user_library, tmp_path
):
    import subprocess
    import sys

    path, model = user_op_artifact
    repo = tmp_path / "repo"
    # Found from what the model calls: the library saved beside it, no flag needed.
    argv = ["export", "triton", str(path), str(repo), "--backend", "pytorch_libtorch", "--trust"]
    assert main(argv) == 0
    version = repo / "scaled" / "1"
    assert sorted(file.name for file in version.iterdir()) == ["model.pt", user_library.name]
    readme = (repo / "README.md").read_text()
    preload = f"LD_PRELOAD=$REPO/scaled/1/{user_library.name} \\\n"
    assert f'{preload}    tritonserver --model-repository "$REPO"' in readme
    assert f"calls the custom operators {USER_OPERATOR}; the operator libraries" in readme
    # What Triton does with it: the library loaded (preloaded), then model.pt, new process.
    x = torch.rand(4, 6)
    torch.save(x, tmp_path / "x.pt")
    code = (
        "import sys, torch; torch.ops.load_library(sys.argv[1]); "
        "torch.save(torch.jit.load(sys.argv[2])(torch.load(sys.argv[3])), sys.argv[4])"
    )
    files = [version / user_library.name, version / "model.pt", tmp_path / "x.pt"]
    subprocess.run(
        [sys.executable, "-c", code, *map(str, files), str(tmp_path / "y.pt")], check=True
    )
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model(x))
    # The same library given with --load-library too: copied and preloaded once.
    again = [
        "--backend",
        "pytorch_libtorch",
        "--name",
        "again",
        "--load-library",
        str(user_library),
    ]
    assert main(["export", "triton", str(path), str(repo), *again]) == 0
    assert sorted(file.name for file in (repo / "again" / "1").iterdir()) == sorted(
        file.name for file in version.iterdir()
    )


# An operator registered from Python, as the user's own code may (no library file).
_PYTHON_OPS = torch.library.Library("pyops_test", "DEF")
_PYTHON_OPS.define("twice(Tensor x) -> Tensor")
_PYTHON_OPS.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")


def test_a_libtorch_repository_of_an_operator_registered_from_python_is_refused(tmp_path, capsys):
    class Twice(torch.nn.Module):
        def forward(self, x):
            return torch.ops.pyops_test.twice(x)

    x = torch.rand(2, 3)
    optimized, _, _ = bladesmith.optimize(
        torch.jit.script(Twice()), device="cpu", test_data=[(x,)], config=QUICK, passes=[]
    )
    path = bladesmith.save(optimized, tmp_path / "twice.pt")
    capsys.readouterr()  # optimize's progress
    repo = tmp_path / "repo"
    assert main(["export", "triton", str(path), str(repo), "--backend", "pytorch_libtorch"]) == 2
    err = capsys.readouterr().err
    assert "twice.pt calls pyops_test::twice, which no loaded library file defines" in err
    assert "--load-library" in err and len(err.strip().splitlines()) == 1
    assert not (repo / "twice").exists()


def test_an_artifact_with_its_own_libraries_needs_trust_to_be_served(user_op_artifact, tmp_path):
    """Each model instance would load scaled.pt.libs/ in a process of its own: refused in
    one line before anything is written, though this process has loaded the library
    (docs/security.md, trust model: an artifact with ARTIFACT.libs/*.so)."""
    from bladesmith.trust import UntrustedFileError

    path, _ = user_op_artifact
    for backend in ("python", "pytorch_libtorch"):
        with pytest.raises(UntrustedFileError) as refused:
            write_repository(path, tmp_path / backend, backend=backend)
        assert "scaled.pt.libs" in str(refused.value) and "--trust" in str(refused.value)
        assert not (tmp_path / backend / "scaled").exists()
