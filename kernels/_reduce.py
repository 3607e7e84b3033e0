"""Finishing the norms' weight-gradient reductions: partial rows, summed in split order.

The norms' weight-gradient programs each store one fp32 partial row (per program in the one-pass
backwards; per column block and row split in the wide-row backwards). :func:`sum_split_rows` adds a column
block's partial rows in split order (deterministic) and stores the result straight into the
parameter's dtype. The one-pass backwards (RMSNorm's and LayerNorm's, planned by
:func:`one_pass_plan`: programs that each cover every column) call it from a small launch after
theirs. For rows too wide for one pass, RMSNorm calls it from extra programs of its ``dx`` launch,
which follows the partial rows' launch; LayerNorm makes partial rows and ``dx`` in one launch, and
the programs of a column block count themselves in on an atomic ticket (:func:`last_to_arrive`)
and the last to arrive does the sum. Tickets live in one small int32 row per device and stream
(:func:`tickets`), re-armed to zero by the program that used them, so no launch clears them
and CUDA-graph replays find them zero.

Shapes: partial rows ``(splits, N)`` fp32, contiguous; outputs ``(N,)``.
"""

from __future__ import annotations

import functools
import threading

import torch

from ._utils import jit_helper, next_power_of_2, num_programs, tl

__all__ = [
    "split_rows",
    "one_pass_plan",
    "load_rows",
    "tickets",
    "last_to_arrive",
    "sum_split_rows",
    "DW_BLOCK_R",
    "DW_BLOCK_C",
]

#: tile of the column-parallel weight-gradient kernels: rows x columns per step
DW_BLOCK_R, DW_BLOCK_C = 32, 128

#: one-pass backward tiling (tuned on an H200 at 8192 x 4096 and 16384 x 2048 bf16): one program per SM,
#: each step loads about 16 KiB of ``dy`` (and of ``x``), loads pipelined up to 3 steps ahead within the
#: shared memory budget
_BWD_PER_SM, _BWD_STEP_BYTES, _BWD_MAX_STAGES, _SMEM_BUDGET = 1, 16384, 3, 96 * 1024


