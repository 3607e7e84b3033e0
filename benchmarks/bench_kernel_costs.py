"""Where the time of the host-bound norms and of the fused linear cross-entropy goes (GPU only).

Diagnostics behind docs/benchmarks.md, not a provider comparison: the machine's copy and
matmul ceilings; the fused linear cross-entropy's per-chunk GEMMs and cross-entropy pass
timed one by one at several chunk sizes, cross-entropy block sizes and a two-stream variant
of the chunk loop (``flce``); the three GEMMs under every operand layout and cuBLAS vs
cuBLASLt (``gemm``) and with PyTorch's TunableOp (``tunable``); and LayerNorm's host cost against its raw-launcher lower bound, aten
and an empty ``autograd.Function``, at 8 rows (pure host cost) and 8192 (``lean``); the
Gluon weight-gradient GEMMs of ``benchmarks/gluon_dw_gemm.py`` against cuBLAS, alone and in
the loss's chunk loop (``dwgemm``). Prints its findings.

    python benchmarks/bench_kernel_costs.py            # all
    PART=lean python benchmarks/bench_kernel_costs.py  # or PART=flce, ce, gemm, tunable, dwgemm
"""
import sys, time, os
import torch, triton, triton.testing
import torch.nn.functional as F
import ckpt.kernels as K
from ckpt.kernels.cross_entropy import launch_ce
dev = "cuda"
if not torch.cuda.is_available():
    sys.exit("bench_kernel_costs: needs a CUDA GPU")
