"""MoE router health and balancing (glm45v_fsdp/model/router_health.py): the per-layer figures, the bias update and
the auxiliary balance loss, in process and through both doors on real ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import free_port, mean_relative_error, spawn, train_many
from torch.utils.checkpoint import checkpoint
from transformers import Glm4vMoeForConditionalGeneration

from glm45v_fsdp import vocab
from glm45v_fsdp.checkpoint.dcp import checkpoint_name, read_model_tensors
from glm45v_fsdp.config import ModelConfig, RouterConfig, load_config
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize
from glm45v_fsdp.model.loss import WholeSequence
from glm45v_fsdp.model.moe import MoEBlock, moe_blocks
from glm45v_fsdp.model.router_health import RouterMonitor, RoutingTokens, router_monitor, routing_tokens
from glm45v_fsdp.parallel.sequence import SplitSequence, ZigzagSequence
from glm45v_fsdp.plans import MoEPlan, PlanContext
from glm45v_fsdp.runtime import ParallelDims, select_device

TEXT = load_hf_config(ModelConfig()).text_config
E, K = TEXT.n_routed_experts, TEXT.num_experts_per_tok
CPU = torch.device("cpu")


def monitor_over(layers: int, **router) -> RouterMonitor:
    return RouterMonitor({layer: MoEBlock(TEXT) for layer in range(1, layers + 1)}, RouterConfig(**router))


def tiny_ours(*overrides: str) -> torch.nn.Module:
    """The tiny GLM-4.5V with our MoE blocks and router monitor (the moe plan), materialised on CPU in fp32."""
    config = load_config(None, list(overrides))
    hf_config = load_hf_config(config.model)
    model = build_meta_model(hf_config)
    MoEPlan().apply(model, PlanContext(config, ParallelDims(1, 1, 1, 1, 1, 1), hf_config, select_device("cpu")))
    materialize(model, CPU, 1234)
    return model


def tiny_batch(model: torch.nn.Module) -> dict:
    """Two right-padded text samples of 30 and 22 tokens with positions, as the collator makes them."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.full((2, 30), vocab.PAD_TOKEN_ID)
    attention_mask = torch.zeros(2, 30, dtype=torch.long)
    for row, length in enumerate((30, 22)):
        ids = torch.randint(vocab.BYTE_TOKEN_OFFSET, vocab.BYTE_TOKEN_OFFSET + 256, (length,), generator=generator)
        input_ids[row, :length] = ids
        attention_mask[row, :length] = 1
    labels = input_ids.masked_fill(attention_mask == 0, vocab.IGNORE_INDEX)
    mm_token_type_ids = torch.zeros_like(input_ids)
    positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids, None, attention_mask=attention_mask)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "mm_token_type_ids": mm_token_type_ids,
        "position_ids": positions,
    }


# 1. Figures ----------------------------------------------------------------------------------------------------------
LOADS = [6, 2, 0, 4, 4, 4, 2, 2]  # layer 1's pairs per expert: mean 3, expert 2 dead


def known_routing() -> tuple[list[torch.Tensor], list[torch.Tensor], RoutingTokens]:
    """Two layers over 12 tokens and 3 padding tokens (which all choose expert 2, and must not count): layer 1 loads
    LOADS with equal scores (entropy 1); layer 2 is even (3 pairs per expert) with one expert scored far above the
    others (entropy ~0)."""
    pairs = torch.tensor([expert for expert, count in enumerate(LOADS) for _ in range(count)])
    even = torch.arange(12)
    padding = torch.full((3, K), 2)
    ids = [
        torch.cat([pairs.view(K, 12).t(), padding]),
        torch.cat([torch.stack([even % E, (even + 4) % E], dim=1), padding]),
    ]
    peaked = torch.full((15, E), -40.0)
    peaked[:, 0] = 40.0
    logits = [torch.zeros(15, E), peaked]
    return logits, ids, RoutingTokens(torch.tensor([0] * 12 + [-1] * 3), 1, None, 1.0)


