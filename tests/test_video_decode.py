"""Reading one video of a record (glm45v_fsdp/data/video.py): the frame indices are transformers' own, decoded frames
hold what was encoded, frame images read like a file, and every hostile video is refused by name, never hangs.

The videos are made here with PyAV from solid-colour frames, a different colour each, so a decoded frame's mean
colour tells which frame it is; all are tiny (48x32 or 64x48, at most 2 s), so the file runs in seconds.
"""

from __future__ import annotations

import fractions
import itertools
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
from PIL import Image
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glm45v_fsdp.data import video
from glm45v_fsdp.data.video import BadVideo, read_video, sample_indices
from glm45v_fsdp.errors import UserError

# 20 colours, far apart in RGB (each channel steps through its own cycle), one a frame
COLOURS = [((i * 53) % 256, (i * 101 + 40) % 256, (255 - i * 13) % 256) for i in range(20)]
LIMITS = dict(target_fps=2.0, max_frames=64, max_pixels=10_000, max_decode_pixels=1_000_000, max_duration_s=60.0)


def read(source: Path | list[Path], fps: float | None = None, **overrides) -> video.SampledVideo:
    return read_video(source, fps=fps, **{**LIMITS, "timeout_s": 30.0, **overrides})


def encode(
    path: Path, codec: str, frames: int = 20, size: tuple[int, int] = (48, 32), rate: int = 10, fmt=None, **options
) -> Path:
    """A video of `frames` solid frames of COLOURS at `rate` fps; `options` go to the muxer (e.g. movflags)."""
    width, height = size
    with av.open(str(path), "w", format=fmt, options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12"}
        for i in range(frames):
            pixels = np.full((height, width, 3), COLOURS[i], np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def mean_colour(image: Image.Image) -> np.ndarray:
    return np.asarray(image, np.float64).reshape(-1, 3).mean(axis=0)


def assert_frames_show(result: video.SampledVideo, tolerance: float) -> None:
    """Each frame's mean colour is that of the frame index it claims, and nearer it than any other colour."""
    for frame, index in zip(result.frames, result.indices):
        assert frame.mode == "RGB"
        distances = [np.abs(mean_colour(frame) - colour).max() for colour in COLOURS]
        assert distances[index] <= tolerance, (index, mean_colour(frame), COLOURS[index])
        assert int(np.argmin(distances)) == index


@contextmanager
def no_hang(seconds: int) -> Iterator[None]:
    def fail(*_) -> None:
        raise AssertionError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- sampling: transformers' indices ------------------------------------------------------------------------------


def transformers_indices(
    total: int, fps: float, target_fps: float, max_duration: float, duration: float | None
) -> list[int]:
    try:
        processor = Glm4vVideoProcessor()
        processor.max_duration = max_duration
    except Exception:  # constructing it may need torchvision; sample_frames reads only these two attributes
        processor = SimpleNamespace(fps=2, max_duration=max_duration)
    metadata = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
    return Glm4vVideoProcessor.sample_frames(processor, metadata, fps=target_fps).tolist()


GRID = list(
    itertools.product(
        [1, 2, 3, 7, 30, 31, 100, 601, 9_001, 20_000],  # frames: odd counts, and 9001/20000 run past 300 s at 25-30 fps
        [1.0, 2.0, 7.5, 23.976, 25.0, 29.97, 30.0, 60.0],  # the stream's fps: 1 is below the target
        [1.0, 2.0, 3.0],  # target fps
    )
)


@pytest.mark.parametrize("max_duration", [300.0, 60.0])
@pytest.mark.parametrize("decoder_duration", [True, False], ids=["duration", "no-duration"])
def test_sample_indices_are_transformers(max_duration: float, decoder_duration: bool) -> None:
    """With the duration transformers' decoders report (total / fps), and without one (its fallback formula)."""
    long_ones = 0
    for total, fps, target in GRID:
        duration = total / fps if decoder_duration else None
        expected = transformers_indices(total, fps, target, max_duration, duration)
        got = sample_indices(total, fps, target, max_frames=10**9, max_duration_s=max_duration, duration_s=duration)
        assert got == expected, (total, fps, target)
        assert len(got) % 2 == 0
        long_ones += (total - 1) / fps > max_duration
    assert long_ones > 10  # the grid does reach the linspace branch


def test_sample_indices_cap_keeps_first_last_and_even() -> None:
    uncapped = sample_indices(3_000, 30.0, 2.0, max_frames=10**9)
    assert len(uncapped) == 202  # round(2999 / 30) + 1 = 101 s at 2 fps
    for cap in (2, 16, 64):
        capped = sample_indices(3_000, 30.0, 2.0, max_frames=cap)
        assert len(capped) == cap
        assert capped[0] == uncapped[0] and capped[-1] == uncapped[-1]
        assert set(capped) <= set(uncapped) and capped == sorted(set(capped))
    # a cap that leaves an odd count is padded with the last index, as the uncapped sampling is
    assert sample_indices(20, 10.0, 2.0, max_frames=10**9) == [0, 5, 10, 15, 19, 19]
    assert sample_indices(1, 10.0, 2.0, max_frames=8) == [0, 0]
    with pytest.raises(ValueError):
        sample_indices(0, 10.0, 2.0, max_frames=8)


# --- real files -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "codec", "tolerance"),
    [
        ("clip.mp4", "mpeg4", 12),
        ("clip_x264.mp4", "libx264", 12),
        ("clip.webm", "libvpx-vp9", 12),
        ("clip.mkv", "ffv1", 3),
        ("clip.ts", "mpeg4", 12),
    ],
)
def test_file_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, codec: str, tolerance: float) -> None:
    """15 frames at 10 fps (1.5 s): GLM's sampling at 2 fps picks 0,5,10 and repeats 10. webm, mkv and MPEG-TS
    headers carry no frame count, so those are counted by decoding; MPEG-TS has no average rate (its guessed one)."""
    converted = []
    downscale = video._Limits.downscale
    monkeypatch.setattr(video._Limits, "downscale", lambda self, image: converted.append(1) or downscale(self, image))
    result = read(encode(tmp_path / name, codec, frames=15), fps=99.0)  # the stream's own rate wins over a given fps
    assert len(converted) == 3  # only the chosen frames became images
    assert result.fps == 10.0 and result.total_frames == 15
    assert result.indices == [0, 5, 10, 10] == sample_indices(15, 10.0, 2.0, 64, duration_s=1.5)
    assert result.timestamps == [0.0, 0.5, 1.0, 1.0]
    assert len(result.frames) == 4 and result.frames[-1] is result.frames[-2]
    assert all(frame.size == (48, 32) for frame in result.frames)
    assert_frames_show(result, tolerance)


