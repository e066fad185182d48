"""Accelerators as data: peak throughput, memory and bandwidth, for the planner's step time and for MFU.

Peak dense bf16 figures are the vendors' published ones (no sparsity). ``efficiency`` is
the fraction of peak a well-tuned training step reaches on large matmuls; the planner
states it next to every predicted time, and ``runtime.peak_tflops`` / ``--peak-tflops``
override the peak where a user knows better.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    name: str
    peak_bf16_tflops: float  # dense
    memory_gb: float
    memory_bw_gbs: float  # HBM
    link_gbs: float  # per-GPU intra-node bandwidth (NVLink/PCIe), one direction
    efficiency: float = 0.5  # achievable fraction of peak on a training step's matmuls

    @property
    def peak_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12


DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM 80GB", 989.0, 80.0, 3350.0, 450.0),
    "h200": Device("H200 SXM 141GB", 989.0, 141.0, 4800.0, 450.0),
    "a100": Device("A100 SXM 80GB", 312.0, 80.0, 2039.0, 300.0),
    "l40s": Device("L40S 48GB", 362.0, 48.0, 864.0, 32.0),
}


def get_device(name: str, peak_tflops: float | None = None) -> Device:
    """A device by table name (h100, h200, a100, l40s), optionally with its peak overridden."""
    try:
        dev = DEVICES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}") from None
    return replace(dev, peak_bf16_tflops=peak_tflops) if peak_tflops else dev


def detect_device() -> Device | None:
    """The table entry of this process's CUDA device, by name; None without CUDA or for an unknown GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    for key, dev in DEVICES.items():
        if key in name:
            return dev
    return None
