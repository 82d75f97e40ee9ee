"""Image-video-text SFT data sets: built-in synthetic scenes, or LLaVA / ShareGPT records from a .json or .jsonl file
(or, in hf_datasets.py, from a Hugging Face data set: both share `RecordDataset`'s check of every record).

`__getitem__(i)` loads, tokenises and lays out ONE sample lazily (so data workers do it) and returns tensors:
input_ids [L], labels [L], mm_token_type_ids [L] (int32, 1 on an image's <|image|>, 2 on a video's),
position_ids [3, L] (3-D rope positions), pixel_values [patches, D] and image_grid_thw [n_images, 3] (absent without
images), pixel_values_videos [patches, D] and video_grid_thw [n_videos, 3] (absent without videos), num_valid_tokens
(0-d: labels[1:] that are supervised).

Truncation to data.cutoff_len never cuts an image or a video block: when the cut falls inside a block
(<|begin_of_image|> to <|end_of_image|>, <|begin_of_video|> to <|end_of_video|>), the sample ends just before the
block, and that image or video and every later one are dropped. A sample left without any supervised token is a
UserError.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data.images import BadImage, load_image
from glm45v_fsdp.data.processor import image_token_counts, process_images, video_processor_for
from glm45v_fsdp.data.template import (
    IMAGE_TAG,
    VIDEO_TAG,
    VideoTokens,
    encode_conversation,
    mm_token_types,
    mrope_position_ids,
)
from glm45v_fsdp.data.video import BadVideo, SampledVideo, read_video
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger
from glm45v_fsdp.runtime.dist import gather_objects, rank_and_world
from glm45v_fsdp.vocab import supervised_token_count

RESERVED_TOKENS = (
    "<|image|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|video|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class ImageTextDataset(Dataset):
    """Shared encoding of one (messages, images, videos) sample; subclasses provide `__len__`, `conversation`,
    `describe`."""

    skipped_records = 0  # bad records left out of the data set (data.on_bad_record=skip)

    def __init__(self, tokenizer, image_processor, cutoff_len: int, spatial_merge_size: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor_for(image_processor)
        self.cutoff_len = cutoff_len
        self.spatial_merge_size = spatial_merge_size
        self.token_ids = {
            name: tokenizer.convert_tokens_to_ids(name)
            for name in ("<|image|>", "<|begin_of_video|>", "<|end_of_video|>")
        }

    def conversation(self, index: int) -> tuple[list[dict], list[Image.Image], list[SampledVideo]]:
        raise NotImplementedError

    def describe(self, index: int) -> str:
        raise NotImplementedError

    def summary(self) -> str:
        """What data this is, for the start-up log: kind, source, number of records."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.encode(index, *self.conversation(index))

    def encode(
        self, index: int, messages: list[dict], images: list[Image.Image], videos: list[SampledVideo]
    ) -> dict[str, torch.Tensor]:
        """The sample of `conversation(index)`'s result (`index` only names it in messages)."""
        pixel_values, grid, counts = None, None, []
        if images:
            try:
                pixel_values, grid = process_images(self.image_processor, images)
            except ValueError as error:
                raise UserError(
                    f"{self.describe(index)}: an image cannot be processed: {error}. Resize or replace it."
                ) from None
            counts = image_token_counts(grid, self.spatial_merge_size)
        video_pixels, video_grids, video_tokens = self._videos(index, videos)
        input_ids, labels = encode_conversation(messages, self.tokenizer, counts, video_tokens)
        input_ids, labels = torch.tensor(input_ids), torch.tensor(labels)
        ids = self.token_ids
        mm_token_type_ids = mm_token_types(
            input_ids, ids["<|image|>"], ids["<|begin_of_video|>"], ids["<|end_of_video|>"]
        )
        expected = sum(counts) + sum(v.tokens_per_patch * len(v.timestamps) for v in video_tokens)
        assert int((mm_token_type_ids > 0).sum()) == expected, "text holds reserved image tokens"
        length, kept_images, kept_videos = _cut_point(input_ids, mm_token_type_ids, self.cutoff_len, ids)
        num_valid = int(supervised_token_count(labels[:length]))
        if num_valid == 0:
            raise UserError(
                f"{self.describe(index)} has no supervised token left after truncation to data.cutoff_len="
                f"{self.cutoff_len} (it is {len(input_ids)} tokens long, image and video tokens included; an image "
                f"or video block is never cut). Raise data.cutoff_len, or shorten or drop this sample."
            )
        sample = {
            "input_ids": input_ids[:length],
            "labels": labels[:length],
            "mm_token_type_ids": mm_token_type_ids[:length],
            "num_valid_tokens": torch.tensor(num_valid),
        }
        if kept_images:
            grid = grid[:kept_images]
            sample["pixel_values"] = pixel_values[: int(grid.prod(-1).sum())]
            sample["image_grid_thw"] = grid
        if kept_videos:
            sample["pixel_values_videos"] = torch.cat(video_pixels[:kept_videos])
            sample["video_grid_thw"] = torch.cat(video_grids[:kept_videos])
        sample["position_ids"] = mrope_position_ids(
            sample["mm_token_type_ids"],
            sample.get("image_grid_thw"),
            self.spatial_merge_size,
            sample.get("video_grid_thw"),
        )
        return sample

    def _videos(
        self, index: int, videos: list[SampledVideo]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[VideoTokens]]:
        """Each video's patches, (t, h, w) grid and block contents (tokens per temporal patch, each patch's timestamp:
        its first frame's, as Glm4vProcessor takes every other frame's)."""
        pixels, grids, tokens = [], [], []
        for number, video in enumerate(videos):
            try:
                patches, grid = self.video_processor(video.frames)
            except ValueError as error:
                raise UserError(
                    f"{self.describe(index)}: video {number} cannot be processed: {error}. Resize or replace it."
                ) from None
            t, h, w = grid[0].tolist()
            pixels.append(patches)
            grids.append(grid)
            tokens.append(VideoTokens(h * w // self.spatial_merge_size**2, video.timestamps[::2][:t]))
        return pixels, grids, tokens


def _cut_point(
    input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, cutoff_len: int, token_ids: dict[str, int]
) -> tuple[int, int, int]:
    """(length to keep, images kept, videos kept): at most cutoff_len tokens, never inside an image or video block
    (a block that does not end before the cut goes, with every later one)."""
    length = min(len(input_ids), cutoff_len)
    starts = (input_ids == token_ids["<|begin_of_video|>"]).nonzero().flatten().tolist()
    ends = (input_ids == token_ids["<|end_of_video|>"]).nonzero().flatten().tolist()
    blocks = [(start, end, "video") for start, end in zip(starts, ends)]
    position = 0
    for modality, group in itertools.groupby(mm_token_type_ids.tolist()):
        size = len(list(group))
        if modality == 1:  # <|begin_of_image|> just before the run, <|end_of_image|> just after
            blocks.append((position - 1, position + size, "image"))
        position += size
    kept = {"image": 0, "video": 0}
    for first, last, kind in sorted(blocks):
        if last >= length:
            return min(length, first), kept["image"], kept["video"]
        kept[kind] += 1
    return length, kept["image"], kept["video"]


# --------------------------------------------------------------------------------------------------------------
# Synthetic
# --------------------------------------------------------------------------------------------------------------

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 40),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
    "purple": (140, 50, 170),
    "orange": (250, 140, 20),
}
SHAPES = ("circle", "square", "triangle")
PLACES = ("top left", "top right", "bottom left", "bottom right", "center")
QUESTIONS = ("What is in the image?", "Describe the picture.", "What do you see?", "What shape is shown?")


