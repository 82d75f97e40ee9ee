"""glm45v-fsdp: GLM-4.5V training on PyTorch FSDP2, with a DeepSpeed compatibility layer (ds_compat)."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_version() -> str:
    for line in (ROOT / "glm45v_fsdp" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=")[1].strip().strip('"')
    raise RuntimeError("glm45v_fsdp/__init__.py has no __version__")


setup(
    name="glm45v-fsdp",
    version=read_version(),
    description="GLM-4.5V training backend on PyTorch FSDP2 with a DeepSpeed compatibility layer",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        *find_packages(include=["glm45v_fsdp", "glm45v_fsdp.*", "ds_compat", "ds_compat.*"]),
        "glm45v_fsdp.configs",
    ],
    # The top-level configs/ folder ships inside the package, so the default config is found after a
    # non-editable install too.
    package_dir={"glm45v_fsdp.configs": "configs"},
    # ds_compat/shim is not a package but a PYTHONPATH entry (`import deepspeed` -> ds_compat under ds-fsdp): its
    # `deepspeed` package and the `deepspeed` distribution metadata ship as data.
    package_data={
        "glm45v_fsdp.configs": ["*.yaml"],
        "ds_compat": ["shim/deepspeed/*.py", "shim/deepspeed-*.dist-info/*", "ds_schema.json"],
    },
    install_requires=[
        # 2.13 is the first release whose FSDP2/DTensor/DCP we test on CPU; the upper bound keeps pip from
        # pulling an untested major release.
        "torch>=2.13,<2.15",
        # 5.18 is the first release our GLM-4.5V code runs on: it hands the vision features computed first into the
        # model (mm_encoder_outputs); 5.17 builds the vision rotary differently, 5.6-5.12 lack Glm4vMoeTextExperts.
        # Below 5.24 the code falls back for the output class, create_causal_mask's keyword and transformers'
        # checkpointing switch (docs/lora.md). 5.18 admits ms-swift 4.6 (< 5.20). CI runs the model tests and two
        # training steps on exactly this lower bound (.ci/lowest-transformers).
        "transformers>=5.18,<6",
        "safetensors>=0.4",
        # the checkpoint manifests' checksums (xxh3-64, ~28 GB/s on one core; checkpoint/integrity.py)
        "xxhash>=3.0",
        "pyyaml>=6.0",
        "pillow>=10.0",
        "numpy>=1.24",
        "tqdm>=4.60",
        "hjson>=3.0",  # ds_config files may be hjson, as DeepSpeed accepts
        # ds_compat's DeepSpeed config sections (deepspeed.runtime.zero.config, ...) are pydantic models, as
        # DeepSpeed's are, so a bad section fails with the same ValidationError
        "pydantic>=2.0,<3",
    ],
    extras_require={
        # accelerate: the HF Trainer / accelerate tests of the ds-fsdp switch (tests/test_hf_integration.py);
        # mindstudio-probe (import msprobe): Ascend's CPU implementations of fused NPU ops, the independent
        # reference the tests' stand-in torch_npu is checked against (tests/test_ops.py); matplotlib: the benchmark
        # charts (tests/test_chart.py, tests/test_bench.py); trl: TRL's SFTTrainer through the DeepSpeed door
        # (tests/test_glm_door_trl.py); av: the video decoding tests (tests/test_video_decode.py builds its files with
        # PyAV 18's encoder API); datasets: data.dataset=hf (tests/test_hf_datasets.py); peft: the reference LoRA
        # runs and adapter files are compared with (tests/test_lora.py); pytest-rerunfailures: a test whose process
        # crashed beneath Python runs once more (tests/conftest.py RankCrashed)
        "test": [
            "pytest>=8,<10",
            "pytest-rerunfailures>=14,<17",
            "ruff>=0.5",
            "tensorboard>=2.14",
            "accelerate>=1.10,<2",
            "mindstudio-probe>=26.2,<27",
            "matplotlib>=3.7",
            "trl>=1.16,<2",
            "datasets>=3",
            "av>=18",
            "peft>=0.21,<0.23",
        ],
        "tensorboard": ["tensorboard>=2.14"],
        # PyAV: decoding the video files of data records (glm45v_fsdp/data/video.py)
        "video": ["av>=12"],
        # Hugging Face `datasets`: data.dataset=hf (glm45v_fsdp/data/hf_datasets.py)
        "hf": ["datasets>=3"],
        # the PNG charts of `python -m glm45v_fsdp.tools.bench` (glm45v_fsdp/bench/charts.py)
        "bench": ["matplotlib>=3.7"],
        "deepspeed": ["deepspeed>=0.19,<0.20"],
        # torch_npu must match the installed torch and CANN; pin it with the version Ascend publishes for it.
        "npu": ["torch_npu"],
        # CUDA: varlen flash attention for model.ops (attention: flash_attn); builds against the installed torch
        "flash-attn": ["flash-attn>=2.6"],
    },
    entry_points={
        "console_scripts": [
            "glm45v-train=glm45v_fsdp.train:main",
            "ds-fsdp=ds_compat.launcher:main",
        ]
    },
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
