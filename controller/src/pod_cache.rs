//! The pods of each StreamJob as the operator's pod watch last showed them,
//! indexed by (namespace, job). Filled from the same watch events that
//! trigger reconciles, before they trigger them (see `main.rs`), so a
//! reconcile caused by a pod event sees at least that event (during a relist
//! the cache answers nothing, so that holds there too).
//!
//! A cache may lag behind the API server (pods the operator has just applied
//! or deleted itself); [`crate::reconcile`] concludes only "nothing to do"
//! from it and lists the pods before it writes or acts.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;

use crate::names::JOB_LABEL;

#[derive(Default)]
struct Index {
    /// (namespace, job) → pod name → pod.
    by_job: HashMap<(String, String), BTreeMap<String, Arc<Pod>>>,
    /// (namespace, pod name) → job.
    job_of: HashMap<(String, String), String>,
}

impl Index {
    fn insert(&mut self, pod: &Pod) {
        // Our pods never change their job label; should one, it leaves its old job.
        self.remove(pod);
        let (Some(ns), Some(name)) = (pod.metadata.namespace.clone(), pod.metadata.name.clone()) else { return };
        let Some(job) = pod.metadata.labels.as_ref().and_then(|l| l.get(JOB_LABEL)).cloned() else { return };
        self.job_of.insert((ns.clone(), name.clone()), job.clone());
        self.by_job.entry((ns, job)).or_default().insert(name, Arc::new(pod.clone()));
    }

    fn remove(&mut self, pod: &Pod) {
        let (Some(ns), Some(name)) = (pod.metadata.namespace.clone(), pod.metadata.name.clone()) else { return };
        let Some(job) = self.job_of.remove(&(ns.clone(), name.clone())) else { return };
        let key = (ns, job);
        if let Some(pods) = self.by_job.get_mut(&key) {
            pods.remove(&name);
            if pods.is_empty() {
                self.by_job.remove(&key);
            }
        }
    }
}

pub struct PodCache {
    inner: RwLock<Inner>,
}

struct Inner {
    /// The pods as of the last complete list and the events since.
    pods: Index,
    /// A list in progress (from the start until the first list is complete,
    /// and whenever the watch restarts): replaces `pods` when complete, and
    /// until then the cache answers nothing.
    listing: Option<Index>,
}

impl Default for PodCache {
    fn default() -> PodCache {
        PodCache { inner: RwLock::new(Inner { pods: Index::default(), listing: Some(Index::default()) }) }
    }
}

impl PodCache {
    /// Applies one watch event.
    pub fn apply(&self, event: &Event<Pod>) {
        let Ok(mut inner) = self.inner.write() else { return };
        match event {
            Event::Apply(pod) => inner.pods.insert(pod),
            Event::Delete(pod) => inner.pods.remove(pod),
            Event::Init => inner.listing = Some(Index::default()),
            Event::InitApply(pod) => {
                if let Some(listing) = inner.listing.as_mut() {
                    listing.insert(pod);
                }
            }
            Event::InitDone => {
                if let Some(listing) = inner.listing.take() {
                    inner.pods = listing;
                }
            }
        }
    }

    /// The job's pods by name; `None` before the first complete list and
    /// while a relist is under way (the watch restarted: its events until the
    /// list is complete trigger reconciles that the old view cannot answer,
    /// and a pod deleted while the watch was down is still in it).
    pub fn pods(&self, namespace: &str, job: &str) -> Option<Vec<Arc<Pod>>> {
        let inner = self.inner.read().ok()?;
        if inner.listing.is_some() {
            return None;
        }
        Some(inner.pods.by_job.get(&(namespace.to_string(), job.to_string())).map(|p| p.values().cloned().collect()).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pod;

    fn names(c: &PodCache, job: &str) -> Option<Vec<String>> {
        c.pods("jobs", job).map(|p| p.iter().map(|p| p.metadata.name.clone().unwrap()).collect())
    }

    #[test]
    fn follows_lists_applies_and_deletes_per_job() {
        let c = PodCache::default();
        assert_eq!(names(&c, "a"), None, "not ready before the first list");
        c.apply(&Event::Init);
        c.apply(&Event::InitApply(pod("a", "r-1", 1, "Pending", None)));
        c.apply(&Event::InitApply(pod("a", "r-1", 0, "Pending", None)));
        c.apply(&Event::InitApply(pod("b", "s-1", 0, "Pending", None)));
        assert_eq!(names(&c, "a"), None, "still listing");
        c.apply(&Event::InitDone);
        assert_eq!(names(&c, "a"), Some(vec!["a-r-1-0".into(), "a-r-1-1".into()]));
        assert_eq!(names(&c, "b"), Some(vec!["b-s-1-0".into()]));
        assert_eq!(names(&c, "c"), Some(vec![]));

        let mut running = pod("a", "r-1", 0, "Running", Some("10.0.0.1"));
        c.apply(&Event::Apply(running.clone()));
        assert_eq!(c.pods("jobs", "a").unwrap()[0].status.as_ref().unwrap().phase.as_deref(), Some("Running"));
        c.apply(&Event::Delete(pod("a", "r-1", 1, "Pending", None)));
        assert_eq!(names(&c, "a"), Some(vec!["a-r-1-0".into()]));

        // A relist replaces everything once complete; until then the cache
        // answers nothing (reconciles list the pods themselves).
        c.apply(&Event::Init);
        c.apply(&Event::InitApply(pod("b", "s-2", 0, "Pending", None)));
        assert_eq!(names(&c, "a"), None, "relisting");
        c.apply(&Event::InitDone);
        assert_eq!(names(&c, "a"), Some(vec![]));
        assert_eq!(names(&c, "b"), Some(vec!["b-s-2-0".into()]));

        // Another namespace is another job.
        running.metadata.namespace = Some("other".into());
        c.apply(&Event::Apply(running.clone()));
        assert_eq!(names(&c, "a"), Some(vec![]));
        assert_eq!(c.pods("other", "a").map(|p| p.len()), Some(1));
        c.apply(&Event::Delete(running));
        assert_eq!(c.pods("other", "a").map(|p| p.len()), Some(0));
        assert!(c.inner.read().unwrap().pods.job_of.len() == 1, "only b's pod is left");
    }
}
