"""GPU telemetry from NVML (nvidia-ml-py, imported as pynvml): a background sampler that
sends one complete gpu record per GPU every TRAINMON_GPU_INTERVAL_S seconds.

    sampler = GpuSampler(tm).start()     # off, with one info line, without GPU or NVML
    for step in ...:
        sampler.set_step(step)           # the records carry the latest step
    sampler.stop()

Each rank samples its own GPU (CUDA_VISIBLE_DEVICES at LOCAL_RANK), so every record is
tagged with the rank that owns the device. Record ``id`` is the NVML index, the number
nvidia-smi shows. NVML reads are microseconds each and run on the sampler's thread.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, Union

log = logging.getLogger("trainmon.gpu")

DEFAULT_INTERVAL_S = 5.0

# Bits of nvmlDeviceGetCurrentClocksEventReasons (formerly ...ClocksThrottleReasons),
# named as GpuRecord.throttle spells them. GpuIdle (0x1) is left out on purpose: an idle
# GPU clocks down by design, which gpu_util already shows, and it is not throttling.
THROTTLE_REASONS = {
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
    0x200: "board_limit",
    0x400: "reliability",
}
_IDLE = 0x1


@dataclass(frozen=True)
class NvmlReading:
    """One GPU's values as NVML reports them (its units), None where the GPU does not
    support a query (fans on passively cooled boards, energy on older parts)."""

    index: int
    clock_mhz: int | None = None  # SM clock
    max_clock_mhz: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None  # enforced limit
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    gpu_util_percent: int | None = None
    memory_util_percent: int | None = None
    memory_free_bytes: int | None = None
    pcie_rx_kb_per_s: int | None = None
    pcie_tx_kb_per_s: int | None = None
    fan_percent: int | None = None
    clocks_event_reasons: int | None = None
    energy_mj: int | None = None  # since the driver was loaded


def throttle_text(reasons: int | None) -> str:
    """Readable, comma-separated throttle reasons of an NVML clocks-event bitmask; bits
    this table does not know show as hex so nothing is silently dropped."""
    if not reasons:
        return ""
    names = [name for bit, name in THROTTLE_REASONS.items() if reasons & bit]
    unknown = reasons & ~(_IDLE | sum(THROTTLE_REASONS))
    if unknown:
        names.append(hex(unknown))
    return ",".join(names)


def _percent(value: int | None) -> int:
    return min(100, max(0, int(value or 0)))


def gpu_fields(reading: NvmlReading) -> dict[str, Any]:
    """GpuRecord fields (without step) from one NVML reading; unsupported values are 0,
    energy is left out when unknown."""
    fields: dict[str, Any] = {
        "id": reading.index,
        "clock": reading.clock_mhz or 0,
        "max_clock": reading.max_clock_mhz or 0,
        "power": reading.power_mw or 0,
        "power_limit": reading.power_limit_mw or 0,
        "temperature": reading.temperature_c or 0,
        "temp_slowdown": reading.slowdown_temperature_c or 0,
        "gpu_util": _percent(reading.gpu_util_percent),
        "mem_util": _percent(reading.memory_util_percent),
        "dram_free": reading.memory_free_bytes or 0,
        # NVML reports PCIe throughput in KB/s (1 KB = 1024 bytes); GpuRecord has bytes/s.
        "pcie_rx": (reading.pcie_rx_kb_per_s or 0) * 1024,
        "pcie_tx": (reading.pcie_tx_kb_per_s or 0) * 1024,
        "fan": _percent(reading.fan_percent),
        "throttle": throttle_text(reading.clocks_event_reasons),
    }
    if reading.energy_mj is not None:
        fields["energy"] = reading.energy_mj
    return fields


def cuda_version_text(version: int) -> str:
    """NVML / CUDA integer version (12040) as text ("12.4")."""
    return f"{version // 1000}.{version % 1000 // 10}"


# -- reading NVML -----------------------------------------------------------------------

def _query(fn: Callable[..., Any], *args: Any) -> Any:
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def read(handle: Any, index: int) -> NvmlReading:
    import pynvml as n

    clocks_event = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or n.nvmlDeviceGetCurrentClocksThrottleReasons  # renamed in NVML 12.2
    util = _query(n.nvmlDeviceGetUtilizationRates, handle)
    memory = _query(n.nvmlDeviceGetMemoryInfo, handle)
    return NvmlReading(
        index=index,
        clock_mhz=_query(n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_SM),
        max_clock_mhz=_query(n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_SM),
        power_mw=_query(n.nvmlDeviceGetPowerUsage, handle),
        power_limit_mw=_query(n.nvmlDeviceGetEnforcedPowerLimit, handle),
        temperature_c=_query(n.nvmlDeviceGetTemperature, handle, n.NVML_TEMPERATURE_GPU),
        slowdown_temperature_c=_query(n.nvmlDeviceGetTemperatureThreshold, handle,
                                      n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        gpu_util_percent=util.gpu if util else None,
        memory_util_percent=util.memory if util else None,
        memory_free_bytes=memory.free if memory else None,
        pcie_rx_kb_per_s=_query(n.nvmlDeviceGetPcieThroughput, handle, n.NVML_PCIE_UTIL_RX_BYTES),
        pcie_tx_kb_per_s=_query(n.nvmlDeviceGetPcieThroughput, handle, n.NVML_PCIE_UTIL_TX_BYTES),
        fan_percent=_query(n.nvmlDeviceGetFanSpeed, handle),
        clocks_event_reasons=_query(clocks_event, handle),
        energy_mj=_query(n.nvmlDeviceGetTotalEnergyConsumption, handle),
    )


def _own_device(local_rank: int, env: dict) -> int | str:
    """This process's GPU as NVML names it: the CUDA_VISIBLE_DEVICES entry at LOCAL_RANK
    (an index, or a GPU-/MIG- UUID), else LOCAL_RANK itself."""
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if local_rank < len(visible):
        entry = visible[local_rank]
        return int(entry) if entry.isdigit() else entry
    return local_rank


def _handles(devices: Sequence[int | str] | Literal["all"]) -> list[tuple[Any, int]]:
    import pynvml as n

    if devices == "all":
        devices = list(range(n.nvmlDeviceGetCount()))
    handles = []
    for device in devices:
        handle = (n.nvmlDeviceGetHandleByIndex(device) if isinstance(device, int)
                  else n.nvmlDeviceGetHandleByUUID(device))
        handles.append((handle, n.nvmlDeviceGetIndex(handle)))
    return handles


def _unavailable_reason(exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return "nvidia-ml-py is not installed (pip install 'trainmon[gpu]')"
    return f"NVML unavailable ({exc})"


def model_fields(uuid: str) -> dict[str, Any]:
    """What NVML adds to the gpu_model record: NVML index, CUDA driver version, ECC mode.
    Empty without NVML or when the GPU is not found."""
    try:
        import pynvml as n

        n.nvmlInit()
    except Exception:  # ImportError, or NVMLError when there is no driver
        return {}
    try:
        handle = n.nvmlDeviceGetHandleByUUID(uuid)
        fields: dict[str, Any] = {"id": n.nvmlDeviceGetIndex(handle)}
        driver = _query(n.nvmlSystemGetCudaDriverVersion_v2)
        if driver:
            fields["cuda_driver"] = cuda_version_text(driver)
        ecc = _query(n.nvmlDeviceGetEccMode, handle)
        if ecc is not None:
            fields["ecc"] = bool(ecc[0])
        return fields
    except n.NVMLError:
        return {}
    finally:
        n.nvmlShutdown()


# -- the sampler -----------------------------------------------------------------------

Devices = Union[Sequence[Union[int, str]], Literal["all"], None]


class GpuSampler:
    """Background thread sending ``log_gpu_state`` for each GPU every ``interval_s``.

    ``devices``: NVML indices or UUIDs, "all", or None for this process's own GPU.
    ``reader``: where readings come from; None reads NVML. Passing one skips NVML
    entirely (for replaying recorded readings)."""

    def __init__(self, producer: Any, interval_s: float | None = None, devices: Devices = None,
                 *, reader: Callable[[], list[NvmlReading]] | None = None,
                 env: dict | None = None):
        env = os.environ if env is None else env
        if interval_s is None:
            interval_s = float(env.get("TRAINMON_GPU_INTERVAL_S") or DEFAULT_INTERVAL_S)
        self.producer = producer
        self.interval_s = interval_s
        self.step = 0
        self.samples = 0
        self.enabled = False
        local_rank = getattr(getattr(producer, "config", None), "local_rank", 0)
        self._devices = [_own_device(local_rank, env)] if devices is None else devices
        self._reader = reader
        self._nvml_open = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def set_step(self, step: int) -> None:
        """The latest training step; later records carry it."""
        self.step = step

    def start(self) -> "GpuSampler":
        if self.interval_s <= 0:
            log.info("trainmon: GPU telemetry off (TRAINMON_GPU_INTERVAL_S=%s)", self.interval_s)
            return self
        if self._reader is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml_open = True
                handles = _handles(self._devices)
            except Exception as exc:  # no module, no driver, no such GPU: run without telemetry
                log.info("trainmon: GPU telemetry off: %s", _unavailable_reason(exc))
                self._close_nvml()
                return self
            self._reader = lambda: [read(handle, index) for handle, index in handles]
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="trainmon-gpu", daemon=True)
        self._thread.start()
        return self

    def sample(self) -> int:
        """Read every GPU once and send the records; returns how many were sent."""
        assert self._reader is not None
        sent = 0
        for reading in self._reader():
            sent += bool(self.producer.log_gpu_state(self.step, **gpu_fields(reading)))
        self.samples += 1
        return sent

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as exc:  # a GPU fallen off the bus must not end the training
                if not self._failed:
                    log.warning("trainmon: GPU sampling failed (further failures are silent): %s", exc)
                    self._failed = True
            if self._stop.wait(self.interval_s):
                return

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._close_nvml()

    def _close_nvml(self) -> None:
        if self._nvml_open:
            import pynvml

            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass
            self._nvml_open = False

    def __enter__(self) -> "GpuSampler":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
