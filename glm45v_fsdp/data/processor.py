"""GLM-4.5V vision inputs: images -> flat patches (pixel_values) and per-image (t, h, w) patch grids (transformers'
PIL image processor); a video's frames -> pixel_values_videos and its (t, h, w) grid, computed here as transformers'
Glm4vVideoProcessor computes them, without its torchvision dependency."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import Glm4vImageProcessorPil
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor, smart_resize

from glm45v_fsdp.errors import UserError

PREPROCESSOR_FILE = "preprocessor_config.json"


def build_image_processor(vision_config) -> Glm4vImageProcessorPil:
    """Processor matching `vision_config` (a Glm4vMoeVisionConfig).

    The pixel lower bound is one merged token (t * (patch*merge)^2 pixels), so small synthetic images are not upscaled:
    a 56x56 image gives grid (1, 4, 4) with patch 14, i.e. 4 image tokens. The upper bound is transformers' default.
    """
    factor = vision_config.patch_size * vision_config.spatial_merge_size
    return Glm4vImageProcessorPil(
        patch_size=vision_config.patch_size,
        temporal_patch_size=vision_config.temporal_patch_size,
        merge_size=vision_config.spatial_merge_size,
        size={
            "shortest_edge": vision_config.temporal_patch_size * factor**2,
            "longest_edge": Glm4vImageProcessorPil.size["longest_edge"],
        },
    )


def load_image_processor(model_path: str | None, vision_config) -> Glm4vImageProcessorPil:
    """The model directory's preprocessor_config.json when there is one, else `build_image_processor`."""
    if model_path is None or not (Path(model_path) / PREPROCESSOR_FILE).is_file():
        return build_image_processor(vision_config)
    try:
        processor = Glm4vImageProcessorPil.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(
            f"'{Path(model_path) / PREPROCESSOR_FILE}' (model.name_or_path) cannot be loaded: {error}. Fix or "
            f"delete that file; without it the image processor is built from the model's vision config."
        ) from None
    expected = {
        "patch_size": vision_config.patch_size,
        "temporal_patch_size": vision_config.temporal_patch_size,
        "merge_size": vision_config.spatial_merge_size,
    }
    for key, value in expected.items():
        if getattr(processor, key) != value:
            raise UserError(
                f"'{Path(model_path) / PREPROCESSOR_FILE}' has {key}={getattr(processor, key)} but the model's "
                f"vision config needs {value}. Make the two files of '{model_path}' agree."
            )
    return processor


def process_images(
    image_processor: Glm4vImageProcessorPil, images: list[Image.Image]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values float32 [sum of t*h*w, C*temporal*patch*patch], image_grid_thw long [n_images, 3])."""
    out = image_processor(images=images, return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"].long()


def image_token_counts(image_grid_thw: torch.Tensor, merge_size: int) -> list[int]:
    """Number of <|image|> tokens of each image: t*h*w / merge_size**2."""
    return (image_grid_thw.prod(-1) // merge_size**2).tolist()


@dataclass(frozen=True)
class VideoProcessor:
    """transformers' Glm4vVideoProcessor, reduced to what training needs: frames -> (pixel_values_videos, grid).

    Frames are resized together (one size for the whole video, from `smart_resize` over frames x height x width with
    `min_pixels` / `max_pixels`), bicubic with antialiasing on uint8 as torchvision does on CPU, then normalised with
    the CLIP mean and std and cut into patches of `temporal_patch_size` frames x `patch_size`^2 pixels, merge blocks
    contiguous. An odd frame count gets its last frame repeated."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int

    def resized(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) every frame of a `frames`-frame video of that size is resized to."""
        return smart_resize(
            num_frames=frames,
            height=height,
            width=width,
            temporal_factor=self.temporal_patch_size,
            factor=self.patch_size * self.merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of a `frames`-frame video of that size, without its pixels."""
        resized_height, resized_width = self.resized(frames, height, width)
        t = (frames + -frames % self.temporal_patch_size) // self.temporal_patch_size
        return t, resized_height // self.patch_size, resized_width // self.patch_size

    def __call__(self, frames: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values_videos float32 [t*h*w, 3*temporal*patch*patch], video_grid_thw long [1, 3])."""
        video = torch.from_numpy(np.stack([np.asarray(frame.convert("RGB")) for frame in frames]))
        video = video.permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
        height, width = self.resized(*video.shape[:1], *video.shape[2:])
        if (height, width) != tuple(video.shape[2:]):
            video = F.interpolate(video, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        mean = torch.tensor(OPENAI_CLIP_MEAN) * (1.0 / (1 / 255))
        std = torch.tensor(OPENAI_CLIP_STD) * (1.0 / (1 / 255))
        video = video.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])
        if pad := -video.shape[0] % self.temporal_patch_size:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        return self._patches(video)

    def _patches(self, video: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        frames, channels, height, width = video.shape
        t, h, w = frames // self.temporal_patch_size, height // self.patch_size, width // self.patch_size
        m, p = self.merge_size, self.patch_size
        patches = video.view(t, self.temporal_patch_size, channels, h // m, m, p, w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, -1)
        return patches, torch.tensor([[t, h, w]])


def video_processor_for(image_processor: Glm4vImageProcessorPil) -> VideoProcessor:
    """The video processor beside `image_processor`: its patch, temporal and merge sizes and pixel lower bound (one
    merged token per temporal patch for the built-in processor, so small frames are not upscaled), and transformers'
    video upper bound (over frames x height x width)."""
    return VideoProcessor(
        patch_size=image_processor.patch_size,
        temporal_patch_size=image_processor.temporal_patch_size,
        merge_size=image_processor.merge_size,
        min_pixels=int(image_processor.size["shortest_edge"]),
        max_pixels=Glm4vVideoProcessor.size["longest_edge"],
    )
