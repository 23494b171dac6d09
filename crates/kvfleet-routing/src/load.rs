//! Worker load as the router sees it: the worker's last polled report plus the work
//! this router has sent it since.
//!
//! Load reports arrive every few hundred milliseconds, while requests arrive every few
//! microseconds. Between two reports the router adds what it sent itself
//! (`*_since_poll`), so a burst of requests does not all land on the worker that looked
//! idle at the last poll. A new report replaces the polled fields and zeroes the
//! since-poll counters, because the report now includes that work. When a request's
//! first token comes, its prefill tokens leave the backlog at once (`finish_prefill`),
//! from whichever of the two counted them: otherwise a worker that has just finished a
//! prompt looks busy with it until the next report, and a repeat of the prompt moves
//! away from its cache.
//!
//! A worker also pushes its load with its KV events ([`WorkerLoad::apply_pushed`]): a
//! poll taken mid-request, of work this router did not send or whose end it has not
//! heard of, would otherwise keep the worker looking busy until the next poll. A
//! pushed load only lowers what the poll counted; raising it stays the poll's job.
//!
//! [`WorkerLoad`] is the one load type from the wire to the policy: the serving router
//! converts the worker's `Load` answer into it once (the polled fields), and the same
//! value is what the policies score and what `/fleet` shows.

use serde::{Deserialize, Serialize};

/// One worker's load snapshot, as used by routing policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerLoad {
    /// Sequences the worker is running (polled).
    pub running: usize,
    /// Sequences queued on the worker, not yet admitted (polled).
    pub waiting: usize,
    /// Prompt tokens the worker has yet to compute (polled).
    pub queued_prefill_tokens: usize,
    /// KV blocks free for allocation (polled).
    pub free_blocks: usize,
    /// All KV blocks of the worker (polled).
    pub total_blocks: usize,
    /// Blocks a new sequence may take now by the worker's admission rule: its free
    /// blocks less what its running sequences are expected to grow by. `None`: the
    /// worker does not say (it admits whatever its pool holds, or predates the field).
    pub admit_blocks: Option<usize>,
    /// Blocks of the prompts this router sent the worker since its last poll: they
    /// come out of `admit_blocks` until the next poll counts them.
    pub admit_blocks_since_poll: usize,
    /// KV blocks holding cached prefixes, free or in use (polled; shown, not scored).
    pub cached_blocks: usize,
    /// Prompt tokens received since the worker started (polled; shown, not scored).
    pub prompt_tokens: u64,
    /// Prompt tokens actually computed since start (polled; shown, not scored).
    pub prompt_tokens_computed: u64,
    /// Prompt tokens served from cache since start (polled; shown, not scored).
    pub cached_tokens: u64,
    /// Tokens generated since start (polled; shown, not scored).
    pub generated_tokens: u64,
    /// Preemptions since start (polled; shown, not scored).
    pub preemptions: u64,
    /// Requests this router has in flight to the worker (started, not finished).
    /// Maintained by the router; ignored in load reports.
    pub inflight_requests: usize,
    /// Prefill tokens (uncached prompt tokens) of those requests. Maintained by the
    /// router; ignored in load reports.
    pub inflight_prefill_tokens: usize,
    /// Requests this router sent since the last load report. Maintained by the router.
    pub requests_since_poll: usize,
    /// Prefill tokens this router sent since the last load report. Maintained by the
    /// router.
    pub prefill_tokens_since_poll: usize,
    /// Load reports this router has applied. Maintained by the router: a request that
    /// started at one count and ended its prefill at another was in a report's
    /// `queued_prefill_tokens`.
    pub reports: u64,
    /// The worker's count of published loads when the newest report applied (polled
    /// or pushed) was taken: orders a pushed load against a poll.
    pub report_seq: u64,
}

impl WorkerLoad {
    /// Prompt tokens the worker must compute before a new request's own prefill:
    /// the polled backlog plus what this router sent since.
    pub fn prefill_backlog_tokens(&self) -> usize {
        self.queued_prefill_tokens
            .saturating_add(self.prefill_tokens_since_poll)
    }

