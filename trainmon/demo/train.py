"""The demo's training job: one process per rank, a tiny mixture-of-experts language model
trained on CPU with torch.distributed (gloo), logging every step through the producer.

Ranks train on their own shards and average their parameters every ``--sync-every`` steps
(local SGD), so a stalled rank really falls behind the others until the next sync point.
Injected anomalies, each on a step given on the command line:

- a grad spike: every rank's gradients are scaled up 40x for one step;
- a stall: one rank sleeps for a few seconds, the others run on to the next sync;
- a NaN loss: one rank's loss goes NaN; the step is skipped, as GradScaler would.

Launched by ``trainmon demo`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as
torchrun would, and TRAINMON_* set for the producer: the job itself has no trainmon setup.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import trainmon.producer as tm
from trainmon.integrations.flops import flops_per_token, throughput_fields
from trainmon.integrations.moe import moe_fields
from trainmon.integrations.nvml import GpuSampler
from trainmon.integrations.torch import allocator_fields, step_fields

VOCAB, DIM, EXPERTS, SEQ, BATCH = 128, 64, 4, 32, 16
# Megatron reports the router losses times their coefficients (moe_aux_loss_coeff,
# moe_z_loss_coeff); the alert thresholds (aux > 1.0, z > 0.1) are meant for those.
AUX_LOSS_COEFF, Z_LOSS_COEFF = 1e-2, 1e-3


class MoeFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                   nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS))
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, DIM)
        logits = self.router(tokens)
        self.router_logits = logits.detach()
        gate, choice = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            picked = choice == e
            if picked.any():
                out[picked] = gate[picked, None] * expert(tokens[picked])
        return out.reshape_as(x)


class TinyMoeLM(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn = nn.ModuleList(nn.MultiheadAttention(DIM, 4, batch_first=True) for _ in range(layers))
        self.moe = nn.ModuleList(MoeFeedForward() for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2 * layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, (attn, moe) in enumerate(zip(self.attn, self.moe)):
            h = self.norms[2 * i](x)
            x = x + attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
            x = x + moe(self.norms[2 * i + 1](x))
        return self.head(x)


# A fixed random Markov chain over the vocabulary: the loss falls towards the chain's
# entropy and stays there, as a real run's would, instead of collapsing to zero.
TRANSITIONS = torch.softmax(2.0 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)), -1)


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seq = [torch.randint(0, VOCAB, (BATCH,), generator=generator)]
    for _ in range(SEQ):
        seq.append(torch.multinomial(TRANSITIONS[seq[-1]], 1, generator=generator).squeeze(1))
    tokens = torch.stack(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def average_parameters(model: nn.Module, world_size: int) -> None:
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= world_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="trainmon demo training job (one rank)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--spike-step", type=int, default=30)
    parser.add_argument("--stall-step", type=int, default=52)
    parser.add_argument("--stall-rank", type=int, default=2)
    parser.add_argument("--stall-seconds", type=float, default=8.0)
    parser.add_argument("--nan-step", type=int, default=75)
    parser.add_argument("--nan-rank", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyMoeLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = 10
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    data = torch.Generator().manual_seed(1000 + rank)
    num_params = sum(p.numel() for p in model.parameters())
    per_token = flops_per_token(num_params, num_layers=len(model.attn), hidden_size=DIM, seq_len=SEQ)
    tokens_per_step = BATCH * SEQ

    producer = tm.get_producer()
    producer.run_start(config={"model": "tiny-moe-lm", "params": num_params, "experts": EXPERTS,
                               "steps": args.steps, "lr": 3e-3, "batch": BATCH, "seq": SEQ,
                               "sync_every": args.sync_every},
                       name="trainmon-demo", hostnames=[os.uname().nodename],
                       versions={"torch": torch.__version__})
    producer.log_dataset("train", files=world_size, tokens=tokens_per_step * args.steps * world_size,
                         file_index=rank, seed=1000 + rank)
    gpus = GpuSampler(producer).start()  # turns itself off with one line on a machine without GPUs

    dist.barrier()  # start together: a rank still importing torch is not a lagging rank
    status = "failed"
    try:
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            gpus.set_step(step)
            if rank == args.stall_rank and step == args.stall_step:
                time.sleep(args.stall_seconds)  # injected: this rank stalls
            tokens, targets = batch(data)
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            if rank == args.nan_rank and step == args.nan_step:
                loss = loss * math.nan  # injected: a NaN loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if step == args.spike_step:
                for p in model.parameters():  # injected: a grad spike on every rank
                    if p.grad is not None:
                        p.grad.mul_(40.0)
            fields = step_fields(model)  # before clipping: the norm Megatron and HF log
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            skipped = 0
            if math.isfinite(loss.item()):
                optimizer.step()
            else:
                skipped = 1  # as GradScaler does: no update from a non-finite step
            schedule.step()
            if step % args.sync_every == 0:
                average_parameters(model, world_size)
            duration_ms = (time.perf_counter() - started) * 1000.0
            producer.log_step(step, epoch=step / args.steps, step_tokens=tokens_per_step,
                              duration_ms=duration_ms, loss=loss.item(), lr=schedule.get_last_lr()[0],
                              total_steps=args.steps, skipped=skipped,
                              consumed_samples=step * BATCH * world_size,
                              global_batch_size=BATCH * world_size,
                              timers={"forward-backward": duration_ms}, **fields,
                              **throughput_fields(per_token, tokens_per_step, duration_ms))
            moe = moe_fields([layer.router_logits for layer in model.moe], top_k=1)
            for key, coeff in (("aux_loss", AUX_LOSS_COEFF), ("z_loss", Z_LOSS_COEFF)):
                moe[key] *= coeff
                moe[f"layer_{key}"] = [v * coeff for v in moe[f"layer_{key}"]]
            producer.log_moe_stats(step, **moe)
            if step % 10 == 0:
                producer.log_allocator(step, **allocator_fields(model, optimizer))
            if step % args.eval_every == 0:
                eval_started = time.perf_counter()
                with torch.no_grad():
                    eval_tokens, eval_targets = batch(torch.Generator().manual_seed(7))
                    eval_loss = F.cross_entropy(model(eval_tokens).reshape(-1, VOCAB),
                                                eval_targets.reshape(-1)).item()
                producer.log_eval(step, epoch=step / args.steps, eval_tokens=eval_tokens.numel(),
                                  duration_ms=(time.perf_counter() - eval_started) * 1000.0,
                                  loss=eval_loss)
            if rank == 0 and step % 10 == 0:
                print(f"   rank 0 at step {step}/{args.steps}, loss {loss.item():.3f}", flush=True)
        status = "success"
    finally:
        gpus.stop()
        producer.run_end(status)
        producer.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
