"""Mixed image + video data through the features: Ulysses 2 (with the chunked loss), Ring 2 and EP 2 (with packing)
against the same data on one rank; under CP the vision work is split over the ranks by image and frame group."""

from __future__ import annotations

from conftest import PARITY, mean_relative_error, read_metrics, train, train_many

# every other sample also holds a 6-frame video (3 temporal patches) beside its 2 images; per-token loss: the global
# token mean however the batch is split over data-parallel ranks (the default averages each rank's own mean)
MIXED = [
    *PARITY,
    "training.loss_type=per_token",
    "data.synthetic_images_per_sample=2",
    "data.synthetic_video_every=2",
    "data.synthetic_video_frames=6",
]
RUNS = {  # the global batch stays 2 samples: micro 2 on the one data-parallel rank of CP 2, micro 1 on each of EP 2's
    "ulysses2": [
        "parallel.ulysses_parallel_size=2",
        "features.chunk_loss.mode=static",
        "features.chunk_loss.chunk_size=64",
    ],
    "ring2": ["parallel.ring_attention_size=2"],
    "ep2_packed": ["parallel.expert_parallel_size=2", "training.micro_batch_size=1", "data.packing=true"],
}


def test_mixed_image_video_data_trains_alike_on_every_layout(tmp_path):
    one = train(tmp_path / "one", MIXED)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "32 of them also with a 6-frame video" in one.stdout
    reference = [r["loss"] for r in read_metrics(tmp_path / "one")]
    runs = train_many(tmp_path / "two", {name: MIXED + extra for name, extra in RUNS.items()}, nproc=2)
    for name, (_, records) in runs.items():
        assert records[0]["global_batch_size"] == 2, name
        losses = [r["loss"] for r in records]
        assert mean_relative_error(losses, reference) <= 1e-5, (name, losses, reference)
    assert "Ulysses context parallelism over 2 ranks" in runs["ulysses2"][0]
