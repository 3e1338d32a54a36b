//! Fleet cursors: everything a fleet dump or watch needs to resume, sealed
//! with the daemon's cursor keys (`bpfmapd::SealingKeys`: ChaCha20-Poly1305,
//! the key file checked for its permissions, rotated with the previous key
//! still opening), so that any relay sharing the key (a replica behind the
//! same Service, the same relay after a restart) resumes a cursor another
//! issued. A cursor holds the call's targets in order, each pending, in
//! progress (with the daemon's own cursor, itself sealed by the daemon) or
//! done; it is bound ([`Binding`]) to the caller and to the call (a dump's
//! map, filter and fields; a watch's map, query and interval).

use std::{
    path::Path,
    sync::{Arc, RwLock},
    time::Duration,
};

use bpfmap_client::pb;
use bpfmapd::{KeyError, KeyFiles, SealingKeys, binding_digest, frontend::Identity};
use tokio::sync::watch;

/// The key file in the state directory (and `fleet-cursor.key.previous`
/// after a rotation).
const KEY_FILE: &str = "fleet-cursor.key";
/// The first character of every fleet cursor (daemon cursors start with 'c').
const PREFIX: char = 'f';
const VERSION: u8 = 1;
/// Longest fleet cursor accepted, in characters.
const MAX_CURSOR_LEN: usize = 4 << 20;

/// Where one target of a fleet call stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Not started.
    Pending,
    /// Started: the daemon's cursor after the last answer delivered.
    At(String),
    /// Finished (its end was delivered).
    Done,
}

/// Where one target stands, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TargetPosition {
    pub(crate) target: String,
    pub(crate) standing: Standing,
}

/// A fleet call's position: every target of the call, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FleetPosition {
    pub(crate) targets: Vec<TargetPosition>,
}

impl FleetPosition {
    /// Where `target` stands, if the position has it.
    pub(crate) fn standing(&self, target: &str) -> Option<&Standing> {
        self.targets
            .iter()
            .find(|t| t.target == target)
            .map(|t| &t.standing)
    }

    /// Records where `target` stands now.
    pub(crate) fn set(&mut self, target: &str, standing: Standing) {
        if let Some(t) = self.targets.iter_mut().find(|t| t.target == target) {
            t.standing = standing;
        }
    }
}

/// Why a fleet cursor cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CursorError {
    /// Altered, truncated, too long, or sealed under a key the relay does
    /// not hold.
    #[error(
        "the cursor is not a fleet cursor of this relay (altered, truncated, or sealed under another key)"
    )]
    Invalid,
    /// Issued to another caller.
    #[error("the cursor was issued to another identity")]
    OtherIdentity,
    /// Issued for another call.
    #[error(
        "the cursor was issued for another call (a dump's map, filter or fields; a watch's map, query or interval)"
    )]
    OtherCall,
    /// Authentic, but naming a target that is not one.
    #[error("a target that is not one")]
    NotATarget,
}

/// What a fleet cursor is bound to: digests of the caller and of the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Binding {
    identity: [u8; 16],
    call: [u8; 16],
}

impl Binding {
    /// A fleet dump's: its caller, and the dump's map, filter and fields.
    pub(crate) fn dump(identity: &Identity, req: &pb::DumpMapRequest) -> Self {
        let bound = pb::DumpMapRequest {
            map: req.map.clone(),
            filter: req.filter.clone(),
            fields: req.fields.clone(),
            ..Default::default()
        };
        Self {
            identity: identity_digest(identity),
            call: binding_digest(&prost::Message::encode_to_vec(&bound)),
        }
    }

    /// A fleet watch's: its caller, and the watch's map, query, interval
    /// and how it reads entries (a dump's cursor is never a watch's).
    pub(crate) fn watch(identity: &Identity, req: &pb::WatchMapRequest) -> Self {
        let bound = pb::WatchMapRequest {
            map: req.map.clone(),
            interval: req.interval,
            filter: req.filter.clone(),
            fields: req.fields.clone(),
            group_by: req.group_by.clone(),
            aggregates: req.aggregates.clone(),
            per_cpu: req.per_cpu,
            raw: req.raw,
            render: req.render.clone(),
            cursor: String::new(),
        };
        let mut bytes = b"watch".to_vec();
        bytes.extend(prost::Message::encode_to_vec(&bound));
        Self {
            identity: identity_digest(identity),
            call: binding_digest(&bytes),
        }
    }
}

