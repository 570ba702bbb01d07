//! Running one command with a deadline, std only: spawn, poll `try_wait`,
//! kill on timeout. Standard output and error are read by two threads so a
//! chatty child never blocks on a full pipe.

use std::ffi::OsString;
use std::io::{self, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::SlurmError;

/// The most bytes kept of one stream; the rest is read and dropped.
const OUTPUT_LIMIT: u64 = 4 << 20;
/// Polling starts fast (scontrol usually answers in a few milliseconds)
/// and backs off to this.
const MAX_POLL: Duration = Duration::from_millis(50);
/// How long to wait for the pipes to close once the child has exited.
const PIPE_GRACE: Duration = Duration::from_millis(500);

/// What a finished command printed.
#[derive(Debug)]
pub(crate) struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `program args` with `env` added to the inherited environment and
/// stdin closed. Returns once the child exits, or kills it after
/// `deadline` and returns [`SlurmError::Timeout`] (`timeout` is what the
/// error reports).
pub(crate) fn run(
    program: &Path,
    args: &[String],
    env: &[(OsString, OsString)],
    deadline: Instant,
    timeout: Duration,
) -> Result<Output, SlurmError> {
    let command = display(program, args);
    let timed_out = || SlurmError::Timeout {
        command: command.clone(),
        seconds: timeout.as_secs_f64(),
    };
    let mut child = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| {
            if source.kind() == io::ErrorKind::NotFound {
                SlurmError::NotInstalled {
                    program: program.to_owned(),
                }
            } else {
                SlurmError::Io {
                    program: program.to_owned(),
                    source,
                }
            }
        })?;
    let io_error = |child: &mut Child, source: io::Error| {
        kill(child);
        SlurmError::Io {
            program: program.to_owned(),
            source,
        }
    };
    let stdout = match collect(child.stdout.take()) {
        Ok(rx) => rx,
        Err(source) => return Err(io_error(&mut child, source)),
    };
    let stderr = match collect(child.stderr.take()) {
        Ok(rx) => rx,
        Err(source) => return Err(io_error(&mut child, source)),
    };

    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(source) => return Err(io_error(&mut child, source)),
        }
        let now = Instant::now();
        if now >= deadline {
            kill(&mut child);
            return Err(timed_out());
        }
        thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(MAX_POLL);
    };

    // The pipes close when the child exits, unless it left a grandchild
    // holding them: then give up at the deadline like for a hung child.
    let pipe_deadline = deadline.max(Instant::now() + PIPE_GRACE);
    let receive = |rx: mpsc::Receiver<Vec<u8>>| {
        let left = pipe_deadline.saturating_duration_since(Instant::now());
        rx.recv_timeout(left)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .map_err(|_| timed_out())
    };
    let stdout = receive(stdout)?;
    let stderr = receive(stderr)?;
    Ok(Output {
        status,
        stdout,
        stderr,
    })
}

/// Kills and reaps the child; both may fail only if it already exited.
fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Reads a pipe to its end on a thread; the bytes arrive on the channel.
fn collect<R: Read + Send + 'static>(pipe: Option<R>) -> io::Result<mpsc::Receiver<Vec<u8>>> {
    let (tx, rx) = mpsc::channel();
    match pipe {
        None => {
            let _ = tx.send(Vec::new());
        }
        Some(pipe) => {
            thread::Builder::new()
                .name("keel-slurm-pipe".into())
                .spawn(move || {
                    let mut kept = Vec::new();
                    let mut limited = pipe.take(OUTPUT_LIMIT);
                    let _ = limited.read_to_end(&mut kept);
                    let _ = io::copy(&mut limited.into_inner(), &mut io::sink());
                    let _ = tx.send(kept);
                })?;
        }
    }
    Ok(rx)
}

/// The command as a person would type it, for error messages.
pub(crate) fn display(program: &Path, args: &[String]) -> String {
    let name = program
        .file_name()
        .map_or_else(|| program.to_string_lossy(), |n| n.to_string_lossy());
    let mut line = name.into_owned();
    for arg in args {
        line.push(' ');
        let plain = !arg.is_empty()
            && arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_=.,:/%[]@+".contains(c));
        if plain {
            line.push_str(arg);
        } else {
            line.push('\'');
            line.push_str(&arg.replace('\'', r"'\''"));
            line.push('\'');
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn run_for(program: &str, list: &[&str], timeout: Duration) -> Result<Output, SlurmError> {
        run(
            Path::new(program),
            &args(list),
            &[("KEEL_SLURM_TEST".into(), "passed".into())],
            Instant::now() + timeout,
            timeout,
        )
    }

    #[test]
    fn collects_output_status_and_environment() {
        let out = run_for(
            "sh",
            &["-c", "echo out $KEEL_SLURM_TEST; echo err >&2; exit 3"],
            Duration::from_secs(10),
        )
        .expect("sh runs");
        assert_eq!(out.stdout, "out passed\n");
        assert_eq!(out.stderr, "err\n");
        assert_eq!(out.status.code(), Some(3));
    }

    #[test]
    fn kills_a_child_that_runs_past_the_timeout() {
        let started = Instant::now();
        let err = run_for("sleep", &["30"], Duration::from_millis(300)).expect_err("times out");
        assert!(started.elapsed() < Duration::from_secs(5));
        match err {
            SlurmError::Timeout { command, seconds } => {
                assert_eq!(command, "sleep 30");
                assert!((seconds - 0.3).abs() < 1e-9);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn large_output_does_not_block_the_child() {
        let out = run_for(
            "sh",
            &["-c", "head -c 300000 /dev/zero | tr '\\0' x"],
            Duration::from_secs(20),
        )
        .expect("sh runs");
        assert_eq!(out.stdout.len(), 300_000);
    }

    #[test]
    fn a_missing_program_is_not_installed() {
        let err = run_for(
            "/nonexistent/keel/scontrol",
            &["ping"],
            Duration::from_secs(1),
        )
        .expect_err("missing");
        assert!(
            matches!(&err, SlurmError::NotInstalled { program } if program == Path::new("/nonexistent/keel/scontrol")),
            "{err:?}"
        );
    }

    #[test]
    fn display_quotes_what_a_shell_would_split() {
        assert_eq!(
            display(
                Path::new("/usr/bin/scontrol"),
                &args(&["update", "NodeName=n1", "Reason=keel: gpu: it's hot"])
            ),
            r"scontrol update NodeName=n1 'Reason=keel: gpu: it'\''s hot'"
        );
    }
}
