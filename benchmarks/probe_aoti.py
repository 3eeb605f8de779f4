"""Why an AOTInductor package crashes where it is loaded, and whether Inductor's cache
artifacts carry the compiled model to a new process instead. Each variant runs in a child
process (faulthandler on, and segv_backtrace.c preloaded where gcc is), printing its exit
code and the tail of its output; the cache variant prints the new process's first-call
time and its latency beside the process that compiled it.

    python3 benchmarks/probe_aoti.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

_PACKAGE = """
import torch, torchvision
torch.manual_seed(0)
model = {model}.to(DEVICE).eval()
x = torch.randn({shape}, device=DEVICE)
exported = torch.export.export(model, (x,), strict=False)
options = {options}
path = torch._inductor.aoti_compile_and_package(
    exported, package_path=PATH, inductor_configs=options
)
print("packaged", path, flush=True)
"""

_LOAD = """
import torch
r = torch._inductor.aoti_load_package(PATH)
print("loaded", flush=True)
x = torch.randn({shape}, device=DEVICE)
out = r(x)
torch.cuda.synchronize() if DEVICE == "cuda" else None
print("ran ok", flush=True)
"""

# Each script's last lines: the compiled call's latency, after a warm-up.
_TIMED = """
with torch.no_grad():
    for _ in range(20):
        compiled(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        compiled(x)
    torch.cuda.synchronize()
print(f"LABEL: {{(time.perf_counter() - start) / 200 * 1e3:.3f}} ms", flush=True)
"""

_COMPILE_AND_SAVE = """
import time, torch, torchvision
torch.manual_seed(0)
model = {model}.to(DEVICE).eval()
x = torch.randn({shape}, device=DEVICE)
compiled = torch.compile(model, mode={mode!r}, fullgraph=True)
start = time.perf_counter()
with torch.no_grad():
    compiled(x)
torch.cuda.synchronize()
print(f"compiled cold in {{time.perf_counter() - start:.1f}} s", flush=True)
artifacts = torch.compiler.save_cache_artifacts()
assert artifacts is not None, "no cache artifacts"
data, info = artifacts
open(PATH, "wb").write(data)
print(f"artifacts {{len(data)}} bytes", flush=True)
""" + _TIMED.replace("LABEL", "in process")

_LOAD_CACHE = """
import time, torch, torchvision
start = time.perf_counter()
if {load}:
    torch.compiler.load_cache_artifacts(open(PATH, "rb").read())
torch.manual_seed(0)
model = {model}.to(DEVICE).eval()
x = torch.randn({shape}, device=DEVICE)
compiled = torch.compile(model, mode={mode!r}, fullgraph=True)
with torch.no_grad():
    compiled(x)
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
print(f"new process (artifacts loaded: {load}): first call after {{elapsed:.1f}} s", flush=True)
""" + _TIMED.replace("LABEL", "new process")


def _child(title: str, code: str, path: Path, device: str, env=None, lines=40) -> int:
    source = f"PATH = {str(path)!r}\nDEVICE = {device!r}\n" + textwrap.dedent(code)
    print(f"== {title}", flush=True)
    try:
        result = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", source],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        print("--- timed out")
        return -1
    tail = (result.stdout + result.stderr).strip().splitlines()[-lines:]
    print(f"--- rc={result.returncode}")
    print("\n".join(tail), flush=True)
    return result.returncode


def _stack_library(out: Path) -> dict:
    library = out / "segv_backtrace.so"
    source = Path(__file__).with_name("segv_backtrace.c")
    if not library.exists() and shutil.which("gcc"):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return {"LD_PRELOAD": str(library)} if library.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument(
        "--modes", nargs="+", default=["default", "max-autotune-no-cudagraphs", "max-autotune"]
    )
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    stack = _stack_library(options.out)
    tiny = "torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())"
    variants = {
        "default": {},
        "constants outside the library": {"aot_inductor.package_constants_in_so": False},
        "kernels embedded": {"aot_inductor.embed_kernel_binary": True},
        "max_autotune": {"max_autotune": True},
        "freezing": {"freezing": True},
    }
    for device in dict.fromkeys(("cpu", options.device)):
        for name, config in variants.items():
            if device == "cpu" and name != "default":
                continue
            path = options.out / f"tiny-{device}-{name.replace(' ', '_')}.pt2"
            made = _child(
                f"package tiny on {device}, {name}",
                _PACKAGE.format(model=tiny, shape="1, 3, 32, 32", options=config),
                path,
                device,
            )
            if made == 0:
                _child(
                    f"load tiny on {device}, {name}",
                    _LOAD.format(shape="1, 3, 32, 32"),
                    path,
                    device,
                    env=stack,
                )
    if options.device != "cuda":
        return
    resnet = "torchvision.models.resnet50(weights=None)"
    for mode in options.modes:
        path = options.out / f"resnet50-{mode}.cache"
        fields = {"model": resnet, "shape": "1, 3, 224, 224", "mode": mode}
        if (
            _child(
                f"resnet50 b1 compiled ({mode}) and its cache saved",
                _COMPILE_AND_SAVE.format(**fields),
                path,
                "cuda",
            )
            == 0
        ):
            for attempt, load in ((1, False), (2, True), (3, True)):
                fresh = options.out / f"inductor-cache-{mode}-{attempt}"  # nothing on disk
                env = {
                    "TORCHINDUCTOR_CACHE_DIR": str(fresh),
                    "TRITON_CACHE_DIR": str(fresh / "triton"),
                }
                _child(
                    f"resnet50, new process, empty cache dir ({mode}, artifacts loaded: {load})",
                    _LOAD_CACHE.format(load=load, **fields),
                    path,
                    "cuda",
                    env=env,
                )


if __name__ == "__main__":
    main()
