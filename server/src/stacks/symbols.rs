//! Frame names: one thread owns the daemon's symbolizer (blazesym, which
//! caches kernel symbols, ELF files and DWARF between calls and cannot
//! move between threads), and answers each call's addresses in order. The
//! symbolizer is made again after a while, so that kernel modules and BPF
//! programs loaded since are named.
//!
//! The thread also remembers the processes it named frames of: their
//! executable mappings, and their binaries held open (by descriptor, so
//! that a binary deleted or replaced since still reads as it was mapped),
//! with their ELF build IDs. A process that exited before a later call is
//! named from them; a stack map kept by build ID is named from the binary
//! of each build ID, wherever a process maps it (or /usr/lib/debug).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    thread,
    time::{Duration, Instant},
};

use blazesym::{
    MaybeDefault, Pid,
    symbolize::{
        Input, Symbolized, Symbolizer,
        source::{Elf, Kernel, Process, Source},
    },
};
use bpfmap_proto::v1 as pb;
use tokio::sync::oneshot;

/// How long one symbolizer (and its caches) serves before it is made
/// again.
const RENEW: Duration = Duration::from_secs(60);

/// Whose addresses to name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Space {
    /// The kernel's (BPF programs and modules included).
    Kernel,
    /// A process's.
    Process(u32),
    /// File offsets in the binary of this ELF build ID (a stack map kept by
    /// build ID).
    File(BuildId),
}

/// An ELF build ID as a stack map keeps it (20 bytes, zero-padded).
pub(crate) type BuildId = [u8; 20];

/// Addresses named: a frame per address, in order, and why some have no
/// name.
#[derive(Debug, Default)]
pub(crate) struct Named {
    pub(crate) frames: Vec<pb::Frame>,
    pub(crate) note: Option<Note>,
}

/// Why frames have no name, or how they were named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Note {
    /// The process exited before its addresses were named.
    Exited,
    /// The process exited: its frames were named from its binaries as it
    /// mapped them when the daemon last saw it.
    Remembered,
    /// Anything else, said.
    Said(String),
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited => f.write_str("the process exited before its frames were named"),
            Self::Remembered => f.write_str(
                "the process exited: its frames were named from its binaries as it mapped them",
            ),
            Self::Said(s) => f.write_str(s),
        }
    }
}

struct Ask {
    space: Space,
    addrs: Vec<u64>,
    reply: oneshot::Sender<Named>,
}

/// The symbolizer's thread.
#[derive(Debug)]
pub(crate) struct Symbols {
    tx: std::sync::Mutex<mpsc::Sender<Ask>>,
}

impl Symbols {
    /// Starts the thread (it ends when this is dropped).
    pub(crate) fn start() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Ask>();
        thread::Builder::new()
            .name("symbolizer".into())
            .spawn(move || serve(rx))?;
        Ok(Self {
            tx: std::sync::Mutex::new(tx),
        })
    }

    /// Names `addrs` of `space`: every address a frame, named where the
    /// symbols allow.
    pub(crate) async fn name(&self, space: Space, addrs: Vec<u64>) -> Named {
        let (reply, answer) = oneshot::channel();
        let fallback = addrs.clone();
        let sent = self
            .tx
            .lock()
            .map(|tx| {
                tx.send(Ask {
                    space,
                    addrs,
                    reply,
                })
                .is_ok()
            })
            .unwrap_or(false);
        match sent {
            true => answer.await.unwrap_or_else(|_| unnamed(&fallback, None)),
            false => unnamed(&fallback, Some(Note::Said("the symbolizer stopped".into()))),
        }
    }
}

/// Frames of bare addresses.
pub(crate) fn unnamed(addrs: &[u64], note: Option<Note>) -> Named {
    Named {
        frames: addrs
            .iter()
            .map(|&address| pb::Frame {
                address,
                ..Default::default()
            })
            .collect(),
        note,
    }
}

/// A symbolizer that names functions: no source lines or inlined
/// functions (frames carry neither, and reading DWARF's line tables costs
/// most of a cold call).
fn naming_only() -> Symbolizer {
    Symbolizer::builder()
        .enable_code_info(false)
        .enable_inlined_fns(false)
        .build()
}

