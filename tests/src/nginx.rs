//! A real nginx for black-box tests: Debian's `nginx` binary on loopback, in front of daemons started by the test.
//!
//! Invariants:
//! - [`Nginx::start`] runs nginx in the foreground as one process (`daemon off; master_process off;`, so it
//!   runs as the user running the test and never switches to `www-data`), with its configuration, pid file,
//!   logs and temporary folders under a folder the caller owns: nothing under `/etc`, `/var` or `/run` is read
//!   or written. It waits (at most [`NGINX_STARTUP`]) until every port it listens on accepts a connection,
//!   and the process is killed when the value is dropped.
//! - The caller gives the `http` block's body (maps, upstreams, servers); this module adds only the paths.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long nginx may take to listen.
pub const NGINX_STARTUP: Duration = Duration::from_secs(30);

/// The nginx binary: on `$PATH`, else Debian's `/usr/sbin/nginx` (not on a non-root user's `$PATH`).
pub fn nginx_binary() -> Option<PathBuf> {
    crate::prometheus::on_path("nginx").or_else(|| {
        let debian = PathBuf::from("/usr/sbin/nginx");
        debian.is_file().then_some(debian)
    })
}

/// A loopback port that was free when asked.
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A running nginx.
pub struct Nginx {
    child: Child,
    dir: PathBuf,
}

impl Nginx {
    /// Writes `dir/nginx.conf` around `http_body` and starts `binary` on it; returns once each of `ports`
    /// accepts connections.
    pub fn start(binary: &Path, http_body: &str, dir: &Path, ports: &[u16]) -> Result<Nginx> {
        for sub in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}", dir.join(sub).display()))?;
        }
        let d = dir.display();
        let config = format!(
            "worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n    access_log {d}/access.log;\n    client_body_temp_path {d}/client_body;\n    \
             proxy_temp_path {d}/proxy;\n    fastcgi_temp_path {d}/fastcgi;\n    uwsgi_temp_path {d}/uwsgi;\n    \
             scgi_temp_path {d}/scgi;\n{http_body}\n}}\n"
        );
        let config_path = dir.join("nginx.conf");
        std::fs::write(&config_path, config).with_context(|| format!("writing {}", config_path.display()))?;
        let child = Command::new(binary)
            .arg("-p")
            .arg(dir)
            .arg("-c")
            .arg(&config_path)
            .arg("-e")
            .arg(dir.join("error.log"))
            .args(["-g", "daemon off; master_process off;"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut nginx = Nginx { child, dir: dir.to_path_buf() };
        let started = Instant::now();
        for &port in ports {
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                if let Some(status) = nginx.child.try_wait()? {
                    bail!("nginx exited ({status}) before listening on {port}:\n{}", nginx.error_log());
                }
                if started.elapsed() > NGINX_STARTUP {
                    bail!("nginx did not listen on {port} within {NGINX_STARTUP:?}:\n{}", nginx.error_log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(nginx)
    }

    /// What nginx logged so far (its error log).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
