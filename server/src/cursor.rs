//! Opaque, authenticated resume tokens.
//!
//! A cursor binds the map reference it was issued for, the map's kernel id
//! and fingerprint (type, sizes, flags, name) and the walk position. It is
//! sealed with ChaCha20-Poly1305 under a key kept in the state directory, so
//! it survives daemon restarts, and a client can neither read, forge nor
//! alter one. The encoding is URL-safe base64 of a random nonce and the
//! sealed, versioned binary record; the format is private to the server.

use std::{
    fs,
    io::{self, Read, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use ring::{
    aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey},
    rand::{SecureRandom, SystemRandom},
};

use crate::kernel::walk::Position;

const VERSION: u8 = 2;
const KEY_FILE: &str = "cursor.key";
const KEY_LEN: usize = 32;
/// Longest cursor accepted (a cursor holds at most one map key).
pub const MAX_CURSOR_LEN: usize = 4096;

/// What a cursor says, once verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// Digest of the identity the cursor was issued to
    /// ([`identity_digest`]): constant size, whatever the certificate says.
    pub identity: [u8; 16],
    /// Canonical form of the map reference ("path:demo/flows", "id:12").
    pub map_ref: String,
    pub map_id: u32,
    pub fingerprint: [u8; 8],
    /// Never `Position::Start`: a dump starts with an empty cursor.
    pub position: Position,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CursorError {
    #[error("cursor is not valid base64")]
    Encoding,
    #[error("cursor is corrupt or was not issued by this server")]
    NotAuthentic,
    #[error("cursor is malformed")]
    Malformed,
    #[error("cursor is longer than {MAX_CURSOR_LEN} characters")]
    TooLong,
}

/// Seals and opens cursors.
#[derive(Clone)]
pub struct CursorKey {
    key: std::sync::Arc<LessSafeKey>,
    rng: SystemRandom,
}

impl std::fmt::Debug for CursorKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CursorKey(..)")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot create state directory {path}: {error}")]
    Dir { path: PathBuf, error: io::Error },
    #[error("cannot read or create cursor key {path}: {error}")]
    File { path: PathBuf, error: io::Error },
    #[error("cursor key {path} must be {KEY_LEN} bytes, found {len}")]
    Length { path: PathBuf, len: usize },
    #[error(
        "cursor key {path} is accessible by group or others (mode {mode:o}); run chmod 600 on it"
    )]
    Permissions { path: PathBuf, mode: u32 },
    #[error("no system randomness to create a cursor key")]
    Random,
}

impl CursorKey {
    /// A key from raw bytes: the first 32 bytes are used, shorter input is
    /// zero-padded (tests use short keys).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut raw = [0u8; KEY_LEN];
        for (d, s) in raw.iter_mut().zip(bytes) {
            *d = *s;
        }
        let key = UnboundKey::new(&CHACHA20_POLY1305, &raw).expect("32-byte key");
        Self {
            key: std::sync::Arc::new(LessSafeKey::new(key)),
            rng: SystemRandom::new(),
        }
    }

    /// Loads the key from `state_dir`, creating the directory (0700) and a
    /// random key (0600) on first start.
    pub fn load_or_create(state_dir: &Path) -> Result<Self, KeyError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)
            .map_err(|error| KeyError::Dir {
                path: state_dir.into(),
                error,
            })?;
        let path = state_dir.join(KEY_FILE);
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
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                let mut f = fs::File::open(&path).map_err(file_err)?;
                let mode = f.metadata().map_err(file_err)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(KeyError::Permissions { path, mode });
                }
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes).map_err(file_err)?;
                if bytes.len() != KEY_LEN {
                    return Err(KeyError::Length {
                        path,
                        len: bytes.len(),
                    });
                }
                Ok(Self::from_bytes(&bytes))
            }
            Err(e) => Err(file_err(e)),
        }
    }

    pub fn encode(&self, c: &Cursor) -> String {
        let mut buf = Vec::with_capacity(64);
        buf.push(VERSION);
        buf.extend_from_slice(&c.identity);
        put_bytes(&mut buf, c.map_ref.as_bytes());
        buf.extend_from_slice(&c.map_id.to_le_bytes());
        buf.extend_from_slice(&c.fingerprint);
        match &c.position {
            Position::Start => buf.push(0),
            Position::After(token) => {
                buf.push(1);
                put_bytes(&mut buf, token);
            }
            Position::End => buf.push(2),
        }
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).expect("system randomness");
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buf)
            .expect("sealing a short buffer");
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        URL_SAFE_NO_PAD.encode(out)
    }

    pub fn decode(&self, s: &str) -> Result<Cursor, CursorError> {
        if s.len() > MAX_CURSOR_LEN {
            return Err(CursorError::TooLong);
        }
        let raw = URL_SAFE_NO_PAD
            .decode(s)
            .map_err(|_| CursorError::Encoding)?;
        if raw.len() < NONCE_LEN + CHACHA20_POLY1305.tag_len() + 1 {
            return Err(CursorError::Malformed);
        }
        let (nonce, sealed) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| CursorError::Malformed)?;
        let mut sealed = sealed.to_vec();
        // Authenticate before parsing: nothing a client made is interpreted.
        let body = self
            .key
            .open_in_place(nonce, Aad::empty(), &mut sealed)
            .map_err(|_| CursorError::NotAuthentic)?;
        let mut r = Reader(body);
        if r.u8()? != VERSION {
            return Err(CursorError::Malformed);
        }
        let identity = r.take(16)?.try_into().expect("16 bytes");
        let map_ref = String::from_utf8(r.bytes()?.to_vec()).map_err(|_| CursorError::Malformed)?;
        let map_id = u32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
        let fingerprint = r.take(8)?.try_into().expect("8 bytes");
        let position = match r.u8()? {
            1 => Position::After(r.bytes()?.to_vec()),
            2 => Position::End,
            _ => return Err(CursorError::Malformed),
        };
        if !r.0.is_empty() {
            return Err(CursorError::Malformed);
        }
        Ok(Cursor {
            identity,
            map_ref,
            map_id,
            fingerprint,
            position,
        })
    }
}