def test_figures_of_a_known_routing():
    """Exact per-layer figures of a known count matrix with a dead expert; padding is not counted; the next report
    covers only the tokens after this one."""
    monitor = monitor_over(2)
    logits, ids, tokens = known_routing()
    monitor.tokens = tokens
    for position in range(2):
        monitor.observe(position, logits[position], ids[position], 1)
    figures = monitor.take_figures(monitor.interval_stats())
    assert figures["router/layer1/load_max_over_mean"] == 2.0 and figures["router/layer1/load_min_over_mean"] == 0.0
    assert figures["router/layer1/dead_fraction"] == 1 / 8
    assert figures["router/layer2/load_max_over_mean"] == figures["router/layer2/load_min_over_mean"] == 1.0
    assert figures["router/layer2/dead_fraction"] == 0.0
    assert figures["router/layer1/entropy"] == pytest.approx(1.0, abs=1e-6)
    assert figures["router/layer2/entropy"] == pytest.approx(0.0, abs=1e-6)
    assert figures["router/worst_load_max_over_mean"] == 2.0 and figures["router/worst_load_layer"] == 1
    assert figures["router/dead_fraction"] == 1 / 16
    assert "router/aux_loss" not in figures and "router/bias_max_abs" not in figures
    monitor.observe(0, logits[1], ids[1], 1)  # the next interval: layer 1 now even
    monitor.observe(1, logits[1], ids[1], 1)
    again = monitor.take_figures(monitor.interval_stats())
    assert again["router/layer1/load_max_over_mean"] == 1.0 and again["router/dead_fraction"] == 0.0


def test_counts_forwards_but_not_the_recomputation():
    monitor = monitor_over(1)
    block = monitor.blocks[0]
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    hidden = torch.randn(2, 16, TEXT.hidden_size, requires_grad=True)
    _, _, expert_ids = block.gate(hidden.view(-1, TEXT.hidden_size))
    checkpoint(block, hidden, use_reentrant=False).sum().backward()  # forward, then again inside backward
    counts = monitor.interval_stats()[:E]
    assert torch.equal(counts, torch.bincount(expert_ids.reshape(-1), minlength=E).double())
    block.eval()  # an eval forward counts nothing
    block(hidden)
    assert not monitor.interval_stats().any()


def test_routing_tokens_of_padded_packed_and_split_batches():
    padded = {
        "input_ids": torch.zeros(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5]),
    }
    tokens = routing_tokens(padded, WholeSequence())
    assert tokens.segments.tolist() == [0, 0, 0, -1, -1, 1, 1, 1, 1, 1] and tokens.num_sequences == 2
    packed_positions = torch.tensor([0, 1, 2, 0, 1, 0, 1]).expand(4, 1, 7)
    packed = routing_tokens(
        {"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": packed_positions}, WholeSequence()
    )
    assert packed.segments.tolist() == [0, 0, 0, 1, 1, 2, 2] and packed.num_sequences == 3
    split = routing_tokens(padded, SplitSequence(None, 2, 1, vocab.PAD_TOKEN_ID))  # length 5 padded to 6, slice 1
    assert split.segments.tolist() == [-1, -1, -1, 1, 1, -1] and split.num_sequences == 2 and split.share == 0.5
    zigzag = routing_tokens(padded, ZigzagSequence(None, 2, 1, 1, 0, vocab.PAD_TOKEN_ID))  # 8 = 4 chunks of 2
    assert zigzag.segments.tolist() == [0, -1, -1, -1, 1, 1, 1, -1] and zigzag.share == 0.5  # chunks 1 and 2


# 2. Bias balancing ---------------------------------------------------------------------------------------------------
def test_bias_update_follows_the_sign_rule_and_skips_a_skipped_step():
    rate = 0.25
    monitor = monitor_over(2, bias_update_rate=rate)
    logits, ids, tokens = known_routing()
    monitor.tokens = tokens
    for position in range(2):
        monitor.observe(position, logits[position], ids[position], 1)
    monitor.end_step(stepped=True)
    expected = rate * torch.sign(3.0 - torch.tensor(LOADS, dtype=torch.float32))  # mean load 3
    assert torch.equal(monitor.blocks[0].gate.e_score_correction_bias, expected)
    assert not monitor.blocks[1].gate.e_score_correction_bias.any()  # an even layer keeps its bias
    assert monitor.interval_stats() is None  # end_step summed the statistics already
    assert monitor.take_figures(None)["router/bias_max_abs"] == rate
    monitor.observe(0, logits[0], ids[0], 1)
    monitor.end_step(stepped=False)
    assert torch.equal(monitor.blocks[0].gate.e_score_correction_bias, expected)


