//! Who may use the API: API keys and browser origins ([`Access`]), and whose kept responses are whose ([`Owner`]).
//!
//! Invariants:
//! - Without keys every request is served (a daemon on loopback for one user). With keys, every route but
//!   `/health` needs `Authorization: Bearer KEY` for one of them; the presented key's SHA-256 digest is compared
//!   with every key's, each byte of each, with no early exit, so the time taken reveals neither a key nor its
//!   length.
//! - A request carrying an `Origin` header (a browser sends one with every cross-site POST and WebSocket) is refused
//!   unless its origin is allowed (`--allow-origin`; `*` allows any); clients other than browsers send none. So a
//!   page on another site cannot make a local daemon generate.
//! - A kept response belongs to the key that made it: the engine keeps it under the owner's tag and the public
//!   id ([`Owner::kept_id`]), so another key finds nothing, exactly as for an id that never existed (404).

use hyper::header::{AUTHORIZATION, ORIGIN};
use hyper::HeaderMap;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use crate::engine::types::ResponseId;

/// The keys and origins the server accepts (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// SHA-256 of each key.
    keys: Vec<[u8; 32]>,
    /// Allowed `Origin` values; `*` allows any.
    origins: Vec<String>,
}

/// The key a request was made with, as the tag its kept responses are stored under; none without keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner(Option<String>);

impl Owner {
    /// The engine's id for the kept response this owner knows as `id`.
    pub fn kept_id(&self, id: &str) -> ResponseId {
        match &self.0 {
            Some(tag) => ResponseId(format!("{tag}/{id}")),
            None => ResponseId(id.to_owned()),
        }
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Access {
    /// Accepts `keys` (none: every request) and browser requests from `origins`. Errors on an empty key.
    pub fn new(keys: &[String], origins: &[String]) -> Result<Self, String> {
        if keys.iter().any(|k| k.trim().is_empty()) {
            return Err("an API key is empty".into());
        }
        Ok(Access { keys: keys.iter().map(|k| digest(k.trim())).collect(), origins: origins.to_vec() })
    }

    /// Whether requests need a key.
    pub fn requires_key(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Checks a request's origin and key; returns whose it is.
    pub fn check(&self, headers: &HeaderMap) -> Result<Owner, ApiError> {
        if let Some(origin) = headers.get(ORIGIN) {
            let origin = origin.to_str().unwrap_or_default();
            if !self.origins.iter().any(|o| o == "*" || o == origin) {
                return Err(ApiError::OriginNotAllowed(origin.to_owned()));
            }
        }
        if self.keys.is_empty() {
            return Ok(Owner::default());
        }
        let presented = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .ok_or(ApiError::Unauthorized { missing: true })?;
        let presented = digest(presented.trim());
        let mut matched = None;
        for (i, key) in self.keys.iter().enumerate() {
            let diff = key.iter().zip(&presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 {
                matched = Some(i);
            }
        }
        let i = matched.ok_or(ApiError::Unauthorized { missing: false })?;
        let tag: String = self.keys[i][..8].iter().map(|b| format!("{b:02x}")).collect();
        Ok(Owner(Some(tag)))
    }
}

/// The keys of `--api-key` (each flag, and `SPARKD_API_KEYS` comma-separated) and of `--api-key-file` (one per
/// line; blank lines and lines starting with `#` skipped).
pub fn load_keys(flags: &[String], file: Option<&std::path::Path>) -> Result<Vec<String>, String> {
    let mut keys: Vec<String> = flags.iter().map(|k| k.trim().to_owned()).collect();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
        keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_owned));
        if keys.is_empty() {
            return Err(format!("--api-key-file {} holds no key", path.display()));
        }
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn keys_origins_and_owners() {
        let open = Access::new(&[], &[]).unwrap();
        assert_eq!(open.check(&headers(&[])).unwrap(), Owner::default());
        assert_eq!(open.check(&headers(&[])).unwrap().kept_id("resp_1"), ResponseId("resp_1".into()));
        let keyed = Access::new(&["alpha".into(), "beta".into()], &["https://ok.example".into()]).unwrap();
        assert!(matches!(keyed.check(&headers(&[])), Err(ApiError::Unauthorized { missing: true })));
        let bad = headers(&[("authorization", "Bearer gamma")]);
        assert!(matches!(keyed.check(&bad), Err(ApiError::Unauthorized { missing: false })));
        let a = keyed.check(&headers(&[("authorization", "Bearer alpha")])).unwrap();
        let b = keyed.check(&headers(&[("authorization", "Bearer beta")])).unwrap();
        assert_ne!(a.kept_id("resp_1"), b.kept_id("resp_1"), "two keys never share a kept response");
        assert_eq!(a, keyed.check(&headers(&[("authorization", "Bearer alpha")])).unwrap(), "an owner is stable");
        let cross = headers(&[("authorization", "Bearer alpha"), ("origin", "https://evil.example")]);
        assert!(matches!(keyed.check(&cross), Err(ApiError::OriginNotAllowed(_))));
        let allowed = headers(&[("authorization", "Bearer alpha"), ("origin", "https://ok.example")]);
        assert_eq!(keyed.check(&allowed).unwrap(), a);
        assert!(Access::new(&[" ".into()], &[]).is_err());
        let any = Access::new(&[], &["*".into()]).unwrap();
        assert!(any.check(&headers(&[("origin", "https://anywhere.example")])).is_ok());
    }
}
