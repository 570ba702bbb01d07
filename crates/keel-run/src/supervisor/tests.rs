//! The supervisor's decisions over a fake trainer (a thread that writes to
//! pipes and answers signals as a script says), a checkpoint store in a
//! temporary directory, injected stop signals and a console that records.
//! The process and Slurm scenarios run end to end in the `keel` crate's
//! `run_local`, `run_slurm` and `run_slurm_torch` tests.

use std::io::Write as _;
use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;
use std::sync::Condvar;

use super::*;
use crate::{Cause, Timeout};

/// Lines said, and the trainer's output, in order.
#[derive(Default)]
struct Recorder {
    said: Mutex<Vec<String>>,
}

impl Console for Recorder {
    fn say(&self, msg: &str) {
        self.said.lock().expect("lock").push(msg.to_owned());
    }
    fn trainer_stdout(&self, _line: &[u8]) {}
    fn trainer_stderr(&self, _line: &[u8]) {}
}

/// What the fake trainer and the test share.
#[derive(Default)]
struct Shared {
    signals: Mutex<Vec<Signal>>,
    exit: Mutex<Option<ExitStatus>>,
    changed: Condvar,
    launched: Mutex<Option<Launch>>,
}

impl Shared {
    fn signals(&self) -> Vec<Signal> {
        self.signals.lock().expect("lock").clone()
    }

    /// Waits (at most 10 s) until `sig` has been sent.
    fn wait_signal(&self, sig: Signal) -> bool {
        let g = self.signals.lock().expect("lock");
        let (g, _) = self
            .changed
            .wait_timeout_while(g, Duration::from_secs(10), |s| !s.contains(&sig))
            .expect("test setup");
        g.contains(&sig)
    }

    fn end(&self, status: ExitStatus) {
        let mut e = self.exit.lock().expect("lock");
        e.get_or_insert(status);
    }
}

/// The trainer's side: its output and what it was started with.
struct Ctl {
    shared: Arc<Shared>,
    stdout: std::io::PipeWriter,
    ckpt_dir: PathBuf,
}

impl Ctl {
    fn line(&mut self, s: &str) {
        let _ = writeln!(self.stdout, "{s}");
    }

    /// Writes a complete PyTorch DCP-shaped checkpoint of `step`.
    fn save(&self, step: u64) {
        let d = self.ckpt_dir.join(format!("step_{step}"));
        std::fs::create_dir_all(&d).expect("test setup");
        std::fs::write(d.join("__0_0.distcp"), format!("step {step}")).expect("test setup");
        std::fs::write(d.join(".metadata"), "dcp").expect("test setup");
    }
}

type Script = Arc<dyn Fn(&mut Ctl) -> i32 + Send + Sync>;

/// Starts a thread that runs `script`; its return value is the exit code.
/// SIGKILL ends the fake at once; other signals are only recorded (the
/// script looks at them).
struct FakeLauncher {
    shared: Arc<Shared>,
    script: Script,
}

impl Launcher for FakeLauncher {
    fn launch(&self, launch: &Launch) -> std::io::Result<Box<dyn Trainer>> {
        *self.shared.launched.lock().expect("lock") = Some(launch.clone());
        let env = |k: &str| {
            launch
                .env
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| PathBuf::from(v))
        };
        let (out_r, out_w) = std::io::pipe()?;
        let (err_r, _err_w) = std::io::pipe()?;
        let mut ctl = Ctl {
            shared: self.shared.clone(),
            stdout: out_w,
            ckpt_dir: env("KEEL_CKPT_DIR").expect("KEEL_CKPT_DIR"),
        };
        let script = self.script.clone();
        let shared = self.shared.clone();
        std::thread::spawn(move || {
            let code = script(&mut ctl);
            drop(ctl);
            shared.end(ExitStatus::from_raw(code << 8));
        });
        Ok(Box::new(Fake {
            shared: self.shared.clone(),
            stdout: Some(Box::new(out_r)),
            stderr: Some(Box::new(err_r)),
        }))
    }
}

