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
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    // Canonical: checkov finds nothing under a path with "..".
    path.canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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
/// with the CAP_SYS_ADMIN drop-in when `sys_admin`.
fn installed_unit(sys_admin: bool) -> tempfile::TempDir {
    let bin = Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"));
    let dir = install("bpfmapd", bin);
    if sys_admin {
        let d = dir.path().join("bpfmapd.service.d");
        std::fs::create_dir(&d).unwrap();
        std::fs::copy(
            repo("deploy/systemd/bpfmapd.service.d/cap-sys-admin.conf"),
            d.join("cap-sys-admin.conf"),
        )
        .unwrap();
    }
    dir
}

/// The unit `name` of deploy/systemd, installed in a directory of its own
/// with `bin` in its ExecStart (`verify` checks that the program exists).
fn install(name: &str, bin: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(repo(&format!("deploy/systemd/{name}.service"))).unwrap();
    let exec = format!("ExecStart=/usr/sbin/{name} ");
    assert!(unit.contains(&exec), "{unit}");
    let unit = unit.replace(&exec, &format!("ExecStart={} ", bin.display()));
    std::fs::write(dir.path().join(format!("{name}.service")), unit).unwrap();
    dir
}

/// `systemd-analyze security --offline=yes` of the unit in `dir`: its
/// overall exposure (0 to 10), checked against 2.9 by systemd itself.
fn exposure(dir: &Path) -> f64 {
    exposure_of(dir, "bpfmapd")
}

/// The same for the unit `name`.
fn exposure_of(dir: &Path, name: &str) -> f64 {
    let unit = format!("{name}.service");
    let (out, text) = output(
        systemd_analyze()
            .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.display()))
            .args(["security", "--offline=yes", "--threshold=29", &unit]),
    );
    let marker = format!("Overall exposure level for {unit}: ");
    let level = text
        .lines()
        .find_map(|l| l.split_once(marker.as_str()))
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
    for sys_admin in [false, true] {
        let dir = installed_unit(sys_admin);
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
            if sys_admin {
                " (with cap-sys-admin.conf)"
            } else {
                ""
            }
        );
    }
}

#[test]
fn the_relay_unit_verifies_and_its_exposure_is_low() {
    let dir = install(
        "bpfmap-relay",
        Path::new(env!("CARGO_BIN_EXE_test-bpfmap-relay")),
    );
    let (out, text) = output(
        systemd_analyze()
            .env("SYSTEMD_UNIT_PATH", format!("{}:", dir.path().display()))
            .args(["verify", "bpfmap-relay.service"]),
    );
    assert!(out.status.success(), "{text}");
    assert_eq!(text.trim(), "", "systemd-analyze verify warned");
    let level = exposure_of(dir.path(), "bpfmap-relay");
    eprintln!("systemd-analyze security --offline=yes bpfmap-relay.service: {level}");
}

#[test]
fn the_relay_configmap_holds_a_config_the_relay_accepts_and_the_deployment_matches() {
    let yaml = std::fs::read_to_string(repo("deploy/kubernetes/relay/configmap.yaml")).unwrap();
    let toml: String = yaml
        .lines()
        .skip_while(|l| l.trim() != "bpfmap-relay.toml: |")
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let config = bpfmap_relay::Config::from_toml(&toml)
        .unwrap_or_else(|e| panic!("the ConfigMap's bpfmap-relay.toml: {e:#}\n{toml}"));
    config.validate().unwrap();
    let tls = config.tls.as_ref().expect("mutual TLS for callers");
    let client = config
        .client_tls
        .as_ref()
        .expect("mutual TLS to the daemons");
    let deployment =
        std::fs::read_to_string(repo("deploy/kubernetes/relay/deployment.yaml")).unwrap();
    for (file, projected) in [
        (&tls.cert, "path: tls/tls.crt"),
        (&tls.key, "path: tls/tls.key"),
        (&tls.client_ca, "path: tls/ca.crt"),
        (&client.cert, "path: client/tls.crt"),
        (&client.key, "path: client/tls.key"),
        (&client.ca, "path: client/ca.crt"),
    ] {
        assert!(file.starts_with("/etc/bpfmap-relay"), "{}", file.display());
        assert!(deployment.contains(projected), "{projected}");
    }
    assert!(deployment.contains(&format!("mountPath: {}\n", config.state_dir.display())));
    assert!(deployment.contains(&format!("containerPort: {}\n", config.listen.port())));
    let health = config.health_listen.expect("a health port for kubelet");
    assert!(deployment.contains(&format!("port: {}\n", health.port())));
    // The daemons grant the relay's identity.
    let daemons = std::fs::read_to_string(repo("deploy/kubernetes/base/configmap.yaml")).unwrap();
    let certs = std::fs::read_to_string(repo(
        "deploy/kubernetes/relay/cert-manager/certificates.yaml",
    ))
    .unwrap();
    let identity = "spiffe://cluster.local/ns/bpfmapd/sa/bpfmap-relay";
    assert!(daemons.contains(identity) && certs.contains(identity));
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
    let sys_admin =
        std::fs::read_to_string(repo("deploy/systemd/bpfmapd.service.d/cap-sys-admin.conf"))
            .unwrap();
    let caps = ["CAP_BPF CAP_DAC_READ_SEARCH CAP_SYS_ADMIN"];
    assert_eq!(setting(&sys_admin, "AmbientCapabilities"), caps);
    assert_eq!(setting(&sys_admin, "CapabilityBoundingSet"), caps);

    // The user it runs as, created in an empty root: on this host the
    // user may exist already (an installed package), and sysusers then
    // says nothing.
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("etc")).unwrap();
    let (out, text) = output(
        tool(
            "systemd-sysusers",
            "SYSTEMD_SYSUSERS",
            "apt-get install systemd",
        )
        .arg(format!("--root={}", root.path().display()))
        .arg("--dry-run")
        .arg(repo("deploy/systemd/bpfmapd.sysusers")),
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Creating user 'bpfmapd'"), "{text}");
}

