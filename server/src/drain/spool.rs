//! The spool of one map's drain: every drained chunk in a file of its own,
//! written and made durable (fsync of the file and of the directory)
//! before the chunk is sent, and removed once acknowledged.
//!
//! A file is `<sequence>.chunk` (20 digits): a header (magic, version,
//! sequence, the map's kernel id, key and value sizes, entry count, the
//! identity that drained it, the chunk's cursor), the keys, the values,
//! and a SHA-256 of all that before it. A file that does not read back as
//! written is refused (DATA_LOSS naming it), never skipped or guessed at.
//! `acked` holds the highest sequence acknowledged, so that sequences
//! keep increasing when the spool is empty.

use std::{
    fs::{self, File},
    io::{self, Write as _},
    path::{Path, PathBuf},
};

use crate::error::Error;

const MAGIC: &[u8; 8] = b"BPFMAPSP";
const VERSION: u8 = 1;
const DIGEST: usize = 32;
const SUFFIX: &str = ".chunk";

/// One chunk as spooled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Spooled {
    pub(crate) sequence: u64,
    pub(crate) map_id: u32,
    pub(crate) key_size: u32,
    /// One entry's value in the kernel's layout (all CPUs).
    pub(crate) value_size: u32,
    pub(crate) count: u32,
    pub(crate) identity: [u8; 16],
    pub(crate) cursor: String,
    pub(crate) keys: Vec<u8>,
    pub(crate) values: Vec<u8>,
}

/// A chunk file found in the spool (its header read, its body not yet).
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) sequence: u64,
    pub(crate) path: PathBuf,
    pub(crate) bytes: u64,
    /// Entries it holds, from its header (checked when it is read).
    pub(crate) count: u64,
}

/// One map's spool directory.
#[derive(Debug)]
pub(crate) struct Spool {
    dir: PathBuf,
    files: Vec<Entry>,
    acked: u64,
}

/// Why the spool cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpoolError {
    /// The file system failed.
    #[error("the drain spool cannot be read or written: {0}")]
    Io(#[from] io::Error),
    /// A file that is not what was written.
    #[error(
        "spool file {} is corrupt ({why}); the daemon will not drop or guess its entries: inspect it, then move it out of the spool to go on",
        path.display()
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: Damage,
    },
}

/// What is wrong with a spool file.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Damage {
    #[error("{0} bytes: truncated")]
    Truncated(usize),
    #[error("its checksum does not match: truncated or altered")]
    Checksum,
    #[error("not a spool file")]
    NotASpool,
    #[error("version {0} is not {VERSION}")]
    Version(u8),
    #[error("{got} bytes of entries, {want} expected")]
    Length { got: usize, want: u64 },
    #[error("its cursor is not text")]
    Cursor,
    #[error("its name is not a sequence number")]
    Name,
    #[error("its sequence is not its name's")]
    Sequence,
    #[error("not a number")]
    Acked,
    #[error("a chunk cut short while the daemon stopped: {0}")]
    CutShort(Box<Damage>),
}

impl From<SpoolError> for Error {
    fn from(e: SpoolError) -> Self {
        match e {
            SpoolError::Io(_) => Error::Internal {
                map: None,
                message: e.to_string(),
            },
            SpoolError::Corrupt { .. } => Error::SpoolCorrupt(e.to_string()),
        }
    }
}