# 3. Auxiliary loss ---------------------------------------------------------------------------------------------------
def reference_sequence_loss(logits: list[torch.Tensor], ids: list[torch.Tensor], segments: torch.Tensor):
    """DeepSeek-V3's complementary sequence-wise balance loss, written out: per layer and sequence of T tokens,
    sum_i f_i P_i with f_i = E / (K T) x (tokens choosing i) and P_i the mean normalised sigmoid score; the mean over
    the sequences, summed over the layers."""
    total = 0.0
    for layer_logits, layer_ids in zip(logits, ids):
        per_sequence = []
        for sequence in sorted(set(segments.tolist()) - {-1}):
            rows = segments == sequence
            length = int(rows.sum())
            chosen = torch.zeros(E)
            for token in layer_ids[rows].tolist():
                for expert in token:
                    chosen[expert] += 1
            f = E / (K * length) * chosen
            scores = torch.sigmoid(layer_logits[rows])
            p = (scores / scores.sum(dim=1, keepdim=True)).mean(dim=0)
            per_sequence.append((f * p).sum())
        total = total + sum(per_sequence) / len(per_sequence)
    return total


def test_sequence_aux_loss_equals_the_reference_with_padding_and_packed_sequences():
    generator = torch.Generator().manual_seed(3)
    segments = torch.tensor([0] * 5 + [1] * 7 + [2] * 6 + [-1] * 2)  # a packed row of 2, a padded row of 6 + 2
    logits = [torch.randn(20, E, generator=generator, requires_grad=True) for _ in range(2)]
    ids = [torch.topk(layer.detach() + torch.randn(20, E, generator=generator), K).indices for layer in logits]
    monitor = monitor_over(2, aux_loss_coef=0.1)
    monitor.tokens = RoutingTokens(segments, 3, None, 1.0)
    for position in range(2):
        monitor.observe(position, logits[position], ids[position], 2)
    aux = monitor.take_aux_loss()
    reference = reference_sequence_loss(logits, ids, segments)
    assert aux.item() == pytest.approx(reference.item(), rel=1e-6) and 1.0 < aux.item() < 4.0
    ours_grad = torch.autograd.grad(aux, logits)
    reference_grad = torch.autograd.grad(reference, logits)
    for mine, theirs in zip(ours_grad, reference_grad):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    assert monitor.take_aux_loss() is None  # taken
    figures = monitor.take_figures(monitor.interval_stats())
    assert figures["router/aux_loss"] == pytest.approx(reference.item(), rel=1e-6)