/// Every manifest under deploy/kubernetes (kustomization files aside: they
/// are not Kubernetes objects).
fn manifests() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "yaml") {
                out.push(path);
            }
        }
    }
    let mut all = Vec::new();
    walk(&repo("deploy/kubernetes"), &mut all);
    all.sort();
    all
}

fn is_kustomization(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n == "kustomization.yaml")
}

#[test]
fn the_kubernetes_manifests_are_valid_and_complete() {
    let all = manifests();
    let objects: Vec<&PathBuf> = all.iter().filter(|p| !is_kustomization(p)).collect();
    assert!(objects.len() >= 7, "{objects:?}");
    let (out, text) = output(
        tool(
            "kubernetes-validate",
            "KUBERNETES_VALIDATE",
            "pip install kubernetes-validate",
        )
        .args(["--strict", "--quiet"])
        .args(&objects),
    );
    assert!(out.status.success(), "{text}");
    // kubernetes-validate knows no schema for cert-manager's Certificate:
    // it warns (and checks the rest).
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.contains("kind Certificate with api version cert-manager.io/v1"),
            "unexpected output: {line}"
        );
    }
    // The same run on a DaemonSet with a misspelt field fails: the
    // validator really reads the files.
    let tmp = tempfile::tempdir().unwrap();
    let broken = tmp.path().join("daemonset.yaml");
    let ds = std::fs::read_to_string(repo("deploy/kubernetes/base/daemonset.yaml")).unwrap();
    std::fs::write(
        &broken,
        ds.replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:"),
    )
    .unwrap();
    let (out, text) = output(
        tool(
            "kubernetes-validate",
            "KUBERNETES_VALIDATE",
            "pip install kubernetes-validate",
        )
        .args(["--strict", "--quiet"])
        .arg(&broken),
    );
    assert!(!out.status.success(), "a misspelt field passed: {text}");

    // Every resource a kustomization names exists, and every object is
    // named by one.
    let mut named = Vec::new();
    for k in all.iter().filter(|p| is_kustomization(p)) {
        let text = std::fs::read_to_string(k).unwrap();
        let mut in_resources = false;
        for line in text.lines() {
            if !line.starts_with(' ') && !line.starts_with('-') {
                in_resources = line.trim_end() == "resources:";
                continue;
            }
            if let Some(r) = line.trim().strip_prefix("- ").filter(|_| in_resources) {
                let path = k.parent().unwrap().join(r);
                assert!(path.exists(), "{} names {r}, which is missing", k.display());
                if path.is_file() {
                    named.push(path.canonicalize().unwrap());
                }
            }
        }
    }
    for o in objects {
        assert!(
            named.contains(&o.canonicalize().unwrap()),
            "{} is in no kustomization",
            o.display()
        );
    }
}

fn checkov() -> Command {
    tool(
        "checkov",
        "CHECKOV",
        "pip install checkov (in a virtualenv)",
    )
}