    /// Sequences the worker is (or soon will be) serving. Taking the larger of the
    /// polled count and this router's own in-flight count keeps the estimate sane
    /// when no load report has arrived yet.
    pub fn active_sequences(&self) -> usize {
        self.running
            .saturating_add(self.waiting)
            .saturating_add(self.requests_since_poll)
            .max(self.inflight_requests)
    }

    /// Prefills a new request would wait behind: the worker's waiting requests, those
    /// this router sent since its last report, and the one it is computing (when its
    /// backlog is not empty). Each costs the engine a fixed overhead on top of its
    /// tokens, which the token backlog leaves out. A request sent since the report
    /// counts until the next one, even if its first token came: an overestimate of at
    /// most one poll interval.
    pub fn prefills_ahead(&self) -> usize {
        self.waiting
            .saturating_add(self.requests_since_poll)
            .saturating_add(usize::from(self.prefill_backlog_tokens() > 0))
    }

    /// KV blocks in use by running sequences, in sixteenths of the pool
    /// (`0..=USAGE_LEVELS`; 0 when unknown), as the memory price reads it.
    pub fn usage_level(&self) -> u8 {
        if self.total_blocks == 0 {
            return 0;
        }
        let in_use = self.total_blocks - self.free_blocks.min(self.total_blocks);
        // At most 16 × total_blocks fits in u128 for any usize.
        (in_use as u128 * u128::from(USAGE_LEVELS) / self.total_blocks as u128) as u8
    }

    /// Fraction of KV blocks in use, in `[0, 1]` (0 when unknown).
    pub fn kv_usage(&self) -> f64 {
        if self.total_blocks == 0 {
            0.0
        } else {
            1.0 - (self.free_blocks.min(self.total_blocks) as f64 / self.total_blocks as f64)
        }
    }

    /// Takes the polled fields of `report`, keeps this router's in-flight counters and
    /// zeroes the since-poll counters (the report now reflects that work).
    pub fn apply_report(&mut self, report: &WorkerLoad) {
        self.running = report.running;
        self.waiting = report.waiting;
        self.queued_prefill_tokens = report.queued_prefill_tokens;
        self.free_blocks = report.free_blocks;
        self.total_blocks = report.total_blocks;
        self.admit_blocks = report.admit_blocks;
        self.cached_blocks = report.cached_blocks;
        self.prompt_tokens = report.prompt_tokens;
        self.prompt_tokens_computed = report.prompt_tokens_computed;
        self.cached_tokens = report.cached_tokens;
        self.generated_tokens = report.generated_tokens;
        self.preemptions = report.preemptions;
        self.requests_since_poll = 0;
        self.prefill_tokens_since_poll = 0;
        self.admit_blocks_since_poll = 0;
        self.reports = self.reports.wrapping_add(1);
        self.report_seq = report.report_seq;
    }