fn serve(rx: mpsc::Receiver<Ask>) {
    let mut made = Instant::now();
    let mut symbolizer = naming_only();
    let mut memory = Memory::default();
    while let Ok(ask) = rx.recv() {
        // Binaries let go of: their descriptors' numbers may name others.
        if made.elapsed() > RENEW || memory.forgot_binaries() {
            symbolizer = naming_only();
            made = Instant::now();
        }
        // A binary that makes the symbolizer panic costs its addresses
        // their names, not the thread (a fresh symbolizer serves on).
        let named = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            name(&symbolizer, &mut memory, ask.space, &ask.addrs)
        }));
        let named = named.unwrap_or_else(|_| {
            symbolizer = naming_only();
            made = Instant::now();
            unnamed(
                &ask.addrs,
                Some(Note::Said(
                    "the symbolizer failed on these addresses".into(),
                )),
            )
        });
        let _ = ask.reply.send(named);
    }
}

fn name(symbolizer: &Symbolizer, memory: &mut Memory, space: Space, addrs: &[u64]) -> Named {
    let source = match space {
        Space::Kernel => {
            // kallsyms only: a vmlinux image with kallsyms hidden would be
            // placed at a KASLR offset of 0, and name the wrong functions.
            Source::Kernel(Kernel {
                vmlinux: MaybeDefault::None,
                debug_syms: false,
                ..Default::default()
            })
        }
        Space::Process(pid) => {
            let Some(nonzero) = std::num::NonZeroU32::new(pid) else {
                return unnamed(addrs, Some(Note::Said("user frames of process 0".into())));
            };
            // Its binaries, remembered for after it exits.
            memory.remember(pid);
            let mut p = Process::new(Pid::Pid(nonzero));
            p.perf_map = true;
            Source::Process(p)
        }
        Space::File(id) => return by_build_id(symbolizer, memory, &id, addrs),
    };
    let symbolized = match symbolizer.symbolize(&source, Input::AbsAddr(addrs)) {
        Ok(s) => s,
        Err(e) => {
            let whose = match space {
                Space::Kernel | Space::File(_) => "kernel frames".to_owned(),
                Space::Process(pid) if e.kind() == blazesym::ErrorKind::NotFound => {
                    return remembered(symbolizer, memory, pid, addrs);
                }
                Space::Process(pid) => format!("user frames of process {pid}"),
            };
            let why = match e.kind() {
                blazesym::ErrorKind::PermissionDenied => format!("no permission ({e})"),
                _ => e.to_string(),
            };
            return unnamed(
                addrs,
                Some(Note::Said(format!("{whose} are addresses: {why}"))),
            );
        }
    };
    let mut missing = 0usize;
    let frames = addrs
        .iter()
        .zip(symbolized)
        .map(|(&address, s)| {
            let mut frame = frame(address, s, space == Space::Kernel);
            missing += usize::from(frame.function.is_empty());
            if let Space::Process(pid) = space {
                memory.place(pid, &mut frame);
            }
            frame
        })
        .collect();
    let note = (missing > 0 && space == Space::Kernel && kernel_hidden()).then(|| {
        Note::Said("kernel frames are addresses: /proc/kallsyms shows no addresses (kernel.kptr_restrict, or no CAP_SYSLOG)".to_owned())
    });
    Named { frames, note }
}

/// A frame from what the symbolizer said of `address`.
fn frame(address: u64, s: Symbolized<'_>, kernel: bool) -> pb::Frame {
    match s {
        Symbolized::Sym(sym) => pb::Frame {
            address,
            function: sym.name.into_owned(),
            offset: sym.offset as u64,
            module: match &sym.module {
                Some(m) => m.to_string_lossy().into_owned(),
                None if kernel => "[kernel]".into(),
                None => String::new(),
            },
            ..Default::default()
        },
        Symbolized::Unknown(_) => pb::Frame {
            address,
            ..Default::default()
        },
    }
}

