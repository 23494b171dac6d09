//! Conversions between the gRPC messages (`kvfleet_proto::v1`) and the engine's types,
//! with the checks only the wire format needs (signed counts, unset fields).

use crate::commands::LoadSnapshot;
use kvfleet_engine::{EngineLoad, FinishReason, KvEvent, KvEventKind, SamplingParams, TierStats};
use kvfleet_proto::kv_events::medium_to_wire;
use kvfleet_proto::v1 as pb;
use tonic::Status;

/// Engine sampling parameters from the request's (absent: the engine's defaults).
/// Range checks the engine also makes are left to it, so its messages are the ones
/// clients see; only what cannot be represented on the engine side is checked here.
pub fn sampling_params(p: Option<&pb::SamplingParams>) -> Result<SamplingParams, Status> {
    let Some(p) = p else {
        return Ok(SamplingParams::default());
    };
    if p.max_tokens <= 0 {
        return Err(Status::invalid_argument(format!(
            "max_tokens must be at least 1, got {}",
            p.max_tokens
        )));
    }
    // Bounded here, before the request is queued: the engine thread matches them on
    // every generated token.
    kvfleet_core::openai::check_stop_strings(&p.stop).map_err(Status::invalid_argument)?;
    kvfleet_core::openai::check_stop_token_ids(&p.stop_token_ids)
        .map_err(Status::invalid_argument)?;
    Ok(SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: p.top_p.unwrap_or(1.0),
        seed: p.seed,
        max_tokens: p.max_tokens as usize,
        stop: p.stop.clone(),
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        grammar: p.grammar.as_ref().map(output_grammar).transpose()?,
        logprobs: p.logprobs.map(|k| k as usize),
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect(),
    })
}

/// The engine's pin from the request's; a ttl of 0 or over an hour is refused here,
/// before the request is queued.
pub fn pin_spec(p: Option<&pb::PinRequest>) -> Result<Option<kvfleet_engine::PinSpec>, Status> {
    let Some(p) = p else {
        return Ok(None);
    };
    let ttl = std::time::Duration::from_secs(u64::from(p.ttl_s));
    if p.ttl_s == 0 || ttl > kvfleet_engine::MAX_PIN_TTL {
        return Err(Status::invalid_argument(format!(
            "pin.ttl_s must be between 1 and {}, got {}",
            kvfleet_engine::MAX_PIN_TTL.as_secs(),
            p.ttl_s
        )));
    }
    Ok(Some(kvfleet_engine::PinSpec {
        blocks: p.blocks as usize,
        ttl,
    }))
}

/// The wire form of a pin's outcome, its expiry counted from now.
pub fn pin_result(o: kvfleet_engine::PinOutcome) -> pb::PinResult {
    use kvfleet_engine::{PinOutcome, PinRefusal};
    match o {
        PinOutcome::Pinned { blocks, expires } => pb::PinResult {
            blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
            expires_in_ms: expires
                .saturating_duration_since(std::time::Instant::now())
                .as_millis() as u64,
            refusal: pb::PinRefusal::Unspecified as i32,
        },
        PinOutcome::Refused(PinRefusal::Capacity) => pb::PinResult {
            blocks: 0,
            expires_in_ms: 0,
            refusal: pb::PinRefusal::Capacity as i32,
        },
    }
}

/// The engine's grammar from the wire form; a message without a kind is refused.
pub fn output_grammar(
    g: &pb::OutputGrammar,
) -> Result<kvfleet_core::structured_output::OutputGrammar, Status> {
    use kvfleet_core::structured_output::OutputGrammar;
    use pb::output_grammar::Kind;
    match &g.kind {
        Some(Kind::JsonObject(_)) => Ok(OutputGrammar::JsonObject),
        Some(Kind::JsonSchema(s)) => Ok(OutputGrammar::JsonSchema(s.clone())),
        Some(Kind::Lark(s)) => Ok(OutputGrammar::Lark(s.clone())),
        None => Err(Status::invalid_argument("grammar has no kind")),
    }
}

/// The wire form of one token's log-probabilities.
pub fn token_logprob(l: kvfleet_engine::TokenLogprobs) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token,
        logprob: l.logprob,
        top: l
            .top
            .into_iter()
            .map(|(token_id, logprob)| pb::TopLogprob { token_id, logprob })
            .collect(),
    }
}

/// The wire value of an engine finish reason. `Prefilled` (a fork parent, never
/// exposed as a `Generate` request) maps to `Stop`.
pub fn finish_reason(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop | FinishReason::Prefilled => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Aborted => pb::FinishReason::Aborted,
    }
}

