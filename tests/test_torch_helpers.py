"""The torch helpers against values worked out by hand, on CPU, and their dicts sent
through the real broker as Producer kwargs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.conftest import read_records
from trainmon.integrations.flops import (flops_per_token, gpu_family, peak_tflops,
                                         throughput_fields)
from trainmon.integrations.moe import moe_fields
from trainmon.integrations.torch import (allocator_fields, cuda_memory_fields, grad_fields,
                                         gpu_model_fields, layer_grad_norms, params_fields,
                                         step_fields)


def linear_with(weight, bias, weight_grad=None, bias_grad=None) -> nn.Linear:
    layer = nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        layer.bias.copy_(torch.tensor(bias, dtype=torch.float32))
    if weight_grad is not None:
        layer.weight.grad = torch.tensor(weight_grad, dtype=torch.float32)
    if bias_grad is not None:
        layer.bias.grad = torch.tensor(bias_grad, dtype=torch.float32)
    return layer


def test_grad_norm_and_zeros_by_hand():
    # squares: 9 + 16 = 25 and 144, so the norm is sqrt(169) = 13; zeros: 2 + 1.
    layer = linear_with([[1, 2], [2, 0]], [4, 0], [[3, 0], [0, 4]], [0, 12])
    assert grad_fields(layer) == {"norm": pytest.approx(13.0), "num_zeros": 3}


def test_zero_count_can_be_skipped():
    layer = linear_with([[1, 2], [2, 0]], [4, 0], [[3, 0], [0, 4]], [0, 12])
    assert grad_fields(layer, count_zeros=False) == {"norm": pytest.approx(13.0)}
    assert "num_zeros" not in step_fields(layer, count_zeros=False)


def test_params_norm_and_count_by_hand():
    # squares: 1 + 4 + 4 + 0 + 16 + 0 = 25.
    layer = linear_with([[1, 2], [2, 0]], [4, 0])
    assert params_fields(layer) == {"params_norm": pytest.approx(5.0), "num_params": 6}


def test_grad_norm_after_a_real_backward_pass():
    layer = linear_with([[1, 2], [2, 0]], [4, 0])
    layer(torch.tensor([1.0, 2.0])).sum().backward()
    # d(sum(Wx + b))/dW = [[1, 2], [1, 2]], d/db = [1, 1]: 1+4+1+4+1+1 = 12.
    fields = step_fields(layer)
    assert fields["norm"] == pytest.approx(math.sqrt(12))
    assert fields["num_zeros"] == 0
    assert fields["params_norm"] == pytest.approx(5.0)


def test_parameters_without_grad_are_skipped_and_lists_work():
    frozen = nn.Parameter(torch.ones(3))  # no grad at all
    trained = nn.Parameter(torch.zeros(2))
    trained.grad = torch.tensor([0.0, 2.0])
    assert grad_fields([frozen, trained]) == {"norm": pytest.approx(2.0), "num_zeros": 1}
    assert grad_fields([frozen]) == {"norm": 0.0, "num_zeros": 0}


def test_non_finite_grads_show_in_the_norm():
    layer = linear_with([[1, 2], [2, 0]], [4, 0], [[math.inf, 0], [0, 0]], [0, 0])
    assert math.isinf(grad_fields(layer)["norm"])
    layer.weight.grad[0, 0] = math.nan
    assert math.isnan(grad_fields(layer)["norm"])


def test_layer_grad_norms_per_parameter_and_per_module():
    model = nn.Sequential(linear_with([[1, 0], [0, 1]], [0, 0], [[3, 0], [0, 4]], [0, 12]),
                          linear_with([[1, 0], [0, 1]], [0, 0], [[0, 0], [0, 0]], [6, 8]))
    per_param = layer_grad_norms(model)
    assert per_param == {"0.weight": pytest.approx(5.0), "0.bias": pytest.approx(12.0),
                         "1.weight": 0.0, "1.bias": pytest.approx(10.0)}
    assert layer_grad_norms(model, depth=1) == {"0": pytest.approx(13.0), "1": pytest.approx(10.0)}


def _sharded_worker(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # Each rank holds half of the grad [3, 0, 4, 12]: global norm 13, one zero.
    shard = nn.Parameter(torch.zeros(2))
    shard.grad = torch.tensor([[3.0, 0.0], [4.0, 12.0]][rank])
    results[rank] = {**grad_fields([shard], sharded=True), **params_fields([shard], sharded=True)}
    dist.destroy_process_group()


def test_sharded_grads_are_summed_across_ranks(tmp_path):
    context = torch.multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        torch.multiprocessing.start_processes(_sharded_worker, args=(str(tmp_path / "init"), results),
                                              nprocs=2, start_method="spawn")
        results = dict(results)
    for rank in (0, 1):
        assert results[rank] == {"norm": pytest.approx(13.0), "num_zeros": 1,
                                 "params_norm": 0.0, "num_params": 4}


# -- allocator / GPU model ------------------------------------------------------------

def test_allocator_segments_from_tensors():
    layer = linear_with([[1, 2], [2, 0]], [4, 0])
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.tensor([1.0, 2.0])).sum().backward()
    optimizer.step()  # creates one momentum buffer per parameter
    fields = allocator_fields(layer, optimizer)
    # 6 float32 values each: weights, grads and momentum buffers are 24 bytes of host memory.
    assert fields == {"stats": [
        {"name": "weights", "device": 0, "managed": 0, "pinned": 0, "pageable": 24},
        {"name": "gradients", "device": 0, "managed": 0, "pinned": 0, "pageable": 24},
        {"name": "optimizer", "device": 0, "managed": 0, "pinned": 0, "pageable": 24},
    ]}


def test_allocator_counts_a_shared_storage_once():
    weight = torch.zeros(4, 4)  # 64 bytes, once more as a view (tied embeddings)
    fields = allocator_fields([weight, weight.view(-1)])
    assert fields["stats"][0]["pageable"] == 64


def test_cuda_memory_stats_map_to_allocator_fields():
    stats = {"allocated_bytes.all.current": 10, "allocated_bytes.all.peak": 20,
             "active_bytes.all.current": 11, "inactive_split_bytes.all.current": 3,
             "reserved_bytes.all.current": 32, "reserved_bytes.all.peak": 48,
             "num_alloc_retries": 1, "allocation.all.current": 5}
    assert cuda_memory_fields(stats) == {"allocated": 10, "peak_allocated": 20, "active": 11,
                                         "inactive": 3, "reserved": 32, "peak_reserved": 48,
                                         "alloc_retries": 1}
    assert cuda_memory_fields({}) == {}


def test_gpu_model_is_none_without_cuda():
    assert not torch.cuda.is_available()  # this suite runs on CPU machines
    assert gpu_model_fields() is None


# -- MoE --------------------------------------------------------------------------------

LN3 = math.log(3)


def test_moe_stats_of_one_layer_by_hand():
    # probs are [0.75, 0.25] or [0.25, 0.75]; top-1 sends 3 tokens to expert 0, 1 to expert 1.
    logits = torch.tensor([[LN3, 0], [LN3, 0], [0, LN3], [LN3, 0]])
    # f = [3/4, 1/4], P = [2.5/4, 1.5/4]: aux = 2 * (0.75 * 0.625 + 0.25 * 0.375) = 1.125.
    # logsumexp = ln(3 + 1) for every token: z = ln(4)^2. Load [3, 1] over mean 2: 1.5.
    assert moe_fields(logits) == {"aux_loss": pytest.approx(1.125),
                                  "z_loss": pytest.approx(math.log(4) ** 2),
                                  "expert_utilization": 1.0, "load_imbalance": pytest.approx(1.5)}


def test_moe_top2_counts_each_token_twice():
    logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 2.0, 3.0]])
    fields = moe_fields(logits, top_k=2)
    # experts {0, 1} and {2, 1}: loads [1, 2, 1] over mean 4/3.
    assert fields["load_imbalance"] == pytest.approx(1.5)
    assert fields["expert_utilization"] == 1.0


def test_moe_balanced_router_has_aux_loss_one():
    fields = moe_fields(torch.zeros(8, 4), top_k=1)  # uniform probabilities, whatever the ties
    assert fields["aux_loss"] == pytest.approx(1.0)
    assert fields["z_loss"] == pytest.approx(math.log(4) ** 2)


def test_moe_several_layers_mean_and_worst():
    balanced = torch.tensor([[LN3, 0], [LN3, 0], [0, LN3], [LN3, 0]])
    collapsed = torch.tensor([[2.0, 0, 0, 0], [2.0, 0, 0, 0]])  # 4 experts, all tokens to 0
    p0 = math.exp(2) / (math.exp(2) + 3)
    fields = moe_fields([balanced, collapsed.reshape(1, 2, 4)])
    assert fields["layer_aux_loss"] == [pytest.approx(1.125), pytest.approx(4 * p0)]
    assert fields["layer_z_loss"] == [pytest.approx(math.log(4) ** 2),
                                      pytest.approx(math.log(math.exp(2) + 3) ** 2)]
    assert fields["layer_utilization"] == [1.0, 0.25]
    assert fields["layer_imbalance"] == [pytest.approx(1.5), pytest.approx(4.0)]
    assert fields["aux_loss"] == pytest.approx((1.125 + 4 * p0) / 2)
    assert fields["expert_utilization"] == pytest.approx(0.625)
    assert fields["load_imbalance"] == pytest.approx(4.0)


def test_moe_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="top_k"):
        moe_fields(torch.zeros(4, 2), top_k=3)
    with pytest.raises(ValueError, match="no tokens"):
        moe_fields(torch.zeros(0, 2))
    with pytest.raises(ValueError, match="no router logits"):
        moe_fields([])
    # A tensor without an experts dimension, or with none in it: named, not torch's
    # reshape or topk error.
    with pytest.raises(ValueError, match=r"at least one expert, got shape \[\]"):
        moe_fields(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"at least one expert, got shape \[4, 0\]"):
        moe_fields(torch.zeros(4, 0))



# -- FLOPs / SOL ------------------------------------------------------------------------

def test_flops_per_token_formula():
    assert flops_per_token(1000) == 6000
    # 6 * 1000 + 12 * 2 layers * 8 hidden * 16 tokens = 6000 + 3072.
    assert flops_per_token(1000, num_layers=2, hidden_size=8, seq_len=16) == 9072
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(1000, seq_len=-1)


def test_tflops_and_sol_percent():
    # 1B params: 6e9 FLOPs per token, 8192 tokens in one second on one GPU = 49.152 TFLOPS.
    fields = throughput_fields(6e9, 8192, 1000.0, peak=peak_tflops("NVIDIA H100 80GB HBM3"))
    assert fields["tflops_per_gpu"] == pytest.approx(49.152)
    assert fields["sol_percent"] == pytest.approx(100 * 49.152 / 989.5)
    # The same global batch over 8 GPUs.
    assert throughput_fields(6e9, 8192, 1000.0, gpus=8)["tflops_per_gpu"] == pytest.approx(6.144)
    assert throughput_fields(6e9, 8192, 0.0) == {}
    assert "sol_percent" not in throughput_fields(6e9, 8192, 1000.0, peak=None)


@pytest.mark.parametrize("name, family", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"), ("Tesla T4", None),
    # Not an A100: its peak would make the SOL % ~100x too low.
    ("NVIDIA RTX A1000", None), ("NVIDIA RTX A1000 6GB Laptop GPU", None),
    # MIG slices (CUDA's names for them): a fraction of the GPU's SMs, so not its peak.
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None),
    ("NVIDIA H200 MIG 7g.141gb", None),
])
def test_gpu_names_map_to_the_peak_table(name, family):
    assert gpu_family(name) == family


def test_peak_table_dtypes():
    assert peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert peak_tflops("Tesla T4") is None
    assert peak_tflops("NVIDIA A100-SXM4-40GB MIG 3g.20gb") is None
    with pytest.raises(ValueError, match="A100 has no fp8"):
        peak_tflops("NVIDIA A100-SXM4-80GB", "fp8")
    with pytest.raises(ValueError, match="fp16x"):
        peak_tflops("NVIDIA H100 PCIe", "fp16x")


# -- end to end: the dicts are Producer kwargs ------------------------------------------

def test_helper_dicts_go_through_the_producer(make_producer, bootstrap, topic_prefix):
    layer = linear_with([[1, 2], [2, 0]], [4, 0])
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.tensor([1.0, 2.0])).sum().backward()
    optimizer.step()
    producer = make_producer(strict=True)
    assert producer.log_step(1, step_tokens=8192, duration_ms=1000.0, loss=2.0, lr=1e-3,
                             **step_fields(layer), **throughput_fields(6e9, 8192, 1000.0, peak=989.5))
    assert producer.log_allocator(1, **allocator_fields(layer, optimizer))
    assert producer.log_moe_stats(1, **moe_fields([torch.zeros(4, 2), torch.zeros(4, 2)]))
    assert producer.flush(30)

    [step] = read_records(bootstrap, topic_prefix, "step", 1)
    # After one SGD step (lr 0.1): W = [[0.9, 1.8], [1.9, -0.2]], b = [3.9, -0.1].
    assert (step.norm, step.num_zeros, step.params_norm, step.num_params) == \
        (pytest.approx(math.sqrt(12)), 0, pytest.approx(math.sqrt(22.92)), 6)
    assert step.sol_percent == pytest.approx(100 * 49.152 / 989.5)
    [allocator] = read_records(bootstrap, topic_prefix, "allocator", 1)
    assert [s.name for s in allocator.stats] == ["weights", "gradients", "optimizer"]
    [moe] = read_records(bootstrap, topic_prefix, "moe", 1)
    assert moe.layer_aux_loss == [pytest.approx(1.0)] * 2
