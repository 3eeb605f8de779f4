"""What the GPU really does: its SM clock, from a spin of known cycles
(torch.cuda._sleep) timed with CUDA events, after idling and under load; and the device
time of each CUDA kernel a call launches (torch.profiler).

    python benchmarks/gpu_probe.py       # the clock
"""

import re

import torch
from torch.profiler import ProfilerActivity, profile


def effective_mhz(cycles: int = 2_000_000) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def kernel_times(call, runs: int = 30) -> dict[str, float]:
    """Device time per call of each CUDA kernel ``call`` launches, in microseconds, by
    kernel name (templates and namespaces left out), largest first."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            key = event.key.removeprefix("void ")
            match = re.search(r"(\w+)\s*[<(]", key)  # cuDNN's names have no signature
            name = match.group(1) if match else key
            times[name] = times.get(name, 0.0) + event.device_time_total / runs
    return dict(sorted(times.items(), key=lambda item: -item[1]))


def main() -> None:
    x = torch.randn(1024, device="cuda")
    effective_mhz()  # the first launch loads the kernel
    print(f"after idle: {effective_mhz():.0f} MHz")
    for _ in range(20000):
        x.add_(1)
    print(f"after 20,000 small kernels: {effective_mhz():.0f} MHz")
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(50):
        a @ a
    print(f"after 50 large matmuls: {effective_mhz():.0f} MHz")
    for _ in range(5):
        print(f"spin after spin: {effective_mhz(20_000_000):.0f} MHz")


if __name__ == "__main__":
    main()
