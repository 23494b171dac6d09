//! Hand-run check of the GGUF tokenizer against llama.cpp's tokenizer test vectors.
//!
//! llama.cpp ships vocabulary-only GGUF files (`models/ggml-vocab-NAME.gguf`) with
//! test texts (`.gguf.inp`, separated by `__ggml_vocab_test__` lines) and the ids the
//! model's original Hugging Face tokenizer gives them (`.gguf.out`, one line each,
//! written by `convert_hf_to_gguf_update.py` with `add_special_tokens=False`).
//!
//! ```text
//! cargo run -p kvfleet-engine --example gguf_vocab_check -- \
//!     llama.cpp/models/ggml-vocab-qwen2.gguf [more.gguf ...]
//! ```
//!
//! Prints, per file, how many texts encode to exactly the reference ids, and the
//! first mismatches; exits 1 if any text differs.

use candle_core::quantized::gguf_file::Content;
use kvfleet_core::Tokenizer;
use kvfleet_engine::gguf_tokenizer::tokenizer_from_gguf;
use std::path::Path;
use std::process::ExitCode;

fn check(path: &Path) -> Result<bool, String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let content = Content::read(&mut file).map_err(|e| format!("{}: {e}", path.display()))?;
    let (tokenizer, _) = tokenizer_from_gguf(&content, path).map_err(|e| e.to_string())?;
    let read = |ext: &str| {
        let p = format!("{}.{ext}", path.display());
        std::fs::read_to_string(&p).map_err(|e| format!("{p}: {e}"))
    };
    let inputs = read("inp")?;
    let outputs = read("out")?;
    let texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<Vec<u32>> = outputs
        .lines()
        .map(|line| {
            line.split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect()
        })
        .collect();
    let mut ok = 0;
    let mut shown = 0;
    for (text, want) in texts.iter().zip(&expected) {
        let got = tokenizer.encode(text).map_err(|e| e.to_string())?;
        if got == *want {
            ok += 1;
        } else if shown < 5 {
            shown += 1;
            println!("  {text:?}\n    ours      {got:?}\n    reference {want:?}");
        }
    }
    let total = texts.len().min(expected.len());
    println!("{}: {ok}/{total} texts match", path.display());
    Ok(ok == total)
}

fn main() -> ExitCode {
    let mut all = true;
    for arg in std::env::args().skip(1) {
        match check(Path::new(&arg)) {
            Ok(passed) => all &= passed,
            Err(e) => {
                println!("{e}");
                all = false;
            }
        }
    }
    if all {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