bench = lambda f, rep=100: triton.testing.do_bench(f, warmup=10, rep=rep, return_mode="median")
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
os.system("lscpu | grep -E 'Model name|MHz' | head -3")
# ceilings
x = torch.randn(2**30 // 2, device=dev, dtype=torch.bfloat16); y = torch.empty_like(x)
t = bench(lambda: y.copy_(x)); print(f"copy {2*x.numel()*2/t/1e9:.2f} TB/s", flush=True)
del x, y
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
t = bench(lambda: a @ b); print(f"mm8192 {2*8192**3/t/1e9:.0f} TFLOP/s", flush=True)
del a, b
PART = os.environ.get("PART", "all")
if PART in ("all", "flce"):
    cem = sys.modules["ckpt.kernels.cross_entropy"]
    N, H, V = 8192, 4096, 128256
    W = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    hid0 = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    tgt = torch.randint(0, V, (N,), device=dev)
    dw = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.01
    for C in (256, 512, 1024):
        h = hid0[:C]; G = torch.empty(C, V, device=dev, dtype=torch.bfloat16)
        t_log = bench(lambda: torch.mm(h, W.t(), out=G))
        lr = torch.empty(C, device=dev); sc = torch.ones(1, device=dev) / N
        t_ce = bench(lambda: launch_ce(G, tgt[:C], lr, G, sc, -100, 0.0, 0.0))
        G.copy_(torch.randn_like(G) * 1e-3)
        t_dw1 = bench(lambda: dw.addmm_(G.t(), h))
        dh = torch.empty(C, H, device=dev, dtype=torch.bfloat16)
        t_dh = bench(lambda: torch.mm(G, W, out=dh))
        fl = 2 * C * V * H / 1e9
        print(f"C={C}: logits {t_log:.3f} ms ({fl/t_log:.0f} TFLOP/s)  ce {t_ce:.3f}  d_weight+= {t_dw1:.3f} "
              f"({fl/t_dw1:.0f})  d_hidden {t_dh:.3f} ({fl/t_dh:.0f});  x{N//C} chunks = "
              f"{(N//C)*(t_log+t_ce+t_dw1+t_dh):.1f} ms", flush=True)
        del G, dh
    del dw
    C = 512
    G = torch.empty(C, V, device=dev, dtype=torch.bfloat16)
    lr = torch.empty(C, device=dev); sc = torch.ones(1, device=dev) / N
    torch.mm(hid0[:C], W.t(), out=G)
    for bv, nw in [(8192, 8), (4096, 8), (16384, 16), (8192, 16), (4096, 4), (2048, 4)]:
        t = bench(lambda: cem._ce[(C,)](G, G, tgt, lr, sc, G.stride(0), G.stride(0), 0, V, -100, 0.0, 0.0,
                                        COMPUTE_GRAD=True, HAS_SMOOTHING=False, BLOCK_V=bv, num_warps=nw))
        print(f"ce C={C} BLOCK_V={bv} warps={nw}: {t:.3f} ms ({2*C*V*2/t/1e9:.2f} TB/s)", flush=True)
        torch.mm(hid0[:C], W.t(), out=G)
    side = torch.cuda.Stream()
    def flce(mode, C=512):
        hid = hid0
        dw = torch.empty_like(W)
        G = torch.empty(C, V, device=dev, dtype=torch.bfloat16)
        lr = torch.empty(N, device=dev)
        main = torch.cuda.current_stream()
        for i, s0 in enumerate(range(0, N, C)):
            h = hid[s0:s0 + C]
            torch.mm(h, W.t(), out=G)
            launch_ce(G, tgt[s0:s0 + C], lr[s0:s0 + C], G, sc, -100, 0.0, 0.0)
            if mode == "seq":
                torch.mm(G.t(), h, out=dw) if i == 0 else dw.addmm_(G.t(), h)
                torch.mm(G, W, out=h)
            else:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    torch.mm(G.t(), h, out=dw) if i == 0 else dw.addmm_(G.t(), h)
                dh = torch.mm(G, W)  # separate buffer in this prototype: h is read by dw on the side stream
                main.wait_stream(side)
                h.copy_(dh)
        return dw
    for mode in ("seq", "2stream", "seq"):
        t = bench(lambda: flce(mode), rep=400)
        torch.cuda.reset_peak_memory_stats(); b0 = torch.cuda.memory_allocated(); flce(mode); torch.cuda.synchronize()
        print(f"flce proto {mode}: {t:.2f} ms peak {(torch.cuda.max_memory_allocated()-b0)/2**20:.0f} MiB", flush=True)
    hh = hid0.clone().requires_grad_(); ww = W.clone().requires_grad_()
    def ours():
        l = K.fused_linear_cross_entropy(hh, ww, tgt, inplace=True); l.backward()
    t = bench(ours, rep=400); print(f"ours full fn chunk auto: {t:.2f} ms", flush=True)
    del W, hid0, G, hh, ww
    torch.cuda.empty_cache()
if PART in ("all", "ce"):
    # Schedules of the cross-entropy row kernel (benchmarks/ce_variants.py) against the
    # library's, at the loss's chunk (512 rows) and the cross-entropy case (8192 rows):
    # checked against the library's output, then timed next to a plain copy of the same bytes.
    import ce_variants as CEV
    V = 128256
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for C in (512, 8192):
        L = torch.randn(C, V, device=dev, dtype=torch.bfloat16) * 3
        tgt = torch.randint(0, V, (C,), device=dev)
        sc = torch.ones(1, device=dev) / C
        lr0 = torch.empty(C, device=dev); g0 = torch.empty_like(L)
        launch_ce(L, tgt, lr0, g0, sc, -100, 0.0, 0.0)
        lr = torch.empty(C, device=dev); g = torch.empty_like(L)
        t = bench(lambda: g.copy_(L)); print(f"ce C={C} copy of the same bytes: {t:.3f} ms ({2*L.numel()*2/t/1e9:.2f} TB/s)", flush=True)
        t = bench(lambda: launch_ce(L, tgt, lr, g, sc, -100, 0.0, 0.0)); print(f"ce C={C} library: {t:.3f} ms", flush=True)
        cfgs = [(C, 8192, 8, False, 1), (C, 8192, 8, True, 1), (C, 8192, 8, True, 3),
                (nsm, 8192, 8, True, 1), (nsm, 8192, 8, True, 3), (nsm, 8192, 16, True, 3), (nsm, 4096, 8, True, 4),
                (2 * nsm, 8192, 8, True, 1), (2 * nsm, 8192, 8, True, 3), (2 * nsm, 4096, 8, True, 3),
                (4 * nsm, 8192, 8, True, 1), (4 * nsm, 4096, 4, True, 3), (8 * nsm, 4096, 4, True, 1)]
        for (P, bv, nw, rev, ns) in cfgs:
            try:
                g.zero_(); lr.zero_()
                CEV.launch(L, tgt, lr, g, sc, P, bv, nw, rev, ns)
                ok = torch.equal(lr, lr0) and torch.equal(g, g0)
                t = bench(lambda: CEV.launch(L, tgt, lr, g, sc, P, bv, nw, rev, ns))
                print(f"ce C={C} programs={P} BLOCK_V={bv} warps={nw} reverse={rev} stages={ns}: {t:.3f} ms "
                      f"{'same' if ok else 'DIFFERS'}", flush=True)
            except Exception as e:
                print(f"ce C={C} programs={P} {bv} {nw} {rev} {ns}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
        del L, g, g0
        torch.cuda.empty_cache()
if PART in ("all", "lean"):
    # Lower bound of a Python-dispatched LayerNorm: the library's two kernels launched through
    # their compiled launchers directly (no argument checks, no launch cache), against the
    # library path, aten, and an empty autograd.Function; host time per call and do_bench, at
    # 8 rows (GPU work negligible: pure host cost) and 8192 rows (the benchmark's shape),
    # three interleaved rounds; plus the GPU time of one CUDA-graph replay at 8192 rows.
    from ckpt.kernels._reduce import split_rows, tickets, DW_BLOCK_C, DW_BLOCK_R
    lnm = sys.modules["ckpt.kernels.layer_norm"]
    rt = triton.knobs.runtime
    raw_stream = torch._C._cuda_getCurrentRawStream
    def go(k, g0, *args):
        k.run(g0, 1, 1, raw_stream(0), k.function, k.packed_metadata, None, rt.launch_enter_hook,
              rt.launch_exit_hook, *args)
    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a): return a.view_as(a)
        @staticmethod
        def backward(ctx, g): return g
    def host_us(fn, iters=300):
        for _ in range(20): fn()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(iters): fn()
        torch.cuda.synchronize(); return (time.perf_counter() - t0) / iters * 1e6
    n = 4096
    cases = {}
    for rows in (8, 8192):
        x = torch.randn(rows, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        bb = torch.randn(n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        for lk in (lnm._fwd, lnm._bwd):
            lk._compiled.clear()
        y = K.layer_norm(x, w, bb); y.backward(dy)  # compiles and caches this shape's kernels
        ref = [t.detach().clone() for t in (y, x.grad, w.grad, bb.grad)]
        x.grad = w.grad = bb.grad = None
        del y
        kf, kb = (next(iter(lk._compiled.values()))[0] for lk in (lnm._fwd, lnm._bwd))
        splits, per = split_rows(rows, n, x.device)
        cbs = n // DW_BLOCK_C
        bs = min(32, 1 << (splits - 1).bit_length())
        def make_raw(rows=rows, kf=kf, kb=kb, splits=splits, per=per, bs=bs):
            class RawLN(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, w, b):
                    y = torch.empty_like(x)
                    st = torch.empty((2, rows), dtype=torch.float32, device=x.device)
                    go(kf, rows, x, y, w, b, st, n, n, rows, n, 1e-5, 4096, True)
                    ctx.save_for_backward(x, w, st)
                    return y
                @staticmethod
                def backward(ctx, dy):
                    x, w, st = ctx.saved_tensors
                    dx = torch.empty_like(x)
                    part = torch.empty((2, splits, n), dtype=torch.float32, device=x.device)
                    dw = torch.empty_like(w); db = torch.empty_like(w)
                    go(kb, cbs * splits + rows, dy, x, w, st, dx, part, dw, db, tickets(dy, cbs), n, n, rows, n,
                       per, splits, cbs, cbs * splits, 4096, DW_BLOCK_R, DW_BLOCK_C, bs, True, True)
                    return dx, dw, db
            return RawLN
        RawLN = make_raw()
        yr = RawLN.apply(x, w, bb); yr.backward(dy)
        for a, b_ in zip(ref, (yr, x.grad, w.grad, bb.grad)):
            assert torch.equal(a, b_), "raw launch path differs from the library path"
        x.grad = w.grad = bb.grad = None
        del yr
        if rows == 8192:  # GPU time alone: one CUDA-graph replay of forward + backward
            for name, f in (("ours", lambda a, b, c: K.layer_norm(a, b, c)),
                            ("aten", lambda a, b, c: F.layer_norm(a, (n,), b, c))):
                xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, bb))  # fresh graph
                s_ = torch.cuda.Stream(); s_.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s_):
                    for _ in range(3):
                        out = f(xg, wg, bg); out.backward(dy); xg.grad = wg.grad = bg.grad = None
                    del out
                torch.cuda.current_stream().wait_stream(s_)
                g_ = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_):
                    out = f(xg, wg, bg); out.backward(dy)
                print(f"LN {name}: one CUDA-graph replay of forward + backward {bench(g_.replay)*1e3:.1f} us", flush=True)
                del g_, out
        def fb(f, x=x, w=w, bb=bb, dy=dy):
            def g():
                out = f(); out.backward(dy); x.grad = w.grad = bb.grad = None
            return g
        cases[rows] = {
            "aten LN fwd+bwd": fb(lambda x=x, w=w, bb=bb: F.layer_norm(x, (n,), w, bb)),
            "ours LN fwd+bwd": fb(lambda x=x, w=w, bb=bb: K.layer_norm(x, w, bb)),
            "raw-launch LN fwd+bwd": fb(lambda x=x, w=w, bb=bb, R=RawLN: R.apply(x, w, bb)),
            "empty autograd.Function fwd+bwd": fb(lambda x=x: Noop.apply(x)),
            "ours RMS fwd+bwd": fb(lambda x=x, w=w: K.rms_norm(x, w)),
            "aten RMS fwd+bwd": fb(lambda x=x, w=w: F.rms_norm(x, (n,), w, 1e-6)),
        }
    for rnd in range(3):
        for rows, items in cases.items():
            for name, fn in items.items():
                print(f"lean[{rnd}] rows={rows:5d} {name:34s} host {host_us(fn):7.1f} us   "
                      f"do_bench {bench(fn)*1e3:7.1f} us", flush=True)
