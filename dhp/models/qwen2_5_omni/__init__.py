"""The Qwen2.5-Omni thinker in plain PyTorch: Qwen2.5-VL's vision encoder and language model, a chunked audio
encoder and TMRoPE position ids, with Hugging Face weights in and out."""

from dhp.models.qwen2_5_omni.audio import AudioEncoder
from dhp.models.qwen2_5_omni.config import PRESETS, AudioConfig, Qwen2_5OmniConfig, preset
from dhp.models.qwen2_5_omni.model import Qwen2_5OmniThinker, build_model
from dhp.models.qwen2_5_omni.rope import omni_rope_index
from dhp.models.qwen2_5_omni.weights import load_hf_checkpoint, read_hf_config, save_hf_checkpoint

__all__ = [
    "PRESETS",
    "AudioConfig",
    "AudioEncoder",
    "Qwen2_5OmniConfig",
    "Qwen2_5OmniThinker",
    "build_model",
    "load_hf_checkpoint",
    "omni_rope_index",
    "preset",
    "read_hf_config",
    "save_hf_checkpoint",
]
