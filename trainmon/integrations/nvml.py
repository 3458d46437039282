"""GPU telemetry from NVML (nvidia-ml-py, imported as pynvml): a background sampler that
sends one complete gpu record per GPU every TRAINMON_GPU_INTERVAL_S seconds.

    sampler = GpuSampler(tm).start()     # off, with one info line, without GPU or NVML
    for step in ...:
        sampler.set_step(step)           # the records carry the latest step
    sampler.stop()

Each rank samples its own GPU (CUDA_VISIBLE_DEVICES at LOCAL_RANK), so every record is
tagged with the rank that owns the device. Record ``id`` is the NVML index, the number
nvidia-smi shows. NVML reads are microseconds each and run on the sampler's thread.

The same thread sends a gpu_health record per GPU every TRAINMON_GPU_HEALTH_INTERVAL_S
seconds (60; 0 turns it off): ECC error counts, remapped rows or retired pages, the PCIe
replay counter, NVLink error counters, and the critical XID errors NVML reported since the
last one. XID events are collected at every gpu sample; one arriving sends the health
records at once instead of at the next interval. A counter the GPU does not report is
left out of the record (None), never sent as 0.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, Union

log = logging.getLogger("trainmon.gpu")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_HEALTH_INTERVAL_S = 60.0

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


# Readings a GPU never changes: asked once per GPU (see read's ``known``).
FIXED_READINGS = frozenset({"max_clock_mhz", "slowdown_temperature_c"})


class _Asker:
    """Asks NVML for one reading, remembering in ``known`` what need not be asked again:
    a fixed reading's value, and None for a query the GPU does not support (a fan on a
    passively cooled board). Measured on an H200 in a VM (scripts/gpu_check.py): the max
    clock cost 0.85 ms of CPU and the unsupported fan 0.11 ms per sample, of 6-8 ms in
    all (the energy counter 2.4-3.7 ms, the two PCIe queries 0.55 ms each)."""

    def __init__(self, known: dict[str, Any] | None):
        import pynvml

        self.known = known
        self.nvml = pynvml

    def __call__(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self.known is not None and name in self.known:
            return self.known[name]
        try:
            value = fn(*args)
        except self.nvml.NVMLError as exc:
            if self.known is not None and getattr(exc, "value", None) == self.nvml.NVML_ERROR_NOT_SUPPORTED:
                self.known[name] = None
            return None
        if self.known is not None and name in FIXED_READINGS:
            self.known[name] = value
        return value


def read(handle: Any, index: int, known: dict[str, Any] | None = None) -> NvmlReading:
    """One GPU's readings. ``known``: a dict kept per GPU between calls (the sampler's),
    in which fixed readings and unsupported queries are remembered; None asks every time."""
    import pynvml as n

    clocks_event = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) \
        or n.nvmlDeviceGetCurrentClocksThrottleReasons  # renamed in NVML 12.2
    ask = _Asker(known)
    util = ask("utilization", n.nvmlDeviceGetUtilizationRates, handle)
    memory = ask("memory", n.nvmlDeviceGetMemoryInfo, handle)
    return NvmlReading(
        index=index,
        clock_mhz=ask("clock_mhz", n.nvmlDeviceGetClockInfo, handle, n.NVML_CLOCK_SM),
        max_clock_mhz=ask("max_clock_mhz", n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_SM),
        power_mw=ask("power_mw", n.nvmlDeviceGetPowerUsage, handle),
        power_limit_mw=ask("power_limit_mw", n.nvmlDeviceGetEnforcedPowerLimit, handle),
        temperature_c=ask("temperature_c", n.nvmlDeviceGetTemperature, handle, n.NVML_TEMPERATURE_GPU),
        slowdown_temperature_c=ask("slowdown_temperature_c", n.nvmlDeviceGetTemperatureThreshold,
                                   handle, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        gpu_util_percent=util.gpu if util else None,
        memory_util_percent=util.memory if util else None,
        memory_free_bytes=memory.free if memory else None,
        # Each PCIe query waits ~20 ms on the driver (its sampling window; 0.6 ms of CPU).
        pcie_rx_kb_per_s=ask("pcie_rx_kb_per_s", n.nvmlDeviceGetPcieThroughput, handle,
                             n.NVML_PCIE_UTIL_RX_BYTES),
        pcie_tx_kb_per_s=ask("pcie_tx_kb_per_s", n.nvmlDeviceGetPcieThroughput, handle,
                             n.NVML_PCIE_UTIL_TX_BYTES),
        fan_percent=ask("fan_percent", n.nvmlDeviceGetFanSpeed, handle),
        clocks_event_reasons=ask("clocks_event_reasons", clocks_event, handle),
        energy_mj=ask("energy_mj", n.nvmlDeviceGetTotalEnergyConsumption, handle),
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


# -- GPU health: NVML's return values -> gpu_health fields -----------------------------
#
# Each function takes the NVML function(s) it needs already bound to a device handle, so
# it can be tested with fakes of their return values and exceptions. Any NVMLError (not
# supported, no permission, GPU lost) leaves its field None: absent, not zero. So does a
# function the installed nvidia-ml-py lacks (passed as None).

# NVML's enum values (nvml.h), so these functions need no pynvml to be read or tested.
MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED = 0, 1   # nvmlMemoryErrorType_t
VOLATILE_ECC, AGGREGATE_ECC = 0, 1                        # nvmlEccCounterType_t
PAGE_RETIREMENT_MULTIPLE_SINGLE_BIT, PAGE_RETIREMENT_DOUBLE_BIT = 0, 1  # nvmlPageRetirementCause_t
NVLINK_ERROR_DL_REPLAY, NVLINK_ERROR_DL_RECOVERY = 0, 1   # nvmlNvLinkErrorCounter_t
NVLINK_ERROR_DL_CRC_FLIT, NVLINK_ERROR_DL_CRC_DATA = 2, 3
NVLINK_MAX_LINKS = 18  # when pynvml does not say (NVML_NVLINK_MAX_LINKS: 18, 36 since NVML 12.8)
EVENT_TYPE_XID_CRITICAL_ERROR = 0x8                       # nvmlEventTypeXidCriticalError
XID_WAIT_MS = 10     # nvmlEventSetWait_v2's timeout: how long one drain waits for a first event
XID_MAX_PER_DRAIN = 1000

_NVLINK_COUNTERS = {"nvlink_crc_flit_errors": NVLINK_ERROR_DL_CRC_FLIT,
                    "nvlink_crc_data_errors": NVLINK_ERROR_DL_CRC_DATA,
                    "nvlink_replay_errors": NVLINK_ERROR_DL_REPLAY,
                    "nvlink_recovery_errors": NVLINK_ERROR_DL_RECOVERY}


@functools.lru_cache(maxsize=1)
def _nvml_errors() -> tuple[type[BaseException], ...]:
    try:
        import pynvml
    except ImportError:
        return ()
    return (pynvml.NVMLError,)


def nvml_value(fn: Callable[..., Any] | None, *args: Any) -> Any:
    """``fn(*args)``, or None when NVML refuses it or ``fn`` is None."""
    if fn is None:
        return None
    try:
        return fn(*args)
    except _nvml_errors():
        return None


def ecc_counts(get_total_ecc_errors: Callable[[int, int], int] | None) -> dict[str, int | None]:
    """``get_total_ecc_errors(error_type, counter_type)``: nvmlDeviceGetTotalEccErrors
    bound to a handle (NotSupported when ECC is off)."""
    return {f"ecc_{counter}_{error}": nvml_value(get_total_ecc_errors, error_type, counter_type)
            for counter, counter_type in (("volatile", VOLATILE_ECC), ("aggregate", AGGREGATE_ECC))
            for error, error_type in (("corrected", MEMORY_ERROR_CORRECTED),
                                      ("uncorrected", MEMORY_ERROR_UNCORRECTED))}


def remapped_rows(get_remapped_rows: Callable[[], tuple] | None) -> dict[str, Any]:
    """``get_remapped_rows()``: nvmlDeviceGetRemappedRows bound to a handle, which returns
    (correctable rows, uncorrectable rows, remapping pending, remapping failed)."""
    value = nvml_value(get_remapped_rows)
    if value is None:
        return dict.fromkeys(("remapped_rows_correctable", "remapped_rows_uncorrectable",
                              "remapped_rows_pending", "remapped_rows_failed"))
    correctable, uncorrectable, pending, failed = value
    return {"remapped_rows_correctable": int(correctable),
            "remapped_rows_uncorrectable": int(uncorrectable),
            "remapped_rows_pending": bool(pending), "remapped_rows_failed": bool(failed)}


def retired_pages(get_retired_pages: Callable[[int], list] | None,
                  get_pending_status: Callable[[], int] | None) -> dict[str, Any]:
    """``get_retired_pages(cause)``: nvmlDeviceGetRetiredPages bound to a handle (the
    retired pages' addresses); ``get_pending_status()``:
    nvmlDeviceGetRetiredPagesPendingStatus. Before Ampere only: later GPUs remap rows."""
    single = nvml_value(get_retired_pages, PAGE_RETIREMENT_MULTIPLE_SINGLE_BIT)
    double = nvml_value(get_retired_pages, PAGE_RETIREMENT_DOUBLE_BIT)
    pending = nvml_value(get_pending_status)
    return {"retired_pages_single_bit": None if single is None else len(single),
            "retired_pages_double_bit": None if double is None else len(double),
            "retired_pages_pending": None if pending is None else bool(pending)}


def nvlink_errors(get_link_state: Callable[[int], int] | None,
                  get_error_counter: Callable[[int, int], int] | None,
                  max_links: int = NVLINK_MAX_LINKS) -> dict[str, int | None]:
    """Each NVLink data-link error counter summed over the active links.
    ``get_link_state(link)``: nvmlDeviceGetNvLinkState (refused for a link the GPU does not
    have); ``get_error_counter(link, counter)``: nvmlDeviceGetNvLinkErrorCounter. A
    counter no active link reports (or a GPU without NVLink) is None."""
    active = [link for link in range(max_links) if nvml_value(get_link_state, link)]
    out: dict[str, int | None] = {}
    for field, counter in _NVLINK_COUNTERS.items():
        values = [v for link in active
                  if (v := nvml_value(get_error_counter, link, counter)) is not None]
        out[field] = sum(values) if values else None
    return out


def collect_xids(wait: Callable[[int], Any], index_of: Callable[[Any], int | None],
                 timeout_ms: int = XID_WAIT_MS, limit: int = XID_MAX_PER_DRAIN) -> dict[int, list[int]]:
    """Drain an NVML event set: NVML index -> critical XID codes, in arrival order.

    ``wait(timeout_ms)``: nvmlEventSetWait_v2 bound to the set; it returns an event
    (``device``, ``eventType``, ``eventData``: the XID code) and raises NVMLError_Timeout
    when none came within the timeout, which ends the drain (as does any other NVMLError:
    the next drain tries again). ``index_of(device)``: the NVML index of the event's
    device handle, None for a device not sampled here."""
    seen: dict[int, list[int]] = {}
    for _ in range(limit):
        try:
            event = wait(timeout_ms)
        except _nvml_errors():
            break
        if not event.eventType & EVENT_TYPE_XID_CRITICAL_ERROR:
            continue
        index = index_of(event.device)
        if index is not None:
            seen.setdefault(index, []).append(int(event.eventData))
    return seen


def _bound(name: str, *args: Any) -> Callable[..., Any] | None:
    import pynvml

    fn = getattr(pynvml, name, None)
    return None if fn is None else functools.partial(fn, *args)


def read_health(handle: Any, index: int) -> dict[str, Any]:
    """gpu_health fields (without step and xids) of one GPU; None where unsupported."""
    import pynvml as n

    fields: dict[str, Any] = {"id": index}
    fields.update(ecc_counts(_bound("nvmlDeviceGetTotalEccErrors", handle)))
    fields.update(remapped_rows(_bound("nvmlDeviceGetRemappedRows", handle)))
    fields.update(retired_pages(_bound("nvmlDeviceGetRetiredPages", handle),
                                _bound("nvmlDeviceGetRetiredPagesPendingStatus", handle)))
    fields["pcie_replays"] = nvml_value(_bound("nvmlDeviceGetPcieReplayCounter", handle))
    fields.update(nvlink_errors(_bound("nvmlDeviceGetNvLinkState", handle),
                                _bound("nvmlDeviceGetNvLinkErrorCounter", handle),
                                getattr(n, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS)))
    return fields


def _address(pointer: Any) -> int | None:
    """A ctypes pointer's address: event data's ``device`` and the handle registered are
    different Python objects for the same device."""
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class XidEvents:
    """An NVML event set registered for critical XID errors on the sampled GPUs.
    ``supported``: the NVML indices whose events could be registered (not on every GPU,
    nor in every container); the others' records carry no xids."""

    def __init__(self, handles: list[tuple[Any, int]]):
        import pynvml as n

        self.supported: set[int] = set()
        self._by_address: dict[int | None, int] = {}
        self._set = n.nvmlEventSetCreate()
        for handle, index in handles:
            try:
                n.nvmlDeviceRegisterEvents(handle, n.nvmlEventTypeXidCriticalError, self._set)
            except n.NVMLError:
                continue
            self.supported.add(index)
            self._by_address[_address(handle)] = index

    def drain(self) -> dict[int, list[int]]:
        import pynvml as n

        if not self.supported:  # nothing registered: no 10 ms wait for nothing
            return {}
        return collect_xids(lambda ms: n.nvmlEventSetWait_v2(self._set, ms),
                            lambda device: self._by_address.get(_address(device)))

    def close(self) -> None:
        import pynvml as n

        nvml_value(n.nvmlEventSetFree, self._set)


# -- the sampler -----------------------------------------------------------------------

Devices = Union[Sequence[Union[int, str]], Literal["all"], None]


class GpuSampler:
    """Background thread sending ``log_gpu_state`` for each GPU every ``interval_s``, and
    ``log_gpu_health`` every ``health_interval_s`` (or at the next gpu sample after a
    critical XID).

    ``devices``: NVML indices or UUIDs, "all", or None for this process's own GPU.
    ``reader``: where readings come from; None reads NVML. Passing one skips NVML
    entirely (for replaying recorded readings); health records then come from
    ``health_reader`` (gpu_health fields per GPU, without step and xids) and XIDs from
    ``xid_events`` (``supported``: NVML indices, ``drain()``: index -> XID codes), when given."""

    def __init__(self, producer: Any, interval_s: float | None = None, devices: Devices = None,
                 *, reader: Callable[[], list[NvmlReading]] | None = None,
                 health_interval_s: float | None = None,
                 health_reader: Callable[[], list[dict[str, Any]]] | None = None,
                 xid_events: Any = None, env: dict | None = None):
        env = os.environ if env is None else env
        if interval_s is None:
            interval_s = float(env.get("TRAINMON_GPU_INTERVAL_S") or DEFAULT_INTERVAL_S)
        if health_interval_s is None:
            health_interval_s = float(env.get("TRAINMON_GPU_HEALTH_INTERVAL_S")
                                      or DEFAULT_HEALTH_INTERVAL_S)
        self.producer = producer
        self.interval_s = interval_s
        self.health_interval_s = health_interval_s
        self.step = 0
        self.samples = 0
        self.health_samples = 0
        self.enabled = False
        self._health_reader = health_reader
        self._xid_events = xid_events
        self._xids: dict[int, list[int]] = {}  # collected, not yet sent
        self._next_health = 0.0  # monotonic time of the next health sample (the first at once)
        self._health_failed = False
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
            known: dict[int, dict[str, Any]] = {index: {} for _, index in handles}
            self._reader = lambda: [read(handle, index, known[index]) for handle, index in handles]
            if self.health_interval_s > 0:
                self._health_reader = lambda: [read_health(handle, index) for handle, index in handles]
                try:
                    self._xid_events = XidEvents(handles)
                except Exception as exc:  # NVMLError: events not supported here
                    log.info("trainmon: GPU XID events off: %s", exc)
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

    def sample_health(self) -> int:
        """Collect XIDs, read every GPU's health once and send the records; returns how
        many were sent."""
        self._drain_xids()
        return self._send_health()

    def _drain_xids(self) -> None:
        if self._xid_events is not None:
            for index, codes in self._xid_events.drain().items():
                self._xids.setdefault(index, []).extend(codes)

    def _send_health(self) -> int:
        assert self._health_reader is not None
        self._next_health = time.monotonic() + self.health_interval_s
        supported = self._xid_events.supported if self._xid_events is not None else ()
        sent = 0
        for fields in self._health_reader():
            fields = {k: v for k, v in fields.items() if v is not None}
            if fields.get("id") in supported:
                fields["xids"] = self._xids.pop(fields["id"], [])
            sent += bool(self.producer.log_gpu_health(self.step, **fields))
        self._xids.clear()  # of a GPU not read this time: dropped, not resent forever
        self.health_samples += 1
        return sent

    def _health_tick(self) -> None:
        if self._health_reader is None or self.health_interval_s <= 0:
            return
        try:
            self._drain_xids()
            if time.monotonic() >= self._next_health or any(self._xids.values()):
                self._send_health()
        except Exception as exc:
            if not self._health_failed:
                log.warning("trainmon: GPU health sampling failed (further failures are "
                            "silent): %s", exc)
                self._health_failed = True

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as exc:  # a GPU fallen off the bus must not end the training
                if not self._failed:
                    log.warning("trainmon: GPU sampling failed (further failures are silent): %s", exc)
                    self._failed = True
            self._health_tick()
            if self._stop.wait(self.interval_s):
                return

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._xid_events is not None and self._nvml_open:
            self._xid_events.close()
            self._xid_events = None
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
