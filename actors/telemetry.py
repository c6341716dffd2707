"""GPU telemetry from NVML (the `pynvml` module of nvidia-ml-py), sampled on a background thread.

`GpuSampler` reads the actor's own GPUs — the devices in CUDA_VISIBLE_DEVICES, matched to NVML by UUID
where Ray gives UUIDs, else by index — every `interval_s` (an actor of a tensor-parallel engine holds
several: one reading sums or averages them). Where NVML or a GPU is absent it
samples nothing and every aggregate is None: a missing reading is never reported as zero.
"""

from __future__ import annotations

import os
import threading
import time


def _nvml_handles() -> list:
    """NVML handles of this process's visible GPUs, in CUDA_VISIBLE_DEVICES order ([] without NVML; the
    first GPU where the variable is unset)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: NVML is simply absent here
        return []
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()] or ["0"]
    handles = []
    for device in visible:
        try:
            if device.startswith(("GPU-", "MIG-")):
                handles.append(pynvml.nvmlDeviceGetHandleByUUID(device))
            else:
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(device) if device.isdigit() else 0))
        except Exception:
            continue
    return handles


def _nvml_handle():
    """The NVML handle of this process's first visible GPU, or None."""
    handles = _nvml_handles()
    return handles[0] if handles else None


def gpu_name() -> str | None:
    """The name NVML gives this process's GPU ("NVIDIA H100 80GB HBM3"), or None. Read through NVML, not
    torch, so that an actor whose engine core runs in a process of its own never opens a CUDA context."""
    handle = _nvml_handle()
    if handle is None:
        return None
    import pynvml

    name = pynvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else name


def gpu_capability() -> tuple[int, int] | None:
    """This process's GPU's CUDA compute capability (9, 0 for an H100), from NVML, or None."""
    handle = _nvml_handle()
    if handle is None:
        return None
    import pynvml

    try:
        return tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    except Exception:
        return None


def gpu_total_bytes() -> int | None:
    """This process's GPU's memory in bytes, from NVML (no CUDA context), or None."""
    handle = _nvml_handle()
    if handle is None:
        return None
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)


class GpuSampler:
    """Samples the GPU on a thread: `start()`/`stop()` for an actor's lifetime, or `with` for one span."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.handles = _nvml_handles()  # an actor of several GPUs (tensor parallel) reads all of them
        self.samples: list[dict] = []  # time, mem_used_mib, util_pct, power_w, sm_clock_mhz, temp_c
        self._drained = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def read(self) -> dict | None:
        """One reading of the actor's GPUs: memory and power summed over them, utilisation and SM clock
        their mean, temperature the hottest's (one GPU: its own readings)."""
        if not self.handles:
            return None
        import pynvml

        each = [(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20, float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                 pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                 float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))) for h in self.handles]
        n = len(each)
        return {"time": time.time(), "mem_used_mib": sum(e[0] for e in each), "util_pct": sum(e[1] for e in each) / n,
                "power_w": sum(e[2] for e in each), "sm_clock_mhz": sum(e[3] for e in each) / n,
                "temp_c": max(e[4] for e in each)}

    def start(self) -> "GpuSampler":
        if self.handles and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_now()  # one last reading, so even a short span has one

    def __enter__(self) -> "GpuSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def sample_now(self) -> None:
        reading = self.read()
        if reading:
            with self._lock:
                self.samples.append(reading)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_now()
            self._stop.wait(self.interval_s)

    def drain(self) -> list[dict]:
        """The samples taken since the last drain (for telemetry/gpu.parquet)."""
        with self._lock:
            new, self._drained = self.samples[self._drained:], len(self.samples)
        return new

    def aggregates(self, since: float | None = None, until: float | None = None) -> dict:
        """Max memory, mean utilisation and mean power over the samples in [since, until]; None where
        nothing was read."""
        with self._lock:
            window = [s for s in self.samples if (since is None or s["time"] >= since)
                      and (until is None or s["time"] <= until)]
        if not window:
            return {"gpu_mem_used_max_mib": None, "gpu_util_mean_pct": None, "power_mean_w": None}
        n = len(window)
        return {"gpu_mem_used_max_mib": max(s["mem_used_mib"] for s in window),
                "gpu_util_mean_pct": sum(s["util_pct"] for s in window) / n,
                "power_mean_w": sum(s["power_w"] for s in window) / n}
