"""Reading one video of a data record, safely: the frames GLM-4.5V's processor would sample, with a bounded decode.

A video is a file (mp4, webm, mkv, avi, mov, ...), decoded with PyAV (an optional dependency, imported on first use),
or frame images: a folder of them (in file-name order, so number them with leading zeros) or a list of their paths,
for which the record gives the frame rate. The frame indices are those of transformers'
`Glm4vVideoProcessor.sample_frames`, capped at `max_frames`. The bounds: the header's resolution and duration are
checked before decoding; decoding stops after the last chosen frame and keeps only the chosen ones, each downscaled to
the processor's pixel budget; the whole read has a deadline, checked between packets and, through PyAV's `timeout=`,
inside a blocking read too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image

from glm45v_fsdp.data.images import BadImage, _fit, load_image, require_content
from glm45v_fsdp.errors import UserError

_IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")
_REENCODE = "ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4"
_FIX = f"Re-encode it ({_REENCODE}), or remove it from the record"
# A container's frame count may exceed the decodable frames by a few (an mp4 edit list drops some): such a file is
# sampled over the frames it holds; a larger shortfall is a truncated file.
_HEADER_SLACK_FRAMES = 3


class BadVideo(Exception):
    """A video that cannot be used; the message says why and what to do (the caller adds the record and file)."""


@dataclass(frozen=True)
class SampledVideo:
    frames: list[Image.Image]  # RGB, an even count, each at most max_pixels pixels
    timestamps: list[float]  # seconds of each frame: its index / fps
    fps: float  # the stream's average frame rate (the given fps for frame images)
    total_frames: int  # frames in the stream
    indices: list[int]  # the chosen frame indices, after the odd-count padding


def sample_indices(
    total_frames: int,
    fps: float,
    target_fps: float,
    max_frames: int,
    max_duration_s: float = 300.0,
    duration_s: float | None = None,
) -> list[int]:
    """The frame indices transformers' `Glm4vVideoProcessor.sample_frames` chooses (its `max_duration` =
    max_duration_s; `duration_s` the metadata's duration, which transformers' video decoders report as
    total_frames / fps; None or 0: its fallback, round((total_frames - 1) / fps) + 1), ascending; when more than
    `max_frames` remain, `max_frames` of them spread evenly, the first and last kept; an odd count gets its last index
    repeated."""
    if total_frames < 1 or fps <= 0 or target_fps <= 0 or max_frames < 2:
        raise ValueError(f"sample_indices({total_frames=}, {fps=}, {target_fps=}, {max_frames=}): out of range")
    last = total_frames - 1
    duration = duration_s or round(last / fps) + 1
    if duration <= max_duration_s:
        n = max(math.floor(duration * target_fps), 1)
        chosen = [min(last, math.ceil(i * fps / target_fps)) for i in range(n)]
    elif (n := int(max_duration_s * target_fps)) >= total_frames:
        chosen = list(range(total_frames))
    else:
        chosen = [min(last, math.ceil(t * fps)) for t in np.linspace(0, duration, n, endpoint=True)]
    unique = list(dict.fromkeys(chosen))
    if len(unique) > max_frames:
        unique = [unique[i * (len(unique) - 1) // (max_frames - 1)] for i in range(max_frames)]
    return unique + unique[-1:] if len(unique) % 2 else unique


@dataclass(frozen=True)
class _Limits:
    target_fps: float
    max_frames: int
    max_pixels: int
    max_decode_pixels: int
    max_duration_s: float
    timeout_s: float
    deadline: float  # time.monotonic() value

    def timed_out(self) -> bool:
        return time.monotonic() > self.deadline

    def check_time(self) -> None:
        if self.timed_out():
            raise self.timeout_error()

    def timeout_error(self) -> BadVideo:
        return BadVideo(
            f"reading it took longer than the time limit of {self.timeout_s:g} s: it is too long or too slow to "
            f"decode. Shorten or re-encode it ({_REENCODE}), or raise data.video_decode_timeout_s"
        )

    def check_duration(self, seconds: float, counting: bool = False) -> None:
        if seconds > self.max_duration_s:
            raise BadVideo(
                f"it lasts {'over ' if counting else ''}{seconds:.1f} s, over the duration limit of "
                f"{self.max_duration_s:g} s. Cut it into shorter clips (ffmpeg -i IN -ss 0 -t 60 OUT.mp4), or raise "
                f"data.video_max_seconds"
            )

    def sample(self, total_frames: int, fps: float) -> list[int]:
        """As transformers samples a decoded video: its duration total_frames / fps, the processor's own max_duration
        (300 s, where its sampling turns to a linspace; max_duration_s is for refusing a video)."""
        return sample_indices(total_frames, fps, self.target_fps, self.max_frames, duration_s=total_frames / fps)

    def downscale(self, image: Image.Image) -> Image.Image:
        if image.width * image.height <= self.max_pixels:
            return image
        return image.resize(
            _fit(image.width, image.height, self.max_pixels), Image.Resampling.BICUBIC, reducing_gap=3.0
        )


def read_video(
    source: Path | list[Path],
    *,
    fps: float | None,
    target_fps: float,
    max_frames: int,
    max_pixels: int,
    max_decode_pixels: int,
    max_duration_s: float,
    timeout_s: float,
) -> SampledVideo:
    """The sampled frames of a video file, a folder of frame images or a list of frame image paths. `fps` is the
    record's frame rate: required for frame images, used for a file only when its stream has none. `BadVideo` when
    the video is missing, empty, undecodable, without a video stream, frames or frame rate, over `max_decode_pixels`
    a frame or `max_duration_s`, or not read within `timeout_s`; `UserError` when a file needs PyAV and it is absent."""
    limits = _Limits(
        target_fps, max_frames, max_pixels, max_decode_pixels, max_duration_s, timeout_s, time.monotonic() + timeout_s
    )
    if isinstance(source, list):
        return _read_frame_images(source, fps, limits)
    if source.is_dir():
        return _read_frame_images(_frame_files(source), fps, limits)
    return _read_file(source, fps, limits)


def _given_fps(fps: float | None, missing: str) -> float:
    if fps is None:
        raise BadVideo(
            f"missing fps: {missing}, and the record gives none. Add it to the record: the video entry's "
            '"fps", or the record\'s "video_fps"'
        )
    if not (math.isfinite(fps) and fps > 0):
        raise BadVideo(f"the record's fps is {fps!r}; give a positive frame rate")
    return float(fps)


def _sampled(frames: dict[int, Image.Image], indices: list[int], fps: float, total_frames: int) -> SampledVideo:
    return SampledVideo([frames[i] for i in indices], [i / fps for i in indices], fps, total_frames, indices)


def _frame_files(folder: Path) -> list[Path]:
    """The image files of a frame folder, sorted by name."""
    try:
        entries = sorted(folder.iterdir(), key=lambda path: path.name)
    except OSError as error:
        raise BadVideo(f"its frame folder cannot be listed ({error.strerror})") from None
    frames = [path for path in entries if path.suffix.lower() in _IMAGE_SUFFIXES and path.is_file()]
    if not frames:
        raise BadVideo(
            f"its frame folder holds no frame images ({len(entries)} entries, none named "
            f"*{', *'.join(_IMAGE_SUFFIXES)}). Put the frames there, or give a video file instead"
        )
    return frames


def _read_frame_images(paths: list[Path], fps: float | None, limits: _Limits) -> SampledVideo:
    if not paths:
        raise BadVideo("its list of frame images is empty. Give the frames, or remove the video from the record")
    fps = _given_fps(fps, "frame images have no frame rate of their own")
    limits.check_duration(len(paths) / fps)
    indices = limits.sample(len(paths), fps)
    frames = {}
    for i in dict.fromkeys(indices):
        limits.check_time()
        try:
            frames[i] = load_image(paths[i], limits.max_pixels, limits.max_decode_pixels)
        except BadImage as error:
            raise BadVideo(f"its frame {paths[i]}: {error}") from None
    return _sampled(frames, indices, fps, len(paths))


def _import_av() -> ModuleType:
    try:
        import av
    except ImportError:
        raise UserError(
            "the data has video files, and reading them needs PyAV (the `av` package), which is not installed: "
            'pip install "glm45v-fsdp[video]" (or pip install av), or remove the video records from the data. '
            "data.on_bad_record=skip does not apply: this is a problem of the environment, not of a record"
        ) from None
    return av


def _read_file(path: Path, fps: float | None, limits: _Limits) -> SampledVideo:
    av = _import_av()
    require_content(path, BadVideo, ". Check the path", ". Replace it, or remove the video from the record")
    try:
        with _open(av, path, limits) as container:
            rate, total = _probe(av, container, fps, limits)
        indices = limits.sample(total, rate)
        frames, decoded = _decode(av, path, indices, limits)
        if decoded <= indices[-1]:  # the stream ends before its header's frame count
            if decoded == 0 or total - decoded > _HEADER_SLACK_FRAMES:
                raise BadVideo(
                    f"its header says {total} frames, but only {decoded} decode: it is truncated or damaged. {_FIX}"
                )
            total = decoded  # a header a few frames over: sample the frames the stream holds
            indices = limits.sample(total, rate)
            frames, _ = _decode(av, path, indices, limits)
        return _sampled(frames, indices, rate, total)
    except BadVideo:
        raise
    except Exception as error:  # PyAV raises av.error.* (InvalidDataError, EOFError, ExitError, ...) and others
        if limits.timed_out():  # PyAV's timeout= interrupts a blocking read with an ExitError
            raise limits.timeout_error() from None
        raise BadVideo(
            f"it cannot be decoded as a video: {type(error).__name__}: {error}. It is truncated, corrupt or not a "
            f"video. {_FIX}"
        ) from None


def _open(av: ModuleType, path: Path, limits: _Limits) -> Any:
    """The container of `path`; PyAV's `timeout=` interrupts a read blocked for longer than the limit."""
    return av.open(str(path), timeout=limits.timeout_s)


