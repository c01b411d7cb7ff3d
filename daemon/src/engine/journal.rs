//! The session journal (`--session-dir`): an append-only, checksummed log of committed kept responses, so that
//! after a crash (kill -9 included) and a restart every committed turn can still be continued.
//!
//! A turn commits when the API attaches its response object (`EngineCommand::RecordResponse`): the journal then
//! appends the response's id (which carries its owner's key tag), its token history and its object, and syncs
//! the file to disk before the API is answered, so a client that saw a response end can always continue it.
//! Deleted and evicted responses are appended as forgotten, so they do not come back.
//!
//! Invariants:
//! - File layout: records of `[payload length: u32 LE][CRC-32 of the payload: u32 LE][payload]`. The first
//!   record is the header (magic, version, the served model's fingerprint); then commits and forgets.
//! - Replay reads records in order and stops at the first that is torn (the file ends inside it) or corrupt
//!   (its checksum fails, or it does not parse): that record and everything after it are logged, cut off the
//!   file, and appending resumes at the last good record. Replay never panics on any bytes.
//! - A journal written for another model (fingerprint) is moved aside (`*.stale`), not replayed: its token ids
//!   would mean other text.
//! - Compaction: when the file holds more than [`COMPACT_RATIO`] times the bytes of its live records (and at
//!   least [`COMPACT_MIN_BYTES`]), the live records are copied to a new file that is synced and renamed over the
//!   old one (then the folder is synced), so a crash during compaction leaves one whole journal or the other.
//! - The file is written by one thread ([`Journal`]), never by the engine thread: the engine only sends it
//!   what to write (a bounded channel), so disk latency never stalls a step.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;

use bytes::Bytes;
use sparkd_kernels::TokenId;
use tokio::sync::oneshot;

use super::types::ResponseId;

/// The journal's file name inside `--session-dir`.
pub const JOURNAL_FILE: &str = "sessions.journal";
/// Compact when the file is this many times larger than its live records...
pub const COMPACT_RATIO: u64 = 2;
/// ... and at least this large.
pub const COMPACT_MIN_BYTES: u64 = 64 << 20;
/// Operations queued for the writer thread before the engine waits (backpressure from the disk).
pub const JOURNAL_QUEUE: usize = 1024;
/// Largest record accepted on replay (a history of 2^24 tokens and a large object fit; anything longer is
/// corruption, not a record).
const MAX_RECORD_BYTES: u32 = 1 << 30;

const MAGIC: &[u8; 8] = b"SPKDJRNL";
const VERSION: u32 = 1;
const KIND_HEADER: u8 = 0;
const KIND_COMMIT: u8 = 1;
const KIND_FORGET: u8 = 2;
/// Bytes before a record's payload.
const FRAME: u64 = 8;

/// A committed kept response: what a continuation after a restart needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    pub id: ResponseId,
    /// Prompt and output tokens (the state is rebuilt from them by prefill).
    pub history: Vec<TokenId>,
    /// The response object `GET /v1/responses/{id}` returns.
    pub record: Bytes,
}

/// Why the journal could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("session journal {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl JournalError {
    /// A stable, low-cardinality name (metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            JournalError::Io { .. } => "journal_io",
        }
    }
}

/// Where a live record sits in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    offset: u64,
    len: u64,
}

/// The journal file: appends, replay, compaction. Owned by the writer thread.
#[derive(Debug)]
pub struct JournalFile {
    dir: PathBuf,
    path: PathBuf,
    file: File,
    /// Bytes of whole records in the file (where the next one is appended).
    len: u64,
    header: Vec<u8>,
    /// Each live response's latest commit record.
    live: HashMap<ResponseId, Span>,
    live_bytes: u64,
}

/// CRC-32 (IEEE 802.3, as zlib computes it) of `data`.
pub fn crc32(data: &[u8]) -> u32 {
    const fn table() -> [u32; 256] {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    }
    const TABLE: [u32; 256] = table();
    !data.iter().fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xFF) as usize] ^ (c >> 8))
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + FRAME as usize);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

fn header_payload(fingerprint: &str) -> Vec<u8> {
    let mut p = vec![KIND_HEADER];
    p.extend_from_slice(MAGIC);
    p.extend_from_slice(&VERSION.to_le_bytes());
    p.extend_from_slice(fingerprint.as_bytes());
    p
}

fn put_id(p: &mut Vec<u8>, id: &ResponseId) {
    p.extend_from_slice(&(id.0.len() as u32).to_le_bytes());
    p.extend_from_slice(id.0.as_bytes());
}

