#!/usr/bin/env python3
"""How far apart two emulations of a dynamic fp8_tensor layer land when FC2's input scale differs by
one bf16 step of FC1's amax (what expect_dynamic_scales allows between the device and the
reference), everything else equal: the rel. L2 distance of their outputs, for the ordinary rows and
for a row of x scaled by 64 (the valid-rows test's last token), with and without that row in the
call. CPU only (PyTorch's float8_e4m3fn for the rounding); qwen35-a3b's H and I, 16 experts with
8 picked per token, random weights and inputs; ~5 minutes.
  python3 bench/pending/fc2_scale_step.py"""
import math

import torch

H, I, E, K, T = 2048, 512, 16, 8, 128


def e4m3(v):
    return v.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)


def bf16(v):
    return v.to(torch.bfloat16).to(torch.float64)


def rel_l2(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


def per_tensor(w):
    scale = w.abs().amax(dim=(1, 2)) / 448
    return e4m3(w / scale[:, None, None]) * scale[:, None, None]


def main():
    torch.manual_seed(0)
    for trial in range(6):
        w1 = per_tensor(torch.randn(E, 2 * I, H, dtype=torch.float64) / math.sqrt(H))
        w2 = per_tensor(torch.randn(E, H, I, dtype=torch.float64) / math.sqrt(I))
        x = torch.randn(T, H, dtype=torch.float64)
        x[-1] *= 64
        ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
        weights = torch.rand(T, K, dtype=torch.float64)
        weights /= weights.sum(1, keepdim=True)
        for rows in (T, T - 1):  # the large row valid (the clamped count), or not
            xs = x[:rows]
            sx = xs.abs().max() / 448
            xq = e4m3(xs / sx) * sx
            h = torch.zeros(rows, K, I, dtype=torch.float64)
            for t in range(rows):
                for j in range(K):
                    gu = w1[ids[t, j]] @ xq[t]
                    g, u = gu[:I], gu[I:]
                    h[t, j] = bf16(g / (1 + torch.exp(-g)) * u)

            def forward(s2):
                hq = e4m3(h / s2) * s2
                y = torch.zeros(rows, H, dtype=torch.float64)
                for t in range(rows):
                    for j in range(K):
                        y[t] += weights[t, j] * (w2[ids[t, j]] @ hq[t, j])
                return y

            s2 = h.abs().max() / 448
            ya, yb = forward(s2), forward(s2 * (1 + 2**-7))
            ordinary = min(rows, T - 1)
            line = f"trial {trial}, {rows} rows: ordinary rows {rel_l2(yb[:ordinary], ya[:ordinary]):.2e}"
            if rows == T:
                line += f", the x64 row {rel_l2(yb[ordinary:], ya[ordinary:]):.2e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
