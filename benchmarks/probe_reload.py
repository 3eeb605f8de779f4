"""Where a saved artifact fails to load in a fresh process: save in this process, then
load it in new processes under variants (bladesmith.load, aoti_load_package with and
without the operator library loaded first), printing each child's exit code and the
tail of its output (faulthandler on, so a crash shows its Python stack).

    python3 benchmarks/probe_reload.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

import bladesmith
from bladesmith.images import sample_images
from bladesmith.models import build_retinanet

_CHILDREN = {
    "bladesmith.load": """
        import bladesmith, torch
        m = bladesmith.load(PATH, trust=True)  # the probe's own package
        print("loaded", type(m).__name__)
        out = m(*ARGS())
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        print("ran ok")
    """,
    "aoti only": """
        import torch
        r = torch._inductor.aoti_load_package(PATH)
        print("loaded aoti without bladesmith ops")
    """,
    "ops then aoti": """
        import torch
        from bladesmith import ops
        print("library", ops.load_library())
        r = torch._inductor.aoti_load_package(PATH)
        print("loaded aoti after ops")
    """,
    "cuda first then aoti": """
        import torch
        torch.zeros(1, device="cuda")
        r = torch._inductor.aoti_load_package(PATH)
        print("loaded aoti after CUDA init")
        out = r(*ARGS())
        torch.cuda.synchronize()
        print("ran ok")
    """,
    "single-threaded aoti": """
        import torch
        r = torch._inductor.aoti_load_package(PATH, run_single_threaded=True)
        print("loaded aoti single-threaded")
    """,
    "raw library then aoti": """
        import torch
        from bladesmith.ops import build
        st = build.status()
        print("status", st)
        torch.ops.load_library(st.path)
        r = torch._inductor.aoti_load_package(PATH)
        print("loaded aoti after raw library")
    """,
}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.body(x)


def _child(code: str, path: Path, args_code: str, env: dict | None = None, lines=25) -> None:
    source = f"PATH = {str(path)!r}\ndef ARGS():\n    {args_code}\n" + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", source],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    tail = (result.stdout + result.stderr).strip().splitlines()[-lines:]
    print(f"--- rc={result.returncode}")
    print("\n".join(tail))


def _pure_torch(out: Path, device: str) -> None:
    """Packages made by torch alone (no bladesmith, no metadata), on the CPU and on
    ``device``, each loaded only in children by torch alone: whether a crash is
    bladesmith's or the machine's, and the CPU's or the device's. For a crash, the last
    libraries the dynamic loader opened (LD_DEBUG) and the native stack (segv_backtrace.c).
    Then the same model as a bare shared object (no package) run by torch's runner."""
    for where in dict.fromkeys(("cpu", device)):
        model = Tiny().to(where).eval()
        x = torch.randn(1, 3, 32, 32, device=where)
        path = out / f"pure-{where}.pt2"
        exported = torch.export.export(model, (x,), strict=False)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
        print(f"===== pure torch on {where}: {path} ({path.stat().st_size} bytes)", flush=True)
        args_code = f"import torch; return (torch.randn(1,3,32,32, device={where!r}),)"
        code = """
            import torch
            r = torch._inductor.aoti_load_package(PATH)
            print("loaded")
            r(*ARGS())
            print("ran ok")
        """
        for variant, env in (("plain", None), ("LD_DEBUG=files", {"LD_DEBUG": "files"})):
            print(f"== {path.name}: {variant}", flush=True)
            _child(code, path, args_code, env=env)
        stack = _native_stack_library(out)
        if stack:
            print(f"== {path.name}: native stack (LD_PRELOAD {stack.name})", flush=True)
            _child(code, path, args_code, env={"LD_PRELOAD": str(stack)}, lines=60)
    _bare_shared_object(device)


def _bare_shared_object(device: str) -> None:
    model = Tiny().to(device).eval()
    x = torch.randn(1, 3, 32, 32, device=device)
    try:
        exported = torch.export.export(model, (x,), strict=False)
        so_path = torch._inductor.aot_compile(exported.module(), (x,))
    except Exception as error:  # noqa: BLE001 - a probe reports every failure
        print(f"===== bare .so on {device}: not made: {type(error).__name__}: {error}"[:400])
        return
    print(f"===== bare .so on {device}: {so_path}", flush=True)
    on_cuda = device.startswith("cuda")
    runner = f"Cuda(PATH, 1, {device!r})" if on_cuda else "Cpu(PATH, 1)"
    code = f"""
        import torch
        r = torch._C._aoti.AOTIModelContainerRunner{runner}
        print("loaded")
        r.run(list(ARGS()))
        print("ran ok")
    """
    args_code = f"import torch; return (torch.randn(1,3,32,32, device={device!r}),)"
    _child(code, Path(so_path), args_code)


def _native_stack_library(out: Path) -> Path | None:
    """segv_backtrace.c built into ``out`` (None where no C compiler is)."""
    library = out / "segv_backtrace.so"
    source = Path(__file__).with_name("segv_backtrace.c")
    if not library.exists() and shutil.which("gcc"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library if library.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--size", default="320x416")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    height, width = (int(v) for v in options.size.split("x"))
    device = options.device

    _pure_torch(options.out, device)
    cases = []
    tiny = Tiny().eval()
    tiny_args = (torch.randn(1, 3, 32, 32),)
    cases.append(
        (
            "tiny",
            tiny,
            [tiny_args],
            f"import torch; return (torch.randn(1,3,32,32, device={device!r}),)",
        )
    )
    detector = build_retinanet((height, width), backbone="resnet18")
    images = list(sample_images(1, (height, width)))
    cases.append(
        (
            "retinanet18",
            detector,
            [(images,)],
            f"from bladesmith.images import sample_images; "
            f"return ([i.to({device!r}) for i in sample_images(1, ({height}, {width}))],)",
        )
    )
    for name, model, data, args_code in cases:
        print(f"===== {name}: optimize on {device}", flush=True)
        optimized, spec, _ = bladesmith.optimize(model, "o1", device=device, test_data=data)
        print("passes", spec.passes, "formats", spec.save_formats, flush=True)
        for suffix in spec.save_formats:
            path = options.out / f"{name}{suffix}"
            try:
                bladesmith.save(optimized, path)
            except Exception as error:  # noqa: BLE001 - a probe reports every failure
                print(f"save {path.name} failed: {type(error).__name__}: {str(error)[:300]}")
                continue
            for variant, code in _CHILDREN.items():
                if variant != "bladesmith.load" and suffix != ".pt2":
                    continue
                print(f"== {path.name}: {variant}", flush=True)
                _child(code, path, args_code)


if __name__ == "__main__":
    main()