/// The digest of an identity that a cursor binds.
pub fn identity_digest(identity: &str) -> [u8; 16] {
    let d = ring::digest::digest(&ring::digest::SHA256, identity.as_bytes());
    let mut out = [0; 16];
    out.copy_from_slice(&d.as_ref()[..16]);
    out
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    let len = u16::try_from(b.len()).expect("cursor fields are shorter than 64 KiB");
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(b);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CursorError> {
        if self.0.len() < n {
            return Err(CursorError::Malformed);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, CursorError> {
        Ok(self.take(1)?[0])
    }

    fn bytes(&mut self) -> Result<&'a [u8], CursorError> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
        self.take(len as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Cursor {
        Cursor {
            identity: identity_digest("spiffe://example.org/ops"),
            map_ref: "path:demo/flows".into(),
            map_id: 42,
            fingerprint: [1, 2, 3, 4, 5, 6, 7, 8],
            position: Position::After(vec![9, 0, 0, 0]),
        }
    }

    #[test]
    fn round_trip() {
        let key = CursorKey::from_bytes(b"k");
        for position in [Position::After(vec![1; 16]), Position::End] {
            let c = Cursor {
                position,
                ..sample()
            };
            assert_eq!(key.decode(&key.encode(&c)).unwrap(), c);
        }
    }

    #[test]
    fn cursor_does_not_reveal_its_contents() {
        let key = CursorKey::from_bytes(b"k");
        let raw = URL_SAFE_NO_PAD.decode(key.encode(&sample())).unwrap();
        let needle = b"demo/flows";
        assert!(!raw.windows(needle.len()).any(|w| w == needle));
        // Two cursors for the same position differ (random nonce).
        assert_ne!(key.encode(&sample()), key.encode(&sample()));
    }

    #[test]
    fn every_flipped_bit_is_rejected() {
        let key = CursorKey::from_bytes(b"k");
        let raw = URL_SAFE_NO_PAD.decode(key.encode(&sample())).unwrap();
        for i in 0..raw.len() {
            for bit in 0..8 {
                let mut bad = raw.clone();
                bad[i] ^= 1 << bit;
                let s = URL_SAFE_NO_PAD.encode(&bad);
                assert_eq!(
                    key.decode(&s),
                    Err(CursorError::NotAuthentic),
                    "byte {i} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn another_key_or_garbage_is_rejected() {
        let s = CursorKey::from_bytes(b"a").encode(&sample());
        assert_eq!(
            CursorKey::from_bytes(b"b").decode(&s),
            Err(CursorError::NotAuthentic)
        );
        let key = CursorKey::from_bytes(b"a");
        assert_eq!(key.decode("not base64!"), Err(CursorError::Encoding));
        assert_eq!(key.decode(""), Err(CursorError::Malformed));
        assert_eq!(key.decode("AAAA"), Err(CursorError::Malformed));
        assert_eq!(
            key.decode(&"A".repeat(MAX_CURSOR_LEN + 1)),
            Err(CursorError::TooLong)
        );
        // Truncations of a valid cursor.
        for n in 0..s.len() {
            assert!(key.decode(&s[..n]).is_err(), "prefix of {n} accepted");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        #[test]
        fn arbitrary_strings_are_rejected_without_panicking(s in "\\PC{0,300}") {
            proptest::prop_assert!(CursorKey::from_bytes(b"k").decode(&s).is_err());
        }

        #[test]
        fn arbitrary_bytes_are_rejected_without_panicking(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)
        ) {
            let s = URL_SAFE_NO_PAD.encode(&bytes);
            proptest::prop_assert!(CursorKey::from_bytes(b"k").decode(&s).is_err());
        }

        #[test]
        fn mutated_cursors_are_rejected(
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in 1u8..=255,
            op in 0u8..3,
        ) {
            let key = CursorKey::from_bytes(b"k");
            let mut raw = URL_SAFE_NO_PAD.decode(key.encode(&sample())).unwrap();
            let i = at.index(raw.len());
            match op {
                0 => raw[i] ^= byte,       // change a byte
                1 => { raw.remove(i); }     // drop a byte
                _ => raw.insert(i, byte),   // add a byte
            }
            let s = URL_SAFE_NO_PAD.encode(&raw);
            proptest::prop_assert!(key.decode(&s).is_err());
        }
    }

    #[test]
    fn key_is_created_once_with_owner_only_permissions_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let k1 = CursorKey::load_or_create(&state).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&state), 0o700);
        assert_eq!(mode(&state.join(KEY_FILE)), 0o600);
        let k2 = CursorKey::load_or_create(&state).unwrap();
        let s = k1.encode(&sample());
        assert_eq!(k2.decode(&s).unwrap(), sample(), "same key after restart");

        fs::set_permissions(state.join(KEY_FILE), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            CursorKey::load_or_create(&state),
            Err(KeyError::Permissions { mode: 0o644, .. })
        ));
    }
}
