//! The deployment files checked as their tools check them: the systemd unit
//! with `systemd-analyze verify` and `security --offline=yes`, the
//! Kubernetes manifests with `kubernetes-validate --strict` and `checkov`,
//! the Containerfile with checkov, and the configurations they carry with
//! the daemon's own parser. The tools are installed by `.ci/run`; a test
//! whose tool is missing fails and says how to install it.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// Runs `program` (or the path in `$env_var`), failing with `install` when
/// it is not there.
fn tool(program: &str, env_var: &str, install: &str) -> Command {
    let path = std::env::var(env_var).unwrap_or_else(|_| program.to_owned());
    let found = Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{program} is needed for this test and was not found (set ${env_var} or put it on PATH); install it with `{install}` (.ci/run does)"
    );
    Command::new(path)
}

fn output(cmd: &mut Command) -> (Output, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

fn systemd_analyze() -> Command {
    tool(
        "systemd-analyze",
        "SYSTEMD_ANALYZE",
        "apt-get install systemd",
    )
}

/// The unit as installed, with the test's daemon binary in ExecStart
/// (`verify` checks that the program exists), in a directory of its own;
/// with the by-id drop-in when `by_id`.
fn installed_unit(by_id: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(repo("deploy/systemd/bpfmapd.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/bpfmapd "), "{unit}");
    let bin = Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"));
    let unit = unit.replace(
        "ExecStart=/usr/local/bin/bpfmapd ",
        &format!("ExecStart={} ", bin.display()),
    );
    std::fs::write(dir.path().join("bpfmapd.service"), unit).unwrap();
    if by_id {
        let d = dir.path().join("bpfmapd.service.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::copy(
            repo("deploy/systemd/bpfmapd.service.d/by-id.conf"),
            d.join("by-id.conf"),
        )
        .unwrap();
    }
    dir
}

/// `systemd-analyze security --offline=yes` of the unit in `dir`: its
/// overall exposure (0 to 10), checked against 2.9 by systemd itself.
fn exposure(dir: &Path) -> f64 {
    let (out, text) = output(
        systemd_analyze()
            .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.display()))
            .args([
                "security",
                "--offline=yes",
                "--threshold=29",
                "bpfmapd.service",
            ]),
    );
    let level = text
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for bpfmapd.service: "))
        .and_then(|(_, v)| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{text}"));
    assert!(
        out.status.success(),
        "exposure {level} is above 2.9:\n{text}"
    );
    level
}

#[test]
fn the_systemd_unit_verifies_and_its_exposure_is_low() {
    for by_id in [false, true] {
        let dir = installed_unit(by_id);
        let (out, text) = output(
            systemd_analyze()
                .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display()))
                .args(["verify", "bpfmapd.service"]),
        );
        assert!(out.status.success(), "{text}");
        assert_eq!(text.trim(), "", "systemd-analyze verify warned");
        let level = exposure(dir.path());
        eprintln!(
            "systemd-analyze security --offline=yes bpfmapd.service{}: {level}",
            if by_id { " (with by-id.conf)" } else { "" }
        );
    }
}

#[test]
fn the_unit_grants_what_the_daemon_needs_and_nothing_more() {
    let unit = std::fs::read_to_string(repo("deploy/systemd/bpfmapd.service")).unwrap();
    let setting = |text: &str, key: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("{key}=")))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(setting(&unit, "Type"), ["notify"]);
    assert_eq!(setting(&unit, "ExecReload"), ["/bin/kill -HUP $MAINPID"]);
    assert_eq!(setting(&unit, "StateDirectory"), ["bpfmapd"]);
    assert_eq!(setting(&unit, "ConfigurationDirectory"), ["bpfmapd"]);
    assert_eq!(setting(&unit, "NoNewPrivileges"), ["yes"]);
    let caps = ["CAP_BPF CAP_DAC_READ_SEARCH"];
    assert_eq!(setting(&unit, "AmbientCapabilities"), caps);
    assert_eq!(setting(&unit, "CapabilityBoundingSet"), caps);
    let filter = setting(&unit, "SystemCallFilter");
    assert!(
        filter
            .iter()
            .any(|f| f.split_whitespace().any(|s| s == "bpf")),
        "bpf(2) must stay allowed: {filter:?}"
    );
    let by_id =
        std::fs::read_to_string(repo("deploy/systemd/bpfmapd.service.d/by-id.conf")).unwrap();
    let caps = ["CAP_BPF CAP_DAC_READ_SEARCH CAP_SYS_ADMIN"];
    assert_eq!(setting(&by_id, "AmbientCapabilities"), caps);
    assert_eq!(setting(&by_id, "CapabilityBoundingSet"), caps);

    // The user it runs as.
    let (out, text) = output(
        tool(
            "systemd-sysusers",
            "SYSTEMD_SYSUSERS",
            "apt-get install systemd",
        )
        .arg("--dry-run")
        .arg(repo("deploy/systemd/bpfmapd.sysusers")),
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Creating user 'bpfmapd'"), "{text}");
}