if PART in ("all", "gemm"):
    # The three FLCE GEMMs at C tokens per chunk: operand layouts and cuBLAS vs cuBLASLt.
    N, H, V = 8192, 4096, 128256
    W = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    dW = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.01
    def ev_ms(f, reps=20):
        for _ in range(3): f()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record()
        for _ in range(reps): f()
        e.record(); e.synchronize(); return s.elapsed_time(e) / reps
    for C in (512, 1024):
        h = torch.randn(C, H, device=dev, dtype=torch.bfloat16)
        hT = h.t().contiguous()
        G = (torch.randn(C, V, device=dev) * 1e-3).to(torch.bfloat16)
        Gt = G.t().contiguous()
        out_l = torch.empty(C, V, device=dev, dtype=torch.bfloat16); out_lt = torch.empty(V, C, device=dev, dtype=torch.bfloat16)
        dh = torch.empty(C, H, device=dev, dtype=torch.bfloat16)
        fl = 2 * C * V * H / 1e9
        variants = {
            "logits h@W.T": lambda: torch.mm(h, W.t(), out=out_l),
            "logits^T W@h.T": lambda: torch.mm(W, h.t(), out=out_lt),
            "dW+= G.T@h": lambda: dW.addmm_(G.t(), h),
            "dW+= Gt@h": lambda: dW.addmm_(Gt, h),
            "dW+= G.T@hT.T": lambda: dW.addmm_(G.t(), hT.t()),
            "dW+= Gt@hT.T": lambda: dW.addmm_(Gt, hT.t()),
            "dh G@W": lambda: torch.mm(G, W, out=dh),
            "dh Gt.T@W": lambda: torch.mm(Gt.t(), W, out=dh),
        }
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for name, f in variants.items():
                t = ev_ms(f)
                print(f"gemm C={C} {lib:8s} {name:16s} {t:.3f} ms {fl / t:5.0f} TFLOP/s", flush=True)
        del h, hT, G, Gt, out_l, out_lt
    torch.backends.cuda.preferred_blas_library("cublas")
    del W, dW
    torch.cuda.empty_cache()
    hh = torch.randn(N, H, device=dev, dtype=torch.bfloat16).requires_grad_()
    ww = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16).requires_grad_()
    tgt = torch.randint(0, V, (N,), device=dev)
    for lib in ("cublas", "cublaslt", "cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        def ours():
            l = K.fused_linear_cross_entropy(hh, ww, tgt, inplace=True); l.backward()
        t = triton.testing.do_bench(ours, warmup=5, rep=400, grad_to_none=[hh, ww], return_mode="median")
        print(f"flce ours {lib}: {t:.2f} ms", flush=True)
if PART in ("all", "tunable"):
    # Fused linear CE with PyTorch's TunableOp (cuBLAS/cuBLASLt algorithms benchmarked per GEMM
    # shape on first use) against the default heuristics, same process, same inputs.
    N, H, V = 8192, 4096, 128256
    hh = torch.randn(N, H, device=dev, dtype=torch.bfloat16).requires_grad_()
    ww = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16).requires_grad_()
    tgt = torch.randint(0, V, (N,), device=dev)
    def ours():
        l = K.fused_linear_cross_entropy(hh, ww, tgt, inplace=True); l.backward()
    tun = torch.cuda.tunable
    for mode in ("default", "tunable", "default", "tunable"):
        tun.enable(mode == "tunable")
        if mode == "tunable":
            tun.tuning_enable(True)
            tun.set_max_tuning_duration(30)
            tun.set_max_tuning_iterations(30)
            t0 = time.perf_counter(); ours(); torch.cuda.synchronize()
            print(f"tunable: first call (tuning) {time.perf_counter() - t0:.1f} s", flush=True)
        t = triton.testing.do_bench(ours, warmup=5, rep=400, grad_to_none=[hh, ww], return_mode="median")
        print(f"flce ours {mode}: {t:.2f} ms", flush=True)
    print(tun.get_results() if hasattr(tun, "get_results") else "", flush=True)