/// Runs checkov with `args` (JSON output); its summary and the checks it
/// skipped, with their reasons.
fn checkov_json(args: &[&std::ffi::OsStr]) -> (serde_json::Value, Vec<(String, String)>) {
    let (out, text) = output(
        checkov()
            .args(args)
            .args(["--skip-download", "--output", "json"]),
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("checkov printed no JSON ({e}):\n{text}"));
    assert!(
        out.status.success(),
        "checkov failed: {}",
        serde_json::to_string_pretty(&json["results"]["failed_checks"]).unwrap()
    );
    let skipped = json["results"]["skipped_checks"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            (
                c["check_id"].as_str().unwrap().to_owned(),
                c["check_result"]["suppress_comment"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    (json["summary"].clone(), skipped)
}

fn assert_clean(
    what: &str,
    summary: &serde_json::Value,
    skipped: &[(String, String)],
    allowed: &[&str],
) {
    eprintln!("checkov {what}: {summary}");
    assert_eq!(summary["failed"], 0, "{what}: {summary}");
    assert_eq!(summary["parsing_errors"], 0, "{what}: {summary}");
    assert!(
        summary["passed"].as_u64().unwrap() >= 20,
        "{what}: {summary}"
    );
    let mut ids: Vec<&str> = skipped.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, allowed, "{what}: skipped checks");
    for (id, reason) in skipped {
        assert!(
            reason.len() > 30,
            "{what}: {id} is skipped without a written reason ({reason:?})"
        );
    }
}

#[test]
fn checkov_passes_the_manifests_and_the_containerfile() {
    let dir = repo("deploy/kubernetes");
    let (summary, skipped) = checkov_json(&[
        "--directory".as_ref(),
        dir.as_os_str(),
        "--framework".as_ref(),
        "kubernetes".as_ref(),
    ]);
    assert_clean(
        "deploy/kubernetes",
        &summary,
        &skipped,
        &[
            "CKV_K8S_23",
            "CKV_K8S_25",
            "CKV_K8S_40",
            "CKV_K8S_43",
            "CKV_K8S_43",
        ],
    );

    // checkov only recognises the name Dockerfile.
    let tmp = tempfile::tempdir().unwrap();
    let dockerfile = tmp.path().join("Dockerfile");
    std::fs::copy(repo("deploy/Containerfile"), &dockerfile).unwrap();
    let (summary, skipped) = checkov_json(&[
        "--file".as_ref(),
        dockerfile.as_os_str(),
        "--framework".as_ref(),
        "dockerfile".as_ref(),
    ]);
    assert_clean(
        "deploy/Containerfile",
        &summary,
        &skipped,
        &["CKV_DOCKER_2"],
    );
}

#[test]
fn the_configmap_holds_a_config_the_daemon_accepts_and_the_daemonset_matches() {
    let yaml = std::fs::read_to_string(repo("deploy/kubernetes/base/configmap.yaml")).unwrap();
    let toml: String = yaml
        .lines()
        .skip_while(|l| l.trim() != "bpfmapd.toml: |")
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let config = bpfmapd::Config::from_toml(&toml)
        .unwrap_or_else(|e| panic!("the ConfigMap's bpfmapd.toml: {e:#}\n{toml}"));
    config.validate().unwrap();
    assert!(!config.mount_bpffs, "the pod cannot mount bpffs");
    assert!(
        config.watch_files().is_some(),
        "Secret updates must be picked up"
    );
    assert!(!config.rules.is_empty());
    let tls = config.tls.as_ref().expect("mutual TLS");

    // What the config names is what the DaemonSet provides.
    let ds = std::fs::read_to_string(repo("deploy/kubernetes/base/daemonset.yaml")).unwrap();
    for (file, projected) in [
        (&tls.cert, "path: tls/tls.crt"),
        (&tls.key, "path: tls/tls.key"),
        (&tls.client_ca, "path: tls/ca.crt"),
    ] {
        assert!(file.starts_with("/etc/bpfmapd/tls"), "{}", file.display());
        assert!(ds.contains(projected), "{projected}");
    }
    assert!(ds.contains("mountPath: /etc/bpfmapd\n"));
    assert!(ds.contains("args: [\"--config\", \"/etc/bpfmapd/bpfmapd.toml\"]"));
    assert!(ds.contains(&format!("mountPath: {}\n", config.state_dir.display())));
    assert!(ds.contains(&format!("mountPath: {}\n", config.roots[0].display())));
    let port = |a: Option<std::net::SocketAddr>| a.expect("listener set").port();
    for p in [
        config.listen.port(),
        port(config.health_listen),
        port(config.metrics_listen),
    ] {
        assert!(ds.contains(&format!("containerPort: {p}\n")), "port {p}");
    }
    assert!(ds.contains(&format!("port: {}\n", port(config.health_listen))));
    for forbidden in ["privileged: true", "hostNetwork: true", "SYS_ADMIN\""] {
        assert!(!ds.contains(forbidden), "{forbidden}");
    }
}

#[test]
fn the_export_examples_are_configurations_the_daemon_accepts() {
    let dir = repo("deploy/exports");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let toml =
            format!("roots = [\"/sys/fs/bpf\"]\nmetrics_listen = \"127.0.0.1:9464\"\n{text}");
        let config = bpfmapd::Config::from_toml(&toml)
            .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        config
            .validate()
            .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
        assert!(!config.exports.is_empty(), "{}", path.display());
        seen.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "cilium.toml",
            "runqlat.toml",
            "syscount.toml",
            "xdp-filter.toml"
        ]
    );
}

