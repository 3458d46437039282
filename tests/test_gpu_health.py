"""GPU health from NVML: the conversions of NVML's return values into gpu_health fields,
checked by hand against fakes of the NVML functions (this machine has no GPU); a field
NVML refuses is absent (None), never 0; XID events drained from a fake event set; the
sampler sending health records at its interval and at once after an XID."""

from __future__ import annotations

import ctypes
import json
from types import SimpleNamespace

import pynvml
import pytest

from tests.conftest import read_records
from trainmon.integrations import nvml
from trainmon.integrations.nvml import (GpuSampler, NvmlReading, XidEvents, collect_xids, ecc_counts,
                                        nvlink_errors, nvml_value, read_health, remapped_rows,
                                        retired_pages)
from trainmon.schemas import GpuHealthRecord, encode

from .waiting import wait_until

ENVELOPE = dict(run_id="r", rank=0, world_size=1, host="h", time="2025-01-01T00:00:00Z", event_id="e")


def refuse(code=pynvml.NVML_ERROR_NOT_SUPPORTED):
    """A fake NVML function that fails as NVML does (NVMLError_NotSupported, ...)."""
    def fn(*args):
        raise pynvml.NVMLError(code)
    return fn


# -- ECC ----------------------------------------------------------------------------------

def test_ecc_counts_by_error_and_counter_type():
    # nvmlDeviceGetTotalEccErrors(handle, errorType, counterType): errorType 0 corrected,
    # 1 uncorrected; counterType 0 volatile, 1 aggregate.
    counts = {(0, 0): 3, (1, 0): 0, (0, 1): 17, (1, 1): 1}
    assert ecc_counts(lambda error, counter: counts[(error, counter)]) == {
        "ecc_volatile_corrected": 3, "ecc_volatile_uncorrected": 0,
        "ecc_aggregate_corrected": 17, "ecc_aggregate_uncorrected": 1}


def test_ecc_off_or_refused_is_absent_not_zero():
    assert ecc_counts(refuse()) == dict.fromkeys(
        ("ecc_volatile_corrected", "ecc_volatile_uncorrected", "ecc_aggregate_corrected",
         "ecc_aggregate_uncorrected"))

    def volatile_only(error, counter):  # e.g. an infoROM that keeps no aggregate counts
        if counter == pynvml.NVML_AGGREGATE_ECC:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 5 if error == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    fields = ecc_counts(volatile_only)
    assert fields["ecc_volatile_corrected"] == 5 and fields["ecc_volatile_uncorrected"] == 0
    assert fields["ecc_aggregate_corrected"] is None and fields["ecc_aggregate_uncorrected"] is None
    assert ecc_counts(None)["ecc_volatile_corrected"] is None  # a binding without the function


def test_the_enum_values_are_nvmls():
    assert (nvml.MEMORY_ERROR_CORRECTED, nvml.MEMORY_ERROR_UNCORRECTED) == \
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
    assert (nvml.VOLATILE_ECC, nvml.AGGREGATE_ECC) == (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)
    assert (nvml.PAGE_RETIREMENT_MULTIPLE_SINGLE_BIT, nvml.PAGE_RETIREMENT_DOUBLE_BIT) == \
        (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
         pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    assert (nvml.NVLINK_ERROR_DL_REPLAY, nvml.NVLINK_ERROR_DL_RECOVERY, nvml.NVLINK_ERROR_DL_CRC_FLIT,
            nvml.NVLINK_ERROR_DL_CRC_DATA) == (pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
                                               pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
                                               pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                                               pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA)
    assert nvml.EVENT_TYPE_XID_CRITICAL_ERROR == pynvml.nvmlEventTypeXidCriticalError


# -- remapped rows, retired pages ----------------------------------------------------------

def test_remapped_rows_from_nvmls_tuple():
    # (correctable rows, uncorrectable rows, isPending, failureOccurred)
    assert remapped_rows(lambda: (2, 1, 1, 0)) == {
        "remapped_rows_correctable": 2, "remapped_rows_uncorrectable": 1,
        "remapped_rows_pending": True, "remapped_rows_failed": False}
    assert remapped_rows(lambda: (0, 0, 0, 0)) == {
        "remapped_rows_correctable": 0, "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False, "remapped_rows_failed": False}
    # Before Ampere: no row remapper.
    assert set(remapped_rows(refuse()).values()) == {None}


def test_retired_pages_are_counted_per_cause():
    pages = {pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x1000, 0x2000, 0x9000],
             pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x4000]}
    assert retired_pages(lambda cause: pages[cause], lambda: 1) == {
        "retired_pages_single_bit": 3, "retired_pages_double_bit": 1, "retired_pages_pending": True}
    assert retired_pages(lambda cause: [], lambda: 0) == {
        "retired_pages_single_bit": 0, "retired_pages_double_bit": 0, "retired_pages_pending": False}
    # Ampere and later retire no pages (they remap rows): absent.
    assert set(retired_pages(refuse(), refuse()).values()) == {None}


