//! How many jobs upgrade at once (`--max-concurrent-upgrades`). An
//! upgrade takes a savepoint, stops the pods and restores new ones: done
//! by every job at one moment (a new default worker image after a `helm
//! upgrade` of the operator, or one `kubectl apply` of many manifests) it
//! loads the checkpoint store, the nodes and the sinks all at once. A job
//! whose spec changed while the limit is taken keeps running its previous
//! spec and says so (Ready False, reason `UpgradeQueued`) until a slot is
//! free; the limit counts this operator's jobs, from its cache of them and
//! its own latest decisions, which the cache may not show yet.

use weir_api::streamjob::{Phase, StreamJobStatus};

/// What one reconcile knows of the other jobs' upgrades.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpgradeSlots {
    /// Other jobs whose upgrade is in flight ([`in_flight`]).
    pub taken: usize,
    /// At most this many at once; `None`: no limit.
    pub limit: Option<usize>,
}

impl UpgradeSlots {
    /// Why an upgrade must wait for a slot, when it must.
    pub fn wait_reason(&self) -> Option<String> {
        let limit = self.limit?;
        let jobs = if self.taken == 1 { "job is" } else { "jobs are" };
        (self.taken >= limit).then(|| format!("{} other {jobs} upgrading, and at most {limit} upgrade at once (--max-concurrent-upgrades)", self.taken))
    }
}

/// The slots job `uid` sees among `jobs` (the operator's cache of them):
/// another job's upgrade is in flight by this operator's latest decision
/// for it (`decided`, by uid), else by its status in the cache.
pub fn count(uid: &str, jobs: &[std::sync::Arc<weir_api::streamjob::StreamJob>], decided: &std::collections::HashMap<String, bool>, limit: usize) -> UpgradeSlots {
    let taken = jobs
        .iter()
        .filter_map(|j| j.metadata.uid.as_deref().filter(|u| *u != uid).map(|u| (u, j)))
        .filter(|(u, j)| decided.get(*u).copied().unwrap_or_else(|| j.status.as_ref().is_some_and(in_flight)))
        .count();
    UpgradeSlots { taken, limit: Some(limit) }
}

/// Whether `status` shows an upgrade in flight: from its savepoint (or
/// rollback) until the new spec runs. A job's first deployment is not an
/// upgrade: nothing of it ran before.
pub fn in_flight(status: &StreamJobStatus) -> bool {
    match status.phase {
        Some(Phase::Upgrading | Phase::RollingBack) => true,
        Some(Phase::Deploying) => {
            status.deployed_spec_hash.is_some() && status.run.as_ref().is_some_and(|r| status.deployed_spec_hash.as_deref() != Some(r.spec_hash.as_str()))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_api::streamjob::RunStatus;

    fn status(phase: Phase, deployed: Option<&str>, run: &str) -> StreamJobStatus {
        let started = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::from_second(1_800_000_000).unwrap());
        StreamJobStatus {
            phase: Some(phase),
            deployed_spec_hash: deployed.map(String::from),
            run: Some(RunStatus::decided("r-1".into(), 1, run.into(), 1, started)),
            ..Default::default()
        }
    }

    #[test]
    fn an_upgrade_is_in_flight_from_its_savepoint_until_the_new_spec_runs_and_a_first_deployment_is_none() {
        assert!(in_flight(&status(Phase::Upgrading, Some("a"), "a")));
        assert!(in_flight(&status(Phase::RollingBack, Some("b"), "a")));
        assert!(in_flight(&status(Phase::Deploying, Some("a"), "b")), "the new spec's pods are starting");
        assert!(!in_flight(&status(Phase::Deploying, None, "a")), "a first deployment");
        assert!(!in_flight(&status(Phase::Deploying, Some("a"), "a")), "a recovery of the deployed spec");
        assert!(!in_flight(&status(Phase::Running, Some("b"), "b")));
        assert!(!in_flight(&status(Phase::Recovering, Some("a"), "a")));
    }

    #[test]
    fn the_count_takes_this_operators_latest_decision_over_the_cache_and_never_counts_the_job_itself() {
        let job = |uid: &str, st: StreamJobStatus| {
            let mut j = crate::testing::JobBuilder::new(uid).status(st).build();
            j.metadata.uid = Some(uid.into());
            std::sync::Arc::new(j)
        };
        let jobs = vec![
            job("a", status(Phase::Upgrading, Some("a"), "a")),
            job("b", status(Phase::Running, Some("b"), "b")),
            job("c", status(Phase::Deploying, Some("c"), "c2")),
            job("me", status(Phase::Upgrading, Some("m"), "m")),
        ];
        let none = std::collections::HashMap::new();
        assert_eq!(count("me", &jobs, &none, 2), UpgradeSlots { taken: 2, limit: Some(2) }, "a and c, by the cache");
        // The cache has not seen a's finished upgrade nor b's new one yet.
        let decided: std::collections::HashMap<String, bool> = [("a".to_string(), false), ("b".to_string(), true)].into();
        assert_eq!(count("me", &jobs, &decided, 2).taken, 2, "b and c");
        assert_eq!(count("b", &jobs, &decided, 2).taken, 2, "a's decision is newer than the cache; me counts");
    }

    #[test]
    fn an_upgrade_waits_only_while_the_limit_is_taken() {
        assert_eq!(UpgradeSlots { taken: 5, limit: None }.wait_reason(), None, "no limit");
        assert_eq!(UpgradeSlots { taken: 1, limit: Some(2) }.wait_reason(), None);
        let why = UpgradeSlots { taken: 2, limit: Some(2) }.wait_reason().expect("taken");
        assert!(why.contains("2 other jobs are upgrading") && why.contains("--max-concurrent-upgrades"), "{why}");
    }
}
