"""data.dataset=hf: image-video-text SFT records from a Hugging Face `datasets` data set on local disk.

data.data_path is a `save_to_disk` directory (a DatasetDict's split data.hf_split is taken), a parquet file, a
directory of parquet files (splits inferred from the file names, as `load_dataset("parquet", data_dir=...)` does), an
.arrow file or a directory of them. Nothing is downloaded: only an existing local path is read, with the library's
offline mode on. The table is memory-mapped (parquet is first converted to the library's Arrow cache, as `datasets`
always does): rows are read one at a time, by index, as raw Arrow values, so no column is decoded by `datasets` itself.

Each row is a record as the JSON reader takes it (records.py `parse_record`): `messages` (role/content turns) or
`conversations` (from/value turns), optional `images` (or `image`): a list of path strings relative to
data.image_root (default: the data directory), of the `datasets.Image` feature's {"bytes", "path"} values (bytes
decoded here with the same bounds as image files, see `load_image_bytes`; a path without bytes read as a file), or
of raw bytes; optional `videos` (or `video`) and `video_fps`, as a JSON record gives them. Null values count as
absent (an Arrow struct holds every field of every row).

The build-time check, the stop / skip handling and the summary are `RecordDataset`'s: each rank reads and encodes
every world-th row only.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

from PIL import Image

from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data.images import load_image
from glm45v_fsdp.data.records import RecordDataset, RecordError, VideoSource, check_image_root, parse_record
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger

TURN_COLUMNS = ("messages", "conversations")
_OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # datasets.config's, read when it loads
_FORMS = (
    "a directory written by save_to_disk, a .parquet file, a directory of .parquet files, an .arrow file or a "
    "directory of .arrow files"
)


def import_datasets() -> ModuleType:
    """The `datasets` library, imported on first use; a UserError naming the install when it is missing."""
    try:
        import datasets
    except ImportError as error:
        raise UserError(
            f"data.dataset=hf reads the data with the Hugging Face `datasets` library, which cannot be imported "
            f"({error}). Install it (pip install datasets, or pip install glm45v-fsdp[hf]), or convert the data to a "
            f".json/.jsonl file and set data.dataset=json."
        ) from None
    return datasets


@contextlib.contextmanager
def _offline(datasets: ModuleType) -> Iterator[None]:
    """The library's offline mode (HF_DATASETS_OFFLINE=1) while it loads: it never reaches the network."""
    saved = {name: getattr(datasets.config, name) for name in _OFFLINE_FLAGS if hasattr(datasets.config, name)}
    for name in saved:
        setattr(datasets.config, name, True)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(datasets.config, name, value)


def load_hf_data(path: Path, split: str):
    """(the `datasets.Dataset` at `path`, the split taken or None when the data has no splits); UserErrors name the
    key, the value and the fix."""
    datasets = import_datasets()
    if not path.exists():
        raise UserError(
            f"Config key 'data.data_path' = '{path}' does not exist. With data.dataset=hf, point it at {_FORMS} on "
            f"this machine (nothing is downloaded: save a hub data set with save_to_disk first)."
        )
    with _offline(datasets):
        try:
            if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
                loaded = datasets.load_from_disk(str(path))
            elif path.is_dir() and next(path.rglob("*.parquet"), None) is not None:
                loaded = datasets.load_dataset("parquet", data_dir=str(path))
            elif path.is_dir() and next(path.rglob("*.arrow"), None) is not None:
                loaded = datasets.load_dataset("arrow", data_dir=str(path))
            elif path.is_file() and path.suffix == ".parquet":
                loaded = datasets.Dataset.from_parquet(str(path))
            elif path.is_file() and path.suffix == ".arrow":
                loaded = datasets.Dataset.from_file(str(path))
            else:
                raise UserError(
                    f"Config key 'data.data_path' = '{path}' is not a Hugging Face data set: with data.dataset=hf it "
                    f"must be {_FORMS}. Point it at one, or set data.dataset=json for a .json/.jsonl file."
                )
        except UserError:
            raise
        except Exception as error:  # datasets and pyarrow raise OSError, ValueError, ArrowInvalid, their own errors
            cause = error.__cause__ or error.__context__  # DatasetGenerationError says why only here
            why = f"{type(error).__name__}: {error}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
            why = " ".join(why.split())  # one paragraph
            raise UserError(
                f"Config key 'data.data_path' = '{path}' cannot be read as a Hugging Face data set: {why}. Point it "
                f"at {_FORMS} that the installed `datasets` {datasets.__version__} can read (parquet files of one "
                f"data set must share their columns)."
            ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(
                f"Config key 'data.hf_split' = '{split}' is not a split of the Hugging Face data set '{path}' "
                f"(data.data_path), whose splits are {sorted(loaded)}. Set data.hf_split to one of them."
            )
        return loaded[split], split
    if split != "train":
        raise UserError(
            f"Config key 'data.hf_split' = '{split}' names a split, but the Hugging Face data set '{path}' "
            f"(data.data_path) is a single table without splits. Remove data.hf_split, or point data.data_path at a "
            f"data set with splits (a DatasetDict saved with save_to_disk, or parquet files named by split)."
        )
    return loaded, None


@dataclass(frozen=True)
class ImageBytes:
    """An image held in the row itself (the `datasets.Image` feature's bytes); `name` says which, for messages."""

    data: bytes = field(repr=False)
    name: str

    def __str__(self) -> str:
        return self.name


class _InMemoryFile(io.BytesIO):
    """Bytes that `load_image` reads as it reads a file (its size from `stat()`, then PIL opens it), so an image
    held as bytes gets the same bounded decode as an image file."""

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=len(self.getbuffer()))


