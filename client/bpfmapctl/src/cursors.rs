//! The cursor file: every target's cursor, and whether it finished, for a
//! later run to resume from.

use std::{collections::BTreeMap, path::Path};

use anyhow::Context as _;

use crate::{DumpArgs, usage};

/// What --save-cursor writes and --resume reads.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct CursorFile {
    pub(crate) map: String,
    pub(crate) targets: BTreeMap<String, SavedTarget>,
}

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct SavedTarget {
    pub(crate) cursor: String,
    pub(crate) done: bool,
}

impl CursorFile {
    /// The file of --resume, if given.
    pub(crate) fn read(args: &DumpArgs) -> anyhow::Result<Option<Self>> {
        let Some(path) = &args.resume else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        let file = serde_json::from_str(&text)
            .map_err(|e| usage(format!("{} is not a cursor file: {e}", path.display())))?;
        Ok(Some(file))
    }

    /// The targets it names.
    pub(crate) fn targets(&self) -> impl Iterator<Item = &str> {
        self.targets.keys().map(String::as_str)
    }

    /// Writes the file (whole or not at all).
    pub(crate) fn write(&self, path: &Path) -> anyhow::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
    }
}
