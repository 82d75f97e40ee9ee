"""Image-video-text SFT data sets: built-in synthetic scenes, or LLaVA / ShareGPT records from a .json or .jsonl file
(or, in hf_datasets.py, from a Hugging Face data set: both readers share records.py's `RecordDataset`, which checks
every record), and `build_dataset`, which picks one by data.dataset. Every sample is encoded as encode.py describes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data.encode import ImageTextDataset
from glm45v_fsdp.data.hf_datasets import HfImageTextDataset
from glm45v_fsdp.data.records import RecordDataset, RecordError, VideoSource, check_image_root, parse_record
from glm45v_fsdp.data.template import IMAGE_TAG, VIDEO_TAG
from glm45v_fsdp.data.video import SampledVideo
from glm45v_fsdp.errors import UserError

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


def _read_json_records(path: Path) -> list:
    """The records of a .json list or a .jsonl file. A .jsonl line that is not UTF-8 or not JSON becomes a
    RecordError in its place (a bad record, which data.on_bad_record may skip); a .json file that cannot be parsed
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
                    RecordError(
                        f"line {line_number} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); re-encode the file as UTF-8"
                    )
                )
            except json.JSONDecodeError as error:
                records.append(
                    RecordError(
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


class JsonImageTextDataset(RecordDataset):
    """Records of a .json list or a .jsonl file, every one checked when the data set is built (RecordDataset); all are
    parsed at once (the file is read whole), encoded a rank's share at a time."""

    def _open(self, data: DataConfig) -> int:
        if not self.data_path.is_file():
            raise UserError(
                f"Config key 'data.data_path' = '{data.data_path}' is not a file. Point it at a .json (list of "
                f"records) or .jsonl (one record per line) file."
            )
        self.image_root = check_image_root(data.image_root, self.data_path.parent)
        # each record of the file: (messages, image paths, videos), or the RecordError that says why it is bad
        self.records: list[tuple[list[dict], list[Path], list[VideoSource]] | RecordError] = []
        for record in _read_json_records(self.data_path):
            try:
                self.records.append(parse_record(record, self.image_root))
            except RecordError as error:
                self.records.append(error)
        return len(self.records)

    def _record(self, index: int) -> tuple[list[dict], list[Path], list[VideoSource]]:
        record = self.records[index]
        if isinstance(record, RecordError):
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
    reader = HfImageTextDataset if data_cfg.dataset == "hf" else JsonImageTextDataset
    return reader(data_cfg, tokenizer, image_processor, merge)
