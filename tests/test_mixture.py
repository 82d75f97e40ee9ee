"""data.mixture: the blend honours the weights and the seed, step k is the same whatever the split, each source walks
its own epochs, resume positions are checked and a changed mixture is refused (or allowed with the key), per-source
losses add up to the step loss and leave it unchanged, and a resumed run's batches equal the uninterrupted run's."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import mean_relative_error, train_many

from glm45v_fsdp.config import ChunkLossConfig, load_config
from glm45v_fsdp.data.collate import collate
from glm45v_fsdp.data.mixture import MixtureDataset, MixtureSampler, MixtureStream, SourceSpec, resume_stream
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.memory.chunk_loss import ChunkedLossHead
from glm45v_fsdp.model.loss import lm_loss_sum, token_losses
from glm45v_fsdp.tools.compare_batches import compare
from glm45v_fsdp.vocab import IGNORE_INDEX

WEIGHTS = {"a": 0.6, "b": 0.3, "c": 0.1}


def specs(weights: dict[str, float] = WEIGHTS, sizes: tuple[int, ...] = (700, 300, 37)) -> list[SourceSpec]:
    total = math.fsum(weights.values())  # as data/mixture.py normalises them
    return [
        SourceSpec(name, "synthetic", None, weight / total, None, size)
        for (name, weight), size in zip(weights.items(), sizes)
    ]


def sources_of(stream: MixtureStream, start: int, stop: int) -> list[int]:
    return [source for source, _ in stream.items(start, stop)]


def test_blend_honours_the_weights_at_every_prefix():
    stream = MixtureStream(specs(), seed=3, shuffle=True)
    picks = sources_of(stream, 0, 2000)
    shares = [picks.count(source) / 2000 for source in range(3)]
    assert all(abs(share - weight) <= 0.02 for share, weight in zip(shares, WEIGHTS.values())), shares
    counts = [0, 0, 0]
    for position, source in enumerate(picks, start=1):  # Megatron's rule: within one sample of the share, always
        counts[source] += 1
        assert all(abs(count - weight * position) < 1 for count, weight in zip(counts, stream.weights))


def test_each_source_walks_its_own_seeded_epochs():
    stream = MixtureStream(specs(), seed=3, shuffle=True)
    indices = stream.indices(0, 2000)
    small = [i - stream.starts[2] for i in indices if i >= stream.starts[2]]  # source c: 37 samples, 200 draws
    assert len(small) == 200
    for epoch in range(5):  # every epoch is a permutation of the source, and the epochs differ
        assert sorted(small[37 * epoch : 37 * (epoch + 1)]) == list(range(37))
    assert small[:37] != small[37:74] and small[:37] != list(range(37))
    again = MixtureStream(specs(), seed=3, shuffle=True).indices(0, 2000)
    other_seed = MixtureStream(specs(), seed=4, shuffle=True).indices(0, 2000)
    assert indices == again and indices != other_seed
    assert sources_of(MixtureStream(specs(), seed=4, shuffle=True), 0, 2000) == sources_of(
        MixtureStream(specs(), seed=3, shuffle=True), 0, 2000
    )  # the seed orders each source's samples; the blend is the weights' alone
    in_order = MixtureStream(specs(), seed=3, shuffle=False).indices(0, 2000)
    assert [i for i in in_order if i < 700][:5] == [0, 1, 2, 3, 4]


def step_union(layout: dict, step: int) -> list[int]:
    indices = []
    for rank in range(layout["dp"]):
        stream = MixtureStream(specs(), seed=1, shuffle=True)
        sampler = MixtureSampler(stream, layout["micro"], layout["accum"], rank, layout["dp"])
        micro_batches = list(itertools.islice(iter(sampler), (step + 1) * layout["accum"]))
        indices += [i for batch in micro_batches[step * layout["accum"] :] for i in batch]
    return indices


def test_step_k_is_the_same_whatever_the_split():
    layouts = [
        {"dp": 1, "micro": 2, "accum": 4},
        {"dp": 2, "micro": 2, "accum": 2},
        {"dp": 4, "micro": 1, "accum": 2},
        {"dp": 8, "micro": 1, "accum": 1},
    ]
    for step in (0, 3, 7):
        unions = [step_union(layout, step) for layout in layouts]
        assert all(union == unions[0] for union in unions) and len(unions[0]) == 8
    resumed = MixtureSampler(MixtureStream(specs(), seed=1, shuffle=True), 2, 2, 1, 2, start_step=3)
    fresh = MixtureSampler(MixtureStream(specs(), seed=1, shuffle=True), 2, 2, 1, 2)
    assert list(itertools.islice(iter(resumed), 2)) == fresh.micro_batches(3)


def mixture_config(weights: dict[str, float] = WEIGHTS, *extra: str):
    entries = ", ".join(f"{{dataset: synthetic, name: {name}, weight: {weight}}}" for name, weight in weights.items())
    return load_config(None, [f"data.mixture=[{entries}]", "training.seed=1", *extra])


def saved_state(position: int) -> dict:
    """A checkpoint's trainer state at `position` of a fresh run's stream (the loader ran ahead of it)."""
    stream = MixtureStream(specs(), seed=1, shuffle=True)
    stream.indices(0, position + 24)  # the loader's prefetch
    return {"consumed_samples": position, "mixture": stream.checkpoint(position)}


def test_resume_checks_positions_and_continues_the_stream():
    dataset = MixtureDataset(specs(), [range(700), range(300), range(37)])
    saved = saved_state(400)
    assert saved["mixture"]["consumed"] == [240, 120, 40] and sum(saved["mixture"]["consumed"]) == 400
    resumed = resume_stream(dataset, mixture_config(), saved, 400)
    assert resumed.indices(400, 480) == MixtureStream(specs(), seed=1, shuffle=True).indices(400, 480)
    assert resume_stream(dataset, mixture_config(), None, 0).indices(0, 8) == resumed.indices(0, 8)
    recovered = resume_stream(dataset, mixture_config(), {"consumed_samples": 400}, 400)  # a DeepSpeed checkpoint
    assert recovered.walk_positions(400) == saved["mixture"]["consumed"]
    damaged = {**saved, "mixture": {**saved["mixture"], "consumed": [241, 119, 40]}}
    with pytest.raises(UserError, match=r"positions do not match a replay.*\[241, 119, 40\].*\[240, 120, 40\]"):
        resume_stream(dataset, mixture_config(), damaged, 400)


def test_a_changed_mixture_is_refused_unless_allowed():
    changed = {"a": 0.2, "b": 0.4, "d": 0.4}
    dataset = MixtureDataset(specs(changed), [range(700), range(300), range(37)])
    with pytest.raises(UserError) as refused:
        resume_stream(dataset, mixture_config(changed), saved_state(400), 400)
    message = str(refused.value)
    assert "source 'c' was removed; source 'd' is new; source 'a' weight 0.6 -> 0.2; source 'b' weight 0.3" in message
    assert "set data.mixture_allow_change=true" in message and "\n" not in message
    allowed = resume_stream(dataset, mixture_config(changed, "data.mixture_allow_change=true"), saved_state(400), 400)
    assert allowed.origin == 400 and allowed.offsets == [240, 120, 0]  # a and b go on where they were; d is new
    assert allowed.walk_positions(500) == [260, 160, 40]  # the new weights from the resume point on
    reordered = MixtureDataset(specs(dict(reversed(WEIGHTS.items())), (37, 300, 700)), [range(37)] * 3)
    with pytest.raises(UserError, match=r"the order of the sources \['a', 'b', 'c'\] -> \['c', 'b', 'a'\]"):
        resume_stream(reordered, mixture_config(dict(reversed(WEIGHTS.items()))), saved_state(400), 400)
    single = {"consumed_samples": 400, "mixture": None}
    with pytest.raises(UserError, match="the checkpoint trained on one data set"):
        resume_stream(MixtureDataset(specs(), [range(700), range(300), range(37)]), mixture_config(), single, 400)


def test_collate_marks_each_token_with_its_source():
    def sample(length: int, source: int) -> dict:
        ids = torch.arange(5, 5 + length)
        return {
            "input_ids": ids,
            "labels": ids.clone(),
            "mm_token_type_ids": torch.zeros(length, dtype=torch.int32),
            "position_ids": torch.arange(length).expand(3, -1),
            "source": source,
        }

    samples = [sample(3, 2), sample(2, 0)]
    padded = collate(samples, pad_token_id=0)
    assert padded["source_ids"].tolist() == [[2, 2, 2], [0, 0, -1]] and padded["sample_sources"].tolist() == [2, 0]
    packed = collate(samples, pad_token_id=0, packing=True)
    assert packed["source_ids"].tolist() == [[2, 2, 2, 0, 0]]


@pytest.mark.parametrize("chunked", [False, True])
def test_token_losses_split_the_loss_sum_and_leave_it_unchanged(chunked):
    torch.manual_seed(0)
    hidden, targets = torch.randn(2, 9, 8), torch.randint(0, 50, (2, 9))
    targets[0, :3] = targets[1, -2:] = IGNORE_INDEX
    head = torch.nn.Linear(8, 50, bias=False)
    if chunked:
        head.__class__ = ChunkedLossHead
        head.chunk_config, head.last_choice = ChunkLossConfig(mode="static", chunk_size=4), None
    plain_sum, _ = lm_loss_sum(hidden, head, targets)
    head.keep_row_losses = chunked
    loss_sum, count = lm_loss_sum(hidden, head, targets)
    assert torch.equal(loss_sum, plain_sum)  # bit-identical with the per-token figures on
    logits = None if chunked else head(hidden).float()
    per_token = token_losses(head, logits, targets)
    reference = F.cross_entropy(
        F.linear(hidden, head.weight).reshape(-1, 50), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(2, 9)
    assert (
        torch.allclose(per_token, reference, rtol=1e-6, atol=1e-6) and (per_token[targets == IGNORE_INDEX] == 0).all()
    )
    assert abs(per_token.sum().item() - loss_sum.item()) <= 1e-6 * loss_sum.item() and count == 13


# ---------------------------------------------------------------------------------------------------------------
# Through the real trainer, 2 ranks
# ---------------------------------------------------------------------------------------------------------------


def write_records(path: Path, topic: str, count: int) -> None:
    records = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about {topic} number {i}."},
                {"from": "gpt", "value": f"{topic.capitalize()} {i} is " + " ".join([topic] * (3 + i % 5)) + "."},
            ]
        }
        for i in range(count)
    ]
    path.write_text("\n".join(json.dumps(record) for record in records))


FP32 = ["parallel.fsdp_plan.param_dtype=fp32", "parallel.fsdp_plan.reduce_dtype=fp32", "data.synthetic_samples=32"]
CP_PACKED_CHUNKED = [
    "parallel.ulysses_parallel_size=2",
    "data.packing=true",
    "features.chunk_loss.mode=static",
    "features.chunk_loss.chunk_size=16",
    "training.micro_batch_size=2",
    "training.gradient_accumulation_steps=2",
    "data.shuffle=false",
    "training.train_iters=3",
]


ONE_SAMPLE_MICRO_BATCHES = ["training.micro_batch_size=1", "training.gradient_accumulation_steps=2"]  # global 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    """One 2-rank job: a 3-source mixture with a checkpoint at step 3, its resume, a resume with changed weights
    (allowed), a 2-source mixture under Ulysses + packing + chunked loss and on the same samples without Ulysses, and
    one data set alone vs a one-source mixture of it (same layout)."""
    root = tmp_path_factory.mktemp("mixture")
    write_records(root / "ocr.jsonl", "letters", 24)
    write_records(root / "chat.jsonl", "weather", 30)
    three = (
        f"data.mixture=[{{dataset: synthetic, weight: 0.6}}, {{dataset: json, data_path: {root}/ocr.jsonl, "
        f"weight: 0.3}}, {{dataset: json, data_path: {root}/chat.jsonl, weight: 0.1, max_samples: 5}}]"
    )
    mixture = [three, "training.loss_type=per_token", "training.micro_batch_size=2"]
    mixture += ["training.gradient_accumulation_steps=2", "training.train_iters=6", *FP32]
    checkpoint = f"training.load={root}/save/step_00000003"
    changed = three.replace("weight: 0.6", "weight: 0.2")
    two = f"data.mixture=[{{dataset: synthetic}}, {{dataset: json, data_path: {root}/ocr.jsonl, weight: 2}}]"
    results = train_many(
        root,
        {
            "full": [*mixture, f"training.save={root}/save", "training.save_interval=3", "training.dump_batches=12"],
            "resumed": [*mixture, checkpoint, "training.dump_batches=6"],
            "changed": [
                *mixture,
                changed,
                checkpoint,
                "data.mixture_allow_change=true",
                "training.train_iters=4",
                "training.tensorboard=true",
            ],
            "cp": [*FP32, *CP_PACKED_CHUNKED, two, "training.loss_type=per_token"],
            "dp": [*FP32, *CP_PACKED_CHUNKED[1:], two, "training.loss_type=per_token", *ONE_SAMPLE_MICRO_BATCHES],
            "alone": [*FP32, *CP_PACKED_CHUNKED, "training.dump_batches=6"],
            "one_source": [*FP32, *CP_PACKED_CHUNKED, "data.mixture=[{dataset: synthetic}]", "training.dump_batches=6"],
        },
        nproc=2,
    )
    return root, results


def source_names(record: dict) -> list[str]:
    return sorted({key.split("/")[1] for key in record if key.startswith("data/")})


def weighted_loss(record: dict) -> float:
    """The sources' losses weighted by their supervised tokens."""
    names = [name for name in source_names(record) if f"data/{name}/loss" in record]
    tokens = sum(record[f"data/{name}/loss_tokens"] for name in names)
    return sum(record[f"data/{name}/loss"] * record[f"data/{name}/loss_tokens"] for name in names) / tokens


