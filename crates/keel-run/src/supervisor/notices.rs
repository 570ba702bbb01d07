//! Eviction notices, each polled on a thread of its own: Azure's
//! Scheduled Events, AWS's Spot notice and GCP's preemption flag. A
//! failure there is said once and never ends training.

use super::*;

/// Asks `notice` every `every` until it names an eviction or the
/// supervisor goes away; an error is logged once (`what`) and never ends
/// training.
pub(super) fn poll_notice(
    sh: &Shell,
    what: &str,
    every: Duration,
    tx: &mpsc::Sender<Note>,
    mut notice: impl FnMut() -> Result<Option<Note>, crate::events::EventsError>,
) {
    let mut failing = false;
    loop {
        match notice() {
            Ok(Some(evict)) => {
                let _ = tx.send(evict);
                return;
            }
            Ok(None) => failing = false,
            Err(e) => {
                if !failing {
                    sh.say(&format!("{what}: {e}; training continues"));
                    failing = true;
                }
            }
        }
        sh.sleep(every);
        if tx.send(Note::Tick).is_err() {
            return;
        }
    }
}

/// AWS's Spot interruption notice, asked every 2 s.
pub(super) fn poll_aws(sh: &Shell, imds: &Imds, tx: &mpsc::Sender<Note>) {
    poll_notice(sh, "AWS Spot notice", Duration::from_secs(2), tx, || {
        Ok(imds.aws_instance_action()?.map(|n| Note::Evict {
            resources: Vec::new(),
            job_vms: Vec::new(),
            id: format!("aws-spot-{}", n.action),
            kind: format!("AWS Spot {}", n.action),
            notice: n
                .time
                .and_then(|t| t.duration_since(sh.now()).ok())
                .unwrap_or(Duration::ZERO),
        }))
    });
}

/// GCP's preemption flag, asked every second. GCP powers the VM off 30 s
/// after it is set.
pub(super) fn poll_gcp(sh: &Shell, md: &Imds, tx: &mpsc::Sender<Note>) {
    poll_notice(
        sh,
        "GCP preemption flag",
        Duration::from_secs(1),
        tx,
        || {
            Ok(md.gcp_preempted()?.then(|| Note::Evict {
                resources: Vec::new(),
                job_vms: Vec::new(),
                id: "gcp-preempted".to_owned(),
                kind: "GCP preemption".to_owned(),
                notice: Duration::from_secs(30),
            }))
        },
    );
}

/// Polls Scheduled Events once a second until the supervisor goes away.
pub(super) fn poll_imds(
    sh: &Shell,
    imds: Imds,
    vm: Option<String>,
    others: Vec<String>,
    tx: mpsc::Sender<Note>,
) {
    let mut warned = false;
    let vm = loop {
        match vm.clone().map(Ok).unwrap_or_else(|| imds.vm_name()) {
            Ok(v) => break v,
            Err(e) => {
                if !warned {
                    sh.say(&format!(
                        "Scheduled Events: cannot learn this VM's name: {e}; retrying"
                    ));
                    warned = true;
                }
                sh.sleep(Duration::from_secs(1));
            }
        }
    };
    let mut job_vms = others;
    if !job_vms.iter().any(|v| v.eq_ignore_ascii_case(&vm)) {
        job_vms.push(vm.clone());
    }
    let mut poller = Poller::new(imds, &job_vms);
    let mut failing = false;
    loop {
        match poller.poll() {
            Ok(events) => {
                if failing {
                    sh.say("Scheduled Events: IMDS answers again");
                    failing = false;
                }
                for e in events {
                    if e.kind.ends_training() {
                        let note = Note::Evict {
                            resources: e.resources.clone(),
                            job_vms: job_vms.clone(),
                            id: e.id.clone(),
                            kind: e.kind.as_str().to_owned(),
                            notice: e.notice(sh.now()),
                        };
                        if tx.send(note).is_err() {
                            return;
                        }
                    } else {
                        sh.say(&format!(
                            "scheduled event {} ({}) for this VM: training continues",
                            e.kind.as_str(),
                            e.id
                        ));
                    }
                }
            }
            Err(e) => {
                if !failing {
                    sh.say(&format!("Scheduled Events: {e}; training continues"));
                    failing = true;
                }
            }
        }
        sh.sleep(Duration::from_secs(1));
        // The supervisor is gone when nobody listens.
        if tx.send(Note::Tick).is_err() {
            return;
        }
    }
}
