"""GPU telemetry: NVML values -> gpu record fields by hand, the sampler turning itself off
without NVML (this machine has no GPU), and its thread sending records through the real
broker, tagged with the latest step."""

from __future__ import annotations

import logging
import sys

from tests.conftest import read_records
from trainmon.integrations.nvml import (GpuSampler, NvmlReading, _own_device, cuda_version_text,
                                        gpu_fields, throttle_text)
from trainmon.schemas import GpuRecord

from .waiting import wait_until

READING = NvmlReading(index=3, clock_mhz=1755, max_clock_mhz=1980, power_mw=612_345,
                      power_limit_mw=700_000, temperature_c=78, slowdown_temperature_c=87,
                      gpu_util_percent=97, memory_util_percent=41, memory_free_bytes=5 * 2**30,
                      pcie_rx_kb_per_s=1000, pcie_tx_kb_per_s=250, fan_percent=None,
                      clocks_event_reasons=0x4 | 0x40, energy_mj=9_876_543)


def test_throttle_reasons_are_readable():
    assert throttle_text(None) == ""
    assert throttle_text(0) == ""
    assert throttle_text(0x1) == ""  # idle is not throttling
    assert throttle_text(0x4 | 0x40) == "sw_power_cap,hw_thermal"
    assert throttle_text(0x1 | 0x8 | 0x80) == "hw_slowdown,hw_power_brake"
    assert throttle_text(0x800 | 0x20) == "sw_thermal,0x800"


def test_reading_to_gpu_record_fields_by_hand():
    fields = gpu_fields(READING)
    assert fields == {"id": 3, "clock": 1755, "max_clock": 1980, "power": 612_345,
                      "power_limit": 700_000, "temperature": 78, "temp_slowdown": 87,
                      "gpu_util": 97, "mem_util": 41, "dram_free": 5 * 2**30,
                      "pcie_rx": 1_024_000, "pcie_tx": 256_000, "fan": 0,
                      "throttle": "sw_power_cap,hw_thermal", "energy": 9_876_543}
    GpuRecord(run_id="r", rank=0, world_size=1, host="h", time="2025-01-01T00:00:00Z",
              event_id="e", step=1, **fields)


def test_unsupported_values_become_zero_and_energy_is_left_out():
    fields = gpu_fields(NvmlReading(index=0, gpu_util_percent=101, fan_percent=-1))
    assert fields["gpu_util"] == 100 and fields["fan"] == 0
    assert fields["power"] == 0 and fields["throttle"] == ""
    assert "energy" not in fields


def test_cuda_versions_as_text():
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert cuda_version_text(12090) == "12.9"


