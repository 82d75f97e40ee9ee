"""Device presets: what one accelerator computes and moves, per device and direction (docs/planning.md lists the
source of every figure and which ones are vendor-stated, paper-stated or uncertain).

Rates are line rates; `compute_efficiency` and `comm_efficiency` turn them into what a step gets. Nothing here is
fitted to a measurement we cannot make: the efficiencies are stated defaults (`--custom` changes any field), and the
`cpu` preset is the only one measured, by `python -m glm45v_fsdp.tools.plan --calibrate`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # dense peak
    fp32_tflops: float  # the matmul rate with fp32 compute
    hbm_gib: float  # usable device memory
    hbm_tbps: float  # memory bandwidth (the optimizer step is bound by it)
    intra_gbps: float  # per device and direction, to another device of its node
    inter_gbps: float  # per device and direction, through its NIC(s) to other nodes
    intra_latency_us: float  # per collective call inside a node
    inter_latency_us: float  # per collective call across nodes
    devices_per_node: int
    compute_efficiency: float = 0.5  # share of the peak the model's matmuls reach (stated, not measured)
    comm_efficiency: float = 0.7  # share of the line rate a collective reaches
    reserve_gib: float = 4.0  # kept free: allocator fragmentation, workspaces, communicator buffers
    overlap: bool = True  # collectives run beside compute (own engines and streams); False: they share its cores
    causal_share: float = 0.5  # of a causal attention's S x S scores, what the kernel computes (flash: the half)

    def peak_flops(self, dtype: str) -> float:
        return (self.bf16_tflops if dtype in ("bf16", "fp16") else self.fp32_tflops) * 1e12

    @property
    def usable_bytes(self) -> float:
        return (self.hbm_gib - self.reserve_gib) * GIB

    def with_custom(self, values: dict[str, str]) -> Device:
        fields = {f.name: f.type for f in dataclasses.fields(self)}
        changed = {}
        for key, value in values.items():
            if key not in fields or key == "name":
                raise ValueError(
                    f"--custom {key}={value}: unknown field; use any of {', '.join(f for f in fields if f != 'name')}."
                )
            try:
                if key == "overlap":  # a bool among the numbers
                    changed[key] = {"true": True, "false": False}[value.lower()]
                else:
                    changed[key] = int(value) if key == "devices_per_node" else float(value)
            except (ValueError, KeyError):
                raise ValueError(f"--custom {key}={value}: not a number (overlap: true or false).") from None
        return dataclasses.replace(self, name=f"{self.name} (custom)" if changed else self.name, **changed)


PRESETS = {
    # Atlas 800T A2 node: 8 x Ascend 910B2 (the common "910B"), HCCS full mesh, one 200 GbE RoCE port per NPU.
    # 10 us per collective: HCCL's static cost as Huawei's simulator models it (marked unconfirmed there).
    "910b": Device("Ascend 910B2 (Atlas 800T A2, 8 per node)", 376, 188, 64, 1.6, 196, 25, 10.5, 11.5, 8),
    "910b3": Device("Ascend 910B3 (Atlas 800T A2, 8 per node)", 313, 156, 64, 1.6, 196, 25, 10.5, 11.5, 8),
    # Atlas 900 A3 SuperPoD: each 910C is two dies, one rank each (16 per server); servers of one supernode reach
    # each other over the unified bus at the in-server rate (2-level UB Clos, 5.5 us) - jobs within one supernode.
    "a3": Device("Ascend 910C die (Atlas 900 A3 SuperPoD, 16 per server)", 376, 188, 64, 1.6, 196, 196, 10.5, 15.5, 16),
    # NVIDIA HGX/DGX: NVLink 4 (450 GB/s per direction) through NVSwitch, 8 x 400 Gb/s ConnectX-7 per node; NCCL
    # reaches ~370 GB/s of the NVLink line rate (comm_efficiency 0.8).
    "h100": Device("NVIDIA H100 SXM (8 per node)", 989, 495, 79.6, 3.35, 450, 50, 8, 15, 8, comm_efficiency=0.8),
    "h200": Device("NVIDIA H200 SXM (8 per node)", 989, 495, 140, 4.8, 450, 50, 8, 15, 8, comm_efficiency=0.8),
}


def load_calibration(path: Path) -> Device:
    """The `cpu` preset measured by `tools.plan --calibrate` (rates already effective: efficiencies 1)."""
    try:
        values = json.loads(Path(path).read_text())
        return Device(**values["device"])
    except FileNotFoundError:
        raise ValueError(
            f"--device cpu needs a calibration: {path} does not exist. Run `python -m glm45v_fsdp.tools.plan "
            f"--calibrate --calibration {path}` first (about a minute)."
        ) from None
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a calibration file written by tools.plan --calibrate ({error}).") from None
