//! The `kvfleet` command line.

mod bench_cmd;
mod cache_aware_args;
mod control_plane;
mod generate;
mod http_serve;
mod router_cmd;
mod router_scale;
mod security_args;
mod serve_args;
mod sglang_args;
mod sim_cmd;
mod tls_args;
mod trace_cmd;
mod up;
mod worker_cmd;
mod worker_http;

use clap::{Parser, Subcommand};

/// kvfleet: LLM serving that computes each shared prompt prefix once per fleet.
#[derive(Parser)]
#[command(name = "kvfleet", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the embedded cluster: a router and N workers on 127.0.0.1.
    Up(up::UpArgs),
    /// Run one worker (gRPC).
    Worker(worker_cmd::WorkerArgs),
    /// Run one router (OpenAI HTTP API) in front of worker processes.
    Router(router_cmd::RouterArgs),
    /// Generate a completion for one prompt on a local engine.
    Generate(generate::GenerateArgs),
    /// Benchmark tools: generate traces, replay them, run the benchmark matrix.
    Bench(bench_cmd::BenchArgs),
    /// Simulate a fleet on a trace: hit ratio vs. bounds, load, TTFT, cost per policy.
    Sim(sim_cmd::SimArgs),
    /// Usage traces: `kvfleet trace export --kafka BROKERS --out FILE`.
    Trace(trace_cmd::TraceArgs),
    /// API keys: `kvfleet keys hash --tenant NAME < key` prints a keys-file line.
    Keys(security_args::KeysArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Up(args) => up::run(args),
        Command::Worker(args) => worker_cmd::run(args),
        Command::Router(args) => router_cmd::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Trace(args) => trace_cmd::run(args),
        Command::Keys(args) => security_args::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
