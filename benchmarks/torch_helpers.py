"""Cost of the torch helpers per training step, on this machine's CPU (on a GPU the
reductions run on the device and each helper syncs once).

    python benchmarks/torch_helpers.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from trainmon.integrations.moe import moe_fields
from trainmon.integrations.torch import allocator_fields, layer_grad_norms, step_fields


def timed(label: str, fn, repeat: int = 20) -> None:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    print(f"{label:<52} {(time.perf_counter() - start) / repeat * 1000:8.2f} ms")


def main() -> None:
    torch.manual_seed(0)
    layers, dim = 8, 512
    model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                            for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, dim)).square().mean().backward()
    optimizer.step()
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    print(f"model: {params / 1e6:.1f}M parameters in {tensors} tensors, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    timed("step_fields (norm, zeros, params norm, count)", lambda: step_fields(model))
    timed("step_fields(count_zeros=False)", lambda: step_fields(model, count_zeros=False))
    timed("layer_grad_norms(depth=1)", lambda: layer_grad_norms(model, depth=1))
    timed("allocator_fields(model, optimizer)", lambda: allocator_fields(model, optimizer))
    logits = [torch.randn(4096, 64) for _ in range(layers)]
    timed("moe_fields(8 layers x 4096 tokens x 64 experts, top 2)", lambda: moe_fields(logits, top_k=2))
    start = time.perf_counter()
    for _ in range(5):
        model(torch.randn(8, dim)).square().mean().backward()
    print(f"{'for scale: one forward + backward, batch 8':<52} "
          f"{(time.perf_counter() - start) / 5 * 1000:8.2f} ms")


if __name__ == "__main__":
    main()
