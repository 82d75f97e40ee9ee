"""The package as users get it: a wheel that carries the default configs and the deepspeed switch (ds_compat/shim),
and the glm45v-train console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_configs_and_finds_the_default_config_after_install(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("glm45v_fsdp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "glm45v_fsdp/configs/glm45v_tiny.yaml" in names
    assert "glm45v_fsdp/configs/glm45v_106b_sft.yaml" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "glm45v-train = glm45v_fsdp.train:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    probe = (
        "import glm45v_fsdp.builders, glm45v_fsdp.trainer, glm45v_fsdp.tools.preflight, ds_compat.launcher; "
        "from glm45v_fsdp.config import default_config_path, load_config; "
        "print(default_config_path()); print(load_config().model.preset)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout.split()
    assert out == [str(target / "glm45v_fsdp" / "configs" / "glm45v_tiny.yaml"), "tiny"]
    # ds_compat/shim travels as data: `import deepspeed` switches to ds_compat from the installed wheel too
    assert (
        "ds_compat/shim/deepspeed/__init__.py" in names
        and "ds_compat/shim/deepspeed-0.19.8.dist-info/METADATA" in names
    )
    switched = tmp_path / "switched.py"
    switched.write_text(
        "import importlib.metadata, deepspeed; print(deepspeed.__name__, importlib.metadata.version('deepspeed'))"
    )
    out = subprocess.run(
        [sys.executable, "-m", "ds_compat.run", str(switched)],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == ["ds_compat", "0.19.8+fsdp2"]


def test_console_script_is_the_module_entry_point(tmp_path):
    script = shutil.which("glm45v-train")
    assert script is not None, "glm45v-train is not on PATH: install the package (pip install -e .)"
    result = subprocess.run([script, "training.micro_batch_sise=2"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert "Did you mean 'training.micro_batch_size'" in result.stderr
