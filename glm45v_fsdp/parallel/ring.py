"""Ring attention: each rank's queries against every rank's key/value block, the blocks passed around the ring.

Layout (parallel/sequence.py, `ZigzagSequence`): the padded sequence is cut into 2r chunks and ring rank i holds
chunks i and 2r-1-i, so under the causal mask every ring rank does the same attention work. Attention sees the
rank's ring block: its own 2 chunks, in global order (under hybrid Ulysses x Ring, after the Ulysses all-to-all).

Forward, r steps: at step j the rank holds the key/value block of ring rank (i - j) mod r; it posts the block's
send to the next rank and the receive of the following block from the previous one (batched isend/irecv), computes
its queries against the block it holds while they travel, and merges the partial output into the running one with
their log-sum-exps in fp32. Key/value heads travel as they are (GQA: never repeated before the send).

Masks are pieces, computed once per micro batch on the host from the packed positions and the padding mask
(`ring_pieces`): (step, batch row or all rows, query rows, key rows, causal). A piece is either a full block (every
key precedes every query) or a square causal block whose first query and first key are the same token, so any
kernel's causal flag means the same thing; blocks above the diagonal, other samples of a packed row and padding keys
produce no piece. A step whose pieces are empty computes nothing.

Backward, r steps again: the key/value blocks go round once more and the gradient of each block travels with it,
every rank adding its contribution; after r steps each block's gradient arrives back at its owner. The per-block
backward uses the final output and log-sum-exp (the flash-attention backward), so nothing per step is saved.

The whole exchange is one custom op, `glm45v::ring_attention` -> (out, lse): selective recompute and full recompute
with keep_attention keep its outputs (memory/recompute.py), so backward does not run the forward ring again; full
recompute without keep_attention replays it.

Block kernels (`BLOCK_KERNELS`), each returning (out, lse) and taking the final (out, lse) in backward:
  reference   plain PyTorch in fp32, any device (model.attn_implementation: eager)
  cpu_flash   aten._scaled_dot_product_flash_attention_for_cpu and its backward (CPU, sdpa)
  npu_fusion  torch_npu.npu_fusion_attention / npu_fusion_attention_grad, BNSD (NPU, sdpa); the log-sum-exp is
              softmax_max + log(softmax_sum), and the backward takes the final lse as softmax_max with a sum of 1.
              Wired against a stand-in with the documented semantics (tests/test_ring.py); unverified on hardware.
  cuda_efficient  aten._scaled_dot_product_efficient_attention and its backward (CUDA, sdpa; any dtype; its lse is
              padded to a multiple of 32 rows; key/value heads repeated for GQA inside the block, not on the wire).
              Its call signature is checked on the meta device here; unverified on a GPU.
A fused kernel is checked against the reference once per process before the first step (`verify_block_kernel`): a
kernel that fails or disagrees stops the run with a message naming the key that chose it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from glm45v_fsdp.ops.verify import check_close, kernel_check, tolerance_for
from glm45v_fsdp.runtime.device import import_torch_npu

# One row per piece of work: (step, batch row or -1 for every row, q_start, q_end, k_start, k_end, causal).
PIECE_COLUMNS = 7
KV_TAG, GRAD_TAG = 11, 13


class BlockKernel:
    """Attention of a query block against a key/value block: out [B, Hq, Sq, D] and lse [B, Hq, Sq] (fp32), and the
    backward given the *final* out and lse of the rows (after every block was merged)."""

    name: str
    description: str

    def forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, S, D] -> [B, Hkv, Hq/Hkv, S, D] in fp32: the query heads that share one key/value head."""
    batch, heads, length, dim = q.shape
    return q.float().reshape(batch, kv_heads, heads // kv_heads, length, dim)


class ReferenceKernel(BlockKernel):
    name, description = "reference", "reference (plain PyTorch, fp32 scores)"

    def _probabilities(self, qg, k, causal: bool, scale: float, lse: torch.Tensor | None):
        scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) * scale
        if causal:
            above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(above, float("-inf"))
        if lse is None:
            lse = scores.logsumexp(-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, causal, scale):
        qg = _grouped(q, k.shape[1])
        probs, lse = self._probabilities(qg, k, causal, scale, None)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float())
        return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1])

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        kv_heads = k.shape[1]
        qg, dout_g, out_g = (_grouped(t, kv_heads) for t in (q, dout, out))
        probs, _ = self._probabilities(qg, k, causal, scale, _grouped(lse.unsqueeze(-1), kv_heads).squeeze(-1))
        dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, dout_g)
        dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout_g, v.float())
        delta = (dout_g * out_g).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k.float()).reshape(q.shape)
        dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg)
        return dq, dk, dv


