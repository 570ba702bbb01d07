//! Starting the trainer and signalling it: the [`Launcher`] seam. The
//! process launcher starts the command in a process group of its own with
//! both output streams piped, and signals the whole group (srun, torchrun
//! and their workers); tests give the supervisor a launcher of their own.

use std::ffi::OsString;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};

use super::Signal;

/// What to start: the command and the environment it gets beside the
/// supervisor's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The program and its arguments.
    pub command: Vec<String>,
    /// Variables set for the trainer.
    pub env: Vec<(String, OsString)>,
    /// Variables removed from what the trainer inherits.
    pub env_remove: Vec<String>,
}

/// Starts trainers.
pub trait Launcher: Send + Sync {
    /// Starts `launch`; an error means it could not start at all.
    fn launch(&self, launch: &Launch) -> std::io::Result<Box<dyn Trainer>>;
}

/// A started trainer.
pub trait Trainer: Send {
    /// Its standard output, once (what it writes, line by line).
    fn take_stdout(&mut self) -> Option<Box<dyn Read + Send>>;
    /// Its standard error, once.
    fn take_stderr(&mut self) -> Option<Box<dyn Read + Send>>;
    /// How it ended, if it has; `None` while it runs (or when that cannot
    /// be told).
    fn try_wait(&mut self) -> Option<ExitStatus>;
    /// Sends `sig` to it and everything it started.
    fn signal(&self, sig: Signal);
    /// Waits for it to end.
    fn wait(&mut self) -> Option<ExitStatus>;
}

/// Starts the command as a process in a process group of its own.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessLauncher;

impl Launcher for ProcessLauncher {
    fn launch(&self, launch: &Launch) -> std::io::Result<Box<dyn Trainer>> {
        let Some((program, args)) = launch.command.split_first() else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "no command",
            ));
        };
        let mut cmd = Command::new(program);
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for k in &launch.env_remove {
            cmd.env_remove(k);
        }
        for (k, v) in &launch.env {
            cmd.env(k, v);
        }
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        Ok(Box::new(Process(cmd.spawn()?)))
    }
}

struct Process(Child);

impl Trainer for Process {
    fn take_stdout(&mut self) -> Option<Box<dyn Read + Send>> {
        self.0
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>)
    }

    fn take_stderr(&mut self) -> Option<Box<dyn Read + Send>> {
        self.0
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>)
    }

    fn try_wait(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().ok().flatten()
    }

    fn signal(&self, sig: Signal) {
        // The child leads its process group (started with process_group(0)).
        if let Some(pgid) = i32::try_from(self.0.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(pgid, sig);
        }
    }

    fn wait(&mut self) -> Option<ExitStatus> {
        self.0.wait().ok()
    }
}