fn corrupt(path: &Path, why: Damage) -> SpoolError {
    SpoolError::Corrupt {
        path: path.to_owned(),
        why,
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Spool {
    /// Opens (creating) the spool in `dir`, listing its chunks.
    pub(crate) fn open(dir: &Path) -> Result<Self, SpoolError> {
        fs::create_dir_all(dir)?;
        let mut files = Vec::new();
        for e in fs::read_dir(dir)? {
            let e = e?;
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(seq) = name.strip_suffix(SUFFIX) {
                let path = e.path();
                let Ok(sequence) = seq.parse::<u64>() else {
                    return Err(corrupt(&path, Damage::Name));
                };
                let count = header_count(&path)?;
                files.push(Entry {
                    sequence,
                    bytes: e.metadata()?.len(),
                    path,
                    count,
                });
            } else if let Some(seq) = name.strip_suffix(".tmp") {
                // A chunk being written when the daemon stopped: its entries
                // are no longer in the map. Complete, it is kept (it was
                // never sent); cut short, it is refused like any damage.
                let path = e.path();
                let bytes = fs::read(&path)?;
                match decode(&bytes) {
                    Ok(c) if seq.parse() == Ok(c.sequence) => {
                        let chunk = dir.join(format!("{:020}{SUFFIX}", c.sequence));
                        File::open(&path)?.sync_all()?;
                        fs::rename(&path, &chunk)?;
                        sync_dir(dir)?;
                        files.push(Entry {
                            sequence: c.sequence,
                            bytes: bytes.len() as u64,
                            path: chunk,
                            count: u64::from(c.count),
                        });
                    }
                    Ok(_) => return Err(corrupt(&path, Damage::Sequence)),
                    Err(why) => return Err(corrupt(&path, Damage::CutShort(Box::new(why)))),
                }
            }
        }
        files.sort_by_key(|f| f.sequence);
        let acked = match fs::read_to_string(dir.join("acked")) {
            Ok(s) => match s.trim().parse() {
                Ok(n) => n,
                Err(_) => return Err(corrupt(&dir.join("acked"), Damage::Acked)),
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e.into()),
        };
        Ok(Self {
            dir: dir.to_owned(),
            files,
            acked,
        })
    }

    /// The chunks not acknowledged, oldest first.
    pub(crate) fn pending(&self) -> &[Entry] {
        &self.files
    }

    /// Entries in the chunks not acknowledged.
    pub(crate) fn entries(&self) -> u64 {
        self.files.iter().map(|f| f.count).sum()
    }

    /// Bytes the chunks take.
    pub(crate) fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }

    /// The sequence the next chunk gets.
    pub(crate) fn next_sequence(&self) -> u64 {
        self.files
            .last()
            .map_or(self.acked, |f| f.sequence.max(self.acked))
            + 1
    }

    /// Reads a chunk back, checking it is exactly what was written.
    pub(crate) fn read(&self, e: &Entry) -> Result<Spooled, SpoolError> {
        let bytes = fs::read(&e.path)?;
        let s = decode(&bytes).map_err(|why| corrupt(&e.path, why))?;
        if s.sequence != e.sequence {
            return Err(corrupt(&e.path, Damage::Sequence));
        }
        Ok(s)
    }

    /// Writes a chunk and makes it durable.
    pub(crate) fn write(&mut self, s: &Spooled) -> io::Result<()> {
        let bytes = encode(s);
        let path = self.dir.join(format!("{:020}{SUFFIX}", s.sequence));
        let tmp = path.with_extension("tmp");
        let mut f = File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, &path)?;
        sync_dir(&self.dir)?;
        self.files.push(Entry {
            sequence: s.sequence,
            path,
            bytes: bytes.len() as u64,
            count: u64::from(s.count),
        });
        Ok(())
    }

    /// Removes the chunks up to `sequence` (acknowledged); the entries they
    /// held.
    pub(crate) fn ack(&mut self, sequence: u64) -> io::Result<u64> {
        if sequence <= self.acked && self.files.first().is_none_or(|f| f.sequence > sequence) {
            return Ok(0);
        }
        // The high-water mark first: a crash between the two leaves files
        // that the next call removes again.
        let mark = self.dir.join("acked");
        let tmp = self.dir.join("acked.tmp");
        fs::write(&tmp, format!("{}\n", sequence.max(self.acked)))?;
        File::open(&tmp)?.sync_all()?;
        fs::rename(&tmp, &mark)?;
        self.acked = sequence.max(self.acked);
        let mut removed = 0;
        let (gone, kept): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut self.files)
            .into_iter()
            .partition(|f| f.sequence <= sequence);
        for f in &gone {
            removed += f.count;
            match fs::remove_file(&f.path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    self.files = gone.iter().cloned().chain(kept).collect();
                    return Err(e);
                }
            }
        }
        self.files = kept;
        sync_dir(&self.dir)?;
        Ok(removed)
    }
}

