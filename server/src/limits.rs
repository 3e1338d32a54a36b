//! Dump slots: how many dumps may run at once, in all and per identity.
//!
//! A slot is taken when DumpMap is accepted and held by the producer for the
//! whole life of the stream (tonic's own limits only cover the response
//! future, not the stream behind it).
#![forbid(unsafe_code)]

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{auth::Identity, error::Error};

/// How many dumps run at once, in all and per identity.
#[derive(Debug)]
pub struct DumpSlots {
    global: Arc<Semaphore>,
    global_max: usize,
    per_identity_max: usize,
    per_identity: Mutex<HashMap<Identity, Arc<Semaphore>>>,
}

/// A running dump's claim on both limits; released on drop.
#[derive(Debug)]
pub struct Slot {
    _global: OwnedSemaphorePermit,
    _identity: OwnedSemaphorePermit,
}

impl DumpSlots {
    /// Slots for `global_max` dumps, at most `per_identity_max` per identity.
    pub fn new(global_max: usize, per_identity_max: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(global_max)),
            global_max,
            per_identity_max,
            per_identity: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a slot, or RESOURCE_EXHAUSTED naming the limit that was hit.
    pub fn try_acquire(&self, identity: &Identity) -> Result<Slot, Error> {
        let sem = {
            let mut map = self.per_identity.lock().expect("slots lock");
            // Forget identities with nothing running, so the map stays small.
            if map.len() > 1024 {
                let max = self.per_identity_max;
                map.retain(|_, s| s.available_permits() < max);
            }
            map.entry(identity.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_identity_max)))
                .clone()
        };
        let identity_permit = sem.try_acquire_owned().map_err(|_| {
            Error::ResourceExhausted(format!(
                "{identity} already runs {} dumps (limits.max_dumps_per_identity); wait for one to finish",
                self.per_identity_max
            ))
        })?;
        let global = self.global.clone().try_acquire_owned().map_err(|_| {
            Error::ResourceExhausted(format!(
                "the server already runs {} dumps (limits.max_dumps); retry later",
                self.global_max
            ))
        })?;
        Ok(Slot {
            _global: global,
            _identity: identity_permit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_per_identity_and_in_all() {
        let slots = DumpSlots::new(3, 2);
        let (a, b) = (Identity::Cn("a".into()), Identity::Cn("b".into()));
        let a1 = slots.try_acquire(&a).unwrap();
        let _a2 = slots.try_acquire(&a).unwrap();
        let e = slots.try_acquire(&a).unwrap_err();
        assert!(e.to_string().contains("max_dumps_per_identity"), "{e}");
        let _b1 = slots.try_acquire(&b).unwrap();
        let e = slots.try_acquire(&b).unwrap_err();
        assert!(e.to_string().contains("limits.max_dumps)"), "{e}");
        drop(a1);
        slots
            .try_acquire(&b)
            .expect("a released slot is free again");
    }
}
