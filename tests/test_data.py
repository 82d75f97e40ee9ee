"""Data pipeline: tokenizer, template, image tokens, 3-D positions, collation/packing, JSON data, sampler, loader."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import Glm4vMoeForConditionalGeneration, Glm4vMoeModel

from glm45v_fsdp import vocab
from glm45v_fsdp.config import DataConfig
from glm45v_fsdp.data import (
    BATCH_METADATA_KEYS,
    GlobalBatchSampler,
    JsonImageTextDataset,
    SyntheticImageTextDataset,
    build_dataloader,
    build_dataset,
    build_image_processor,
    build_tiny_tokenizer,
    collate,
    encode_conversation,
    load_image_processor,
    load_tokenizer,
)
from glm45v_fsdp.data.processor import image_token_counts, process_images
from glm45v_fsdp.errors import UserError

IGNORE = vocab.IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def image_processor(hf_config):
    return build_image_processor(hf_config.vision_config)


def synthetic(tokenizer, image_processor, images_per_sample=1, text_tokens=64, cutoff_len=512, samples=8):
    return SyntheticImageTextDataset(
        samples, images_per_sample, 56, text_tokens, tokenizer, image_processor, cutoff_len, 2
    )


def supervised_spans(tokenizer, labels: list[int]) -> list[str]:
    """Decoded runs of consecutive supervised labels."""
    spans = []
    for is_label, run in itertools.groupby(labels, key=lambda x: x != IGNORE):
        if is_label:
            spans.append(tokenizer.decode(list(run)))
    return spans


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_tokens(tokenizer):
    text = "Hello, 世界! 🎉\n\tünïcødé  <b>x</b> [gMASK]"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < vocab.TINY_VOCAB_SIZE and len(tokenizer) <= vocab.TINY_VOCAB_SIZE
    assert tokenizer.encode("A", add_special_tokens=False) == [vocab.BYTE_TOKEN_OFFSET + ord("A")]
    for token, token_id in vocab.SPECIAL_TOKEN_IDS.items():
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == vocab.PAD_TOKEN_ID
    assert tokenizer.encode("[gMASK]<sop>", add_special_tokens=True) == [2, 4]  # no implicit bos/eos


def test_load_tokenizer(tmp_path, tokenizer):
    assert load_tokenizer(None).encode("<|image|>ab") == tokenizer.encode("<|image|>ab")
    tokenizer.save_pretrained(tmp_path / "model")
    loaded = load_tokenizer(str(tmp_path / "model"))
    assert loaded.encode("<|user|>\nhé", add_special_tokens=False) == tokenizer.encode("<|user|>\nhé")
    with pytest.raises(UserError, match="missing_dir"):
        load_tokenizer(str(tmp_path / "missing_dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty.*holds no tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------------------------------------------
# Template, image tokens, positions
# ---------------------------------------------------------------------------------------------------------------


def test_template_multi_turn_with_system(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "See you."},
    ]
    ids, labels = encode_conversation(messages, tokenizer, [])
    assert len(ids) == len(labels)
    assert tokenizer.decode(ids) == (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n<think></think>\nHello!"
        "<|user|>\nBye<|assistant|>\n<think></think>\nSee you.<|endoftext|>"
    )
    assert supervised_spans(tokenizer, labels) == ["Hello!<|user|>", "See you.<|endoftext|>"]
    assert all(label in (IGNORE, token) for token, label in zip(ids, labels))


def test_template_reasoning_is_supervised(tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>\n4"}]
    ids, labels = encode_conversation(messages, tokenizer, [])
    assert tokenizer.decode(ids).endswith("<|assistant|>\n<think>add</think>\n4<|endoftext|>")
    assert supervised_spans(tokenizer, labels) == ["<think>add</think>\n4<|endoftext|>"]


@pytest.mark.parametrize("sizes", [[(56, 56)], [(140, 84), (448, 448)]])
def test_image_tokens_match_grid(tokenizer, image_processor, sizes):
    images = [Image.new("RGB", size, (200, 10, 10)) for size in sizes]
    pixel_values, grid = process_images(image_processor, images)
    counts = image_token_counts(grid, 2)
    if sizes == [(56, 56)]:
        assert grid.tolist() == [[1, 4, 4]] and counts == [4]
    assert pixel_values.shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    messages = [
        {"role": "user", "content": "<image>\nLook" + "<image>" * (len(images) - 1)},
        {"role": "assistant", "content": "ok"},
    ]
    ids = torch.tensor(encode_conversation(messages, tokenizer, counts)[0])
    starts = (ids == vocab.IMAGE_START_TOKEN_ID).nonzero().flatten().tolist()
    ends = (ids == vocab.IMAGE_END_TOKEN_ID).nonzero().flatten().tolist()
    assert [end - start - 1 for start, end in zip(starts, ends)] == counts
    assert all((ids[s + 1 : e] == vocab.IMAGE_TOKEN_ID).all() for s, e in zip(starts, ends))
    assert int((ids == vocab.IMAGE_TOKEN_ID).sum()) == sum(g.prod().item() // 4 for g in grid)


def test_load_image_processor(tmp_path, hf_config, image_processor):
    assert load_image_processor(None, hf_config.vision_config).size == image_processor.size
    image_processor.save_pretrained(tmp_path)
    loaded = load_image_processor(str(tmp_path), hf_config.vision_config)
    assert loaded.merge_size == 2 and loaded.size == image_processor.size
    bad = json.loads((tmp_path / "preprocessor_config.json").read_text()) | {"patch_size": 16}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="patch_size=16"):
        load_image_processor(str(tmp_path), hf_config.vision_config)


def test_position_ids_match_get_rope_index(hf_config, tokenizer, image_processor):
    with torch.device("meta"):
        model = Glm4vMoeModel(hf_config)
    samples = [
        synthetic(tokenizer, image_processor, 2)[0],
        synthetic(tokenizer, image_processor, 1, 90)[3],
        synthetic(tokenizer, image_processor, 0)[5],
    ]
    for sample in samples:
        expected, _ = model.get_rope_index(
            sample["input_ids"][None], sample["mm_token_type_ids"][None], sample.get("image_grid_thw")
        )
        assert torch.equal(sample["position_ids"], expected[:, 0])
    assert not torch.equal(samples[0]["position_ids"][1], samples[0]["position_ids"][2])  # images move h and w
    batch = collate(samples, vocab.PAD_TOKEN_ID)
    expected, _ = model.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"], attention_mask=batch["attention_mask"]
    )
    assert torch.equal(batch["position_ids"], expected)


# ---------------------------------------------------------------------------------------------------------------
# Collation and packing
# ---------------------------------------------------------------------------------------------------------------


def test_collate_padding(tokenizer, image_processor):
    samples = [
        synthetic(tokenizer, image_processor, 1, 30)[0],
        synthetic(tokenizer, image_processor, 2, 120)[1],
        synthetic(tokenizer, image_processor, 0, 20)[2],
    ]
    lengths = [len(s["input_ids"]) for s in samples]
    batch = collate(samples, pad_token_id=7)
    size = (3, max(lengths))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == size
    assert batch["position_ids"].shape == (3, *size)
    assert batch["mm_token_type_ids"].dtype == torch.int32
    for row, (sample, length) in enumerate(zip(samples, lengths)):
        assert torch.equal(batch["input_ids"][row, :length], sample["input_ids"])
        assert (batch["input_ids"][row, length:] == 7).all() and (batch["labels"][row, length:] == IGNORE).all()
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (size[1] - length)
        assert (batch["position_ids"][:, row, length:] == 0).all()
        assert (batch["mm_token_type_ids"][row, length:] == 0).all()
    assert torch.equal(batch["image_grid_thw"], torch.cat([samples[0]["image_grid_thw"], samples[1]["image_grid_thw"]]))
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert batch["num_valid_tokens"].item() == sum(s["num_valid_tokens"].item() for s in samples)
    assert batch["num_samples"].item() == 3 and batch["num_tokens"].item() == sum(lengths)
    text_only = collate([samples[2]], pad_token_id=0)
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only


def test_collate_packing(tokenizer, image_processor):
    samples = [synthetic(tokenizer, image_processor, 1)[i] for i in range(3)]
    lengths = [len(s["input_ids"]) for s in samples]
    batch = collate(samples, pad_token_id=0, packing=True)
    total = sum(lengths)
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == batch["labels"].shape == (1, total)
    assert batch["position_ids"].shape == (4, 1, total)
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, *itertools.accumulate(lengths)]
    assert batch["position_ids"][0, 0].tolist() == [p for n in lengths for p in range(n)]
    assert torch.equal(batch["position_ids"][1:, 0], torch.cat([s["position_ids"] for s in samples], 1))
    starts = batch["cu_seqlens"][:-1].long()
    assert (batch["labels"][0, starts] == IGNORE).all()
    assert batch["num_valid_tokens"].item() == sum(s["num_valid_tokens"].item() for s in samples)
    assert batch["num_tokens"].item() == total and batch["image_grid_thw"].shape == (3, 3)
    # Template samples never supervise their first token, so check the boundary rule on fully supervised ones.
    handmade = {
        "input_ids": torch.tensor([5, 6, 7]),
        "labels": torch.tensor([5, 6, 7]),
        "mm_token_type_ids": torch.zeros(3, dtype=torch.int32),
        "position_ids": torch.arange(3).expand(3, -1),
    }
    packed = collate([handmade, handmade], pad_token_id=0, packing=True)
    assert packed["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, 6, 7]] and packed["num_valid_tokens"].item() == 4
    assert handmade["labels"].tolist() == [5, 6, 7]  # samples are not modified


def test_packed_forward_equals_separate_samples(hf_config, tokenizer, image_processor):
    torch.manual_seed(0)
    model = Glm4vMoeForConditionalGeneration._from_config(
        hf_config, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    first = synthetic(tokenizer, image_processor, 1, 40)[0]
    second = synthetic(tokenizer, image_processor, 2, 90)[1]

    def token_losses(batch: dict) -> tuple[torch.Tensor, dict]:
        batch = dict(batch)
        meta = {key: batch.pop(key) for key in BATCH_METADATA_KEYS if key in batch}
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        return losses, meta

    alone = [token_losses(collate([s], vocab.PAD_TOKEN_ID))[0].sum() for s in (first, second)]
    padded = token_losses(collate([first, second], vocab.PAD_TOKEN_ID))[0].sum(1)
    packed, meta = token_losses(collate([first, second], vocab.PAD_TOKEN_ID, packing=True))
    cu = meta["cu_seqlens"].tolist()
    per_sample = [packed[0, cu[i] : cu[i + 1] - 1].sum() for i in range(2)]
    torch.testing.assert_close(torch.stack(per_sample), torch.stack(alone))
    torch.testing.assert_close(padded, torch.stack(alone))
    assert packed[0].sum() > 0 and packed[0, cu[1] - 1] == 0  # nothing predicted across the boundary
    # Without the text row there is no block-diagonal mask: the second sample then sees the first.
    leaky = collate([first, second], vocab.PAD_TOKEN_ID, packing=True)
    leaky["position_ids"] = leaky["position_ids"][1:]
    leaked = token_losses(leaky)[0][0, cu[1] : cu[2] - 1].sum()
    assert not torch.allclose(leaked, alone[1])


# ---------------------------------------------------------------------------------------------------------------
# JSON data
# ---------------------------------------------------------------------------------------------------------------


def write_png(path, color=(0, 128, 255), size=(56, 56)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def json_dataset(path, tokenizer, image_processor, cutoff_len=512, image_root=None):
    data = DataConfig(dataset="json", data_path=str(path), image_root=image_root, cutoff_len=cutoff_len)
    return JsonImageTextDataset(data, tokenizer, image_processor, 2)


def test_json_llava_and_sharegpt(tmp_path, hf_config, tokenizer, image_processor):
    write_png(tmp_path / "img" / "a.png")
    write_png(tmp_path / "img" / "b.png", (255, 0, 0))
    llava = [
        {
            "image": "img/a.png",
            "conversations": [{"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "Blue."}],
        },
        {
            "conversations": [
                {"from": "system", "value": "Be nice."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello."},
            ]
        },
    ]
    (tmp_path / "llava.json").write_text(json.dumps(llava))
    config = DataConfig(dataset="json", data_path=str(tmp_path / "llava.json"))
    dataset = build_dataset(config, hf_config, tokenizer, image_processor)
    assert len(dataset) == 2
    first = dataset[0]
    assert first["image_grid_thw"].tolist() == [[1, 4, 4]] and first["pixel_values"].shape == (16, 1176)
    assert supervised_spans(tokenizer, first["labels"].tolist()) == ["Blue.<|endoftext|>"]
    assert "pixel_values" not in dataset[1]
    assert tokenizer.decode(dataset[1]["input_ids"]).startswith("[gMASK]<sop><|system|>\nBe nice.<|user|>\nHi")

    sharegpt = {
        "messages": [
            {"role": "user", "content": "<image><image>Compare."},
            {"role": "assistant", "content": "Blue then red."},
        ],
        "images": ["a.png", "b.png"],
    }
    (tmp_path / "share.jsonl").write_text("\n" + json.dumps(sharegpt) + "\n")
    dataset = json_dataset(tmp_path / "share.jsonl", tokenizer, image_processor, image_root=str(tmp_path / "img"))
    sample = dataset[0]
    assert sample["image_grid_thw"].shape == (2, 3) and int(sample["mm_token_type_ids"].sum()) == 8
    assert not torch.equal(sample["pixel_values"][:16], sample["pixel_values"][16:])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"conversations": "hello"}, "non-empty list under 'conversations'"),
        ({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "must alternate"),
        ({"conversations": [{"from": "human", "value": "a"}]}, "must alternate"),
        ({"conversations": [{"from": "bot", "value": "a"}]}, "turn 0"),
        (
            {"image": "ok.png", "conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "x"}]},
            "0 '<image>' tag\\(s\\) but 1 image",
        ),
        (
            {
                "image": "gone.png",
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
            },
            "gone.png' does not exist",
        ),
        ({"conversations": [{"from": "human", "value": "<|image|>"}, {"from": "gpt", "value": "x"}]}, "reserved"),
    ],
)
def test_json_record_errors_name_index_and_path(tmp_path, tokenizer, image_processor, record, message):
    write_png(tmp_path / "ok.png")
    good = {"image": "ok.png", "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "y"}]}
    path = tmp_path / "data.json"
    path.write_text(json.dumps([good, record]))
    with pytest.raises(UserError, match=message) as error:
        json_dataset(path, tokenizer, image_processor)
    assert "Record 1 " in str(error.value) and str(path) in str(error.value)


def test_json_missing_file(tmp_path, tokenizer, image_processor):
    with pytest.raises(UserError, match="data.data_path.*missing.json"):
        json_dataset(tmp_path / "missing.json", tokenizer, image_processor)


def test_build_dataset_rejects_mismatched_image_token(hf_config, tokenizer, image_processor):
    config = copy.deepcopy(hf_config)
    config.image_token_id = 151363
    with pytest.raises(UserError, match="image_token_id=151363"):
        build_dataset(DataConfig(), config, tokenizer, image_processor)


# ---------------------------------------------------------------------------------------------------------------
# Truncation and the synthetic data set
# ---------------------------------------------------------------------------------------------------------------


def test_truncation_never_cuts_an_image(tmp_path, tokenizer, image_processor):
    write_png(tmp_path / "a.png")
    write_png(tmp_path / "b.png", (9, 9, 9))
    record = {
        "images": ["a.png", "b.png"],
        "messages": [
            {"role": "user", "content": "<image>\nFirst?"},
            {"role": "assistant", "content": "One."},
            {"role": "user", "content": "<image>\nSecond?"},
            {"role": "assistant", "content": "Two."},
        ],
    }
    (tmp_path / "data.json").write_text(json.dumps([record]))
    full = json_dataset(tmp_path / "data.json", tokenizer, image_processor)[0]
    begins = (full["input_ids"] == vocab.IMAGE_START_TOKEN_ID).nonzero().flatten().tolist()
    for cutoff in (begins[1] + 1, begins[1] + 3, begins[1] + 5):  # inside the second block (begin, 4 images, end)
        sample = json_dataset(tmp_path / "data.json", tokenizer, image_processor, cutoff)[0]
        assert len(sample["input_ids"]) == begins[1] == sample["position_ids"].shape[1]
        assert sample["image_grid_thw"].tolist() == [[1, 4, 4]] and sample["pixel_values"].shape[0] == 16
        assert supervised_spans(tokenizer, sample["labels"].tolist()) == ["One.<|user|>"]
    whole_block = json_dataset(tmp_path / "data.json", tokenizer, image_processor, begins[1] + 6)[0]
    assert len(whole_block["input_ids"]) == begins[1] + 6 and whole_block["image_grid_thw"].shape == (2, 3)
    with pytest.raises(UserError, match="Record 0 .*no supervised token.*cutoff_len=8"):
        json_dataset(tmp_path / "data.json", tokenizer, image_processor, 8)[0]  # the first image does not fit


def test_synthetic_is_deterministic(tokenizer, image_processor):
    one, two = synthetic(tokenizer, image_processor, 2), synthetic(tokenizer, image_processor, 2)
    for index in (0, 5):
        a, b, c = one[index], one[index], two[index]
        assert a.keys() == c.keys()
        assert all(torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]) for key in a)
    assert not torch.equal(one[0]["pixel_values"], one[1]["pixel_values"])
    sample = one[0]
    assert sample["image_grid_thw"].tolist() == [[1, 4, 4]] * 2 and sample["pixel_values"].shape == (32, 1176)
    assert sample["num_valid_tokens"].item() == int((sample["labels"][1:] != IGNORE).sum()) > 0
    answer = supervised_spans(tokenizer, sample["labels"].tolist())[0]
    assert answer.startswith("Image 1: a ") and "Image 2: a " in answer  # never shorter than the description
    sample = synthetic(tokenizer, image_processor, 1, text_tokens=100)[0]
    # Template overhead with one image: [gMASK] <sop> <|user|> \n <|begin_of_image|> <|end_of_image|> <|assistant|>
    # \n <think> </think> \n <|endoftext|> = 12 tokens; question + answer make about 100 (strip may drop a space).
    text_tokens = int((sample["mm_token_type_ids"] == 0).sum()) - 12
    assert 98 <= text_tokens <= 100


def test_synthetic_cutoff(tokenizer, image_processor):
    sample = synthetic(tokenizer, image_processor, 1, text_tokens=200, cutoff_len=40)[0]
    assert len(sample["input_ids"]) == 40 and sample["num_valid_tokens"].item() > 0
    with pytest.raises(UserError, match="Synthetic sample 0 has no supervised token.*data.cutoff_len=8"):
        synthetic(tokenizer, image_processor, 1, cutoff_len=8)[0]


# ---------------------------------------------------------------------------------------------------------------
# Sampler and loader
# ---------------------------------------------------------------------------------------------------------------


def step_union(sampler_args: dict, step: int, dataset_size: int = 10) -> list[int]:
    dp = sampler_args["dp_size"]
    indices = []
    for rank in range(dp):
        sampler = GlobalBatchSampler(
            dataset_size, sampler_args["micro"], sampler_args["accum"], rank, dp, seed=3, shuffle=True
        )
        micro_batches = list(itertools.islice(iter(sampler), (step + 1) * sampler_args["accum"]))
        step_batches = micro_batches[step * sampler_args["accum"] :]
        assert all(len(batch) == sampler_args["micro"] for batch in step_batches)
        indices += [i for batch in step_batches for i in batch]
    return indices


def test_sampler_global_batch_independent_of_split():
    layouts = [
        {"dp_size": 1, "micro": 2, "accum": 2},
        {"dp_size": 2, "micro": 2, "accum": 1},
        {"dp_size": 4, "micro": 1, "accum": 1},
        {"dp_size": 1, "micro": 1, "accum": 4},
    ]
    for step in range(6):  # 10 samples, global batch 4: steps cross epoch boundaries
        unions = [step_union(layout, step) for layout in layouts]
        assert all(union == unions[0] for union in unions)
    epoch0 = [i for step in range(2) for i in step_union(layouts[0], step)] + step_union(layouts[0], 2)[:2]
    assert sorted(epoch0) == list(range(10)) and epoch0 != list(range(10))  # a shuffled permutation


def test_sampler_rank_major_and_resume():
    steps = GlobalBatchSampler(10, 1, 2, 0, 2, seed=0, shuffle=False)
    assert steps.step_indices(0) == [0, 1, 2, 3]
    rank1 = GlobalBatchSampler(10, 1, 2, 1, 2, seed=0, shuffle=False)
    assert list(itertools.islice(iter(rank1), 4)) == [[2], [3], [6], [7]]
    small = GlobalBatchSampler(3, 2, 2, 0, 1, seed=0, shuffle=False)  # data set smaller than a global batch
    assert list(itertools.islice(iter(small), 3)) == [[0, 1], [2, 0], [1, 2]]
    full = GlobalBatchSampler(10, 2, 2, 1, 2, seed=5, shuffle=True)
    resumed = GlobalBatchSampler(10, 2, 2, 1, 2, seed=5, shuffle=True, start_step=3)
    assert list(itertools.islice(iter(full), 12))[6:] == list(itertools.islice(iter(resumed), 6))
    assert full.epoch_of_step(3) == 2  # global batch 8: step 3 starts at stream item 24 of 10-sample epochs


def test_dataloader_workers_match_in_process(tokenizer, image_processor):
    dataset = synthetic(tokenizer, image_processor, 1, samples=6)

    def batches(num_workers: int, packing: bool) -> list[dict]:
        sampler = GlobalBatchSampler(len(dataset), 2, 1, 0, 1, seed=1, shuffle=True)
        loader = build_dataloader(dataset, sampler, vocab.PAD_TOKEN_ID, packing, num_workers)
        return list(itertools.islice(iter(loader), 4))

    for packing in (False, True):
        in_process, workers = batches(0, packing), batches(1, packing)
        for a, b in zip(in_process, workers, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
