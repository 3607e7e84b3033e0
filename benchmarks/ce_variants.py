"""Experimental schedules of the cross-entropy row kernel (GPU only; ``PART=ce`` of
bench_kernel_costs.py). Same math as ``ckpt.kernels.cross_entropy._ce_kernel`` (its per-block
helpers); what varies is
how the two passes over a row meet the memory system:

* ``REVERSE``: pass 2 walks the row backwards, so it starts with the blocks pass 1 read last
  (the ones most likely still in L2).
* persistent grid (``P`` programs, each looping over rows ``pid, pid+P, ...``): only ``P`` rows
  are in flight at once, so ``P x 250 KB`` stays well under the 50 MB L2 and pass 2 re-reads
  from L2 rather than HBM. With one program per row (``P = N``) every row is in flight and the
  rows evict each other before pass 2.
* ``NS``: software-pipelined loads (``tl.range(num_stages=NS)``), more bytes in flight per program.
"""
import triton
import triton.language as tl

from ckpt.kernels.cross_entropy import ce_grad_block, ce_grad_scale, ce_row_loss, ce_stats_block


@triton.jit
def ce_sched_kernel(
    LOGITS, GRAD, TARGET, LOSS, SCALE,
    stride_l, stride_g, stride_scale, N, V, ignore_index, label_smoothing, z_loss,
    COMPUTE_GRAD: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
    REVERSE: tl.constexpr, NS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols0 = tl.arange(0, BLOCK_V)
    nblk = tl.cdiv(V, BLOCK_V)
    for r in range(pid, N, nprog):
        row = r + tl.zeros([], tl.int64)
        t = tl.load(TARGET + row).to(tl.int64)
        valid = t != ignore_index
        base = LOGITS + row * stride_l
        m = -float("inf")
        s = 0.0
        sum_x = 0.0
        for b in tl.range(0, nblk, num_stages=NS):
            m, s, sum_x = ce_stats_block(base, b * BLOCK_V, cols0, V, m, s, sum_x, HAS_SMOOTHING)
        lse, loss = ce_row_loss(base, t, valid, m, s, sum_x, V, label_smoothing, z_loss, HAS_SMOOTHING)
        tl.store(LOSS + row, loss)
        if COMPUTE_GRAD:
            scale, coef = ce_grad_scale(SCALE, row, stride_scale, valid, lse, z_loss)
            gbase = GRAD + row * stride_g
            for j in tl.range(0, nblk, num_stages=NS):
                if REVERSE:
                    b2 = nblk - 1 - j
                else:
                    b2 = j
                ce_grad_block(base, gbase, b2 * BLOCK_V, cols0, t, lse, coef, scale, V, label_smoothing)


def launch(logits, target, loss_rows, grad, scale, programs, block, warps, reverse, ns):
    n, v = logits.shape
    ce_sched_kernel[(min(programs, n),)](
        logits, grad, target, loss_rows, scale, logits.stride(0), grad.stride(0),
        0 if scale.numel() == 1 else scale.stride(0), n, v, -100, 0.0, 0.0,
        COMPUTE_GRAD=True, HAS_SMOOTHING=False, BLOCK_V=block, REVERSE=reverse, NS=ns, num_warps=warps)
