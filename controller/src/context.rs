//! What every reconcile shares: the API client, the workers' client, the
//! event recorder, metrics and settings.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use weir_api::streamjob::StreamJob;

use crate::control_key::ControlKey;
use crate::desired::WorkerSettings;
use crate::metrics::Metrics;
use crate::observe::{DisposalOutcome, Rejection};
use crate::pod_cache::PodCache;
use crate::worker_api::WorkerApi;

pub struct Context {
    pub client: Client,
    pub workers: Arc<dyn WorkerApi>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub settings: WorkerSettings,
    /// The key every job's control token is derived from.
    pub control_key: ControlKey,
    /// By StreamJob uid: the resourceVersion this operator last read and then
    /// changed (finalizer or status), and the one its write produced. A
    /// reconcile that gets a version before the write decides on an object
    /// older than the operator's own write (see [`crate::reconcile`]).
    pub superseded: Mutex<HashMap<String, Superseded>>,
    /// The pods the operator watches (those with the job label), fed by the
    /// same watch that triggers reconciles; `None`: list them every time.
    pub pods: Option<Arc<PodCache>>,
    /// By StreamJob uid: the API server refused the objects of the job's
    /// run the last time they were created. Reported by the next reconcile
    /// (status and an event); kept in memory only, so an operator restarted
    /// in between sees missing pods instead (one restart of the job).
    pub rejections: Mutex<HashMap<String, Rejection>>,
    /// How many jobs may upgrade at once (`--max-concurrent-upgrades`), with
    /// the operator's cache of its jobs to count them in.
    pub upgrade_limit: Option<(usize, Store<StreamJob>)>,
    /// By StreamJob uid: whether the job's upgrade is in flight by this
    /// operator's latest decisions; newer than the cache until the job's
    /// status write comes back through the watch. A slot is taken when an
    /// upgrade is decided and freed only once the status that ends it is
    /// written ([`Context::status_written`]).
    pub upgrades_decided: Mutex<HashMap<String, bool>>,
    /// By StreamJob uid: savepoint disposals carried out (location, outcome)
    /// until a written status no longer lists the savepoint. In memory only:
    /// an operator restarted in between asks again, and the coordinator
    /// answers a savepoint already gone as done.
    pub disposals: Mutex<HashMap<String, Vec<(String, DisposalOutcome)>>>,
}

/// A StreamJob version this operator replaced by its own write.
#[derive(Debug, Clone, PartialEq)]
pub struct Superseded {
    /// The version the operator read.
    pub read: String,
    /// The version its write produced.
    pub written: String,
}

impl Context {
    pub fn new(client: Client, workers: Arc<dyn WorkerApi>, metrics: Arc<Metrics>, settings: WorkerSettings, instance: Option<String>) -> Context {
        let reporter = Reporter { controller: crate::FIELD_MANAGER.into(), instance };
        Context { recorder: Recorder::new(client.clone(), reporter), client, workers, metrics, settings, control_key: ControlKey::random(), superseded: Mutex::new(HashMap::new()), pods: None, rejections: Mutex::new(HashMap::new()), upgrade_limit: None, upgrades_decided: Mutex::new(HashMap::new()), disposals: Mutex::new(HashMap::new()) }
    }

    /// Derive job tokens from `key` (the operator's, from its Secret), and
    /// name their Secrets after it; a new context has a random key of its
    /// own and unnamed token Secrets.
    pub fn with_control_key(mut self, key: ControlKey) -> Context {
        self.settings.control_key_id = Some(key.id());
        self.control_key = key;
        self
    }

    /// At most `limit` jobs of `jobs` upgrade at once.
    pub fn with_upgrade_limit(mut self, limit: usize, jobs: Store<StreamJob>) -> Context {
        self.upgrade_limit = Some((limit, jobs));
        self
    }

