"""Records read from a file or a table (a JSON record, a Hugging Face data set row), every one checked when the data
set is built: a record's structure (`parse_record`: its turns, image and video entries) and `RecordDataset`, the base
the two readers share (datasets.py's JSON reader, hf_datasets.py's Hugging Face reader).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data.encode import ImageTextDataset
from glm45v_fsdp.data.images import BadImage, load_image
from glm45v_fsdp.data.template import IMAGE_TAG, VIDEO_TAG
from glm45v_fsdp.data.video import BadVideo, SampledVideo, read_video
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime.dist import gather_objects, rank_and_world

RESERVED_TOKENS = (
    "<|image|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|video|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class RecordError(Exception):
    """A problem of one record (a JSON record, a data set row); the data set adds its index and source."""


@dataclass(frozen=True)
class VideoSource:
    """Where a record's video is: a file, or its frame images (a folder or a list of files, in order) with their
    fps (the entry's "fps", else the record's "video_fps"; a file's own rate wins over both)."""

    path: Path | list[Path]
    fps: float | None


def _image_paths(record: dict, root: Path) -> list[Path]:
    """A JSON record's "images" (or "image"): a path or a list of paths, relative to `root`."""
    images = record.get("images", record.get("image"))
    images = [] if images is None else [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(name, str) for name in images):
        raise RecordError(f"its images are {images!r}; give 'image' or 'images' as a path or a list of paths")
    return [root / name for name in images]


def parse_record(
    record, image_root: Path, images_of: Callable[[dict, Path], list] = _image_paths
) -> tuple[list[dict], list, list[VideoSource]]:
    """Normalised (messages, images, videos) of one record (a JSON record, a data set row: its turns under
    "conversations" or "messages", its "images", "videos", "video_fps"); a RecordError's message names the problem and
    the fix. `images_of(record, image_root)` gives the record's image entries (a JSON record's are paths); those that
    are paths must exist."""
    if isinstance(record, RecordError):  # a .jsonl line that could not be read
        raise record
    if not isinstance(record, dict):
        raise RecordError(f"it is a {type(record).__name__}, not an object with 'conversations' or 'messages'")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise RecordError(
            "it needs a non-empty list under 'conversations' (LLaVA: from/value turns) or 'messages' "
            "(ShareGPT: role/content turns)"
        )
    messages = []
    for turn_index, turn in enumerate(turns):
        role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if role not in ROLE_ALIASES or not isinstance(content, str):
            raise RecordError(
                f"turn {turn_index} is {turn!r}; each turn needs 'from' (human/gpt/system) and a string "
                f"'value', or 'role' (user/assistant/system) and a string 'content'"
            )
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[0] == "system" else roles
    if not body or body != ["user", "assistant"] * (len(body) // 2):
        raise RecordError(
            f"its roles are {roles}; after an optional first system turn, user and assistant turns must "
            f"alternate, starting with user and ending with assistant"
        )
    for turn_index, message in enumerate(messages):
        for tag in (IMAGE_TAG, VIDEO_TAG):
            if message["role"] != "user" and tag in message["content"]:
                raise RecordError(
                    f"turn {turn_index} ({message['role']}) holds '{tag}'; images and videos go in user turns"
                )
        if message["role"] == "assistant" and not message["content"].strip():
            raise RecordError(f"turn {turn_index} (assistant) is empty; give it an answer or drop the record")
        reserved = [token for token in RESERVED_TOKENS if token in message["content"]]
        if reserved:
            raise RecordError(
                f"turn {turn_index} holds the reserved token(s) {reserved}; write '{IMAGE_TAG}' where an image "
                f"goes and '{VIDEO_TAG}' where a video goes"
            )
    images = images_of(record, image_root)
    _check_tags(messages, IMAGE_TAG, len(images), "image")
    for path in images:
        if isinstance(path, Path) and not path.is_file():
            raise RecordError(
                f"its image '{path}' does not exist; fix the path (relative to data.image_root, default "
                f"the data file's directory) or drop the record"
            )
    videos = _parse_videos(record, image_root)
    _check_tags(messages, VIDEO_TAG, len(videos), "video")
    return messages, images, videos


def _check_tags(messages: list[dict], tag: str, count: int, kind: str) -> None:
    """One `tag` in the messages for each of the record's `count` images or videos (`kind`)."""
    n_tags = sum(m["content"].count(tag) for m in messages)
    if n_tags != count:
        raise RecordError(
            f"it has {n_tags} '{tag}' tag(s) but {count} {kind}(s); put one '{tag}' in the user turns for each "
            f"{kind}, in order"
        )


def _parse_videos(record: dict, root: Path) -> list[VideoSource]:
    """The record's "videos" (or "video"): each a path (a video file or a folder of frame images), a list of frame
    image paths, or an object {"path" | "frames", "fps"}; paths relative to `root`."""
    videos = record.get("videos", record.get("video"))
    videos = [] if videos is None else [videos] if isinstance(videos, (str, dict)) else videos
    record_fps = record.get("video_fps")
    usage = (
        "give 'videos' as a list whose entries are a path (a video file or a folder of frame images), a list of "
        'frame image paths, or {"path" or "frames": ..., "fps": number}'
    )
    if not isinstance(videos, list) or (record_fps is not None and not _positive_number(record_fps)):
        raise RecordError(f"its videos are {videos!r} (video_fps {record_fps!r}); {usage}")
    sources = []
    for entry in videos:
        fps = record_fps
        if isinstance(entry, dict):
            fps = entry.get("fps", record_fps)
            entry = entry.get("path", entry.get("frames"))
            if fps is not None and not _positive_number(fps):
                raise RecordError(f"a video's fps is {fps!r}, not a positive number; {usage}")
        if isinstance(entry, str):
            path: Path | list[Path] = root / entry
            exists = path.exists()
        elif isinstance(entry, list) and entry and all(isinstance(name, str) for name in entry):
            path = [root / name for name in entry]
            exists = all(frame.is_file() for frame in path)
        else:
            raise RecordError(f"a video entry is {entry!r}; {usage}")
        if not exists:
            raise RecordError(
                f"its video '{entry}' does not exist under '{root}'; fix the path (relative to data.image_root, "
                f"default the data file's directory) or drop the record"
            )
        sources.append(VideoSource(path, None if fps is None else float(fps)))
    return sources


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


class RecordDataset(ImageTextDataset):
    """Records read from data.data_path (a JSON file, a Hugging Face data set), every one checked when the data set is
    built.

    The check is the full encoding of each record (structure, images read and processed, videos read, tokenised,
    truncated), split over the ranks of the default process group (rank r checks records r, r + world, ...) and
    gathered, so every rank knows every bad record before step 1 and no rank reads them all. `on_bad_record="stop"`
    raises a UserError naming the first bad record (its 0-based index in the source, the source, the problem) and how
    many there are; `"skip"` trains on the good records only, logs each bad one and keeps their count in
    `skipped_records`. Record indices in messages are always those of the source.

    The data keys come from `data` (data.data_path, data.image_root, data.cutoff_len, data.on_bad_record,
    data.max_image_pixels, the data.video_* keys, and what a reader reads besides). A subclass provides `_open` (reads
    the source, sets `image_root`, returns the number of records), `_record` (the parsed record at an index of the
    source), `_record_name`, `_source` and `_summary_head`; `unit` names a record.
    """

    unit = "record"

    def __init__(self, data: DataConfig, tokenizer, image_processor, spatial_merge_size: int):
        super().__init__(tokenizer, image_processor, data.cutoff_len, spatial_merge_size)
        self.video = data  # its video_* keys
        self.max_pixels = int(image_processor.size["longest_edge"])
        self.max_image_pixels = data.max_image_pixels
        self.data_path = Path(data.data_path or "")
        self.image_root: Path = Path()
        self.total_records = 0
        self.indices: Sequence[int] = range(0)  # position in the data set -> index in the source
        self.image_count = self.video_count = 0  # of the good records
        self._check(self._open(data), data.on_bad_record)

    def _open(self, data: DataConfig) -> int:
        """Reads the source at `data_path` and sets `image_root`; the number of records in the source."""
        raise NotImplementedError

    def _record(self, index: int) -> tuple[list[dict], list, list[VideoSource]]:
        """(messages, image entries, videos) of the record at `index` of the source; a RecordError when it is bad."""
        raise NotImplementedError

    def _record_name(self, index: int) -> str:
        raise NotImplementedError

    def _source(self) -> str:
        """The source, capitalised, for messages: "Data file '...'"."""
        raise NotImplementedError

    def _summary_head(self) -> str:
        raise NotImplementedError

    def _open_image(self, entry) -> Image.Image:
        """The image of one entry of `_record`'s image entries (a path here); BadImage when it cannot be used."""
        return load_image(entry, self.max_pixels, self.max_image_pixels)

    def _check(self, total: int, on_bad_record: str) -> None:
        """Encodes this rank's share of the `total` records, gathers every rank's findings, then stops or skips."""
        self.total_records = total
        self.indices = range(total)
        rank, world = rank_and_world()
        found: dict[int, str] = {}
        images = videos = 0
        start = time.perf_counter()
        mine = range(rank, total, world)
        for index in mine:
            try:
                messages, loaded, read = self.conversation(index)
                self.encode(index, messages, loaded, read)
            except RecordError as error:
                found[index] = f"{self._record_name(index)} is invalid: {error}."
            except UserError as error:
                found[index] = str(error)
            else:
                images, videos = images + len(loaded), videos + len(read)
        get_logger().info(
            "data: checked %d of %d %ss by encoding them (every %d-th on this rank) in %.2f s",
            len(mine),
            total,
            self.unit,
            world,
            time.perf_counter() - start,
        )
        problems: dict[int, str] = {}
        for part, part_images, part_videos in gather_objects((found, images, videos)):
            problems.update(part)
            self.image_count += part_images
            self.video_count += part_videos
        self.skipped_records = len(problems)
        self._apply(on_bad_record, problems)

    def _apply(self, on_bad_record: str, problems: dict[int, str]) -> None:
        if not problems:
            return
        first = problems[min(problems)]
        unit = self.unit
        if on_bad_record == "stop":
            raise UserError(
                f"{self._source()} (data.data_path) has {len(problems)} bad {unit}(s) of {self.total_records}, found "
                f"before step 1. The first: {first} Fix or drop the bad {unit}s, or set data.on_bad_record=skip to "
                f"train without them (each is then logged)."
            )
        self.indices = array("q", (index for index in range(self.total_records) if index not in problems))  # compact
        log = get_logger()
        for index in sorted(problems):
            log.warning("data: skipping (data.on_bad_record=skip): %s", problems[index])
        log.warning(
            "data: skipped %d bad %s(s) of %d in '%s' (data.on_bad_record=skip); training on %d",
            len(problems),
            unit,
            self.total_records,
            self.data_path,
            len(self.indices),
        )
        if not self.indices:
            raise UserError(
                f"Every {unit} of {self._source()} (data.data_path) is bad ({len(problems)} of {self.total_records}), "
                f"so nothing is left to train on with data.on_bad_record=skip. The first: {first}"
            )

    def __len__(self) -> int:
        return len(self.indices)

    def describe(self, position: int) -> str:
        return self._record_name(self.indices[position])

    def summary(self) -> str:
        skipped = f", {self.skipped_records} bad {self.unit}(s) skipped" if self.skipped_records else ""
        sampling = (
            f" (sampled at {self.video.video_fps:g} fps, at most {self.video.video_max_frames} frames of at most "
            f"{self.video.video_max_pixels} pixels each)"
            if self.video_count
            else ""
        )
        return (
            f"{self._summary_head()}, {len(self)} {self.unit}s with {self.image_count} image(s) and "
            f"{self.video_count} video(s){sampling} under '{self.image_root.resolve()}'{skipped}, cutoff "
            f"{self.cutoff_len}"
        )

    def conversation(self, position: int) -> tuple[list[dict], list[Image.Image], list[SampledVideo]]:
        index = self.indices[position]
        messages, entries, sources = self._record(index)
        images = []
        for entry in entries:
            try:
                images.append(self._open_image(entry))
            except BadImage as error:
                raise UserError(
                    f"{self._record_name(index)}: image '{entry}' cannot be used: {error}. Replace it or drop the "
                    f"{self.unit}."
                ) from None
        return messages, images, [self._read_video(index, source) for source in sources]

    def _read_video(self, index: int, source: VideoSource) -> SampledVideo:
        v = self.video
        try:
            return read_video(
                source.path,
                fps=source.fps,
                target_fps=v.video_fps,
                max_frames=v.video_max_frames,
                max_pixels=v.video_max_pixels,
                max_decode_pixels=self.max_image_pixels,
                max_duration_s=v.video_max_seconds,
                timeout_s=v.video_decode_timeout_s,
            )
        except BadVideo as error:
            name = source.path if isinstance(source.path, Path) else f"{source.path[0]} ... ({len(source.path)} frames)"
            raise UserError(
                f"{self._record_name(index)}: video '{name}' cannot be used: {error}. Replace it or drop the "
                f"{self.unit}."
            ) from None


def check_image_root(image_root: str | None, default: Path) -> Path:
    """data.image_root as a directory (`default` when unset); a UserError when it is not one."""
    root = Path(image_root) if image_root is not None else default
    if not root.is_dir():
        raise UserError(
            f"Config key 'data.image_root' = '{image_root}' is not a directory. Point it at the "
            f"directory the records' image and video paths are relative to, or set it to null."
        )
    return root
