"""Data pipeline: tokenizer, image processor, GLM-4.5V chat template, data sets (synthetic, JSON, Hugging Face
`datasets`), collation, sampler, loader."""

from glm45v_fsdp.data.collate import BATCH_METADATA_KEYS, collate
from glm45v_fsdp.data.datasets import JsonImageTextDataset, SyntheticImageTextDataset, build_dataset
from glm45v_fsdp.data.hf_datasets import HfImageTextDataset
from glm45v_fsdp.data.loader import build_dataloader
from glm45v_fsdp.data.processor import build_image_processor, load_image_processor
from glm45v_fsdp.data.records import RecordDataset
from glm45v_fsdp.data.sampler import GlobalBatchSampler
from glm45v_fsdp.data.template import encode_conversation, mrope_position_ids
from glm45v_fsdp.data.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = [
    "BATCH_METADATA_KEYS",
    "GlobalBatchSampler",
    "HfImageTextDataset",
    "JsonImageTextDataset",
    "RecordDataset",
    "SyntheticImageTextDataset",
    "build_dataloader",
    "build_dataset",
    "build_image_processor",
    "build_tiny_tokenizer",
    "collate",
    "encode_conversation",
    "load_image_processor",
    "load_tokenizer",
    "mrope_position_ids",
]
