"""The NVML provider against a fake pynvml: throttle reasons, ECC, retired/remapped pages, Xid events, lost GPUs."""

import pytest

from fleet.gpus import NvmlProvider
from tests.fakenvml import FakeNvml, device


def test_it_reads_clock_and_throttle_reasons():
    nvml = FakeNvml([device(sm_clock=1410, reasons=0x20 | 0x40), device(reasons=0x4), device()])

    thermal, power, calm = NvmlProvider(nvml).sample(set())

    assert thermal.sm_clock_mhz == 1410
    assert thermal.throttle_reasons == ("sw_thermal", "hw_thermal")
    assert thermal.thermal_throttled and not thermal.power_throttled
    assert power.throttle_reasons == ("sw_power_cap",)
    assert power.power_throttled and not power.thermal_throttled
    assert calm.throttle_reasons == () and not (calm.thermal_throttled or calm.power_throttled)


def test_it_reads_ecc_counts_and_pending_pages():
    nvml = FakeNvml(
        [
            device(ecc_volatile=2, ecc_aggregate=7, retired_pending=1),
            device(remapped=(3, 1, 1, 0)),
            device(),
        ]
    )

    ecc, remapped, clean = NvmlProvider(nvml).sample(set())

    assert (ecc.ecc_uncorrected_volatile, ecc.ecc_uncorrected_aggregate, ecc.retired_pages_pending) == (2, 7, True)
    assert remapped.remapped_rows_pending and not remapped.retired_pages_pending
    assert clean.ecc_uncorrected_volatile == 0
    assert not (clean.retired_pages_pending or clean.remapped_rows_pending)


def test_queries_a_gpu_does_not_support_read_as_absent():
    nvml = FakeNvml([device(unsupported={"ecc", "retired", "remapped", "clock", "reasons"})])

    (sample,) = NvmlProvider(nvml).sample(set())

    assert sample.sm_clock_mhz is None
    assert sample.throttle_reasons == ()
    assert sample.ecc_uncorrected_volatile == 0
    assert not sample.retired_pages_pending and not sample.remapped_rows_pending
    assert sample.temperature_c == 40.0


def test_xid_events_are_collected_per_gpu_without_blocking():
    nvml = FakeNvml([device(), device()])
    provider = NvmlProvider(nvml)
    assert nvml.registered == [0, 1]
    nvml.xid(1, 79)
    nvml.xid(1, 48)
    nvml.xid(0, 13)

    first, second = provider.sample(set())
    again = provider.sample(set())

    assert first.xids == (13,)
    assert second.xids == (79, 48)
    assert all(s.xids == () for s in again)


def test_without_event_support_it_still_samples():
    nvml = FakeNvml([device()], events=False)

    (sample,) = NvmlProvider(nvml).sample(set())

    assert sample.xids == () and sample.utilization_pct == 50.0


def test_preflight_sampling_leaves_xid_events_for_the_monitor():
    nvml = FakeNvml([device()])
    provider = NvmlProvider(nvml)
    nvml.xid(0, 94)

    assert provider.sample(set(), events=False)[0].xids == ()
    assert provider.sample(set())[0].xids == (94,)


def test_a_gpu_fallen_off_the_bus_is_reported_lost():
    nvml = FakeNvml([device(), device(lost=True)])

    ok, lost = NvmlProvider(nvml).sample(set())

    assert not ok.lost
    assert lost.lost and lost.utilization_pct is None and lost.temperature_c is None


@pytest.mark.parametrize("old_api", [True, False])
def test_it_uses_the_throttle_reasons_call_of_older_bindings(old_api):
    nvml = FakeNvml([device(reasons=0x80)])
    if old_api:
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons = nvml.nvmlDeviceGetCurrentClocksEventReasons
        nvml.nvmlDeviceGetCurrentClocksEventReasons = None

    (sample,) = NvmlProvider(nvml).sample(set())

    assert sample.throttle_reasons == ("hw_power_brake",)
