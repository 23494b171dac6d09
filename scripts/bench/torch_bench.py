#!/usr/bin/env python3
"""torch (transformers, float32, GGUF dequantized) on the same GGUF: pp512, pp2048, tg128 at
batch 1, and aggregate decode at batch 4 and 8. Prints one JSON line. Used by vs_llamacpp.py."""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

gguf, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
folder, name = os.path.split(os.path.abspath(gguf))
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
g = torch.Generator().manual_seed(0)
out = {}
with torch.inference_mode():
    for n in (512, 2048):
        ids = torch.randint(300, 40000, (1, n), generator=g)
        t0 = time.perf_counter()
        model(ids)
        out[f"pp{n}"] = n / (time.perf_counter() - t0)
    for batch, key in ((1, "tg128"), (4, "agg4"), (8, "agg8")):
        ids = torch.randint(300, 40000, (batch, 32), generator=g)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=129, min_new_tokens=129,
                       do_sample=False)
        # The first new token is the prompt's prefill; count decode steps only roughly.
        out[key] = batch * 128 / (time.perf_counter() - t0)
print(json.dumps(out))
