"""Torch helpers for a training loop: one call each, each returning Producer kwargs.

    from trainmon.integrations.torch import step_fields, allocator_fields, gpu_model_fields

    tm.log_gpu_model(**gpu_model_fields())                  # once, at start (CUDA only)
    ...
    fields = step_fields(model)                             # norm, num_zeros, params_norm, num_params
    clip_grad_norm_(model.parameters(), 1.0)
    tm.log_step(step, step_tokens=n, duration_ms=ms, loss=loss.item(), lr=lr, **fields)
    tm.log_allocator(step, **allocator_fields(model, optimizer))

Called before clipping, ``norm`` is the norm StepRecord holds: the one Megatron and the HF
Trainer log (what ``clip_grad_norm_`` returns), in which a spike shows; after clipping it
could never exceed the clip threshold.
Each helper reads the device once (one host sync), whatever the number of parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch import nn

from . import nvml

Tensors = Union[nn.Module, Iterable[torch.Tensor]]

# torch.cuda.memory_stats() key -> AllocatorRecord field.
CUDA_MEMORY_FIELDS = {
    "allocated_bytes.all.current": "allocated",
    "allocated_bytes.all.peak": "peak_allocated",
    "active_bytes.all.current": "active",
    "inactive_split_bytes.all.current": "inactive",
    "reserved_bytes.all.current": "reserved",
    "reserved_bytes.all.peak": "peak_reserved",  # Megatron's "max reserved"
    "num_alloc_retries": "alloc_retries",
}


def _params(source: Tensors) -> list[torch.Tensor]:
    return list(source.parameters() if isinstance(source, nn.Module) else source)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2, tensor parallel) holds this rank's shard; ``sharded=True`` sums
    # the shards' squares across ranks.
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _reduced(values: list[torch.Tensor], sharded: bool, group: Any) -> list[float]:
    """Stack per-tensor partial sums, add them up across ranks when sharded, and read
    them back in one host sync."""
    totals = torch.stack(values)
    if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals, group=group)
    return totals.tolist()


def _square_sums(tensors: list[torch.Tensor], device: torch.device,
                 count_zeros: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squares, number of zeros) over all tensors, as float64 tensors on device."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    zeros = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        t = _local(t.detach())
        squares += torch.linalg.vector_norm(t, dtype=torch.float32).to(device, torch.float64) ** 2
        if count_zeros:
            zeros += (t.numel() - torch.count_nonzero(t)).to(device, torch.float64)
    return squares, zeros


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def grad_fields(model: Tensors, *, sharded: bool = False, group: Any = None,
                count_zeros: bool = True) -> dict[str, Any]:
    """``norm`` (global grad L2 norm) and ``num_zeros`` (grad entries equal to 0) over all
    parameters that have a gradient. Pass ``sharded=True`` under FSDP / ZeRO / tensor
    parallel, where each rank holds a part of the grads (one all-reduce).
    ``count_zeros=False`` skips the zero count, the dearer half on CPU."""
    grads = [p.grad for p in _params(model) if p.grad is not None]
    squares, zeros = _square_sums(grads, _device_of(grads), count_zeros)
    squares, zeros = _reduced([squares, zeros], sharded, group)
    fields: dict[str, Any] = {"norm": squares ** 0.5}
    if count_zeros:
        fields["num_zeros"] = int(zeros)
    return fields


def params_fields(model: Tensors, *, sharded: bool = False, group: Any = None) -> dict[str, Any]:
    """``params_norm`` (L2 norm of all parameters) and ``num_params``."""
    params = _params(model)
    device = _device_of(params)
    squares, _ = _square_sums(params, device, count_zeros=False)
    count = torch.tensor(float(sum(_local(p).numel() for p in params)), dtype=torch.float64,
                         device=device)
    squares, count = _reduced([squares, count], sharded, group)
    return {"params_norm": squares ** 0.5, "num_params": int(count)}


def step_fields(model: Tensors, *, sharded: bool = False, group: Any = None,
                count_zeros: bool = True) -> dict[str, Any]:
    """grad_fields and params_fields together: norm, num_zeros, params_norm, num_params."""
    return {**grad_fields(model, sharded=sharded, group=group, count_zeros=count_zeros),
            **params_fields(model, sharded=sharded, group=group)}


def layer_grad_norms(model: nn.Module, depth: int | None = None) -> dict[str, float]:
    """Grad L2 norm per parameter name, or per module when ``depth`` is given (the first
    ``depth`` dotted parts of the name: depth=2 groups "layers.3.mlp.w1" under
    "layers.3"). For looking at on demand; StepRecord has no per-layer field."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            key = ".".join(name.split(".")[:depth]) if depth else name
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return {}
    device = _device_of(next(iter(groups.values())))
    squares = [_square_sums(grads, device, count_zeros=False)[0] for grads in groups.values()]
    return {key: value ** 0.5 for key, value in zip(groups, torch.stack(squares).tolist())}


