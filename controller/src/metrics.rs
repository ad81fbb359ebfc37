//! Prometheus metrics of the operator: reconciles, errors, reconcile
//! latency, jobs per phase and time spent in a phase before each transition.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use kube::ResourceExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use weir_api::streamjob::{Phase, StreamJob};

use crate::error::Error;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub from: String,
    pub to: String,
}

pub struct Metrics {
    pub registry: Mutex<Registry>,
    reconciles: Counter,
    skipped_stale: Counter,
    status_conflicts: Counter,
    errors: Family<ErrorLabels, Counter>,
    duration: Histogram,
    jobs: Family<PhaseLabels, Gauge>,
    transitions: Family<TransitionLabels, Histogram>,
    pub leader: Gauge,
    phases: Mutex<HashMap<String, String>>,
}

fn phase_name(p: Option<Phase>) -> String {
    p.map(|p| format!("{p:?}")).unwrap_or_else(|| "Created".into())
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("weir_operator");
        let reconciles = Counter::default();
        let skipped_stale = Counter::default();
        let status_conflicts = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        // Factor √2 from 0.5 ms to 23 s: a bound every half doubling (…, 64, 90.5,
        // 128 ms, …), so that a percentile read off the buckets can tell
        // "under 100 ms" from "up to 128 ms".
        let duration = Histogram::new(exponential_buckets(0.0005, std::f64::consts::SQRT_2, 32));
        let jobs = Family::<PhaseLabels, Gauge>::default();
        let transitions = Family::<TransitionLabels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.1, 2.0, 14)));
        let leader = Gauge::default();
        registry.register("reconciles", "Reconciles of StreamJobs", reconciles.clone());
        registry.register(
            "reconciles_skipped_stale",
            "Reconciles not run because the watch had not yet shown the operator's own last write to the StreamJob (not counted in reconciles)",
            skipped_stale.clone(),
        );
        registry.register(
            "status_conflicts",
            "Reconciles whose decision was dropped because the StreamJob changed between reading it and writing its status (decided again on the newer version)",
            status_conflicts.clone(),
        );
        registry.register("reconcile_errors", "Reconciles that failed, by kind of error", errors.clone());
        registry.register("reconcile_duration_seconds", "Time of one reconcile, including calls to the API server and workers", duration.clone());
        registry.register("jobs", "StreamJobs by phase", jobs.clone());
        registry.register("phase_duration_seconds", "Time a job spent in a phase before moving to the next", transitions.clone());
        registry.register("leader", "1 while this replica holds the leader lease", leader.clone());
        Metrics { registry: Mutex::new(registry), reconciles, skipped_stale, status_conflicts, errors, duration, jobs, transitions, leader, phases: Mutex::new(HashMap::new()) }
    }

    pub fn reconciled(&self, took: Duration, error: Option<&Error>) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(e) = error {
            self.errors.get_or_create(&ErrorLabels { kind: e.kind().into() }).inc();
        }
    }

    pub fn skipped_stale(&self) {
        self.skipped_stale.inc();
    }

    pub fn status_conflict(&self) {
        self.status_conflicts.inc();
    }

    pub fn transition(&self, from: Option<Phase>, to: Phase, spent: Duration) {
        self.transitions
            .get_or_create(&TransitionLabels { from: phase_name(from), to: phase_name(Some(to)) })
            .observe(spent.as_secs_f64());
    }

    pub fn set_phase(&self, job: &StreamJob, phase: Option<Phase>) {
        let key = format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any());
        let new = phase_name(phase);
        let Ok(mut phases) = self.phases.lock() else { return };
        if let Some(old) = phases.insert(key, new.clone()) {
            if old == new {
                return;
            }
            self.jobs.get_or_create(&PhaseLabels { phase: old }).dec();
        }
        self.jobs.get_or_create(&PhaseLabels { phase: new }).inc();
    }

    /// A deleted job no longer counts.
    pub fn forget(&self, job: &StreamJob) {
        let key = format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any());
        if let Some(old) = self.phases.lock().ok().and_then(|mut p| p.remove(&key)) {
            self.jobs.get_or_create(&PhaseLabels { phase: old }).dec();
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Ok(r) = self.registry.lock() {
            let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        }
        out
    }
}