def test_each_rank_samples_its_own_gpu():
    assert _own_device(1, {"CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert _own_device(0, {"CUDA_VISIBLE_DEVICES": "GPU-8b1f,GPU-77aa"}) == "GPU-8b1f"
    assert _own_device(2, {}) == 2


def test_without_nvml_library_the_sampler_turns_itself_off(make_producer, caplog):
    # This machine has nvidia-ml-py but no GPU driver: nvmlInit fails.
    caplog.set_level(logging.INFO, logger="trainmon.gpu")
    sampler = GpuSampler(make_producer(), interval_s=0.01).start()
    assert not sampler.enabled
    sampler.stop()
    [line] = [r for r in caplog.records if r.name == "trainmon.gpu"]
    assert line.levelno == logging.INFO
    assert "GPU telemetry off: NVML unavailable" in line.getMessage()


def test_without_nvidia_ml_py_the_sampler_says_what_to_install(make_producer, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" fail
    caplog.set_level(logging.INFO, logger="trainmon.gpu")
    with GpuSampler(make_producer(), interval_s=0.01) as sampler:
        assert not sampler.enabled
    assert "pip install 'trainmon[gpu]'" in caplog.text


def test_interval_zero_turns_telemetry_off(make_producer, caplog):
    caplog.set_level(logging.INFO, logger="trainmon.gpu")
    sampler = GpuSampler(make_producer(), env={"TRAINMON_GPU_INTERVAL_S": "0"}).start()
    assert not sampler.enabled and sampler.interval_s == 0
    assert "TRAINMON_GPU_INTERVAL_S=0" in caplog.text


def test_sampler_sends_records_tagged_with_the_latest_step(make_producer, bootstrap, topic_prefix):
    producer = make_producer(strict=True)
    sampler = GpuSampler(producer, interval_s=0.05, reader=lambda: [READING])
    sampler.set_step(7)
    sampler.start()
    assert sampler.enabled
    wait_until(lambda: sampler.samples >= 1)
    sampler.set_step(8)
    seen = sampler.samples
    wait_until(lambda: sampler.samples >= seen + 2)
    sampler.stop()
    assert producer.flush(30)

    records = read_records(bootstrap, topic_prefix, "gpu", sampler.samples)
    assert len(records) == sampler.samples
    assert records[0].step == 7 and records[-1].step == 8
    assert records[-1].model_dump(include=set(gpu_fields(READING))) == gpu_fields(READING)


def test_a_failing_read_is_reported_once_and_sampling_goes_on(make_producer, caplog):
    caplog.set_level(logging.INFO, logger="trainmon.gpu")
    calls = []

    def reader():
        calls.append(1)
        raise RuntimeError("GPU has fallen off the bus")

    sampler = GpuSampler(make_producer(), interval_s=0.01, reader=reader).start()
    wait_until(lambda: len(calls) >= 3)
    sampler.stop()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fallen off the bus" in warnings[0].getMessage()


class FakeNvml:
    """The pynvml functions ``read`` calls, counting the calls: the fan is not supported
    (a passively cooled board), the power reading fails once for another reason."""

    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_UNKNOWN = 3, 999
    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1, 0, 1
    NVML_PCIE_UTIL_RX_BYTES, NVML_PCIE_UTIL_TX_BYTES = 1, 0

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    def __init__(self):
        from collections import Counter
        from types import SimpleNamespace

        self.calls = Counter()
        self.power_fails = 1

        def answer(name, value):
            def fn(*args):
                self.calls[name] += 1
                return value(*args) if callable(value) else value
            return fn

        def fan(handle):
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)

        def power(handle):
            if self.power_fails:
                self.power_fails -= 1
                raise self.NVMLError(self.NVML_ERROR_UNKNOWN)
            return 612_345

        self.nvmlDeviceGetUtilizationRates = answer("util", SimpleNamespace(gpu=97, memory=41))
        self.nvmlDeviceGetMemoryInfo = answer("memory", SimpleNamespace(free=5 * 2**30))
        self.nvmlDeviceGetClockInfo = answer("clock", 1755)
        self.nvmlDeviceGetMaxClockInfo = answer("max_clock", 1980)
        self.nvmlDeviceGetPowerUsage = answer("power", power)
        self.nvmlDeviceGetEnforcedPowerLimit = answer("power_limit", 700_000)
        self.nvmlDeviceGetTemperature = answer("temperature", 78)
        self.nvmlDeviceGetTemperatureThreshold = answer("slowdown", 87)
        self.nvmlDeviceGetPcieThroughput = answer("pcie", 1000)
        self.nvmlDeviceGetFanSpeed = answer("fan", fan)
        self.nvmlDeviceGetCurrentClocksEventReasons = answer("throttle", 0x4)
        self.nvmlDeviceGetTotalEnergyConsumption = answer("energy", 9_876_543)


def test_fixed_readings_and_unsupported_queries_are_asked_once_per_gpu(monkeypatch):
    from trainmon.integrations import nvml

    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    known: dict = {}
    readings = [nvml.read("handle", 3, known) for _ in range(3)]
    assert readings[0].power_mw is None  # failed, but not as unsupported: asked again
    assert readings[1] == readings[2] == NvmlReading(
        index=3, clock_mhz=1755, max_clock_mhz=1980, power_mw=612_345, power_limit_mw=700_000,
        temperature_c=78, slowdown_temperature_c=87, gpu_util_percent=97, memory_util_percent=41,
        memory_free_bytes=5 * 2**30, pcie_rx_kb_per_s=1000, pcie_tx_kb_per_s=1000,
        fan_percent=None, clocks_event_reasons=0x4, energy_mj=9_876_543)
    assert fake.calls["max_clock"] == fake.calls["slowdown"] == 1
    assert fake.calls["fan"] == 1 and "fan_percent" in known  # refused once, never asked again
    assert fake.calls["power"] == fake.calls["clock"] == fake.calls["energy"] == 3
    # Without a memo every reading is asked each time (another GPU's sampler, a replay).
    nvml.read("handle", 3)
    assert fake.calls["max_clock"] == 2
