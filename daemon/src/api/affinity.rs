//! The session-affinity header, `x-sparkd-session`: the key a load balancer hashes so that every turn of a
//! conversation reaches the replica that holds its state (README "Replicas behind a load balancer").
//!
//! Contract:
//! - A client (or the balancer in front) may send `x-sparkd-session` on a generation request (chat completions,
//!   completions, Responses over HTTP, the Responses WebSocket upgrade). Its value is 1 to [`MAX_KEY_LEN`]
//!   bytes of `A-Z a-z 0-9 - _ . : ~ + / =` (a UUID, a hex or base64 id, a response id); anything else, or the
//!   header sent twice, is a 400 naming the header. An empty value counts as absent.
//! - Every successful generation response carries `x-sparkd-session`: the client's value when it sent one,
//!   otherwise a key derived here, stable over the turns of one conversation, so a client that sends back
//!   what it received keeps its turns together:
//!   - Responses: the conversation's root. A first turn's key is its own response id; a continuation
//!     (`previous_response_id`) inherits the key stored with the response it continues (the `session` field
//!     of the stored object), so every turn of a chain answers the root's key.
//!   - Chat completions: a digest of the messages up to and including the first user message (a growing
//!     history keeps them, so every turn derives the same key); completions: a digest of the prompt's first
//!     [`COMPLETION_ROOT_TOKENS`] token ids.
//!   - The WebSocket upgrade: a fresh random key for the socket (its streams all run on this replica).
//! - What a client can know before turn 2 is only what turn 1 told it, and the balancer routes turn 1 before the
//!   daemon says anything: so affinity needs the key on turn 1 already. Either the client picks one, or the
//!   balancer makes one for a request that has none and passes it on (nginx: `$request_id`, see the README), and
//!   the client sends back the key it received.
//!
//! Invariants: parsing never panics on any header bytes; a derived key always satisfies the same bound and
//! charset as a client's (so a client can always send it back).

use hyper::header::{HeaderMap, HeaderValue};
use hyper::Response;
use sha2::{Digest, Sha256};
use sparkd_kernels::TokenId;
use sparkd_tokenizer::ChatMessage;

use super::error::ApiError;

/// The header's name (lower case, as HTTP/2 sends it; HTTP/1.1 matches it case-insensitively).
pub const SESSION_HEADER: &str = "x-sparkd-session";
/// The longest key accepted, in bytes: a UUID (36), a 128-bit hex id with a prefix (`resp_` + 32) and a
/// client's own composite keys fit; a balancer hashes it on every request, so it stays short.
pub const MAX_KEY_LEN: usize = 128;
/// How many leading prompt tokens of a completion name its conversation.
pub const COMPLETION_ROOT_TOKENS: usize = 256;
/// Hex digits of a derived digest key (96 bits).
const DIGEST_HEX: usize = 24;

/// A valid affinity key (see the module contract).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SessionKey(String);

/// Whether `b` may appear in a key.
fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':' | b'~' | b'+' | b'/' | b'=')
}

impl SessionKey {
    /// A key from text, checked against the bound and charset.
    pub fn parse(value: &[u8]) -> Result<SessionKey, ApiError> {
        if value.len() > MAX_KEY_LEN {
            return Err(invalid(format!(
                "the `{SESSION_HEADER}` header is {} bytes long; at most {MAX_KEY_LEN} are allowed",
                value.len()
            )));
        }
        if let Some(bad) = value.iter().position(|&b| !allowed(b)) {
            return Err(invalid(format!(
                "the `{SESSION_HEADER}` header has a byte outside `A-Z a-z 0-9 - _ . : ~ + / =` at offset {bad}"
            )));
        }
        // Every byte is ASCII here, so this conversion cannot fail.
        let text = String::from_utf8(value.to_vec()).map_err(|e| invalid(e.to_string()))?;
        Ok(SessionKey(text))
    }

