"""GPU providers: NVML on a machine with NVIDIA GPUs, a simulator everywhere else.

Both answer the same two questions: what GPUs are here (inventory) and how
are they doing now (sample). The agent does not care which one it has.
"""

import hashlib
import logging
import random
import uuid
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("hangar.fleet")

# Memory (MiB), idle and max power (W) of the models the simulator knows.
SIMULATED_MODELS = {
    "H100": (81559, 70, 700),
    "H200": (143771, 75, 700),
    "B300": (274877, 120, 1100),
    "A100": (81920, 55, 400),
    "L40S": (46068, 35, 350),
}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    model: str
    memory_total_mb: int


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization_pct: float
    memory_used_mb: float
    temperature_c: float
    power_w: float


class GpuProvider(Protocol):
    simulated: bool

    def inventory(self) -> list[GpuInfo]: ...

    def sample(self, busy: set[int]) -> list[GpuSample]: ...


class SimulatedProvider:
    """Plausible GPUs of one model; busy GPUs run hot and loaded."""

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

    def inventory(self) -> list[GpuInfo]:
        memory, _, _ = SIMULATED_MODELS[self.model]
        return [
            GpuInfo(i, f"GPU-SIM-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{self.node_name}/{i}')}", self.model, memory)
            for i in range(self.count)
        ]

    def sample(self, busy: set[int]) -> list[GpuSample]:
        memory, idle_w, max_w = SIMULATED_MODELS[self.model]
        samples = []
        for i in range(self.count):
            load = self._random.uniform(0.85, 1.0) if i in busy else self._random.uniform(0.0, 0.02)
            samples.append(
                GpuSample(
                    index=i,
                    utilization_pct=round(load * 100, 1),
                    memory_used_mb=round(memory * (0.05 + 0.8 * load)),
                    temperature_c=round(32 + 45 * load + self._random.uniform(-1, 1), 1),
                    power_w=round(idle_w + (max_w - idle_w) * load, 1),
                )
            )
        return samples


class NvmlProvider:
    """Real NVIDIA GPUs through nvidia-ml-py (`pynvml`)."""

    simulated = False

    def __init__(self, nvml):
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]

    def inventory(self) -> list[GpuInfo]:
        out = []
        for i, handle in enumerate(self.handles):
            name = self.nvml.nvmlDeviceGetName(handle)
            uuid_ = self.nvml.nvmlDeviceGetUUID(handle)
            memory = self.nvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            out.append(GpuInfo(i, _text(uuid_), short_model_name(_text(name)), int(memory)))
        return out

    def sample(self, busy: set[int]) -> list[GpuSample]:
        nvml = self.nvml
        out = []
        for i, handle in enumerate(self.handles):
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            temp = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            power_mw = nvml.nvmlDeviceGetPowerUsage(handle)
            out.append(GpuSample(i, float(util.gpu), memory.used / (1024 * 1024), float(temp), power_mw / 1000))
        return out


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