/// The entry count in a chunk file's header (0 when it is too short to
/// have one: reading it reports the damage).
fn header_count(path: &Path) -> io::Result<u64> {
    use std::io::Read as _;
    let mut h = [0u8; 36];
    let mut f = File::open(path)?;
    match f.read_exact(&mut h) {
        Ok(()) => Ok(u64::from(u32::from_le_bytes(
            h[32..36].try_into().expect("4"),
        ))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
        Err(e) => Err(e),
    }
}

fn encode(s: &Spooled) -> Vec<u8> {
    let mut b = Vec::with_capacity(96 + s.cursor.len() + s.keys.len() + s.values.len());
    b.extend_from_slice(MAGIC);
    b.push(VERSION);
    b.extend_from_slice(&[0; 3]);
    b.extend_from_slice(&s.sequence.to_le_bytes());
    b.extend_from_slice(&s.map_id.to_le_bytes());
    b.extend_from_slice(&s.key_size.to_le_bytes());
    b.extend_from_slice(&s.value_size.to_le_bytes());
    b.extend_from_slice(&s.count.to_le_bytes());
    b.extend_from_slice(&s.identity);
    b.extend_from_slice(&(s.cursor.len() as u32).to_le_bytes());
    b.extend_from_slice(s.cursor.as_bytes());
    b.extend_from_slice(&s.keys);
    b.extend_from_slice(&s.values);
    let digest = ring::digest::digest(&ring::digest::SHA256, &b);
    b.extend_from_slice(digest.as_ref());
    b
}

fn decode(b: &[u8]) -> Result<Spooled, Damage> {
    if b.len() < 8 + 4 + 8 + 16 + 16 + 4 + DIGEST {
        return Err(Damage::Truncated(b.len()));
    }
    let (body, digest) = b.split_at(b.len() - DIGEST);
    if ring::digest::digest(&ring::digest::SHA256, body).as_ref() != digest {
        return Err(Damage::Checksum);
    }
    if &body[..8] != MAGIC {
        return Err(Damage::NotASpool);
    }
    if body[8] != VERSION {
        return Err(Damage::Version(body[8]));
    }
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let sequence = u64::from_le_bytes(body[12..20].try_into().expect("8 bytes"));
    let (map_id, key_size, value_size, count) = (u32_at(20), u32_at(24), u32_at(28), u32_at(32));
    let identity: [u8; 16] = body[36..52].try_into().expect("16 bytes");
    let cursor_len = u32_at(52) as usize;
    let rest = &body[56..];
    let want = cursor_len as u64 + u64::from(count) * (u64::from(key_size) + u64::from(value_size));
    if rest.len() as u64 != want {
        return Err(Damage::Length {
            got: rest.len(),
            want,
        });
    }
    let cursor = std::str::from_utf8(&rest[..cursor_len])
        .map_err(|_| Damage::Cursor)?
        .to_owned();
    let kb = count as usize * key_size as usize;
    let rest = &rest[cursor_len..];
    Ok(Spooled {
        sequence,
        map_id,
        key_size,
        value_size,
        count,
        identity,
        cursor,
        keys: rest[..kb].to_vec(),
        values: rest[kb..].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(sequence: u64) -> Spooled {
        Spooled {
            sequence,
            map_id: 7,
            key_size: 4,
            value_size: 8,
            count: 2,
            identity: [1; 16],
            cursor: format!("c{sequence}"),
            keys: vec![1, 0, 0, 0, 2, 0, 0, 0],
            values: (0..16).collect(),
        }
    }

    #[test]
    fn chunks_survive_reopening_until_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spool::open(dir.path()).unwrap();
        assert_eq!(s.next_sequence(), 1);
        s.write(&chunk(1)).unwrap();
        s.write(&chunk(2)).unwrap();
        s.write(&chunk(3)).unwrap();
        let s2 = Spool::open(dir.path()).unwrap();
        let seqs: Vec<u64> = s2.pending().iter().map(|e| e.sequence).collect();
        assert_eq!(seqs, [1, 2, 3]);
        assert_eq!(s2.read(&s2.pending()[1]).unwrap(), chunk(2));
        assert_eq!(s.ack(2).unwrap(), 4);
        let mut s3 = Spool::open(dir.path()).unwrap();
        assert_eq!(s3.pending().len(), 1);
        assert_eq!(s3.ack(3).unwrap(), 2);
        // Sequences go on increasing once the spool is empty.
        let s4 = Spool::open(dir.path()).unwrap();
        assert!(s4.pending().is_empty());
        assert_eq!(s4.next_sequence(), 4);
    }

    #[test]
    fn a_chunk_written_but_not_renamed_is_kept_and_a_cut_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(format!("{:020}.tmp", 4)), encode(&chunk(4))).unwrap();
        let s = Spool::open(dir.path()).unwrap();
        let seqs: Vec<u64> = s.pending().iter().map(|e| e.sequence).collect();
        assert_eq!(seqs, [4]);
        assert_eq!(s.read(&s.pending()[0]).unwrap(), chunk(4));
        assert_eq!(s.next_sequence(), 5);
        let bytes = encode(&chunk(5));
        let cut = dir.path().join(format!("{:020}.tmp", 5));
        fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
        let e = Spool::open(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("cut short") && e.contains(&cut.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn a_truncated_or_altered_file_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spool::open(dir.path()).unwrap();
        s.write(&chunk(1)).unwrap();
        s.write(&chunk(2)).unwrap();
        let p1 = s.pending()[0].path.clone();
        let bytes = fs::read(&p1).unwrap();
        fs::write(&p1, &bytes[..bytes.len() - 5]).unwrap();
        let p2 = s.pending()[1].path.clone();
        let mut bytes = fs::read(&p2).unwrap();
        bytes[60] ^= 1;
        fs::write(&p2, &bytes).unwrap();
        let s = Spool::open(dir.path()).unwrap();
        for e in s.pending() {
            let err = s.read(e).unwrap_err().to_string();
            assert!(err.contains(&e.path.display().to_string()), "{err}");
            assert!(err.contains("checksum"), "{err}");
        }
    }
}