    /// Takes a load the worker pushed with its KV events, if it was taken after the
    /// last report applied (a later `report_seq`); returns whether it was.
    ///
    /// It only lowers the polled queue and sequence counts, and only raises the free
    /// blocks: it tells this router that work counted in the last poll has ended (a
    /// poll taken mid-request otherwise keeps the worker looking busy until the next
    /// one, and steers requests away from it). It does not stand in for a poll: the
    /// since-poll counters stay, because the pushed load may have been taken before
    /// this router's latest requests reached the worker, and raising the counts on its
    /// word would count those requests twice.
    pub fn apply_pushed(&mut self, pushed: &WorkerLoad) -> bool {
        if pushed.report_seq <= self.report_seq {
            return false;
        }
        self.report_seq = pushed.report_seq;
        self.running = self.running.min(pushed.running);
        self.waiting = self.waiting.min(pushed.waiting);
        self.queued_prefill_tokens = self.queued_prefill_tokens.min(pushed.queued_prefill_tokens);
        if pushed.total_blocks == self.total_blocks {
            self.free_blocks = self.free_blocks.max(pushed.free_blocks);
            self.admit_blocks = match (self.admit_blocks, pushed.admit_blocks) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, _) => a,
            };
        }
        true
    }

    /// Records a request this router sent, with its expected prefill tokens.
    pub fn start_request(&mut self, prefill_tokens: usize) {
        self.inflight_requests += 1;
        self.inflight_prefill_tokens = self.inflight_prefill_tokens.saturating_add(prefill_tokens);
        self.requests_since_poll += 1;
        self.prefill_tokens_since_poll = self
            .prefill_tokens_since_poll
            .saturating_add(prefill_tokens);
    }

    /// Records that a request started with [`start_request`](Self::start_request) when
    /// `reports` load reports had been applied has computed its `prefill_tokens`
    /// (its first token came). They leave the backlog now, not at the next report:
    /// from the since-poll count if no report came since the request started, else
    /// from the polled queue, which counted them (a router otherwise sees a worker
    /// that just finished a prompt as busy with it for up to a poll interval).
    pub fn finish_prefill(&mut self, prefill_tokens: usize, reports: u64) {
        self.inflight_prefill_tokens = self.inflight_prefill_tokens.saturating_sub(prefill_tokens);
        if reports == self.reports {
            self.prefill_tokens_since_poll = self
                .prefill_tokens_since_poll
                .saturating_sub(prefill_tokens);
        } else {
            self.queued_prefill_tokens = self.queued_prefill_tokens.saturating_sub(prefill_tokens);
        }
    }

    /// Records the end of a request started with [`start_request`](Self::start_request).
    /// The since-poll counters shrink too (saturating): without load reports they then
    /// track in-flight work; with reports, a request that started before the last
    /// report may shrink them early, an underestimate that lasts until the next report.
    pub fn finish_request(&mut self, prefill_tokens: usize) {
        self.inflight_requests = self.inflight_requests.saturating_sub(1);
        self.inflight_prefill_tokens = self.inflight_prefill_tokens.saturating_sub(prefill_tokens);
        self.requests_since_poll = self.requests_since_poll.saturating_sub(1);
        self.prefill_tokens_since_poll = self
            .prefill_tokens_since_poll
            .saturating_sub(prefill_tokens);
    }
}

/// Levels of KV pool usage the memory price tells apart: a worker's blocks in use by
/// running sequences, in sixteenths of its pool. Coarse on purpose: the load order
/// keeps one order per level, so a decision walks a few heads per level.
pub const USAGE_LEVELS: u8 = 16;

/// The numbers routing policies score a worker's load on, worked out once per
/// decision from its [`WorkerLoad`] (a candidate carries these, not the whole report:
/// a decision over 1,000 workers copies and reads a third of the bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CandidateLoad {
    active_sequences: usize,
    prefill_backlog_tokens: usize,
    // u32: it takes what was padding after the two counts, so the load keeps its size.
    prefills_ahead: u32,
    /// [`WorkerLoad::admit_blocks`], `u32::MAX` where the worker does not say.
    admit_blocks: u32,
    usage_level: u8,
}

impl CandidateLoad {
    /// A load of `active_sequences` sequences and `prefill_backlog_tokens` prompt
    /// tokens to compute, with an empty KV pool.
    pub fn new(active_sequences: usize, prefill_backlog_tokens: usize) -> Self {
        CandidateLoad {
            active_sequences,
            prefill_backlog_tokens,
            prefills_ahead: 0,
            admit_blocks: u32::MAX,
            usage_level: 0,
        }
    }

    /// This load with `blocks` blocks a new sequence may take now (saturating at
    /// `u32::MAX`; `None`: no limit known).
    pub fn with_admit_blocks(mut self, blocks: Option<usize>) -> Self {
        self.admit_blocks = blocks.map_or(u32::MAX, |b| u32::try_from(b).unwrap_or(u32::MAX));
        self
    }

