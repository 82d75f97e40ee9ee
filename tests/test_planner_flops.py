"""The planner's FLOPs against torch.utils.flop_counter on the tiny model, one process (issue 32).

With the math attention kernel the counter sees every matmul, attention's included, and the model's forward and
backward are equal to it; for full and selective recompute (the default attention kernel, which the counter does not
see on CPU, and which keep_attention keeps) the matmuls are equal, replay included. The distributed cases (CP split,
EP) are in tests/test_planner_traffic.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from glm45v_fsdp.config import ModelConfig, RecomputeConfig, load_config
from glm45v_fsdp.data import build_dataset, build_image_processor, build_tiny_tokenizer, collate
from glm45v_fsdp.memory.recompute import apply_recompute
from glm45v_fsdp.model import build_meta_model, load_hf_config, materialize, model_loss_sum
from glm45v_fsdp.planner.flops import Shape, step_flops
from glm45v_fsdp.plans import MoEPlan, PlanContext
from glm45v_fsdp.preflight import minimal_dims
from glm45v_fsdp.runtime import select_device


@pytest.fixture(scope="module")
def setup():
    hf_config = load_hf_config(ModelConfig())
    data = load_config(None, ["data.synthetic_text_tokens=300", "data.synthetic_image_size=112"]).data
    tokenizer = build_tiny_tokenizer()
    dataset = build_dataset(data, hf_config, tokenizer, build_image_processor(hf_config.vision_config))
    batch = collate([dataset[0]], tokenizer.pad_token_id)
    patches = [int(grid.prod()) for grid in batch["image_grid_thw"]]
    tokens = batch["input_ids"].numel()
    return hf_config, batch, Shape(tokens, tokens, 1, 1, sum(patches), patches)


def counted_model(hf_config, recompute: RecomputeConfig | None):
    model = build_meta_model(hf_config)
    config = load_config()
    MoEPlan().apply(model, PlanContext(config, minimal_dims(config), hf_config, select_device("cpu")))
    matches = apply_recompute(model, recompute) if recompute else []
    materialize(model, torch.device("cpu"), 0)
    return model, sorted({name for match in matches for name in match.names})


def count(model, batch, math_attention: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs by the counter."""
    kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
    with kernel:
        with FlopCounterMode(display=False) as forward:
            loss, _ = model_loss_sum(model, batch)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def test_forward_and_backward_with_attention_equal_the_counter(setup):
    hf_config, batch, shape = setup
    model, _ = counted_model(hf_config, None)
    forward, backward = count(model, batch, math_attention=True)
    flops = step_flops(model, hf_config, shape, causal=1.0)  # the math kernel computes every score, masked or not
    assert flops.forward["text attention"] > 0 and flops.forward["vision attention"] > 0
    assert (flops.forward_total, flops.backward) == (forward, backward)
    half = step_flops(model, hf_config, shape, causal=0.5)  # what a kernel that skips masked blocks computes
    assert half.forward["text attention"] == flops.forward["text attention"] / 2


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_replay_equals_the_counter(setup, granularity):
    hf_config, batch, shape = setup
    model, modules = counted_model(hf_config, RecomputeConfig(enabled=True, granularity=granularity))
    forward, backward = count(model, batch, math_attention=False)
    flops = step_flops(model, hf_config, shape, 1.0, granularity, modules, keep_attention=True)
    attention = flops.forward["text attention"] + flops.forward["vision attention"]  # not seen by the counter
    assert flops.total - 3 * attention == forward + backward
    if granularity == "full":
        assert flops.recompute > 0.2 * flops.forward_total  # the decoder layers' and blocks' matmuls again
    else:
        assert flops.recompute == 0