@pytest.mark.parametrize("name", ["full", "cp"])
def test_per_source_losses_add_up_to_the_step_loss(runs, name):
    _, results = runs
    records = results[name][1]
    for record in records:
        assert abs(weighted_loss(record) - record["loss"]) <= 1e-6 * record["loss"], record
        assert sum(record[f"data/{n}/samples"] for n in source_names(record)) == record["global_batch_size"]
        assert sum(record[f"data/{n}/tokens"] for n in source_names(record)) == record["tokens"]
    assert len(source_names(records[0])) == (3 if name == "full" else 2)


def test_per_source_losses_are_the_same_under_context_parallelism(runs):
    """Each source's loss under Ulysses 2 (each rank holds half of each packed row) = on whole sequences (DP 2)."""
    _, results = runs
    cp, dp = results["cp"][1], results["dp"][1]
    for name in ("synthetic", "ocr"):
        assert [r[f"data/{name}/loss_tokens"] for r in cp] == [r[f"data/{name}/loss_tokens"] for r in dp]
        curve = [r[f"data/{name}/loss"] for r in cp]
        assert mean_relative_error(curve, [r[f"data/{name}/loss"] for r in dp], steps=3) <= 1e-5


def test_per_source_figures_leave_the_training_loss_unchanged(runs):
    """One data set alone and a one-source mixture of it: the same batches (compare-batches) and bit-identical losses,
    under Ulysses, packing and the chunked loss."""
    root, results = runs
    alone, one_source = results["alone"][1], results["one_source"][1]
    assert [r["loss"] for r in alone] == [r["loss"] for r in one_source]
    assert [r["grad_norm"] for r in alone] == [r["grad_norm"] for r in one_source]
    assert all(r["data/synthetic/samples"] == 4 for r in one_source)
    assert compare(root / "alone", root / "one_source")["equal"]


