//! Fleet cursors: everything a fleet dump needs to resume, sealed, so that
//! any relay sharing the key (a replica behind the same Service, the same
//! relay after a restart) resumes a cursor another issued. A cursor holds
//! the call's targets in order, each pending, in progress (with the
//! daemon's own cursor, itself sealed by the daemon) or done; it is bound to
//! the caller and to the dump (its map, filter and fields).

use std::{
    fs,
    io::{self, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
};

use base64::{Engine as _, engine::general_purpose::URL_SAFE_NO_PAD};
use ring::{
    aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey},
    digest,
    rand::{SecureRandom as _, SystemRandom},
};

/// The key file in the state directory.
const KEY_FILE: &str = "fleet-cursor.key";
/// The first character of every fleet cursor (daemon cursors start with 'c').
const PREFIX: char = 'f';
const VERSION: u8 = 1;
/// Longest fleet cursor accepted, in characters.
pub(crate) const MAX_CURSOR_LEN: usize = 4 << 20;

/// Where one target of a fleet dump stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Not started.
    Pending,
    /// Started: the daemon's cursor after the last chunk delivered.
    At(String),
    /// Finished (its end was delivered).
    Done,
}

/// A fleet dump's position: every target of the call, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FleetPosition {
    pub(crate) targets: Vec<(String, Standing)>,
}

/// Why a fleet cursor cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CursorError {
    #[error(
        "the cursor is not a fleet cursor of this relay (altered, truncated, or sealed under another key)"
    )]
    Invalid,
    #[error("the cursor was issued to another identity")]
    OtherIdentity,
    #[error(
        "the cursor was issued for another call (a dump's map, filter or fields; a watch's map, query or interval)"
    )]
    OtherDump,
}

/// The key fleet cursors are sealed with.
#[derive(Debug)]
pub(crate) struct CursorKey(LessSafeKey);

impl CursorKey {
    /// The key in `state_dir`, created (0600) when there is none.
    pub(crate) fn load_or_create(state_dir: &Path) -> anyhow::Result<Self> {
        fs::create_dir_all(state_dir)?;
        let path = state_dir.join(KEY_FILE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => create(&path)?,
            Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        };
        anyhow::ensure!(
            bytes.len() == 32,
            "{} is not a fleet cursor key (32 bytes)",
            path.display()
        );
        let key = UnboundKey::new(&CHACHA20_POLY1305, &bytes)
            .map_err(|_| anyhow::anyhow!("unusable key {}", path.display()))?;
        Ok(Self(LessSafeKey::new(key)))
    }

    /// `position` sealed for `identity` and the dump `dump` (its digest).
    pub(crate) fn seal(&self, identity: &str, dump: &[u8; 16], position: &FleetPosition) -> String {
        let mut buf = vec![VERSION];
        buf.extend_from_slice(&short_digest(identity.as_bytes()));
        buf.extend_from_slice(dump);
        buf.extend_from_slice(&(position.targets.len() as u32).to_le_bytes());
        for (target, standing) in &position.targets {
            put(&mut buf, target.as_bytes());
            match standing {
                Standing::Pending => buf.push(0),
                Standing::At(c) => {
                    buf.push(1);
                    put(&mut buf, c.as_bytes());
                }
                Standing::Done => buf.push(2),
            }
        }
        let mut nonce = [0u8; NONCE_LEN];
        SystemRandom::new()
            .fill(&mut nonce)
            .expect("the system's random source");
        self.0
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buf)
            .expect("sealing a buffer in memory");
        let mut raw = nonce.to_vec();
        raw.extend_from_slice(&buf);
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw))
    }

    /// The position `cursor` holds, checked against the caller and the
    /// dump.
    pub(crate) fn open(
        &self,
        cursor: &str,
        identity: &str,
        dump: &[u8; 16],
    ) -> Result<FleetPosition, CursorError> {
        let raw = cursor
            .strip_prefix(PREFIX)
            .filter(|_| cursor.len() <= MAX_CURSOR_LEN)
            .and_then(|c| URL_SAFE_NO_PAD.decode(c).ok())
            .filter(|r| r.len() > NONCE_LEN)
            .ok_or(CursorError::Invalid)?;
        let (nonce, sealed) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| CursorError::Invalid)?;
        let mut sealed = sealed.to_vec();
        let body = self
            .0
            .open_in_place(nonce, Aad::empty(), &mut sealed)
            .map_err(|_| CursorError::Invalid)?;
        let mut r = Reader(body);
        if r.take(1)? != [VERSION] {
            return Err(CursorError::Invalid);
        }
        if r.take(16)? != short_digest(identity.as_bytes()) {
            return Err(CursorError::OtherIdentity);
        }
        if r.take(16)? != dump {
            return Err(CursorError::OtherDump);
        }
        let n = u32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
        let mut targets = Vec::new();
        for _ in 0..n {
            let target = r.string()?;
            let standing = match r.take(1)?[0] {
                0 => Standing::Pending,
                1 => Standing::At(r.string()?),
                2 => Standing::Done,
                _ => return Err(CursorError::Invalid),
            };
            targets.push((target, standing));
        }
        Ok(FleetPosition { targets })
    }
}

/// A new random key written to `path` (0600, never over another).
fn create(path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut key = vec![0u8; 32];
    SystemRandom::new()
        .fill(&mut key)
        .map_err(|_| anyhow::anyhow!("no random source"))?;
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            f.write_all(&key)?;
            f.sync_all()?;
            Ok(key)
        }
        // Another replica made it first.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(fs::read(path)?),
        Err(e) => Err(anyhow::anyhow!("cannot create {}: {e}", path.display())),
    }
}

/// The first 16 bytes of the SHA-256 of `bytes`.
pub(crate) fn short_digest(bytes: &[u8]) -> [u8; 16] {
    let d = digest::digest(&digest::SHA256, bytes);
    d.as_ref()[..16].try_into().expect("16 bytes")
}

fn put(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CursorError> {
        if self.0.len() < n {
            return Err(CursorError::Invalid);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn string(&mut self) -> Result<String, CursorError> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| CursorError::Invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_are_bound_to_caller_and_dump() {
        let dir = tempfile::tempdir().unwrap();
        let key = CursorKey::load_or_create(dir.path()).unwrap();
        let position = FleetPosition {
            targets: vec![
                ("a:1".into(), Standing::Done),
                ("b:1".into(), Standing::At("c123".into())),
                ("c:1".into(), Standing::Pending),
            ],
        };
        let dump = short_digest(b"demo/flows");
        let sealed = key.seal("cn:ops", &dump, &position);
        assert!(sealed.starts_with('f'));
        // Another replica, the same key file.
        let again = CursorKey::load_or_create(dir.path()).unwrap();
        assert_eq!(again.open(&sealed, "cn:ops", &dump).unwrap(), position);
        assert!(matches!(
            again.open(&sealed, "cn:other", &dump),
            Err(CursorError::OtherIdentity)
        ));
        assert!(matches!(
            again.open(&sealed, "cn:ops", &short_digest(b"x")),
            Err(CursorError::OtherDump)
        ));
        let mut altered = sealed.clone();
        altered.pop();
        assert!(matches!(
            again.open(&altered, "cn:ops", &dump),
            Err(CursorError::Invalid)
        ));
        let other = CursorKey::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        assert!(matches!(
            other.open(&sealed, "cn:ops", &dump),
            Err(CursorError::Invalid)
        ));
    }
}
