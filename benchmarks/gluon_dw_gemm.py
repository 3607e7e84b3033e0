"""Experiment: a Hopper GEMM in Gluon for the fused linear cross-entropy's weight-gradient update.

Not used by the library (cuBLAS stays; see "Measured" below). Kept, with
``PART=dwgemm python benchmarks/bench_kernel_costs.py``, as the record of what was tried and
as the starting point for the next attempt.

The update: ``d (M, N) = g (K, M)^T @ h (K, N) [+ d]`` in bf16 with fp32 accumulation, ``g``
the chunk's logits gradient (tokens x vocabulary), ``h`` the chunk's hidden states, ``d`` the
``V x H`` weight gradient (1 GiB). ``K`` is short (512 tokens at the Llama-3-8B shapes), so
every tile has a short matrix phase and a long memory phase (the ``d`` tile's load and
store); cuBLAS runs it at 530-585 TFLOP/s on an H200, against about 790 for a long-K GEMM.

Three schedules, all warp-specialized (ideas from NVIDIA's CUTLASS Hopper kernels and
Triton's Gluon tutorials; no code taken):

* one producer warp issues every bulk tensor copy (TMA): the ``g`` and ``h`` tiles of each K
  step into a ring of ``STAGES`` shared-memory slots, and each output tile's ``d`` tile into
  a slot of its own, early in that tile's K loop; slots are handed over through ``mbarrier``
  pairs (ready / empty);
* a persistent grid, one program per multiprocessor, output tiles N-fastest (the programs
  resident at one time share the same ``g`` block; ``h`` stays in L2);
* ``g`` is fed to ``wgmma`` as an MN-major operand through a transposed shared-memory view;
* one rounding per update: ``acc + d`` in fp32, rounded once (cuBLAS with ``beta=1`` showed
  twice the error against an fp32 reference in the same check).

``coop``: two consumer warpgroups share a 128 x 256 tile (64 x 256 each); the epilogue's
bulk store is waited for only after the next tile's second K step. ``pingpong``: two
consumer warpgroups take alternate 128 x 128 tiles, so one's epilogue runs while the other's
``wgmma`` keep the tensor cores busy; an order barrier makes their main loops alternate (a
waiter two phases ahead of a ring barrier would otherwise pass on the older phase: a first
version read stale slots and faulted once a program had more than one tile). A third schedule,
the same ping-pong with 192 x 128 tiles as three 64-row accumulators (Triton's blocks are powers
of two), for 20% fewer operand bytes per flop out of L2, was measured too (below) and removed:
its code is in commit dbe6219.

Measured (one H200, Triton 3.6, C = 512 tokens, H = 4096, V = 128256, bf16; all schedules
match the fp32 reference as closely as cuBLAS or closer): cuBLAS ``addmm_`` 0.96-1.00 ms;
``coop`` 1.11 ms (its epilogue is not overlapped); ``pingpong`` 0.97-1.01 ms, reading 8.4
TB/s of operands from L2 at both C = 512 and 1024, which caps 128 x 128 tiles at about 540
TFLOP/s here; the 192-row version 1.02 ms with 32-wide K steps (the compiler puts a
``bar.sync`` before every ``mbarrier`` wait and arrive, two per K step). At C = 256 the
ping-pong schedules beat cuBLAS by 18-20% (0.66 vs 0.82 ms), and at C = 1024 the 192-row
version by 2% (1.76 vs 1.79 ms), but the loss runs at C = 512 (its memory cap), where none is
faster: the whole loss was 40.7 ms with ``pingpong`` against 40.0 with cuBLAS in one run.
What would be left to try: TMA multicast across a cluster of two CTAs for ``g`` (not in
Gluon 3.6's Hopper API), fewer barriers per step (larger K steps need more shared memory
than the ``d`` slots leave).

Multicast, tried in session 8 (commit c90b797 holds the kernel): under Triton 3.9 (carried onto
the GPU machine's torch 2.11; this file compiles under 3.6 to 3.9, the renamed calls picked in
``_gluon``), clusters of two CTAs side by side along N, the shared ``g`` tile loaded once and
multicast. ``tma.async_load(..., multicast=True)`` into a broadcast CGA layout lowers to one
``cp.async.bulk.tensor ... multicast::cluster`` issued by cluster rank 0 alone. The kernel was
correct for a single K step on an H200 (error 2.1e-3 of the fp32 reference) and deadlocked from
the first refill of a ring slot: rank 0 refills the ``g`` slot in both CTAs, so it must hear that
rank 1's consumer released it, and Gluon's Hopper ``mbarrier.arrive`` only routes arrivals from
rank 0 (``from_cta``), not from rank 1 to rank 0. What it would take: a remote arrive from rank 1
(``mapa`` + ``mbarrier.arrive.shared::cluster`` in inline PTX, which needs the barrier's shared
address, not exposed by Gluon), or a lowering in which each CTA issues half of the multicast.

Requirements (:func:`usable`): a compute-capability-9.0 GPU, Triton 3.6 to 3.9 with Gluon, 16-bit
floats, unit inner strides and 16-byte-aligned rows and bases (TMA).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["usable", "addmm_t_", "TILE"]

#: ``coop``'s (BLOCK_M, BLOCK_N, BLOCK_K, STAGES): 128 x 256 output tiles (each consumer
#: warpgroup owns 64 x 256, 128 fp32 accumulator registers per thread), K steps of 64, three
#: K stages. Shared memory: 3 x (16 + 32) KiB of operands + 64 KiB for the d tile = 208 KiB.
TILE = (128, 256, 64, 3)


@functools.lru_cache(maxsize=1)
def _gluon():
    """The Gluon kernel, built on first use (Triton's Gluon is experimental and optional)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # names that changed between Triton 3.6 and 3.9 (the kernels compile for sm_90 under both)
    cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

    @gluon.jit
    def _load_step(g_desc, h_desc, g_bufs, h_bufs, ready, empty, it, k, off_m, off_n, STAGES: gl.constexpr):
        """Producer: K step ``k`` of a tile into ring slot ``it % STAGES`` once its consumer freed it."""
        gl.static_assert(STAGES >= 2, "the ring needs two slots or more")
        s = it % STAGES
        # a fresh barrier counts as having completed the phase before its first, so the first
        # round of waits (parity 1) passes at once
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), g_desc.block_type.nbytes + h_desc.block_type.nbytes)
        tma_load(g_desc, [k, off_m], ready.index(s), g_bufs.index(s))
        tma_load(h_desc, [k, off_n], ready.index(s), h_bufs.index(s))

    @gluon.jit
    def _mma_step(g_bufs, h_bufs, ready, empty, acc, it, first, STAGES: gl.constexpr):
        """Consumer: wait for ring slot ``it % STAGES``, issue its wgmma (one left in flight) and,
        unless this is the tile's first step, give the previous step's slot back."""
        gl.static_assert(STAGES >= 2, "the ring needs two slots or more")
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(g_bufs.index(s).permute((1, 0)), h_bufs.index(s), acc, use_acc=not first,
                            is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        if not first:
            cta_barrier()   # the previous step's wgmma is done in every warpgroup of the partition
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        return acc

    @gluon.jit
    def _producer(g_desc, h_desc, d_desc, g_bufs, h_bufs, d_buf, ready, empty, d_ready, d_empty,
                  K, tiles_n, n_tiles, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr):
        BM: gl.constexpr = d_desc.block_type.shape[0]
        BN: gl.constexpr = d_desc.block_type.shape[1]
        BK: gl.constexpr = g_desc.block_type.shape[0]
        it = 0
        t = 0
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            off_m = (tile // tiles_n) * BM
            off_n = (tile % tiles_n) * BN
            for k in range(0, K, BK):
                _load_step(g_desc, h_desc, g_bufs, h_bufs, ready, empty, it, k, off_m, off_n, STAGES)
                if ACCUMULATE:
                    # after the ring's first fill: blocking on the d slot then costs nothing
                    if k == gl.minimum(STAGES - 1, (K - 1) // BK) * BK:
                        mbarrier.wait(d_empty, (t & 1) ^ 1)
                        mbarrier.expect(d_ready, d_desc.block_type.nbytes)
                        tma_load(d_desc, [off_m, off_n], d_ready, d_buf)
                it += 1
            t += 1

    @gluon.jit
    def _consumer(g_bufs, h_bufs, d_buf, ready, empty, d_ready, d_empty, d_desc,
                  K, tiles_n, n_tiles, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr,
                  num_warps: gl.constexpr):
        BM: gl.constexpr = d_desc.block_type.shape[0]
        BN: gl.constexpr = d_desc.block_type.shape[1]
        BK: gl.constexpr = g_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        it = 0
        t = 0
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            off_m = (tile // tiles_n) * BM
            off_n = (tile % tiles_n) * BN
            acc = gl.zeros((BM, BN), gl.float32, acc_layout)
            for k in range(0, K, BK):
                acc = _mma_step(g_bufs, h_bufs, ready, empty, acc, it, k == 0, STAGES)
                if k > 0:
                    if k == BK:
                        if t > 0:
                            # the previous tile's store has read the d slot by now
                            tma.store_wait(0)
                            if ACCUMULATE:
                                mbarrier.arrive(d_empty)
                it += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            cta_barrier()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            if K <= BK:
                if t > 0:
                    tma.store_wait(0)
                    if ACCUMULATE:
                        mbarrier.arrive(d_empty)
            if ACCUMULATE:
                mbarrier.wait(d_ready, t & 1)
                acc = acc + d_buf.load(acc_layout).to(gl.float32)
            d_buf.store(acc.to(d_desc.dtype))
            fence_async_shared()
            tma_store(d_desc, [off_m, off_n], d_buf)
            t += 1
        tma.store_wait(0)

    @gluon.jit
    def _kernel(g_desc, h_desc, d_desc, K, tiles_n, n_tiles,
                ACCUMULATE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = g_desc.dtype
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
        h_bufs = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
        d_buf = gl.allocate_shared_memory(dtype, d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(d_ready, count=1)
        mbarrier.init(d_empty, count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (g_bufs, h_bufs, d_buf, ready, empty, d_ready, d_empty, d_desc, K, tiles_n, n_tiles,
                         ACCUMULATE, STAGES, num_warps)),
            (_producer, (g_desc, h_desc, d_desc, g_bufs, h_bufs, d_buf, ready, empty, d_ready, d_empty,
                         K, tiles_n, n_tiles, ACCUMULATE, STAGES)),
        ], [1], [40])

    @gluon.jit
    def _pp_producer(g_desc, h_desc, d_desc, g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty,
                     K, tiles_n, n_tiles, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr):
        BM: gl.constexpr = d_desc.block_type.shape[0]
        BN: gl.constexpr = d_desc.block_type.shape[1]
        BK: gl.constexpr = g_desc.block_type.shape[0]
        d_at = gl.minimum(STAGES - 1, (K - 1) // BK) * BK
        it = 0
        j = 0
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            off_m = (tile // tiles_n) * BM
            off_n = (tile % tiles_n) * BN
            c = j % 2
            for k in range(0, K, BK):
                _load_step(g_desc, h_desc, g_bufs, h_bufs, ready, empty, it, k, off_m, off_n, STAGES)
                if ACCUMULATE:
                    if k == d_at:
                        mbarrier.wait(d_empty.index(c), ((j // 2) & 1) ^ 1)
                        mbarrier.expect(d_ready.index(c), d_desc.block_type.nbytes)
                        tma_load(d_desc, [off_m, off_n], d_ready.index(c), d_bufs.index(c))
                it += 1
            j += 1

    @gluon.jit
    def _pp_consumer(g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty, order, d_desc,
                     K, tiles_n, n_tiles, C: gl.constexpr, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr):
        # consumer C (0 or 1) of the two warpgroups takes every other tile of this program; the
        # shared ring hands out the K steps in tile order, so the two main loops alternate and
        # each one's epilogue runs while the other's wgmmas keep the tensor cores busy
        BM: gl.constexpr = d_desc.block_type.shape[0]
        BN: gl.constexpr = d_desc.block_type.shape[1]
        BK: gl.constexpr = g_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BN, 16])
        steps = (K + BK - 1) // BK
        d_buf = d_bufs.index(C)
        j = C
        for tile in range(gl.program_id(0) + C * gl.num_programs(0), n_tiles, 2 * gl.num_programs(0)):
            off_m = (tile // tiles_n) * BM
            off_n = (tile % tiles_n) * BN
            it = j * steps
            acc = gl.zeros((BM, BN), gl.float32, acc_layout)
            if j > 0:
                # the other consumer has taken all of tile j-1's steps: only then may this one wait
                # on the ring (a waiter two phases ahead of a barrier would pass on the old phase)
                mbarrier.wait(order.index(C), ((j - 1) // 2) & 1)
            for k in range(0, K, BK):
                acc = _mma_step(g_bufs, h_bufs, ready, empty, acc, it, k == 0, STAGES)
                it += 1
            mbarrier.arrive(order.index(1 - C))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            cta_barrier()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            # this consumer's previous store (two tiles ago) has long finished reading its slot
            tma.store_wait(0)
            if ACCUMULATE:
                mbarrier.wait(d_ready.index(C), (j // 2) & 1)
                acc = acc + d_buf.load(acc_layout).to(gl.float32)
            d_buf.store(acc.to(d_desc.dtype))
            fence_async_shared()
            tma_store(d_desc, [off_m, off_n], d_buf)
            if ACCUMULATE:
                # the slot is refilled only after the store has read it
                tma.store_wait(0)
                mbarrier.arrive(d_empty.index(C))
            j += 2
        tma.store_wait(0)

    @gluon.jit
    def _pp_worker(g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty, order, d_desc,
                   K, tiles_n, n_tiles, ACCUMULATE: gl.constexpr, STAGES: gl.constexpr):
        _pp_consumer(g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty, order, d_desc,
                     K, tiles_n, n_tiles, gl.constexpr(1), ACCUMULATE, STAGES)

    @gluon.jit
    def _pp_kernel(g_desc, h_desc, d_desc, K, tiles_n, n_tiles,
                   ACCUMULATE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = g_desc.dtype
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
        h_bufs = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
        d_bufs = gl.allocate_shared_memory(dtype, [2] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(d_ready.index(i), count=1)
            mbarrier.init(d_empty.index(i), count=1)
            mbarrier.init(order.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_pp_consumer, (g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty, order, d_desc, K, tiles_n,
                            n_tiles, 0, ACCUMULATE, STAGES)),
            (_pp_worker, (g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty, order, d_desc, K, tiles_n,
                          n_tiles, ACCUMULATE, STAGES)),
            (_pp_producer, (g_desc, h_desc, d_desc, g_bufs, h_bufs, d_bufs, ready, empty, d_ready, d_empty,
                            K, tiles_n, n_tiles, ACCUMULATE, STAGES)),
        ], [4, 1], [232, 40])

    return gl, TensorDescriptor, {"coop": _kernel, "pingpong": _pp_kernel}


def _aligned(t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


@functools.lru_cache(maxsize=8)
def _device_ok(index: int) -> bool:
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        _gluon()
    except Exception:  # no Triton, or a Triton without Gluon's Hopper API
        return False
    return True


def usable(d: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether :func:`addmm_t_` can run ``d (M, N) [+]= g (K, M)^T @ h (K, N)`` on these tensors."""
    if not (d.is_cuda and g.is_cuda and h.is_cuda) or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if not (d.dtype == g.dtype == h.dtype and d.dtype in (torch.bfloat16, torch.float16)):
        return False
    if g.shape[0] != h.shape[0] or d.shape != (g.shape[1], h.shape[1]) or g.shape[0] == 0:
        return False
    if not (_aligned(d) and _aligned(g) and _aligned(h)):
        return False
    return _device_ok(d.device.index if d.device.index is not None else torch.cuda.current_device())


def addmm_t_(d: torch.Tensor, g: torch.Tensor, h: torch.Tensor, accumulate: bool,
             tile: tuple[int, int, int, int] = TILE, schedule: str = "coop") -> torch.Tensor:
    """``d = g.T @ h + (d if accumulate else 0)`` in place (shapes: ``d (M, N)``, ``g (K, M)``,
    ``h (K, N)``); call only where :func:`usable` is true. ``tile``: ``(BLOCK_M, BLOCK_N,
    BLOCK_K, STAGES)``, see :data:`TILE`. Returns ``d``."""
    gl, TensorDescriptor, kernels = _gluon()
    kernel = kernels[schedule]
    bm, bn, bk, stages = tile
    dt = gl.bfloat16 if d.dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for
    m, n = d.shape
    sms = torch.cuda.get_device_properties(d.device).multi_processor_count
    g_desc = TensorDescriptor.from_tensor(g, [bk, bm], lay([bk, bm], dt))
    h_desc = TensorDescriptor.from_tensor(h, [bk, bn], lay([bk, bn], dt))
    d_desc = TensorDescriptor.from_tensor(d, [bm, bn], lay([bm, bn], dt))
    tiles_n = -(-n // bn)
    n_tiles = -(-m // bm) * tiles_n
    if schedule == "coop":
        kernel[(min(sms, n_tiles),)](g_desc, h_desc, d_desc, g.shape[0], tiles_n, n_tiles,
                                     ACCUMULATE=accumulate, STAGES=stages, num_warps=8)
    else:
        kernel[(min(sms, n_tiles),)](g_desc, h_desc, d_desc, g.shape[0], tiles_n, n_tiles,
                                     ACCUMULATE=accumulate, STAGES=stages, num_warps=4)
    return d