struct Fake {
    shared: Arc<Shared>,
    stdout: Option<Box<dyn std::io::Read + Send>>,
    stderr: Option<Box<dyn std::io::Read + Send>>,
}

impl Trainer for Fake {
    fn take_stdout(&mut self) -> Option<Box<dyn std::io::Read + Send>> {
        self.stdout.take()
    }
    fn take_stderr(&mut self) -> Option<Box<dyn std::io::Read + Send>> {
        self.stderr.take()
    }
    fn try_wait(&mut self) -> Option<ExitStatus> {
        *self.shared.exit.lock().expect("lock")
    }
    fn signal(&self, sig: Signal) {
        self.shared.signals.lock().expect("lock").push(sig);
        if sig == Signal::KILL {
            self.shared.end(ExitStatus::from_raw(9));
        }
        self.shared.changed.notify_all();
    }
    fn wait(&mut self) -> Option<ExitStatus> {
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

struct Bed {
    dir: tempfile::TempDir,
    shared: Arc<Shared>,
    console: Arc<Recorder>,
}

impl Bed {
    fn new() -> Self {
        Bed {
            dir: tempfile::tempdir().expect("test setup"),
            shared: Arc::default(),
            console: Arc::default(),
        }
    }

    fn plan(&self) -> Plan {
        let store_root = self.dir.path().join("store");
        let url = keel_store::StoreUrl::parse(&format!("file://{}", store_root.display()))
            .expect("test setup");
        let store = keel_store::Store::open(
            &url,
            &keel_store::StoreOptions {
                create_root: true,
                ..Default::default()
            },
        )
        .expect("test setup");
        let ckpt_dir = self.dir.path().join("ckpt");
        Plan {
            store,
            run: "r".into(),
            restore_dir: ckpt_dir.join(".keel-resume"),
            state: self.dir.path().join("keel-run.json"),
            request_file: ckpt_dir.join(REQUEST_FILE),
            ckpt_dir,
            marker: None,
            heartbeat_file: None,
            heartbeat_dir: None,
            heartbeat_pattern: Some("step".into()),
            hang: HangConfig {
                startup: Duration::from_secs(5),
                timeout: Timeout::Fixed(Duration::from_secs(5)),
                save: Duration::from_secs(5),
            },
            grace: Duration::from_secs(5),
            checkpoint_signal: Some(Signal::USR1),
            checkpoint_deadline: Duration::from_secs(10),
            stop_reserve: Duration::ZERO,
            watch_interval: Duration::from_millis(50),
            imds: None,
            aws_imds: None,
            gcp_metadata: None,
            vm_name: None,
            job_vms: Vec::new(),
            imds_ack: false,
            job: "local".into(),
            slurm_job: None,
            host: "test-host".into(),
            policy: RunPolicy::default(),
            command: vec!["trainer".into()],
            slurm: None,
            metrics_listen: None,
            metrics_token: None,
        }
    }

    fn supervisor(&self, script: Script) -> Supervisor {
        Supervisor::new(self.console.clone(), Arc::new(keel_time::SystemClock)).with_launcher(
            Box::new(FakeLauncher {
                shared: self.shared.clone(),
                script,
            }),
        )
    }

    fn history(&self, plan: &Plan) -> crate::JobHistory {
        History::load(&plan.state)
            .expect("test setup")
            .job(&plan.job)
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("test setup")
}

#[test]
fn a_trainer_that_completes_is_done_and_gets_the_checkpoint_environment() {
    let bed = Bed::new();
    let plan = bed.plan();
    let sup = bed.supervisor(Arc::new(|ctl: &mut Ctl| {
        for i in 1..=3 {
            ctl.line(&format!("step {i}"));
        }
        ctl.save(3);
        0
    }));
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert_eq!(c.ending, Ending::Done, "{c:?}");
    assert_eq!(c.outcome, Ended::Completed);
    assert_eq!(c.commits, 1, "the last pass pushes what it wrote");
    let launched = bed
        .shared
        .launched
        .lock()
        .expect("lock")
        .clone()
        .expect("test setup");
    let names: Vec<&str> = launched.env.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["KEEL_CKPT_DIR", "KEEL_CKPT_REQUEST"]);
    assert_eq!(launched.env_remove, ["KEEL_RESUME_DIR", "KEEL_RESUME_STEP"]);
    let h = bed.history(&plan);
    assert_eq!(h.attempts.len(), 1);
    assert!(h.failures.is_empty());

    // The next attempt resumes from the committed step.
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert_eq!(c.resumed_from_step, Some(3));
    let launched = bed
        .shared
        .launched
        .lock()
        .expect("lock")
        .clone()
        .expect("test setup");
    assert!(launched
        .env
        .iter()
        .any(|(k, v)| k == "KEEL_RESUME_STEP" && v == "3"));
}

#[test]
fn a_crash_is_recorded_against_this_host_for_a_requeue() {
    let bed = Bed::new();
    let plan = bed.plan();
    let sup = bed.supervisor(Arc::new(|ctl: &mut Ctl| {
        ctl.line("step 1");
        1
    }));
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert_eq!(c.ending, Ending::Failed, "{c:?}");
    assert!(c.result.contains("exit code 1"), "{}", c.result);
    let h = bed.history(&plan);
    assert_eq!(h.failures.len(), 1);
    assert_eq!(h.failures[0].node, "test-host");
    assert_eq!(h.failures[0].cause, Cause::Crash);
    assert!(
        bed.shared.signals().is_empty(),
        "an exited trainer is not signalled"
    );
}

#[test]
fn a_stop_signal_asks_for_a_checkpoint_and_stops_after_its_commit() {
    let bed = Bed::new();
    let plan = bed.plan();
    let request = plan.request_file.clone();
    let sup = bed.supervisor(Arc::new(move |ctl: &mut Ctl| {
        let mut step = 0;
        loop {
            step += 1;
            ctl.line(&format!("step {step}"));
            let signals = ctl.shared.signals();
            if signals.contains(&Signal::TERM) {
                return 128 + 15;
            }
            if signals.contains(&Signal::USR1) && !ctl.ckpt_dir.join("step_100").exists() {
                // Asked through the request file too, which names why.
                let why = std::fs::read_to_string(&request).expect("test setup");
                assert!(why.ends_with("SIGTERM\n"), "{why}");
                ctl.save(100);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }));
    let (tx, rx) = mpsc::channel();
    let sup = sup.with_signals(rx);
    tx.send(StopSignal::Term).expect("test setup");
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert_eq!(c.ending, Ending::Requeue, "{c:?}");
    assert_eq!(c.outcome, Ended::Preempted);
    assert_eq!(c.commits, 1);
    assert_eq!(bed.shared.signals(), [Signal::USR1, Signal::TERM]);
    let said = bed.console.said.lock().expect("lock").join("\n");
    assert!(
        said.contains("the checkpoint is committed; stopping the trainer"),
        "{said}"
    );
}

#[test]
fn a_silent_trainer_is_stopped_as_hung_and_one_ignoring_sigterm_is_killed() {
    let bed = Bed::new();
    let mut plan = bed.plan();
    plan.hang.startup = Duration::from_millis(300);
    plan.grace = Duration::from_millis(300);
    let shared = bed.shared.clone();
    // Says nothing, and ignores SIGTERM.
    let sup = bed.supervisor(Arc::new(move |_ctl: &mut Ctl| {
        shared.wait_signal(Signal::KILL);
        0
    }));
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert_eq!(c.outcome, Ended::Failed, "{c:?}");
    assert_eq!(bed.shared.signals(), [Signal::TERM, Signal::KILL]);
    let h = bed.history(&plan);
    assert_eq!(h.failures[0].cause, Cause::Hang);
    assert_eq!(h.startup_failures, 1, "it never sent a heartbeat");
    let said = bed.console.said.lock().expect("lock").join("\n");
    assert!(said.contains("the trainer is hung"), "{said}");
    assert!(said.contains("ignored SIGTERM; sending SIGKILL"), "{said}");
}

#[test]
fn a_trainer_that_cannot_start_is_a_usage_error_and_nothing_is_recorded() {
    struct Refuses;
    impl Launcher for Refuses {
        fn launch(&self, _: &Launch) -> std::io::Result<Box<dyn Trainer>> {
            Err(std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }
    let bed = Bed::new();
    let plan = bed.plan();
    let sup = Supervisor::new(bed.console.clone(), Arc::new(keel_time::SystemClock))
        .with_launcher(Box::new(Refuses));
    let e = rt().block_on(sup.run(&plan)).expect_err("an error");
    assert!(
        matches!(&e, SuperviseError::Usage(m) if m.contains("cannot start the trainer \"trainer\"")),
        "{e}"
    );
    assert!(!plan.state.exists());
}

#[test]
fn production_sized_waits_pass_on_the_injected_monotonic_clock() {
    // A trainer that ignores the checkpoint request and SIGTERM, with a
    // 2-minute checkpoint deadline and a 1-minute grace: the supervisor
    // waits both out on a stepped clock, in a fraction of their length.
    let bed = Bed::new();
    let mut plan = bed.plan();
    plan.hang.startup = Duration::from_secs(3600);
    plan.checkpoint_deadline = Duration::from_secs(120);
    plan.grace = Duration::from_secs(60);
    let shared = bed.shared.clone();
    let sup = bed.supervisor(Arc::new(move |_ctl: &mut Ctl| {
        shared.wait_signal(Signal::KILL);
        0
    }));
    let mono = Arc::new(keel_time::SteppedClock::default());
    let (tx, rx) = mpsc::channel();
    let sup = sup.with_signals(rx).with_monotonic(mono.clone());
    tx.send(StopSignal::Usr2).expect("test setup");
    let real = std::time::Instant::now();
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert!(
        real.elapsed() < Duration::from_secs(30),
        "{:?}",
        real.elapsed()
    );
    assert_eq!(c.outcome, Ended::Preempted, "{c:?}");
    assert_eq!(c.commits, 0);
    assert_eq!(
        bed.shared.signals(),
        [Signal::USR1, Signal::TERM, Signal::KILL]
    );
    let waited = mono.elapsed();
    assert!(
        waited >= Duration::from_secs(180) && waited < Duration::from_secs(3600),
        "the deadline and the grace, not the start-up timeout: {waited:?}"
    );
    let said = bed.console.said.lock().expect("lock").join("\n");
    assert!(
        said.contains("no checkpoint was committed before the deadline"),
        "{said}"
    );
    assert!(said.contains("ignored SIGTERM; sending SIGKILL"), "{said}");
}

#[test]
fn the_start_up_timeout_is_measured_on_the_injected_monotonic_clock() {
    let bed = Bed::new();
    let mut plan = bed.plan();
    plan.hang.startup = Duration::from_secs(120);
    plan.grace = Duration::from_secs(30);
    let shared = bed.shared.clone();
    let sup = bed.supervisor(Arc::new(move |_ctl: &mut Ctl| {
        shared.wait_signal(Signal::KILL);
        0
    }));
    let mono = Arc::new(keel_time::SteppedClock::default());
    let sup = sup.with_monotonic(mono.clone());
    let real = std::time::Instant::now();
    let c = rt().block_on(sup.run(&plan)).expect("an attempt");
    assert!(
        real.elapsed() < Duration::from_secs(30),
        "{:?}",
        real.elapsed()
    );
    assert_eq!(c.outcome, Ended::Failed, "{c:?}");
    assert_eq!(bed.history(&plan).failures[0].cause, Cause::Hang);
    let waited = mono.elapsed();
    assert!(
        waited >= Duration::from_secs(150) && waited < Duration::from_secs(300),
        "{waited:?}"
    );
}
