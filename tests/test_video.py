"""Video samples against transformers 5's own Glm4vProcessor (Glm4vVideoProcessor on the same frames): token ids,
token types, video patches and grids, mRoPE positions, and the tiny model's loss on both batches.

torchvision, which transformers' video processor calls for three primitive ops, has no CPU build that installs beside
torch 2.13's CPU wheel here (PyPI's links CUDA libraries). `TorchvisionCpu` stands in for it with those ops as
torchvision 0.28's CPU kernels define them (resize_image: uint8 bicubic with antialias runs natively in
torch.nn.functional.interpolate, align_corners=False; normalize: subtract the mean, divide by the std, per channel;
grayscale_to_rgb: repeat one channel); everything else is transformers' code.
"""

from __future__ import annotations

import enum
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    Glm4vMoeForConditionalGeneration,
    Glm4vMoeModel,
    Glm4vProcessor,
    image_processing_backends,
    video_processing_utils,
)
from transformers.image_utils import PILImageResampling
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glm45v_fsdp import vocab
from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data import JsonImageTextDataset, build_image_processor, build_tiny_tokenizer
from glm45v_fsdp.data.collate import collate
from glm45v_fsdp.model.hf_forward import Glm4vMoeForScripts
from glm45v_fsdp.model.loss import Glm4vMoeForTraining, model_loss_sum

FPS = 4  # the frame folders' rate; sampled at data.video_fps=2: every other frame


class TorchvisionCpu:
    """torchvision.transforms.v2.functional's ops that transformers' video processor calls, as on CPU."""

    class InterpolationMode(enum.Enum):
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    @staticmethod
    def resize(image: torch.Tensor, size: list[int], interpolation, antialias: bool = True) -> torch.Tensor:
        shape = image.shape
        flat = image.reshape(-1, *shape[-3:])
        out = F.interpolate(flat, size=list(size), mode=interpolation.value, align_corners=False, antialias=antialias)
        return out.reshape(*shape[:-2], *out.shape[-2:])

    @staticmethod
    def normalize(image: torch.Tensor, mean, std, inplace: bool = False) -> torch.Tensor:
        image = image if inplace else image.clone()
        mean, std = torch.as_tensor(mean, dtype=image.dtype), torch.as_tensor(std, dtype=image.dtype)
        return image.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))

    @staticmethod
    def grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
        return image if image.shape[-3] == 3 else image.repeat_interleave(3, dim=-3)


@pytest.fixture()
def hf_processor(monkeypatch, hf_config):
    """transformers' Glm4vProcessor on the tiny tokenizer, our image processor settings and its own video
    processor with the same patch sizes and pixel bounds."""
    for module in (image_processing_backends, video_processing_utils):
        monkeypatch.setattr(module, "tvF", TorchvisionCpu, raising=False)
    monkeypatch.setattr(
        image_processing_backends,
        "pil_torch_interpolation_mapping",
        {PILImageResampling.BICUBIC: TorchvisionCpu.InterpolationMode.BICUBIC},
    )
    images = build_image_processor(hf_config.vision_config)
    videos = Glm4vVideoProcessor(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": images.size["shortest_edge"], "longest_edge": Glm4vVideoProcessor.size["longest_edge"]},
    )
    # its class check looks the video processor up in a mapping transformers leaves empty without torchvision
    monkeypatch.setattr(Glm4vProcessor, "check_argument_for_proper_class", lambda *args: None)
    return Glm4vProcessor(image_processor=images, tokenizer=build_tiny_tokenizer(), video_processor=videos)


