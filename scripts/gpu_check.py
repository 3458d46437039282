"""Checks trainmon's NVML and CUDA-memory paths on a real NVIDIA GPU, which CI has not.

    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR

Trains a small transformer on the GPU for ``--seconds`` while the producer logs every
step, an allocator record every 10 steps and the run's gpu_model record, and a GpuSampler
reads NVML every 0.25 s (health every 2 s). The producer sends into an in-memory broker
(no Kafka on a GPU machine that has no Java); every message it sent is written to
DIR/gpu-records.jsonl (topic, key and value as Kafka would hold them) so the rest of the
pipeline can take them in on a machine with the broker (tests/test_real_gpu_records.py).

Prints one line per check (ok / FAILED with the values) and NVML's read times, and exits
1 if any check failed. Without CUDA or NVML it says so and checks what it can.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainmon import topics
from trainmon.integrations import nvml
from trainmon.integrations.nvml import GpuSampler
from trainmon.integrations.torch import allocator_fields, gpu_model_fields, step_fields
from trainmon.kafka_client.memory_transport import MemoryBroker
from trainmon.producer import Producer, ProducerConfig
from trainmon.schemas import decode, unpack

failures: list[str] = []


def check(name: str, judge) -> None:
    """``judge()`` returns (ok, detail); one that raises fails its check, not the script."""
    try:
        ok, detail = judge()
    except Exception as exc:
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    print(f"  {'ok    ' if ok else 'FAILED'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def median_us(fn, repeat: int = 200) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def train(producer: Producer, sampler: GpuSampler, device: torch.device, seconds: float) -> dict:
    """A 12-layer transformer, bf16 autocast on CUDA: enough to keep an H100 busy."""
    width, seq, batch = (2048, 1024, 8) if device.type == "cuda" else (64, 32, 4)
    layer = nn.TransformerEncoderLayer(width, nhead=16 if width >= 256 else 4, dim_feedforward=4 * width,
                                       batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, num_layers=12 if device.type == "cuda" else 2,
                                  enable_nested_tensor=False).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    norms = []  # (clip_grad_norm_'s total norm, the step record's norm)
    step, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        step += 1
        sampler.set_step(step)
        began = time.perf_counter()
        x = torch.randn(batch, seq, width, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x).float().pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        fields = step_fields(model)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        norms.append((float(total), fields.get("norm")))
        optimizer.step()
        producer.log_step(step, loss=loss.item(), step_tokens=batch * seq,
                          duration_ms=(time.perf_counter() - began) * 1000, lr=1e-4, **fields)
        if step % 10 == 0:
            producer.log_allocator(step, **allocator_fields(model, optimizer))
    if device.type == "cuda":
        torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()  # AdamW's
                for v in s.values() if isinstance(v, torch.Tensor) and v.device == device)  # step: CPU
    return {"steps": step, "norms": norms, "param_bytes": params, "optimizer_bytes": state}


def captured(broker: MemoryBroker) -> tuple[list[dict], dict[str, list]]:
    lines, records = [], {}
    for topic, messages in broker.topics.items():
        kind = topics.kind_of(topic)
        for key, value in messages:
            lines.append({"topic": topic, "key": base64.b64encode(key).decode(),
                          "value": base64.b64encode(value).decode()})
            records.setdefault(kind, []).extend(decode(kind, data) for data in unpack(value))
    return lines, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if cuda else 'no CUDA device'}", flush=True)

    broker = MemoryBroker()
    producer = Producer(ProducerConfig(run_id=f"gpu-check-{int(time.time())}",
                                       spill_dir=Path(tempfile.mkdtemp()) / "spill"),
                        transport=broker.transport)
    producer.run_start(config={"purpose": "scripts/gpu_check.py"}, name="gpu-check")
    model_fields = gpu_model_fields() if cuda else None
    if model_fields:
        producer.log_gpu_model(**model_fields)
    torch.empty(1, device=device)  # a CUDA context before the sampler's first read
    sampler = GpuSampler(producer, interval_s=0.25, health_interval_s=2.0).start()
    print(f"GPU sampler enabled: {sampler.enabled}", flush=True)
    result = train(producer, sampler, device, args.seconds)
    sampler.stop()
    producer.run_end("success")
    delivered = producer.close()

    lines, records = captured(broker)
    (args.out / "gpu-records.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    counts = {kind: len(found) for kind, found in sorted(records.items())}
    print(f"{result['steps']} steps; records sent per kind: {counts}", flush=True)

    print("checks:")
    check("every record delivered", lambda: (delivered, ""))
    check("every step record sent", lambda: (counts.get("step") == result["steps"],
                                             f"{counts.get('step')} of {result['steps']}"))
    worst = max(abs(n - m) / max(n, 1e-12) for n, m in result["norms"])
    check("step norm equals clip_grad_norm_'s",
          lambda: (worst < 1e-3, f"worst relative difference {worst:.2e}"))
    if not cuda:
        print("no CUDA: the GPU checks are skipped", flush=True)
        return 1 if failures else 0
    gpu_checks(records, model_fields["uuid"], sampler, result, args.seconds)
    print(f"{len(failures)} check(s) failed: {failures}" if failures else "all checks passed")
    return 1 if failures else 0


def gpu_checks(records: dict, uuid: str, sampler: GpuSampler, result: dict, seconds: float) -> None:
    import pynvml as n

    n.nvmlInit()
    handle = n.nvmlDeviceGetHandleByUUID(uuid)
    index = n.nvmlDeviceGetIndex(handle)
    memory_total = n.nvmlDeviceGetMemoryInfo(handle).total
    ecc_on = bool(n.nvmlDeviceGetEccMode(handle)[0])
    check("sampler on", lambda: (sampler.enabled, ""))

    model = records["gpu_model"][0]
    print(f"  gpu_model: {model.name}, {model.sm_count} SMs, sm_{model.major}{model.minor}, "
          f"L2 {model.l2_size}, driver CUDA {model.cuda_driver}, runtime {model.cuda_runtime}")
    check("gpu_model uuid is NVML's", lambda: (model.uuid == n.nvmlDeviceGetUUID(handle), model.uuid))
    check("gpu_model id is NVML's index", lambda: (model.id == index, f"{model.id} / {index}"))
    check("gpu_model ecc is NVML's mode", lambda: (model.ecc == ecc_on, f"{model.ecc}"))
    check("gpu_model memory near NVML's total",
          lambda: (abs(model.memory - memory_total) <= 0.05 * memory_total,
                   f"torch {model.memory} / NVML {memory_total} bytes"))

    gpus = records.get("gpu", [])
    check("gpu records over the run", lambda: (len(gpus) >= seconds * 2, f"{len(gpus)}"))
    check("gpu records name NVML's index", lambda: ({g.id for g in gpus} == {index}, ""))
    check("power in mW (50 W..2 kW)",
          lambda: (all(50_000 <= g.power <= 2_000_000 for g in gpus),
                   f"{min(g.power for g in gpus)}..{max(g.power for g in gpus)} mW, "
                   f"limit {gpus[-1].power_limit} mW"))
    check("temperature in degrees C",
          lambda: (all(10 <= g.temperature <= 110 for g in gpus),
                   f"{min(g.temperature for g in gpus)}..{max(g.temperature for g in gpus)} C, "
                   f"slowdown at {gpus[-1].temp_slowdown} C"))
    check("GPU busy while training", lambda: (max(g.gpu_util for g in gpus) >= 50,
                                              f"peak gpu_util {max(g.gpu_util for g in gpus)} %"))
    check("clock within max", lambda: (all(g.clock <= g.max_clock for g in gpus),
                                       f"{max(g.clock for g in gpus)} of {gpus[-1].max_clock} MHz"))
    check("energy counter rises (mJ)",
          lambda: (all(g.energy is not None for g in gpus) and gpus[-1].energy > gpus[0].energy,
                   f"{(gpus[-1].energy - gpus[0].energy) / 1000:.0f} J over the run"))
    allocators = records.get("allocator", [])
    check("NVML used >= torch reserved",
          lambda: (memory_total - min(g.dram_free for g in gpus) >= max(a.reserved for a in allocators),
                   f"used {memory_total - min(g.dram_free for g in gpus)}, "
                   f"reserved {max(a.reserved for a in allocators)} bytes"))
    print(f"  throttle reasons seen: {sorted({g.throttle for g in gpus})}; pcie rx/tx peak "
          f"{max((g.pcie_rx for g in gpus), default=None)}/{max((g.pcie_tx for g in gpus), default=None)}"
          f" B/s; fan {gpus[-1].fan if gpus else None} %")

    health = records.get("gpu_health", [])
    check("gpu_health records", lambda: (len(health) >= 2, f"{len(health)}"))
    if health:
        last = health[-1].model_dump(exclude_none=True)
        absent = sorted(set(type(health[-1]).model_fields) - set(last))
        print(f"  gpu_health fields absent (NVML did not report them): {absent}")
        print(f"  gpu_health: {({k: v for k, v in last.items() if k not in ('time', 'event_id')})}")
        check("ECC counts present when ECC is on",
              lambda: (not ecc_on or last.get("ecc_volatile_corrected") is not None, f"ecc on: {ecc_on}"))
        check("xids a list where events registered, else absent",
              lambda: (sampler_xids_ok(health), f"{last.get('xids')}"))

    check("allocator: allocated <= reserved <= peak_reserved",
          lambda: (all(a.allocated <= a.reserved <= a.peak_reserved for a in allocators),
                   f"last {allocators[-1].allocated} / {allocators[-1].reserved} / "
                   f"{allocators[-1].peak_reserved}"))
    segments = {s.name: s.device for s in allocators[-1].stats} if allocators else {}
    check("weights segment is the parameters' bytes",
          lambda: (segments["weights"] == result["param_bytes"],
                   f"{segments['weights']} / {result['param_bytes']}"))
    check("optimizer segment is AdamW's state on the GPU",
          lambda: (segments["optimizer"] == result["optimizer_bytes"],
                   f"{segments['optimizer']} / {result['optimizer_bytes']}"))
    check("segments add up to allocated",
          lambda: (sum(segments.values()) == allocators[-1].allocated,
                   f"{sum(segments.values())} / {allocators[-1].allocated} "
                   f"(activations {segments.get('activations')})"))
    check("peak allocated at least current",
          lambda: (allocators[-1].peak_allocated >= allocators[-1].allocated, ""))

    read_us = median_us(lambda: nvml.read(handle, index))
    health_us = median_us(lambda: nvml.read_health(handle, index), repeat=50)
    print(f"NVML read time, median: gpu record {read_us:.0f} us, gpu_health {health_us:.0f} us")
    try:
        events = nvml.XidEvents([(handle, index)])
        drain_us = median_us(events.drain, repeat=20)
        print(f"XID events registered: {bool(events.supported)}; a drain with no event {drain_us:.0f} us")
        events.close()
    except Exception as exc:
        print(f"XID events: {type(exc).__name__}: {exc}")
    alloc_us = median_us(lambda: allocator_fields(None, None))
    print(f"torch.cuda.memory_stats -> allocator fields: {alloc_us:.0f} us")
    n.nvmlShutdown()


def sampler_xids_ok(health: list) -> bool:
    """xids is a list (no XID in a healthy run) where events registered, None elsewhere."""
    return all(h.xids in ([], None) and (h.xids is None) == (h.xid_count is None) for h in health)


if __name__ == "__main__":
    sys.exit(main())
