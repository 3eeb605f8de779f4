"""Where a saved artifact fails to load in a fresh process: save in this process, then
load it in new processes under variants (bladesmith.load, aoti_load_package with and
without the operator library loaded first), printing each child's exit code and the
tail of its output (faulthandler on, so a crash shows its Python stack).

    python3 benchmarks/probe_reload.py --device cuda --out DIR
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

import bladesmith
from bladesmith.models import build_retinanet
from bladesmith.models.images import sample_images

_CHILDREN = {
    "bladesmith.load": """
        import bladesmith, torch
        m = bladesmith.load(PATH)
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


def _child(code: str, path: Path, args_code: str) -> None:
    source = f"PATH = {str(path)!r}\ndef ARGS():\n    {args_code}\n" + textwrap.dedent(code)
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", source],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (result.stdout + result.stderr).strip().splitlines()[-25:]
    print(f"--- rc={result.returncode}")
    print("\n".join(tail))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--size", default="320x416")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    height, width = (int(v) for v in options.size.split("x"))
    device = options.device

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
            f"from bladesmith.models.images import sample_images; "
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
