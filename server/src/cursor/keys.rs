//! The keys resume tokens are sealed with, and the sealing itself, for the
//! daemon's cursors and bpfmap-relay's fleet cursors alike.
//!
//! A key is 32 random bytes in a file of a state directory, made at first
//! start (the directory 0700, the file 0600) and refused when group or
//! others may read it. A rotation moves the key to `NAME.previous` and
//! writes a new one: tokens sealed with the previous key are still opened
//! until the next rotation. A token is a prefix letter (whose token it is)
//! then URL-safe base64 of a random nonce and the record sealed with
//! ChaCha20-Poly1305, so a client can neither read, forge nor alter one.
//! What a record binds (the caller, the call) is each format's own,
//! compared as [`binding_digest`]s.

use std::{
    fs,
    io::{self, Read, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use ring::{
    aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey},
    rand::{SecureRandom, SystemRandom},
};

const KEY_LEN: usize = 32;

/// Where a key and the one before its last rotation are kept: `NAME` and
/// `NAME.previous` in a state directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFiles {
    dir: PathBuf,
    name: String,
}

impl KeyFiles {
    /// The key `name` in `state_dir` ("cursor.key" for the daemon,
    /// "fleet-cursor.key" for the relay).
    pub fn new(state_dir: &Path, name: &str) -> Self {
        Self {
            dir: state_dir.to_owned(),
            name: name.to_owned(),
        }
    }

    /// The files: the current key, then the previous one.
    pub fn paths(&self) -> [PathBuf; 2] {
        [self.current(), self.previous()]
    }

    fn current(&self) -> PathBuf {
        self.dir.join(&self.name)
    }

    fn previous(&self) -> PathBuf {
        self.dir.join(format!("{}.previous", self.name))
    }

    fn next(&self) -> PathBuf {
        self.dir.join(format!("{}.new", self.name))
    }
}

/// Why a key cannot be loaded, made or rotated.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The state directory cannot be made.
    #[error("cannot create state directory {path}: {error}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// Why.
        error: io::Error,
    },
    /// A key file cannot be read, made or moved.
    #[error("cannot read or create cursor key {path}: {error}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        error: io::Error,
    },
    /// A key file of the wrong size.
    #[error("cursor key {path} must be {KEY_LEN} bytes, found {len}")]
    Length {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: usize,
    },
    /// A key file that group or others may read.
    #[error(
        "cursor key {path} is accessible by group or others (mode {mode:o}); run chmod 600 on it"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// No randomness to make a key with.
    #[error("no system randomness to create a cursor key")]
    Random,
}

/// Why a token's text does not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsealed {
    /// Not URL-safe base64.
    #[error("not valid base64")]
    Encoding,
    /// Too short to hold a nonce, a record and its tag.
    #[error("too short")]
    Malformed,
    /// Altered, or sealed under a key not held (neither the current one nor
    /// the previous).
    #[error("altered, or sealed under another key")]
    NotAuthentic,
}

/// The keys tokens are sealed with: the current one, which seals, and the
/// one before the last rotation, which still opens.
#[derive(Clone)]
pub struct SealingKeys {
    current: Arc<LessSafeKey>,
    previous: Option<Arc<LessSafeKey>>,
    rng: SystemRandom,
}

impl std::fmt::Debug for SealingKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealingKeys(..)")
    }
}

impl SealingKeys {
    /// A key from raw bytes: the first 32 bytes are used, shorter input is
    /// zero-padded (tests use short keys).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut raw = [0u8; KEY_LEN];
        for (d, s) in raw.iter_mut().zip(bytes) {
            *d = *s;
        }
        Self {
            current: Arc::new(aead_key(&raw)),
            previous: None,
            rng: SystemRandom::new(),
        }
    }

    /// The keys of `files` (the previous one if a rotation left it),
    /// creating the directory (0700) and a random key (0600) on first
    /// start.
    pub fn load_or_create(files: &KeyFiles) -> Result<Self, KeyError> {
        let mut keys = Self::load_or_create_current(files)?;
        let previous = files.previous();
        if previous.exists() {
            keys.previous = Some(Arc::new(aead_key(&read_key(&previous)?)));
        }
        Ok(keys)
    }

    /// Rotates the key of `files`: the current key becomes the previous one
    /// (its tokens stay valid until the next rotation) and a new random key
    /// becomes current.
    pub fn rotate(files: &KeyFiles) -> Result<(), KeyError> {
        Self::load_or_create_current(files)?;
        let (current, previous, next) = (files.current(), files.previous(), files.next());
        let err = |path: &Path| {
            let path = path.to_owned();
            move |error| KeyError::File { path, error }
        };
        let _ = fs::remove_file(&next);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&next)
            .map_err(err(&next))?;
        let mut bytes = [0u8; KEY_LEN];
        SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| KeyError::Random)?;
        f.write_all(&bytes).map_err(err(&next))?;
        f.sync_all().map_err(err(&next))?;
        fs::rename(&current, &previous).map_err(err(&previous))?;
        fs::rename(&next, &current).map_err(err(&current))?;
        fs::File::open(&files.dir)
            .and_then(|d| d.sync_all())
            .map_err(err(&files.dir))?;
        tracing::info!(key = %current.display(), "rotated the cursor key");
        Ok(())
    }

    fn load_or_create_current(files: &KeyFiles) -> Result<Self, KeyError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&files.dir)
            .map_err(|error| KeyError::Dir {
                path: files.dir.clone(),
                error,
            })?;
        let path = files.current();
        let file_err = |error| KeyError::File {
            path: path.clone(),
            error,
        };
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(mut f) => {
                let mut bytes = [0u8; KEY_LEN];
                SystemRandom::new()
                    .fill(&mut bytes)
                    .map_err(|_| KeyError::Random)?;
                f.write_all(&bytes).map_err(file_err)?;
                f.sync_all().map_err(file_err)?;
                tracing::info!(path = %path.display(), "created a new cursor key");
                Ok(Self::from_bytes(&bytes))
            }
            // Made before, or by another replica first.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                Ok(Self::from_bytes(&read_key(&path)?))
            }
            Err(e) => Err(file_err(e)),
        }
    }

    /// `record` sealed with the current key, as a token: `prefix`, then
    /// URL-safe base64 of a random nonce and the sealed record.
    pub fn seal(&self, prefix: char, mut record: Vec<u8>) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).expect("system randomness");
        self.current
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut record,
            )
            .expect("sealing a buffer in memory");
        let mut raw = Vec::with_capacity(NONCE_LEN + record.len());
        raw.extend_from_slice(&nonce);
        raw.extend_from_slice(&record);
        let mut out = String::with_capacity(1 + raw.len() * 4 / 3 + 4);
        out.push(prefix);
        URL_SAFE_NO_PAD.encode_string(raw, &mut out);
        out
    }

    /// The record of a token's text after its prefix, authenticated with
    /// the current key or else the previous one. Nothing of what a client
    /// sent is interpreted before it is authenticated.
    pub fn open(&self, text: &str) -> Result<Vec<u8>, Unsealed> {
        let raw = URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| Unsealed::Encoding)?;
        if raw.len() < NONCE_LEN + CHACHA20_POLY1305.tag_len() + 1 {
            return Err(Unsealed::Malformed);
        }
        let (nonce, sealed) = raw.split_at(NONCE_LEN);
        let nonce: [u8; NONCE_LEN] = nonce.try_into().expect("NONCE_LEN bytes");
        for key in std::iter::once(&self.current).chain(&self.previous) {
            let mut body = sealed.to_vec();
            let n = Nonce::assume_unique_for_key(nonce);
            if let Ok(record) = key.open_in_place(n, Aad::empty(), &mut body) {
                let len = record.len();
                body.truncate(len);
                return Ok(body);
            }
        }
        Err(Unsealed::NotAuthentic)
    }
}

