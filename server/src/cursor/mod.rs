//! Opaque, authenticated resume tokens.
//!
//! A cursor binds the map reference it was issued for, the map's kernel id
//! and fingerprint (type, sizes, flags, name), the query of a filtered or
//! projected dump (a digest of its filter and fields) and the walk
//! position. It is sealed ([`keys`]: ChaCha20-Poly1305, the key in the
//! state directory, rotated with the previous key still opening) so it
//! survives daemon restarts, and a client can neither read, forge nor alter
//! one. The encoding is the letter "c" then URL-safe base64 of a random
//! nonce and the sealed, versioned binary record; the format is private to
//! the server. [`keys`] is what bpfmap-relay seals its fleet cursors with.

pub(crate) mod keys;

/// The cursor keys in force (a reload or a rotation replaces them).
pub(crate) type SharedKeys = std::sync::Arc<arc_swap::ArcSwap<CursorKey>>;

use std::path::{Path, PathBuf};

use bpfmap_kernel::{MapMeta, walk::Position};

pub(crate) use self::keys::KeyError;
use self::keys::{KeyFiles, SealingKeys, Unsealed, binding_digest};
use crate::model::{Identity, MapRef};

/// The record format written now. Version 2 (the map reference as a
/// "path:..." / "id:N" string) is still read, so cursors issued before an
/// upgrade keep working.
const VERSION: u8 = 3;
const VERSION_2: u8 = 2;
const KEY_FILE: &str = "cursor.key";
/// Longest cursor accepted (a cursor holds at most one map key).
pub(super) const MAX_CURSOR_LEN: usize = 4096;
/// The first character of every cursor: a letter, so that a cursor never
/// starts with "-" (which command lines take for an option). Cursors issued
/// without it are still read.
const PREFIX: char = 'c';

/// What a cursor is bound to: who it was issued to, for which map
/// reference, and which kernel map that reference named then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Binding {
    /// Digest of the identity: constant size, whatever the certificate says.
    identity: [u8; 16],
    map: MapRef,
    map_id: u32,
    fingerprint: [u8; 8],
    /// The digest of the dump's filter and fields, if it has any.
    query: Option<[u8; 16]>,
}

impl Binding {
    /// The binding of cursors issued to `identity` for a dump of `map`, whose
    /// map is described by `meta`.
    pub(crate) fn new(identity: &Identity, map: &MapRef, meta: &MapMeta) -> Self {
        Self {
            identity: identity_digest(identity),
            map: map.clone(),
            map_id: meta.id,
            fingerprint: meta.fingerprint(),
            query: None,
        }
    }
}

/// Seals the cursors of one dump: a key and the dump's binding.
#[derive(Debug, Clone)]
pub(crate) struct Sealer {
    key: CursorKey,
    binding: Binding,
}

impl Sealer {
    /// Cursors issued to `identity` for a dump of `map` (described by `meta`).
    pub(crate) fn new(key: CursorKey, identity: &Identity, map: &MapRef, meta: &MapMeta) -> Self {
        Self {
            key,
            binding: Binding::new(identity, map, meta),
        }
    }

    /// The same, for a dump with this query digest (filter and fields).
    pub(crate) fn with_query(mut self, query: Option<[u8; 16]>) -> Self {
        self.binding.query = query;
        self
    }

    /// The cursor that resumes at `position`.
    pub(crate) fn seal(&self, position: &Position) -> String {
        self.key.seal(&self.binding, position)
    }
}

/// A cursor that is authentic and was issued to this caller for this map
/// reference; [`Opened::resume`] checks it against the map as it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Opened {
    map: MapRef,
    map_id: u32,
    fingerprint: [u8; 8],
    query: Option<[u8; 16]>,
    position: Position,
}

impl Opened {
    /// INVALID_ARGUMENT unless the cursor was issued for a dump with the
    /// same filter and fields (`query`: their digest).
    pub(crate) fn check_query(&self, query: Option<[u8; 16]>) -> Result<(), CursorError> {
        if self.query == query {
            Ok(())
        } else {
            Err(CursorError::OtherQuery)
        }
    }

    /// The position, whichever kernel map the reference names now (for a
    /// drain's acknowledgement: its spool may hold an earlier map's chunks).
    pub(crate) fn into_position(self) -> Position {
        self.position
    }

    /// The position to resume from, unless the map behind the reference was
    /// replaced since the cursor was issued.
    pub(crate) fn resume(self, meta: &MapMeta) -> Result<Position, CursorError> {
        if self.map_id != meta.id {
            return Err(CursorError::MapReplaced {
                map: self.map,
                detail: format!("kernel id was {}, now {}", self.map_id, meta.id),
            });
        }
        if self.fingerprint != meta.fingerprint() {
            return Err(CursorError::MapReplaced {
                map: self.map,
                detail: "its type, sizes, flags or name changed".into(),
            });
        }
        Ok(self.position)
    }
}

