"""Validation and eval (glm45v_fsdp/evaluation.py, data/validation.py): the eval batches of every rank, the held-out
split, validation files, the config keys, the training state an eval sets aside, the chunked loss without gradients,
and on real ranks (fp32): the eval loss under DP 2, EP 2, Ulysses 2, Ring 2 and packing with the chunked loss,
recompute and activation offload equals one process's on the same validation samples, an eval changes nothing the
training records afterwards, and the records, summary and TensorBoard scalars it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import mean_relative_error, train_many
from torch import nn

from glm45v_fsdp.builders import build_training_data
from glm45v_fsdp.config import ModelConfig, load_config
from glm45v_fsdp.data.validation import eval_micro_batches, split_validation
from glm45v_fsdp.errors import ConfigError, UserError
from glm45v_fsdp.evaluation import training_state_kept
from glm45v_fsdp.memory.chunk_loss import chunked_linear_cross_entropy
from glm45v_fsdp.model import load_hf_config
from glm45v_fsdp.model.moe import MoEBlock
from glm45v_fsdp.runtime.device import DeviceLayer

LIMIT = 1e-6  # mean relative eval-loss error, fp32 (issue 52)


# 1. The eval batches --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "micro", "dp"), [(7, 2, 2), (5, 2, 2), (5, 1, 2), (3, 2, 4), (6, 3, 1)])
def test_every_sample_counts_once_and_every_rank_runs_the_same_forwards(size, micro, dp):
    ranks = [eval_micro_batches(size, micro, rank, dp) for rank in range(dp)]
    assert len({len(batches) for batches in ranks}) == 1  # the same number of forwards everywhere
    assert len(ranks[0]) == math.ceil(size / (micro * dp))
    seen = sorted(index for batches in ranks for batch in batches for index in batch)
    assert seen == list(range(size))
    for step in zip(*ranks):  # global batch b: the samples in order, rank-major
        assert [index for batch in step for index in batch] == sorted(index for batch in step for index in batch)
    assert eval_micro_batches(5, 2, 1, 2) == [[2, 3], []]  # the last global batch leaves rank 1 a placeholder


def test_eval_iters_takes_the_first_global_batches():
    assert eval_micro_batches(10, 2, 0, 2, eval_iters=2) == [[0, 1], [4, 5]]
    assert eval_micro_batches(10, 2, 1, 2, eval_iters=2) == [[2, 3], [6, 7]]
    assert eval_micro_batches(10, 2, 0, 2, eval_iters=9) == eval_micro_batches(10, 2, 0, 2)  # at most the set


# 2. Validation data -------------------------------------------------------------------------------------------------


def test_validation_split_is_disjoint_and_deterministic_by_seed():
    data = list(range(100))
    train, held_out = split_validation(data, 0.1, seed=7)
    assert len(held_out) == 10 and len(train) == 90
    assert not set(train.positions) & set(held_out.positions)
    assert sorted(train.positions + held_out.positions) == data
    assert train.positions == sorted(train.positions) and held_out.positions == sorted(held_out.positions)
    again_train, again = split_validation(data, 0.1, seed=7)
    assert again.positions == held_out.positions and again_train.positions == train.positions
    assert split_validation(data, 0.1, seed=8)[1].positions != held_out.positions
    assert [held_out[i] for i in range(len(held_out))] == held_out.positions
    assert len(split_validation(data, 0.051, seed=7)[1]) == 6  # ceil(fraction x size)
    with pytest.raises(UserError, match=r"'data.validation_split' = 0.995 holds out 100 of the 100 .* none to train"):
        split_validation(data, 0.995, seed=7)


def test_training_data_leaves_out_the_validation_split():
    config = load_config(None, ["data.synthetic_samples=20", "data.validation_split=0.25", "training.seed=3"])
    data = build_training_data(config, load_hf_config(ModelConfig()))
    assert len(data.dataset) == 15 and len(data.validation) == 5
    assert not set(data.dataset.positions) & set(data.validation.positions)
    first = data.validation.positions[0]
    assert torch.equal(data.validation[0]["input_ids"], data.dataset.base[first]["input_ids"])
    assert data.dataset.skipped_records == 0
    assert data.validation.summary().startswith("validation: 5 of the 20 samples of the built-in synthetic")
    plain = build_training_data(load_config(None, ["data.synthetic_samples=20"]), load_hf_config(ModelConfig()))
    assert plain.validation is None and len(plain.dataset) == 20


def _record(answer: str) -> dict:
    return {"conversations": [{"from": "human", "value": "Say it."}, {"from": "gpt", "value": answer}]}


def test_validation_path_is_read_like_the_training_file(tmp_path):
    train_file, validation_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("\n".join(json.dumps(_record(f"train {i}")) for i in range(4)))
    validation_file.write_text("\n".join(json.dumps(_record(f"held out {i}")) for i in range(3)))
    json_data = ["data.dataset=json", f"data.data_path={train_file}"]
    config = load_config(None, [*json_data, f"data.validation_path={validation_file}"])
    data = build_training_data(config, load_hf_config(ModelConfig()))
    assert len(data.dataset) == 4 and len(data.validation) == 3
    assert "held out 2" in data.tokenizer.decode(data.validation[2]["input_ids"])
    missing = load_config(None, [*json_data, f"data.validation_path={tmp_path / 'nope.jsonl'}"])
    with pytest.raises(UserError, match=r"^Config key 'data.validation_path' = '.*nope.jsonl' is not a file"):
        build_training_data(missing, load_hf_config(ModelConfig()))


def test_a_mixture_reads_its_validation_file_in_its_sources_format(tmp_path):
    train_file, validation_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("\n".join(json.dumps(_record(f"train {i}")) for i in range(4)))
    validation_file.write_text("\n".join(json.dumps(_record(f"held out {i}")) for i in range(3)))
    mixture = f"data.mixture=[{{dataset: json, data_path: {train_file}}}, {{dataset: synthetic, weight: 0.5}}]"
    config = load_config(None, [mixture, "data.synthetic_samples=8", f"data.validation_path={validation_file}"])
    data = build_training_data(config, load_hf_config(ModelConfig()))
    assert len(data.validation) == 3
    assert "held out 0" in data.tokenizer.decode(data.validation[0]["input_ids"])


# 3. The config keys -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        (["data.validation_split=1.0"], "data.validation_split", "= 1.0 is invalid: it must be a fraction in [0, 1)"),
        (["data.validation_split=-0.1"], "data.validation_split", "= -0.1 is invalid"),
        (
            ["data.validation_split=0.1", "data.validation_path=v.jsonl"],
            "data.validation_path",
            "are both set, but the validation set comes from one of them. Remove data.validation_split",
        ),
        (["data.validation_path=v.jsonl"], "data.validation_path", "'synthetic', which reads no file. Hold out part"),
        (
            ["data.dataset=json", "data.data_path=t.jsonl", "data.validation_path=''"],
            "data.validation_path",
            "= '' is invalid: it must be a path or null",
        ),
        (["training.eval_interval=-1", "data.validation_split=0.1"], "training.eval_interval", "= -1 is invalid"),
        (["training.eval_iters=-2", "data.validation_split=0.1"], "training.eval_iters", "= -2 is invalid"),
        (["training.eval_interval=5"], "training.eval_interval", "= 5 is set, but there is no validation data"),
        (["training.eval_iters=3"], "training.eval_iters", "= 3 is set, but there is no validation data"),
        (["training.eval_interval=often", "data.validation_split=0.1"], "training.eval_interval", "expects int"),
        (
            ["training.save_best=true", "data.validation_split=0.1"],
            "training.save_best",
            "= True is invalid: it must be False unless training.save is set",
        ),
        (
            ["training.save_best=true", "training.save=ckpt"],
            "training.save_best",
            "= True is set, but there is no validation data",
        ),
    ],
)
def test_bad_eval_keys_name_the_key_and_the_fix(overrides, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert f"'{key}'" in message and expected in message and "\n" not in message


# 4. What an eval leaves alone ---------------------------------------------------------------------------------------


class _TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoEBlock(load_hf_config(ModelConfig()).text_config)
        self.lm_head = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.5)


def test_training_state_kept_keeps_routing_out_and_restores_rng_and_mode():
    torch.manual_seed(0)
    model = _TinyMoE()
    for tensor in [*model.parameters(), *model.buffers()]:
        nn.init.normal_(tensor, std=0.1)
    hidden = torch.randn(5, model.moe.gate.weight.shape[1])
    observed = []  # what the router monitor would count (router_health.py)
    model.moe.observer = lambda logits, expert_ids, rows: observed.append(expert_ids.shape[0])
    model.moe(hidden)
    assert observed == [5]
    expected = torch.get_rng_state()
    with training_state_kept(model, DeviceLayer("cpu", "gloo")):
        assert not model.training and not model.dropout.training and not torch.is_grad_enabled()
        model.moe(hidden)  # the eval's routing is not observed ...
        torch.rand(3)  # ... and its random numbers are not drawn from training's stream
    assert observed == [5]
    assert torch.equal(torch.get_rng_state(), expected)
    assert model.training and torch.is_grad_enabled()


def test_chunked_loss_without_gradients_is_the_same_sum():
    torch.manual_seed(1)
    hidden, weight = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    with_graph = chunked_linear_cross_entropy(hidden, weight, labels, 8)
    with torch.no_grad():
        alone = chunked_linear_cross_entropy(hidden, weight, labels, 8)
    assert alone.grad_fn is None and torch.equal(alone, with_graph.detach())
    reference = nn.functional.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    torch.testing.assert_close(alone, reference, rtol=1e-5, atol=0)


# 5. On real ranks ---------------------------------------------------------------------------------------------------

# fp32, 20 synthetic samples of which 5 are held out (an odd count: the 2-rank evals end on a placeholder), an eval
# after each of 2 steps. The layout runs train with lr 0, so every eval sees the initial weights, whatever the layout
# did to its training (training parity is the other tests' business, at 1e-5).
BASE = [
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "data.synthetic_samples=20",
    "data.validation_split=0.25",
    "training.micro_batch_size=1",
    "training.train_iters=2",
    "training.eval_interval=1",
    "training.log_interval=1",
]
FROZEN = [*BASE, "training.lr=0", "training.min_lr=0"]
PACKED = ["data.packing=true", "training.micro_batch_size=2", "features.chunk_loss.mode=dynamic"]
PACKED += ["features.chunk_loss.logits_budget_mib=0.02"]
MEMORY = ["features.recompute.enabled=true"]
MEMORY += ["features.activation_offload.enabled=true", "features.activation_offload.min_tensor_bytes=0"]
EP2 = ["parallel.expert_parallel_size=2"]
# "one" also keeps its best checkpoint (its evals are equal: the first is the best; written in the background), then
# "one resumed" continues it.
SAVE_BEST = ["training.save_best=true", "training.save_keep_last=1", "training.save=SAVE"]
ONE_RANK = {
    "one": [*FROZEN, "training.tensorboard=true", *SAVE_BEST, "training.async_save=true"],
    "one packed": [*FROZEN, *PACKED],
    "one resumed": [*FROZEN, *SAVE_BEST, "training.resume=auto", "training.train_iters=3"],
}
LAYOUTS = {
    "dp2": [*FROZEN],
    "ep2": [*FROZEN, *EP2, "features.ep_balance.enabled=true"],
    "ulysses2": [*FROZEN, "parallel.ulysses_parallel_size=2"],
    "ring2": [*FROZEN, "parallel.ring_attention_size=2"],
    "dp2 packed memory": [*FROZEN, *PACKED, *MEMORY],
    "ep2 ulysses2 packed": [*FROZEN, *EP2, "parallel.ulysses_parallel_size=2", *PACKED],
}
REFERENCE = {name: "one packed" if "packed" in name else "one" for name in LAYOUTS}
PLAN = {"ep2": "expert_parallel", "ulysses2": "context_parallel", "ring2": "context_parallel"}
# Training with an eval after every step against an eval only after the last: EP 2 with balance over a skewed router,
# the dynamic chunked loss, recompute and activation offload, i.e. every side channel the training forward writes.
SIDE = [*BASE, "training.train_iters=3", "training.lr=1e-3", *EP2, "model.router_skew=0.6"]
SIDE += ["features.ep_balance.enabled=true", "features.chunk_loss.mode=dynamic"]
SIDE += ["features.chunk_loss.logits_budget_mib=0.02", *MEMORY]
SIDE_RUNS = {"side eval": [*SIDE, "training.eval_interval=1"], "side no eval": [*SIDE, "training.eval_interval=0"]}
TIMING = {"ms_per_iter", "samples_per_s", "tokens_per_s", "ms_per_iter_per_rank", "data_ms", "data_ms_per_rank"}
TIMING |= {"mem_peak_max_gib", "mem_peak_avg_gib", "mem_peak_per_rank_gib", "offload_wait_ms"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval_runs")


@pytest.fixture(scope="module")
def runs(root) -> dict[str, tuple[str, list[dict]]]:
    """Every run once: (rank 0's log, metrics records) by name; run NAME of ONE_RANK writes to root/one/NAME, and
    its checkpoints to root/save."""
    save = str(root / "save")
    one_rank = {name: [o.replace("SAVE", save) for o in overrides] for name, overrides in ONE_RANK.items()}
    return {**train_many(root / "one", one_rank, 1), **train_many(root / "two", {**LAYOUTS, **SIDE_RUNS}, 2)}


def evals(records: list[dict]) -> list[dict]:
    return [record for record in records if "eval_loss" in record]


def steps(records: list[dict]) -> list[dict]:
    return [record for record in records if "eval_loss" not in record]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_eval_loss_in_every_layout_equals_one_process(runs, name):
    log, records = runs[name]
    reference = evals(runs[REFERENCE[name]][1])
    mine = evals(records)
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == [1, 2]
    assert all(r["eval_samples"] == 5 for r in mine)
    assert [r["eval_tokens"] for r in mine] == [r["eval_tokens"] for r in reference]
    assert mean_relative_error([r["eval_loss"] for r in mine], [r["eval_loss"] for r in reference], 2) <= LIMIT
    for record in mine:
        assert record["eval_ppl"] == pytest.approx(math.exp(record["eval_loss"]), rel=1e-12)
    if name in PLAN:
        assert f"[plan {PLAN[name]}]" in log
    if "packed" in name:
        assert "chunked lm_head + cross-entropy (dynamic)" in log and "[plan chunk_loss]" in log
    if "memory" in name:
        assert "[plan recompute]" in log and "[plan activation_offload]" in log
    assert len([line for line in log.splitlines() if line.startswith("eval step")]) == 2


def test_evals_of_the_same_weights_agree(runs):
    """lr 0: the eval after step 2 sees the weights of the eval after step 1, so nothing the first eval did (or
    training did) may move it."""
    for name in [*LAYOUTS, "one", "one packed"]:
        first, second = (r["eval_loss"] for r in evals(runs[name][1]))
        assert first == second, name


def test_an_eval_changes_nothing_training_records(runs):
    with_eval, without = steps(runs["side eval"][1]), steps(runs["side no eval"][1])
    assert len(evals(runs["side eval"][1])) == 3 and len(evals(runs["side no eval"][1])) == 1
    assert len(with_eval) == len(without) == 3
    for record in with_eval:  # the side channels are there to be compared
        assert {"ep_load_max_over_mean_before", "ep_replicas", "chunk_size", "offload_tensors"} <= set(record)
    assert "router/worst_load_max_over_mean" in with_eval[-1]  # the routers' figures, at the log steps
    assert with_eval[-1]["loss"] < with_eval[0]["loss"]  # it trains
    assert max(r["ep_replicas"] for r in with_eval) > 0  # balance ran
    for record, reference in zip(with_eval, without):
        figures = {key: value for key, value in record.items() if key not in TIMING}
        assert figures == {key: value for key, value in reference.items() if key not in TIMING}  # bit-identical
    assert evals(runs["side eval"][1])[-1]["eval_loss"] == evals(runs["side no eval"][1])[-1]["eval_loss"]


def test_eval_records_summary_line_and_tensorboard(runs, root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, records = runs["one"]
    mine = evals(records)
    assert [r["step"] for r in records] == [1, 1, 2, 2]  # each eval's record after its step's
    assert set(mine[0]) == {"step", "eval_loss", "eval_ppl", "eval_samples", "eval_tokens", "eval_ms"}
    assert mine[0]["eval_ms"] > 0
    line = next(line for line in log.splitlines() if line.startswith("eval step 2/2"))
    assert f"eval loss {mine[1]['eval_loss']:.6f} | eval ppl {mine[1]['eval_ppl']:.4f} | 5 samples," in line
    output = root / "one" / "one"
    summary = json.loads((output / "summary.json").read_text())
    assert summary["evals"] == 2 and summary["eval_loss_last"] == mine[1]["eval_loss"]
    assert summary["eval_loss_best"] == min(r["eval_loss"] for r in mine)
    assert summary["eval_best_step"] in (1, 2) and summary["eval_ppl_last"] == mine[1]["eval_ppl"]
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [1, 2]
    assert [e.value for e in events.Scalars("eval/ppl")] == pytest.approx([r["eval_ppl"] for r in mine], rel=1e-6)


def test_save_best_keeps_the_best_checkpoint_through_pruning_and_resume(runs, root):
    """lr 0: every eval is equal, so the first is the best (a tie is no improvement). "one" saves step 1 (best) and
    step 2 (last); "one resumed" continues from step 2, its eval at step 3 does not beat step 1's, and
    save_keep_last=1 removes step 2 but never the best."""
    save = root / "save"
    assert sorted(path.name for path in save.iterdir() if path.is_dir()) == ["step_00000001", "step_00000003"]
    assert (save / "best").read_text().strip() == "step_00000001"
    assert (save / "latest").read_text().strip() == "step_00000003"
    log, records = runs["one"]
    assert "checkpoint saved: " in log and log.count("checkpoint saved: ") == 2
    resumed_log, resumed = runs["one resumed"]
    assert "resumed from DCP checkpoint" in resumed_log and [r["step"] for r in resumed] == [3, 3]
    summary = json.loads((root / "one" / "one_resumed" / "summary.json").read_text())
    assert summary["evals"] == 1 and summary["eval_best_step"] == 1
    assert summary["eval_loss_best"] == evals(records)[0]["eval_loss"] == evals(resumed)[0]["eval_loss"]
    assert "removed step_00000002" in resumed_log