def _segment(name: str, tensors: Iterable[torch.Tensor]) -> dict[str, Any]:
    """Bytes held by ``tensors`` by where they live: GPU, pinned or pageable host memory.
    Views of one storage (tied weights) count once."""
    seen: set[tuple[str, int]] = set()
    segment = {"name": name, "device": 0, "managed": 0, "pinned": 0, "pageable": 0}
    for t in tensors:
        t = _local(t)
        key = (str(t.device), t.data_ptr())
        if key in seen or t.data_ptr() == 0:
            continue
        seen.add(key)
        size = t.numel() * t.element_size()
        if t.device.type == "cpu":
            segment["pinned" if t.is_pinned() else "pageable"] += size
        else:
            segment["device"] += size
    return segment


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def cuda_memory_fields(memory_stats: dict[str, Any]) -> dict[str, int]:
    """AllocatorRecord's torch fields from a ``torch.cuda.memory_stats()`` dict."""
    return {field: int(memory_stats[key]) for key, field in CUDA_MEMORY_FIELDS.items()
            if key in memory_stats}


def allocator_fields(model: Tensors | None = None, optimizer: torch.optim.Optimizer | None = None,
                     device: torch.device | int | None = None) -> dict[str, Any]:
    """kwargs for ``log_allocator``: segments weights / gradients / optimizer (from the
    tensors themselves) and, on CUDA, the caching allocator's counters plus an
    "activations" segment: allocated bytes the other segments do not account for
    (activations, plus temporaries and workspaces alive at the time of the call)."""
    stats = []
    if model is not None:
        params = _params(model)
        stats.append(_segment("weights", params))
        stats.append(_segment("gradients", (p.grad for p in params if p.grad is not None)))
    if optimizer is not None:
        stats.append(_segment("optimizer", _optimizer_tensors(optimizer)))
    fields: dict[str, Any] = {"stats": stats}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        fields.update(cuda_memory_fields(torch.cuda.memory_stats(device)))
        if stats and "allocated" in fields:
            known = sum(s["device"] for s in stats)
            stats.append({"name": "activations", "device": max(0, fields["allocated"] - known),
                          "managed": 0, "pinned": 0, "pageable": 0})
    return fields


def gpu_model_fields(device: torch.device | int | None = None) -> dict[str, Any] | None:
    """kwargs for ``log_gpu_model`` describing this process's CUDA device, from
    torch.cuda and, when NVML is there, the driver version, ECC mode and NVML index
    (the number nvidia-smi shows). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if device is None else torch.cuda._get_device_index(device)
    props = torch.cuda.get_device_properties(index)
    free, _ = torch.cuda.mem_get_info(index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith("GPU-"):
        uuid = f"GPU-{uuid}"  # NVML's spelling, so the two sources name the GPU alike
    fields = {"id": index, "name": props.name, "sm_count": props.multi_processor_count,
              "major": props.major, "minor": props.minor, "memory": props.total_memory,
              "free": free, "l2_size": getattr(props, "L2_cache_size", 0), "uuid": uuid,
              "cuda_runtime": torch.version.cuda or ""}
    fields.update(nvml.model_fields(uuid))
    return fields
