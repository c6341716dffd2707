"""GPU telemetry from NVML (the `pynvml` module of nvidia-ml-py), sampled on a background thread.

`GpuSampler` reads the actor's own GPU — the first device in CUDA_VISIBLE_DEVICES, matched to NVML by
UUID where Ray gives UUIDs, else by index — every `interval_s`. Where NVML or a GPU is absent it
samples nothing and every aggregate is None: a missing reading is never reported as zero.
"""

from __future__ import annotations

import os
import threading
import time


def _nvml_handle():
    """The NVML handle of this process's first visible GPU, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: NVML is simply absent here
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        if visible.startswith(("GPU-", "MIG-")):
            return pynvml.nvmlDeviceGetHandleByUUID(visible)
        return pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
    except Exception:
        return None


class GpuSampler:
    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.handle = _nvml_handle()
        self.samples: list[dict] = []  # time, mem_used_mib, util_pct, power_w, sm_clock_mhz, temp_c
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def read(self) -> dict | None:
        if self.handle is None:
            return None
        import pynvml

        h = self.handle
        return {"time": time.time(), "mem_used_mib": pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20,
                "util_pct": float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "temp_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))}

    def __enter__(self) -> "GpuSampler":
        if self.handle is not None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        reading = self.read()  # one last reading, so even a short interval has one
        if reading:
            self.samples.append(reading)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.read())
            self._stop.wait(self.interval_s)

    def aggregates(self) -> dict:
        """Max memory, mean utilisation and mean power over the samples; None where nothing was read."""
        if not self.samples:
            return {"gpu_mem_used_max_mib": None, "gpu_util_mean_pct": None, "power_mean_w": None}
        n = len(self.samples)
        return {"gpu_mem_used_max_mib": max(s["mem_used_mib"] for s in self.samples),
                "gpu_util_mean_pct": sum(s["util_pct"] for s in self.samples) / n,
                "power_mean_w": sum(s["power_w"] for s in self.samples) / n}