class CpuFlashKernel(BlockKernel):
    """PyTorch's CPU flash attention: returns the log-sum-exp and takes it back in its backward; GQA native."""

    name = "cpu_flash"
    description = "aten._scaled_dot_product_flash_attention_for_cpu (out + lse)"

    def forward(self, q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out, lse, 0.0, causal, scale=scale
        )


class NpuFusionKernel(BlockKernel):
    """torch_npu's fused attention in BNSD layout (GQA native: head_num is the query heads). Causal blocks use
    sparse_mode 3 with the compressed 2048 x 2048 upper-triangular mask (square blocks: both corners agree)."""

    name = "npu_fusion"
    description = "torch_npu.npu_fusion_attention (BNSD, lse = softmax_max + log softmax_sum)"
    CAUSAL_SPARSE_MODE, MASK_SIZE, STAT_WIDTH = 3, 2048, 8

    def _mask(self, causal: bool, device: torch.device) -> dict:
        if not causal:
            return {"atten_mask": None, "sparse_mode": 0}
        mask = torch.ones(self.MASK_SIZE, self.MASK_SIZE, dtype=torch.bool, device=device).triu(1)
        return {"atten_mask": mask, "sparse_mode": self.CAUSAL_SPARSE_MODE}

    def forward(self, q, k, v, causal, scale):
        outputs = import_torch_npu().npu_fusion_attention(
            q, k, v, q.shape[1], "BNSD", scale=scale, keep_prob=1.0, **self._mask(causal, q.device)
        )
        out, softmax_max, softmax_sum = outputs[:3]
        return out, softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        stat = lse.unsqueeze(-1).expand(*lse.shape, self.STAT_WIDTH).contiguous()
        grads = import_torch_npu().npu_fusion_attention_grad(
            q,
            k,
            v,
            dout.to(q.dtype),
            q.shape[1],
            "BNSD",
            softmax_max=stat,
            softmax_sum=torch.ones_like(stat),
            attention_in=out,
            scale_value=scale,
            keep_prob=1.0,
            **self._mask(causal, q.device),
        )
        return grads[0], grads[1], grads[2]