    /// Decides `job` with the other jobs' upgrades in flight counted, and
    /// records it when the decision puts its own in flight. Counting and
    /// recording hold one lock, so that two jobs decided at once cannot
    /// both take the last slot. A decision that ends an upgrade frees the
    /// slot only once its status is written: freed before, another job's
    /// upgrade could start while the API still shows this one's, and
    /// anyone counting there would see one upgrade more than the limit.
    pub fn decide(&self, job: &StreamJob, observed: &mut crate::observe::Observed) -> crate::lifecycle::Decision {
        let Some((limit, jobs)) = &self.upgrade_limit else { return crate::lifecycle::decide(job, observed, &self.settings) };
        let uid = job.uid().unwrap_or_default();
        let mut decided = self.upgrades_decided.lock().unwrap_or_else(|e| e.into_inner());
        observed.upgrades = crate::lifecycle::upgrade_slots(&uid, &jobs.state(), &decided, *limit);
        let decision = crate::lifecycle::decide(job, observed, &self.settings);
        if crate::lifecycle::upgrade_in_flight(&decision.status) {
            decided.insert(uid, true);
        }
        decision
    }

    /// Records that the API holds `status` for `job`: whether its upgrade
    /// is in flight is now what anyone reading the API sees.
    pub fn status_written(&self, job: &StreamJob, status: &weir_api::streamjob::StreamJobStatus) {
        let uid = job.uid().unwrap_or_default();
        // A disposal is forgotten once the status no longer lists its savepoint.
        if let Some(done) = self.disposals.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&uid) {
            done.retain(|(path, _)| status.savepoint_history.iter().any(|s| &s.path == path));
        }
        if self.upgrade_limit.is_none() {
            return;
        }
        self.upgrades_decided.lock().unwrap_or_else(|e| e.into_inner()).insert(uid, crate::lifecycle::upgrade_in_flight(status));
    }

    /// Records the outcome of a savepoint disposal for the job's next decision.
    pub fn disposal_done(&self, job: &StreamJob, location: &str, outcome: DisposalOutcome) {
        let uid = job.uid().unwrap_or_default();
        let mut m = self.disposals.lock().unwrap_or_else(|e| e.into_inner());
        let done = m.entry(uid).or_default();
        done.retain(|(path, _)| path != location);
        done.push((location.to_string(), outcome));
    }

    /// The disposals whose outcome the job's status does not show yet.
    pub fn disposals_of(&self, job: &StreamJob) -> Vec<(String, DisposalOutcome)> {
        let uid = job.uid().unwrap_or_default();
        self.disposals.lock().unwrap_or_else(|e| e.into_inner()).get(&uid).cloned().unwrap_or_default()
    }

    /// Reconciles read the job's pods from `cache` when nothing is to be done.
    pub fn with_pod_cache(mut self, cache: Arc<PodCache>) -> Context {
        self.pods = Some(cache);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::JobBuilder;
    use crate::worker_api::HttpWorkerApi;

    fn context_with_limit(limit: usize) -> Context {
        let (service, _handle) = tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let (jobs, _writer) = kube::runtime::reflector::store::<StreamJob>();
        Context::new(Client::new(service, "jobs"), Arc::new(HttpWorkerApi::new().unwrap()), Arc::new(Metrics::new()), WorkerSettings::default(), None).with_upgrade_limit(limit, jobs)
    }

    fn slot_taken(ctx: &Context, job: &StreamJob) -> Option<bool> {
        ctx.upgrades_decided.lock().unwrap().get(job.uid().as_deref().unwrap()).copied()
    }

    #[tokio::test]
    async fn an_ended_upgrade_frees_its_slot_only_once_its_status_is_written() {
        let ctx = context_with_limit(1);
        let job = JobBuilder::new("j").build();
        ctx.upgrades_decided.lock().unwrap().insert(job.uid().unwrap(), true);
        // A decision that leaves no upgrade in flight (a first deployment).
        let decision = ctx.decide(&job, &mut crate::observe::Observed::at(jiff::Timestamp::now()));
        assert!(!crate::lifecycle::upgrade_in_flight(&decision.status));
        assert_eq!(slot_taken(&ctx, &job), Some(true), "held while the API still shows the upgrade");
        ctx.status_written(&job, &decision.status);
        assert_eq!(slot_taken(&ctx, &job), Some(false));
    }

    #[tokio::test]
    async fn without_a_limit_nothing_is_counted() {
        let (service, _handle) = tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let ctx = Context::new(Client::new(service, "jobs"), Arc::new(HttpWorkerApi::new().unwrap()), Arc::new(Metrics::new()), WorkerSettings::default(), None);
        let job = JobBuilder::new("j").build();
        let decision = ctx.decide(&job, &mut crate::observe::Observed::at(jiff::Timestamp::now()));
        ctx.status_written(&job, &decision.status);
        assert!(ctx.upgrades_decided.lock().unwrap().is_empty());
    }
}