fn commit_payload(c: &Committed) -> Vec<u8> {
    let mut p = Vec::with_capacity(16 + c.id.0.len() + 4 * c.history.len() + c.record.len());
    p.push(KIND_COMMIT);
    put_id(&mut p, &c.id);
    p.extend_from_slice(&(c.history.len() as u32).to_le_bytes());
    for t in &c.history {
        p.extend_from_slice(&t.to_le_bytes());
    }
    p.extend_from_slice(&(c.record.len() as u32).to_le_bytes());
    p.extend_from_slice(&c.record);
    p
}

fn forget_payload(id: &ResponseId) -> Vec<u8> {
    let mut p = vec![KIND_FORGET];
    put_id(&mut p, id);
    p
}

/// A cursor over a payload that fails (returns `None`) instead of reading past its end.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn id(&mut self) -> Option<ResponseId> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok().map(ResponseId)
    }
}

/// One parsed record.
enum Record {
    Header,
    Commit(Committed),
    Forget(ResponseId),
}

fn parse(payload: &[u8]) -> Option<Record> {
    let (&kind, rest) = payload.split_first()?;
    let mut f = Fields(rest);
    let record = match kind {
        KIND_HEADER => Record::Header,
        KIND_COMMIT => {
            let id = f.id()?;
            let n = f.u32()? as usize;
            let raw = f.take(n.checked_mul(4)?)?;
            let history = raw.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let m = f.u32()? as usize;
            let record = Bytes::copy_from_slice(f.take(m)?);
            Record::Commit(Committed { id, history, record })
        }
        KIND_FORGET => Record::Forget(f.id()?),
        _ => return None,
    };
    // A payload with bytes left over is not one this version wrote.
    (matches!(record, Record::Header) || f.0.is_empty()).then_some(record)
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io { path: path.to_path_buf(), source }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl JournalFile {
    /// Opens (or creates) the journal in `dir` for the model `fingerprint` and replays it: the committed
    /// responses still live, in commit order (module invariants on torn tails and other models' journals).
    pub fn open(dir: &Path, fingerprint: &str) -> Result<(JournalFile, Vec<Committed>), JournalError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let path = dir.join(JOURNAL_FILE);
        let header = frame(&header_payload(fingerprint));
        let mut bytes = Vec::new();
        match File::open(&path) {
            Ok(mut f) => {
                f.read_to_end(&mut bytes).map_err(io_err(&path))?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e)),
        }
        // A file that is a prefix of the header was torn while its header was written: it holds nothing.
        if !bytes.starts_with(&header) && !header.starts_with(&bytes) {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let stale = dir.join(format!("{JOURNAL_FILE}.{now}.stale"));
            tracing::warn!(
                "the session journal {} was written for another model or version: moved to {}, not replayed",
                path.display(),
                stale.display()
            );
            std::fs::rename(&path, &stale).map_err(io_err(&path))?;
            bytes.clear();
        }
        let mut journal = JournalFile {
            dir: dir.to_path_buf(),
            file: OpenOptions::new()
                .create(true)
                .read(true)
                .write(true)
                .truncate(false)
                .open(&path)
                .map_err(io_err(&path))?,
            path,
            len: 0,
            header,
            live: HashMap::new(),
            live_bytes: 0,
        };
        let replayed = journal.replay(&bytes)?;
        Ok((journal, replayed))
    }

    /// Reads the records of `bytes` (the whole file), cuts a torn or corrupt tail, and returns the live commits.
    fn replay(&mut self, bytes: &[u8]) -> Result<Vec<Committed>, JournalError> {
        let mut commits: HashMap<ResponseId, (u64, Committed)> = HashMap::new();
        let mut at = 0u64;
        let mut seq = 0u64;
        while (at as usize) < bytes.len() {
            let rest = &bytes[at as usize..];
            let whole = (rest.len() >= FRAME as usize).then(|| {
                let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
                (len, crc)
            });
            let record = whole.and_then(|(len, crc)| {
                let payload = rest.get(FRAME as usize..FRAME as usize + len as usize)?;
                (len <= MAX_RECORD_BYTES && crc32(payload) == crc).then(|| parse(payload)).flatten().map(|r| (r, len))
            });
            let Some((record, len)) = record else {
                tracing::warn!(
                    "session journal {}: the record at byte {at} is torn or corrupt; it and the {} bytes after it \
                     are skipped and cut off",
                    self.path.display(),
                    bytes.len() as u64 - at
                );
                break;
            };
            let span = Span { offset: at, len: FRAME + u64::from(len) };
            match record {
                Record::Header if at == 0 => {}
                Record::Header => {
                    tracing::warn!(
                        "session journal {}: a second header at byte {at}; stopping there",
                        self.path.display()
                    );
                    break;
                }
                Record::Commit(c) => {
                    self.set_live(c.id.clone(), span);
                    seq += 1;
                    commits.insert(c.id.clone(), (seq, c));
                }
                Record::Forget(id) => {
                    self.drop_live(&id);
                    commits.remove(&id);
                }
            }
            at += span.len;
        }
        if at == 0 {
            self.file.set_len(0).map_err(io_err(&self.path))?;
            self.file.write_all(&self.header).map_err(io_err(&self.path))?;
            self.file.sync_data().map_err(io_err(&self.path))?;
            at = self.header.len() as u64;
        } else if at < bytes.len() as u64 {
            self.file.set_len(at).map_err(io_err(&self.path))?;
            self.file.sync_data().map_err(io_err(&self.path))?;
        }
        self.len = at;
        self.file.seek(SeekFrom::Start(at)).map_err(io_err(&self.path))?;
        let mut live: Vec<(u64, Committed)> = commits.into_values().collect();
        live.sort_by_key(|(seq, _)| *seq);
        Ok(live.into_iter().map(|(_, c)| c).collect())
    }

    fn set_live(&mut self, id: ResponseId, span: Span) {
        if let Some(old) = self.live.insert(id, span) {
            self.live_bytes -= old.len;
        }
        self.live_bytes += span.len;
    }

    fn drop_live(&mut self, id: &ResponseId) -> bool {
        match self.live.remove(id) {
            Some(old) => {
                self.live_bytes -= old.len;
                true
            }
            None => false,
        }
    }

    fn append(&mut self, payload: &[u8]) -> io::Result<Span> {
        let framed = frame(payload);
        let span = Span { offset: self.len, len: framed.len() as u64 };
        if let Err(e) = self.file.write_all(&framed) {
            // Cut what may have been written, so the next append starts on a record boundary.
            let _ = self.file.set_len(self.len);
            let _ = self.file.seek(SeekFrom::Start(self.len));
            return Err(e);
        }
        self.len += span.len;
        Ok(span)
    }

    /// Appends a commit and syncs it to disk.
    pub fn commit(&mut self, c: &Committed) -> io::Result<()> {
        let span = self.append(&commit_payload(c))?;
        self.file.sync_data()?;
        self.set_live(c.id.clone(), span);
        self.compact_if_due()
    }

    /// Appends that `ids` are forgotten (deleted or evicted) and syncs; ids never committed are skipped.
    pub fn forget(&mut self, ids: &[ResponseId]) -> io::Result<()> {
        let mut wrote = false;
        for id in ids {
            if self.drop_live(id) {
                self.append(&forget_payload(id))?;
                wrote = true;
            }
        }
        if wrote {
            self.file.sync_data()?;
            self.compact_if_due()?;
        }
        Ok(())
    }

    /// Bytes of whole records in the file.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file holds only its header.
    pub fn is_empty(&self) -> bool {
        self.len <= self.header.len() as u64
    }

    fn compact_if_due(&mut self) -> io::Result<()> {
        let live = self.live_bytes + self.header.len() as u64;
        if self.len < COMPACT_MIN_BYTES || self.len <= COMPACT_RATIO * live {
            return Ok(());
        }
        self.compact()
    }

    /// Copies the live records to a new file, syncs it and renames it over the journal.
    pub fn compact(&mut self) -> io::Result<()> {
        let tmp = self.dir.join(format!("{JOURNAL_FILE}.compacting"));
        let mut out = io::BufWriter::new(File::create(&tmp)?);
        out.write_all(&self.header)?;
        let mut spans: Vec<(ResponseId, Span)> = self.live.iter().map(|(id, s)| (id.clone(), *s)).collect();
        spans.sort_by_key(|(_, s)| s.offset);
        let mut at = self.header.len() as u64;
        let mut moved = HashMap::with_capacity(spans.len());
        let mut buf = Vec::new();
        for (id, span) in spans {
            buf.resize(span.len as usize, 0);
            self.file.seek(SeekFrom::Start(span.offset))?;
            self.file.read_exact(&mut buf)?;
            out.write_all(&buf)?;
            moved.insert(id, Span { offset: at, len: span.len });
            at += span.len;
        }
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(&self.dir)?;
        let before = self.len;
        self.file = OpenOptions::new().read(true).write(true).open(&self.path)?;
        self.file.seek(SeekFrom::Start(at))?;
        self.len = at;
        self.live = moved;
        tracing::info!("session journal compacted from {before} to {at} bytes ({} live responses)", self.live.len());
        Ok(())
    }
}

