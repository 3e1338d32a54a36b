//! Frame names: one thread owns the daemon's symbolizer (blazesym, which
//! caches kernel symbols, ELF files and DWARF between calls and cannot
//! move between threads), and answers each call's addresses in order. The
//! symbolizer is made again after a while, so that kernel modules and BPF
//! programs loaded since are named.

use std::{
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use blazesym::{
    MaybeDefault, Pid,
    symbolize::{
        Input, Symbolized, Symbolizer,
        source::{Kernel, Process, Source},
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
}

/// Addresses named: a frame per address, in order, and why some have no
/// name.
#[derive(Debug, Default)]
pub(crate) struct Named {
    pub(crate) frames: Vec<pb::Frame>,
    pub(crate) note: Option<Note>,
}

/// Why frames have no name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Note {
    /// The process exited before its addresses were named.
    Exited,
    /// Anything else, said.
    Said(String),
}

impl std::fmt::Display for Note {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exited => f.write_str("the process exited before its frames were named"),
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
    while let Ok(ask) = rx.recv() {
        if made.elapsed() > RENEW {
            symbolizer = naming_only();
            made = Instant::now();
        }
        // A binary that makes the symbolizer panic costs its addresses
        // their names, not the thread (a fresh symbolizer serves on).
        let named = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            name(&symbolizer, ask.space, &ask.addrs)
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

fn name(symbolizer: &Symbolizer, space: Space, addrs: &[u64]) -> Named {
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
            let Some(pid) = std::num::NonZeroU32::new(pid) else {
                return unnamed(addrs, Some(Note::Said("user frames of process 0".into())));
            };
            let mut p = Process::new(Pid::Pid(pid));
            p.perf_map = true;
            Source::Process(p)
        }
    };
    let symbolized = match symbolizer.symbolize(&source, Input::AbsAddr(addrs)) {
        Ok(s) => s,
        Err(e) => {
            let whose = match space {
                Space::Kernel => "kernel frames".to_owned(),
                Space::Process(_) if e.kind() == blazesym::ErrorKind::NotFound => {
                    return unnamed(addrs, Some(Note::Exited));
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
        .map(|(&address, s)| match s {
            Symbolized::Sym(sym) => pb::Frame {
                address,
                function: sym.name.into_owned(),
                offset: sym.offset as u64,
                module: match (&sym.module, space) {
                    (Some(m), _) => m.to_string_lossy().into_owned(),
                    (None, Space::Kernel) => "[kernel]".into(),
                    (None, Space::Process(_)) => String::new(),
                },
            },
            Symbolized::Unknown(_) => {
                missing += 1;
                pb::Frame {
                    address,
                    ..Default::default()
                }
            }
        })
        .collect();
    let note = (missing > 0 && space == Space::Kernel && kernel_hidden()).then(|| {
        Note::Said("kernel frames are addresses: /proc/kallsyms shows no addresses (kernel.kptr_restrict, or no CAP_SYSLOG)".to_owned())
    });
    Named { frames, note }
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
