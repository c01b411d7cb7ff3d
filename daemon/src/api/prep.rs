//! Request preparation off the I/O threads: parsing a body, validating it, rendering the chat template,
//! tokenizing, building the stop-string matcher and compiling output constraints run on tokio's blocking
//! threads, at most `--prep-threads` at once.
//!
//! Invariants:
//! - The async worker threads that accept connections, answer `/health` and write streams never run work whose
//!   cost grows with a request's size: a 17 MB prompt takes seconds to tokenize, which would otherwise stall
//!   every connection sharing its worker.
//! - At most `threads` preparations run at once; the rest wait (asynchronously, in arrival order) for a slot,
//!   so a flood of large prompts costs at most `threads` cores and leaves the others to the engine and the I/O.
//! - A request whose client leaves while it waits for a slot gives the slot up unused; one already running
//!   finishes its (bounded) work and its result is dropped.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::error::ApiError;

/// The bounded pool that prepares requests.
#[derive(Clone, Debug)]
pub struct PrepPool {
    slots: Arc<Semaphore>,
    threads: usize,
}

impl PrepPool {
    /// A pool running at most `threads` (at least 1) preparations at once.
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        PrepPool { slots: Arc::new(Semaphore::new(threads)), threads }
    }

    /// Half the machine's cores (at least 1): the other half stays with the engine's host work and the I/O.
    pub fn default_threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
    }

    /// How many preparations may run at once.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `work` on a blocking thread once a slot is free.
    pub async fn run<T, F>(&self, work: F) -> Result<T, ApiError>
    where
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
        T: Send + 'static,
    {
        let slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Internal("the request preparation pool is closed".into()))?;
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            work()
        })
        .await
        .map_err(|e| ApiError::Internal(format!("preparing the request failed: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_threads_preparations_run_at_once_and_errors_come_back() {
        let pool = PrepPool::new(2);
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let jobs: Vec<_> = (0..8)
            .map(|i| {
                let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
                tokio::spawn(async move {
                    pool.run(move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        running.fetch_sub(1, Ordering::SeqCst);
                        if i == 3 {
                            Err(ApiError::Internal("job 3".into()))
                        } else {
                            Ok(i)
                        }
                    })
                    .await
                })
            })
            .collect();
        let mut ok = Vec::new();
        for job in jobs {
            match job.await.unwrap() {
                Ok(i) => ok.push(i),
                Err(e) => assert!(e.to_string().contains("job 3"), "{e}"),
            }
        }
        assert_eq!(ok, vec![0, 1, 2, 4, 5, 6, 7]);
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }
}