    /// See [`WorkerLoad::admit_blocks`] (`u32::MAX`: not said).
    #[inline]
    pub fn admit_blocks(&self) -> u32 {
        self.admit_blocks
    }

    /// Whether a new sequence needing `blocks` blocks would be admitted now: the
    /// worker runs nothing (a lone sequence always is), or its admission headroom
    /// holds them.
    #[inline]
    pub fn admits(&self, blocks: usize) -> bool {
        self.active_sequences == 0 || blocks <= self.admit_blocks as usize
    }

    /// This load with `n` prefills queued or running ahead of a new request
    /// (saturating at `u32::MAX`).
    pub fn with_prefills_ahead(mut self, n: usize) -> Self {
        self.prefills_ahead = u32::try_from(n).unwrap_or(u32::MAX);
        self
    }

    /// See [`WorkerLoad::prefills_ahead`] (0 unless set).
    #[inline]
    pub fn prefills_ahead(&self) -> usize {
        self.prefills_ahead as usize
    }

    /// This load with `level` sixteenths of the KV pool in use (capped at
    /// [`USAGE_LEVELS`]).
    pub fn with_usage_level(mut self, level: u8) -> Self {
        self.usage_level = level.min(USAGE_LEVELS);
        self
    }

    /// See [`WorkerLoad::usage_level`].
    #[inline]
    pub fn usage_level(&self) -> u8 {
        self.usage_level
    }

    /// See [`WorkerLoad::active_sequences`].
    #[inline]
    pub fn active_sequences(&self) -> usize {
        self.active_sequences
    }

    /// See [`WorkerLoad::prefill_backlog_tokens`].
    #[inline]
    pub fn prefill_backlog_tokens(&self) -> usize {
        self.prefill_backlog_tokens
    }
}

