//! `kvfleet trace export`: usage records from `kvfleet.usage` → a replayable JSONL
//! trace (`timestamp`, `input_length`, `output_length`, `hash_ids`, `block_size`, and
//! `session_id`, `fork_group`, `tenant` when known).

use crate::control_plane::ControlArgs;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kvfleet_control::{EventStream, StartAt, Topic, UsageRecord};
use std::path::PathBuf;
use std::time::Duration;

/// `kvfleet trace …`.
#[derive(Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Export usage records as a replayable trace.
    Export(ExportArgs),
}

#[derive(Args)]
struct ExportArgs {
    /// Kafka bootstrap brokers.
    #[arg(long)]
    kafka: String,
    /// Prefix of the topic names.
    #[arg(long, default_value = "")]
    topic_prefix: String,
    /// Start from the oldest record kept (else: only records not yet exported by
    /// `--group`, or, for a new group, those published from now on).
    #[arg(long)]
    from_beginning: bool,
    /// Consumer group (default: a fresh one); a named group resumes where its last
    /// export stopped.
    #[arg(long)]
    group: Option<String>,
    /// Output file (JSONL).
    #[arg(long)]
    out: PathBuf,
    /// Stop after this long without a new record, milliseconds.
    #[arg(long, default_value_t = 3000)]
    idle_ms: u64,
    /// How long to wait for the first record, milliseconds.
    #[arg(long, default_value_t = 15000)]
    first_wait_ms: u64,
}

/// Runs `kvfleet trace`.
pub fn run(args: TraceArgs) -> Result<()> {
    crate::serve_args::init_logging();
    let rt = crate::serve_args::runtime()?;
    match args.command {
        TraceCommand::Export(a) => rt.block_on(export(a)),
    }
}

async fn export(a: ExportArgs) -> Result<()> {
    let control = ControlArgs {
        kafka: Some(a.kafka.clone()),
        topic_prefix: a.topic_prefix.clone(),
        kafka_session_timeout_ms: 2000,
        ..ControlArgs::default()
    };
    let stream = control.kafka().await?.context("--kafka is required")?;
    let group = a.group.clone().unwrap_or_else(|| {
        format!(
            "kvfleet-trace-export-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0)
        )
    });
    let start = if a.from_beginning {
        StartAt::Earliest
    } else {
        StartAt::Latest
    };
    let mut sub = stream
        .subscribe(Topic::Usage, &group, start)
        .await
        .context("subscribing to usage records")?;
    let mut records = Vec::new();
    let mut last = None;
    let mut wait = Duration::from_millis(a.first_wait_ms);
    while let Some(rec) = sub.next(wait).await.context("reading usage records")? {
        match UsageRecord::decode(&rec.payload) {
            Ok(u) => records.push(u),
            Err(e) => tracing::warn!(offset = rec.offset, "skipping a record: {e}"),
        }
        last = Some(rec);
        wait = Duration::from_millis(a.idle_ms);
    }
    if let Some(rec) = last {
        sub.commit(&rec).await.context("committing the export")?;
    }
    kvfleet_bench::usage_trace::trace_from_usage(&records)
        .write_path(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "kvfleet trace export: {} requests → {}",
        records.len(),
        a.out.display()
    );
    Ok(())
}
