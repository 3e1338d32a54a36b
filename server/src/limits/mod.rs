//! Bounds on what callers can make the daemon hold: dump slots (how many
//! dumps run at once, in all and per caller), memory for what is queued to
//! clients, and lookups in flight.
//!
//! Memory (`limits.max_queued_bytes`) is split so that no client can take
//! another's: three quarters are shared out equally among the dump slots (a
//! dump's [`Share`]: its queued chunks never exceed it, and nobody else can
//! use it, so a new dump always has room), and one quarter is the [`Budget`]
//! pool for lookup responses and for entries larger than a dump's share.
//!
//! A slot is taken when DumpMap is accepted and held by the producer for the
//! whole life of the stream (tonic's own limits only cover the response
//! future, not the stream behind it). A slot held longer than the hold time
//! while other dumps were refused is given back: the stream ends with
//! UNAVAILABLE and the client resumes from its cursor.
//!
//! Allocator trimming ([`Trimmer`]) lives here too: it is what hands the
//! memory of finished dumps and lookups back to the system.

mod memory;
mod slots;
mod trim;

pub(crate) use memory::{Budget, Held, Reservation, Share, split_memory};
pub(crate) use slots::{DumpSlots, LookupSlot, LookupSlots, Slot, SlotKey};
pub(crate) use trim::{TrimGuard, Trimmer};
