//! The wall clock, read in one place. Routing decisions never read it (they use the
//! router's monotonic milliseconds, [`crate::routing_state::RoutingState::now_ms`]);
//! only timestamps shown to people or written to records do.

/// Wall-clock Unix milliseconds (0 before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Wall-clock Unix seconds (0 before 1970).
pub fn unix_secs() -> u64 {
    unix_ms() / 1000
}
