//! Stop strings over streamed text.
//!
//! OpenAI semantics: the output ends *before* the first occurrence of any stop string,
//! and the stop string itself is never sent. While streaming, text that could still be
//! the start of a stop string is held back until it is known not to be one.

/// Tracks generated text against a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    max_len: usize,
    text: String,
    emitted: usize,
}

/// What the matcher says after new text arrives.
#[derive(Debug, PartialEq, Eq)]
pub struct StopCheck {
    /// Text that can be sent to the client now.
    pub emit: String,
    /// A stop string was found; generation must end.
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for these stop strings (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        StopMatcher {
            stops,
            max_len,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Adds newly decoded text and returns what may be emitted.
    pub fn push(&mut self, delta: &str) -> StopCheck {
        let mut search_from = self.emitted.saturating_sub(self.max_len);
        // Stop strings and generated text are arbitrary UTF-8: step back to a char
        // boundary rather than slice inside a character.
        while !self.text.is_char_boundary(search_from) {
            search_from -= 1;
        }
        self.text.push_str(delta);
        if self.stops.is_empty() {
            return StopCheck {
                emit: self.take_until(self.text.len()),
                stopped: false,
            };
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|p| p + search_from)
            })
            .min();
        if let Some(pos) = hit {
            let emit = self.take_until(pos.max(self.emitted));
            return StopCheck {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut safe = self.text.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && self.text.len() >= k && self.text.ends_with(&s[..k]) {
                    safe = safe.min(self.text.len() - k);
                    break;
                }
            }
        }
        StopCheck {
            emit: self.take_until(safe.max(self.emitted)),
            stopped: false,
        }
    }

    /// Everything not yet emitted (at the end of a generation that did not stop on a string).
    pub fn flush(&mut self) -> String {
        self.take_until(self.text.len())
    }

    /// All text emitted so far.
    pub fn emitted_text(&self) -> &str {
        &self.text[..self.emitted]
    }

    fn take_until(&mut self, end: usize) -> String {
        let mut end = end.min(self.text.len());
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_before_the_stop_string_across_deltas() {
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("hello E").emit, "hello ");
        let c = m.push("ND more");
        assert!(c.stopped);
        assert_eq!(c.emit, "");
        assert_eq!(m.emitted_text(), "hello ");
    }

    #[test]
    fn multibyte_stop_strings_do_not_panic() {
        // Found by schemathesis: a 4-byte character in a stop string panicked the
        // engine thread while checking for a partial match.
        let stop = "\u{e09e3}\u{fb}".to_string();
        let mut m = StopMatcher::new(std::slice::from_ref(&stop));
        assert_eq!(m.push("ab").emit, "ab");
        assert_eq!(m.push("\u{fb}\u{e09e3}").emit, "\u{fb}");
        let c = m.push("\u{fb}!");
        assert!(c.stopped);
        assert_eq!(m.emitted_text(), "ab\u{fb}");
    }

    #[test]
    fn false_alarm_is_released() {
        let mut m = StopMatcher::new(&["</s>".to_string()]);
        assert_eq!(m.push("a</").emit, "a");
        assert_eq!(m.push("x").emit, "</x");
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn no_stops_emits_everything() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc").emit, "abc");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut m = StopMatcher::new(&["c".to_string(), "ab".to_string()]);
        let c = m.push("xabc");
        assert!(c.stopped);
        assert_eq!(c.emit, "x");
    }
}