def test_aux_loss_reaches_every_router_and_the_off_switches_change_nothing():
    """coef > 0: the auxiliary loss's gradient reaches each MoE layer's router weight (through the hidden states,
    the earlier layers' experts too, but not the last layer's experts nor the output layer). With the keys at 0 the
    forward and every gradient are bit-identical to a model whose blocks have no observer (the code before the
    router monitor), and the trainer adds nothing to the loss."""
    model = tiny_ours("features.router.aux_loss_coef=0.01")
    batch = tiny_batch(model)
    ce_sum, _ = model(batch)
    aux = router_monitor(model).take_aux_loss()
    aux.backward()
    for block in moe_blocks(model):
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    assert moe_blocks(model)[-1].experts.gate_up_proj.grad is None and model.lm_head.weight.grad is None

    def forward_backward(observed: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model = tiny_ours()
        if not observed:
            for block in moe_blocks(model):
                block.observer = None
        ce_sum, _ = model(tiny_batch(model))
        ce_sum.backward()
        return ce_sum.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    (loss_on, grads_on), (loss_off, grads_off) = forward_backward(True), forward_backward(False)
    assert loss_on == loss_off and grads_on.keys() == grads_off.keys()
    assert all(torch.equal(grads_on[name], grads_off[name]) for name in grads_on)


def _door_worker(rank: int, port: int) -> None:
    """1 rank: the DeepSpeed engine door with the extension's transformers-type auxiliary loss and bias balancing,
    against transformers' own model with output_router_logits=True on the same weights and batch."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import copy

    import ds_compat as deepspeed
    from glm45v_fsdp.builders import build_training_data
    from glm45v_fsdp.data.collate import collate

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(5)
    model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    reference = copy.deepcopy(model)
    reference.config.text_config.output_router_logits = True
    reference.config.text_config.router_aux_loss_coef = 0.01
    rate = 0.125
    router = {"aux_loss_coef": 0.01, "aux_loss_type": "transformers", "bias_update_rate": rate}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "glm45v_fsdp": {"features": {"router": router}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    data = build_training_data(load_config(None, ["data.shuffle=false"]), model.config)
    batch = collate([data.dataset[0], data.dataset[1]], data.tokenizer.pad_token_id)
    keys = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")
    inputs = {key: batch[key] for key in keys}
    assert bool(batch["attention_mask"].eq(0).any()), "the batch must hold padding"
    ours, theirs = engine(**inputs), reference(**inputs)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=0)
    reference.config.text_config.output_router_logits = False
    with torch.no_grad():
        cross_entropy = reference(**inputs).loss  # the loss without the router's
    torch.testing.assert_close(ours.loss.detach() - cross_entropy, 0.01 * ours.aux_loss.detach(), rtol=1e-4, atol=0)
    engine.backward(ours.loss)
    engine.step()
    for block in moe_blocks(engine.module):
        bias = block.gate.e_score_correction_bias
        assert bias.abs().max() == rate and set(bias.abs().unique().tolist()) <= {0.0, rate}, bias


def test_door_extension_aux_loss_equals_transformers_and_updates_the_bias():
    spawn(_door_worker, (free_port(),), nprocs=1)


def test_door_refuses_what_its_forward_cannot_add_or_would_drop():
    from ds_compat.glm_door import check_router_features
    from glm45v_fsdp.errors import UserError

    with torch.device("meta"):
        model = Glm4vMoeForConditionalGeneration(load_hf_config(ModelConfig()))
    model.config.text_config.output_router_logits = True  # transformers would add 1e-4 x its router loss
    with pytest.raises(UserError, match='"aux_loss_type": "transformers", "aux_loss_coef": 0.0001'):
        check_router_features(load_config(None, []), model, alst=False)
    same = ["features.router.aux_loss_type=transformers", "features.router.aux_loss_coef=1e-4"]
    check_router_features(load_config(None, same), model, alst=False)  # asked for in the extension: accepted
    with pytest.raises(UserError, match="ALST sequence parallelism"):
        check_router_features(load_config(None, same), model, alst=True)
    model.forward = lambda **batch: None  # a script's own forward (TRL's fused LM head)
    with pytest.raises(UserError, match="computes the loss itself"):
        check_router_features(load_config(None, same), model, alst=False)


# 4. Real runs: the figures over EP 2 with EP balance, Ulysses 2 and the --deepspeed door equal one process on the
# same samples; the bias is bit-identical on every rank and resumes exactly. ------------------------------------------
STEPS = 4
COMMON = [
    f"training.train_iters={STEPS}",
    "training.log_interval=1",
    "training.loss_type=per_token",  # the CE of the global batch, whatever its split into micro batches
    "training.lr=1e-3",
    "parallel.fsdp_plan.param_dtype=fp32",
    "parallel.fsdp_plan.reduce_dtype=fp32",
    "data.synthetic_samples=16",
    "model.router_skew=0.6",  # the low-numbered experts (EP rank 0's) take most pairs: EP balance replicates
    "features.router.bias_update_rate=0.05",
    "features.router.aux_loss_coef=0.01",
]
EP2 = [
    "parallel.expert_parallel_size=2",
    "features.ep_balance.enabled=true",
    "features.ep_balance.max_dup_experts_num=2",
]
DOOR_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto"}},
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3},
    "activation_checkpointing": {"cpu_checkpointing": True},  # recompute + activation offload
    "expert_parallel": {"enabled": True, "autoep_size": 2},
    "glm45v_fsdp": {
        "features": {
            "router": {"bias_update_rate": 0.05, "aux_loss_coef": 0.01},
            "ep_balance": {"enabled": True, "max_dup_experts_num": 2},
        }
    },
}


def _bias_worker(rank: int, port: int, out: str) -> None:
    """2 ranks: the EP 2 run with EP balance through `glm45v_fsdp.train.run`, then every rank's biases side by side."""
    import torch.distributed as dist

    import glm45v_fsdp.trainer as trainer_module
    from glm45v_fsdp.train import run

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    trained = []
    original = trainer_module.Trainer.run

    def run_and_keep(self):
        trained.append(self.model)
        return original(self)

    trainer_module.Trainer.run = run_and_keep
    save = Path(out) / "save"
    run(
        [
            f"training.output_dir={Path(out) / 'ep2'}",
            "training.progress_bar=false",
            "training.micro_batch_size=1",
            f"training.save={save}",
            "training.save_interval=2",
            *COMMON,
            *EP2,
        ]
    )
    biases = torch.stack([block.gate.e_score_correction_bias for block in moe_blocks(trained[0])])
    gathered = [torch.empty_like(biases) for _ in range(2)]
    dist.all_gather(gathered, biases)
    if rank == 0:
        (Path(out) / "biases.json").write_text(json.dumps([g.tolist() for g in gathered]))
        assert torch.equal(gathered[0], gathered[1]) and gathered[0].abs().max() > 0, gathered


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("router_runs")
    spawn(_bias_worker, (free_port(), str(root)), nprocs=2)
    door = root / "ds_config.json"
    door.write_text(json.dumps(DOOR_CONFIG))
    save = root / "save"
    done = train_many(
        root / "two",
        {
            "ep2 resumed": [
                "training.micro_batch_size=1",
                f"training.load={save / checkpoint_name(2)}",
                f"training.save={root / 'resave'}",
                *COMMON,
                *EP2,
            ],
            "ulysses2": ["training.micro_batch_size=2", "parallel.ulysses_parallel_size=2", *COMMON],
            "door": ["--deepspeed", str(door), "training.micro_batch_size=1", *COMMON[:-2]],
        },
        nproc=2,
    )
    done.update(
        train_many(
            root / "one",
            {"one process": ["training.micro_batch_size=1", "training.gradient_accumulation_steps=2", *COMMON]},
            1,
        )
    )
    done["ep2"] = ("", [json.loads(line) for line in (root / "ep2" / "metrics.jsonl").read_text().splitlines()])
    done["root"] = root
    return done


def router_figures(record: dict) -> dict:
    return {key: value for key, value in record.items() if key.startswith("router/")}


def assert_same_figures(test: list[dict], reference: list[dict]) -> None:
    """Every step's router figures: the load figures equal (integer counts), the entropy and aux loss within fp32
    summation order, the bias the same."""
    assert len(test) == len(reference) == STEPS
    for mine, theirs in zip(test, reference):
        mine, theirs = router_figures(mine), router_figures(theirs)
        assert mine.keys() == theirs.keys() and "router/aux_loss" in mine and "router/layer3/entropy" in mine
        for key, value in theirs.items():
            if key.endswith(("entropy", "aux_loss")):
                assert mine[key] == pytest.approx(value, rel=1e-5), key
            else:
                assert mine[key] == value, key


@pytest.mark.parametrize("name", ["ep2", "ulysses2", "door"])
def test_router_figures_and_losses_equal_one_process(runs, name):
    records, reference = runs[name][1], runs["one process"][1]
    assert_same_figures(records, reference)
    assert mean_relative_error([r["loss"] for r in records], [r["loss"] for r in reference], STEPS) <= 1e-5
    assert reference[-1]["router/bias_max_abs"] >= 0.1  # the bias moved
    if name != "ulysses2":  # EP balance ran replicas: a replicated expert still counts once
        assert all(r["ep_replicas"] > 0 for r in records)


def test_bias_is_bit_identical_on_every_rank_and_resumes_exactly(runs):
    root = runs["root"]
    biases = json.loads((root / "biases.json").read_text())
    assert biases[0] == biases[1]
    straight, resumed = runs["ep2"][1], runs["ep2 resumed"][1]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [router_figures(r) for r in resumed] == [router_figures(r) for r in straight[2:]]
    final = read_model_tensors(root / "save" / checkpoint_name(STEPS))
    again = read_model_tensors(root / "resave" / checkpoint_name(STEPS))
    keys = [key for key in final if key.endswith("e_score_correction_bias")]
    assert len(keys) == 3 and all(torch.equal(final[key], again[key]) for key in keys)
    assert torch.tensor(biases[0]).equal(torch.stack([final[key] for key in sorted(keys)]))
    assert "router max/mean" in runs["ep2 resumed"][0]


def test_progress_line_shows_the_worst_layer():
    from glm45v_fsdp.metrics import StepRecord, format_line

    record = StepRecord(1, 1.0, 1.0, 1e-3, 10.0, 1.0, 1.0, 0.0, 0.0, 1, 10, False, 0)
    record.extra = {"router/worst_load_max_over_mean": 2.5, "router/worst_load_layer": 3, "router/dead_fraction": 0.125}
    assert format_line(record, 10, "off").endswith("| router max/mean 2.50 (layer 3), dead 12.5%")
