//! What a `Generate` stream has not taken yet. The engine thread never waits for a
//! client: it `try_send`s, and when a stream is full the request's new tokens and text
//! are merged into one pending message (and a final error kept behind it) until the
//! client catches up. Nothing is dropped; a slow client just gets fewer, larger messages.

use crate::commands::StreamSender;
use crate::convert;
use kvfleet_proto::v1 as pb;
use tokio::sync::mpsc::error::TrySendError;
use tonic::Status;

/// Messages a request's client has not taken yet: tokens coalesced into one message,
/// and possibly a final error.
#[derive(Default)]
pub(crate) struct Outbox {
    msg: Option<pb::GenerateResponse>,
    /// A final error, sent after `msg`.
    pub(crate) error: Option<Status>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Delivery {
    /// Everything was handed to the stream.
    Done,
    /// The stream is full; the rest waits in the outbox.
    Buffered,
    /// The client went away.
    Closed,
}

impl Outbox {
    pub(crate) fn push(&mut self, msg: pb::GenerateResponse) {
        match &mut self.msg {
            Some(pending) => convert::merge_response(pending, msg),
            None => self.msg = Some(msg),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.msg.is_none() && self.error.is_none()
    }

    /// Hands what it can to `stream` without waiting.
    pub(crate) fn flush(&mut self, stream: &StreamSender) -> Delivery {
        if let Some(msg) = self.msg.take() {
            match stream.try_send(Ok(msg)) {
                Ok(()) => {}
                Err(TrySendError::Full(Ok(msg))) => {
                    self.msg = Some(msg);
                    return Delivery::Buffered;
                }
                Err(TrySendError::Full(Err(_))) => {}
                Err(TrySendError::Closed(_)) => return Delivery::Closed,
            }
        }
        if let Some(err) = self.error.take() {
            match stream.try_send(Err(err)) {
                Ok(()) => {}
                Err(TrySendError::Full(Err(err))) => {
                    self.error = Some(err);
                    return Delivery::Buffered;
                }
                Err(TrySendError::Full(Ok(_))) => {}
                Err(TrySendError::Closed(_)) => return Delivery::Closed,
            }
        }
        Delivery::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc as tmpsc;

    #[tokio::test]
    async fn outbox_coalesces_when_the_stream_is_full() {
        let (tx, mut rx) = tmpsc::channel(1);
        let mut ob = Outbox::default();
        let msg = |t: u32| pb::GenerateResponse {
            token_ids: vec![t],
            text: t.to_string(),
            ..Default::default()
        };
        ob.push(msg(1));
        assert_eq!(ob.flush(&tx), Delivery::Done);
        ob.push(msg(2));
        assert_eq!(ob.flush(&tx), Delivery::Buffered);
        ob.push(msg(3));
        ob.error = Some(Status::internal("x"));
        assert_eq!(ob.flush(&tx), Delivery::Buffered);
        assert_eq!(rx.recv().await.unwrap().unwrap().token_ids, vec![1]);
        assert_eq!(ob.flush(&tx), Delivery::Buffered);
        let m = rx.recv().await.unwrap().unwrap();
        assert_eq!((m.token_ids, m.text.as_str()), (vec![2, 3], "23"));
        assert_eq!(ob.flush(&tx), Delivery::Done);
        assert!(rx.recv().await.unwrap().is_err());
        assert!(ob.is_empty());
        drop(rx);
        ob.push(msg(4));
        assert_eq!(ob.flush(&tx), Delivery::Closed);
    }
}