/// Names offsets in one binary, held open as `binary`: the frames with
/// `address` (0 when unknown), the binary's path, build ID and offset.
fn in_binary(
    symbolizer: &Symbolizer,
    binary: &Binary,
    addresses: &[u64],
    offsets: &[u64],
) -> Vec<pb::Frame> {
    let source = Source::Elf(Elf::new(binary.open_path()));
    let named = symbolizer
        .symbolize(&source, Input::FileOffset(offsets))
        .unwrap_or_default();
    let mut named = named.into_iter();
    addresses
        .iter()
        .zip(offsets)
        .map(|(&address, &file_offset)| {
            let mut f = match named.next() {
                Some(s) => frame(address, s, false),
                None => pb::Frame {
                    address,
                    ..Default::default()
                },
            };
            if f.function.is_empty() || f.module.starts_with("/proc/self/fd/") {
                f.module.clone_from(&binary.path);
            }
            // A named frame needs no build ID (frames are many, binaries few).
            if f.function.is_empty() {
                f.build_id = binary.build_id_hex();
            }
            f.file_offset = file_offset;
            f
        })
        .collect()
}

/// Names the addresses of a process that exited from the binaries it
/// mapped when the daemon last saw it.
fn remembered(symbolizer: &Symbolizer, memory: &mut Memory, pid: u32, addrs: &[u64]) -> Named {
    let Some(mappings) = memory.processes.get(&pid).map(|p| p.mappings.clone()) else {
        return unnamed(addrs, Some(Note::Exited));
    };
    let mut frames = unnamed(addrs, None).frames;
    // Per binary, the addresses it holds and their offsets in it.
    let mut per: HashMap<FileKey, Vec<(usize, u64)>> = HashMap::new();
    for (i, &a) in addrs.iter().enumerate() {
        if let Some(m) = mappings.iter().find(|m| (m.start..m.end).contains(&a)) {
            per.entry(m.file)
                .or_default()
                .push((i, a - m.start + m.offset));
        }
    }
    for (key, at) in per {
        let Some(binary) = memory.binaries.get_mut(&key) else {
            continue;
        };
        binary.used = Instant::now();
        let (idx, offsets): (Vec<usize>, Vec<u64>) = at.into_iter().unzip();
        let addresses: Vec<u64> = idx.iter().map(|&i| addrs[i]).collect();
        for (i, f) in idx
            .into_iter()
            .zip(in_binary(symbolizer, binary, &addresses, &offsets))
        {
            frames[i] = f;
        }
    }
    Named {
        frames,
        note: Some(Note::Remembered),
    }
}

/// Names offsets in the binary of build ID `id`: one a process maps (or
/// mapped), else /usr/lib/debug/.build-id's.
fn by_build_id(
    symbolizer: &Symbolizer,
    memory: &mut Memory,
    id: &BuildId,
    offsets: &[u64],
) -> Named {
    let hex = hex_id(id);
    let addresses = vec![0; offsets.len()];
    if let Some(binary) = memory.by_build_id(id) {
        return Named {
            frames: in_binary(symbolizer, binary, &addresses, offsets),
            note: None,
        };
    }
    let debug = Path::new("/usr/lib/debug/.build-id")
        .join(&hex[..2.min(hex.len())])
        .join(format!("{}.debug", hex.get(2..).unwrap_or("")));
    if let Ok(file) = std::fs::File::open(&debug) {
        let binary = Binary::new(file, debug.display().to_string(), Some(id.to_vec()));
        return Named {
            frames: in_binary(symbolizer, &binary, &addresses, offsets),
            note: None,
        };
    }
    let frames = offsets
        .iter()
        .map(|&file_offset| pb::Frame {
            build_id: hex.clone(),
            file_offset,
            ..Default::default()
        })
        .collect();
    Named {
        frames,
        note: Some(Note::Said(format!(
            "frames of build ID {hex} are offsets: no running process maps a binary with that build ID, nor is it in /usr/lib/debug/.build-id"
        ))),
    }
}

/// A build ID as hex, its zero padding cut (a 20-byte SHA-1 keeps all).
fn hex_id(id: &[u8]) -> String {
    let end = id.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    let end = if id.len() == 20 && end > 16 { 20 } else { end };
    id[..end].iter().map(|b| format!("{b:02x}")).collect()
}