/// Why a cursor cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum CursorError {
    /// Not URL-safe base64.
    #[error("cursor is not valid base64")]
    Encoding,
    /// Altered, or sealed under another key.
    #[error("cursor is corrupt or was not issued by this server")]
    NotAuthentic,
    /// Authentic but unreadable (a format this server does not know).
    #[error("cursor is malformed")]
    Malformed,
    /// Longer than any cursor this server issues.
    #[error("cursor is longer than {MAX_CURSOR_LEN} characters")]
    TooLong,
    /// Issued to another identity.
    #[error("cursor was issued to another identity, not to {0}")]
    OtherIdentity(Identity),
    /// Issued for another map reference.
    #[error("cursor was issued for map {issued_for}, not for {requested}")]
    OtherMap {
        /// The reference the cursor was issued for.
        issued_for: MapRef,
        /// The reference in the request.
        requested: MapRef,
    },
    /// Issued for a dump with another filter or other fields.
    #[error(
        "cursor was issued for a dump with another filter or other fields: resume with the ones it was issued with, or start over without a cursor"
    )]
    OtherQuery,
    /// The map behind the reference is not the one the cursor was issued for.
    #[error(
        "map {map} was replaced since the cursor was issued ({detail}); restart the dump without a cursor"
    )]
    MapReplaced {
        /// The reference.
        map: MapRef,
        /// What changed.
        detail: String,
    },
}

/// Seals and opens cursors.
#[derive(Debug, Clone)]
pub(crate) struct CursorKey {
    keys: SealingKeys,
}

impl CursorKey {
    /// The files that hold the keys in `state_dir` (the current and the
    /// previous key).
    pub(crate) fn files(state_dir: &Path) -> [PathBuf; 2] {
        KeyFiles::new(state_dir, KEY_FILE).paths()
    }

    /// A key from raw bytes: the first 32 bytes are used, shorter input is
    /// zero-padded (tests use short keys).
    #[cfg(test)]
    pub(crate) fn from_bytes(bytes: &[u8]) -> Self {
        Self {
            keys: SealingKeys::from_bytes(bytes),
        }
    }

    /// Loads the key from `state_dir` (and the previous one, if a rotation
    /// left it), creating the directory (0700) and a random key (0600) on
    /// first start.
    pub(crate) fn load_or_create(state_dir: &Path) -> Result<Self, KeyError> {
        Ok(Self {
            keys: SealingKeys::load_or_create(&KeyFiles::new(state_dir, KEY_FILE))?,
        })
    }

    /// Rotates the cursor key in `state_dir`: the current key becomes the
    /// previous one (its cursors stay valid until the next rotation) and a
    /// new random key becomes current. A running daemon picks the new key
    /// up when it reloads (on SIGHUP, or by itself when it watches files).
    pub(crate) fn rotate(state_dir: &Path) -> Result<(), KeyError> {
        SealingKeys::rotate(&KeyFiles::new(state_dir, KEY_FILE))
    }

    /// Seals a position of a dump bound to `binding` into a cursor.
    pub(crate) fn seal(&self, binding: &Binding, position: &Position) -> String {
        let mut buf = Vec::with_capacity(64);
        buf.push(VERSION);
        buf.extend_from_slice(&binding.identity);
        put_ref(&mut buf, &binding.map);
        buf.extend_from_slice(&binding.map_id.to_le_bytes());
        buf.extend_from_slice(&binding.fingerprint);
        match position {
            Position::Start => buf.push(0),
            Position::After(token) => {
                buf.push(1);
                put_bytes(&mut buf, token);
            }
            Position::End => buf.push(2),
        }
        if let Some(q) = &binding.query {
            buf.extend_from_slice(q);
        }
        self.keys.seal(PREFIX, buf)
    }

    /// Opens a cursor presented by `identity` with a request for `map`: it
    /// must be authentic, issued to that identity, for that reference.
    pub(crate) fn open(
        &self,
        token: &str,
        identity: &Identity,
        map: &MapRef,
    ) -> Result<Opened, CursorError> {
        let (digest, version, opened) = self.unseal(token)?;
        // Version 2 bound the identity's name without its kind ("alice",
        // not "cn:alice").
        let expected = match version {
            VERSION_2 => legacy_identity_digest(identity),
            _ => identity_digest(identity),
        };
        if digest != expected {
            return Err(CursorError::OtherIdentity(identity.clone()));
        }
        if opened.map != *map {
            return Err(CursorError::OtherMap {
                issued_for: opened.map,
                requested: map.clone(),
            });
        }
        Ok(opened)
    }

