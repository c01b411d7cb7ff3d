//! The matchers of constrained requests (`sparkd-grammar`: `response_format`, grammars, required tool calls),
//! owned by the engine thread beside the requests' states.
//!
//! Invariants:
//! - A constrained request's matcher has committed exactly the tokens the request has emitted (each step's
//!   emitted tokens are committed when the step lands), so its mask is the grammar's for the next position.
//! - Before verification a request's drafts are cut at their first token the grammar forbids, and its row
//!   carries one mask per sampling position (before the first draft, after each), computed on a copy of the
//!   matcher that walks the drafts; the runner samples and accepts under them, so a constrained reply is exactly
//!   what sampling from the masked target distribution gives, with speculation on or off.
//! - A matcher error fails its request alone, with the matcher's message.

use std::collections::HashMap;
use std::sync::Arc;

use sparkd_grammar::Constraint;
use sparkd_kernels::TokenId;

use super::types::{EngineError, RequestId};

/// See the module docs.
#[derive(Debug, Default)]
pub struct Constraints {
    by_request: HashMap<RequestId, Constraint>,
}

fn failed(id: RequestId, e: sparkd_grammar::GrammarError) -> EngineError {
    EngineError::InvalidRequest(format!("{id}: {e}"))
}

impl Constraints {
    pub fn insert(&mut self, id: RequestId, constraint: Constraint) {
        self.by_request.insert(id, constraint);
    }

    pub fn remove(&mut self, id: RequestId) {
        self.by_request.remove(&id);
    }

    /// Whether any live request is constrained (its next step's masks need this step's tokens, so no step is
    /// launched ahead).
    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    pub fn contains(&self, id: RequestId) -> bool {
        self.by_request.contains_key(&id)
    }

    /// Cuts `drafts` at the first token `id`'s grammar forbids (unconstrained requests keep theirs).
    pub fn cut(&mut self, id: RequestId, drafts: &mut Vec<TokenId>) -> Result<(), EngineError> {
        let Some(c) = self.by_request.get_mut(&id) else { return Ok(()) };
        let keep = c.allowed_prefix(drafts).map_err(|e| failed(id, e))?;
        drafts.truncate(keep);
        Ok(())
    }

    /// The masks of `id`'s row sampling after `drafts`: `drafts.len() + 1` of them; none for an unconstrained
    /// request.
    pub fn masks(&mut self, id: RequestId, drafts: &[TokenId]) -> Result<Vec<Arc<[u32]>>, EngineError> {
        let Some(c) = self.by_request.get_mut(&id) else { return Ok(Vec::new()) };
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        masks.push(Arc::from(c.allowed().map_err(|e| failed(id, e))?));
        if !drafts.is_empty() {
            let mut walk = c.clone();
            for &d in drafts {
                walk.commit(&[d]).map_err(|e| failed(id, e))?;
                masks.push(Arc::from(walk.allowed().map_err(|e| failed(id, e))?));
            }
        }
        Ok(masks)
    }

    /// Advances `id`'s matcher past the tokens it emitted.
    pub fn commit(&mut self, id: RequestId, tokens: &[TokenId]) -> Result<(), EngineError> {
        let Some(c) = self.by_request.get_mut(&id) else { return Ok(()) };
        c.commit(tokens).map_err(|e| failed(id, e))
    }
}