/// A journal opened and replayed: its writer thread and the committed responses to restore.
#[derive(Debug)]
pub struct OpenJournal {
    pub journal: Journal,
    pub replayed: Vec<Committed>,
}

impl OpenJournal {
    /// Opens and replays the journal in `dir` for the model `fingerprint`, and starts its writer thread.
    pub fn open(dir: &Path, fingerprint: &str) -> Result<OpenJournal, JournalError> {
        let (file, replayed) = JournalFile::open(dir, fingerprint)?;
        let path = file.path.clone();
        let journal = Journal::start(file).map_err(io_err(&path))?;
        Ok(OpenJournal { journal, replayed })
    }
}

/// What the engine asks the writer thread to do.
#[derive(Debug)]
enum JournalOp {
    /// Append and sync a commit, then answer (with whether it is on disk).
    Commit(Committed, oneshot::Sender<bool>),
    /// Append and sync that these are forgotten; then send the answer, if any, on its channel.
    Forget(Vec<ResponseId>, Option<(oneshot::Sender<bool>, bool)>),
}

/// The writer thread of a [`JournalFile`], and the engine's way to it.
#[derive(Debug)]
pub struct Journal {
    ops: Option<std_mpsc::SyncSender<JournalOp>>,
    thread: Option<JoinHandle<()>>,
}