def test_file_downscaled_keeping_aspect(tmp_path: Path) -> None:
    path = encode(tmp_path / "wide.mp4", "mpeg4", frames=8, size=(64, 48))
    result = read(path, max_pixels=800)
    for frame in result.frames:
        assert frame.width * frame.height <= 800
        assert frame.size == (32, 24)  # 64x48 scaled by sqrt(800 / 3072), floored: the 4:3 aspect kept
    assert_frames_show(result, 12)
    # decoding stops at the last chosen frame
    limits = video._Limits(2.0, 64, 800, 1_000_000, 60.0, 30.0, deadline=float("inf"))
    frames, decoded = video._decode(av, path, [0, 3], limits)
    assert sorted(frames) == [0, 3] and decoded == 4


def test_file_shorter_than_its_header(tmp_path: Path) -> None:
    """A faststart mp4 (header first) of 20 frames at 2 fps, all of them chosen, cut at the start of a packet: its
    header still says 20 frames. 3 missing are taken for a header that overstates (the 17 there are sampled); 4, or
    all 20, for a truncated file."""
    whole = encode(tmp_path / "whole.mp4", "mpeg4", rate=2, movflags="faststart")
    with av.open(str(whole)) as container:
        starts = [packet.pos for packet in container.demux(video=0) if packet.size]
        assert container.streams.video[0].frames == 20
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole.read_bytes()[: starts[17]])
    result = read(cut)
    assert result.total_frames == 17 and result.indices == [*range(17), 16]
    assert_frames_show(result, 12)
    cut.write_bytes(whole.read_bytes()[: starts[16]])
    with pytest.raises(BadVideo, match=r"header says 20 frames, but only 16 decode: it is truncated"):
        read(cut)
    cut.write_bytes(whole.read_bytes()[: starts[0]])
    with pytest.raises(BadVideo, match=r"header says 20 frames, but only 0 decode"):
        read(cut)