    fn unseal(&self, s: &str) -> Result<([u8; 16], u8, Opened), CursorError> {
        if s.len() > MAX_CURSOR_LEN {
            return Err(CursorError::TooLong);
        }
        match s.strip_prefix(PREFIX) {
            Some(rest) => self.unseal_raw(rest).or_else(|e| {
                // An unprefixed cursor from before the prefix that happens
                // to start with the prefix letter.
                self.unseal_raw(s).map_err(|_| e)
            }),
            None => self.unseal_raw(s),
        }
    }

    fn unseal_raw(&self, s: &str) -> Result<([u8; 16], u8, Opened), CursorError> {
        // Authenticated before it is parsed: nothing a client made is
        // interpreted.
        let body = self.keys.open(s).map_err(|e| match e {
            Unsealed::Encoding => CursorError::Encoding,
            Unsealed::NotAuthentic => CursorError::NotAuthentic,
            _ => CursorError::Malformed,
        })?;
        let mut r = Reader(&body);
        let version = r.u8()?;
        let identity = r.take(16)?.try_into().expect("16 bytes");
        let map = match version {
            VERSION => r.map_ref(true)?,
            VERSION_2 => {
                let s = r.string()?;
                if let Some(p) = s.strip_prefix("path:") {
                    MapRef::Path(p.to_owned())
                } else if let Some(id) = s.strip_prefix("id:") {
                    MapRef::Id(id.parse().map_err(|_| CursorError::Malformed)?)
                } else {
                    return Err(CursorError::Malformed);
                }
            }
            _ => return Err(CursorError::Malformed),
        };
        let map_id = r.u32()?;
        let fingerprint = r.take(8)?.try_into().expect("8 bytes");
        let position = match r.u8()? {
            0 => Position::Start,
            1 => Position::After(r.bytes()?.to_vec()),
            2 => Position::End,
            _ => return Err(CursorError::Malformed),
        };
        // A filtered or projected dump's query, after the position.
        let query = match r.0.len() {
            0 => None,
            16 => Some(r.take(16)?.try_into().expect("16 bytes")),
            _ => return Err(CursorError::Malformed),
        };
        Ok((
            identity,
            version,
            Opened {
                map,
                map_id,
                fingerprint,
                query,
                position,
            },
        ))
    }
}

/// The digest of an identity that a cursor binds.
fn identity_digest(identity: &Identity) -> [u8; 16] {
    binding_digest(identity.to_string().as_bytes())
}

/// The digest version-2 cursors bound: the name alone.
fn legacy_identity_digest(identity: &Identity) -> [u8; 16] {
    match identity {
        Identity::Anonymous => binding_digest(b"anonymous"),
        Identity::Spiffe(n) | Identity::Dns(n) | Identity::Cn(n) => binding_digest(n.as_bytes()),
        // Newer than version 2: never bound by such a cursor.
        Identity::Uid(_) | Identity::Daemon => identity_digest(identity),
    }
}

