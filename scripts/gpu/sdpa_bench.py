#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention on the paged-decode benchmark's shape, with
contiguous K/V: batch 64, one query per sequence, 4096 keys, 32 query heads over 8 KV
heads (GQA), head_dim 128, bf16. Times each SDPA backend that accepts the shape with
CUDA events and prints JSON; `best_ms` is the fastest (the yardstick gpu-check.sh uses).
"""
import json
import sys

import torch
import torch.nn.functional as F

B, HQ, HKV, D, L = 64, 32, 8, 128, 4096
ITERS = 50


def time_ms(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / ITERS


def main():
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, L, D, device=dev, dtype=torch.bfloat16)
    kv_bytes = 2 * k.numel() * k.element_size()
    results = {}
    errors = {}

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        results["default_gqa"] = time_ms(gqa)
    except Exception as e:  # older PyTorch without enable_gqa
        errors["default_gqa"] = str(e)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None),
        }
        for name, b in backends.items():
            if b is None:
                continue
            try:
                with sdpa_kernel(b):
                    results[name + "_gqa"] = time_ms(gqa)
            except Exception as e:
                errors[name + "_gqa"] = str(e)[:200]
    except ImportError as e:
        errors["sdpa_kernel"] = str(e)
    if not results:
        # Fallback: K/V expanded to every query head (reads 4x the bytes).
        ke = k.repeat_interleave(HQ // HKV, dim=1)
        ve = v.repeat_interleave(HQ // HKV, dim=1)
        results["default_expanded_kv"] = time_ms(lambda: F.scaled_dot_product_attention(q, ke, ve))
    best = min(results, key=results.get)
    out = {
        "shape": {"batch": B, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "context": L, "dtype": "bf16"},
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "kv_bytes_per_iter": kv_bytes,
        "ms": results,
        "errors": errors,
        "best": best,
        "best_ms": results[best],
        "best_gbps": kv_bytes / (results[best] * 1e-3) / 1e9,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
