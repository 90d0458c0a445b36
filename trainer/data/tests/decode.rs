//! Responses decoded as verl decodes them (issue 31): `decode_skip_special` is Hugging Face's
//! `tokenizer.decode(ids, skip_special_tokens=True)`, so the EOS `<|im_end|>` that ends a response and the padding
//! after it are left out; `decode` keeps them.

mod common;

use ferl_data::SftTokenizer;
use serde_json::Value;

/// Token sequences a response can be: an answer ending at EOS, one padded after EOS, one cut off without EOS, one
/// with chat markers and a `<think>` block (an added token that is not special, so it stays) inside.
fn sequences(tok: &SftTokenizer) -> Vec<Vec<i64>> {
    let (eos, pad) = (tok.eos_token_id(), tok.pad_token_id());
    let ids = |t: &str| tok.encode(t).unwrap();
    vec![
        [ids("The answer is 4"), vec![eos]].concat(),
        [ids("72"), vec![eos, pad, pad]].concat(),
        ids(" no stop here"),
        ids("<think>\nhm\n</think>\n\nok<|im_end|>\n<|im_start|>user\nagain<|endoftext|>"),
    ]
}

#[test]
fn special_tokens_are_skipped_only_by_decode_skip_special() {
    let tok = SftTokenizer::from_dir(&common::qwen_tokenizer(), None).unwrap();
    let seqs = sequences(&tok);
    let skip = |i: usize| tok.decode_skip_special(&seqs[i]).unwrap();
    assert_eq!(skip(0), "The answer is 4");
    assert_eq!(
        tok.decode(&seqs[0]).unwrap(),
        "The answer is 4<|im_end|>",
        "decode keeps special tokens"
    );
    assert_eq!(skip(1), "72");
    assert_eq!(skip(2), " no stop here");
    assert_eq!(skip(3), "<think>\nhm\n</think>\n\nok\nuser\nagain");
    assert!(tok.decode_skip_special(&[-1]).is_err(), "a negative id");
}

#[test]
fn decode_skip_special_equals_hugging_face() {
    let Some(py) = common::venv_python("transformers") else {
        return;
    };
    let tok_dir = common::qwen_tokenizer();
    let tok = SftTokenizer::from_dir(&tok_dir, None).unwrap();
    let seqs = sequences(&tok);
    let script = r#"
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps([tok.decode(ids, skip_special_tokens=True) for ids in json.loads(sys.argv[2])]))
"#;
    let o = std::process::Command::new(py)
        .args([
            "-c",
            script,
            tok_dir.to_str().unwrap(),
            &serde_json::to_string(&seqs).unwrap(),
        ])
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let hf: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    for (ids, want) in seqs.iter().zip(&hf) {
        assert_eq!(
            tok.decode_skip_special(ids).unwrap(),
            want.as_str().unwrap(),
            "{ids:?}"
        );
    }
}