/// A map reference: a tag (0 path, 1 id, 2 inner map), then its fields (an
/// inner map's outer reference, then its key).
fn put_ref(buf: &mut Vec<u8>, map: &MapRef) {
    match map {
        MapRef::Path(p) => {
            buf.push(0);
            put_bytes(buf, p.as_bytes());
        }
        MapRef::Id(id) => {
            buf.push(1);
            buf.extend_from_slice(&id.to_le_bytes());
        }
        MapRef::Inner { outer, key } => {
            buf.push(2);
            put_ref(buf, outer);
            put_bytes(buf, key);
        }
    }
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

    fn u32(&mut self) -> Result<u32, CursorError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn bytes(&mut self) -> Result<&'a [u8], CursorError> {
        let len = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
        self.take(len as usize)
    }

    fn string(&mut self) -> Result<String, CursorError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| CursorError::Malformed)
    }

    /// A map reference as [`put_ref`] wrote it (an inner map only where
    /// `inner` allows: maps of maps do not nest).
    fn map_ref(&mut self, inner: bool) -> Result<MapRef, CursorError> {
        Ok(match self.u8()? {
            0 => MapRef::Path(self.string()?),
            1 => MapRef::Id(self.u32()?),
            2 if inner => MapRef::Inner {
                outer: Box::new(self.map_ref(false)?),
                key: self.bytes()?.to_vec(),
            },
            _ => return Err(CursorError::Malformed),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::PermissionsExt as _};

    use base64::{Engine as _, engine::general_purpose::URL_SAFE_NO_PAD};
    use bpfmap_kernel::MapType;

    use super::*;

    fn alice() -> Identity {
        Identity::Spiffe("spiffe://example.org/ops".into())
    }

    fn flows() -> MapRef {
        MapRef::Path("demo/flows".into())
    }

    fn meta() -> MapMeta {
        MapMeta {
            id: 42,
            name: "flows".into(),
            map_type: MapType::HASH,
            key_size: 16,
            value_size: 16,
            max_entries: 1024,
            flags: 0,
            btf_id: 0,
            btf_key_type_id: 0,
            btf_value_type_id: 0,
            possible_cpus: 2,
        }
    }

    fn binding() -> Binding {
        Binding::new(&alice(), &flows(), &meta())
    }

    fn sample(key: &CursorKey) -> String {
        key.seal(&binding(), &Position::After(vec![9, 0, 0, 0]))
    }

    fn open(key: &CursorKey, s: &str) -> Result<Position, CursorError> {
        key.open(s, &alice(), &flows())?.resume(&meta())
    }

    /// The sealed bytes of a cursor.
    fn raw(s: &str) -> Vec<u8> {
        URL_SAFE_NO_PAD
            .decode(s.strip_prefix(PREFIX).unwrap())
            .unwrap()
    }

    /// A cursor made of sealed bytes.
    fn token(raw: &[u8]) -> String {
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw))
    }

    #[test]
    fn no_cursor_starts_with_a_dash_and_unprefixed_cursors_are_read() {
        let key = CursorKey::from_bytes(b"k");
        for _ in 0..500 {
            let s = sample(&key);
            assert!(s.starts_with(PREFIX), "{s}");
            // The same sealed bytes without the prefix (as issued before).
            let bare = URL_SAFE_NO_PAD.encode(raw(&s));
            assert_eq!(
                open(&key, &bare).unwrap(),
                Position::After(vec![9, 0, 0, 0])
            );
        }
    }

    #[test]
    fn round_trip() {
        let key = CursorKey::from_bytes(b"k");
        for position in [Position::After(vec![1; 16]), Position::End] {
            let s = key.seal(&binding(), &position);
            assert_eq!(open(&key, &s).unwrap(), position);
        }
        let by_id = Binding::new(&alice(), &MapRef::Id(42), &meta());
        let s = key.seal(&by_id, &Position::End);
        let opened = key.open(&s, &alice(), &MapRef::Id(42)).unwrap();
        assert_eq!(opened.resume(&meta()).unwrap(), Position::End);
    }

    #[test]
    fn a_cursor_is_checked_against_its_caller_its_map_and_the_map_now() {
        let key = CursorKey::from_bytes(b"k");
        let s = sample(&key);
        let bob = Identity::Cn("bob".into());
        assert_eq!(
            key.open(&s, &bob, &flows()),
            Err(CursorError::OtherIdentity(bob))
        );
        let other = MapRef::Path("demo/other".into());
        assert_eq!(
            key.open(&s, &alice(), &other),
            Err(CursorError::OtherMap {
                issued_for: flows(),
                requested: other
            })
        );
        assert_eq!(
            key.open(&s, &alice(), &MapRef::Id(42)).unwrap_err(),
            CursorError::OtherMap {
                issued_for: flows(),
                requested: MapRef::Id(42)
            },
            "a path and an id are different references"
        );
        let opened = key.open(&s, &alice(), &flows()).unwrap();
        let recreated = MapMeta { id: 43, ..meta() };
        assert!(matches!(
            opened.clone().resume(&recreated),
            Err(CursorError::MapReplaced { detail, .. }) if detail == "kernel id was 42, now 43"
        ));
        let reshaped = MapMeta {
            value_size: 8,
            ..meta()
        };
        assert!(matches!(
            opened.resume(&reshaped),
            Err(CursorError::MapReplaced { .. })
        ));
    }

    #[test]
    fn version_2_cursors_are_still_read() {
        let key = CursorKey::from_bytes(b"k");
        let mut body = vec![VERSION_2];
        body.extend_from_slice(&legacy_identity_digest(&alice()));
        put_bytes(&mut body, b"path:demo/flows");
        body.extend_from_slice(&42u32.to_le_bytes());
        body.extend_from_slice(&meta().fingerprint());
        body.push(1);
        put_bytes(&mut body, &[7, 0, 0, 0]);
        // Issued without the prefix, as version 2 cursors were.
        let s = URL_SAFE_NO_PAD.encode(raw(&key.keys.seal(PREFIX, body)));
        assert_eq!(open(&key, &s).unwrap(), Position::After(vec![7, 0, 0, 0]));
        assert_eq!(
            open(&key, &token(&URL_SAFE_NO_PAD.decode(&s).unwrap())).unwrap(),
            Position::After(vec![7, 0, 0, 0])
        );
    }

    #[test]
    fn cursor_does_not_reveal_its_contents() {
        let key = CursorKey::from_bytes(b"k");
        let raw = raw(&sample(&key));
        let needle = b"demo/flows";
        assert!(!raw.windows(needle.len()).any(|w| w == needle));
        // Two cursors for the same position differ (random nonce).
        assert_ne!(sample(&key), sample(&key));
    }

    #[test]
    fn every_flipped_bit_is_rejected() {
        let key = CursorKey::from_bytes(b"k");
        let raw = raw(&sample(&key));
        for i in 0..raw.len() {
            for bit in 0..8 {
                let mut bad = raw.clone();
                bad[i] ^= 1 << bit;
                let s = token(&bad);
                assert_eq!(
                    open(&key, &s),
                    Err(CursorError::NotAuthentic),
                    "byte {i} bit {bit}"
                );
            }
        }
    }

    #[test]
    fn another_key_or_garbage_is_rejected() {
        let s = sample(&CursorKey::from_bytes(b"a"));
        assert_eq!(
            open(&CursorKey::from_bytes(b"b"), &s),
            Err(CursorError::NotAuthentic)
        );
        let key = CursorKey::from_bytes(b"a");
        assert_eq!(open(&key, "not base64!"), Err(CursorError::Encoding));
        assert_eq!(open(&key, ""), Err(CursorError::Malformed));
        assert_eq!(open(&key, "AAAA"), Err(CursorError::Malformed));
        assert_eq!(
            open(&key, &"A".repeat(MAX_CURSOR_LEN + 1)),
            Err(CursorError::TooLong)
        );
        // Truncations of a valid cursor.
        for n in 0..s.len() {
            assert!(open(&key, &s[..n]).is_err(), "prefix of {n} accepted");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]

        #[test]
        fn arbitrary_strings_are_rejected_without_panicking(s in "\\PC{0,300}") {
            proptest::prop_assert!(open(&CursorKey::from_bytes(b"k"), &s).is_err());
        }

        #[test]
        fn arbitrary_bytes_are_rejected_without_panicking(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)
        ) {
            let s = URL_SAFE_NO_PAD.encode(&bytes);
            proptest::prop_assert!(open(&CursorKey::from_bytes(b"k"), &s).is_err());
        }

        #[test]
        fn mutated_cursors_are_rejected(
            at in proptest::prelude::any::<proptest::sample::Index>(),
            byte in 1u8..=255,
            op in 0u8..3,
        ) {
            let key = CursorKey::from_bytes(b"k");
            let mut raw = raw(&sample(&key));
            let i = at.index(raw.len());
            match op {
                0 => raw[i] ^= byte,       // change a byte
                1 => { raw.remove(i); }     // drop a byte
                _ => raw.insert(i, byte),   // add a byte
            }
            let s = token(&raw);
            proptest::prop_assert!(open(&key, &s).is_err());
        }
    }

    #[test]
    fn a_rotated_key_still_opens_the_previous_key_s_cursors_until_the_next_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let k1 = CursorKey::load_or_create(dir.path()).unwrap();
        let old = sample(&k1);
        CursorKey::rotate(dir.path()).unwrap();
        let k2 = CursorKey::load_or_create(dir.path()).unwrap();
        assert_eq!(open(&k2, &old).unwrap(), Position::After(vec![9, 0, 0, 0]));
        let new = sample(&k2);
        assert_eq!(
            open(&k1, &new),
            Err(CursorError::NotAuthentic),
            "sealed with the new key"
        );
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir.path().join(KEY_FILE)), 0o600);
        assert_eq!(
            mode(&dir.path().join(format!("{KEY_FILE}.previous"))),
            0o600
        );
        CursorKey::rotate(dir.path()).unwrap();
        let k3 = CursorKey::load_or_create(dir.path()).unwrap();
        assert_eq!(
            open(&k3, &old),
            Err(CursorError::NotAuthentic),
            "two rotations ago"
        );
        assert!(open(&k3, &new).is_ok(), "one rotation ago");
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
        let s = sample(&k1);
        assert_eq!(
            open(&k2, &s).unwrap(),
            Position::After(vec![9, 0, 0, 0]),
            "same key after restart"
        );

        fs::set_permissions(state.join(KEY_FILE), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            CursorKey::load_or_create(&state),
            Err(KeyError::Permissions { mode: 0o644, .. })
        ));
    }
}
