"""Built-in GLM-4.5V architectures as `Glm4vMoeConfig` keyword dicts (`model.preset`).

`GLM45V_CONFIG` carries the published zai-org/GLM-4.5V config.json values (rope keys in the transformers v5
`rope_parameters` form); `TINY_CONFIG` is a ~0.5M-parameter model with the same structure (vision tower, one dense
layer, then MoE layers with 3-D stacked experts and a shared expert) and the tiny tokenizer's special-token ids.
"""

from glm45v_fsdp import vocab

_ARCHITECTURES = ["Glm4vMoeForConditionalGeneration"]
# The structure both presets share: GLM-4.5V's published values the tiny model keeps (only its sizes differ).
_TEXT_STRUCTURE: dict = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
_VISION_STRUCTURE: dict = {
    "hidden_act": "silu",
    "attention_bias": False,
    "in_channels": 3,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
}

TINY_CONFIG: dict = {
    "architectures": _ARCHITECTURES,
    "text_config": {
        **_TEXT_STRUCTURE,
        "vocab_size": vocab.TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        # Rotary dim = head_dim * 0.5 = 8; mrope_section (temporal, height, width) sums to half of it.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.5,
        },
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "pad_token_id": vocab.PAD_TOKEN_ID,
        "eos_token_id": [vocab.EOS_TOKEN_ID],
    },
    "vision_config": {
        **_VISION_STRUCTURE,
        "depth": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "intermediate_size": 128,
        "out_hidden_size": 64,
        "image_size": 112,
    },
    "image_token_id": vocab.IMAGE_TOKEN_ID,
    "video_token_id": vocab.VIDEO_TOKEN_ID,
    "image_start_token_id": vocab.IMAGE_START_TOKEN_ID,
    "image_end_token_id": vocab.IMAGE_END_TOKEN_ID,
    "video_start_token_id": vocab.VIDEO_START_TOKEN_ID,
    "video_end_token_id": vocab.VIDEO_END_TOKEN_ID,
    "tie_word_embeddings": False,
}

GLM45V_CONFIG: dict = {
    "architectures": _ARCHITECTURES,
    "text_config": {
        **_TEXT_STRUCTURE,
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [8, 12, 12],
            "partial_rotary_factor": 0.5,
        },
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338],
    },
    "vision_config": {
        **_VISION_STRUCTURE,
        "depth": 24,
        "hidden_size": 1536,
        "num_heads": 12,
        "intermediate_size": 10944,
        "out_hidden_size": 4096,
        "image_size": 336,
    },
    "image_token_id": 151363,
    "video_token_id": 151364,
    "image_start_token_id": 151339,
    "image_end_token_id": 151340,
    "video_start_token_id": 151341,
    "video_end_token_id": 151342,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {"tiny": TINY_CONFIG, "glm-4.5v": GLM45V_CONFIG}
