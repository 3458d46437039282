"""Model FLOPs per token, achieved TFLOPS per GPU, and speed-of-light (SOL) percent.

Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B; the same estimate as
Megatron-LM's MFU and nanoGPT's ``estimate_mfu``)::

    flops_per_token = 6 * N + 12 * L * H * T

N: parameters each token passes through (for MoE: the *active* ones, not all experts),
L: transformer layers, H: hidden size (heads x head dim), T: sequence length.
6N is 2 FLOPs per multiply-add for the forward pass plus twice that for the backward;
12·L·H·T is the attention score and value matmuls (QK^T and AV), which no parameter count
sees. It counts the full T x T matrix, as PaLM does, even for causal attention, so the
figure stays comparable with published MFU numbers. Activation recomputation is not
counted: this is *model* FLOPs, not hardware FLOPs.
"""

from __future__ import annotations

import re

# Dense (no 2:4 sparsity) tensor-core peak TFLOPS. NVIDIA's datasheets print the sparse
# figure with an asterisk ("shown with sparsity; specifications one-half lower without"),
# so each value here is half the datasheet number.
#   H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet
#     https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
#     SXM: TF32 989*, BF16 1,979*, FP8 3,958*; PCIe: 756*, 1,513*, 3,026*;
#     NVL: 835*, 1,671*, 3,341*.
#   H200 SXM / NVL: NVIDIA H200 Tensor Core GPU datasheet
#     https://resources.nvidia.com/en-us-data-center-overview-mc/en-us-data-center-overview/hpc-datasheet-sc23-h200
#     SXM: TF32 989*, BF16 1,979*, FP8 3,958*; NVL: 835*, 1,671*, 3,341*.
#   A100 (40 GB and 80 GB, SXM and PCIe alike): NVIDIA A100 Tensor Core GPU datasheet
#     https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
#     TF32 312*, BF16 624*; Ampere has no FP8 tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
    "H100 PCIe": {"tf32": 378.0, "bf16": 756.5, "fp8": 1513.0},
    "H100 NVL": {"tf32": 417.5, "bf16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"tf32": 494.5, "bf16": 989.5, "fp8": 1979.0},
    "H200 NVL": {"tf32": 417.5, "bf16": 835.5, "fp8": 1670.5},
    "A100": {"tf32": 156.0, "bf16": 312.0},
}
DTYPES = ("tf32", "bf16", "fp8")


def gpu_family(device_name: str) -> str | None:
    """Map a CUDA / NVML device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 PCIe") to a PEAK_TFLOPS key; None for a GPU not in the table or a MIG
    slice of one."""
    name = device_name.upper()
    if re.search(r"\bMIG\b", name):
        # a MIG slice ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") has a fraction of the GPU's
        # SMs: the whole GPU's peak would put its SOL % up to 7x too low
        return None
    for chip in ("H200", "H100"):
        if chip in name:
            if "NVL" in name:
                return f"{chip} NVL"
            if "PCIE" in name:
                return "H100 PCIe" if chip == "H100" else None
            return f"{chip} SXM"  # SXM parts name no form factor ("NVIDIA H100 80GB HBM3")
    return "A100" if re.search(r"A100(?!\d)", name) else None  # not an RTX A1000


def peak_tflops(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense tensor-core peak of one GPU for ``dtype``; None when the GPU is not in the
    table. Raises ValueError for a dtype the table does not know or the GPU lacks."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    family = gpu_family(device_name)
    if family is None:
        return None
    peaks = PEAK_TFLOPS[family]
    if dtype not in peaks:
        raise ValueError(f"{family} has no {dtype} tensor cores")
    return peaks[dtype]


def flops_per_token(num_params: int, *, num_layers: int = 0, hidden_size: int = 0,
                    seq_len: int = 0) -> float:
    """Training FLOPs per token, 6N + 12·L·H·T (see the module docstring). Leave the
    attention arguments at 0 for the plain 6N estimate."""
    for name, value in (("num_params", num_params), ("num_layers", num_layers),
                        ("hidden_size", hidden_size), ("seq_len", seq_len)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def throughput_fields(flops_per_token: float, tokens: int, duration_ms: float, *,
                      gpus: int = 1, peak: float | None = None) -> dict[str, float]:
    """``tflops_per_gpu`` (and ``sol_percent`` when the peak TFLOPS is known) for a step
    that processed ``tokens`` on ``gpus`` GPUs in ``duration_ms``: kwargs for log_step.

    ``tokens`` and ``gpus`` must describe the same scope: this rank's tokens with gpus=1,
    or the global batch with gpus=world size."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if duration_ms <= 0:
        return {}
    tflops = flops_per_token * tokens / (duration_ms / 1000.0) / gpus / 1e12
    fields = {"tflops_per_gpu": tflops}
    if peak:
        fields["sol_percent"] = 100.0 * tflops / peak
    return fields
