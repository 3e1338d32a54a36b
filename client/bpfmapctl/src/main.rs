//! bpfmapctl: read eBPF maps from a bpfmapd, as JSON Lines.
#![forbid(unsafe_code)]

use std::io::{self, Write as _};

use bpfmapctl::{Cli, run};
use clap::Parser as _;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let result = run(cli, &mut out, &mut io::stderr()).await;
    // Whatever happened, what was printed reaches stdout before exiting.
    let flushed = out.flush();
    let result = result.and_then(|()| flushed.map_err(Into::into));
    if let Err(e) = result {
        // A closed pipe (`| head`) is not an error.
        if let Some(io) = e.downcast_ref::<io::Error>()
            && io.kind() == io::ErrorKind::BrokenPipe
        {
            return;
        }
        eprintln!("bpfmapctl: {e:#}");
        let code = if e.is::<bpfmapctl::Interrupted>() {
            130
        } else {
            1
        };
        std::process::exit(code);
    }
}