/// The digest of an identity a cursor binds (the daemon's cursors bind the
/// same).
fn identity_digest(identity: &Identity) -> [u8; 16] {
    binding_digest(identity.to_string().as_bytes())
}

/// The keys fleet cursors are sealed with, read again every refresh so
/// that a rotation ([`CursorKeys::rotate`]) is picked up without a restart.
#[derive(Debug)]
pub(crate) struct CursorKeys {
    files: KeyFiles,
    keys: RwLock<SealingKeys>,
}

impl CursorKeys {
    /// The keys in `state_dir` (`fleet-cursor.key`, and the previous one
    /// after a rotation), the key made (0600) when there is none.
    pub(crate) fn load_or_create(state_dir: &Path) -> Result<Self, KeyError> {
        let files = KeyFiles::new(state_dir, KEY_FILE);
        let keys = SealingKeys::load_or_create(&files)?;
        Ok(Self {
            files,
            keys: RwLock::new(keys),
        })
    }

    /// Rotates the key in `state_dir`: the current key becomes the previous
    /// one (its cursors resume until the next rotation), a new key seals.
    pub(crate) fn rotate(state_dir: &Path) -> Result<(), KeyError> {
        SealingKeys::rotate(&KeyFiles::new(state_dir, KEY_FILE))
    }

