"""A fake `pynvml`: the NVML calls Hangar makes, over a list of fake devices.

Only the hardware is faked: the provider under test is the real one.
"""

from types import SimpleNamespace

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's names)
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    pass


class NVMLError_Timeout(NVMLError):  # noqa: N801
    pass


def device(name="NVIDIA H100 80GB HBM3", uuid="GPU-aaaa", total_mb=81559, used_mb=1024.0, **extra) -> dict:
    return {
        "name": name,
        "uuid": uuid,
        "total": total_mb * MIB,
        "used": used_mb * MIB,
        "util": 50,
        "temp": 40,
        "power_mw": 100000,
        "sm_clock": 1980,
        "reasons": 0,
        "ecc_volatile": 0,
        "ecc_aggregate": 0,
        "retired_pending": 0,
        "remapped": (0, 0, 0, 0),
        "lost": False,
        "unsupported": set(),
        **extra,
    }


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Timeout = NVMLError_Timeout
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_FEATURE_ENABLED = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, devices: list[dict], events: bool = True):
        self.devices = devices
        self.events_supported = events
        self.pending_events: list[SimpleNamespace] = []
        self.registered: list[int] = []

    def _device(self, handle, call: str) -> dict:
        dev = self.devices[handle]
        if dev["lost"]:
            raise NVMLError_GpuIsLost("GPU is lost")
        if call in dev["unsupported"]:
            raise NVMLError_NotSupported("Not Supported")
        return dev

    def xid(self, index: int, xid: int) -> None:
        self.pending_events.append(SimpleNamespace(device=index, eventData=xid, eventType=8))

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return self.devices[handle]["name"]

    def nvmlDeviceGetUUID(self, handle):
        return self.devices[handle]["uuid"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        dev = self._device(handle, "memory")
        return SimpleNamespace(total=dev["total"], used=dev["used"], free=dev["total"] - dev["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self._device(handle, "util")["util"], memory=40)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._device(handle, "temp")["temp"]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._device(handle, "power")["power_mw"]

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == self.NVML_CLOCK_SM
        return self._device(handle, "clock")["sm_clock"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._device(handle, "reasons")["reasons"]

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter):
        assert error_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        dev = self._device(handle, "ecc")
        return dev["ecc_volatile"] if counter == self.NVML_VOLATILE_ECC else dev["ecc_aggregate"]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        return self._device(handle, "retired")["retired_pending"]

    def nvmlDeviceGetRemappedRows(self, handle):
        return self._device(handle, "remapped")["remapped"]

    def nvmlEventSetCreate(self):
        if not self.events_supported:
            raise NVMLError_NotSupported("Not Supported")
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle, types, event_set):
        assert event_set == "event-set" and types == self.nvmlEventTypeXidCriticalError
        self.registered.append(handle)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0, "the agent must never block on NVML events"
        if not self.pending_events:
            raise NVMLError_Timeout("Timeout")
        return self.pending_events.pop(0)
