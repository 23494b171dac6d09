//! What the router's integration tests share.

pub mod fake_worker;
pub mod flaky_control;