def test_a_resumed_mixture_trains_on_the_uninterrupted_runs_batches(runs, tmp_path):
    root, results = runs
    full, resumed = results["full"][1], results["resumed"][1]
    assert "data.mixture: resumed at sample 24; samples consumed per source" in results["resumed"][0]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for rank, micro in itertools.product(range(2), range(6)):  # the resumed run's micro batch k: the full run's 6 + k
        name = f"rank{rank}_micro{micro}.pt"
        (tmp_path / "a" / name).write_bytes(
            (root / "full" / "batches" / f"rank{rank}_micro{micro + 6}.pt").read_bytes()
        )
        (tmp_path / "b" / name).write_bytes((root / "resumed" / "batches" / name).read_bytes())
    result = compare(tmp_path / "a", tmp_path / "b")
    assert result["equal"] and len(result["files"]) == 12
    for before, after in zip(full[3:], resumed):
        assert abs(after["loss"] - before["loss"]) <= 1e-6 * before["loss"]
        assert {k: v for k, v in after.items() if k.endswith(("samples", "tokens"))} == {
            k: v for k, v in before.items() if k.endswith(("samples", "tokens"))
        }


def test_a_changed_mixture_resumes_when_allowed(runs):
    root, results = runs
    log, records = results["changed"]
    assert "data.mixture changed since the checkpoint (source 'synthetic' weight 0.6 -> 0.333333; source 'ocr' " in log
    assert "data.mixture_allow_change=true: the blend restarts at sample 24 with the new weights" in log
    assert [r["step"] for r in records] == [4]
    assert records[0]["data/synthetic/samples"] < results["full"][1][3]["data/synthetic/samples"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "changed" / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("data/synthetic/samples")] == [records[0]["data/synthetic/samples"]]
