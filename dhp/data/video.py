"""Video files for any family's processor: the container header, frame decoding (PyAV), frame lists, writing.

A clip is a video file (mp4, webm, avi...) or a list of frame images (already
sampled); each a path, or an open file object (fetched from an object store by
``dhp.storage.open_media``). What a family makes of it (which frames it samples, their size, its
patches) is the family's processor's; this module gives it what every such rule
needs: the header facts without decoding (``read_header``, ``frame_list_size``)
and the chosen frames as uint8 (``decode_frames``). ``write_clip`` writes test and
demo clips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from dhp.data.processor import MediaError

VIDEO_SUFFIXES = (".mp4", ".webm", ".avi", ".mkv", ".mov", ".m4v")


class VideoError(MediaError):
    """A video that cannot be used: undecodable, empty, too short. The message says what and how to fix it."""


def is_frame_list(source) -> bool:
    return isinstance(source, (list, tuple))


def frame_list_size(frames: list[Path]) -> tuple[int, int]:
    """(width, height) of a frame list, from the first frame image's header."""
    from PIL import Image

    if not frames:
        raise VideoError("an empty list of frames; give at least one frame image")
    with Image.open(frames[0]) as img:
        return img.size


def _container(source: Any) -> Any:
    """What PyAV opens: a path as text, an open file object (a clip fetched from an object store) as it is."""
    return source if hasattr(source, "read") else str(source)


def read_header(path: Path | Any) -> tuple[int, float, int, int]:
    """(frames, fps, width, height) from the container; counts packets (no decoding) if the header has no count."""
    import av

    try:
        with av.open(_container(path)) as container:
            if not container.streams.video:
                raise VideoError(f"video {path} has no video stream; give a video file (mp4, webm, avi)")
            stream = container.streams.video[0]
            total = int(stream.frames or 0)
            rate = stream.average_rate or stream.guessed_rate
            width, height = stream.codec_context.width, stream.codec_context.height
            if total == 0:
                total = sum(1 for packet in container.demux(stream) if packet.size)
    except VideoError:
        raise
    except Exception as e:  # PyAV raises many error types for broken files
        raise VideoError(f"video {path} cannot be read ({type(e).__name__}: {e}); replace the file") from None
    if total == 0:
        raise VideoError(f"video {path} has no frames; replace the file or drop the sample")
    if not rate or not width or not height:
        raise VideoError(f"video {path} has no frame rate or frame size in its header; re-encode it")
    return total, float(rate), int(width), int(height)


def decode_frames(source: Path | list[Path], indices: tuple[int, ...]) -> torch.Tensor:
    """The chosen frames as uint8 [T, 3, H, W] (RGB); a frame list: every image, converted to RGB."""
    if is_frame_list(source):
        from PIL import Image

        frames = []
        for p in source:
            with Image.open(p) as img:
                frames.append(np.asarray(img.convert("RGB")))
        sizes = {f.shape for f in frames}
        if len(sizes) > 1:
            raise VideoError(f"frames of different sizes ({sorted(sizes)}); give frames of one size")
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    import av

    wanted = set(indices)
    frames = []
    try:
        with av.open(_container(source)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i > indices[-1]:
                    break
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except Exception as e:
        raise VideoError(f"video {source} cannot be decoded ({type(e).__name__}: {e}); replace the file") from None
    if len(frames) != len(indices):
        raise VideoError(f"video {source}: its header promises frame {indices[-1]} but only {len(frames)} of the "
                         f"{len(indices)} sampled frames decode; re-encode the file")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()


def write_clip(path: Path, frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> Path:
    """Write uint8 RGB frames [T, H, W, 3] (or gray [T, H, W]) as a video file (PyAV); sides must be even."""
    import av

    if frames.ndim == 3:
        frames = np.repeat(frames[..., None], 3, axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"} if codec == "mpeg4" else {}
        for arr in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
