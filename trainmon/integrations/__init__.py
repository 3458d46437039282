"""Helpers a training loop calls in one line each; every one returns a plain dict ready to
pass as keyword arguments to a Producer call.

- ``trainmon.integrations.torch``: grad / params norms, zero grads, allocator and GPU
  model fields (extra ``torch``).
- ``trainmon.integrations.moe``: MoE router statistics from router logits (extra ``torch``).
- ``trainmon.integrations.flops``: FLOPs per token, TFLOPS per GPU and SOL % (no deps).
- ``trainmon.integrations.nvml``: background GPU telemetry sampler (extra ``gpu``).
"""