def _probe(av: ModuleType, container: Any, fps: float | None, limits: _Limits) -> tuple[float, int]:
    """The frame rate and frame count of the first video stream (counted by decoding when the header lacks it),
    after the header's resolution and duration checks."""
    if not container.streams:
        raise BadVideo(f"no stream can be found in it: it is truncated, corrupt or not a video. {_FIX}")
    if not container.streams.video:
        kinds = ", ".join(stream.type for stream in container.streams)
        raise BadVideo(
            f"it has no video stream (its streams: {kinds}). Give a video file, or remove it from the record"
        )
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > limits.max_decode_pixels:
        raise BadVideo(
            f"its frames are {width}x{height} pixels ({width * height:,}), over the decode limit of "
            f"{limits.max_decode_pixels:,} pixels a frame. Downscale it (ffmpeg -i IN -vf scale=-2:720 OUT.mp4), or "
            f"raise data.max_image_pixels if the memory allows"
        )
    rates = (stream.average_rate, stream.guessed_rate, stream.base_rate)
    rate = next((float(r) for r in rates if r and 0 < float(r) < math.inf), None)
    if rate is None:
        rate = _given_fps(fps, "its video stream has no frame rate")
    if stream.duration and stream.time_base:
        header_s = float(stream.duration * stream.time_base)
    else:
        header_s = (container.duration or 0) / av.time_base
    limits.check_duration(max(header_s, stream.frames / rate))
    if stream.frames > 0:
        return rate, stream.frames
    count = 0
    for _ in _frames(container, limits):
        count += 1
        limits.check_duration(count / rate, counting=True)
    if count == 0:
        raise BadVideo(f"it holds no decodable frame. {_FIX}")
    return rate, count


def _frames(container: Any, limits: _Limits) -> Iterator[Any]:
    """The decoded frames of the first video stream, with the deadline checked before each packet."""
    for packet in container.demux(container.streams.video[0]):
        limits.check_time()
        yield from packet.decode()


def _decode(av: ModuleType, path: Path, indices: list[int], limits: _Limits) -> tuple[dict[int, Image.Image], int]:
    """The chosen frames (ascending `indices`) by index, downscaled, and the count of frames decoded: up to the last
    chosen one, or all of them when the stream ends before it."""
    wanted, frames, count = set(indices), {}, 0
    with _open(av, path, limits) as container:
        for frame in _frames(container, limits):
            if count in wanted:
                frames[count] = limits.downscale(frame.to_image())
            count += 1
            if count > indices[-1]:
                break
    return frames, count