    /// Reads the key files again every `every`, until `stop`; files that
    /// cannot be read leave the keys as they were.
    pub(crate) fn spawn_reload(self: &Arc<Self>, every: Duration, mut stop: watch::Receiver<bool>) {
        let keys = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                match SealingKeys::load_or_create(&keys.files) {
                    Ok(k) => *keys.keys.write().unwrap_or_else(|e| e.into_inner()) = k,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read the cursor key again; keeping it");
                    }
                }
            }
        });
    }

    fn current(&self) -> SealingKeys {
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `position` sealed for the caller and the call of `binding`.
    pub(crate) fn seal(&self, binding: &Binding, position: &FleetPosition) -> String {
        let mut buf = vec![VERSION];
        buf.extend_from_slice(&binding.identity);
        buf.extend_from_slice(&binding.call);
        buf.extend_from_slice(&(position.targets.len() as u32).to_le_bytes());
        for t in &position.targets {
            put(&mut buf, t.target.as_bytes());
            match &t.standing {
                Standing::Pending => buf.push(0),
                Standing::At(c) => {
                    buf.push(1);
                    put(&mut buf, c.as_bytes());
                }
                Standing::Done => buf.push(2),
            }
        }
        self.current().seal(PREFIX, buf)
    }

    /// The position `cursor` holds, checked against the caller and the
    /// call of `binding`.
    pub(crate) fn open(
        &self,
        cursor: &str,
        binding: &Binding,
    ) -> Result<FleetPosition, CursorError> {
        let text = cursor
            .strip_prefix(PREFIX)
            .filter(|_| cursor.len() <= MAX_CURSOR_LEN)
            .ok_or(CursorError::Invalid)?;
        let body = self
            .current()
            .open(text)
            .map_err(|_| CursorError::Invalid)?;
        let mut r = Reader(&body);
        if r.take(1)? != [VERSION] {
            return Err(CursorError::Invalid);
        }
        if r.take(16)? != binding.identity {
            return Err(CursorError::OtherIdentity);
        }
        if r.take(16)? != binding.call {
            return Err(CursorError::OtherCall);
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
            targets.push(TargetPosition { target, standing });
        }
        Ok(FleetPosition { targets })
    }
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
    use std::{fs, os::unix::fs::PermissionsExt as _};

    use super::*;

    fn position() -> FleetPosition {
        let at = |target: &str, standing| TargetPosition {
            target: target.into(),
            standing,
        };
        FleetPosition {
            targets: vec![
                at("a:1", Standing::Done),
                at("b:1", Standing::At("c123".into())),
                at("c:1", Standing::Pending),
            ],
        }
    }

    fn dump(path: &str) -> pb::DumpMapRequest {
        pb::DumpMapRequest {
            map: Some(pb::MapRef {
                r#ref: Some(pb::map_ref::Ref::Path(path.into())),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn cursors_round_trip_and_are_bound_to_caller_and_call() {
        let dir = tempfile::tempdir().unwrap();
        let key = CursorKeys::load_or_create(dir.path()).unwrap();
        let ops = Identity::Cn("ops".into());
        let flows = Binding::dump(&ops, &dump("demo/flows"));
        let sealed = key.seal(&flows, &position());
        assert!(sealed.starts_with('f'));
        // Another replica, the same key file.
        let again = CursorKeys::load_or_create(dir.path()).unwrap();
        assert_eq!(again.open(&sealed, &flows).unwrap(), position());
        let other = Binding::dump(&Identity::Cn("other".into()), &dump("demo/flows"));
        assert_eq!(again.open(&sealed, &other), Err(CursorError::OtherIdentity));
        let elsewhere = Binding::dump(&ops, &dump("demo/other"));
        assert_eq!(again.open(&sealed, &elsewhere), Err(CursorError::OtherCall));
        let watch = Binding::watch(
            &ops,
            &pb::WatchMapRequest {
                map: dump("demo/flows").map,
                ..Default::default()
            },
        );
        assert_eq!(again.open(&sealed, &watch), Err(CursorError::OtherCall));
        let mut altered = sealed.clone();
        altered.pop();
        assert_eq!(again.open(&altered, &flows), Err(CursorError::Invalid));
        let stranger = CursorKeys::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        assert_eq!(stranger.open(&sealed, &flows), Err(CursorError::Invalid));
    }

    /// What the relay sealed before it shared the daemon's keys: a nonce
    /// and the record sealed with the key file's bytes, in base64 after
    /// 'f'.
    fn sealed_the_old_way(key: &[u8], record: &[u8]) -> String {
        use base64::{Engine as _, engine::general_purpose::URL_SAFE_NO_PAD};
        use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
        let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).unwrap());
        let nonce = [7u8; NONCE_LEN];
        let mut buf = record.to_vec();
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut buf)
            .unwrap();
        let mut raw = nonce.to_vec();
        raw.extend_from_slice(&buf);
        format!("f{}", URL_SAFE_NO_PAD.encode(raw))
    }

    #[test]
    fn a_relay_upgraded_in_place_opens_the_cursors_it_issued_and_rotates_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fleet-cursor.key");
        // The key file the relay made before (0600 in its state directory).
        let bytes = [42u8; 32];
        fs::write(&file, bytes).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o600)).unwrap();
        let key = CursorKeys::load_or_create(dir.path()).unwrap();
        let flows = Binding::dump(&Identity::Cn("ops".into()), &dump("demo/flows"));
        // The old relay's record: the same as the one sealed now.
        let fresh = CursorKeys {
            files: KeyFiles::new(dir.path(), KEY_FILE),
            keys: RwLock::new(SealingKeys::from_bytes(&bytes)),
        };
        let record = fresh
            .current()
            .open(&fresh.seal(&flows, &position())[1..])
            .unwrap();
        let old = sealed_the_old_way(&bytes, &record);
        assert_eq!(key.open(&old, &flows).unwrap(), position());
        // Rotated: the old cursor still resumes, new ones use the new key.
        CursorKeys::rotate(dir.path()).unwrap();
        let rotated = CursorKeys::load_or_create(dir.path()).unwrap();
        assert_eq!(rotated.open(&old, &flows).unwrap(), position());
        let new = rotated.seal(&flows, &position());
        assert_eq!(key.open(&new, &flows), Err(CursorError::Invalid));
        // A key file others may read is refused, as the daemon's is.
        fs::set_permissions(&file, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            CursorKeys::load_or_create(dir.path()),
            Err(KeyError::Permissions { .. })
        ));
    }
}