def frame(index: int, size: tuple[int, int]) -> Image.Image:
    """A frame with a gradient and a moving bright square, so resizing and patch order both show."""
    width, height = size
    x = torch.arange(width)[None, :, None]
    y = torch.arange(height)[:, None, None]
    pixels = (torch.cat([x * 255 // width + 0 * y, y * 255 // height + 0 * x, (x + y + 40 * index) % 256], -1)).byte()
    pixels[5 : 5 + 8, 3 * index : 3 * index + 8] = 255
    return Image.fromarray(pixels.numpy())


def write_frames(folder, count: int, size: tuple[int, int]) -> list[Image.Image]:
    folder.mkdir(parents=True)
    frames = [frame(i, size) for i in range(count)]
    for i, image in enumerate(frames):
        image.save(folder / f"{i:04d}.png")
    return frames


QUESTION = "What happens?"
ANSWER = "A square moves right."


def rendered(tags: str) -> str:
    """The conversation as transformers' processor takes it (the chat template's placeholders)."""
    blocks = tags.replace("<image>", "<|begin_of_image|><|image|><|end_of_image|>").replace(
        "<video>", "<|begin_of_video|><|video|><|end_of_video|>"
    )
    return f"[gMASK]<sop><|user|>\n{blocks}\n{QUESTION}<|assistant|>\n<think></think>\n{ANSWER}<|endoftext|>"


@pytest.mark.parametrize(
    "case",
    [
        # (tags, frame count, frame size (w, h)): odd counts are padded, non-square frames resized by smart_resize
        ("<video>", 7, (60, 44)),
        ("<image><video>", 9, (56, 56)),
        ("<video><image><video>", 5, (50, 70)),
    ],
)
def test_video_batch_equals_transformers_processor(tmp_path, hf_config, hf_processor, case):
    tags, count, size = case
    videos = tags.count("<video>")
    frames = [write_frames(tmp_path / f"clip{v}", count + v, size) for v in range(videos)]
    image = frame(3, (56, 84))
    image.save(tmp_path / "image.png")
    record = {
        "messages": [{"role": "user", "content": f"{tags}\n{QUESTION}"}, {"role": "assistant", "content": ANSWER}],
        "videos": [f"clip{v}" for v in range(videos)],
        "video_fps": FPS,
    }
    if "<image>" in tags:
        record["images"] = ["image.png"]
    (tmp_path / "data.json").write_text(json.dumps([record]))
    tokenizer = hf_processor.tokenizer
    data = DataConfig(dataset="json", data_path=str(tmp_path / "data.json"), cutoff_len=2048)
    dataset = JsonImageTextDataset(data, tokenizer, hf_processor.image_processor, 2)
    ours = dataset[0]

    # transformers on the same frames, sampled by its own video processor (the duration as its decoders report it)
    sampled, metadata = [], []
    for clip in frames:
        clip_metadata = VideoMetadata(total_num_frames=len(clip), fps=FPS, duration=len(clip) / FPS)
        indices = hf_processor.video_processor.sample_frames(clip_metadata).tolist()
        sampled.append([torch.from_numpy(np.array(clip[i])) for i in indices])
        metadata.append(VideoMetadata(total_num_frames=len(clip), fps=FPS, frames_indices=indices))
    reference = hf_processor(
        text=[rendered(tags)],
        images=[image] if "<image>" in tags else None,
        videos=[torch.stack(clip) for clip in sampled],
        video_metadata=metadata,
        do_sample_frames=False,
        return_tensors="pt",
    )
    assert torch.equal(ours["input_ids"], reference["input_ids"][0])
    assert torch.equal(ours["mm_token_type_ids"], reference["mm_token_type_ids"][0].int())
    assert int((ours["mm_token_type_ids"] == 2).sum()) > 0
    assert (ours["labels"][ours["mm_token_type_ids"] > 0] == -100).all()  # no loss on image or video tokens
    assert (ours["labels"] != -100).sum() > 0
    assert torch.equal(ours["video_grid_thw"], reference["video_grid_thw"])
    assert torch.equal(ours["pixel_values_videos"], reference["pixel_values_videos"])
    if "<image>" in tags:
        assert torch.equal(ours["pixel_values"], reference["pixel_values"].float())
    with torch.device("meta"):
        model = Glm4vMoeModel(hf_config)
    positions, _ = model.get_rope_index(
        reference["input_ids"],
        reference["mm_token_type_ids"],
        reference.get("image_grid_thw"),
        reference["video_grid_thw"],
    )
    assert torch.equal(ours["position_ids"], positions[:, 0])


def test_video_loss_equals_transformers_model(tmp_path, hf_config, hf_processor):
    """The tiny model's loss on transformers' batch through transformers' forward (video only: its forward scatters
    image features over a video's tokens too, so it cannot take both in one sample) and on ours through the training
    forward, same weights."""
    frames = write_frames(tmp_path / "clip", 8, (56, 56))
    record = {
        "messages": [{"role": "user", "content": f"<video>\n{QUESTION}"}, {"role": "assistant", "content": ANSWER}],
        "videos": [{"path": "clip", "fps": FPS}],
    }
    (tmp_path / "data.json").write_text(json.dumps([record]))
    tokenizer = hf_processor.tokenizer
    data = DataConfig(dataset="json", data_path=str(tmp_path / "data.json"), cutoff_len=2048)
    dataset = JsonImageTextDataset(data, tokenizer, hf_processor.image_processor, 2)
    batch = collate([dataset[0]], vocab.PAD_TOKEN_ID)
    indices = hf_processor.video_processor.sample_frames(VideoMetadata(total_num_frames=8, fps=FPS, duration=2.0))
    reference = hf_processor(
        text=[rendered("<video>")],
        videos=[torch.stack([torch.from_numpy(np.array(frames[i])) for i in indices])],
        video_metadata=[VideoMetadata(total_num_frames=8, fps=FPS, frames_indices=indices.tolist())],
        do_sample_frames=False,
        return_tensors="pt",
    )
    torch.manual_seed(0)
    hf_model = Glm4vMoeForConditionalGeneration(hf_config).eval()
    ours, door = Glm4vMoeForTraining(hf_config).eval(), Glm4vMoeForScripts(hf_config).eval()
    ours.load_state_dict(hf_model.state_dict())
    door.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        expected = hf_model(**reference, labels=batch["labels"], use_cache=False).loss.item()
        loss_sum, count = model_loss_sum(ours, dict(batch))
        # the engine door (HF Trainer, accelerate, TRL) called with transformers' processor output
        door_loss = door(**reference, labels=batch["labels"]).loss.item()
    assert torch.equal(reference["input_ids"], batch["input_ids"])
    assert count > 0 and abs((loss_sum / count).item() - expected) <= 1e-6 * abs(expected)
    assert abs(door_loss - expected) <= 1e-6 * abs(expected)


def test_hostile_video_records_stop_or_skip_by_record(tmp_path):
    """Each bad video kind is one bad record: skip trains on the good ones and counts the rest; stop names the first
    (its index, the file, the problem) before step 1."""
    from conftest import train
    from test_video_decode import encode

    data = tmp_path / "data"
    data.mkdir()
    encode(data / "good.mp4", "mpeg4", frames=10, size=(32, 32))  # 1 s at 10 fps
    encode(data / "long.mp4", "mpeg4", frames=20, size=(32, 32), rate=5)  # 4 s: over data.video_max_seconds=2
    encode(data / "large.mp4", "mpeg4", frames=10, size=(64, 48))  # 3072 px: over data.max_image_pixels=2000
    (data / "truncated.mp4").write_bytes((data / "good.mp4").read_bytes()[:600])
    (data / "random.mp4").write_bytes(bytes(range(256)) * 8)
    write_frames(data / "frames", 4, (32, 32))

    def record(videos, tags="<video>"):
        return {
            "messages": [{"role": "user", "content": f"{tags}\n{QUESTION}"}, {"role": "assistant", "content": ANSWER}],
            "videos": videos,
        }

    records = [
        record(["good.mp4"]),
        record(["truncated.mp4"]),  # 1
        record(["random.mp4"]),  # 2
        record(["long.mp4"]),  # 3
        record(["large.mp4"]),  # 4
        record(["frames"]),  # 5: frame images without an fps
        record(["good.mp4"], tags="<video><video>"),  # 6: two placeholders, one video
        {**record(["frames"]), "video_fps": 2},
    ]
    (data / "data.json").write_text(json.dumps(records))
    common = [
        "data.dataset=json",
        f"data.data_path={data / 'data.json'}",
        "data.video_max_seconds=2",
        "data.max_image_pixels=2000",
        "data.synthetic_samples=8",
        "training.train_iters=2",
        "training.micro_batch_size=1",
    ]
    skipped = train(tmp_path / "skip", [*common, "data.on_bad_record=skip"])
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    log = skipped.stdout + skipped.stderr
    assert "skipped 6 bad record(s) of 8" in log and "2 records with 0 image(s) and 2 video(s)" in log
    for index, problem in [
        (1, "truncated.mp4' cannot be used: "),
        (2, "random.mp4' cannot be used: it cannot be decoded as a video"),
        (3, "long.mp4' cannot be used: it lasts 4.0 s, over the duration limit of 2 s"),
        (4, "large.mp4' cannot be used: its frames are 64x48 pixels (3,072), over the decode limit of 2,000"),
        (5, "fps"),
        (6, "2 '<video>' tag(s) but 1 video(s)"),
    ]:
        line = next((line for line in log.splitlines() if f"Record {index} (0-based)" in line), "")
        assert problem in line, (index, line)
    stopped = train(tmp_path / "stop", common)
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
    assert "has 6 bad record(s) of 8" in stopped.stderr and "Record 1 (0-based)" in stopped.stderr
    assert "truncated.mp4" in stopped.stderr
