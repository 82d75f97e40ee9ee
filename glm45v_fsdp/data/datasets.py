"""Image-text SFT data sets: built-in synthetic scenes, or LLaVA / ShareGPT records from a .json or .jsonl file.

`__getitem__(i)` loads, tokenises and lays out ONE sample lazily (so data workers do it) and returns tensors:
input_ids [L], labels [L], mm_token_type_ids [L] (int32, 1 on <|image|>), position_ids [3, L] (3-D rope positions),
pixel_values [patches, D] and image_grid_thw [n_images, 3] (absent without images), num_valid_tokens (0-d: labels[1:]
that are supervised).

Truncation to data.cutoff_len never cuts an image block: when the cut falls inside a block (<|begin_of_image|> to
<|end_of_image|>), the sample ends just before that block's <|begin_of_image|>, and that image and every later one are
dropped from pixel_values / image_grid_thw. A sample left without any supervised token is a UserError.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data.images import BadImage, load_image
from glm45v_fsdp.data.processor import image_token_counts, process_images
from glm45v_fsdp.data.template import IMAGE_TAG, encode_conversation, mrope_position_ids
from glm45v_fsdp.data.vocab import supervised_token_count
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


class ImageTextDataset(Dataset):
    """Shared encoding of one (messages, images) sample; subclasses provide `__len__`, `conversation`, `describe`."""

    skipped_records = 0  # bad records left out of the data set (data.on_bad_record=skip)

    def __init__(self, tokenizer, image_processor, cutoff_len: int, spatial_merge_size: int):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.cutoff_len = cutoff_len
        self.spatial_merge_size = spatial_merge_size

    def conversation(self, index: int) -> tuple[list[dict], list[Image.Image]]:
        raise NotImplementedError

    def describe(self, index: int) -> str:
        raise NotImplementedError

    def summary(self) -> str:
        """What data this is, for the start-up log: kind, source, number of records."""
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        messages, images = self.conversation(index)
        pixel_values, grid, counts = None, None, []
        if images:
            try:
                pixel_values, grid = process_images(self.image_processor, images)
            except ValueError as error:
                raise UserError(
                    f"{self.describe(index)}: an image cannot be processed: {error}. Resize or replace it."
                ) from None
            counts = image_token_counts(grid, self.spatial_merge_size)
        input_ids, labels = encode_conversation(messages, self.tokenizer, counts)
        input_ids, labels = torch.tensor(input_ids), torch.tensor(labels)
        mm_token_type_ids = (input_ids == self.tokenizer.convert_tokens_to_ids("<|image|>")).int()
        assert int(mm_token_type_ids.sum()) == sum(counts), "text holds reserved image tokens"
        length, kept_images = _cut_point(mm_token_type_ids, self.cutoff_len)
        num_valid = int(supervised_token_count(labels[:length]))
        if num_valid == 0:
            raise UserError(
                f"{self.describe(index)} has no supervised token left after truncation to data.cutoff_len="
                f"{self.cutoff_len} (it is {len(input_ids)} tokens long, image tokens included; an image block is "
                f"never cut). Raise data.cutoff_len, or shorten or drop this sample."
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
        sample["position_ids"] = mrope_position_ids(
            sample["mm_token_type_ids"], sample.get("image_grid_thw"), self.spatial_merge_size
        )
        return sample


def _cut_point(mm_token_type_ids: torch.Tensor, cutoff_len: int) -> tuple[int, int]:
    """(length to keep, number of leading images kept): at most cutoff_len tokens, never inside an image block."""
    length = min(len(mm_token_type_ids), cutoff_len)
    kept = 0
    start = 0
    for modality, group in itertools.groupby(mm_token_type_ids.tolist()):
        end = start + len(list(group))
        if modality:
            if end + 1 > length:  # the block's <|end_of_image|> (at index `end`) does not fit
                return min(length, start - 1), kept
            kept += 1
        start = end
    return length, kept


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
    ):
        super().__init__(tokenizer, image_processor, cutoff_len, spatial_merge_size)
        self.num_samples = num_samples
        self.images_per_sample = images_per_sample
        self.image_size = image_size
        self.text_tokens = text_tokens

    def __len__(self) -> int:
        return self.num_samples

    def describe(self, index: int) -> str:
        return f"Synthetic sample {index}"

    def summary(self) -> str:
        return (
            f"built-in synthetic image-text set (data.dataset=synthetic, no file), {self.num_samples} samples of "
            f"{self.images_per_sample} image(s) {self.image_size}x{self.image_size} px and ~{self.text_tokens} text "
            f"tokens, cutoff {self.cutoff_len}"
        )

    def conversation(self, index: int) -> tuple[list[dict], list[Image.Image]]:
        rng = random.Random(index)
        scenes = [_scene(rng) for _ in range(self.images_per_sample)]
        question = rng.choice(QUESTIONS)
        numbered = len(scenes) > 1
        description = " ".join(_sentence(s, i + 1 if numbered else None) for i, s in enumerate(scenes))
        description = description or "There is no image, so there is nothing to describe."
        answer_ids = self.tokenizer.encode(description, add_special_tokens=False)
        question_tokens = len(self.tokenizer.encode("\n" + question, add_special_tokens=False))
        budget = max(len(answer_ids), self.text_tokens - question_tokens)
        answer = description
        while len(answer_ids) < budget:
            answer += " " + description
            answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        messages = [
            {"role": "user", "content": IMAGE_TAG * len(scenes) + ("\n" if scenes else "") + question},
            {"role": "assistant", "content": self.tokenizer.decode(answer_ids[:budget])},
        ]
        return messages, [_draw(scene, self.image_size) for scene in scenes]


# --------------------------------------------------------------------------------------------------------------
# JSON / JSONL
# --------------------------------------------------------------------------------------------------------------


class _RecordError(Exception):
    """A problem of one JSON record; the data set adds the record index and file path."""


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


def _parse_record(record, image_root: Path) -> tuple[list[dict], list[Path]]:
    """Normalised (messages, image paths) of one record; a _RecordError's message names the problem and the fix."""
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
        if message["role"] != "user" and IMAGE_TAG in message["content"]:
            raise _RecordError(f"turn {turn_index} ({message['role']}) holds '{IMAGE_TAG}'; images go in user turns")
        if message["role"] == "assistant" and not message["content"].strip():
            raise _RecordError(f"turn {turn_index} (assistant) is empty; give it an answer or drop the record")
        reserved = [token for token in RESERVED_TOKENS if token in message["content"]]
        if reserved:
            raise _RecordError(
                f"turn {turn_index} holds the reserved token(s) {reserved}; write '{IMAGE_TAG}' where an image goes"
            )
    images = record.get("images", record.get("image"))
    images = [] if images is None else [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not all(isinstance(name, str) for name in images):
        raise _RecordError(f"its images are {images!r}; give 'image' or 'images' as a path or a list of paths")
    n_tags = sum(m["content"].count(IMAGE_TAG) for m in messages)
    if n_tags != len(images):
        raise _RecordError(
            f"it has {n_tags} '{IMAGE_TAG}' tag(s) but {len(images)} image(s); put one '{IMAGE_TAG}' "
            f"in the user turns for each image, in order"
        )
    paths = [image_root / name for name in images]
    for path in paths:
        if not path.is_file():
            raise _RecordError(
                f"its image '{path}' does not exist; fix the path (relative to data.image_root, default "
                f"the data file's directory) or drop the record"
            )
    return messages, paths


class JsonImageTextDataset(ImageTextDataset):
    """Records of a .json list or a .jsonl file, every one checked when the data set is built.

    The check is the full encoding of each record (structure, images read and processed, tokenised, truncated),
    split over the ranks of the default process group and gathered, so every rank knows every bad record before
    step 1. `on_bad_record="stop"` raises a UserError naming the first bad record (its 0-based index in the file, the
    file, the problem) and how many there are; `"skip"` trains on the good records only, logs each bad one and keeps
    their count in `skipped_records`. Record indices in messages are always those of the file.
    """

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
    ):
        super().__init__(tokenizer, image_processor, cutoff_len, spatial_merge_size)
        self.data_path = Path(data_path)
        if not self.data_path.is_file():
            raise UserError(
                f"Config key 'data.data_path' = '{data_path}' is not a file. Point it at a .json (list of "
                f"records) or .jsonl (one record per line) file."
            )
        root = self.image_root = Path(image_root) if image_root is not None else self.data_path.parent
        if not root.is_dir():
            raise UserError(
                f"Config key 'data.image_root' = '{image_root}' is not a directory. Point it at the "
                f"directory the records' image paths are relative to, or set it to null."
            )
        self.max_pixels = int(image_processor.size["longest_edge"])
        self.max_image_pixels = max_image_pixels
        # (index in the file, messages, image paths) of the records that parsed
        self.records: list[tuple[int, list[dict], list[Path]]] = []
        problems: dict[int, str] = {}
        raw_records = _read_json_records(self.data_path)
        for index, record in enumerate(raw_records):
            try:
                self.records.append((index, *_parse_record(record, root)))
            except _RecordError as error:
                problems[index] = f"{self._record_name(index)} is invalid: {error}."
        problems.update(self._encoding_problems())
        self.total_records = len(raw_records)
        self.skipped_records = len(problems)
        self._apply(on_bad_record, problems)

    def _encoding_problems(self) -> dict[int, str]:
        """{file index: message} of the parsed records that fail to encode; this rank encodes every world-th one,
        and the ranks' findings are gathered (collective when a process group exists)."""
        rank, world = rank_and_world()
        found = {}
        start = time.perf_counter()
        mine = range(rank, len(self.records), world)
        for position in mine:
            try:
                self[position]
            except UserError as error:
                found[self.records[position][0]] = str(error)
        get_logger().info(
            "data: checked %d of %d records by encoding them (every %d-th on this rank) in %.2f s",
            len(mine),
            len(self.records),
            world,
            time.perf_counter() - start,
        )
        merged: dict[int, str] = {}
        for part in gather_objects(found):
            merged.update(part)
        return merged

    def _apply(self, on_bad_record: str, problems: dict[int, str]) -> None:
        if not problems:
            return
        first = problems[min(problems)]
        if on_bad_record == "stop":
            raise UserError(
                f"Data file '{self.data_path}' (data.data_path) has {len(problems)} bad record(s) of "
                f"{self.total_records}, found before step 1. The first: {first} Fix or drop the bad records, or set "
                f"data.on_bad_record=skip to train without them (each is then logged)."
            )
        self.records = [entry for entry in self.records if entry[0] not in problems]
        log = get_logger()
        for index in sorted(problems):
            log.warning("data: skipping (data.on_bad_record=skip): %s", problems[index])
        log.warning(
            "data: skipped %d bad record(s) of %d in '%s' (data.on_bad_record=skip); training on %d",
            len(problems),
            self.total_records,
            self.data_path,
            len(self.records),
        )
        if not self.records:
            raise UserError(
                f"Every record of data file '{self.data_path}' (data.data_path) is bad ({len(problems)} of "
                f"{self.total_records}), so nothing is left to train on with data.on_bad_record=skip. The first: "
                f"{first}"
            )

    def __len__(self) -> int:
        return len(self.records)

    def _record_name(self, index: int) -> str:
        return f"Record {index} (0-based) of data file '{self.data_path}'"

    def describe(self, position: int) -> str:
        return self._record_name(self.records[position][0])

    def summary(self) -> str:
        images = sum(len(paths) for _, _, paths in self.records)
        skipped = f", {self.skipped_records} bad record(s) skipped" if self.skipped_records else ""
        return (
            f"JSON file '{self.data_path.resolve()}' (data.dataset=json), {len(self.records)} records with {images} "
            f"image(s) under '{self.image_root.resolve()}'{skipped}, cutoff {self.cutoff_len}"
        )

    def conversation(self, position: int) -> tuple[list[dict], list[Image.Image]]:
        index, messages, paths = self.records[position]
        images = []
        for path in paths:
            try:
                images.append(load_image(path, self.max_pixels, self.max_image_pixels))
            except BadImage as error:
                raise UserError(
                    f"{self._record_name(index)}: image '{path}' cannot be used: {error}. Replace the file or drop "
                    f"the record."
                ) from None
        return messages, images


def build_dataset(data_cfg: DataConfig, hf_config, tokenizer, image_processor) -> Dataset:
    """The data set of `data_cfg.dataset`, after checking that tokenizer and model agree on the image token ids."""
    for key, token in (
        ("image_token_id", "<|image|>"),
        ("image_start_token_id", "<|begin_of_image|>"),
        ("image_end_token_id", "<|end_of_image|>"),
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
        )
    return JsonImageTextDataset(
        data_cfg.data_path,
        data_cfg.image_root,
        tokenizer,
        image_processor,
        data_cfg.cutoff_len,
        merge,
        on_bad_record=data_cfg.on_bad_record,
        max_image_pixels=data_cfg.max_image_pixels,
    )
