//! Committing kept responses to the session journal (`--session-dir`): restoring the journal's committed turns at
//! start-up, writing each turn as it commits (answered once it is on disk), and forgetting what the session store
//! removed.

use bytes::Bytes;
use tokio::sync::oneshot;

use super::super::journal::{Committed, OpenJournal};
use super::super::types::ResponseId;
use super::EngineCore;

impl EngineCore {
    /// Restores the journal's committed turns as kept responses with their histories only (a continuation
    /// rebuilds the state by prefill) and their objects, then writes to the journal from now on.
    pub(super) fn with_journal(mut self, journal: Option<OpenJournal>) -> Self {
        let Some(OpenJournal { journal, replayed }) = journal else { return self };
        let count = replayed.len();
        for c in replayed {
            let kept = self.sessions.keep(self.runner.as_mut(), c.id.clone(), c.history, None);
            if let Err(e) = kept {
                tracing::warn!(response = %c.id, error = %e, "restoring a journaled response failed");
                continue;
            }
            self.sessions.set_record(&c.id, c.record);
        }
        self.sessions.track_removals();
        self.journal = Some(journal);
        self.enforce_memory();
        tracing::info!("session journal: {count} committed responses restored, {} kept", self.sessions.len());
        self
    }

    /// Commits a turn: attaches its record and, with a journal, has it written and synced before `reply`.
    pub(super) fn commit(&mut self, id: ResponseId, record: Bytes, reply: oneshot::Sender<bool>) {
        if !self.sessions.set_record(&id, record.clone()) {
            let _ = reply.send(true);
            return;
        }
        match (&self.journal, self.sessions.history(&id)) {
            (Some(journal), Some(history)) => {
                journal.commit(Committed { id, history: history.to_vec(), record }, reply);
            }
            _ => {
                let _ = reply.send(true);
            }
        }
        self.enforce_memory();
    }

    /// Tells the journal which kept responses the store removed since the last call.
    pub(super) fn forget_removed(&mut self) {
        if let Some(journal) = &self.journal {
            journal.forget(self.sessions.take_removed());
        }
    }
}