/// A binary by its device and inode.
type FileKey = (u64, u64);

/// A binary some process mapped, held open so that its frames are named
/// after the process exits, and after the file is replaced or deleted.
#[derive(Debug)]
struct Binary {
    file: std::fs::File,
    /// Its path as the process mapped it.
    path: String,
    build_id: Option<Vec<u8>>,
    used: Instant,
}

impl Binary {
    fn new(file: std::fs::File, path: String, build_id: Option<Vec<u8>>) -> Self {
        Self {
            file,
            path,
            build_id,
            used: Instant::now(),
        }
    }

    /// The path the symbolizer opens it by: its descriptor.
    fn open_path(&self) -> PathBuf {
        use std::os::fd::AsRawFd as _;
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    fn build_id_hex(&self) -> String {
        self.build_id.as_deref().map(hex_id).unwrap_or_default()
    }
}

/// An executable mapping of a process.
#[derive(Debug, Clone, Copy)]
struct Mapping {
    start: u64,
    end: u64,
    offset: u64,
    file: FileKey,
}

/// A process as the daemon last saw it.
#[derive(Debug)]
struct Seen {
    at: Instant,
    mappings: Arc<Vec<Mapping>>,
}

/// How many processes' mappings are remembered, and for how long after
/// they were last seen.
const KEEP_PROCESSES: usize = 4096;
const KEEP_FOR: Duration = Duration::from_secs(15 * 60);
/// How long a process's mappings, once read, serve without reading them
/// again.
const FRESH: Duration = Duration::from_secs(5);
/// How many binaries are held open.
const KEEP_BINARIES: usize = 512;
/// How often every process is looked at for a build ID none is known for.
const RESCAN: Duration = Duration::from_secs(10);

/// The processes and binaries the symbolizer saw, for frames named after
/// the process is gone: a stack map kept by build ID, a process that
/// exited between two calls.
#[derive(Debug, Default)]
struct Memory {
    processes: HashMap<u32, Seen>,
    binaries: HashMap<FileKey, Binary>,
    build_ids: HashMap<Vec<u8>, FileKey>,
    scanned: Option<Instant>,
    forgot: bool,
}

impl Memory {
    /// Reads the executable mappings of live process `pid` and holds its
    /// binaries open.
    fn remember(&mut self, pid: u32) {
        // Seen a moment ago: its mappings are those.
        if self
            .processes
            .get(&pid)
            .is_some_and(|p| p.at.elapsed() < FRESH)
        {
            return;
        }
        let dir = PathBuf::from(format!("/proc/{pid}"));
        let Ok(maps) = std::fs::read_to_string(dir.join("maps")) else {
            return;
        };
        let mut mappings = Vec::new();
        for line in maps.lines() {
            let Some(m) = parse_mapping(line) else {
                continue;
            };
            let (range, path) = (m.0, m.1);
            if !self.binaries.contains_key(&range.file) {
                let opened = std::fs::File::open(
                    dir.join("map_files")
                        .join(format!("{:x}-{:x}", range.start, range.end)),
                )
                .or_else(|_| {
                    std::fs::File::open(dir.join("root").join(path.trim_start_matches('/')))
                });
                let Ok(file) = opened else { continue };
                let mut binary = Binary::new(file, path.to_owned(), None);
                binary.build_id = blazesym::helper::read_elf_build_id(&binary.open_path())
                    .ok()
                    .flatten()
                    .map(|b| b.into_owned());
                if let Some(id) = &binary.build_id {
                    self.build_ids.insert(pad(id), range.file);
                }
                self.binaries.insert(range.file, binary);
            }
            mappings.push(range);
        }
        self.processes.insert(
            pid,
            Seen {
                at: Instant::now(),
                mappings: Arc::new(mappings),
            },
        );
        self.forget();
    }