class CudaEfficientKernel(BlockKernel):
    """PyTorch's memory-efficient attention (CUDA): any dtype, lse [B, H, ceil(Sq / 32) x 32]; no GQA, so the key/value
    heads are repeated inside the block (after the ring moved them) and their gradients folded back."""

    name = "cuda_efficient"
    description = "aten._scaled_dot_product_efficient_attention (out + lse)"
    LSE_ALIGN = 32

    @staticmethod
    def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    def forward(self, q, k, v, causal, scale):
        heads = q.shape[1]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, self._repeat(k, heads), self._repeat(v, heads), None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        heads, kv_heads = q.shape[1], k.shape[1]
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % self.LSE_ALIGN)).contiguous()
        no_dropout = torch.zeros((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.to(q.dtype),
            q,
            self._repeat(k, heads),
            self._repeat(v, heads),
            None,
            out,
            padded,
            no_dropout,
            no_dropout,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        fold = lambda t: t.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv)


BLOCK_KERNELS: dict[str, BlockKernel] = {
    kernel.name: kernel for kernel in (ReferenceKernel(), CpuFlashKernel(), NpuFusionKernel(), CudaEfficientKernel())
}
FUSED_BLOCK_KERNEL = {"cpu": "cpu_flash", "npu": "npu_fusion", "cuda": "cuda_efficient"}


def choose_block_kernel(attn_implementation: str, device_type: str) -> BlockKernel:
    """eager -> the reference everywhere; sdpa -> the device's fused kernel that returns the log-sum-exp."""
    if attn_implementation == "sdpa" and device_type in FUSED_BLOCK_KERNEL:
        return BLOCK_KERNELS[FUSED_BLOCK_KERNEL[device_type]]
    return BLOCK_KERNELS["reference"]


def verify_block_kernel(kernel: BlockKernel, device: torch.device, dtype: torch.dtype) -> None:
    """Run a fused block kernel once against the reference (forward and backward, causal and full, GQA) on `device`
    in `dtype`; ConfigError naming model.attn_implementation when it fails or disagrees."""
    if kernel.name == "reference":
        return
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, heads, 40, 16, generator=generator).to(device=device, dtype=dtype) for heads in (4, 2, 2, 4)
    )
    tolerance = tolerance_for(dtype)
    reference = BLOCK_KERNELS["reference"]
    chose = (
        f"'model.attn_implementation' = 'sdpa' chose Ring attention's fused block kernel {kernel.description} on "
        f"{device}"
    )
    fallback = "model.attn_implementation=eager to run the reference block kernel (plain PyTorch) instead"
    with kernel_check(chose, fallback):
        for causal in (False, True):
            out, lse = kernel.forward(q, k, v, causal, 0.25)
            ref_out, ref_lse = reference.forward(q, k, v, causal, 0.25)
            grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.25)
            ref_grads = reference.backward(dout, q, k, v, ref_out, ref_lse, causal, 0.25)
            names = ("output", "log-sum-exp", "dq", "dk", "dv")
            for what, got, want in zip(names, (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
                check_close(got, want, tolerance, f"{what} (causal={causal})")


@dataclass(frozen=True)
class Ring:
    """The ring of one CP group: its process group (ring order = group rank order), size and block kernel."""

    group: dist.ProcessGroup
    size: int
    kernel: BlockKernel

    def describe(self) -> str:
        return (
            f"Ring attention over {self.size} ranks (zigzag: 2 of {2 * self.size} chunks per rank), block kernel "
            f"{self.kernel.description}"
        )


# ---------------------------------------------------------------------------------------------------- pieces


def _intervals(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of True as [start, end) intervals."""
    runs, start = [], None
    for index, flag in enumerate(flags):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    if start is not None:
        runs.append((start, len(flags)))
    return runs


def sequence_segments(
    length: int, attention_mask: list[int] | None, text_positions: list[int] | None
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """One row's attention structure: [(query start, query end, key intervals)]; a query attends the keys of its
    segment's intervals that do not follow it. Segments are packed samples (a text position that does not continue
    the previous one starts a new sample, as transformers detects them); keys are the tokens whose attention mask
    is 1 (all without a mask)."""
    starts = [0]
    if text_positions is not None:
        starts += [t for t in range(1, length) if text_positions[t] != text_positions[t - 1] + 1]
    ends = starts[1:] + [length]
    valid = _intervals([bool(m) for m in attention_mask]) if attention_mask is not None else [(0, length)]
    segments = []
    for start, end in zip(starts, ends):
        keys = [(max(a, start), min(b, end)) for a, b in valid if max(a, start) < min(b, end)]
        segments.append((start, end, keys))
    return segments


def causal_pieces(q0: int, q1: int, k0: int, k1: int) -> list[tuple[int, int, int, int, bool]]:
    """Split queries [q0, q1) against keys [k0, k1) (global token indices) under the causal rule key <= query into
    full blocks and square causal blocks that start on the same token."""
    q0 = max(q0, k0)  # queries before the first key see none of them
    k1 = min(k1, q1)  # keys after the last query are seen by none
    if q0 >= q1 or k0 >= k1:
        return []
    if k1 <= q0 + 1:
        return [(q0, q1, k0, k1, False)]
    pieces = [(q0, q1, k0, q0, False)] if k0 < q0 else []
    pieces.append((q0, k1, q0, k1, True))
    if k1 < q1:
        pieces.append((k1, q1, q0, k1, False))
    return pieces


def _merge_full(pieces: list[tuple]) -> list[tuple]:
    """Join full pieces of one step that are adjacent in queries (same keys) or in keys (same queries)."""
    merged: list[list] = []
    for piece in sorted(pieces):
        if merged:
            last = merged[-1]
            same_step_row = last[:2] == list(piece[:2]) and not last[6] and not piece[6]
            if same_step_row and last[4:6] == list(piece[4:6]) and last[3] == piece[2]:
                last[3] = piece[3]
                continue
            if same_step_row and last[2:4] == list(piece[2:4]) and last[5] == piece[4]:
                last[5] = piece[5]
                continue
        merged.append(list(piece))
    return [tuple(piece) for piece in merged]


def ring_pieces(
    length: int,
    ring_size: int,
    ring_rank: int,
    rows: list[list[tuple[int, int, list[tuple[int, int]]]]],
) -> torch.Tensor:
    """The pieces of work of ring rank `ring_rank` (int64 [n, 7], see PIECE_COLUMNS) for a padded sequence of
    `length` tokens in zigzag layout, from each batch row's `sequence_segments`. Rows with the same structure share
    their pieces (row -1)."""
    chunk = length // (2 * ring_size)
    assert chunk * 2 * ring_size == length, "the layout pads to a multiple of 2 x ring size"

    def block(rank: int) -> list[tuple[int, int]]:  # (global start, local offset) of the rank's two chunks
        return [(rank * chunk, 0), ((2 * ring_size - 1 - rank) * chunk, chunk)]

    def row_pieces(segments) -> list[tuple]:
        pieces = []
        for step in range(ring_size):
            source = (ring_rank - step) % ring_size
            for q_start, q_offset in block(ring_rank):
                for k_start, k_offset in block(source):
                    for seg_start, seg_end, keys in segments:
                        qa, qb = max(q_start, seg_start), min(q_start + chunk, seg_end)
                        for key_start, key_end in keys:
                            ka, kb = max(k_start, key_start), min(k_start + chunk, key_end)
                            for a, b, c, d, causal in causal_pieces(qa, qb, ka, kb):
                                qo, ko = q_offset - q_start, k_offset - k_start
                                pieces.append((step, a + qo, b + qo, c + ko, d + ko, causal))
        return pieces

    per_row = [row_pieces(segments) for segments in rows]
    if all(pieces == per_row[0] for pieces in per_row):
        table = [(step, -1, *rest) for step, *rest in per_row[0]]
    else:
        table = [(step, row, *rest) for row, pieces in enumerate(per_row) for step, *rest in pieces]
    table = _merge_full(table)
    return torch.tensor(table, dtype=torch.int64).reshape(-1, PIECE_COLUMNS)


# ---------------------------------------------------------------------------------------------------- the ring


def _by_step(pieces: torch.Tensor, steps: int) -> list[list[tuple]]:
    grouped: list[list[tuple]] = [[] for _ in range(steps)]
    for step, row, q0, q1, k0, k1, causal in pieces.tolist():
        rows = slice(None) if row < 0 else slice(row, row + 1)
        grouped[step].append((rows, slice(q0, q1), slice(k0, k1), bool(causal)))
    return grouped


class _Exchange:
    """Batched isend/irecv on the ring: `send` goes to the next rank, tensors like `receive_like` come from the
    previous one. The sent tensors are held until `wait`, so they stay alive while in flight."""

    def __init__(
        self, group: dist.ProcessGroup, send: list[torch.Tensor], receive_like: list[torch.Tensor], tag: int
    ) -> None:
        size, rank = group.size(), group.rank()
        self.sent = send
        self.received = [torch.empty_like(t) for t in receive_like]
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % size, tag=tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(rank - 1) % size, tag=tag) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out, lse (fp32 views of the running result) += the partial result, weighted by their log-sum-exps."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(part.float() * torch.exp(part_lse - total).unsqueeze(-1))
    lse.copy_(total)


def ring_forward(q, k, v, pieces, group, kernel: BlockKernel, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    size = group.size()
    work = _by_step(pieces, size)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    key, value = k, v
    for step in range(size):
        incoming = _Exchange(group, [key, value], [key, value], KV_TAG) if step + 1 < size else None
        for rows, q_rows, k_rows, causal in work[step]:
            part, part_lse = kernel.forward(
                q[rows, :, q_rows], key[rows, :, k_rows], value[rows, :, k_rows], causal, scale
            )
            _merge(out[rows, :, q_rows], lse[rows, :, q_rows], part, part_lse.float())
        if incoming is not None:
            key, value = incoming.wait()
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, pieces, group, kernel: BlockKernel, scale: float):
    size = group.size()
    work = _by_step(pieces, size)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    key, value = k, v
    grads_like = [torch.empty(k.shape, dtype=torch.float32, device=k.device)] * 2
    sending = None  # the previous step's gradients, in flight to the next rank
    for step in range(size):
        # posted in the order the previous rank sends: its last step's gradients, then the next key/value block
        arriving = _Exchange(group, [], grads_like, GRAD_TAG) if step > 0 else None
        incoming = _Exchange(group, [key, value], [key, value], KV_TAG) if step + 1 < size else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for rows, q_rows, k_rows, causal in work[step]:
            grads = kernel.backward(
                dout[rows, :, q_rows],
                q[rows, :, q_rows],
                key[rows, :, k_rows],
                value[rows, :, k_rows],
                out[rows, :, q_rows],
                lse[rows, :, q_rows],
                causal,
                scale,
            )
            dq[rows, :, q_rows] += grads[0]
            dk[rows, :, k_rows] += grads[1]
            dv[rows, :, k_rows] += grads[2]
        if arriving is not None:
            dk_in, dv_in = arriving.wait()
            dk += dk_in
            dv += dv_in
        if sending is not None:
            sending.wait()
        sending = _Exchange(group, [dk, dv], [], GRAD_TAG)
        if incoming is not None:
            key, value = incoming.wait()
    dk, dv = _Exchange(group, [], grads_like, GRAD_TAG).wait()
    sending.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("glm45v::ring_attention", mutates_args=())
def ring_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pieces: torch.Tensor,
    group_name: str,
    kernel: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention of this rank's ring block: query [B, Hq, S, D], key/value [B, Hkv, S, D] -> (out like query,
    lse [B, Hq, S] fp32)."""
    return ring_forward(query, key, value, pieces, _resolve_process_group(group_name), BLOCK_KERNELS[kernel], scale)


@ring_attention_op.register_fake
def _(query, key, value, pieces, group_name, kernel, scale):
    return torch.empty_like(query), query.new_empty(query.shape[:-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, pieces, group_name, kernel, scale = inputs
    ctx.save_for_backward(query, key, value, pieces, *output)
    ctx.group_name, ctx.kernel, ctx.scale = group_name, kernel, scale


def _backward(ctx, dout, dlse):
    query, key, value, pieces, out, lse = ctx.saved_tensors
    group = _resolve_process_group(ctx.group_name)
    dq, dk, dv = ring_backward(dout, query, key, value, out, lse, pieces, group, BLOCK_KERNELS[ctx.kernel], ctx.scale)
    return dq, dk, dv, None, None, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
RING_ATTENTION_OP = torch.ops.glm45v.ring_attention.default


def ring_attention(q, k, v, pieces: torch.Tensor, ring: Ring, scale: float) -> torch.Tensor:
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] of this rank's ring block -> output [B, S, Hq, D] (the layout attention
    functions return)."""
    q, k, v = (t.contiguous() for t in (q, k, v))  # the blocks are sent as they lie in memory
    out, _ = ring_attention_op(q, k, v, pieces, ring.group.group_name, ring.kernel.name, scale)
    return out.transpose(1, 2)
