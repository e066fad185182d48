"""Data: LLaVA-style datasets, Qwen2.5-VL preprocessing, M-RoPE positions, batch plans, the demo set."""
