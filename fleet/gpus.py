"""GPU providers: NVML on a machine with NVIDIA GPUs, a simulator everywhere else.

Both answer the same two questions: what GPUs are here (inventory) and how
are they doing now (sample). The agent does not care which one it has.
"""

import hashlib
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("hangar.fleet")

# Memory (MiB), idle and max power (W), max SM clock (MHz) of the models the simulator knows.
SIMULATED_MODELS = {
    "H100": (81559, 70, 700, 1980),
    "H200": (143771, 75, 700, 1980),
    "B300": (274877, 120, 1100, 2100),
    "A100": (81920, 55, 400, 1410),
    "L40S": (46068, 35, 350, 2520),
}

# NVML clocks-event (throttle) reason bits and the names Hangar shows.
THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}
THERMAL_REASONS = frozenset({"sw_thermal", "hw_thermal", "hw_slowdown"})
POWER_REASONS = frozenset({"sw_power_cap", "hw_power_brake"})


def throttle_names(bits: int) -> tuple[str, ...]:
    return tuple(name for bit, name in THROTTLE_BITS.items() if bits & bit)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    model: str
    memory_total_mb: int


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization_pct: float | None
    memory_used_mb: float | None
    temperature_c: float | None
    power_w: float | None
    sm_clock_mhz: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    ecc_uncorrected_volatile: int = 0
    ecc_uncorrected_aggregate: int = 0
    retired_pages_pending: bool = False
    remapped_rows_pending: bool = False
    xids: tuple[int, ...] = ()
    lost: bool = False  # fell off the bus: the driver no longer answers for it

    @property
    def thermal_throttled(self) -> bool:
        return bool(THERMAL_REASONS.intersection(self.throttle_reasons))

    @property
    def power_throttled(self) -> bool:
        return bool(POWER_REASONS.intersection(self.throttle_reasons))


class GpuProvider(Protocol):
    simulated: bool

    def inventory(self) -> list[GpuInfo]: ...

    def sample(self, busy: set[int], events: bool = True) -> list[GpuSample]: ...


FAULT_KINDS = ("thermal", "power", "xid", "ecc", "nccl", "gpu_lost", "agent_silent", "clear")


@dataclass
class SimFaults:
    """Faults injected into one simulated GPU."""

    thermal_until: float = 0.0
    power_until: float = 0.0
    ecc_uncorrected: int = 0
    xids: list[int] = field(default_factory=list)
    lost: bool = False


class SimulatedProvider:
    """Plausible GPUs of one model; busy GPUs run hot and loaded; faults can be injected."""

    simulated = True

    def __init__(self, node_name: str, model: str = "H100", count: int = 4):
        if model not in SIMULATED_MODELS:
            known = ", ".join(sorted(SIMULATED_MODELS))
            raise ValueError(f"unknown simulated GPU model {model!r}; use one of {known}")
        self.node_name = node_name
        self.model = model
        self.count = count
        seed = int(hashlib.sha256(node_name.encode()).hexdigest()[:8], 16)
        self._random = random.Random(seed)
        self.faults = {i: SimFaults() for i in range(count)}

    def inventory(self) -> list[GpuInfo]:
        memory = SIMULATED_MODELS[self.model][0]
        return [
            GpuInfo(i, f"GPU-SIM-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.node_name}/{i}')}", self.model, memory)
            for i in range(self.count)
        ]

    def inject(self, kind: str, gpu: int | None = None, xid: int | None = None, seconds: float = 30.0) -> None:
        """Apply a fault to one GPU (or every GPU when `gpu` is None); 'clear' removes all."""
        targets = [gpu] if gpu is not None else list(self.faults)
        for index in targets:
            if index not in self.faults:
                raise ValueError(f"GPU {index} does not exist on {self.node_name}")
            fault = self.faults[index]
            if kind == "clear":
                self.faults[index] = SimFaults()
            elif kind == "thermal":
                fault.thermal_until = time.monotonic() + seconds
            elif kind == "power":
                fault.power_until = time.monotonic() + seconds
            elif kind == "xid":
                fault.xids.append(xid or 79)
            elif kind == "ecc":
                fault.ecc_uncorrected += 1
            elif kind == "gpu_lost":
                fault.lost = True
            else:
                raise ValueError(f"the GPU simulator has no fault {kind!r}")

    def sample(self, busy: set[int], events: bool = True) -> list[GpuSample]:
        return [self._sample_one(i, i in busy, events) for i in range(self.count)]

    def _sample_one(self, i: int, busy: bool, events: bool) -> GpuSample:
        memory, idle_w, max_w, max_clock = SIMULATED_MODELS[self.model]
        fault, now = self.faults[i], time.monotonic()
        xids = tuple(fault.xids)
        if events:
            fault.xids.clear()
        if fault.lost:
            return GpuSample(i, None, None, None, None, xids=xids, lost=True)
        load = self._random.uniform(0.85, 1.0) if busy else self._random.uniform(0.0, 0.02)
        temperature = 32 + 45 * load + self._random.uniform(-1, 1)
        power = idle_w + (max_w - idle_w) * load
        clock = max_clock if busy else 345
        reasons: tuple[str, ...] = ()
        if fault.thermal_until > now:
            temperature, clock, reasons = 92.0, max_clock * 0.6, ("sw_thermal", "hw_thermal")
        if fault.power_until > now:
            power, clock, reasons = float(max_w), max_clock * 0.75, (*reasons, "sw_power_cap")
        return GpuSample(
            index=i,
            utilization_pct=round(load * 100, 1),
            memory_used_mb=round(memory * (0.05 + 0.8 * load)),
            temperature_c=round(temperature, 1),
            power_w=round(power, 1),
            sm_clock_mhz=round(clock),
            throttle_reasons=reasons,
            ecc_uncorrected_volatile=fault.ecc_uncorrected,
            ecc_uncorrected_aggregate=fault.ecc_uncorrected,
            retired_pages_pending=fault.ecc_uncorrected > 0,
            xids=xids,
        )


