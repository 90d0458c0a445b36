//! Multi-turn masks and parity of the chat template and token ids with Hugging Face's `apply_chat_template`.

mod common;

use std::collections::BTreeMap;

use ferl_config::SftConfig;
use ferl_data::{SftDataset, SftTokenizer};
use serde_json::{json, Value};

fn conversations() -> Vec<Value> {
    vec![
        json!([{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5\n#### 5"}]),
        json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "Another, bigger one?"},
            {"role": "assistant", "content": "  Eleven, which is 11.  "}
        ]),
        json!([
            {"role": "user", "content": "Natalia sold clips to 48 of her friends. ¿Cuántos? 日本語"},
            {"role": "assistant", "content": "<think>\nhalf of 48\n</think>\n\n24"},
            {"role": "user", "content": "And double?"},
            {"role": "assistant", "content": "48"}
        ]),
    ]
}

#[test]
fn multi_turn_mask_covers_assistant_messages_and_their_eos() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.jsonl");
    let lines: String = conversations()
        .iter()
        .map(|c| json!({"messages": c}).to_string() + "\n")
        .collect();
    std::fs::write(&file, lines).unwrap();
    let cfg = SftConfig::load(None, &["data.multiturn.enable=true".to_string()]).unwrap();
    let ds = SftDataset::load(&cfg.data, &common::qwen_tokenizer(), &[file]).unwrap();
    let tok = SftTokenizer::from_dir(&common::qwen_tokenizer(), None).unwrap();
    // Trained spans, decoded: each assistant reply (as the template renders it) up to and including <|im_end|>.
    let spans = |i: usize| -> Vec<String> {
        let s = ds.get(i);
        let mut out = Vec::new();
        let mut t = 0;
        while t < s.len() {
            if s.loss_mask[t] {
                let start = t;
                while t < s.len() && s.loss_mask[t] {
                    t += 1;
                }
                out.push(tok.decode(&s.input_ids[start..t]).unwrap());
            } else {
                t += 1;
            }
        }
        out
    };
    assert_eq!(
        spans(0),
        ["<think>\n\n</think>\n\n2+3 = 5\n#### 5<|im_end|>"]
    );
    assert_eq!(
        spans(1),
        [
            "7<|im_end|>",
            "<think>\n\n</think>\n\n  Eleven, which is 11.  <|im_end|>"
        ]
    );
    assert_eq!(
        spans(2),
        ["24<|im_end|>", "<think>\n\n</think>\n\n48<|im_end|>"]
    );
    for i in 0..3 {
        let text = tok.decode(&ds.get(i).input_ids).unwrap();
        assert!(text.starts_with("<|im_start|>"), "{text}");
        assert_eq!(
            ds.get(i).input_ids.iter().filter(|&&t| t == 151645).count(),
            conversations()[i].as_array().unwrap().len()
        );
    }
}

#[test]
fn chat_template_and_ids_match_hugging_face() {
    let Some(py) = common::venv_python("transformers") else {
        return;
    };
    let tok_dir = common::qwen_tokenizer();
    let script = r#"
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
out = []
for conv in json.load(sys.stdin):
    prompt = conv[:-1]
    p = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(conv, tokenize=False)
    out.append({"prompt": p, "prompt_ids": tok.encode(p, add_special_tokens=False), "full": full,
                "full_ids": tok.encode(full, add_special_tokens=False),
                "response_ids": tok.encode(conv[-1]["content"] + tok.eos_token, add_special_tokens=False)})
tools = [{"function": {"description": "Add two integers.", "name": "add", "parameters": {"properties":
          {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "type": "object"}},
          "type": "function"}]
msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "3+4?"}]
out.append({"tools": tools, "with_tools": tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
            tokenize=False)})
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new(py)
        .args(["-c", script, tok_dir.to_str().unwrap()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(Value::Array(conversations()).to_string().as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut hf: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    let with_tools = hf.pop().unwrap();

    let tok = SftTokenizer::from_dir(&tok_dir, None).unwrap();
    let t = tok.template().unwrap();
    let none = BTreeMap::new();
    for (conv, hf) in conversations().iter().zip(&hf) {
        let msgs = conv.as_array().unwrap();
        let prompt = t
            .render(&msgs[..msgs.len() - 1], true, None, &none)
            .unwrap();
        assert_eq!(prompt, hf["prompt"].as_str().unwrap());
        let full = t.render(msgs, false, None, &none).unwrap();
        assert_eq!(full, hf["full"].as_str().unwrap());
        let ids = |v: &Value| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(tok.encode(&prompt).unwrap(), ids(&hf["prompt_ids"]));
        assert_eq!(tok.encode(&full).unwrap(), ids(&hf["full_ids"]));
        // verl's single-turn sample: prompt ids, then the response with EOS tokenized on its own.
        let mut response = tok
            .encode(msgs.last().unwrap()["content"].as_str().unwrap())
            .unwrap();
        response.push(tok.eos_token_id());
        assert_eq!(response, ids(&hf["response_ids"]));
    }
    let msgs = [
        json!({"role": "system", "content": "Use tools."}),
        json!({"role": "user", "content": "3+4?"}),
    ];
    let ours = t
        .render(&msgs, true, Some(&with_tools["tools"]), &none)
        .unwrap();
    assert_eq!(ours, with_tools["with_tools"].as_str().unwrap());
}
