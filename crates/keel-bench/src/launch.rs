//! Who this process is in a multi-process run: rank, world size and local
//! rank from Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`), and
//! where rank 0 waits for the others. The environment is passed in as a
//! lookup function; nothing here reads it.

use serde::Serialize;

use crate::BenchError;

/// Ports from here on, one per job step, for rendezvous addresses derived
/// from Slurm (`--rendezvous` overrides).
pub const PORT_BASE: u16 = 29600;
pub const PORT_RANGE: u64 = 2000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Launch {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub job_id: Option<u64>,
    pub step_id: Option<u64>,
    /// The step's (or else the job's) node list, compressed form.
    pub nodelist: Option<String>,
}

impl Launch {
    /// The Slurm task this is, or `None` outside Slurm (no `SLURM_PROCID`
    /// or `SLURM_NTASKS`).
    pub fn from_slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, BenchError> {
        let num = |k: &str| -> Result<Option<u64>, BenchError> {
            match get(k).filter(|v| !v.trim().is_empty()) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| BenchError::Invalid(format!("{k}={v:?} is not a number"))),
            }
        };
        let (Some(rank), Some(world)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) else {
            return Ok(None);
        };
        if world == 0 || rank >= world {
            return Err(BenchError::Invalid(format!(
                "SLURM_PROCID={rank} is not a rank of SLURM_NTASKS={world}"
            )));
        }
        let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
        let nodelist = [
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]
        .iter()
        .find_map(|k| get(k).filter(|v| !v.trim().is_empty()));
        Ok(Some(Launch {
            rank: rank as usize,
            world: world as usize,
            local_rank: local_rank as usize,
            job_id: num("SLURM_JOB_ID")?,
            step_id: num("SLURM_STEP_ID")?,
            nodelist,
        }))
    }

    /// Where rank 0 listens: `explicit` (`--rendezvous HOST:PORT`), else
    /// the first node of the step at a port derived from the job and step
    /// ids (so concurrent steps do not collide).
    pub fn rendezvous(&self, explicit: Option<&str>) -> Result<String, BenchError> {
        if let Some(e) = explicit {
            return validate_endpoint(e).map(|()| e.to_owned());
        }
        let list = self.nodelist.as_deref().ok_or_else(|| {
            BenchError::Invalid(
                "no rendezvous address: Slurm gave no node list (SLURM_STEP_NODELIST); use --rendezvous HOST:PORT"
                    .into(),
            )
        })?;
        let hosts = keel_slurm::expand_hostlist(list).map_err(|e| {
            BenchError::Invalid(format!("cannot read the Slurm node list {list:?}: {e}"))
        })?;
        let first = hosts
            .first()
            .ok_or_else(|| BenchError::Invalid(format!("the Slurm node list {list:?} is empty")))?;
        Ok(format!(
            "{first}:{}",
            default_port(self.job_id.unwrap_or(0), self.step_id.unwrap_or(0))
        ))
    }
}

/// The rendezvous port for a job step.
pub fn default_port(job_id: u64, step_id: u64) -> u16 {
    let slot = (job_id.wrapping_mul(31).wrapping_add(step_id)) % PORT_RANGE;
    PORT_BASE + slot as u16
}

/// `HOST:PORT` with a numeric port and a non-empty host.
pub fn validate_endpoint(e: &str) -> Result<(), BenchError> {
    match e.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(())
        }
        _ => Err(BenchError::Invalid(format!(
            "--rendezvous {e:?} is not HOST:PORT"
        ))),
    }
}

/// Which visible GPU a rank uses: the only one when Slurm bound one GPU
/// per task (`CUDA_VISIBLE_DEVICES` with one entry), else its local rank.
pub fn rank_device(local_rank: usize, device_count: usize) -> Result<usize, BenchError> {
    if device_count == 1 {
        return Ok(0);
    }
    if local_rank < device_count {
        return Ok(local_rank);
    }
    Err(BenchError::Invalid(format!(
        "local rank {local_rank} has no GPU: this node shows {device_count} GPU(s); run at most {device_count} tasks per node or bind one GPU per task (--gpus-per-task=1)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn slurm_task() {
        let l = Launch::from_slurm(&env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_JOB_ID", "1234"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_NODELIST", "gpu[01-08]"),
        ]))
        .expect("valid")
        .expect("under slurm");
        assert_eq!((l.rank, l.world, l.local_rank), (5, 16, 5));
        let port = default_port(1234, 0);
        assert_eq!(port, PORT_BASE + (1234 * 31 % 2000) as u16);
        assert_eq!(l.rendezvous(None).expect("addr"), format!("gpu07:{port}"));
        assert_eq!(
            l.rendezvous(Some("10.0.0.1:5000")).expect("explicit"),
            "10.0.0.1:5000"
        );
        assert_ne!(default_port(1234, 1), port);
    }

    #[test]
    fn outside_slurm_and_bad_values() {
        assert_eq!(Launch::from_slurm(&env(&[])).expect("ok"), None);
        assert_eq!(
            Launch::from_slurm(&env(&[("SLURM_PROCID", "0")])).expect("ok"),
            None
        );
        for (pairs, needle) in [
            (
                vec![("SLURM_PROCID", "x"), ("SLURM_NTASKS", "2")],
                "SLURM_PROCID=\"x\" is not a number",
            ),
            (
                vec![("SLURM_PROCID", "2"), ("SLURM_NTASKS", "2")],
                "not a rank of SLURM_NTASKS=2",
            ),
        ] {
            let e = Launch::from_slurm(&env(&pairs)).expect_err(needle);
            assert!(e.to_string().contains(needle), "{e}");
        }
        let no_nodes = Launch::from_slurm(&env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]))
            .expect("ok")
            .expect("slurm");
        let e = no_nodes.rendezvous(None).expect_err("no list");
        assert!(e.to_string().contains("--rendezvous HOST:PORT"), "{e}");
        for bad in ["host", ":29500", "host:", "host:0", "host:99999"] {
            assert!(validate_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn devices_per_rank() {
        assert_eq!(rank_device(3, 1).expect("bound"), 0);
        assert_eq!(rank_device(3, 8).expect("local"), 3);
        let e = rank_device(8, 8).expect_err("too many");
        assert!(e.to_string().contains("--gpus-per-task=1"), "{e}");
    }
}
