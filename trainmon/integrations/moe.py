"""Mixture-of-experts router statistics from router logits, as ``log_moe_stats`` kwargs.

    logits = [layer.router_logits for layer in moe_layers]     # each [tokens, experts]
    tm.log_moe_stats(step, **moe_fields(logits, top_k=2))

Per layer, with T tokens, E experts, top-k routing, p = softmax(logits), c_i = tokens
routed to expert i (each token counts k times):

- aux_loss: Switch Transformer / Megatron-LM load-balancing loss, E * sum_i f_i * P_i with
  f_i = c_i / (T k) and P_i = mean_t p_ti. 1.0 when perfectly balanced. Reported without
  the training coefficient (Megatron's moe_aux_loss_coeff).
- z_loss: ST-MoE router z-loss, mean_t logsumexp(logits_t)^2, without its coefficient.
- expert_utilization: fraction of experts that got at least one token.
- load_imbalance: max_i c_i / mean_i c_i (mean = T k / E); 1.0 when balanced.

Over several layers the record holds the mean of aux_loss, z_loss and utilization and the
worst (max) imbalance, since the slowest expert of any layer holds up the step; the
per-layer values go in the layer_* lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

RouterLogits = Union[torch.Tensor, Sequence[torch.Tensor]]


def _layer_stats(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[aux_loss, z_loss, utilization, imbalance] of one layer, on the logits' device."""
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(f"router logits must be [tokens, experts] (or [batch, seq, experts]) with at "
                         f"least one expert, got shape {list(logits.shape)}")
    experts = logits.shape[-1]
    logits = logits.detach().reshape(-1, experts).float()
    tokens = logits.shape[0]
    if tokens == 0:
        raise ValueError("router logits hold no tokens")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({experts}), got {top_k}")
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(logits, top_k, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=experts).float()
    routed = tokens * top_k
    aux = experts * torch.sum(counts / routed * probs.mean(dim=0))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    utilization = (counts > 0).float().mean()
    imbalance = counts.max() / (routed / experts)
    return torch.stack([aux, z, utilization, imbalance])


def moe_fields(router_logits: RouterLogits, top_k: int = 1) -> dict[str, Any]:
    """kwargs for ``log_moe_stats`` from one layer's router logits ([tokens, experts] or
    [batch, seq, experts]) or a sequence of them, one per MoE layer."""
    single = isinstance(router_logits, torch.Tensor)
    layers = [router_logits] if single else list(router_logits)
    if not layers:
        raise ValueError("no router logits given")
    # Layers may sit on different GPUs (pipeline stages, HF's device_map="auto"): their
    # four numbers meet on the first one's device, for one host sync.
    device = layers[0].device
    per_layer = torch.stack([_layer_stats(logits, top_k).to(device) for logits in layers]).tolist()
    aux, z, utilization, imbalance = (list(column) for column in zip(*per_layer))
    fields: dict[str, Any] = {
        "aux_loss": sum(aux) / len(aux),
        "z_loss": sum(z) / len(z),
        "expert_utilization": sum(utilization) / len(utilization),
        "load_imbalance": max(imbalance),
    }
    if not single:
        fields.update(layer_aux_loss=aux, layer_z_loss=z, layer_utilization=utilization,
                      layer_imbalance=imbalance)
    return fields
