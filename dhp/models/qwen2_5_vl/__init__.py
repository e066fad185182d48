"""Qwen2.5-VL in plain PyTorch: config presets, the two modules, Hugging Face weights in and out."""

from dhp.models.qwen2_5_vl.config import PRESETS, Qwen2_5_VLConfig, TextConfig, VisionConfig, preset
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL, build_model, count_parameters
from dhp.models.qwen2_5_vl.weights import load_hf_checkpoint, read_hf_config, save_hf_checkpoint

__all__ = [
    "PRESETS",
    "Qwen2_5_VL",
    "Qwen2_5_VLConfig",
    "TextConfig",
    "VisionConfig",
    "build_model",
    "count_parameters",
    "load_hf_checkpoint",
    "preset",
    "read_hf_config",
    "save_hf_checkpoint",
]
