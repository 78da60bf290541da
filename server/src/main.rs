//! The `thaw` binary. See `thaw --help`.

mod cli;

use std::io::IsTerminal;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log redirected to a file or a pipe gets plain text, and
        // `NO_COLOR` (no-color.org) turns colour off everywhere.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .init();
    cli::Cli::parse().command.run()
}
