"""The training job of test_cluster_hosts.py, launched by torchrun on each node: gloo on
CPU, every rank logs JOB_STEPS steps through trainmon's producer, configured only by the
env a stack printed (TRAINMON_KAFKA_*) and its CA file."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import trainmon.producer as tm


def main() -> None:
    steps = int(os.environ.get("JOB_STEPS", "30"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tm.run_start(config={"world_size": dist.get_world_size()})
    for step in range(steps):
        loss = torch.tensor([2.0 - step / 100 + rank / 1000])
        dist.all_reduce(loss)  # the ranks talk to each other across the hosts
        tm.log_step(step, loss=loss.item() / dist.get_world_size(), step_tokens=1024, duration_ms=10.0)
    tm.run_end()
    delivered = tm.flush(60)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: delivered={delivered}", flush=True)


if __name__ == "__main__":
    main()
