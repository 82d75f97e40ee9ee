"""GLM-4.5V image processor: images -> flat patches (pixel_values) and per-image (t, h, w) patch grids."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import Glm4vImageProcessorPil

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
