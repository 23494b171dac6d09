//! Stop strings over streamed text.
//!
//! OpenAI semantics: the output ends *before* the first occurrence of any stop string,
//! and the stop string itself is never sent. While streaming, text that could still be
//! the start of a stop string is held back until it is known not to be one.
//!
//! The stop strings are compiled once per request into an Aho–Corasick automaton over
//! their bytes, and the generated text is fed through it byte by byte as it arrives:
//! each byte costs amortised O(1) automaton moves whatever the number of stop strings
//! (scanning the text once per stop string cost O(Σ|stop|) per token). The
//! automaton's state is the longest tail of the text that is a prefix of some stop
//! string, which is exactly what must be held back.

/// The automaton's root: nothing of any stop string matched.
const ROOT: u32 = 0;

/// One trie node of the automaton.
#[derive(Clone, Debug, Default)]
struct Node {
    /// Trie edges, sorted by byte (at most 256, so a lookup is O(1) in the number of
    /// stop strings).
    next: Vec<(u8, u32)>,
    /// The node of the longest proper suffix of this node's string that is also a
    /// trie node.
    fail: u32,
    /// Length of this node's string: the bytes of a stop string matched so far.
    depth: usize,
    /// Length of the longest stop string that ends here (this node's own, or one that
    /// is a suffix of it), if any.
    longest_match: Option<usize>,
}

/// An Aho–Corasick automaton over a set of byte strings.
#[derive(Clone, Debug, Default)]
struct Automaton {
    nodes: Vec<Node>,
}

impl Automaton {
    /// Builds the automaton: a trie of `patterns`, then failure links breadth first.
    fn new<'a>(patterns: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut nodes = vec![Node::default()];
        for p in patterns {
            let mut at = ROOT;
            for &b in p {
                at = match Self::edge(&nodes[at as usize], b) {
                    Some(n) => n,
                    None => {
                        let id = nodes.len() as u32;
                        let depth = nodes[at as usize].depth + 1;
                        nodes.push(Node {
                            depth,
                            ..Node::default()
                        });
                        let next = &mut nodes[at as usize].next;
                        let i = next.partition_point(|&(c, _)| c < b);
                        next.insert(i, (b, id));
                        id
                    }
                };
            }
            let n = &mut nodes[at as usize];
            n.longest_match = Some(n.depth);
        }
        // Breadth first, so every node's failure target is finished before it.
        let mut queue = std::collections::VecDeque::from([ROOT]);
        while let Some(at) = queue.pop_front() {
            let edges = nodes[at as usize].next.clone();
            for (b, child) in edges {
                let fail = if at == ROOT {
                    ROOT
                } else {
                    let mut f = nodes[at as usize].fail;
                    loop {
                        if let Some(n) = Self::edge(&nodes[f as usize], b) {
                            break n;
                        }
                        if f == ROOT {
                            break ROOT;
                        }
                        f = nodes[f as usize].fail;
                    }
                };
                let inherited = nodes[fail as usize].longest_match;
                let c = &mut nodes[child as usize];
                c.fail = fail;
                // Its own match is longer than any suffix's.
                c.longest_match = c.longest_match.or(inherited);
                queue.push_back(child);
            }
        }
        Automaton { nodes }
    }

    fn edge(node: &Node, b: u8) -> Option<u32> {
        node.next
            .binary_search_by_key(&b, |&(c, _)| c)
            .ok()
            .map(|i| node.next[i].1)
    }

    /// The state after reading `b` in state `at`.
    fn step(&self, mut at: u32, b: u8) -> u32 {
        loop {
            let node = &self.nodes[at as usize];
            if let Some(n) = Self::edge(node, b) {
                return n;
            }
            if at == ROOT {
                return ROOT;
            }
            at = node.fail;
        }
    }

    fn node(&self, at: u32) -> &Node {
        &self.nodes[at as usize]
    }
}

