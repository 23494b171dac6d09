use super::*;
use crate::chat::ChatMessage;
use crate::tokenizer::{StreamDecoder, Tokenizer};

const NORMAL: i32 = 1;
const BYTE: i32 = 6;

/// A byte-level vocabulary: ChatML specials, a user-defined `<think>`, the letters of
/// "hello world", digits, and merges up to "hello", "Ġworld" and "12".
fn byte_vocab(pre: &str) -> GgufVocab {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![
        TOKEN_TYPE_CONTROL,
        TOKEN_TYPE_CONTROL,
        TOKEN_TYPE_CONTROL,
        4,
    ];
    let merges = [
        "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2",
    ];
    let singles = [
        "h", "e", "l", "o", "Ġ", "w", "r", "d", "1", "2", "3", "Ċ", "!",
    ];
    let merged = [
        "he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld", "12",
    ];
    for t in singles.iter().chain(&merged) {
        tokens.push((*t).to_owned());
        types.push(NORMAL);
    }
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: types,
        merges: merges.map(String::from).to_vec(),
        bos_id: Some(1),
        eos_id: Some(0),
        unk_id: None,
        pad_id: Some(0),
        chat_template: Some(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
             {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
                .into(),
        ),
        ..GgufVocab::default()
    }
}

fn id_of(v: &GgufVocab, token: &str) -> TokenId {
    v.tokens.iter().position(|t| t == token).unwrap() as TokenId
}

fn ids(v: &GgufVocab, tokens: &[&str]) -> Vec<TokenId> {
    tokens.iter().map(|t| id_of(v, t)).collect()
}

#[test]
fn byte_level_encodes_with_merges_and_whole_specials() {
    let v = byte_vocab("gpt2");
    let t = v.tokenizer().unwrap();
    assert_eq!(
        t.encode("hello world").unwrap(),
        ids(&v, &["hello", "Ġworld"])
    );
    assert_eq!(
        t.encode("<|im_start|>hello<|im_end|>\n<think>").unwrap(),
        ids(&v, &["<|im_start|>", "hello", "<|im_end|>", "Ċ", "<think>"])
    );
    assert_eq!(
        t.decode(&t.encode("hello world!\n").unwrap()).unwrap(),
        "hello world!\n"
    );
    assert!(t.is_special(1) && t.is_special(2) && !t.is_special(3));
    assert!(!t.is_special(id_of(&v, "hello")));
    // EOS first, then the end-of-turn token the template writes.
    assert_eq!(t.eos_token_ids(), vec![0, 2]);
    assert_eq!(t.bos_token_id_to_add(), None);
    assert_eq!(t.vocab_size(), v.tokens.len());
}

#[test]
fn generated_text_leaves_out_special_tokens_only() {
    let v = byte_vocab("gpt2");
    let t = v.tokenizer().unwrap();
    let generated = ids(
        &v,
        &[
            "<|im_start|>",
            "hello",
            "<think>",
            "<|endoftext|>",
            "Ġworld",
        ],
    );
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    for id in generated {
        out.push_str(&d.push(&t, id).unwrap());
    }
    out.push_str(&d.finish(&t).unwrap());
    assert_eq!(out, "hello<think> world");
}

#[test]
fn smollm_splits_digits_where_gpt2_merges_them() {
    let gpt2 = byte_vocab("gpt2");
    let smollm = byte_vocab("smollm");
    assert_eq!(
        gpt2.tokenizer().unwrap().encode("123").unwrap(),
        ids(&gpt2, &["12", "3"])
    );
    assert_eq!(
        smollm.tokenizer().unwrap().encode("123 hello").unwrap(),
        ids(&smollm, &["1", "2", "3", "Ġ", "hello"])
    );
}

#[test]
fn llama3_and_qwen2_split_digits_in_threes_and_ones() {
    let v = byte_vocab("llama-bpe");
    let t = v.tokenizer().unwrap();
    // `\p{N}{1,3}` keeps "123" together, so "12" merges; `[^\r\n\p{L}\p{N}]?\p{L}+`
    // puts the space before a word.
    assert_eq!(
        t.encode("123 world").unwrap(),
        ids(&v, &["12", "3", "Ġworld"])
    );
    let v = byte_vocab("qwen2");
    let t = v.tokenizer().unwrap();
    assert_eq!(
        t.encode("123 world").unwrap(),
        ids(&v, &["1", "2", "3", "Ġworld"])
    );
}

