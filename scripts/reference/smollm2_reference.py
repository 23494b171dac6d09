#!/usr/bin/env python3
"""Reference logits and greedy ids for kvfleet's real-model tests, from Hugging Face
transformers loading the same GGUF file (weights dequantized to float32).

Run by hand, never by CI (it needs torch, about 3 GB):

    python3 -m venv /opt/refenv && /opt/refenv/bin/pip install torch transformers gguf numpy accelerate
    /opt/refenv/bin/python scripts/reference/smollm2_reference.py \
        ~/.cache/kvfleet/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        crates/kvfleet-engine/tests/fixtures/smollm2_reference.json

Output (read by crates/kvfleet-engine/tests/gguf_reference.rs):
  {"gguf", "generator", "vocab_size",
   "prompts": [{"name", "text", "ids", "logit_positions", "logits_f32le_b64",
                "top2_margin", "greedy_ids", "greedy_min_margin"}]}
`ids` are the prompt's ids exactly as transformers tokenizes them (add_special_tokens=False),
`logits_f32le_b64[i]` the full logits row at `logit_positions[i]` as little-endian f32, and
`greedy_ids` the 32 ids greedy decoding appends (`greedy_min_margin`: the smallest top-1 minus
top-2 logit margin along that continuation).
"""
import base64
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

GREEDY_TOKENS = 32


def chatml(system, user):
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


PROMPTS = [
    ("capital", "The capital of France is"),
    ("chat_hi", chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                       "Hi!")),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("counting", "1, 2, 3, 4, 5, 6, 7, 8,"),
    ("story", "Once upon a time, in a small village at the edge of a great forest, there lived"
              " an old woodcutter and his daughter. Every morning, the woodcutter"),
]


def main():
    gguf_path, out_path = sys.argv[1], sys.argv[2]
    folder, name = os.path.split(os.path.abspath(gguf_path))
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    out = {
        "gguf": name,
        "generator": (f"scripts/reference/smollm2_reference.py; transformers {transformers.__version__},"
                      f" torch {torch.__version__}, float32 (dequantized)"),
        "vocab_size": int(model.config.vocab_size),
        "prompts": [],
    }
    for pname, text in PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
        n = len(ids)
        positions = sorted({0, n // 2, n - 1})
        rows, margins = [], []
        for p in positions:
            row = logits[p].astype("<f4")
            rows.append(base64.b64encode(row.tobytes()).decode())
            top = np.sort(row)[-2:]
            margins.append(float(top[1] - top[0]))
        # Greedy decoding by hand (no generate() defaults: no repetition penalty, no EOS stop).
        seq = list(ids)
        greedy, min_margin = [], float("inf")
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                last = model(torch.tensor([seq])).logits[0, -1].float().numpy()
                top2 = np.argsort(last)[-2:]
                min_margin = min(min_margin, float(last[top2[1]] - last[top2[0]]))
                nxt = int(top2[1])
                greedy.append(nxt)
                seq.append(nxt)
        out["prompts"].append({
            "name": pname,
            "text": text,
            "ids": [int(i) for i in ids],
            "logit_positions": positions,
            "logits_f32le_b64": rows,
            "top2_margin": margins,
            "greedy_ids": greedy,
            "greedy_min_margin": min_margin,
        })
        print(f"{pname}: {n} ids, margins {[round(m, 3) for m in margins]}, "
              f"greedy min margin {min_margin:.3f}: {tok.decode(greedy)!r}", file=sys.stderr)
    with open(out_path, "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