# --- frame images ---------------------------------------------------------------------------------------------------


def write_frames(folder: Path, count: int) -> list[Path]:
    folder.mkdir()
    paths = [folder / f"frame_{i:03d}.png" for i in range(count)]
    for i in reversed(range(count)):  # written out of order: the order is the names'
        Image.new("RGB", (40, 30), COLOURS[i]).save(paths[i])
    return paths


def test_frame_folder_and_list(tmp_path: Path) -> None:
    paths = write_frames(tmp_path / "frames", 7)
    (tmp_path / "frames" / "notes.txt").write_text("not a frame")
    result = read(tmp_path / "frames", fps=2.0, max_pixels=300)
    assert result.fps == 2.0 and result.total_frames == 7
    assert result.indices == sample_indices(7, 2.0, 2.0, 64) == [0, 1, 2, 3, 4, 5, 6, 6]
    assert result.timestamps == [i / 2.0 for i in result.indices]
    assert all(frame.size == (20, 15) for frame in result.frames)  # 40x30 into 300 pixels
    assert_frames_show(result, 1)

    shuffled = [paths[i] for i in (3, 0, 6, 1, 5, 2, 4)]  # a list is taken in its own order
    result = read(shuffled, fps=1.0)
    assert result.indices == [0, 1, 2, 3, 4, 5, 6, 6]
    assert [COLOURS.index(tuple(np.asarray(frame)[0, 0])) for frame in result.frames] == [3, 0, 6, 1, 5, 2, 4, 4]