if PART in ("all", "dwgemm"):
    # A Hopper weight-gradient GEMM in Gluon (benchmarks/gluon_dw_gemm.py) against cuBLAS:
    # correctness against an fp32 reference, time per schedule and tile at the loss's shapes,
    # and the whole chunk loop of the loss with each.
    import gluon_dw_gemm as G90
    torch.manual_seed(0)
    VARIANTS = [("coop", (128, 256, 64, 3)), ("pingpong", (128, 128, 64, 4))]
    for (C, V, H) in ((512, 128256, 4096), (300, 1000, 392), (64, 4104, 2048)):
        g = torch.randn(C, V, device=dev, dtype=torch.bfloat16) * 1e-2
        h = torch.randn(C, H, device=dev, dtype=torch.bfloat16)
        d0 = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.1
        assert G90.usable(d0, g, h), "gluon path not usable here"
        for sched, tile in VARIANTS:
            for acc in (False, True):
                ref = g.float().t() @ h.float() + (d0.float() if acc else 0)
                ours = d0.clone(); G90.addmm_t_(ours, g, h, acc, tile, sched)
                cub = d0.clone()
                if acc: cub.addmm_(g.t(), h)
                else: torch.mm(g.t(), h, out=cub)
                scale = ref.abs().max().item()
                eo = (ours.float() - ref).abs().max().item() / scale
                ec = (cub.float() - ref).abs().max().item() / scale
                ok = eo <= 2 * ec + 1e-3
                print(f"dwgemm check {sched} {tile} C={C} V={V} H={H} acc={acc}: max err/scale ours {eo:.2e} "
                      f"cublas {ec:.2e} {'ok' if ok else 'WRONG'}", flush=True)
        del g, h, d0
    for (C, H) in ((512, 4096), (256, 4096), (1024, 4096), (512, 2048)):
        V = 128256
        g = torch.randn(C, V, device=dev, dtype=torch.bfloat16) * 1e-2
        h = torch.randn(C, H, device=dev, dtype=torch.bfloat16)
        dw = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.01
        fl = 2 * C * V * H / 1e9
        t = bench(lambda: dw.addmm_(g.t(), h), rep=200)
        print(f"dwgemm C={C} H={H} cublas addmm_: {t:.3f} ms ({fl/t:.0f} TFLOP/s)", flush=True)
        for sched, tile in VARIANTS:
            try:
                t = bench(lambda: G90.addmm_t_(dw, g, h, True, tile, sched), rep=200)
                print(f"dwgemm C={C} H={H} gluon {sched} {tile}: {t:.3f} ms ({fl/t:.0f} TFLOP/s)", flush=True)
            except Exception as e:
                print(f"dwgemm C={C} H={H} gluon {sched} {tile}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        del g, h, dw
    N, H, V, C = 8192, 4096, 128256, 512
    W = (torch.randn(V, H, device=dev) * H ** -0.5).to(torch.bfloat16)
    hid0 = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    tgt = torch.randint(0, V, (N,), device=dev)
    sc = torch.ones(1, device=dev) / N
    def loop(sched, tile):
        hid = hid0.clone()
        dw = torch.empty_like(W)
        lr = torch.empty(N, device=dev)
        for i, s0 in enumerate(range(0, N, C)):
            h = hid[s0:s0 + C]
            G = torch.mm(h, W.t())
            launch_ce(G, tgt[s0:s0 + C], lr[s0:s0 + C], G, sc, -100, 0.0, 0.0)
            if sched == "cublas":
                torch.mm(G.t(), h, out=dw) if i == 0 else dw.addmm_(G.t(), h)
            else:
                G90.addmm_t_(dw, G, h, i > 0, tile, sched)
            torch.mm(G, W, out=h)
            del G
        return dw, hid
    ref = loop("cublas", None)
    for rnd in range(2):
        for sched, tile in [("cublas", None)] + VARIANTS[1:]:
            out = loop(sched, tile)
            same = all(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() < 2e-2
                       for a, b in zip(out, ref))
            t = bench(lambda: loop(sched, tile), rep=400)
            print(f"flce loop[{rnd}] dw={sched} {tile}: {t:.2f} ms {'matches cublas' if same else 'DIFFERS'}",
                  flush=True)
    del W, hid0
    torch.cuda.empty_cache()