def _scene(rng: random.Random) -> dict[str, str]:
    background, color = rng.sample(sorted(COLORS), 2)
    return {"background": background, "color": color, "shape": rng.choice(SHAPES), "place": rng.choice(PLACES)}


def _draw(scene: dict[str, str], size: int) -> Image.Image:
    image = Image.new("RGB", (size, size), COLORS[scene["background"]])
    half = size // 2
    row = {"top": 0, "bottom": half, "center": size // 4}[scene["place"].split()[0]]
    col = {"left": 0, "right": half}.get(scene["place"].split()[-1], size // 4)
    margin = max(1, size // 16)
    box = (col + margin, row + margin, col + half - margin, row + half - margin)
    draw = ImageDraw.Draw(image)
    fill = COLORS[scene["color"]]
    if scene["shape"] == "circle":
        draw.ellipse(box, fill=fill)
    elif scene["shape"] == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((box[0] + box[2]) // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    return image


def _sentence(scene: dict[str, str], number: int | None) -> str:
    head = f"Image {number}: a" if number is not None else "A"
    return f"{head} {scene['color']} {scene['shape']} on a {scene['background']} background, {scene['place']}."


SYNTHETIC_VIDEO_FPS = 2.0


def _synthetic_video(rng: random.Random, frames: int, size: int) -> tuple[SampledVideo, str]:
    """A shape moving over `frames` frames at 2 fps (an odd count gets its last frame repeated), and its description."""
    scene = _scene(rng)
    start = PLACES.index(scene["place"])
    places = [PLACES[(start + i) % len(PLACES)] for i in range(frames)]
    images = [_draw({**scene, "place": place}, size) for place in places]
    indices = list(range(frames)) + ([frames - 1] if frames % 2 else [])
    video = SampledVideo(
        frames=[images[i] for i in indices],
        timestamps=[i / SYNTHETIC_VIDEO_FPS for i in indices],
        fps=SYNTHETIC_VIDEO_FPS,
        total_frames=frames,
        indices=indices,
    )
    motion = f"moves from the {places[0]} to the {places[-1]}" if frames > 1 else f"stays at the {places[0]}"
    text = f"Video: a {scene['color']} {scene['shape']} on a {scene['background']} background {motion}."
    return video, text


class SyntheticImageTextDataset(ImageTextDataset):
    """Sample i: `images_per_sample` pictures of a coloured shape on a coloured background (drawn from a generator
    seeded with i, so identical in every process and run), a question, and an answer describing every picture that is
    repeated up to about `text_tokens` question + answer tokens (never shorter than one full description)."""

    def __init__(
        self,
        num_samples: int,
        images_per_sample: int,
        image_size: int,
        text_tokens: int,
        tokenizer,
        image_processor,
        cutoff_len: int,
        spatial_merge_size: int,
        video_every: int = 0,
        video_frames: int = 4,
    ):
        super().__init__(tokenizer, image_processor, cutoff_len, spatial_merge_size)
        self.num_samples = num_samples
        self.images_per_sample = images_per_sample
        self.image_size = image_size
        self.text_tokens = text_tokens
        self.video_every = video_every
        self.video_frames = video_frames

    def has_video(self, index: int) -> bool:
        return self.video_every > 0 and index % self.video_every == self.video_every - 1

    def __len__(self) -> int:
        return self.num_samples

    def describe(self, index: int) -> str:
        return f"Synthetic sample {index}"

    def summary(self) -> str:
        videos = sum(map(self.has_video, range(self.num_samples)))
        video = f", {videos} of them also with a {self.video_frames}-frame video" if videos else ""
        return (
            f"built-in synthetic image-text set (data.dataset=synthetic, no file), {self.num_samples} samples of "
            f"{self.images_per_sample} image(s) {self.image_size}x{self.image_size} px and ~{self.text_tokens} text "
            f"tokens{video}, cutoff {self.cutoff_len}"
        )

    def conversation(self, index: int) -> tuple[list[dict], list[Image.Image], list[SampledVideo]]:
        rng = random.Random(index)
        scenes = [_scene(rng) for _ in range(self.images_per_sample)]
        question = rng.choice(QUESTIONS)
        numbered = len(scenes) > 1
        description = " ".join(_sentence(s, i + 1 if numbered else None) for i, s in enumerate(scenes))
        videos = []
        if self.has_video(index):
            video, video_text = _synthetic_video(rng, self.video_frames, self.image_size)
            videos.append(video)
            description = f"{description} {video_text}".strip()
        description = description or "There is no image, so there is nothing to describe."
        answer_ids = self.tokenizer.encode(description, add_special_tokens=False)
        question_tokens = len(self.tokenizer.encode("\n" + question, add_special_tokens=False))
        budget = max(len(answer_ids), self.text_tokens - question_tokens)
        answer = description
        while len(answer_ids) < budget:
            answer += " " + description
            answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        tags = IMAGE_TAG * len(scenes) + VIDEO_TAG * len(videos)
        messages = [
            {"role": "user", "content": tags + ("\n" if tags else "") + question},
            {"role": "assistant", "content": self.tokenizer.decode(answer_ids[:budget])},
        ]
        return messages, [_draw(scene, self.image_size) for scene in scenes], videos


# --------------------------------------------------------------------------------------------------------------
# JSON / JSONL
# --------------------------------------------------------------------------------------------------------------


class _RecordError(Exception):
    """A problem of one record (a JSON record, a data set row); the data set adds its index and source."""


def _read_json_records(path: Path) -> list:
    """The records of a .json list or a .jsonl file. A .jsonl line that is not UTF-8 or not JSON becomes a
    _RecordError in its place (a bad record, which data.on_bad_record may skip); a .json file that cannot be parsed
    is a UserError (no record can be told from another)."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(
            f"Data file '{path}' (data.data_path) cannot be read: {error}. Make it a readable UTF-8 .json or .jsonl "
            f"file, or point data.data_path at one."
        ) from None
    if not raw.strip():
        raise UserError(
            f"Data file '{path}' (data.data_path) is empty ({len(raw)} bytes). Write records into it, or point "
            f"data.data_path at the file that holds them."
        )
    if path.suffix == ".jsonl":
        records: list = []
        for line_number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line.decode("utf-8")))
            except UnicodeDecodeError as error:
                records.append(
                    _RecordError(
                        f"line {line_number} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); re-encode the file as UTF-8"
                    )
                )
            except json.JSONDecodeError as error:
                records.append(
                    _RecordError(
                        f"line {line_number} is not valid JSON ({error}); each line of a "
                        f".jsonl file must be one JSON record"
                    )
                )
        return records
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"Data file '{path}' (data.data_path) is not UTF-8 text ({error.reason} at byte {error.start}), so no "
            f"record can be read from it (data.on_bad_record cannot skip part of a .json file). Re-encode it as "
            f"UTF-8, or write it as .jsonl, where a bad line is one bad record."
        ) from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"Data file '{path}' (data.data_path) is not valid JSON: {error}. A .json data file must "
            f"hold a list of records; use the .jsonl suffix for one record per line."
        ) from None
    if not isinstance(records, list):
        raise UserError(
            f"Data file '{path}' (data.data_path) holds a {type(records).__name__}, not a list of "
            f"records. Wrap the records in a JSON list, or write one record per line to a .jsonl file."
        )
    return records


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
        raise _RecordError(f"its images are {images!r}; give 'image' or 'images' as a path or a list of paths")
    return [root / name for name in images]


def _parse_record(
    record, image_root: Path, images_of: Callable[[dict, Path], list] = _image_paths
) -> tuple[list[dict], list, list[VideoSource]]:
    """Normalised (messages, images, videos) of one record (a JSON record, a data set row: its turns under
    "conversations" or "messages", its "images", "videos", "video_fps"); a _RecordError's message names the problem and
    the fix. `images_of(record, image_root)` gives the record's image entries (a JSON record's are paths); those that
    are paths must exist."""
    if isinstance(record, _RecordError):  # a .jsonl line that could not be read
        raise record
    if not isinstance(record, dict):
        raise _RecordError(f"it is a {type(record).__name__}, not an object with 'conversations' or 'messages'")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise _RecordError(
            "it needs a non-empty list under 'conversations' (LLaVA: from/value turns) or 'messages' "
            "(ShareGPT: role/content turns)"
        )
    messages = []
    for turn_index, turn in enumerate(turns):
        role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if role not in ROLE_ALIASES or not isinstance(content, str):
            raise _RecordError(
                f"turn {turn_index} is {turn!r}; each turn needs 'from' (human/gpt/system) and a string "
                f"'value', or 'role' (user/assistant/system) and a string 'content'"
            )
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[0] == "system" else roles
    if not body or body != ["user", "assistant"] * (len(body) // 2):
        raise _RecordError(
            f"its roles are {roles}; after an optional first system turn, user and assistant turns must "
            f"alternate, starting with user and ending with assistant"
        )
    for turn_index, message in enumerate(messages):
        for tag in (IMAGE_TAG, VIDEO_TAG):
            if message["role"] != "user" and tag in message["content"]:
                raise _RecordError(
                    f"turn {turn_index} ({message['role']}) holds '{tag}'; images and videos go in user turns"
                )
        if message["role"] == "assistant" and not message["content"].strip():
            raise _RecordError(f"turn {turn_index} (assistant) is empty; give it an answer or drop the record")
        reserved = [token for token in RESERVED_TOKENS if token in message["content"]]
        if reserved:
            raise _RecordError(
                f"turn {turn_index} holds the reserved token(s) {reserved}; write '{IMAGE_TAG}' where an image "
                f"goes and '{VIDEO_TAG}' where a video goes"
            )
    images = images_of(record, image_root)
    n_tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    if n_tags != len(images):
        raise _RecordError(
            f"it has {n_tags} '{IMAGE_TAG}' tag(s) but {len(images)} image(s); put one '{IMAGE_TAG}' "
            f"in the user turns for each image, in order"
        )
    for path in images:
        if isinstance(path, Path) and not path.is_file():
            raise _RecordError(
                f"its image '{path}' does not exist; fix the path (relative to data.image_root, default "
                f"the data file's directory) or drop the record"
            )
    videos = _parse_videos(record, image_root)
    n_tags = sum(m["content"].count(VIDEO_TAG) for m in messages)
    if n_tags != len(videos):
        raise _RecordError(
            f"it has {n_tags} '{VIDEO_TAG}' tag(s) but {len(videos)} video(s); put one '{VIDEO_TAG}' in the user "
            f"turns for each video, in order"
        )
    return messages, images, videos


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
        raise _RecordError(f"its videos are {videos!r} (video_fps {record_fps!r}); {usage}")
    sources = []
    for entry in videos:
        fps = record_fps
        if isinstance(entry, dict):
            fps = entry.get("fps", record_fps)
            entry = entry.get("path", entry.get("frames"))
            if fps is not None and not _positive_number(fps):
                raise _RecordError(f"a video's fps is {fps!r}, not a positive number; {usage}")
        if isinstance(entry, str):
            path: Path | list[Path] = root / entry
            exists = path.exists()
        elif isinstance(entry, list) and entry and all(isinstance(name, str) for name in entry):
            path = [root / name for name in entry]
            exists = all(frame.is_file() for frame in path)
        else:
            raise _RecordError(f"a video entry is {entry!r}; {usage}")
        if not exists:
            raise _RecordError(
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

    A subclass sets `data_path` and `image_root`, provides `_record` (the parsed record at an index of the source),
    `_record_name`, `_source` and `_summary_head`, and ends its `__init__` with `_check`; `unit` names a record.
    """

    unit = "record"

    def __init__(
        self,
        tokenizer,
        image_processor,
        cutoff_len: int,
        spatial_merge_size: int,
        max_image_pixels: int = 89_478_485,
        video: DataConfig | None = None,
    ):
        super().__init__(tokenizer, image_processor, cutoff_len, spatial_merge_size)
        self.video = video or DataConfig()  # its video_* keys
        self.max_pixels = int(image_processor.size["longest_edge"])
        self.max_image_pixels = max_image_pixels
        self.data_path: Path = Path()
        self.image_root: Path = Path()
        self.total_records = 0
        self.indices: Sequence[int] = range(0)  # position in the data set -> index in the source
        self.image_count = self.video_count = 0  # of the good records

    def _record(self, index: int) -> tuple[list[dict], list, list[VideoSource]]:
        """(messages, image entries, videos) of the record at `index` of the source; a _RecordError when it is bad."""
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
            except _RecordError as error:
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


class JsonImageTextDataset(RecordDataset):
    """Records of a .json list or a .jsonl file, every one checked when the data set is built (RecordDataset); all are
    parsed at once (the file is read whole), encoded a rank's share at a time."""

    def __init__(
        self,
        data_path: str,
        image_root: str | None,
        tokenizer,
        image_processor,
        cutoff_len: int,
        spatial_merge_size: int,
        on_bad_record: str = "stop",
        max_image_pixels: int = 89_478_485,
        video: DataConfig | None = None,
    ):
        super().__init__(tokenizer, image_processor, cutoff_len, spatial_merge_size, max_image_pixels, video)
        self.data_path = Path(data_path)
        if not self.data_path.is_file():
            raise UserError(
                f"Config key 'data.data_path' = '{data_path}' is not a file. Point it at a .json (list of "
                f"records) or .jsonl (one record per line) file."
            )
        self.image_root = check_image_root(image_root, self.data_path.parent)
        # each record of the file: (messages, image paths, videos), or the _RecordError that says why it is bad
        self.records: list[tuple[list[dict], list[Path], list[VideoSource]] | _RecordError] = []
        for record in _read_json_records(self.data_path):
            try:
                self.records.append(_parse_record(record, self.image_root))
            except _RecordError as error:
                self.records.append(error)
        self._check(len(self.records), on_bad_record)

    def _record(self, index: int) -> tuple[list[dict], list[Path], list[VideoSource]]:
        record = self.records[index]
        if isinstance(record, _RecordError):
            raise record
        return record

    def _record_name(self, index: int) -> str:
        return f"Record {index} (0-based) of data file '{self.data_path}'"

    def _source(self) -> str:
        return f"Data file '{self.data_path}'"

    def _summary_head(self) -> str:
        return f"JSON file '{self.data_path.resolve()}' (data.dataset=json)"


def build_dataset(data_cfg: DataConfig, hf_config, tokenizer, image_processor) -> Dataset:
    """The data set of `data_cfg.dataset`, after checking that tokenizer and model agree on the image and video token
    ids."""
    for key, token in (
        ("image_token_id", "<|image|>"),
        ("image_start_token_id", "<|begin_of_image|>"),
        ("image_end_token_id", "<|end_of_image|>"),
        ("video_start_token_id", "<|begin_of_video|>"),
        ("video_end_token_id", "<|end_of_video|>"),
    ):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id != getattr(hf_config, key):
            raise UserError(
                f"The tokenizer maps '{token}' to id {token_id} but the model config has {key}="
                f"{getattr(hf_config, key)}. Use the tokenizer that belongs to the model (model.name_or_path), or "
                f"fix {key} with model.config_overrides."
            )
    merge = hf_config.vision_config.spatial_merge_size
    if data_cfg.dataset == "synthetic":
        return SyntheticImageTextDataset(
            data_cfg.synthetic_samples,
            data_cfg.synthetic_images_per_sample,
            data_cfg.synthetic_image_size,
            data_cfg.synthetic_text_tokens,
            tokenizer,
            image_processor,
            data_cfg.cutoff_len,
            merge,
            video_every=data_cfg.synthetic_video_every,
            video_frames=data_cfg.synthetic_video_frames,
        )
    reader, extra = JsonImageTextDataset, {}
    if data_cfg.dataset == "hf":
        from glm45v_fsdp.data.hf_datasets import HfImageTextDataset  # imports this module

        reader, extra = HfImageTextDataset, {"split": data_cfg.hf_split}
    return reader(
        data_cfg.data_path,
        data_cfg.image_root,
        tokenizer,
        image_processor,
        data_cfg.cutoff_len,
        merge,
        on_bad_record=data_cfg.on_bad_record,
        max_image_pixels=data_cfg.max_image_pixels,
        video=data_cfg,
        **extra,
    )