impl Journal {
    /// Starts the writer thread over `file`.
    pub fn start(mut file: JournalFile) -> io::Result<Journal> {
        let (tx, rx) = std_mpsc::sync_channel::<JournalOp>(JOURNAL_QUEUE);
        let thread = std::thread::Builder::new().name("sparkd-journal".into()).spawn(move || {
            for op in rx {
                let (result, reply) = match op {
                    JournalOp::Commit(c, reply) => {
                        let result = file.commit(&c);
                        let on_disk = result.is_ok();
                        (result, Some((reply, on_disk)))
                    }
                    JournalOp::Forget(ids, reply) => (file.forget(&ids), reply),
                };
                if let Err(e) = result.map_err(io_err(&file.path)) {
                    metrics::counter!(crate::metrics::ERRORS_TOTAL, "kind" => e.kind()).increment(1);
                    tracing::error!("{e}; the change is in memory only");
                }
                if let Some((reply, answer)) = reply {
                    let _ = reply.send(answer);
                }
            }
        })?;
        Ok(Journal { ops: Some(tx), thread: Some(thread) })
    }

    /// Queues a commit (waiting while the queue is full); `reply` learns when it is on disk.
    pub fn commit(&self, committed: Committed, reply: oneshot::Sender<bool>) {
        if let Some(ops) = &self.ops {
            if let Err(std_mpsc::SendError(JournalOp::Commit(_, reply))) = ops.send(JournalOp::Commit(committed, reply))
            {
                let _ = reply.send(false);
            }
        }
    }

    /// Queues that `ids` are forgotten.
    pub fn forget(&self, ids: Vec<ResponseId>) {
        if let (Some(ops), false) = (&self.ops, ids.is_empty()) {
            let _ = ops.send(JournalOp::Forget(ids, None));
        }
    }

    /// Queues that `ids` are forgotten and sends `answer` on `reply` once that is on disk (a `DELETE` is
    /// answered only when a crash can no longer bring the response back).
    pub fn forget_then(&self, ids: Vec<ResponseId>, reply: oneshot::Sender<bool>, answer: bool) {
        match &self.ops {
            Some(ops) => {
                if let Err(std_mpsc::SendError(JournalOp::Forget(_, Some((reply, answer))))) =
                    ops.send(JournalOp::Forget(ids, Some((reply, answer))))
                {
                    let _ = reply.send(answer);
                }
            }
            None => {
                let _ = reply.send(answer);
            }
        }
    }
}

