//! What the router's integration tests share.

pub mod fake_worker;