    /// The key a request sent, if any (an empty value counts as none).
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<SessionKey>, ApiError> {
        let mut values = headers.get_all(SESSION_HEADER).iter();
        let Some(first) = values.next() else { return Ok(None) };
        if values.next().is_some() {
            return Err(invalid(format!("the `{SESSION_HEADER}` header was sent more than once")));
        }
        if first.is_empty() {
            return Ok(None);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key of a conversation whose root is the response `id` (`resp_` + 32 hex digits: always valid; an
    /// id that is not valid, which the daemon never makes, is digested instead).
    pub fn of_response(id: &str) -> SessionKey {
        Self::parse(id.as_bytes()).unwrap_or_else(|_| Self::digest("resp-", id.as_bytes()))
    }

    /// The key of a chat: its messages up to and including the first user message (all of them when there is
    /// none), by role, name and content.
    pub fn of_chat(messages: &[ChatMessage]) -> SessionKey {
        let root = messages.iter().position(|m| m.role == "user").map_or(messages.len(), |i| i + 1);
        let mut hasher = Sha256::new();
        for m in &messages[..root] {
            for part in [m.role.as_str(), m.name.as_deref().unwrap_or(""), m.content.as_str()] {
                hasher.update((part.len() as u64).to_le_bytes());
                hasher.update(part.as_bytes());
            }
        }
        Self::hex_key("chat-", hasher)
    }

    /// The key of a completion: its prompt's first [`COMPLETION_ROOT_TOKENS`] token ids.
    pub fn of_prompt(tokens: &[TokenId]) -> SessionKey {
        let mut hasher = Sha256::new();
        tokens.iter().take(COMPLETION_ROOT_TOKENS).for_each(|t| hasher.update(t.to_le_bytes()));
        Self::hex_key("cmpl-", hasher)
    }

    /// A fresh random key (a WebSocket's).
    pub fn fresh(prefix: &str) -> SessionKey {
        SessionKey(super::new_id(prefix))
    }

    fn digest(prefix: &str, bytes: &[u8]) -> SessionKey {
        let mut hasher = Sha256::new();
        hasher.update(bytes);
        Self::hex_key(prefix, hasher)
    }

    /// `prefix` and the first [`DIGEST_HEX`] hex digits of what `hasher` has read (the message is never copied).
    fn hex_key(prefix: &str, hasher: Sha256) -> SessionKey {
        let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
        SessionKey(format!("{prefix}{}", &hex[..DIGEST_HEX]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Sets the header on `response`.
    pub fn stamp<B>(&self, response: &mut Response<B>) {
        // The charset is a subset of visible ASCII, which a header value always accepts.
        if let Ok(value) = HeaderValue::from_str(&self.0) {
            response.headers_mut().insert(SESSION_HEADER, value);
        }
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::field(SESSION_HEADER, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(SESSION_HEADER, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn param_of(e: ApiError) -> String {
        e.body().param.unwrap_or_default()
    }

    #[test]
    fn a_valid_key_is_echoed_and_an_empty_one_is_absent() {
        let uuid = "3f2b8c1e-9a7d-4e21-b0c3-5d6f7a8b9c0d";
        assert_eq!(SessionKey::from_headers(&headers(&[uuid])).unwrap().unwrap().as_str(), uuid);
        assert_eq!(SessionKey::from_headers(&headers(&[])).unwrap(), None);
        assert_eq!(SessionKey::from_headers(&headers(&[""])).unwrap(), None);
        let longest = "k".repeat(MAX_KEY_LEN);
        assert!(SessionKey::from_headers(&headers(&[&longest])).is_ok());
    }

    #[test]
    fn keys_past_the_bound_or_charset_or_repeated_are_refused_naming_the_header() {
        let long = "k".repeat(MAX_KEY_LEN + 1);
        let e = SessionKey::from_headers(&headers(&[&long])).unwrap_err();
        assert!(e.to_string().contains("129 bytes") && e.to_string().contains("128"), "{e}");
        assert_eq!(e.status(), hyper::StatusCode::BAD_REQUEST);
        assert_eq!(param_of(e), SESSION_HEADER);
        for bad in ["a b", "a\"b", "a,b", "a;b"] {
            let e = SessionKey::from_headers(&headers(&[bad])).unwrap_err();
            assert!(e.to_string().contains("offset 1"), "{bad}: {e}");
        }
        assert!(SessionKey::parse("é".as_bytes()).is_err());
        let e = SessionKey::from_headers(&headers(&["a", "b"])).unwrap_err();
        assert!(e.to_string().contains("more than once"), "{e}");
    }

    #[test]
    fn derived_keys_are_stable_over_a_conversation_and_valid_to_send_back() {
        let turn1 = vec![ChatMessage::new("system", "rules"), ChatMessage::new("user", "fix the test")];
        let mut turn2 = turn1.clone();
        turn2.push(ChatMessage::new("assistant", "done"));
        turn2.push(ChatMessage::new("user", "now run it"));
        let other = vec![ChatMessage::new("system", "rules"), ChatMessage::new("user", "write docs")];
        assert_eq!(SessionKey::of_chat(&turn1), SessionKey::of_chat(&turn2));
        assert_ne!(SessionKey::of_chat(&turn1), SessionKey::of_chat(&other));
        // Field boundaries count: moving text between role and content changes the key.
        assert_ne!(
            SessionKey::of_chat(&[ChatMessage::new("user", "ab")]),
            SessionKey::of_chat(&[ChatMessage::new("usera", "b")])
        );
        let prompt: Vec<TokenId> = (0..COMPLETION_ROOT_TOKENS as TokenId + 10).collect();
        assert_eq!(SessionKey::of_prompt(&prompt), SessionKey::of_prompt(&prompt[..COMPLETION_ROOT_TOKENS]));
        assert_ne!(SessionKey::of_prompt(&prompt[..5]), SessionKey::of_prompt(&prompt[..6]));
        let id = "resp_0123456789abcdef0123456789abcdef";
        assert_eq!(SessionKey::of_response(id).as_str(), id);
        for key in [
            SessionKey::of_chat(&turn1),
            SessionKey::of_prompt(&prompt),
            SessionKey::of_response("not valid as a key"),
            SessionKey::fresh("ws-"),
        ] {
            assert_eq!(SessionKey::parse(key.as_str().as_bytes()).unwrap(), key);
        }
    }

    #[test]
    fn stamping_sets_the_header() {
        let mut r = Response::new(());
        SessionKey::of_response("resp_1").stamp(&mut r);
        assert_eq!(r.headers()[SESSION_HEADER], "resp_1");
    }
}