def load_image_bytes(data: bytes, max_pixels: int, max_decode_pixels: int) -> Image.Image:
    """`load_image` of encoded image bytes (PNG, JPEG, ...): the same checks, JPEG draft decoding and downscale;
    BadImage when it cannot be used."""
    return load_image(_InMemoryFile(data), max_pixels, max_decode_pixels)


def _without_nulls(value):
    """A raw Arrow row with the null values of its structs dropped, so an absent field reads as absent."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _row_images(row: dict, root: Path) -> list[Path | ImageBytes]:
    """A row's "images" (or "image"): one entry or a list of entries, each a path string (relative to `root`), the
    `datasets.Image` feature's {"bytes", "path"} (its bytes when present, else its path) or raw bytes."""
    images = row.get("images", row.get("image"))
    images = [] if images is None else images if isinstance(images, list) else [images]
    entries: list[Path | ImageBytes] = []
    for number, image in enumerate(images):
        if isinstance(image, dict) and isinstance(image.get("bytes"), bytes):
            label = f", '{image['path']}'" if isinstance(image.get("path"), str) else ""
            entries.append(ImageBytes(image["bytes"], f"image {number} (bytes in the row{label})"))
        elif isinstance(image, dict) and isinstance(image.get("path"), str):
            entries.append(root / image["path"])
        elif isinstance(image, str):
            entries.append(root / image)
        elif isinstance(image, bytes):
            entries.append(ImageBytes(image, f"image {number} (bytes in the row)"))
        else:
            if isinstance(image, dict):  # no bytes in the message
                image = {key: "<bytes>" if isinstance(item, bytes) else item for key, item in image.items()}
            raise RecordError(
                f"its image {number} is {image!r}; give 'images' as a list of paths or of the datasets.Image "
                f"feature's values (bytes or path)"
            )
    return entries


class HfImageTextDataset(RecordDataset):
    """The rows of a local Hugging Face data set (see the module), checked when the data set is built
    (RecordDataset: each rank reads and encodes its share of the rows) and read lazily, by index, afterwards."""

    unit = "row"

    def _open(self, data: DataConfig) -> int:
        table, self.split = load_hf_data(self.data_path, data.hf_split)
        self.image_root = check_image_root(
            data.image_root, self.data_path if self.data_path.is_dir() else self.data_path.parent
        )
        columns = list(table.column_names)
        if not set(TURN_COLUMNS) & set(columns):
            raise UserError(
                f"The Hugging Face data set '{self.data_path}' (data.data_path{self._split_text()}) has no "
                f"'messages' or 'conversations' column; its columns are {columns}. Give each row its turns in a "
                f"'messages' column (role/content) or a 'conversations' column (from/value), e.g. with "
                f"Dataset.rename_column, and save it again."
            )
        self.rows = table.with_format("arrow")  # raw rows: no decoding by `datasets`
        get_logger().info("data: %s holds %d rows, columns %s", self._source(), len(table), columns)
        return len(table)

    def _split_text(self) -> str:
        return f", split '{self.split}'" if self.split is not None else ""

    def row(self, index: int) -> dict:
        """The raw values of row `index` (image bytes undecoded), nulls dropped."""
        return _without_nulls(self.rows[index].to_pylist()[0])

    def _record(self, index: int) -> tuple[list[dict], list[Path | ImageBytes], list[VideoSource]]:
        return parse_record(self.row(index), self.image_root, _row_images)

    def _open_image(self, entry: Path | ImageBytes) -> Image.Image:
        if isinstance(entry, ImageBytes):
            return load_image_bytes(entry.data, self.max_pixels, self.max_image_pixels)
        return super()._open_image(entry)

    def _record_name(self, index: int) -> str:
        return f"Row {index} (0-based) of {self._source()}"

    def _source(self) -> str:
        split = f" (split '{self.split}')" if self.split is not None else ""
        return f"Hugging Face data set '{self.data_path}'{split}"

    def _summary_head(self) -> str:
        return f"Hugging Face data set '{self.data_path.resolve()}' (data.dataset=hf{self._split_text()})"