def test_frame_images_refused(tmp_path: Path) -> None:
    paths = write_frames(tmp_path / "frames", 4)
    with pytest.raises(BadVideo, match=r"missing fps.*video_fps"):
        read(tmp_path / "frames")
    with pytest.raises(BadVideo, match=r"missing fps"):
        read(paths)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadVideo, match=r"no frame images \(0 entries"):
        read(tmp_path / "empty", fps=2.0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(BadVideo, match=r"no frame images \(1 entries"):
        read(tmp_path / "other", fps=2.0)
    paths[2].write_bytes(b"not a png")
    with pytest.raises(BadVideo, match=r"frame_002\.png.*cannot be decoded as an image"):
        read(paths, fps=2.0)
    with pytest.raises(BadVideo, match=r"lasts 2\.0 s, over the duration limit of 1 s"):
        read(paths, fps=2.0, max_duration_s=1.0)
    with pytest.raises(BadVideo, match=r"positive frame rate"):
        read(paths, fps=0.0)


# --- hostile files --------------------------------------------------------------------------------------------------


def hostile(folder: Path) -> dict[str, tuple[Path, dict, str]]:
    """name -> (file, read_video overrides, what the message must say)."""
    good = encode(folder / "good.mp4", "mpeg4")
    # the first half of the bytes: an mp4 whose moov atom (at the end) is lost, and one with it first (faststart)
    (folder / "truncated.mp4").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    faststart = encode(folder / "faststart.mp4", "mpeg4", movflags="faststart")
    (folder / "cut_in_packet.mp4").write_bytes(faststart.read_bytes()[: faststart.stat().st_size // 2])
    (folder / "random.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    (folder / "empty.mp4").write_bytes(b"")
    # an AVI whose header declares a 32x32 mpeg4 video stream, and not one packet: zero decodable frames
    with av.open(str(folder / "no_frames.avi"), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        container.start_encoding()
    # audio only
    with av.open(str(folder / "audio.mka"), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 8000, 0, fractions.Fraction(1, 8000)
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    # a live Matroska stream: no frame count, no duration in the header; the duration check runs while counting
    encode(folder / "live.mkv", "mpeg4", fmt="matroska", live="1")
    return {
        "truncated": (folder / "truncated.mp4", {}, r"no stream can be found in it: it is truncated"),
        "cut in a packet": (folder / "cut_in_packet.mp4", {}, r"it is truncated"),
        "random bytes": (folder / "random.mp4", {}, r"cannot be decoded as a video: InvalidDataError.*not a video"),
        "empty": (folder / "empty.mp4", {}, r"the file is empty \(0 bytes\)"),
        "missing": (folder / "missing.mp4", {}, r"cannot be read \(No such file or directory\)"),
        "zero frames": (folder / "no_frames.avi", {}, r"no decodable frame"),
        "audio only": (folder / "audio.mka", {}, r"no video stream \(its streams: audio\)"),
        "resolution": (good, {"max_decode_pixels": 1000}, r"48x32 pixels \(1,536\), over the decode limit of 1,000"),
        "duration": (good, {"max_duration_s": 1.5}, r"lasts 2\.0 s, over the duration limit of 1\.5 s"),
        "duration (counted)": (folder / "live.mkv", {"max_duration_s": 1.5}, r"lasts over 1\.6 s, over the duration"),
        "timeout": (good, {"timeout_s": 1e-6}, r"longer than the time limit of 1e-06 s"),
    }


def test_hostile_files(tmp_path: Path) -> None:
    corpus = hostile(tmp_path)
    for name, (path, overrides, message) in corpus.items():
        with no_hang(20), pytest.raises(BadVideo, match=message):
            read(path, **overrides)
            pytest.fail(f"{name}: read")
    assert read(corpus["resolution"][0]).total_frames == 20  # the same file within the limits reads


@pytest.mark.parametrize("name", ["clip.mp4", "clip.webm"])
def test_deadline_between_packets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """video.py's clock runs 1 s a look (PyAV's own read timeout keeps the real one, and never fires): the deadline
    checked between packets stops the count (webm) or the decode (mp4)."""
    path = encode(tmp_path / name, "libvpx-vp9" if name.endswith("webm") else "mpeg4")
    now = itertools.count()
    monkeypatch.setattr(video, "time", SimpleNamespace(monotonic=lambda: float(next(now))))
    with no_hang(20), pytest.raises(BadVideo, match=r"longer than the time limit of 5 s"):
        read(path, timeout_s=5.0)
    assert next(now) < 10  # it stopped at the deadline, not at the end of the stream


def test_pyav_timeout_interrupts_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """video.py's clock stands still, so only PyAV's own timeout (open's `timeout=`) can stop the read."""
    path = encode(tmp_path / "clip.mp4", "mpeg4")
    monkeypatch.setattr(video, "time", SimpleNamespace(monotonic=lambda: 0.0))
    with no_hang(20), pytest.raises(BadVideo, match=r"ExitError"):
        read(path, timeout_s=1e-6)


def test_fps_fallback_for_a_stream_without_rate() -> None:
    """No PyAV stream here lacks a rate, so the probe gets a stand-in container whose stream has none."""
    stream = SimpleNamespace(
        average_rate=None, guessed_rate=None, base_rate=None, codec_context=SimpleNamespace(width=32, height=32),
        frames=10, duration=None, time_base=None,
    )  # fmt: skip
    container = SimpleNamespace(streams=SimpleNamespace(video=[stream]), duration=None)
    limits = video._Limits(2.0, 64, 10_000, 1_000_000, 60.0, 30.0, deadline=float("inf"))
    with pytest.raises(
        BadVideo, match=r'missing fps: its video stream has no frame rate.*"fps", or the record\'s "video_fps"'
    ):
        video._probe(av, container, None, limits)
    assert video._probe(av, container, 5.0, limits) == (5.0, 10)
    stream.average_rate, stream.guessed_rate = fractions.Fraction(30000, 1001), fractions.Fraction(25)
    assert video._probe(av, container, 5.0, limits) == (30000 / 1001, 10)


def test_pyav_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = encode(tmp_path / "clip.mp4", "mpeg4", frames=2)
    write_frames(tmp_path / "frames", 2)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    with pytest.raises(UserError, match=r'pip install "glm45v-fsdp\[video\]".*on_bad_record=skip does not apply'):
        read(path)
    assert read(tmp_path / "frames", fps=1.0).total_frames == 2  # frame images need no PyAV