# -- NVLink ----------------------------------------------------------------------------------

def test_nvlink_counters_are_summed_over_the_active_links():
    # Links 0-3 exist, link 2 is down; asking for link 4 and beyond is refused.
    state = {0: 1, 1: 1, 2: 0, 3: 1}
    counters = {  # (link, counter) -> value; link 1 does not report CRC data errors
        (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 5, (1, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 7,
        (2, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 1000, (3, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 0,
        (0, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA): 2, (3, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA): 1,
        (0, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 0, (1, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 0,
        (3, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 4,
    }

    def link_state(link):
        if link not in state:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return state[link]

    def counter(link, which):
        if (link, which) not in counters:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return counters[(link, which)]

    assert nvlink_errors(link_state, counter, max_links=18) == {
        "nvlink_crc_flit_errors": 5 + 7 + 0,   # the inactive link 2's 1000 is not counted
        "nvlink_crc_data_errors": 2 + 1,       # link 1 reports none: left out of the sum
        "nvlink_replay_errors": 0 + 0 + 4,
        "nvlink_recovery_errors": None,        # no active link reports it
    }


def test_a_gpu_without_nvlink_has_no_nvlink_fields():
    fields = nvlink_errors(refuse(), lambda link, which: 0, max_links=18)
    assert set(fields.values()) == {None}
    # Links present but all down: nothing counted either.
    assert set(nvlink_errors(lambda link: 0, lambda link, which: 3).values()) == {None}


def test_pcie_replays_and_any_nvml_error_leave_the_field_absent():
    assert nvml_value(lambda: 12) == 12
    assert nvml_value(lambda: 0) == 0
    for code in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION,
                 pynvml.NVML_ERROR_GPU_IS_LOST):
        assert nvml_value(refuse(code)) is None
    with pytest.raises(ZeroDivisionError):  # not NVML's: a bug, not an unsupported counter
        nvml_value(lambda: 1 // 0)


# -- read_health: the NVML calls, with pynvml's functions faked ---------------------------

def test_read_health_calls_nvml_and_leaves_out_what_the_gpu_refuses(monkeypatch):
    """An H100 PCIe: ECC on, rows remapped, no page retirement, no NVLink."""
    handle = object()
    calls = []

    def ecc(h, error, counter):
        assert h is handle
        calls.append(("ecc", error, counter))
        return {(0, 0): 4, (1, 0): 0, (0, 1): 40, (1, 1): 2}[(error, counter)]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTotalEccErrors", ecc)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRemappedRows", lambda h: (1, 0, 0, 0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRetiredPages", refuse())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetRetiredPagesPendingStatus", refuse())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPcieReplayCounter", lambda h: 9)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkState", refuse())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetNvLinkErrorCounter", refuse())
    fields = read_health(handle, 3)
    assert len(calls) == 4
    assert {k: v for k, v in fields.items() if v is not None} == {
        "id": 3, "ecc_volatile_corrected": 4, "ecc_volatile_uncorrected": 0,
        "ecc_aggregate_corrected": 40, "ecc_aggregate_uncorrected": 2,
        "remapped_rows_correctable": 1, "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False, "remapped_rows_failed": False, "pcie_replays": 9}
    assert fields["retired_pages_single_bit"] is None and fields["nvlink_crc_flit_errors"] is None


def test_a_gpu_that_refuses_everything_sends_a_record_with_only_its_id(monkeypatch):
    for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages",
                 "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetPcieReplayCounter",
                 "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter"):
        monkeypatch.setattr(pynvml, name, refuse())
    monkeypatch.delattr(pynvml, "nvmlDeviceGetRemappedRows")  # an old nvidia-ml-py
    fields = read_health(object(), 0)
    assert {k: v for k, v in fields.items() if v is not None} == {"id": 0}
    record = GpuHealthRecord(**ENVELOPE, step=1, **{k: v for k, v in fields.items() if v is not None})
    wire = json.loads(encode(record))
    # Absent, not zero: none of the counters is on the wire.
    assert not any(k.startswith(("ecc_", "remapped", "retired", "nvlink", "pcie", "xid")) for k in wire)


# -- XIDs ----------------------------------------------------------------------------------

class FakeEventSet:
    """nvmlEventSetWait_v2 over queued events: NVMLError_Timeout when none is waiting."""

    def __init__(self, events):
        self.events = list(events)
        self.timeouts: list[int] = []

    def wait(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)


def event(device, code, kind=pynvml.nvmlEventTypeXidCriticalError):
    return SimpleNamespace(device=device, eventType=kind, eventData=code, gpuInstanceId=0,
                           computeInstanceId=0)


def test_xids_are_drained_per_gpu_in_arrival_order():
    gpus = {"h0": 0, "h5": 5}
    events = FakeEventSet([event("h5", 79), event("h0", 13),
                           event("h0", 0, kind=pynvml.nvmlEventTypeSingleBitEccError),  # not an XID
                           event("h0", 48), event("other", 31)])  # a GPU this sampler does not own
    assert collect_xids(events.wait, gpus.get) == {5: [79], 0: [13, 48]}
    assert events.timeouts == [nvml.XID_WAIT_MS] * 6  # five events, then the timeout
    assert collect_xids(events.wait, gpus.get) == {}  # drained


def test_an_xid_drain_is_bounded_and_stops_on_any_nvml_error():
    flood = FakeEventSet([event("h0", 31)] * 50)
    assert collect_xids(flood.wait, {"h0": 0}.get, limit=10) == {0: [31] * 10}
    lost = SimpleNamespace(wait=refuse(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert collect_xids(lost.wait, {"h0": 0}.get) == {}


def test_xid_events_register_each_gpu_and_map_event_devices_by_address(monkeypatch):
    """XidEvents against pynvml's own handle type: the event's ``device`` is another
    ctypes object pointing at the same device."""
    structs = [pynvml.struct_c_nvmlDevice_t() for _ in range(3)]
    handles = [ctypes.pointer(s) for s in structs]
    registered = []

    def register(handle, types, event_set):
        if handle is handles[2]:  # e.g. a MIG instance, or a container without the rights
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        registered.append((handle, types, event_set))

    fake = FakeEventSet([event(ctypes.cast(handles[1], pynvml.c_nvmlDevice_t), 79),
                         event(ctypes.cast(handles[0], pynvml.c_nvmlDevice_t), 94)])
    freed = []
    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", lambda: "the-set")
    monkeypatch.setattr(pynvml, "nvmlDeviceRegisterEvents", register)
    monkeypatch.setattr(pynvml, "nvmlEventSetWait_v2", lambda s, ms: fake.wait(ms))
    monkeypatch.setattr(pynvml, "nvmlEventSetFree", freed.append)
    events = XidEvents([(handles[0], 0), (handles[1], 1), (handles[2], 2)])
    assert events.supported == {0, 1}
    assert [(t, s) for _, t, s in registered] == [(pynvml.nvmlEventTypeXidCriticalError, "the-set")] * 2
    assert events.drain() == {1: [79], 0: [94]}
    events.close()
    assert freed == ["the-set"]


# -- the sampler -----------------------------------------------------------------------------

class Recorder:
    """A producer that validates and keeps what it is given."""

    def __init__(self):
        self.health: list[GpuHealthRecord] = []
        self.gpu = 0

    def log_gpu_state(self, step, **fields):
        self.gpu += 1
        return True

    def log_gpu_health(self, step, **fields):
        self.health.append(GpuHealthRecord(**ENVELOPE, step=step, **fields))
        return True


class Xids:
    def __init__(self, supported):
        self.supported = set(supported)
        self.pending: dict[int, list[int]] = {}

    def drain(self):
        pending, self.pending = self.pending, {}
        return pending


HEALTH = [{"id": 0, "ecc_volatile_uncorrected": 0, "pcie_replays": 1, "nvlink_crc_flit_errors": None},
          {"id": 1, "ecc_volatile_uncorrected": 2, "pcie_replays": None}]
READING = NvmlReading(index=0, clock_mhz=1980)


def test_health_at_its_interval_and_at_once_after_an_xid():
    producer, xids = Recorder(), Xids(supported={0})  # GPU 1's events could not be registered
    sampler = GpuSampler(producer, interval_s=5, health_interval_s=3600, reader=lambda: [READING],
                         health_reader=lambda: [dict(h) for h in HEALTH], xid_events=xids)
    sampler.set_step(10)
    sampler._health_tick()  # the first tick sends at once: a baseline
    first = producer.health
    assert [(r.id, r.step, r.xids, r.xid_count) for r in first] == [(0, 10, [], 0), (1, 10, None, None)]
    assert first[0].nvlink_crc_flit_errors is None and first[1].pcie_replays is None
    sampler._health_tick()  # within the interval, nothing new: nothing sent
    assert len(producer.health) == 2
    xids.pending = {0: [79, 79]}  # GPU 0 fell off the bus
    sampler.set_step(11)
    sampler._health_tick()
    assert [(r.id, r.step, r.xids, r.xid_count) for r in producer.health[2:]] == \
        [(0, 11, [79, 79], 2), (1, 11, None, None)]
    sampler._health_tick()
    assert len(producer.health) == 4 and sampler.health_samples == 2


def test_health_interval_from_the_environment_and_zero_turns_it_off():
    producer = Recorder()
    sampler = GpuSampler(producer, reader=lambda: [READING], health_reader=lambda: HEALTH,
                         env={"TRAINMON_GPU_HEALTH_INTERVAL_S": "0"})
    assert sampler.health_interval_s == 0
    sampler._health_tick()
    assert producer.health == []
    assert GpuSampler(producer, env={}).health_interval_s == nvml.DEFAULT_HEALTH_INTERVAL_S == 60
    assert GpuSampler(producer, env={"TRAINMON_GPU_HEALTH_INTERVAL_S": "15"}).health_interval_s == 15


def test_a_failing_health_read_is_said_once_and_gpu_sampling_goes_on(caplog):
    producer = Recorder()

    def broken():
        raise RuntimeError("NVML went away")

    sampler = GpuSampler(producer, interval_s=0.01, health_interval_s=0.01,
                         reader=lambda: [READING], health_reader=broken).start()
    wait_until(lambda: producer.gpu >= 5, 10, "five GPU samples")
    sampler.stop()
    said = [r for r in caplog.records if "GPU health sampling failed" in r.getMessage()]
    assert len(said) == 1 and "NVML went away" in said[0].getMessage()


def test_the_sampler_thread_sends_health_records_through_the_broker(make_producer, bootstrap,
                                                                     topic_prefix):
    producer = make_producer(strict=True)
    xids = Xids(supported={0, 1})
    xids.pending = {1: [48]}  # a double-bit ECC error XID before the first sample
    sampler = GpuSampler(producer, interval_s=0.02, health_interval_s=3600, reader=lambda: [READING],
                         health_reader=lambda: [dict(h) for h in HEALTH], xid_events=xids)
    sampler.set_step(42)
    sampler.start()
    wait_until(lambda: sampler.health_samples >= 1 and sampler.samples >= 3, 10,
               "a health sample and three others")
    sampler.stop()
    assert producer.flush(30)
    records = read_records(bootstrap, topic_prefix, "gpu_health", 2)
    assert [(r.id, r.step, r.xids, r.ecc_volatile_uncorrected, r.pcie_replays) for r in records] == \
        [(0, 42, [], 0, 1), (1, 42, [48], 2, None)]
    assert sampler.health_samples == 1  # one per hour after the first, no XID since