#[test]
fn the_packaged_configuration_serves_local_root_only() {
    // /etc/bpfmapd/bpfmapd.toml as the bpfmapd package installs it.
    let text = std::fs::read_to_string(repo("deploy/debian/bpfmapd.toml")).unwrap();
    let config = bpfmapd::Config::from_toml(&text).unwrap_or_else(|e| panic!("{e:#}"));
    config.validate().unwrap();
    assert!(config.tls.is_none());
    assert!(config.listen.ip().is_loopback() && !config.insecure);
    assert!(
        !config.mount_bpffs,
        "the unit grants no capability to mount"
    );
    assert!(!config.demo);
    assert_eq!(config.roots, [PathBuf::from("/sys/fs/bpf")]);
    // The unit's StateDirectory.
    assert_eq!(config.state_dir, PathBuf::from("/var/lib/bpfmapd"));
    // One rule, for uid 0 (root through the Unix socket): anonymous TCP
    // callers get nothing, and nothing may drain.
    assert_eq!(config.rules.len(), 1);
    let rule = &config.rules[0];
    assert_eq!(rule.identities, ["uid:0"]);
    assert_eq!(rule.maps, ["**"]);
    assert!(!rule.operations.contains(&bpfmapd::Operation::Drain));
    let unit = std::fs::read_to_string(repo("deploy/systemd/bpfmapd.service")).unwrap();
    assert!(unit.contains(
        "ExecStart=/usr/sbin/bpfmapd --config ${CONFIGURATION_DIRECTORY}/bpfmapd.toml --listen-unix ${RUNTIME_DIRECTORY}/bpfmapd.sock\n"
    ));

    // The relay's example for a host.
    let text = std::fs::read_to_string(repo("deploy/bpfmap-relay.toml")).unwrap();
    let relay = bpfmap_relay::Config::from_toml(&text).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(relay.tls.is_some() && relay.client_tls.is_some() && !relay.rules.is_empty());
}

#[test]
fn every_deployment_file_names_the_version_of_the_workspace() {
    // The workspace's version (every crate inherits it) is the version of
    // the packages, the image's tag and the `bpfmap-version` header: the
    // files that spell it out must follow it.
    let version = env!("CARGO_PKG_VERSION");
    let changelog = std::fs::read_to_string(repo("deploy/debian/changelog")).unwrap();
    assert!(
        changelog.starts_with(&format!("bpfmapd ({version}-1) ")),
        "deploy/debian/changelog's first entry is not {version}-1"
    );
    let mut seen = 0;
    for rel in [
        "README.md",
        "deploy/README.md",
        "deploy/docs/operating.md",
        "deploy/kubernetes/base/daemonset.yaml",
        "deploy/kubernetes/base/kustomization.yaml",
        "deploy/kubernetes/relay/deployment.yaml",
    ] {
        let text = std::fs::read_to_string(repo(rel)).unwrap();
        for prefix in [
            "ghcr.io/bpfmapd/bpfmapd:",
            "bpfmapd_",
            "bpfmapctl_",
            "bpfmap-relay_",
            "digest of ",
        ] {
            for (at, _) in text.match_indices(prefix) {
                let rest = &text[at + prefix.len()..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .unwrap_or(rest.len());
                let named = rest[..end].trim_end_matches('.');
                if named.is_empty() {
                    continue;
                }
                assert_eq!(named, version, "{rel}: {prefix}{named}");
                seen += 1;
            }
        }
    }
    assert!(seen >= 10, "only {seen} mentions of the version found");
}
