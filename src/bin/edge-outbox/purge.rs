//! `edge-outbox purge`: removes pending messages unpublished, for an operator; the relay announces
//! the gap to the cloud (cause `purged`).

use clap::Args;
use serde_json::json;

use crate::{Global, Result, db, output};

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("which").required(true).args(["topic", "all"]))]
pub struct PurgeArgs {
    /// Remove the pending messages of this topic (exact name).
    #[arg(long, value_name = "TOPIC")]
    pub topic: Option<String>,
    /// Remove every pending message.
    #[arg(long)]
    pub all: bool,
}

pub fn run(global: &Global, args: &PurgeArgs) -> Result<()> {
    let path = db::path(global)?;
    let outbox = db::open_write(global, &path)?;
    let removed = outbox
        .purge_pending(args.topic.as_deref())
        .map_err(|e| db::library_error(&path, e))?;
    if global.json {
        return output::print_json(&json!({ "removed": removed, "topic": args.topic }));
    }
    output::print(&format!(
        "{} removed unpublished; the relay announces {} to the cloud as a gap (cause purged)\n",
        output::count(removed, "pending message"),
        if removed == 1 { "it" } else { "them" }
    ))
}