impl Drop for Journal {
    /// Writes everything queued, then stops the thread.
    fn drop(&mut self) {
        drop(self.ops.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the session journal thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(id: &str, n: u32) -> Committed {
        Committed {
            id: ResponseId(id.into()),
            history: (0..n).collect(),
            record: Bytes::from(format!("{{\"id\":\"{id}\"}}")),
        }
    }

    fn ids(replayed: &[Committed]) -> Vec<&str> {
        replayed.iter().map(|c| c.id.0.as_str()).collect()
    }

    fn reopen(dir: &Path) -> (JournalFile, Vec<Committed>) {
        JournalFile::open(dir, "k3-tiny vocab=163840").unwrap()
    }

    #[test]
    fn crc32_is_zlibs() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn commits_replay_in_order_and_forgotten_ones_stay_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, replayed) = reopen(dir.path());
        assert!(replayed.is_empty() && j.is_empty());
        for (id, n) in [("k/a", 3), ("k/b", 5), ("k/c", 1)] {
            j.commit(&committed(id, n)).unwrap();
        }
        j.forget(&[ResponseId("k/a".into()), ResponseId("never".into())]).unwrap();
        // A recommit supersedes the earlier record (a record attached again).
        j.commit(&committed("k/b", 6)).unwrap();
        drop(j);
        let (_, replayed) = reopen(dir.path());
        assert_eq!(ids(&replayed), ["k/c", "k/b"]);
        assert_eq!(replayed[1], committed("k/b", 6));
    }

    #[test]
    fn a_torn_or_corrupt_tail_is_cut_off_and_appending_resumes_after_the_last_good_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let (mut j, _) = reopen(dir.path());
        j.commit(&committed("a", 4)).unwrap();
        let good = j.len();
        j.commit(&committed("b", 4)).unwrap();
        drop(j);
        // Torn: the file ends inside b's record.
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 5]).unwrap();
        let (mut j, replayed) = reopen(dir.path());
        assert_eq!(ids(&replayed), ["a"]);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), good, "the torn tail is cut off");
        j.commit(&committed("c", 2)).unwrap();
        drop(j);
        assert_eq!(ids(&reopen(dir.path()).1), ["a", "c"]);

        // Corrupt: one flipped byte in c's payload fails its checksum; c and what follows are skipped.
        let mut bytes = std::fs::read(&path).unwrap();
        let at = good as usize + FRAME as usize + 3;
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(ids(&reopen(dir.path()).1), ["a"]);
    }

    #[test]
    fn garbage_and_short_files_never_panic_and_other_models_journals_are_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        let (mut j, _) = reopen(dir.path());
        j.commit(&committed("a", 2)).unwrap();
        drop(j);
        let (_, other) = JournalFile::open(dir.path(), "another model").unwrap();
        assert!(other.is_empty());
        let stale: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|n| n.ends_with(".stale"))
            .collect();
        assert_eq!(stale.len(), 1, "the other model's journal is kept aside");

        // A torn header, then random bytes after a good header: nothing replays, nothing panics.
        let header = frame(&header_payload("k3-tiny vocab=163840"));
        std::fs::write(&path, &header[..5]).unwrap();
        assert!(reopen(dir.path()).1.is_empty());
        let mut state = 7u64;
        for len in [1usize, 7, 8, 9, 64, 1000] {
            let mut bytes = header.clone();
            bytes.extend((0..len).map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 56) as u8
            }));
            std::fs::write(&path, &bytes).unwrap();
            assert!(reopen(dir.path()).1.is_empty());
            assert_eq!(std::fs::metadata(&path).unwrap().len(), header.len() as u64);
        }
    }

    #[test]
    fn compaction_keeps_exactly_the_live_records() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = reopen(dir.path());
        for i in 0..50 {
            j.commit(&committed(&format!("r{i}"), 100)).unwrap();
        }
        let forgotten: Vec<ResponseId> = (0..45).map(|i| ResponseId(format!("r{i}"))).collect();
        j.forget(&forgotten).unwrap();
        let before = j.len();
        j.compact().unwrap();
        assert!(j.len() * 5 < before, "{} -> {}", before, j.len());
        j.commit(&committed("after", 1)).unwrap();
        drop(j);
        let (_, replayed) = reopen(dir.path());
        assert_eq!(ids(&replayed), ["r45", "r46", "r47", "r48", "r49", "after"]);
        assert_eq!(replayed[0], committed("r45", 100));
    }

    #[test]
    fn the_writer_thread_answers_commits_once_they_are_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (file, _) = reopen(dir.path());
        let journal = Journal::start(file).unwrap();
        let (reply, on_disk) = oneshot::channel();
        journal.commit(committed("a", 3), reply);
        assert!(on_disk.blocking_recv().unwrap());
        journal.forget(vec![ResponseId("a".into())]);
        let (reply, on_disk) = oneshot::channel();
        journal.commit(committed("b", 3), reply);
        assert!(on_disk.blocking_recv().unwrap());
        drop(journal);
        assert_eq!(ids(&reopen(dir.path()).1), ["b"]);
    }
}