/// Lower-case name of a finish reason, for metric labels and logs.
pub fn finish_label(f: pb::FinishReason) -> &'static str {
    match f {
        pb::FinishReason::Unspecified => "unspecified",
        pb::FinishReason::Stop => "stop",
        pb::FinishReason::Length => "length",
        pb::FinishReason::Aborted => "aborted",
    }
}

/// The wire form of a KV event.
pub fn kv_event(e: &KvEvent) -> pb::KvEvent {
    use pb::kv_event::{Cleared, Kind, Removed, Stored};
    let kind = match &e.kind {
        KvEventKind::Stored {
            parent_hash,
            block_hashes,
            medium,
        } => Kind::Stored(Stored {
            parent_hash: parent_hash.map(|h| h.0),
            block_hashes: block_hashes.iter().map(|h| h.0).collect(),
            medium: medium_to_wire(*medium),
        }),
        KvEventKind::Removed {
            block_hashes,
            medium,
        } => Kind::Removed(Removed {
            block_hashes: block_hashes.iter().map(|h| h.0).collect(),
            medium: medium_to_wire(*medium),
        }),
        KvEventKind::Cleared => Kind::Cleared(Cleared {}),
    };
    pb::KvEvent {
        seq: e.seq,
        kind: Some(kind),
    }
}