#[test]
fn unknown_models_and_pre_tokenizers_are_named() {
    let err = byte_vocab("mystery-pre")
        .tokenizer()
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.ggml.pre \"mystery-pre\""), "{err}");
    let mut v = byte_vocab("gpt2");
    v.model = "rwkv".into();
    let err = v.tokenizer().unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.model \"rwkv\""), "{err}");
    let mut v = byte_vocab("gpt2");
    v.eos_id = Some(10_000);
    let err = v.tokenizer().unwrap_err().to_string();
    assert!(err.contains("eos_token_id 10000"), "{err}");
    let mut v = byte_vocab("gpt2");
    v.merges.push("nospace".into());
    assert!(v.tokenizer().is_err());
    assert!(GgufVocab::default().tokenizer().is_err());
}

#[test]
fn bos_is_offered_when_the_file_asks() {
    let mut v = byte_vocab("gpt2");
    v.add_bos = Some(true);
    assert_eq!(v.tokenizer().unwrap().bos_token_id_to_add(), Some(1));
}

#[test]
fn chat_template_sees_the_files_bos_and_eos() {
    let mut v = byte_vocab("gpt2");
    v.chat_template = Some("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}".into());
    let rendered = v
        .chat_template()
        .unwrap()
        .render(&[ChatMessage::user("hi")], &[], true)
        .unwrap();
    assert_eq!(rendered, "<|im_start|>hi<|endoftext|>");
    v.chat_template = None;
    assert!(matches!(v.chat_template().unwrap(), ChatTemplate::ChatMl));
    // Without a template the end-of-turn tokens in the vocabulary still stop generation.
    assert_eq!(v.tokenizer().unwrap().eos_token_ids(), vec![0, 2]);
}

/// A SentencePiece vocabulary without merges: `<unk>`, `<s>`, `</s>`, 256 byte tokens,
/// then scored pieces of "hello".
fn spm_vocab() -> GgufVocab {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
        scores.push(0.0);
    }
    for (piece, score) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("▁h", -3.0),
        ("ll", -3.5),
        ("▁he", -4.0),
        ("llo", -4.5),
        ("▁hello", -5.0),
        ("▁w", -6.0),
    ] {
        tokens.push(piece.into());
        types.push(NORMAL);
        scores.push(score);
    }
    GgufVocab {
        model: "llama".into(),
        tokens,
        token_types: types,
        scores,
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        ..GgufVocab::default()
    }
}

#[test]
fn sentencepiece_merges_from_scores_and_falls_back_to_bytes() {
    let v = spm_vocab();
    let t = v.tokenizer().unwrap();
    assert_eq!(t.encode("hello").unwrap(), ids(&v, &["▁hello"]));
    // 'é' is not a piece: its UTF-8 bytes are.
    assert_eq!(
        t.encode("hello é").unwrap(),
        ids(&v, &["▁hello", "▁", "<0xC3>", "<0xA9>"])
    );
    // As in SentencePiece, text after a special token and text that starts with a
    // space get the prefix "▁" too.
    assert_eq!(t.encode("<s>hello").unwrap(), ids(&v, &["<s>", "▁hello"]));
    assert_eq!(t.encode(" hello").unwrap(), ids(&v, &["▁", "▁hello"]));
    assert_eq!(
        t.decode(&t.encode("hello é w").unwrap()).unwrap(),
        "hello é w"
    );
    assert!(t.is_special(0) && t.is_special(1) && t.is_special(2));
    // SentencePiece files without the flag get BOS, as llama.cpp gives them.
    assert_eq!(t.bos_token_id_to_add(), Some(1));
    assert_eq!(t.eos_token_ids(), vec![2]);
}

#[test]
fn sentencepiece_without_scores_or_merges_is_refused() {
    let mut v = spm_vocab();
    v.scores.clear();
    let err = v.tokenizer().unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.scores"), "{err}");
}

#[test]
fn merges_follow_transformers_generate_merges_order() {
    let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc"]
        .map(String::from)
        .to_vec();
    let scores = [0.0, 0.0, 0.0, -1.0, -1.0, -2.0];
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as TokenId))
        .collect();
    let merges = merges_from_scores(&tokens, &scores, &vocab);
    let pairs: Vec<(&str, &str)> = merges
        .iter()
        .map(|(l, r)| (l.as_str(), r.as_str()))
        .collect();
    // Best score first; for "abc", ("a","bc") sorts before ("ab","c") by vocabulary
    // ids, then the longer left piece wins the reversed sort.
    assert_eq!(pairs, [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]);
}

#[test]
fn byte_spelling_matches_gpt2() {
    assert_eq!(byte_char(b' '), 'Ġ');
    assert_eq!(byte_char(b'\n'), 'Ċ');
    assert_eq!(byte_char(b'a'), 'a');
    assert_eq!(byte_char(0), 'Ā');
    assert_eq!(byte_char(0xad), 'Ń');
    let alphabet = ByteLevel::alphabet();
    assert!((0..=255u8).all(|b| alphabet.contains(&byte_char(b))));
}
