//! What users install, built and tried as they get it: `deploy/build-packages`
//! run once for the file (the release binaries, the three Debian packages,
//! the OCI archive of the image), then
//! - each package inspected as `dpkg-deb --info/--contents` shows it (exactly
//!   the files it should hold, nothing of the build tree) and checked by
//!   lintian;
//! - the packages installed with `dpkg -i` on this machine, the daemon
//!   started from the installed files as its installed unit starts it (the
//!   unit's user, capabilities, no_new_privs, umask, directories and command
//!   line, through `setpriv`), a pinned map dumped through it with the
//!   installed bpfmapctl, then the packages removed and purged, with the file
//!   trees and account files compared before and after: nothing is left but
//!   the system user bpfmapd, which purge keeps as Debian keeps system users;
//! - the image read from its archive (its name against the Kubernetes
//!   manifests', its labels, size and files: no shell, no package manager),
//!   its root filesystem unpacked and the daemon run in it as the DaemonSet
//!   runs it (uid 0, only CAP_BPF and CAP_DAC_READ_SEARCH, read-only root,
//!   the host's bpffs mounted read-only), serving a dump to the image's
//!   bpfmapctl.
//!
//! They need root and the tools `.ci/run` installs (cargo-deb, help2man,
//! buildah, lintian, setpriv, capsh, grpcurl); one missing fails the test
//! naming it.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader},
    os::unix::{
        fs::{MetadataExt as _, PermissionsExt as _},
        net::UnixStream,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Arc, Mutex, OnceLock},
    time::{Duration, Instant},
};

use bpfmap_tests::{process::free_addr, *};

const VERSION: &str = env!("CARGO_PKG_VERSION");
const PACKAGES: [&str; 3] = ["bpfmapd", "bpfmapctl", "bpfmap-relay"];
const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_BPF: u32 = 39;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs `cmd`, failing with its output unless it succeeds; its stdout.
fn check(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn need(tool: &str, install: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{tool} is needed for this test and was not found; install it with `{install}` (.ci/run does)"
    );
}

fn need_root() {
    let uid = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("Uid:")
                .map(|v| v.split_whitespace().next().unwrap().to_owned())
        })
        .unwrap();
    assert_eq!(
        uid, "0",
        "installing packages and running the daemon with the unit's user and capabilities needs root"
    );
}

/// What `deploy/build-packages` wrote.
#[derive(Debug)]
struct Built {
    debs: BTreeMap<&'static str, PathBuf>,
    image: PathBuf,
}

/// Runs `deploy/build-packages` once for every test of this file, with the
/// target directory of this test binary (release binaries beside the debug
/// ones, packages in its `packages/`).
fn built() -> &'static Built {
    static BUILT: OnceLock<Result<Built, String>> = OnceLock::new();
    let built = BUILT.get_or_init(|| {
        for (tool, install) in [
            ("cargo-deb", "cargo install cargo-deb --locked"),
            ("help2man", "apt-get install help2man"),
            ("buildah", "apt-get install buildah"),
        ] {
            if !Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .is_ok_and(|o| o.status.success())
            {
                return Err(format!(
                    "{tool} is needed to build the packages; install it with `{install}` (.ci/run does)"
                ));
            }
        }
        // <target>/debug/test-bpfmapd
        let target = Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"))
            .parent()
            .and_then(Path::parent)
            .expect("the target directory")
            .to_owned();
        let started = Instant::now();
        let out = Command::new(repo("deploy/build-packages"))
            .env("CARGO_TARGET_DIR", &target)
            .output()
            .map_err(|e| format!("cannot run deploy/build-packages: {e}"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Err(format!("deploy/build-packages failed ({}):\n{text}", out.status));
        }
        eprintln!(
            "deploy/build-packages: {:.0} s\n{}",
            started.elapsed().as_secs_f64(),
            text.lines().filter(|l| !l.starts_with("   ")).collect::<Vec<_>>().join("\n")
        );
        let dir = target.join("packages");
        let arch = String::from_utf8(run(Command::new("dpkg").arg("--print-architecture")).stdout)
            .unwrap()
            .trim()
            .to_owned();
        let debs = PACKAGES
            .iter()
            .map(|p| (*p, dir.join(format!("{p}_{VERSION}-1_{arch}.deb"))))
            .collect();
        let image = dir.join(format!("bpfmapd_{VERSION}_{arch}.oci.tar"));
        let mut written: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        written.sort();
        let mut expected: Vec<String> = PACKAGES
            .iter()
            .map(|p| format!("{p}_{VERSION}-1_{arch}.deb"))
            .chain([format!("bpfmapd_{VERSION}_{arch}.oci.tar")])
            .collect();
        expected.sort();
        if written != expected {
            return Err(format!("{} holds {written:?}, not {expected:?}", dir.display()));
        }
        Ok(Built { debs, image })
    });
    built.as_ref().unwrap_or_else(|e| panic!("{e}"))
}

