//! Operating the daemon: the metrics listener, reloading certificates,
//! policy and cursor keys without a restart, systemd's sd_notify, and the
//! capabilities the configuration needs.

mod exposition;
mod notify;
mod privileges;
mod reload;

pub(crate) use exposition::Exposition;
pub(crate) use notify::notify;
pub(crate) use privileges::{effective, missing, typed_maps_off, unprivileged_bpf_allowed};
pub(crate) use reload::{Reloader, Seen, watch_files};