class NvmlProvider:
    """Real NVIDIA GPUs through nvidia-ml-py (`pynvml`)."""

    simulated = False

    def __init__(self, nvml):
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self.events = self._xid_event_set()

    def _xid_event_set(self):
        """An NVML event set that collects Xid (critical error) events, or None where unsupported."""
        nvml = self.nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.info("NVML Xid events unavailable: %s", exc)
            return None
        for i, handle in enumerate(self.handles):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:
                log.info("GPU %d: Xid events unavailable: %s", i, exc)
        return events

    def inventory(self) -> list[GpuInfo]:
        out = []
        for i, handle in enumerate(self.handles):
            name = self.nvml.nvmlDeviceGetName(handle)
            uuid_ = self.nvml.nvmlDeviceGetUUID(handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            out.append(GpuInfo(i, _text(uuid_), short_model_name(_text(name)), int(memory)))
        return out

    def sample(self, busy: set[int], events: bool = True) -> list[GpuSample]:
        xids = self.drain_xids() if events else {}
        return [self._sample_one(i, handle, tuple(xids.get(i, ()))) for i, handle in enumerate(self.handles)]

    def _sample_one(self, i: int, handle, xids: tuple[int, ...]) -> GpuSample:
        nvml = self.nvml
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            temp = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            power_mw = nvml.nvmlDeviceGetPowerUsage(handle)
        except nvml.NVMLError_GpuIsLost:
            return GpuSample(i, None, None, None, None, xids=xids, lost=True)
        remapped = self._optional(nvml.nvmlDeviceGetRemappedRows, handle)
        return GpuSample(
            index=i,
            utilization_pct=float(util.gpu),
            memory_used_mb=memory.used / (1024 * 1024),
            temperature_c=float(temp),
            power_w=power_mw / 1000,
            sm_clock_mhz=self._optional(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
            throttle_reasons=throttle_names(self._optional(self._clocks_event_reasons(), handle) or 0),
            ecc_uncorrected_volatile=self._ecc(handle, nvml.NVML_VOLATILE_ECC),
            ecc_uncorrected_aggregate=self._ecc(handle, nvml.NVML_AGGREGATE_ECC),
            retired_pages_pending=self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            == nvml.NVML_FEATURE_ENABLED,
            # (corrected rows, uncorrected rows, remapping pending, remapping failed)
            remapped_rows_pending=bool(remapped and (remapped[2] or remapped[3])),
            xids=xids,
        )

    def _clocks_event_reasons(self):
        # Renamed from "throttle reasons" to "clocks event reasons" in newer drivers.
        return getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )

    def _ecc(self, handle, counter) -> int:
        value = self._optional(
            self.nvml.nvmlDeviceGetTotalEccErrors, handle, self.nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter
        )
        return int(value or 0)

    def _optional(self, call, *args):
        """What a query answers, or None where this GPU or driver does not support it."""
        try:
            return call(*args)
        except self.nvml.NVMLError_NotSupported:
            return None

    def drain_xids(self) -> dict[int, list[int]]:
        """Xid events since the last call, by GPU index; never blocks."""
        found: dict[int, list[int]] = {}
        if self.events is None:
            return found
        while True:
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError_Timeout:
                return found
            except self.nvml.NVMLError as exc:
                log.warning("reading NVML events failed: %s", exc)
                return found
            if data.device in self.handles:
                found.setdefault(self.handles.index(data.device), []).append(int(data.eventData))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def short_model_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA A100-SXM4-80GB' -> 'A100': the GPU type users ask for."""
    for word in name.replace("NVIDIA", "").replace("-", " ").split():
        if any(c.isdigit() for c in word) and word[0].isalpha():
            return word.upper()
    return name.strip()


def open_nvml():
    """The initialised pynvml module, or None when there is no usable NVIDIA GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s); using simulated GPUs", exc)
        return None
    return pynvml


def detect_provider(node_name: str, simulate: bool = False, model: str = "H100", count: int = 4) -> GpuProvider:
    """NVML when it finds GPUs (unless simulation is forced), else the simulator."""
    nvml = None if simulate else open_nvml()
    if nvml is not None:
        return NvmlProvider(nvml)
    return SimulatedProvider(node_name, model, count)
