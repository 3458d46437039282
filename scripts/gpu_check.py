"""Checks trainmon's NVML and CUDA-memory paths on a real NVIDIA GPU, which CI has not.

    PYTHONPATH=. python3 scripts/gpu_check.py --out DIR

Trains a small transformer on the GPU for ``--seconds`` while the producer logs every
step, an allocator record every 10 steps and the run's gpu_model record, and a GpuSampler
reads NVML every 0.25 s (health every 2 s). The producer sends into an in-memory broker
(no Kafka on a GPU machine that has no Java); every record it sent is written to
DIR/gpu-records.jsonl ({"kind", "record"} per line), for the rest of the pipeline to take
in on a machine with the broker (tests/data/gpu/, tests/test_real_gpu_records.py).

Then the HF Trainer's callback and Lightning's logger each train a small model on the
device (when installed): their gpu_model, gpu and allocator records.

Prints one line per check (ok / FAILED with the values) and NVML's read times, and exits
1 if any check failed. Without CUDA or NVML it says so and checks what it can.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from trainmon import topics
from trainmon.integrations import nvml
from trainmon.integrations.moe import moe_fields
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
    return wall_and_cpu_us(fn, repeat)[0]


def wall_and_cpu_us(fn, repeat: int) -> tuple[float, float]:
    """Median wall and CPU (this thread's) time of ``fn()`` in microseconds."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def train(producer: Producer, sampler: GpuSampler, device: torch.device, seconds: float) -> dict:
    """A small causal language model (12 layers of width 2048 on CUDA, bf16 autocast:
    enough to keep an H100 busy) learning next-token prediction on random tokens, so its
    loss behaves as a language model's does (ln(vocab) and slowly falling)."""
    cuda = device.type == "cuda"
    vocab, width, layers, seq, batch = (32_000, 2048, 12, 1024, 8) if cuda else (512, 64, 2, 32, 4)
    layer = nn.TransformerEncoderLayer(width, nhead=16 if cuda else 4, dim_feedforward=4 * width,
                                       batch_first=True, norm_first=True)
    model = nn.ModuleDict({"embed": nn.Embedding(vocab, width),
                           "blocks": nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                           "head": nn.Linear(width, vocab, bias=False)}).to(device)
    causal = nn.Transformer.generate_square_subsequent_mask(seq, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    norms = []  # (clip_grad_norm_'s total norm, the step record's norm)
    step, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        step += 1
        sampler.set_step(step)
        began = time.perf_counter()
        tokens = torch.randint(vocab, (batch, seq + 1), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            hidden = model["blocks"](model["embed"](tokens[:, :-1]), mask=causal, is_causal=True)
            logits = model["head"](hidden).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
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
    if cuda:
        torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values()  # AdamW's
                for v in s.values() if isinstance(v, torch.Tensor) and v.device.type == device.type)  # step: CPU
    return {"steps": step, "norms": norms, "param_bytes": params, "optimizer_bytes": state}


def captured(broker: MemoryBroker) -> tuple[list[str], dict[str, list]]:
    """Every record the producer sent: as JSON lines {"kind", "record"} and decoded by kind."""
    lines, records = [], {}
    for topic, messages in broker.topics.items():
        kind = topics.kind_of(topic)
        for _, value in messages:
            for data in unpack(value):
                lines.append(json.dumps({"kind": kind, "record": json.loads(data)}))
                records.setdefault(kind, []).append(decode(kind, data))
    return lines, records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--no-frameworks", action="store_true", help="skip the HF and Lightning runs")
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
    (args.out / "gpu-records.jsonl").write_text("".join(line + "\n" for line in lines))
    counts = {kind: len(found) for kind, found in sorted(records.items())}
    print(f"{result['steps']} steps; records sent per kind: {counts}", flush=True)

    print("checks:")
    check("every record delivered", lambda: (delivered, ""))
    check("every step record sent", lambda: (counts.get("step") == result["steps"],
                                             f"{counts.get('step')} of {result['steps']}"))
    worst = max(abs(n - m) / max(n, 1e-12) for n, m in result["norms"])
    check("step norm equals clip_grad_norm_'s",
          lambda: (worst < 1e-3, f"worst relative difference {worst:.2e}"))
    if cuda:
        gpu_checks(records, model_fields["uuid"], sampler, result, args.seconds)
    else:
        print("no CUDA: the GPU checks are skipped", flush=True)
    if not args.no_frameworks:
        framework_checks(cuda)
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

    fresh = wall_and_cpu_us(lambda: nvml.read(handle, index), repeat=20)
    known: dict = {}
    sampler_reads = wall_and_cpu_us(lambda: nvml.read(handle, index, known), repeat=20)
    health = wall_and_cpu_us(lambda: nvml.read_health(handle, index), repeat=20)
    print("NVML reads, wall/CPU us (median of 20): a gpu record asking everything "
          f"{fresh[0]:.0f}/{fresh[1]:.0f}, as the sampler asks (fixed and unsupported once) "
          f"{sampler_reads[0]:.0f}/{sampler_reads[1]:.0f}; a gpu_health record {health[0]:.0f}/{health[1]:.0f}")
    query_times(n, handle)
    try:
        events = nvml.XidEvents([(handle, index)])
        drain_us = median_us(events.drain, repeat=20)
        print(f"XID events registered: {bool(events.supported)}; a drain with no event {drain_us:.0f} us")
        events.close()
    except Exception as exc:
        print(f"XID events: {type(exc).__name__}: {exc}")
    logits = torch.randn(64, 8)  # MoE layers on two devices (pipeline stages, device_map="auto")
    check("MoE stats of layers on the CPU and the GPU",
          lambda: (math.isclose(moe_fields([logits, logits.cuda()])["layer_aux_loss"][1],
                                moe_fields(logits)["aux_loss"], rel_tol=1e-5), ""))
    alloc_us = median_us(lambda: allocator_fields(None, None))
    print(f"torch.cuda.memory_stats -> allocator fields: {alloc_us:.0f} us")
    n.nvmlShutdown()


def query_times(n, handle) -> None:
    """Wall and CPU time of each NVML query a gpu record makes (median of 10): which
    ones wait, and whether they wait on the CPU."""
    clocks_event = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or n.nvmlDeviceGetCurrentClocksThrottleReasons
    queries = {
        "clock": (n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM),
        "max_clock": (n.nvmlDeviceGetMaxClockInfo, n.NVML_CLOCK_SM),
        "power": (n.nvmlDeviceGetPowerUsage,), "power_limit": (n.nvmlDeviceGetEnforcedPowerLimit,),
        "temperature": (n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU),
        "temp_slowdown": (n.nvmlDeviceGetTemperatureThreshold, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        "utilization": (n.nvmlDeviceGetUtilizationRates,), "memory": (n.nvmlDeviceGetMemoryInfo,),
        "pcie_rx": (n.nvmlDeviceGetPcieThroughput, n.NVML_PCIE_UTIL_RX_BYTES),
        "pcie_tx": (n.nvmlDeviceGetPcieThroughput, n.NVML_PCIE_UTIL_TX_BYTES),
        "fan": (n.nvmlDeviceGetFanSpeed,), "throttle": (clocks_event,),
        "energy": (n.nvmlDeviceGetTotalEnergyConsumption,),
    }
    parts = []
    for name, (fn, *args) in queries.items():
        walls, cpus = [], []
        for _ in range(10):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                fn(handle, *args)
            except n.NVMLError:
                pass
            cpus.append(time.thread_time() - cpu)
            walls.append(time.perf_counter() - wall)
        parts.append(f"{name} {statistics.median(walls) * 1e6:.0f}/{statistics.median(cpus) * 1e6:.0f}")
    print("NVML queries, wall/CPU us (median of 10): " + ", ".join(parts))


def framework_checks(cuda: bool) -> None:
    """The HF Trainer's callback and Lightning's logger, each training a small model on
    this machine's device: with CUDA, their gpu_model, gpu and allocator records."""
    import os
    import threading

    os.environ["TRAINMON_GPU_INTERVAL_S"] = "0.2"  # (5 s by default: these runs are short)

    def producer_for(run_id: str) -> tuple[Producer, MemoryBroker]:
        broker = MemoryBroker()
        return Producer(ProducerConfig(run_id=run_id, spill_dir=Path(tempfile.mkdtemp()) / "spill"),
                        transport=broker.transport), broker

    def samplers() -> int:
        return sum(t.name == "trainmon-gpu" for t in threading.enumerate())

    def judge(name: str, broker: MemoryBroker, steps: list[int], param_bytes: int | None) -> None:
        _, records = captured(broker)
        allocators = records.get("allocator", [])
        print(f"  {name}: records per kind {({k: len(v) for k, v in sorted(records.items())})}")
        check(f"{name}: gpu_model only on CUDA", lambda: (len(records.get("gpu_model", [])) == int(cuda), ""))
        check(f"{name}: allocator records with the logged steps on CUDA",
              lambda: ([a.step for a in allocators] == (steps if cuda else []), f"{[a.step for a in allocators]}"))
        if cuda:
            gpus = records.get("gpu", [])
            check(f"{name}: gpu records carry training steps",
                  lambda: (bool(gpus) and max(g.step for g in gpus) > 0, f"{len(gpus)} records"))
            check(f"{name}: allocated on the GPU", lambda: (allocators[-1].allocated > 0, f"{allocators[-1].allocated}"))
            if param_bytes is not None:
                segments = {s.name: s.device for s in allocators[-1].stats}
                check(f"{name}: weights segment on the GPU", lambda: (segments["weights"] == param_bytes,
                                                                      f"{segments['weights']} / {param_bytes}"))
                check(f"{name}: optimizer segment on the GPU", lambda: (segments["optimizer"] >= 2 * param_bytes,
                                                                        f"{segments['optimizer']}"))

    try:
        import transformers

        from trainmon.integrations.hf import TrainmonCallback
    except ImportError as exc:
        print(f"HF Trainer not checked: {exc}")
    else:
        producer, broker = producer_for("gpu-check-hf")
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1024, n_positions=128, n_embd=256, n_layer=4, n_head=4))
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 1024, (256, 128))]
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), max_steps=30, logging_steps=5, save_strategy="no",
            per_device_train_batch_size=16, report_to="none", use_cpu=not cuda, disable_tqdm=True)
        before = samplers()
        transformers.Trainer(model=model, args=args, train_dataset=data,
                             callbacks=[TrainmonCallback(producer)]).train()
        check("HF: sampler stopped at the end", lambda: (samplers() == before, ""))
        producer.close()
        judge("HF", broker, list(range(5, 31, 5)),
              sum(p.numel() * p.element_size() for p in model.parameters()))

    try:
        import lightning

        from trainmon.integrations.lightning import TrainmonLogger
    except ImportError as exc:
        print(f"Lightning not checked: {exc}")
        return

    class Regression(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1))

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    producer, broker = producer_for("gpu-check-lightning")
    x = torch.randn(512, 256)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    before = samplers()
    lightning.Trainer(max_steps=20, log_every_n_steps=5, accelerator="gpu" if cuda else "cpu", devices=1,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      logger=TrainmonLogger(producer), default_root_dir=tempfile.mkdtemp()
                      ).fit(Regression(), loader)
    check("Lightning: sampler stopped at the end", lambda: (samplers() == before, ""))
    producer.close()
    _, records = captured(broker)
    judge("Lightning", broker, [s.step for s in records.get("step", [])], None)


def sampler_xids_ok(health: list) -> bool:
    """xids is a list (no XID in a healthy run) where events registered, None elsewhere."""
    return all(h.xids in ([], None) and (h.xids is None) == (h.xid_count is None) for h in health)


if __name__ == "__main__":
    sys.exit(main())