/// Tracks generated text against a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    automaton: Automaton,
    /// Whether there is any stop string at all.
    any: bool,
    /// The automaton's state after all of `text`.
    state: u32,
    /// Length of the longest stop string: no match can start further back than this
    /// from where it ends.
    max_len: usize,
    text: String,
    emitted: usize,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
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
        let stops: Vec<&[u8]> = stops
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes())
            .collect();
        StopMatcher {
            any: !stops.is_empty(),
            max_len: stops.iter().map(|s| s.len()).max().unwrap_or(0),
            automaton: Automaton::new(stops),
            state: ROOT,
            text: String::new(),
            emitted: 0,
            matched: None,
        }
    }

    /// The stop string that ended the text, once one has (Anthropic reports it as
    /// `stop_sequence`).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Adds newly decoded text and returns what may be emitted.
    pub fn push(&mut self, delta: &str) -> StopCheck {
        let base = self.text.len();
        self.text.push_str(delta);
        if !self.any {
            return StopCheck {
                emit: self.take_until(self.text.len()),
                stopped: false,
            };
        }
        // The earliest-starting stop string completed by this delta. UTF-8 patterns
        // matched on UTF-8 text only ever match at character boundaries.
        let mut hit: Option<(usize, usize)> = None;
        for (i, &b) in delta.as_bytes().iter().enumerate() {
            let end = base + i + 1;
            if hit.is_some_and(|(h, _)| end >= h + self.max_len) {
                // Any later match starts after the one found.
                break;
            }
            self.state = self.automaton.step(self.state, b);
            if let Some(len) = self.automaton.node(self.state).longest_match {
                let start = end - len;
                // The earliest start wins (of two starting there, the one found first).
                hit = match hit {
                    Some((h, l)) if h <= start => Some((h, l)),
                    _ => Some((start, len)),
                };
            }
        }
        if let Some((pos, len)) = hit {
            self.matched = self.text.get(pos..pos + len).map(str::to_string);
            let emit = self.take_until(pos.max(self.emitted));
            return StopCheck {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop string: the
        // automaton's state is that tail. It starts at a character boundary, since the
        // stop string's prefix does.
        let held = self.automaton.node(self.state).depth;
        let safe = self.text.len() - held;
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
    fn the_matched_stop_string_is_the_earliest() {
        let mut m = StopMatcher::new(&["lo w".to_string(), "hel".to_string(), "o".to_string()]);
        assert_eq!(m.matched(), None);
        assert!(m.push("say hello world").stopped);
        assert_eq!(m.matched(), Some("hel"));
        assert_eq!(m.emitted_text(), "say ");
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

    /// The matcher this one replaced: every stop string searched in the text after
    /// every delta (O(Σ|stop|) per token), kept as the reference for its behaviour.
    fn reference(stops: &[String], deltas: &[&str]) -> (String, bool, Vec<String>) {
        let stops: Vec<&String> = stops.iter().filter(|s| !s.is_empty()).collect();
        let mut text = String::new();
        let mut emitted = 0;
        let mut emits = Vec::new();
        let floor = |t: &str, mut e: usize| {
            while !t.is_char_boundary(e) {
                e -= 1;
            }
            e
        };
        for d in deltas {
            text.push_str(d);
            let hit = stops.iter().filter_map(|s| text.find(s.as_str())).min();
            let end = match hit {
                Some(p) => p,
                None => {
                    let mut safe = text.len();
                    for s in &stops {
                        for k in (1..s.len()).rev() {
                            if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                                safe = safe.min(text.len() - k);
                                break;
                            }
                        }
                    }
                    safe
                }
            };
            let end = floor(&text, end.max(emitted));
            emits.push(text[emitted..end.max(emitted)].to_string());
            emitted = end.max(emitted);
            if hit.is_some() {
                return (text[..emitted].to_string(), true, emits);
            }
        }
        (text[..emitted].to_string(), false, emits)
    }

    fn run(stops: &[String], deltas: &[&str]) -> (String, bool, Vec<String>) {
        let mut m = StopMatcher::new(stops);
        let mut emits = Vec::new();
        for d in deltas {
            let c = m.push(d);
            emits.push(c.emit);
            if c.stopped {
                return (m.emitted_text().to_string(), true, emits);
            }
        }
        (m.emitted_text().to_string(), false, emits)
    }

    /// A small deterministic generator (xorshift), so failures reproduce.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }

        /// A string over a small alphabet (with multibyte characters), so that stops
        /// overlap and recur often.
        fn text(&mut self, len: usize) -> String {
            const ALPHABET: [char; 6] = ['a', 'b', 'c', 'é', '字', '\u{1f600}'];
            (0..len)
                .map(|_| ALPHABET[self.next(ALPHABET.len())])
                .collect()
        }
    }

    #[test]
    fn many_overlapping_stops_behave_as_the_reference_matcher() {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        for case in 0..2000 {
            let n_stops = [1, 2, 4, 16, 200][case % 5];
            let stops: Vec<String> = (0..n_stops)
                .map(|_| {
                    let len = 1 + g.next(5);
                    g.text(len)
                })
                .collect();
            let text = g.text(40);
            // Split the text into deltas of 1 to 3 characters, as tokens come.
            let chars: Vec<char> = text.chars().collect();
            let mut deltas = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                let n = (1 + g.next(3)).min(chars.len() - i);
                deltas.push(chars[i..i + n].iter().collect::<String>());
                i += n;
            }
            let deltas: Vec<&str> = deltas.iter().map(String::as_str).collect();
            assert_eq!(
                run(&stops, &deltas),
                reference(&stops, &deltas),
                "case {case}: stops {stops:?}, deltas {deltas:?}"
            );
        }
    }

    #[test]
    fn a_thousand_stops_find_the_earliest_and_hold_back_the_longest_prefix() {
        let mut stops: Vec<String> = (0..1000).map(|i| format!("<stop-{i:04}>")).collect();
        stops.push("xyz".into());
        let mut m = StopMatcher::new(&stops);
        // "<stop-0" could still become a stop: held back.
        assert_eq!(m.push("hello <stop-0").emit, "hello ");
        // Not a stop after all ("<stop-0x"): released, up to a new possible start.
        assert_eq!(m.push("x and <sto").emit, "<stop-0x and ");
        let c = m.push("p-0999> later xyz");
        assert!(c.stopped);
        assert_eq!(m.emitted_text(), "hello <stop-0x and ");
    }

    #[test]
    fn a_longer_stop_that_starts_earlier_wins_over_a_shorter_one_in_the_same_delta() {
        let mut m = StopMatcher::new(&["abcd".to_string(), "c".to_string()]);
        let c = m.push("xxabcd");
        assert!(c.stopped);
        assert_eq!(m.emitted_text(), "xx");
    }
}
