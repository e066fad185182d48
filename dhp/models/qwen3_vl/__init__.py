"""Qwen3-VL (dense) in plain PyTorch: config presets, the two modules, Hugging Face weights in and out."""

from dhp.models.qwen3_vl.config import PRESETS, Qwen3VLConfig, TextConfig, VisionConfig, preset
from dhp.models.qwen3_vl.model import Qwen3VL, build_model, count_parameters
from dhp.models.qwen3_vl.weights import load_hf_checkpoint, read_hf_config, save_hf_checkpoint

__all__ = [
    "PRESETS",
    "Qwen3VL",
    "Qwen3VLConfig",
    "TextConfig",
    "VisionConfig",
    "build_model",
    "count_parameters",
    "load_hf_checkpoint",
    "preset",
    "read_hf_config",
    "save_hf_checkpoint",
]
