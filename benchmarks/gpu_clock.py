"""The SM clock the GPU really runs at, from a spin of known cycles (torch.cuda._sleep)
timed with CUDA events: after idling, and right after a burst of small kernels.

    python benchmarks/gpu_clock.py
"""

import torch


def effective_mhz(cycles: int = 2_000_000) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


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
