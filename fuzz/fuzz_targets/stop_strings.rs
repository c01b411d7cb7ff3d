//! Fuzz target: the stop-string matcher (`sparkd::api::stop::StopStrings`) fed text in arbitrary chunks, the stop
//! strings and the text drawn from a small alphabet of one- to four-byte characters so that matches, overlapping
//! stop strings and characters split across chunks are frequent.
//!
//! Checks, against a direct search of the whole text:
//! - nothing panics;
//! - everything released (the outputs of `feed`, then `finish` unless a stop string matched) is the text cut before
//!   the stop string that completes first: of the occurrences of every stop string, the one that ends earliest,
//!   and of those ending at the same byte the longest (what a generator stopping at its first match returns; this
//!   is the earliest occurrence unless one stop string holds another before its own end); the whole text when none
//!   occurs;
//! - `matched` says whether one occurred, and nothing is released after a match.
//!
//! Empty stop strings are left out: requests refuse them before a matcher is built.

#![no_main]

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use sparkd::api::stop::StopStrings;

const ALPHABET: [&str; 8] = ["a", "b", "c", " ", "\n", "é", "€", "😀"];

#[derive(Arbitrary, Debug)]
struct Input {
    stops: Vec<Vec<u8>>,
    text: Vec<u8>,
    cuts: Vec<u8>,
}

fn spell(codes: &[u8]) -> String {
    codes.iter().map(|&c| ALPHABET[usize::from(c) % ALPHABET.len()]).collect()
}

/// The byte where the released text ends: before the occurrence that ends first (the longest of those), if any.
/// Every occurrence is looked at, overlapping ones included.
fn first_completed(text: &str, stops: &[String]) -> Option<usize> {
    text.char_indices()
        .flat_map(|(start, _)| {
            stops.iter().filter(move |s| text[start..].starts_with(s.as_str())).map(move |s| (start + s.len(), start))
        })
        .min()
        .map(|(_, start)| start)
}

fuzz_target!(|input: Input| {
    let stops: Vec<String> =
        input.stops.iter().take(6).map(|s| spell(&s[..s.len().min(8)])).filter(|s| !s.is_empty()).collect();
    let text = spell(&input.text);
    let mut matcher = StopStrings::new(stops.clone());
    let mut released = String::new();
    let mut rest = text.as_str();
    let mut cuts = input.cuts.iter();
    while !rest.is_empty() {
        let mut at = cuts.next().map_or(rest.len(), |&c| usize::from(c) % (rest.len() + 1));
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        let was_matched = matcher.matched();
        let out = matcher.feed(&rest[..at]);
        assert!(!was_matched || out.is_empty(), "text released after a match");
        released.push_str(&out);
        rest = &rest[at..];
    }
    if !matcher.matched() {
        released.push_str(&matcher.finish());
    }
    let cut = first_completed(&text, &stops);
    assert_eq!(matcher.matched(), cut.is_some(), "stops {stops:?} text {text:?}");
    assert_eq!(released, &text[..cut.unwrap_or(text.len())], "stops {stops:?} text {text:?}");
});
