"""The Qwen2.5-Omni audio encoder (a Whisper-large-v3 encoder cut in chunks), top to bottom.

features [M, F_total] (128 log-mel bins x frames of all clips, concatenated in time), feature_lens [A]
  -> chunk_features        [C, M, 2*n_window]  each clip cut in chunks of 2*n_window frames (the last shorter)
  -> encode_chunks:
       gelu(conv1), masked  [C, D, 2*n_window]
       gelu(conv2 stride 2) [C, n_window, D]     then + sinusoid positions, restarting at each chunk
       valid rows only      [T, D]               chunk order; T = sum over chunks of ceil(len / 2)
       layers x n           [T, D]               pre-LN transformer, attention only inside a chunk
  -> pool_project:
       mean of row pairs    [T/2, D]             (2k, 2k+1) inside each clip, a trailing odd row dropped
       ln_post, proj        [N_tokens, output_dim]

Why chunks: attention and positions restart every ``2 * n_window`` frames (2 s at 100 frames/s for n_window=100),
so the cost is linear in the clip length and a long clip can be cut between chunks: the sequence-parallel
runtime gives each rank whole chunks (``encode_chunks``) and pools each rank's rows (``pool_project``).
Parameter names are those of transformers' ``Qwen2_5OmniAudioEncoder`` (our ``audio.*`` is its ``audio_tower.*``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dhp.models.qwen2_5_omni.config import AudioConfig
from dhp.models.qwen2_5_vl.vision import init_rule
from dhp.ops.attention import Segments, host_metadata, packed_attention
from dhp.parallel.materialize import init_by_name


# ---- lengths (host metadata: small integer tensors derived from shapes) ------------------------------------------
def after_conv_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Rows after the stride-2 conv: ceil(L / 2)."""
    return (lengths - 1) // 2 + 1


def audio_output_lengths(feature_lens: torch.Tensor) -> torch.Tensor:
    """Audio tokens (placeholders in the text) per clip of ``feature_lens`` mel frames: the conv halves the
    frames, pooling halves them again."""
    return (after_conv_lengths(feature_lens) - 2) // 2 + 1


def chunk_lengths(feature_lens: torch.Tensor, n_window: int) -> torch.Tensor:
    """Frames of each chunk [C]: every clip cut in chunks of ``2 * n_window`` frames, the last one shorter."""
    size = 2 * n_window
    out: list[int] = []
    for frames in feature_lens.tolist():
        full, rest = divmod(int(frames), size)
        out += [size] * full + ([rest] if rest else [])
    return torch.tensor(out, dtype=torch.long)


