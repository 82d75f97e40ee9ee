"""The README's weights-and-tools section runs as written, top to bottom, from outside the checkout."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import clean_env, free_port

REPO = Path(__file__).resolve().parents[1]


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block under `heading`, continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading) :]
    block = section[section.index("```bash\n") + len("```bash\n") : section.index("\n```", section.index("```bash"))]
    commands, current = [], ""
    for line in block.splitlines():
        code = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not code:
            continue
        current += code[:-1] + " " if code.endswith("\\") else code
        if not code.endswith("\\"):
            commands.append(" ".join(current.split()))
            current = ""
    return commands


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            "--rdzv_backend=c10d",
            *argv[1:],
        ]
    elif argv[0] == "python":
        argv[0] = sys.executable
    result = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def test_weights_section_runs_top_to_bottom(tmp_path):
    commands = readme_block("## Weights, checkpoints and tools")
    assert len(commands) >= 8 and commands[0].startswith("python -m glm45v_fsdp.train")
    # a command naming nothing under runs/ (preflight, plan) neither needs nor changes what the others write: it
    # runs beside them, on the core a 1-rank step leaves idle
    with ThreadPoolExecutor() as pool:
        apart = [pool.submit(run, command, tmp_path) for command in commands if "runs/" not in command]
        for command in [command for command in commands if "runs/" in command]:
            result = run(command, tmp_path)
            if "compare-batches" in command:
                assert "result: all equal" in result.stdout, result.stdout
        for done in apart:
            done.result()
    assert (tmp_path / "runs" / "ft_hf" / "model.safetensors.index.json").is_file()
    resumed = [json.loads(line)["step"] for line in (tmp_path / "runs" / "ft2" / "metrics.jsonl").open()]
    assert resumed == list(range(21, 31))  # the 2-rank run continued the 1-rank run's checkpoint at step 20
