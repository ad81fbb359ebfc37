//! What every reconcile shares: the API client, the workers' client, the
//! event recorder, metrics and settings.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use weir_api::streamjob::StreamJob;

use crate::desired::WorkerSettings;
use crate::metrics::Metrics;
use crate::observe::Rejection;
use crate::pod_cache::PodCache;
use crate::worker_api::WorkerApi;

pub struct Context {
    pub client: Client,
    pub workers: Arc<dyn WorkerApi>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub settings: WorkerSettings,
    /// Control tokens by StreamJob uid, read from their Secrets once.
    pub tokens: Mutex<HashMap<String, String>>,
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
    /// By StreamJob uid: whether this operator's latest decision for the job
    /// left an upgrade in flight; newer than the cache until the job's
    /// status write comes back through the watch.
    pub upgrades_decided: Mutex<HashMap<String, bool>>,
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
        Context { recorder: Recorder::new(client.clone(), reporter), client, workers, metrics, settings, tokens: Mutex::new(HashMap::new()), superseded: Mutex::new(HashMap::new()), pods: None, rejections: Mutex::new(HashMap::new()), upgrade_limit: None, upgrades_decided: Mutex::new(HashMap::new()) }
    }

    /// At most `limit` jobs of `jobs` upgrade at once.
    pub fn with_upgrade_limit(mut self, limit: usize, jobs: Store<StreamJob>) -> Context {
        self.upgrade_limit = Some((limit, jobs));
        self
    }

    /// Decides `job` with the other jobs' upgrades in flight counted, and
    /// records whether the decision leaves its own in flight. Counting and
    /// recording hold one lock, so that two jobs decided at once cannot
    /// both take the last slot.
    pub fn decide(&self, job: &StreamJob, observed: &mut crate::observe::Observed) -> crate::lifecycle::Decision {
        let Some((limit, jobs)) = &self.upgrade_limit else { return crate::lifecycle::decide(job, observed, &self.settings) };
        let uid = job.uid().unwrap_or_default();
        let mut decided = self.upgrades_decided.lock().unwrap_or_else(|e| e.into_inner());
        observed.upgrades = crate::lifecycle::upgrade_slots(&uid, &jobs.state(), &decided, *limit);
        let decision = crate::lifecycle::decide(job, observed, &self.settings);
        decided.insert(uid, crate::lifecycle::upgrade_in_flight(&decision.status));
        decision
    }

    /// Reconciles read the job's pods from `cache` when nothing is to be done.
    pub fn with_pod_cache(mut self, cache: Arc<PodCache>) -> Context {
        self.pods = Some(cache);
        self
    }
}
