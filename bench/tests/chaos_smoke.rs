//! A short run of `ferl-bench chaos` (about 15 s of traffic, at least one node kill and restart): no call hangs,
//! every reply is right, every kill is noticed. It needs root and a kernel that lets it make network namespaces;
//! where either is missing (some containers) it is skipped with the reason printed.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ferl-bench");

fn is_root() -> bool {
    let out = Command::new("id")
        .arg("-u")
        .output()
        .expect("running id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// Whether this process may make a network namespace (root in a container may not).
fn can_make_namespaces() -> bool {
    Command::new("unshare")
        .args(["-n", "true"])
        .status()
        .is_ok_and(|s| s.success())
}

fn row(stdout: &str, name: &str) -> f64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no row {name} in:\n{stdout}"))
}

#[test]
fn chaos_soak_of_15_s_has_no_hang_and_notices_every_kill() {
    if !is_root() || !can_make_namespaces() {
        eprintln!(
            "skipped: the chaos soak needs root and network namespaces (TUN devices); here `id -u` is not 0 or \
             `unshare -n` is refused"
        );
        return;
    }
    let out = Command::new(BIN)
        .args(["chaos", "--seconds", "15", "--kill-every-s", "4"])
        .args(["--down-s", "2", "--callers", "4"])
        .output()
        .expect("running ferl-bench chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "chaos failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(row(&stdout, "node_kills") >= 1.0, "{stdout}\n{stderr}");
    assert!(row(&stdout, "calls_completed") > 0.0, "{stdout}");
    assert_eq!(row(&stdout, "calls_hung"), 0.0, "{stdout}\n{stderr}");
    assert_eq!(row(&stdout, "data_errors"), 0.0, "{stdout}\n{stderr}");
    let bound = row(&stdout, "chaos_call_bound_s");
    assert!(row(&stdout, "worst_detection_s") < bound, "{stdout}");
}