/// Saturating `usize` → `u32` for counts sent on the wire.
pub fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The current-load fields of `load`, as a `KvEventBatch` pushes them (the event log
/// stamps `last_event_seq`; totals are left to `Load`).
pub(crate) fn pushed_load(load: &EngineLoad, load_seq: u64) -> pb::LoadResponse {
    pb::LoadResponse {
        load_seq,
        running: u32_of(load.running),
        waiting: u32_of(load.waiting),
        free_blocks: u32_of(load.free_blocks),
        cached_blocks: u32_of(load.cached_blocks),
        total_blocks: u32_of(load.total_blocks),
        queued_prefill_tokens: load.queued_prefill_tokens as u64,
        admit_blocks: Some(u32_of(load.admit_blocks)),
        ..pb::LoadResponse::default()
    }
}

/// The `Load` answer from the engine's published snapshot, the seq of the newest KV
/// event, and the blocks and bytes pulled from peers so far.
pub(crate) fn load_response(
    worker_id: &str,
    snap: &LoadSnapshot,
    last_event_seq: u64,
    (peer_pulled_blocks, peer_pulled_bytes): (u64, u64),
) -> pb::LoadResponse {
    let stats = &snap.stats;
    pb::LoadResponse {
        worker_id: worker_id.to_string(),
        prompt_tokens: stats.prompt_tokens,
        prompt_tokens_computed: stats.prompt_tokens_computed,
        cached_tokens: stats.cached_tokens,
        generated_tokens: stats.generated_tokens,
        preemptions: stats.preemptions,
        steps: stats.steps,
        last_event_seq,
        host_cached_tokens: snap.cached_by_tier.host,
        disk_cached_tokens: snap.cached_by_tier.disk,
        peer_cached_tokens: snap.cached_by_tier.peer,
        peer_pulled_blocks,
        peer_pulled_bytes,
        kv_tiers: snap.tiers.as_ref().map(kv_tier_totals),
        ..pushed_load(&snap.load, snap.load_seq)
    }
}

/// The wire form of the engine's tier totals.
fn kv_tier_totals(t: &TierStats) -> pb::KvTierTotals {
    let d = &t.disk;
    pb::KvTierTotals {
        host_blocks: t.host_blocks,
        host_bytes: t.host_bytes,
        disk_blocks: t.disk_blocks,
        disk_bytes: t.disk_bytes,
        demoted_blocks: t.demoted_blocks,
        demoted_bytes: t.demoted_bytes,
        demoted_off_thread_blocks: t.demoted_off_thread,
        promoted_host_blocks: t.promoted_host,
        promoted_disk_blocks: t.promoted_disk,
        promoted_peer_blocks: t.promoted_peer,
        promoted_bytes: t.promoted_bytes,
        demotion_misses: t.demotion_misses,
        disk_faults: d.full + d.write_errors + d.backlog_drops + d.missing + d.corrupt,
    }
}

/// Folds `next` into the not-yet-sent message `into`: tokens and text are appended,
/// and the later usage, timings and finish reason win.
pub fn merge_response(into: &mut pb::GenerateResponse, next: pb::GenerateResponse) {
    into.token_ids.extend(next.token_ids);
    into.logprobs.extend(next.logprobs);
    into.text.push_str(&next.text);
    if next.finish_reason != pb::FinishReason::Unspecified as i32 {
        into.finish_reason = next.finish_reason;
    }
    if next.usage.is_some() {
        into.usage = next.usage;
    }
    if next.timings.is_some() {
        into.timings = next.timings;
    }
    if next.stop_sequence.is_some() {
        into.stop_sequence = next.stop_sequence;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::BlockHash;

    #[test]
    fn sampling_defaults_and_checks() {
        assert_eq!(sampling_params(None).unwrap(), SamplingParams::default());
        let mut p = pb::SamplingParams {
            max_tokens: 5,
            ..Default::default()
        };
        let s = sampling_params(Some(&p)).unwrap();
        assert_eq!(s.top_p, 1.0);
        assert_eq!(s.max_tokens, 5);
        for bad in [0, -3] {
            p.max_tokens = bad;
            let e = sampling_params(Some(&p)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains("max_tokens"));
        }
    }

    #[test]
    fn events_convert() {
        let e = kv_event(&KvEvent {
            seq: 7,
            kind: KvEventKind::Stored {
                medium: Default::default(),
                parent_hash: Some(BlockHash(1)),
                block_hashes: vec![BlockHash(2), BlockHash(3)],
            },
        });
        assert_eq!(e.seq, 7);
        match e.kind {
            Some(pb::kv_event::Kind::Stored(s)) => {
                assert_eq!(s.parent_hash, Some(1));
                assert_eq!(s.block_hashes, vec![2, 3]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn load_reports_tier_totals_only_when_the_engine_has_tiers() {
        use crate::commands::CachedByTier;
        let mut snap = LoadSnapshot {
            cached_by_tier: CachedByTier {
                host: 640,
                disk: 32,
                peer: 16,
            },
            ..LoadSnapshot::default()
        };
        snap.stats.cached_tokens = 900;
        let l = load_response("w0", &snap, 7, (1, 4096));
        assert_eq!(l.kv_tiers, None, "no tiers, no tier totals");
        assert_eq!(
            (
                l.cached_tokens,
                l.host_cached_tokens,
                l.disk_cached_tokens,
                l.peer_cached_tokens
            ),
            (900, 640, 32, 16)
        );
        assert_eq!(
            (l.peer_pulled_blocks, l.peer_pulled_bytes, l.last_event_seq),
            (1, 4096, 7)
        );
        let mut t = TierStats {
            demoted_blocks: 50,
            demoted_bytes: 50 * 4096,
            demoted_off_thread: 44,
            demotion_misses: 3,
            promoted_host: 40,
            promoted_disk: 2,
            promoted_peer: 1,
            promoted_bytes: 43 * 4096,
            host_blocks: 48,
            host_bytes: 48 * 4200,
            disk_blocks: 9,
            disk_bytes: 9 * 4300,
            ..TierStats::default()
        };
        t.disk.full = 1;
        t.disk.write_errors = 2;
        t.disk.backlog_drops = 3;
        t.disk.missing = 4;
        t.disk.corrupt = 5;
        t.disk.written_blocks = 60;
        snap.tiers = Some(t);
        let k = load_response("w0", &snap, 7, (0, 0))
            .kv_tiers
            .expect("tier totals");
        assert_eq!(
            k,
            pb::KvTierTotals {
                host_blocks: 48,
                host_bytes: 48 * 4200,
                disk_blocks: 9,
                disk_bytes: 9 * 4300,
                demoted_blocks: 50,
                demoted_bytes: 50 * 4096,
                demoted_off_thread_blocks: 44,
                promoted_host_blocks: 40,
                promoted_disk_blocks: 2,
                promoted_peer_blocks: 1,
                promoted_bytes: 43 * 4096,
                demotion_misses: 3,
                disk_faults: 15,
            }
        );
    }

    #[test]
    fn merge_appends_and_keeps_the_last_finish() {
        let mut a = pb::GenerateResponse {
            token_ids: vec![1],
            text: "a".into(),
            usage: Some(pb::Usage {
                prompt_tokens: 3,
                cached_tokens: 0,
                completion_tokens: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        merge_response(
            &mut a,
            pb::GenerateResponse {
                token_ids: vec![2],
                text: "b".into(),
                finish_reason: pb::FinishReason::Length as i32,
                ..Default::default()
            },
        );
        assert_eq!(a.token_ids, vec![1, 2]);
        assert_eq!(a.text, "ab");
        assert_eq!(a.finish_reason, pb::FinishReason::Length as i32);
        assert_eq!(a.usage.map(|u| u.completion_tokens), Some(1));
    }
}
