"""Where the fused linear cross-entropy's time goes (GPU only).

A diagnostic behind docs/benchmarks.md, not a provider comparison (that is
``bench_kernels.py``). It prints, in one run on one device:

* the device's ceilings: device-to-device copy bandwidth and a bf16 8192^3 matmul rate;
* per chunk of C tokens at Llama-3-8B's head (H 4096, V 128256, bf16) the loss's four steps
  timed one by one: the logits GEMM, the cross-entropy pass (gradient written in place), the
  ``d_weight`` accumulation and the ``d_hidden`` GEMM, and what ``N / C`` chunks of them add up
  to: the floor of the chunked loss at that chunk size;
* the library's whole forward + backward at its default chunk size, for comparison.

    python benchmarks/bench_kernel_costs.py
"""

from __future__ import annotations

import sys

import torch

N, H, V = 8192, 4096, 128256
CHUNKS = (256, 512, 1024)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_kernel_costs: needs a CUDA GPU")
    import triton
    import triton.testing

    import ckpt.kernels as K
    from ckpt.kernels.cross_entropy import launch_ce

    dev = "cuda"

    def bench(fn, rep=100):
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")

    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    x = torch.randn(2**29, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    print(f"copy {2 * x.numel() * 2 / t / 1e9:.2f} TB/s", flush=True)
    del x, y
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t = bench(lambda: a @ b)
    print(f"mm 8192^3 bf16 {2 * 8192**3 / t / 1e9:.0f} TFLOP/s", flush=True)
    del a, b

    w = (torch.randn(V, H, device=dev) * H**-0.5).to(torch.bfloat16)
    hidden = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    target = torch.randint(0, V, (N,), device=dev)
    dw = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.01
    scale = torch.ones(1, device=dev) / N
    for c in CHUNKS:
        h = hidden[:c]
        g = torch.empty(c, V, device=dev, dtype=torch.bfloat16)
        loss_rows = torch.empty(c, device=dev)
        t_logits = bench(lambda: torch.mm(h, w.t(), out=g))
        t_ce = bench(lambda: launch_ce(g, target[:c], loss_rows, g, scale, -100, 0.0, 0.0, 0.0))
        g.copy_(torch.randn_like(g) * 1e-3)
        t_dw = bench(lambda: dw.addmm_(g.t(), h))
        dh = torch.empty(c, H, device=dev, dtype=torch.bfloat16)
        t_dh = bench(lambda: torch.mm(g, w, out=dh))
        flop = 2 * c * V * H / 1e9
        print(
            f"C={c}: logits {t_logits:.3f} ms ({flop / t_logits:.0f} TFLOP/s)  ce {t_ce:.3f}  "
            f"d_weight+= {t_dw:.3f} ({flop / t_dw:.0f})  d_hidden {t_dh:.3f} ({flop / t_dh:.0f});  "
            f"x{N // c} chunks = {(N // c) * (t_logits + t_ce + t_dw + t_dh):.1f} ms",
            flush=True,
        )
        del g, dh
    del dw

    hh = hidden.clone().requires_grad_()
    ww = w.clone().requires_grad_()

    def ours():
        K.fused_linear_cross_entropy(hh, ww, target, inplace=True).backward()

    t = triton.testing.do_bench(ours, warmup=5, rep=400, grad_to_none=[hh, ww], return_mode="median")
    print(f"library forward + backward, default chunk: {t:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