def chunk_features(features: torch.Tensor, feature_lens: torch.Tensor, n_window: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """features [M, F_total] -> padded chunks [C, M, 2*n_window] (zeros past each chunk's end), chunk_lengths [C].

    Same as transformers' ``chunk_and_pad_features``, except the padded width is always a whole chunk."""
    with host_metadata():
        lengths = chunk_lengths(feature_lens.cpu(), n_window)
    chunks = features.T.split(lengths.tolist(), dim=0)  # C x [len_c, M]
    padded = features.new_zeros(len(chunks), 2 * n_window, features.shape[0])
    for i, chunk in enumerate(chunks):
        padded[i, : chunk.shape[0]] = chunk
    return padded.transpose(1, 2), lengths


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's positions [length, channels]: sin of ``channels/2`` geometric frequencies, then cos."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


# ---- modules -------------------------------------------------------------------------------------------------------
class AudioAttention(nn.Module):
    """Multi-head self-attention within chunks (non-causal; Whisper's k_proj has no bias)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: Segments | torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        seq = x.shape[0]
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))  # [T, D] each
        if seq == 0:  # a sequence-parallel rank with no chunk still runs every layer (FSDP gathers in lockstep)
            return self.out_proj(q * 0 + k * 0 + v * 0)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(seq, heads, self.head_dim) for t in (q, k, v))  # [T, H, hd]
        out = packed_attention(q, k, v, cu_seqlens, causal=False)  # [T, H, hd]
        return self.out_proj(out.reshape(seq, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.self_attn = AudioAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)

    def forward(self, x: torch.Tensor, cu_seqlens: Segments | torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    attention_kernel: str = "auto"  # packed_attention's kernel (train.attention)

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        # not in checkpoints: rebuilt by reset_buffers after to_empty
        self.register_buffer("positional_embedding", self._positions(), persistent=False)
        # the <|audio_bos|>/<|audio_eos|> embeddings of the original release: in checkpoints, unused by forward
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.proj = nn.Linear(cfg.d_model, cfg.output_dim)

    def _positions(self) -> torch.Tensor:
        return sinusoids(self.cfg.max_source_positions, self.cfg.d_model)

    def reset_buffers(self) -> None:
        """Recompute ``positional_embedding`` (after ``to_empty``): on the CPU, as at construction, then copied in."""
        with torch.device("cpu"):
            self.positional_embedding.copy_(self._positions())

    def forward(self, features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        """features [M, F_total] (clips concatenated in time), feature_lens [A] -> audio tokens [N, output_dim]
        (``audio_output_lengths(feature_lens)`` per clip, in clip order)."""
        padded, lengths = chunk_features(features, feature_lens, self.cfg.n_window)
        hidden = self.encode_chunks(padded, lengths)
        return self.pool_project(hidden, after_conv_lengths(feature_lens.cpu()))

    def encode_chunks(self, padded: torch.Tensor, chunk_lengths: torch.Tensor) -> torch.Tensor:
        """padded [C, M, L] (zeros past each chunk's length), chunk_lengths [C] -> hidden [sum_c ceil(len_c/2), D],
        valid rows only, in chunk order. Chunks never see each other: any subset gives the same rows."""
        x = padded.to(self.conv1.weight.dtype)
        with host_metadata():  # all from the chunk lengths, on the host: no device value is read back
            lengths = chunk_lengths.cpu()
            after = after_conv_lengths(lengths)  # [C] rows per chunk after the stride-2 conv
            segments = Segments(F.pad(after.cumsum(0), (1, 0)).tolist(), self.attention_kernel)
            frame_mask = (torch.arange(x.shape[2]) < lengths[:, None]).unsqueeze(1)  # [C, 1, L]
        x = F.gelu(self.conv1(x)) * frame_mask.to(x.device)  # [C, D, L]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [C, ceil(L/2), D]
        with host_metadata():
            valid = (torch.arange(x.shape[1]) < after[:, None]).reshape(-1).nonzero().flatten()  # [T] flat rows
        x = x + self.positional_embedding[: x.shape[1]].to(x.dtype)  # positions restart at each chunk
        x = x.reshape(-1, x.shape[-1]).index_select(0, valid.to(x.device))  # [T, D] valid rows, chunk order
        for layer in self.layers:
            x = layer(x, segments)
        return x

    def pool_project(self, hidden: torch.Tensor, segment_lengths: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], segment_lengths [S] (rows of each clip, or of a part of a clip that starts at an even
        row) -> [sum_s floor(T_s / 2), output_dim]: rows (2k, 2k+1) of each segment averaged, then ln_post, proj."""
        with host_metadata():
            firsts = [torch.arange(start, start + 2 * (n // 2), 2)
                      for start, n in zip(_starts(segment_lengths), segment_lengths.tolist(), strict=True)]
            first = torch.cat(firsts) if firsts else torch.zeros(0, dtype=torch.long)
        first = first.to(hidden.device)
        pooled = (hidden[first] + hidden[first + 1]) / 2  # [N, D]
        return self.proj(self.ln_post(pooled))


def _starts(lengths: torch.Tensor) -> list[int]:
    ends = lengths.cpu().cumsum(0).tolist()
    return [0] + ends[:-1] if ends else []


def init_audio(module: nn.Module, seed: int, transforms: dict | None = None, std: float = 0.02) -> None:
    """Shard-local deterministic init of the (possibly parallelized, materialised) audio encoder by parameter name
    (``dhp.parallel.materialize.init_by_name``, Qwen's ``init_rule``): Normal(0, std) for linear, conv and
    embedding weights, zero biases, unit LayerNorm weights."""
    init_by_name(module, seed, lambda name, p: audio_init_rule(name, p, std), transforms=transforms)


def audio_init_rule(name: str, param: torch.Tensor, std: float = 0.02) -> tuple:
    """Qwen's rule (``init_rule``), except the conv stem's weights: He-normal, std ``sqrt(2 / fan_in)``.

    Why: with Normal(0, 0.02) (transformers' init) the stem's output on log-mel input is about 0.016 rms
    against the 0.5 rms of the sinusoid positions added to it (measured on the tiny preset and a dial-tone
    clip): a from-scratch encoder starts almost blind to its input. He init keeps the stem's output at the
    scale of its input, as for any ReLU-like stack. Loaded checkpoints are unaffected."""
    if name.endswith(("conv1.weight", "conv2.weight")):
        fan_in = param.shape[1] * param.shape[2]
        return ("normal", math.sqrt(2.0 / fan_in))
    return init_rule(name, param, std)