@functools.lru_cache(maxsize=256)
def one_pass_plan(
    n_rows: int, block: int, x_bytes: int, dy_bytes: int, device: torch.device
) -> tuple[int, ...]:
    """(programs, rows per program, rows per step, pipeline stages, warps) of a norm's one-pass backward:
    persistent programs, each over its own contiguous rows, a few rows per step with the next steps'
    loads in flight; ``dy_bytes``: bytes per element of every gradient tile a step loads."""
    step = min(max(1, _BWD_STEP_BYTES // (block * x_bytes)), 16, next_power_of_2(n_rows))
    stages = min(_BWD_MAX_STAGES, max(1, _SMEM_BUDGET // (step * block * (x_bytes + dy_bytes))))
    steps = -(-n_rows // step)
    programs = num_programs(device, steps, per_sm=_BWD_PER_SM)
    per = -(-steps // programs) * step
    tile = step * block
    warps = 4 if tile <= 1024 else 8 if tile <= 8192 else 16
    return -(-n_rows // per), per, step, stages, warps


@jit_helper
def last_to_arrive(TICKET, n_programs):
    """Count this program in at ``TICKET`` (an int32 from :func:`tickets`); true in the program
    that arrives last of ``n_programs``, which may then read what all of them stored before
    arriving, and which must store 0 back into ``TICKET`` when done. A barrier, then one
    gpu-scope acquire-release atomic: the serial split-K semaphore pattern."""
    tl.debug_barrier()
    return tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu") == n_programs - 1


@jit_helper
def load_rows(DY, X, STAT, start, r_end, cols, cmask, stride_dy, stride_x, BLOCK_R: tl.constexpr):
    """Rows ``start .. start + BLOCK_R`` (those below ``r_end``) of ``dy`` and ``x`` at ``cols``, in fp32,
    and their per-row statistic at ``STAT`` (a norm's rstd); also the row indices and the tile mask: one
    step of a one-pass backward."""
    rows = start + tl.arange(0, BLOCK_R)
    rmask = rows < r_end
    m = rmask[:, None] & cmask[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    stat = tl.load(STAT + rows, mask=rmask, other=0.0)
    return rows, m, dy, x, stat


@jit_helper
def sum_split_rows(PART, OUT, cols, cmask, n_splits, N, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """``OUT[cols] = sum_s PART[s, cols]`` over ``n_splits`` fp32 partial rows of length ``N``,
    in split order (deterministic), cast to ``OUT``'s dtype. Loads bypass L1 (``.cg``): the
    rows may have been stored by other programs of the same launch."""
    tot = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        srows = s0 + tl.arange(0, BLOCK_S)
        m = (srows < n_splits)[:, None] & cmask[None, :]
        tot += tl.load(PART + srows[:, None] * N + cols[None, :], mask=m, other=0.0, cache_modifier=".cg")
    tl.store(OUT + cols, tl.sum(tot, axis=0).to(OUT.dtype.element_ty), mask=cmask)


@functools.lru_cache(maxsize=256)
def split_rows(n_rows: int, n: int, device: torch.device) -> tuple[int, int]:
    """(row splits, rows per split) for a column-parallel weight-gradient kernel: about
    four programs per SM in total, each over a multiple of :data:`DW_BLOCK_R` rows."""
    col_blocks = -(-n // DW_BLOCK_C)
    want = max(1, num_programs(device, 1 << 30, per_sm=4) // col_blocks)
    splits = max(1, min(want, -(-n_rows // DW_BLOCK_R)))
    per = -(-n_rows // splits)
    per = -(-per // DW_BLOCK_R) * DW_BLOCK_R
    return -(-n_rows // per), per


# Ticket counters: one zeroed int32 buffer per device, one row of it per stream that uses
# tickets. Rows, not a buffer per stream, so that a stream first seen while a CUDA graph is
# being captured (torch.compile's "reduce-overhead" records on its own stream) takes a row of
# a buffer that already exists instead of allocating inside the graph's memory pool, which the
# recording reports as a leak; the buffer itself is made outside any graph pool
# (_zeros_outside_graph_pools), also when the first call is a compiled warm-up.
_TICKET_ROWS, _TICKET_WIDTH = 32, 1024
_tickets: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> its row (a device has rows 0..n-1)
_ticket_bufs: dict[int, torch.Tensor] = {}  # device -> the buffer those rows belong to
_retired: list[torch.Tensor] = []  # replaced buffers, kept: kernels may still use them


def _zeros_outside_graph_pools(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters from the device's ordinary memory, made on a helper thread.

    torch.compile's CUDA graphs (``mode="reduce-overhead"``) run their warm-up calls with this
    thread's allocations routed into the graph's private pool, where every allocation must be
    a graph output; a buffer that outlives the call is reported as a leak. The helper thread
    is not routed, so the counters come from the ordinary pool; it waits for its own zero fill.
    While a stream is being captured (a hand-made ``torch.cuda.graph``) the buffer is made in
    place: the capture forbids allocating elsewhere, and the graph keeps its pool alive.
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(shape, dtype=torch.int32, device=device)
    made: list = []

    def make() -> None:
        try:
            with torch.cuda.device(device):
                t = torch.zeros(shape, dtype=torch.int32, device=device)
                torch.cuda.current_stream().synchronize()
            made.append(t)
        except BaseException as e:  # re-raised on the caller's thread
            made.append(e)

    helper = threading.Thread(target=make, name="ckpt-kernels-tickets")
    helper.start()
    helper.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def tickets(like: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` zeroed int32 counters on ``like``'s device, private to the current stream.

    A kernel that finishes a reduction in its last program counts arrivals here and
    re-arms each counter to zero when done, so the counters are all zero between launches
    and one allocation serves every call (also under CUDA-graph replay). One row of
    counters per (device, stream): kernels on different streams may run at the same time.
    """
    dev = like.get_device()
    key = (dev, torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0)
    t = _tickets.get(key)
    if t is not None and t.numel() >= count:
        return t
    buf = _ticket_bufs.get(dev)
    streams = [k for k in _tickets if k[0] == dev and k != key] + [
        key
    ]  # those with a row here, this one last
    if buf is None or buf.shape[0] < len(streams) or buf.shape[1] < count:
        if buf is not None:
            _retired.append(buf)
        rows = max(_TICKET_ROWS, 2 * len(streams))
        buf = _ticket_bufs[dev] = _zeros_outside_graph_pools((rows, max(count, _TICKET_WIDTH)), like.device)
        for i, k in enumerate(streams):  # every stream of this device moves to the new buffer
            _tickets[k] = buf[i]
    else:
        _tickets[key] = buf[len(streams) - 1]
    return _tickets[key]