impl From<&WorkerLoad> for CandidateLoad {
    fn from(l: &WorkerLoad) -> Self {
        CandidateLoad::new(l.active_sequences(), l.prefill_backlog_tokens())
            .with_usage_level(l.usage_level())
            .with_prefills_ahead(l.prefills_ahead())
            .with_admit_blocks(
                l.admit_blocks
                    .map(|a| a.saturating_sub(l.admit_blocks_since_poll)),
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefills_ahead_count_the_queue_what_was_sent_since_and_the_one_computing() {
        let mut l = WorkerLoad::default();
        assert_eq!(l.prefills_ahead(), 0);
        // One prefill computing (its tokens in the backlog), two waiting.
        l.apply_report(&WorkerLoad {
            running: 3,
            waiting: 2,
            queued_prefill_tokens: 400,
            ..WorkerLoad::default()
        });
        assert_eq!(l.prefills_ahead(), 3);
        // A request this router sent since: one more ahead of the next.
        l.start_request(50);
        assert_eq!(l.prefills_ahead(), 4);
        assert_eq!(CandidateLoad::from(&l).prefills_ahead(), 4);
        // An idle lane decoding: nothing ahead.
        l.apply_report(&WorkerLoad {
            running: 3,
            ..WorkerLoad::default()
        });
        assert_eq!(l.prefills_ahead(), 0);
    }

    #[test]
    fn reports_and_router_work_combine() {
        let mut l = WorkerLoad::default();
        l.start_request(1_000);
        l.start_request(500);
        assert_eq!(l.prefill_backlog_tokens(), 1_500);
        assert_eq!(l.active_sequences(), 2);
        l.apply_report(&WorkerLoad {
            running: 1,
            waiting: 1,
            queued_prefill_tokens: 400,
            free_blocks: 30,
            total_blocks: 40,
            inflight_requests: 99,
            ..WorkerLoad::default()
        });
        assert_eq!(
            l.inflight_requests, 2,
            "in-flight is the router's own count"
        );
        assert_eq!(l.prefill_backlog_tokens(), 400);
        assert_eq!(l.active_sequences(), 2);
        assert!((l.kv_usage() - 0.25).abs() < 1e-9);
        assert_eq!(l.usage_level(), 4, "10 of 40 blocks in use: 4 sixteenths");
        assert_eq!(CandidateLoad::from(&l).usage_level(), 4);
        l.start_request(100);
        assert_eq!(l.prefill_backlog_tokens(), 500);
        assert_eq!(l.active_sequences(), 3);
        l.finish_request(100);
        l.finish_request(1_000);
        l.finish_request(500);
        l.finish_request(500);
        assert_eq!(l.inflight_requests, 0);
        assert_eq!(l.inflight_prefill_tokens, 0);
    }

    #[test]
    fn a_pushed_load_newer_than_the_poll_only_lowers_what_the_poll_counted() {
        // A poll taken mid-request: one running, one waiting, 700 tokens to compute.
        let polled = WorkerLoad {
            running: 1,
            waiting: 1,
            queued_prefill_tokens: 700,
            free_blocks: 20,
            total_blocks: 40,
            report_seq: 10,
            ..WorkerLoad::default()
        };
        let mut l = WorkerLoad::default();
        l.apply_report(&polled);
        l.start_request(300);
        let pushed = |running, waiting, queued, free, seq| WorkerLoad {
            running,
            waiting,
            queued_prefill_tokens: queued,
            free_blocks: free,
            total_blocks: 40,
            report_seq: seq,
            ..WorkerLoad::default()
        };
        // Older than the poll, or the poll itself: ignored.
        assert!(!l.apply_pushed(&pushed(0, 0, 0, 40, 9)));
        assert!(!l.apply_pushed(&pushed(0, 0, 0, 40, 10)));
        assert_eq!(l.prefill_backlog_tokens(), 1_000);
        // Newer, and the polled work has ended: the worker looks idle at once but for
        // this router's own request sent since the poll.
        assert!(l.apply_pushed(&pushed(0, 0, 0, 40, 11)));
        assert_eq!(l.prefill_backlog_tokens(), 300);
        assert_eq!(l.active_sequences(), 1);
        assert_eq!(l.prefills_ahead(), 2, "its own request, and it computing");
        assert_eq!(l.usage_level(), 0);
        // Newer and busier (another router's work): never raised, that is the poll's job.
        assert!(l.apply_pushed(&pushed(3, 2, 5_000, 10, 12)));
        assert_eq!((l.running, l.waiting, l.queued_prefill_tokens), (0, 0, 0));
        assert_eq!(l.free_blocks, 40);
        // The next poll replaces it all.
        l.apply_report(&pushed(3, 2, 5_000, 10, 13));
        assert_eq!(l.prefill_backlog_tokens(), 5_000);
        assert!(!l.apply_pushed(&pushed(0, 0, 0, 40, 12)));
    }

    #[test]
    fn a_first_token_takes_the_prefill_out_of_the_backlog_at_once() {
        let report = |queued| WorkerLoad {
            running: 1,
            queued_prefill_tokens: queued,
            ..WorkerLoad::default()
        };
        // A report came while the request was queued: it counted the request's 650
        // tokens, which leave the polled queue at the first token, not at the next
        // report 100 ms later.
        let mut l = WorkerLoad::default();
        l.start_request(650);
        let at_start = l.reports;
        l.apply_report(&report(650 + 200));
        l.finish_prefill(650, at_start);
        assert_eq!(l.prefill_backlog_tokens(), 200);
        assert_eq!(l.inflight_prefill_tokens, 0);
        l.finish_request(0);
        assert_eq!((l.inflight_requests, l.prefill_backlog_tokens()), (0, 200));
        // No report since it started: the tokens leave the since-poll count.
        l.start_request(300);
        l.start_request(100);
        let at_start = l.reports;
        l.finish_prefill(300, at_start);
        assert_eq!(l.prefill_backlog_tokens(), 200 + 100);
        assert_eq!(l.prefill_tokens_since_poll, 100);
    }
}