/// The `dpkg-deb --contents` of a package: each path (without the leading
/// "."), its mode and owner as `ls -l` shows them.
fn contents(deb: &Path) -> BTreeMap<String, String> {
    check(Command::new("dpkg-deb").arg("--contents").arg(deb))
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f[5].trim_start_matches('.').trim_end_matches('/');
            (path.to_owned(), format!("{} {}", f[0], f[1]))
        })
        .filter(|(p, _)| !p.is_empty())
        .collect()
}

/// A field of `dpkg-deb --field`.
fn field(deb: &Path, name: &str) -> String {
    check(Command::new("dpkg-deb").arg("--field").arg(deb).arg(name))
        .trim()
        .to_owned()
}

fn dirs_of(files: &[&str]) -> BTreeSet<String> {
    let mut dirs = BTreeSet::new();
    for f in files {
        let mut p = Path::new(f).parent();
        while let Some(d) = p.filter(|d| *d != Path::new("/")) {
            dirs.insert(d.to_string_lossy().into_owned());
            p = d.parent();
        }
    }
    dirs
}

#[test]
fn each_package_holds_its_files_and_lintian_passes_them() {
    let built = built();
    let expected: BTreeMap<&str, Vec<&str>> = BTreeMap::from([
        (
            "bpfmapd",
            vec![
                "/etc/bpfmapd/bpfmapd.toml",
                "/usr/lib/systemd/system/bpfmapd.service",
                "/usr/lib/sysusers.d/bpfmapd.conf",
                "/usr/sbin/bpfmapd",
                "/usr/share/doc/bpfmapd/README.md",
                "/usr/share/doc/bpfmapd/copyright",
                "/usr/share/doc/bpfmapd/changelog.Debian.gz",
                "/usr/share/doc/bpfmapd/examples/bpfmapd-mtls.toml",
                "/usr/share/doc/bpfmapd/examples/bpfmapd.service.d/cap-sys-admin.conf",
                "/usr/share/doc/bpfmapd/examples/bpfmapd.service.d/drain.conf",
                "/usr/share/doc/bpfmapd/examples/bpfmapd.toml",
                "/usr/share/doc/bpfmapd/examples/exports/cilium.toml",
                "/usr/share/doc/bpfmapd/examples/exports/runqlat.toml",
                "/usr/share/doc/bpfmapd/examples/exports/syscount.toml",
                "/usr/share/doc/bpfmapd/examples/exports/xdp-filter.toml",
                "/usr/share/lintian/overrides/bpfmapd",
                "/usr/share/man/man8/bpfmapd.8.gz",
            ],
        ),
        (
            "bpfmapctl",
            vec![
                "/usr/bin/bpfmapctl",
                "/usr/share/doc/bpfmapctl/README.md",
                "/usr/share/doc/bpfmapctl/copyright",
                "/usr/share/doc/bpfmapctl/changelog.Debian.gz",
                "/usr/share/lintian/overrides/bpfmapctl",
                "/usr/share/man/man1/bpfmapctl.1.gz",
            ],
        ),
        (
            "bpfmap-relay",
            vec![
                "/usr/lib/systemd/system/bpfmap-relay.service",
                "/usr/sbin/bpfmap-relay",
                "/usr/share/doc/bpfmap-relay/README.md",
                "/usr/share/doc/bpfmap-relay/copyright",
                "/usr/share/doc/bpfmap-relay/changelog.Debian.gz",
                "/usr/share/doc/bpfmap-relay/examples/bpfmap-relay.toml",
                "/usr/share/lintian/overrides/bpfmap-relay",
                "/usr/share/man/man8/bpfmap-relay.8.gz",
            ],
        ),
    ]);
    for (pkg, files) in &expected {
        let deb = &built.debs[pkg];
        let info = check(Command::new("dpkg-deb").arg("--info").arg(deb));
        eprintln!("dpkg-deb --info {}:\n{info}", deb.display());
        assert_eq!(field(deb, "Package"), *pkg);
        assert_eq!(field(deb, "Version"), format!("{VERSION}-1"));
        let depends = field(deb, "Depends");
        assert!(depends.contains("libc6"), "{pkg}: Depends: {depends}");
        // Exactly these files, and their directories; all root's.
        let held = contents(deb);
        eprintln!(
            "dpkg-deb --contents {}:\n{}",
            deb.display(),
            held.iter()
                .map(|(p, m)| format!("{m} {p}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let mut want: BTreeSet<String> = files.iter().map(|f| (*f).to_owned()).collect();
        want.extend(dirs_of(files));
        let got: BTreeSet<String> = held.keys().cloned().collect();
        assert_eq!(
            got.difference(&want).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{pkg} holds files it should not"
        );
        assert_eq!(
            want.difference(&got).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "{pkg} lacks files"
        );
        for (path, mode) in &held {
            // root's, spelt by name or by id (cargo-deb writes ids only).
            assert!(
                mode.ends_with(" root/root") || mode.ends_with(" 0/0"),
                "{pkg}: {path} {mode}"
            );
            let exec = path.starts_with("/usr/sbin/") || path.starts_with("/usr/bin/");
            let want = if exec || !files.contains(&path.as_str()) {
                "rwxr-xr-x"
            } else {
                "rw-r--r--"
            };
            assert_eq!(&mode[1..10], want, "{pkg}: {path}");
        }
    }
    // The daemon's configuration is a conffile; its scripts make the user,
    // enable the unit, remove the state on purge.
    let control = tempfile::tempdir().unwrap();
    check(
        Command::new("dpkg-deb")
            .arg("--control")
            .arg(&built.debs["bpfmapd"])
            .arg(control.path()),
    );
    let conffiles = std::fs::read_to_string(control.path().join("conffiles")).unwrap();
    assert_eq!(conffiles.trim(), "/etc/bpfmapd/bpfmapd.toml");
    let postinst = std::fs::read_to_string(control.path().join("postinst")).unwrap();
    for needed in [
        "systemd-sysusers",
        "bpfmapd.conf",
        "deb-systemd-helper enable bpfmapd.service",
        "chgrp bpfmapd",
        "chmod",
    ] {
        assert!(
            postinst.contains(needed),
            "postinst lacks {needed:?}:\n{postinst}"
        );
    }
    let postrm = std::fs::read_to_string(control.path().join("postrm")).unwrap();
    assert!(postrm.contains("rm -rf /var/lib/bpfmapd"), "{postrm}");

    // lintian: no error, no warning, but the one tag each package
    // overrides, with its reason (/usr/share/lintian/overrides). Overrides
    // are shown, so that a new one cannot hide.
    need("lintian", "apt-get install lintian");
    let out = run(Command::new("lintian")
        .args(["--display-level", ">=warning", "--show-overrides"])
        .args(built.debs.values()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("lintian --display-level '>=warning' --show-overrides:\n{text}");
    let tags: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with("N:"))
        .filter(|l| *l != "running with root privileges is not recommended!")
        .collect();
    let overridden: Vec<String> = PACKAGES
        .iter()
        .map(|p| {
            format!(
                "O: {p}: initial-upload-closes-no-bugs [usr/share/doc/{p}/changelog.Debian.gz:1]"
            )
        })
        .collect();
    assert_eq!(
        tags,
        overridden.iter().map(String::as_str).collect(),
        "lintian's tags"
    );
}

/// Every path under the directories a package may touch, with the target of
/// each symbolic link. dpkg's database, logs and caches aside: they record
/// that the packages came and went.
fn tree() -> BTreeMap<PathBuf, Option<PathBuf>> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, Option<PathBuf>>) {
        let skip = [
            "/var/lib/dpkg",
            "/var/log",
            "/var/cache",
            "/var/tmp",
            "/var/lib/apt",
            "/run/user",
        ];
        if skip.iter().any(|s| dir == Path::new(s)) {
            return;
        }
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_symlink() {
                out.insert(path.clone(), std::fs::read_link(&path).ok());
            } else {
                out.insert(path.clone(), None);
                if meta.is_dir() {
                    walk(&path, out);
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for top in ["/etc", "/usr", "/var", "/run", "/opt", "/srv"] {
        walk(Path::new(top), &mut out);
    }
    out
}

fn installed(pkg: &str) -> bool {
    run(Command::new("dpkg-query").args(["-W", "-f", "${db:Status-Status}", pkg]))
        .stdout
        .starts_with(b"installed")
}

/// The `[Service]` settings of a unit file: each key's values in order.
fn service(unit: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut in_service = false;
    for line in unit.lines().map(str::trim) {
        if line.starts_with('[') {
            in_service = line == "[Service]";
        } else if let Some((k, v)) = line
            .split_once('=')
            .filter(|_| in_service && !line.starts_with('#'))
        {
            out.entry(k.to_owned()).or_default().push(v.to_owned());
        }
    }
    out
}

fn one<'a>(settings: &'a BTreeMap<String, Vec<String>>, key: &str) -> &'a str {
    match settings.get(key).map(Vec::as_slice) {
        Some([v]) => v,
        other => panic!("{key}: {other:?}"),
    }
}

/// "CAP_BPF CAP_DAC_READ_SEARCH" as setpriv spells it: "-all,+bpf,+dac_read_search".
fn setpriv_caps(caps: &str) -> String {
    std::iter::once("-all".to_owned())
        .chain(
            caps.split_whitespace()
                .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase())),
        )
        .collect::<Vec<_>>()
        .join(",")
}

fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

fn id_of(user: &str, flag: &str) -> u32 {
    check(Command::new("id").args([flag, user]))
        .trim()
        .parse()
        .unwrap()
}

/// A process whose stderr is collected; killed on drop.
struct Running {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Running {
    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Self { child, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits until `ready` holds, failing with the log if the process
    /// exits first or 20 s pass.
    fn wait_for(&mut self, what: &str, ready: impl Fn() -> bool) {
        let started = Instant::now();
        while !ready() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "the daemon exited ({status}) before {what}:\n{}",
                    self.log()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no {what} within 20 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn stop(&mut self) {
        process::send_signal(self.child.id(), libc::SIGTERM);
        let started = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the daemon did not stop on SIGTERM within the unit's TimeoutStopSec"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A map pinned in the host's /sys/fs/bpf (what the packaged configuration
/// serves), root's and 0600; removed on drop.
struct HostPin {
    dir: PathBuf,
    _map: OwnedMap,
}

impl Drop for HostPin {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The entries of `bpfmapctl dump` (JSON Lines of an untyped map), as
/// (key, value) hex pairs.
fn dumped(stdout: &str) -> BTreeSet<(String, String)> {
    json_lines(stdout)
        .iter()
        .map(|l| {
            (
                l["key"].as_str().expect("a hex key").to_owned(),
                l["value"].as_str().expect("a hex value").to_owned(),
            )
        })
        .collect()
}

fn expected_hex(n: u64) -> BTreeSet<(String, String)> {
    (0..n)
        .map(|i| {
            (
                faster_hex::hex_string(&i.to_le_bytes()),
                faster_hex::hex_string(&(i * 3).to_le_bytes()),
            )
        })
        .collect()
}

#[test]
fn the_packages_install_serve_a_dump_and_purge_leaving_only_the_system_user() {
    need_root();
    need("setpriv", "apt-get install util-linux");
    let built = built();
    let fs_type = check(Command::new("stat").args(["-f", "-c", "%T", "/sys/fs/bpf"]));
    assert_eq!(
        fs_type.trim(),
        "bpf_fs",
        "the packaged configuration serves the host's /sys/fs/bpf, which is not a bpffs here (systemd mounts it at boot)"
    );
    // Leftovers of an earlier run that failed half-way.
    if PACKAGES.iter().any(|p| installed(p)) {
        check(Command::new("dpkg").arg("--purge").args(PACKAGES));
    }
    let before = tree();
    let accounts_before = accounts();
    let user_existed = accounts_before["/etc/passwd"]
        .iter()
        .any(|l| l.starts_with("bpfmapd:"));

    check(Command::new("dpkg").arg("-i").args(built.debs.values()));
    for pkg in PACKAGES {
        assert!(installed(pkg), "{pkg} is not installed");
    }
    let listed = check(Command::new("dpkg").args(["-L", "bpfmapd", "bpfmapctl", "bpfmap-relay"]));
    eprintln!("dpkg -L:\n{listed}");

    // One version everywhere.
    for bin in [
        "/usr/sbin/bpfmapd",
        "/usr/bin/bpfmapctl",
        "/usr/sbin/bpfmap-relay",
    ] {
        let name = Path::new(bin).file_name().unwrap().to_string_lossy();
        assert_eq!(
            check(Command::new(bin).arg("--version")).trim(),
            format!("{name} {VERSION}")
        );
    }

    // The user, the configuration's owner and mode, the unit enabled but not
    // started (systemd does not run here, as in a chroot or a container
    // build), the relay's unit not enabled.
    let uid = id_of("bpfmapd", "-u");
    let gid = id_of("bpfmapd", "-g");
    assert_ne!(uid, 0);
    for (path, mode) in [
        ("/etc/bpfmapd", 0o750),
        ("/etc/bpfmapd/bpfmapd.toml", 0o640),
    ] {
        let meta = std::fs::metadata(path).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.permissions().mode() & 0o7777),
            (0, gid, mode),
            "{path}"
        );
    }
    let wants = Path::new("/etc/systemd/system/multi-user.target.wants");
    let link = std::fs::read_link(wants.join("bpfmapd.service")).expect("bpfmapd.service enabled");
    assert_eq!(
        std::fs::canonicalize(wants.join(&link)).unwrap(),
        std::fs::canonicalize("/usr/lib/systemd/system/bpfmapd.service").unwrap()
    );
    assert!(
        !wants.join("bpfmap-relay.service").exists(),
        "the relay's unit is enabled"
    );
    assert!(
        !Path::new("/run/bpfmapd").exists(),
        "the daemon was started on install"
    );

    // The daemon as its installed unit starts it.
    let unit = std::fs::read_to_string("/usr/lib/systemd/system/bpfmapd.service").unwrap();
    let s = service(&unit);
    assert_eq!(one(&s, "User"), "bpfmapd");
    assert_eq!(one(&s, "NoNewPrivileges"), "yes");
    let dirs = [
        (
            "CONFIGURATION_DIRECTORY",
            "/etc",
            one(&s, "ConfigurationDirectory"),
        ),
        ("STATE_DIRECTORY", "/var/lib", one(&s, "StateDirectory")),
        ("RUNTIME_DIRECTORY", "/run", one(&s, "RuntimeDirectory")),
    ];
    let mut exec = one(&s, "ExecStart").to_owned();
    let mut env = vec![(
        "PATH".to_owned(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin".to_owned(),
    )];
    for (var, base, name) in dirs {
        let path = format!("{base}/{name}");
        exec = exec.replace(&format!("${{{var}}}"), &path);
        env.push((var.to_owned(), path));
    }
    // systemd makes the state and runtime directories, the unit's user's.
    for (path, mode) in [
        ("/var/lib/bpfmapd", one(&s, "StateDirectoryMode")),
        ("/run/bpfmapd", one(&s, "RuntimeDirectoryMode")),
    ] {
        std::fs::create_dir_all(path).unwrap();
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
        let mode = u32::from_str_radix(mode, 8).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let argv: Vec<&str> = exec.split_whitespace().collect();
    assert_eq!(argv[0], "/usr/sbin/bpfmapd", "{exec}");
    let ambient = setpriv_caps(one(&s, "AmbientCapabilities"));
    let bounding = setpriv_caps(one(&s, "CapabilityBoundingSet"));
    let umask = one(&s, "UMask");

    let n = 300u64;
    let pin = {
        let dir = Path::new("/sys/fs/bpf").join(format!("bpfmapd-pkg-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let map = create_map(MapType::HASH, 8, 8, 512);
        for i in 0..n {
            update(&map, &i.to_le_bytes(), &(i * 3).to_le_bytes());
        }
        map.pin(&dir.join("m")).expect("pin in /sys/fs/bpf");
        HostPin { dir, _map: map }
    };
    let name = format!("{}/m", pin.dir.file_name().unwrap().to_string_lossy());
    let mut daemon = Running::spawn(
        Command::new("setpriv")
            .args([
                "--reuid=bpfmapd",
                "--regid=bpfmapd",
                "--init-groups",
                &format!("--inh-caps={ambient}"),
                &format!("--ambient-caps={ambient}"),
                &format!("--bounding-set={bounding}"),
                "--no-new-privs",
                "--",
                "sh",
                "-c",
                &format!("umask {umask} && exec \"$0\" \"$@\""),
            ])
            .args(&argv)
            .env_clear()
            .envs(env),
    );
    let socket = Path::new("/run/bpfmapd/bpfmapd.sock");
    daemon.wait_for("its socket", || UnixStream::connect(socket).is_ok());
    let pid = daemon.child.id();
    assert_eq!(
        status_field(pid, "Uid:"),
        format!("{uid}\t{uid}\t{uid}\t{uid}")
    );
    let wanted = (1u64 << CAP_BPF) | (1u64 << CAP_DAC_READ_SEARCH);
    for f in ["CapEff:", "CapBnd:", "CapAmb:"] {
        assert_eq!(
            u64::from_str_radix(&status_field(pid, f), 16).unwrap(),
            wanted,
            "{f}"
        );
    }
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");

    // Root reads the map through the socket with the installed bpfmapctl.
    let addr = format!("unix://{}", socket.display());
    let list = check(Command::new("/usr/bin/bpfmapctl").args(["--addr", &addr, "list"]));
    assert!(
        json_lines(&list).iter().any(|m| m["path"] == name.as_str()),
        "{name} not listed:\n{list}"
    );
    let out = check(Command::new("/usr/bin/bpfmapctl").args(["--addr", &addr, "dump", &name]));
    assert_eq!(dumped(&out), expected_hex(n));
    // Nobody else: the loopback listener's anonymous callers get nothing.
    let denied = run(Command::new("/usr/bin/bpfmapctl").args([
        "--addr",
        "http://127.0.0.1:50051",
        "dump",
        &name,
    ]));
    let stderr = String::from_utf8_lossy(&denied.stderr);
    assert!(
        !denied.status.success() && stderr.contains("PERMISSION_DENIED"),
        "{stderr}"
    );
    // The version header.
    let grpcurl = std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".into());
    let headers = check(Command::new(&grpcurl).args([
        "-v",
        "-plaintext",
        "-unix",
        "-authority",
        "localhost",
        "/run/bpfmapd/bpfmapd.sock",
        "bpfmap.v1.MapService/ListMaps",
    ]));
    assert!(
        headers
            .lines()
            .any(|l| l == format!("bpfmap-version: {VERSION}")),
        "{headers}"
    );
    let key = std::fs::metadata("/var/lib/bpfmapd/cursor.key").unwrap();
    assert_eq!((key.uid(), key.permissions().mode() & 0o777), (uid, 0o600));
    daemon.stop();
    // systemd removes the runtime directory when the unit stops.
    std::fs::remove_dir_all("/run/bpfmapd").unwrap();
    drop(pin);

    // Removed: the programs go, the configuration and the state stay.
    check(Command::new("dpkg").arg("--remove").args(PACKAGES));
    for gone in [
        "/usr/sbin/bpfmapd",
        "/usr/bin/bpfmapctl",
        "/usr/sbin/bpfmap-relay",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} after dpkg --remove");
    }
    for kept in ["/etc/bpfmapd/bpfmapd.toml", "/var/lib/bpfmapd/cursor.key"] {
        assert!(Path::new(kept).exists(), "{kept} gone after dpkg --remove");
    }
    // Purged: nothing left but the system user and its group, which
    // Debian keeps (postrm says why), and, when the install created them,
    // the backups systemd-sysusers makes of the account files it edits.
    check(Command::new("dpkg").arg("--purge").args(PACKAGES));
    let after = tree();
    let sysusers_leaves = |p: &Path| {
        !user_existed
            && (p == Path::new("/etc/.pwd.lock")
                || ACCOUNTS.iter().any(|a| p == Path::new(&format!("{a}-"))))
    };
    let left: Vec<_> = after
        .iter()
        .filter(|(p, t)| before.get(*p) != Some(t) && !sysusers_leaves(p))
        .collect();
    let removed: Vec<_> = before.keys().filter(|p| !after.contains_key(*p)).collect();
    eprintln!(
        "{} paths before the install, {} after the purge; new: {left:?}; gone: {removed:?}",
        before.len(),
        after.len()
    );
    assert_eq!(
        left,
        Vec::<(&PathBuf, &Option<PathBuf>)>::new(),
        "left behind by the purge"
    );
    assert_eq!(
        removed,
        Vec::<&PathBuf>::new(),
        "removed by install and purge"
    );
    assert_eq!(id_of("bpfmapd", "-u"), uid, "the system user stays");
    // The account files hold what they held, and the user's entries if the
    // install made them.
    let accounts_after = accounts();
    for file in ACCOUNTS {
        let added: Vec<&String> = accounts_after[file]
            .iter()
            .filter(|l| !accounts_before[file].contains(l))
            .collect();
        let lost: Vec<&String> = accounts_before[file]
            .iter()
            .filter(|l| !accounts_after[file].contains(l))
            .collect();
        assert_eq!(lost, Vec::<&String>::new(), "{file}: entries lost");
        if user_existed {
            assert_eq!(added, Vec::<&String>::new(), "{file}: entries added");
        } else {
            assert!(
                added.len() == 1 && added[0].starts_with("bpfmapd:"),
                "{file}: added {added:?}, not the one entry of bpfmapd"
            );
        }
    }
}

/// The account files systemd-sysusers edits.
const ACCOUNTS: [&str; 4] = ["/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow"];

/// The lines of each account file.
fn accounts() -> BTreeMap<&'static str, Vec<String>> {
    ACCOUNTS
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap_or_default();
            (*f, text.lines().map(str::to_owned).collect())
        })
        .collect()
}

/// The OCI archive unpacked as an OCI layout: its index, manifest and
/// config, and the root filesystem of its layers.
struct Image {
    _dir: tempfile::TempDir,
    name: String,
    manifest: serde_json::Value,
    config: serde_json::Value,
    rootfs: PathBuf,
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    let (algo, hex) = digest.split_once(':').expect("a digest");
    layout.join("blobs").join(algo).join(hex)
}

fn json_file(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn unpack(archive: &Path) -> Image {
    let dir = tempfile::Builder::new()
        .prefix("bpfmapd-image-")
        .tempdir()
        .unwrap();
    let layout = dir.path().join("layout");
    std::fs::create_dir(&layout).unwrap();
    check(
        Command::new("tar")
            .arg("-xf")
            .arg(archive)
            .arg("-C")
            .arg(&layout),
    );
    let index = json_file(&layout.join("index.json"));
    let manifests = index["manifests"].as_array().expect("manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    let name = manifests[0]["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .expect("the image's name")
        .to_owned();
    let manifest = json_file(&blob(&layout, manifests[0]["digest"].as_str().unwrap()));
    let config = json_file(&blob(
        &layout,
        manifest["config"]["digest"].as_str().unwrap(),
    ));
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir(&rootfs).unwrap();
    for layer in manifest["layers"].as_array().expect("layers") {
        let file = blob(&layout, layer["digest"].as_str().unwrap());
        let list = check(Command::new("tar").arg("-tf").arg(&file));
        assert!(
            !list.lines().any(|l| l.contains(".wh.")),
            "a layer of an image from scratch removes nothing"
        );
        check(
            Command::new("tar")
                .arg("-xpf")
                .arg(&file)
                .arg("-C")
                .arg(&rootfs),
        );
    }
    Image {
        _dir: dir,
        name,
        manifest,
        config,
        rootfs,
    }
}

/// The `image:` of every container in the Kubernetes manifests.
fn manifest_images() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for rel in [
        "deploy/kubernetes/base/daemonset.yaml",
        "deploy/kubernetes/relay/deployment.yaml",
    ] {
        let text = std::fs::read_to_string(repo(rel)).unwrap();
        for line in text.lines() {
            if let Some(image) = line.trim().strip_prefix("image: ") {
                out.push((rel.to_owned(), image.trim().to_owned()));
            }
        }
    }
    out
}

fn files_under(root: &Path) -> BTreeMap<String, std::fs::Metadata> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, std::fs::Metadata>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let path = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.insert(format!("/{rel}"), meta);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

#[test]
fn the_image_is_the_one_the_manifests_name_and_its_daemon_serves_a_dump() {
    need_root();
    need("capsh", "apt-get install libcap2-bin");
    let built = built();
    let image = unpack(&built.image);

    // Its name is what the manifests deploy: the version of this build.
    let images = manifest_images();
    assert_eq!(images.len(), 2, "{images:?}");
    for (file, name) in &images {
        assert_eq!(
            name, &image.name,
            "{file} names another image than the one built"
        );
    }
    assert_eq!(image.name, format!("ghcr.io/bpfmapd/bpfmapd:{VERSION}"));
    let revision = check(
        Command::new("git")
            .arg("-C")
            .arg(repo(""))
            .args(["rev-parse", "HEAD"]),
    );
    let revision = revision.trim();
    let source = "https://github.com/bpfmapd/bpfmapd";
    for (what, labels) in [
        ("config labels", &image.config["config"]["Labels"]),
        ("manifest annotations", &image.manifest["annotations"]),
    ] {
        assert_eq!(
            labels["org.opencontainers.image.version"], VERSION,
            "{what}"
        );
        assert_eq!(labels["org.opencontainers.image.source"], source, "{what}");
        let r = labels["org.opencontainers.image.revision"]
            .as_str()
            .unwrap();
        assert!(
            r == revision || r == format!("{revision}-dirty"),
            "{what}: revision {r}, HEAD {revision}"
        );
    }
    let config = &image.config["config"];
    assert_eq!(config["User"], "0:0");
    assert_eq!(
        config["Entrypoint"],
        serde_json::json!(["/usr/sbin/bpfmapd"])
    );
    assert_eq!(
        config["Cmd"],
        serde_json::json!(["--config", "/etc/bpfmapd/bpfmapd.toml"])
    );

    // Its files: the three binaries, exactly those of the packages, the
    // libraries they load, the CA bundle, passwd and group, copyright
    // files. No shell, no package manager.
    let files = files_under(&image.rootfs);
    let listing: Vec<String> = files
        .iter()
        .map(|(p, m)| format!("{:o} {:>9} {p}", m.permissions().mode() & 0o7777, m.len()))
        .collect();
    let total: u64 = files.values().map(std::fs::Metadata::len).sum();
    let archive = std::fs::metadata(&built.image).unwrap().len();
    eprintln!(
        "{}: {} KiB archived, {} KiB unpacked in {} files:\n{}",
        image.name,
        archive / 1024,
        total / 1024,
        files.len(),
        listing.join("\n")
    );
    let debs = tempfile::tempdir().unwrap();
    for deb in built.debs.values() {
        check(Command::new("dpkg-deb").arg("-x").arg(deb).arg(debs.path()));
    }
    for bin in [
        "/usr/sbin/bpfmapd",
        "/usr/sbin/bpfmap-relay",
        "/usr/bin/bpfmapctl",
    ] {
        let from_deb = std::fs::read(debs.path().join(&bin[1..])).unwrap();
        let in_image = std::fs::read(image.rootfs.join(&bin[1..])).unwrap();
        assert!(from_deb == in_image, "{bin} differs from the package's");
    }
    for (path, meta) in &files {
        let file = Path::new(path).file_name().unwrap().to_string_lossy();
        let allowed = matches!(
            path.as_str(),
            "/usr/sbin/bpfmapd"
                | "/usr/sbin/bpfmap-relay"
                | "/usr/bin/bpfmapctl"
                | "/etc/ssl/certs/ca-certificates.crt"
                | "/etc/passwd"
                | "/etc/group"
        ) || (path.starts_with("/usr/share/doc/") && file == "copyright")
            || ((path.starts_with("/lib") || path.starts_with("/usr/lib"))
                && (file.starts_with("lib") || file.starts_with("ld-linux"))
                && file.contains(".so"));
        assert!(allowed, "{path} has no business in the image");
        assert!(meta.is_file(), "{path}: not a regular file");
    }
    for shell_or_manager in ["sh", "bash", "dash", "busybox", "apt", "dpkg", "apk"] {
        assert!(
            !files
                .keys()
                .any(|p| p.ends_with(&format!("/{shell_or_manager}"))),
            "{shell_or_manager} in the image"
        );
    }
    // The binaries (stripped, three of them) are most of it.
    assert!(archive < 64 << 20, "the image archive is {archive} bytes");

    // Every binary starts from the image's own files alone.
    for bin in [
        "/usr/sbin/bpfmapd",
        "/usr/sbin/bpfmap-relay",
        "/usr/bin/bpfmapctl",
    ] {
        let name = Path::new(bin).file_name().unwrap().to_string_lossy();
        let out = check(
            Command::new("chroot")
                .arg("--userspec=65534:65534")
                .arg(&image.rootfs)
                .args([bin, "--version"]),
        );
        assert_eq!(out.trim(), format!("{name} {VERSION}"));
    }

    // The daemon in it as the DaemonSet runs it: uid 0 with only BPF and
    // DAC_READ_SEARCH, no_new_privs, the root filesystem read-only, the
    // host's bpffs read-only at /sys/fs/bpf (a private one here, holding
    // root's 0600 pin), its configuration in /etc/bpfmapd and its state in
    // /var/lib/bpfmapd.
    let fs = BpfFs::new();
    let n = 200;
    let (_map, _) = u64_hash(&fs, "m", n, 256);
    let conf = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let addr = free_addr("127.0.0.1");
    std::fs::write(
        conf.path().join("bpfmapd.toml"),
        format!(
            "listen = \"{addr}\"\nroots = [\"/sys/fs/bpf\"]\nmount_bpffs = false\nstate_dir = \"/var/lib/bpfmapd\"\n"
        ),
    )
    .unwrap();
    let root = &image.rootfs;
    // The mount points the runtime makes.
    for dir in ["proc", "sys/fs/bpf", "etc/bpfmapd", "var/lib/bpfmapd"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let drop = (0..=last)
        .filter(|c| ![CAP_BPF, CAP_DAC_READ_SEARCH].contains(c))
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let entrypoint = config["Entrypoint"][0].as_str().unwrap();
    let cmd: Vec<&str> = config["Cmd"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let script = r#"set -e
R=$1 BPF=$2 CONF=$3 STATE=$4 DROP=$5 ENTRYPOINT=$6
shift 6
mount --bind "$R" "$R"
mount -o remount,bind,ro "$R"
mount -t proc proc "$R/proc"
mount --bind -o ro "$BPF" "$R/sys/fs/bpf"
mount --bind -o ro "$CONF" "$R/etc/bpfmapd"
mount --bind "$STATE" "$R/var/lib/bpfmapd"
exec capsh --chroot="$R" --drop="$DROP" --no-new-privs --shell="$ENTRYPOINT" -- "$@""#;
    let mut daemon = Running::spawn(
        Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .arg(root)
            .arg(fs.path())
            .arg(conf.path())
            .arg(state.path())
            .arg(&drop)
            .arg(entrypoint)
            .args(&cmd)
            .env_clear(),
    );
    daemon.wait_for("listening", || std::net::TcpStream::connect(addr).is_ok());
    let pid = daemon.child.id();
    assert_eq!(status_field(pid, "Uid:"), "0\t0\t0\t0");
    let wanted = (1u64 << CAP_BPF) | (1u64 << CAP_DAC_READ_SEARCH);
    for f in ["CapEff:", "CapBnd:"] {
        assert_eq!(
            u64::from_str_radix(&status_field(pid, f), 16).unwrap(),
            wanted,
            "{f}"
        );
    }
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/root")).unwrap(),
        *root,
        "the daemon sees the image's files only"
    );
    // The image's bpfmapctl, as nobody, reads the map through it.
    let out = check(
        Command::new("chroot")
            .arg("--userspec=65534:65534")
            .arg(root)
            .args([
                "/usr/bin/bpfmapctl",
                "--addr",
                &format!("http://{addr}"),
                "dump",
                "m",
            ]),
    );
    assert_eq!(dumped(&out), expected_hex(u64::from(n)));
    daemon.stop();
    assert!(
        state.path().join("cursor.key").exists(),
        "no cursor key in the state volume"
    );
}
