//! Fuzzing the plugin control files (`RUN_DIR/plugins/`, see `ferl_plugin_host::control`): reload requests as the
//! job takes them at a step boundary, the state file and responses as `ferl plugin` reads them. No panic, no hang,
//! and every request is answered, in the response file its submitter waits on.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferl_fuzz::{Answer, Expect, Target};
use ferl_plugin_host::control::{ControlDir, Response};
use ferl_plugin_host::PluginHost;
use proptest::prelude::*;

/// A run directory with a plugin host (no plugins loaded: every reload fails), reused by every input.
struct Job {
    _dir: tempfile::TempDir,
    run_dir: PathBuf,
    host: PluginHost,
}

thread_local! {
    static JOB: Job = {
        let dir = tempfile::tempdir().expect("temp dir");
        let run_dir = dir.path().to_path_buf();
        let host = PluginHost::for_run_dir(&run_dir).expect("plugin host");
        Job { _dir: dir, run_dir, host }
    };
}

/// `input[0]` picks the file (request, state, response), then its file stem up to the first newline, then its bytes.
fn control_files(input: &[u8]) -> Answer {
    let Some((&kind, rest)) = input.split_first() else {
        return Err("empty input".into());
    };
    let split = rest.iter().position(|&b| b == b'\n').unwrap_or(0);
    let stem: Vec<u8> = rest[..split]
        .iter()
        .copied()
        .filter(|&b| b != b'/' && b != 0)
        .take(64)
        .collect();
    let stem = if stem.is_empty() || stem == b"." || stem == b".." {
        b"id".to_vec()
    } else {
        stem
    };
    let content = rest.get(split + 1..).unwrap_or_default();
    JOB.with(|job| match kind % 3 {
        0 => request(job, OsStr::from_bytes(&stem), content),
        1 => state(job, content),
        _ => response(job, content),
    })
}

fn requests_dir(job: &Job) -> PathBuf {
    job.run_dir.join("plugins").join("requests")
}

fn clear(dir: &Path) {
    for entry in std::fs::read_dir(dir).expect("requests folder").flatten() {
        std::fs::remove_file(entry.path()).expect("clearing the requests folder");
    }
}

/// Drops `STEM.request` and runs a step boundary: the request must be answered in `STEM.response`.
fn request(job: &Job, stem: &OsStr, content: &[u8]) -> Answer {
    let dir = requests_dir(job);
    clear(&dir);
    let mut name = stem.to_os_string();
    name.push(".request");
    std::fs::write(dir.join(&name), content).expect("writing the request");
    job.host.step_boundary();
    let mut answer = stem.to_os_string();
    answer.push(".response");
    let bytes = std::fs::read(dir.join(&answer)).unwrap_or_else(|_| {
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        panic!("request {name:?} got no answer in {answer:?}; the folder holds {left:?}")
    });
    let response: Response =
        serde_json::from_slice(&bytes).expect("the job writes valid responses");
    assert!(
        !response.ok,
        "a reload of a plugin that is not loaded succeeded: {response:?}"
    );
    Err(response.message)
}

fn state(job: &Job, content: &[u8]) -> Answer {
    let path = job.run_dir.join("plugins").join("state.json");
    std::fs::write(&path, content).expect("writing the state file");
    ControlDir::new(&job.run_dir)
        .read_state()
        .map(drop)
        .map_err(|e| format!("{e:#}"))
}

fn response(job: &Job, content: &[u8]) -> Answer {
    let dir = requests_dir(job);
    clear(&dir);
    std::fs::write(dir.join("fuzz.response"), content).expect("writing the response");
    let got = ControlDir::new(&job.run_dir).wait_response("fuzz", Duration::ZERO);
    got.map(drop).map_err(|e| format!("{e:#}"))
}

fn json_text() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        "[a-z_ ]{0,12}".prop_map(|s| format!("{s:?}")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4).prop_map(|kv| {
                let fields: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
                format!("{{{}}}", fields.join(","))
            }),
        ]
    })
}

fn files() -> impl Strategy<Value = Vec<u8>> {
    let request = (
        "[a-z0-9.-]{1,20}",
        "[a-z]{0,8}",
        "[a-z_-]{0,12}",
        json_text(),
    )
        .prop_map(|(stem, action, name, extra)| {
            format!("\0{stem}\n{{\"action\":{action:?},\"name\":{name:?},\"x\":{extra}}}")
                .into_bytes()
        });
    let state = json_text().prop_map(|rows| {
        format!("\u{1}\n[{{\"name\":\"a\",\"kind\":\"logger\",\"version\":\"1\",\"file\":\"f\",\"sha256\":\"0\",\"state\":\"current\",\"last_error\":{rows}}}]").into_bytes()
    });
    let response = (any::<bool>(), json_text()).prop_map(|(ok, message)| {
        format!("\u{2}\n{{\"ok\":{ok},\"message\":{message}}}").into_bytes()
    });
    prop_oneof![request, state, response]
}

#[test]
fn fuzz_plugin_control_files() {
    Target::new("plugin-control", control_files)
        .generate("control files", files(), Expect::Any)
        .dictionary(&[
            b"\"action\"",
            b"\"reload\"",
            b"\"name\"",
            b"\"ok\"",
            b"\"message\"",
            b"{",
            b"}",
            b"[",
            b"]",
            b"\\u0000",
            b"\\ud800",
            b"null",
        ])
        .max_len(16 << 10)
        .run();
}