    /// Where a live process's frame is in its binary: its offset, and for
    /// a frame without a name its binary and build ID.
    fn place(&self, pid: u32, frame: &mut pb::Frame) {
        let Some(seen) = self.processes.get(&pid) else {
            return;
        };
        if let Some(m) = seen
            .mappings
            .iter()
            .find(|m| (m.start..m.end).contains(&frame.address))
            && let Some(b) = self.binaries.get(&m.file)
        {
            if frame.function.is_empty() {
                frame.build_id = b.build_id_hex();
                frame.module.clone_from(&b.path);
            }
            frame.file_offset = frame.address - m.start + m.offset;
        }
    }

    /// The binary of build ID `id`: one seen, else found by looking at
    /// every process (at most every [`RESCAN`]).
    fn by_build_id(&mut self, id: &BuildId) -> Option<&Binary> {
        if !self.build_ids.contains_key(id.as_slice())
            && self.scanned.is_none_or(|at| at.elapsed() > RESCAN)
        {
            self.scanned = Some(Instant::now());
            let pids: Vec<u32> = std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .filter(|p| *p != std::process::id())
                .collect();
            for pid in pids {
                self.remember(pid);
            }
        }
        let key = *self.build_ids.get(id.as_slice())?;
        let binary = self.binaries.get_mut(&key)?;
        binary.used = Instant::now();
        Some(binary)
    }

    /// Forgets processes not seen for [`KEEP_FOR`] and the oldest beyond
    /// the bounds, and the binaries no remembered process maps.
    fn forget(&mut self) {
        self.processes.retain(|_, p| p.at.elapsed() < KEEP_FOR);
        if self.processes.len() > KEEP_PROCESSES {
            let mut by_age: Vec<(Instant, u32)> =
                self.processes.iter().map(|(pid, p)| (p.at, *pid)).collect();
            by_age.sort();
            for (_, pid) in &by_age[..by_age.len() - KEEP_PROCESSES] {
                self.processes.remove(pid);
            }
        }
        if self.binaries.len() > KEEP_BINARIES {
            let mapped: std::collections::HashSet<FileKey> = self
                .processes
                .values()
                .flat_map(|p| p.mappings.iter().map(|m| m.file))
                .collect();
            let mut by_use: Vec<(bool, Instant, FileKey)> = self
                .binaries
                .iter()
                .map(|(k, b)| (mapped.contains(k), b.used, *k))
                .collect();
            by_use.sort();
            for (_, _, key) in &by_use[..by_use.len() - KEEP_BINARIES] {
                self.binaries.remove(key);
            }
            self.build_ids.retain(|_, k| self.binaries.contains_key(k));
            self.forgot = true;
        }
    }

    /// Whether binaries were let go of since the last call.
    fn forgot_binaries(&mut self) -> bool {
        std::mem::take(&mut self.forgot)
    }
}

/// A build ID as a stack map keeps it: 20 bytes, zero-padded.
fn pad(id: &[u8]) -> Vec<u8> {
    let mut v = id.to_vec();
    v.resize(v.len().max(20), 0);
    v
}

/// An executable mapping of a file, from a line of /proc/PID/maps
/// (`start-end perms offset major:minor inode path`), and its path.
fn parse_mapping(line: &str) -> Option<(Mapping, &str)> {
    let mut parts = line.split_ascii_whitespace();
    let (range, perms, offset, dev, inode) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    let path = parts.next()?;
    if !perms.contains('x') || !path.starts_with('/') {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let inode: u64 = inode.parse().ok()?;
    if inode == 0 {
        return None;
    }
    let hex = |s: &str| u64::from_str_radix(s, 16).ok();
    Some((
        Mapping {
            start: hex(start)?,
            end: hex(end)?,
            offset: hex(offset)?,
            file: ((hex(major)? << 32) | hex(minor)?, inode),
        },
        path,
    ))
}

/// Whether /proc/kallsyms hides its addresses (all zero).
fn kernel_hidden() -> bool {
    use std::io::BufRead as _;
    let Ok(f) = std::fs::File::open("/proc/kallsyms") else {
        return true;
    };
    std::io::BufReader::new(f)
        .lines()
        .take(16)
        .map_while(Result::ok)
        .all(|l| {
            l.split(' ')
                .next()
                .is_some_and(|a| a.bytes().all(|b| b == b'0'))
        })
}
