#!/usr/bin/env python3
"""Write the tokenizer.json that Hugging Face transformers builds from a GGUF file.

Run by hand (not by CI) to refresh the reference fixture of the GGUF tokenizer test
(crates/kvfleet-engine/tests/gguf_tokenizer.rs):

    python scripts/reference/gguf_tokenizer_json.py \
        ~/.cache/kvfleet/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf \
        crates/kvfleet-engine/tests/fixtures/smollm2_gguf_tokenizer.json

Needs `transformers` and `gguf` (transformers 5 also imports torch to read GGUF
headers; the reference venv at /opt/refenv has all three). Only the tokenizer is
built; no weights are loaded.

transformers replaces the pre-tokenizer only for the `tokenizer.ggml.pre` names it
maps (llama-bpe, qwen2, ...). For others, `smollm` among them, it keeps GPT-2's
ByteLevel pre-tokenizer, whereas SmolLM2's own tokenizer.json (and llama.cpp's
`smollm` regexes) split digits individually first. The file is written as
transformers builds it; the script prints, for a few probe strings, where that differs
from SmolLM2's original pre-tokenizer (only non-ASCII numerals do, since the vocabulary
has single-digit tokens only). The Rust test swaps the original one in itself.
"""

import argparse
import json
import os
import sys

from transformers import AutoTokenizer
from tokenizers import Tokenizer, pre_tokenizers

# The pre-tokenizer of HuggingFaceTB/SmolLM2-*'s tokenizer.json (StarCoder's family).
SMOLLM_PRE = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]
)

PROBES = ["123", " 1234 x", "x²½ ٣٤", "a1b22c333", "Version 3.14.159", "①②③ ⅷ"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="path to the .gguf file")
    ap.add_argument("out", help="where to write tokenizer.json")
    args = ap.parse_args()

    directory, name = os.path.split(os.path.abspath(args.gguf))
    hf = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    backend = hf.backend_tokenizer
    print(f"transformers pre_tokenizer: {backend.pre_tokenizer.__getstate__()}", file=sys.stderr)
    original = Tokenizer.from_str(backend.to_str())
    original.pre_tokenizer = SMOLLM_PRE
    for text in PROBES:
        a = backend.encode(text, add_special_tokens=False).ids
        b = original.encode(text, add_special_tokens=False).ids
        print(f"{text!r}: transformers {a} original {b}{'' if a == b else '  DIFFER'}", file=sys.stderr)
    # Compact JSON: the fixture is committed, and pretty-printing doubles its size.
    backend.save(args.out, pretty=False)
    print(
        f"wrote {args.out}: vocab {backend.get_vocab_size(with_added_tokens=True)}, "
        f"bos {hf.bos_token!r} eos {hf.eos_token!r} add_bos {getattr(hf, 'add_bos_token', None)}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