fn aead_key(raw: &[u8]) -> LessSafeKey {
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, raw).expect("32-byte key"))
}

/// Reads a key file: owner-only, exactly 32 bytes.
fn read_key(path: &Path) -> Result<Vec<u8>, KeyError> {
    let file_err = |error| KeyError::File {
        path: path.to_owned(),
        error,
    };
    let mut f = fs::File::open(path).map_err(file_err)?;
    let mode = f.metadata().map_err(file_err)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeyError::Permissions {
            path: path.to_owned(),
            mode,
        });
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(file_err)?;
    if bytes.len() != KEY_LEN {
        return Err(KeyError::Length {
            path: path.to_owned(),
            len: bytes.len(),
        });
    }
    Ok(bytes)
}

/// What a token binds, at a constant size: the first 16 bytes of the
/// SHA-256 of `bytes` (an identity's name, a call's parameters).
pub fn binding_digest(bytes: &[u8]) -> [u8; 16] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0; 16];
    out.copy_from_slice(&d.as_ref()[..16]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_record_opens_with_its_key_only_and_a_flipped_bit_does_not() {
        let key = SealingKeys::from_bytes(b"k");
        let token = key.seal('x', b"record".to_vec());
        assert!(token.starts_with('x'));
        assert_eq!(key.open(&token[1..]).unwrap(), b"record");
        assert_eq!(
            SealingKeys::from_bytes(b"other").open(&token[1..]),
            Err(Unsealed::NotAuthentic)
        );
        let raw = URL_SAFE_NO_PAD.decode(&token[1..]).unwrap();
        for i in 0..raw.len() {
            let mut bad = raw.clone();
            bad[i] ^= 1;
            assert_eq!(
                key.open(&URL_SAFE_NO_PAD.encode(bad)),
                Err(Unsealed::NotAuthentic),
                "byte {i}"
            );
        }
        assert_eq!(key.open("not base64!"), Err(Unsealed::Encoding));
        assert_eq!(key.open("AAAA"), Err(Unsealed::Malformed));
    }

    #[test]
    fn keys_are_made_owner_only_refused_when_readable_and_rotated_once_back() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let files = KeyFiles::new(&state, "test.key");
        let k1 = SealingKeys::load_or_create(&files).unwrap();
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(&state.join("test.key")), 0o600);
        let old = k1.seal('x', b"old".to_vec());
        SealingKeys::rotate(&files).unwrap();
        assert_eq!(mode(&state.join("test.key.previous")), 0o600);
        let k2 = SealingKeys::load_or_create(&files).unwrap();
        assert_eq!(
            k2.open(&old[1..]).unwrap(),
            b"old",
            "the previous key opens"
        );
        let new = k2.seal('x', b"new".to_vec());
        assert_eq!(k1.open(&new[1..]), Err(Unsealed::NotAuthentic));
        SealingKeys::rotate(&files).unwrap();
        let k3 = SealingKeys::load_or_create(&files).unwrap();
        assert_eq!(k3.open(&old[1..]), Err(Unsealed::NotAuthentic));
        assert_eq!(k3.open(&new[1..]).unwrap(), b"new");
        fs::set_permissions(state.join("test.key"), fs::Permissions::from_mode(0o640)).unwrap();
        assert!(matches!(
            SealingKeys::load_or_create(&files),
            Err(KeyError::Permissions { mode: 0o640, .. })
        ));
    }
}
