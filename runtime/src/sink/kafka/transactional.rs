//! Exactly-once into Kafka by transactions, including the window other
//! engines leave open: a crash after a checkpoint completed but before (or
//! while) its transaction commits.
//!
//! Each subtask writes an interval's records in one transaction on one of a
//! few producers whose `transactional.id`s are
//! `weir-<job>-<subtask>-<slot>@<topic>` (a new run uses the same ids, so
//! starting it fences the old run's producers and aborts their open
//! transactions). At the barrier the sink
//! adds a *progress marker* to the transaction (a message in the progress
//! topic keyed by the entry's id, `weir:<job>:<run>:<subtask>:<checkpoint>`),
//! flushes, and finishes the log entry: the interval's records, written to
//! checkpoint storage as they came ([`StateFileWriter`]), so that the sink
//! holds a few upload parts of them in memory, not the interval. The entry
//! is the sink's checkpointed state. When the checkpoint completes the
//! transaction commits, and the log file is deleted.
//!
//! librdkafka cannot finish another process's transaction, so a restore
//! settles each entry of the restored checkpoint like this:
//! 1. it initializes the old producers' transactional ids, which makes the
//!    brokers finish what the old producers left: a commit already requested
//!    completes, anything else is aborted. Every old transaction is now
//!    committed or aborted for good;
//! 2. it commits a probe message to the progress topic, then reads the topic
//!    `read_committed` from the entries' markers up to the probe: an entry
//!    whose marker is there was committed;
//! 3. every other entry's records are read back from its log file and
//!    written again in one transaction with a marker of the same id, so a
//!    crash during this step is settled the same way by the next restore.
//!
//! The records are thus written twice (to Kafka and to the log), the price
//! of closing that window; the log file lives until its transaction commits.
//!
//! A restored checkpoint names the transactional ids its subtasks used, but
//! not those of a run after it, nor those of a run that crashed before its
//! first checkpoint. A transaction such a run left open would hold back
//! every read_committed reader of its partitions until the transaction
//! timeout. So each subtask records its ids in storage before it uses them
//! (`kafka-transactional-ids/subtask-<n>`), and at start every subtask
//! fences the ids recorded for it, and subtask 0 those of subtasks the job
//! no longer has at its parallelism.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use weir_api::KafkaSinkSpec;

use super::{check_topic, flush, key_index, producer, send_batch};
use crate::checkpoint::{Location, StateFile, StateFileWriter};
use crate::error::{Error, Result};
use crate::kafka::{self, Deliveries, Scope, REQUEST_TIMEOUT};
use crate::sink::{SinkRestore, SinkState};

/// Producers a subtask starts with; more are made only while every one has
/// a transaction waiting for its checkpoint.
const INITIAL_SLOTS: usize = 2;

/// How often a restore held back by an open transaction in the progress
/// topic says so.
const HELD_REPORT_EVERY: Duration = Duration::from_secs(10);

/// A transaction waiting for its checkpoint to complete, as a checkpoint keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct KafkaLogEntry {
    pub checkpoint: u64,
    /// `weir:<job>:<run>:<subtask>:<checkpoint>`: its progress marker's key.
    pub id: String,
    /// The producer whose transaction holds the records.
    pub transactional_id: String,
    /// The marker's offset in partition 0 of the progress topic.
    pub marker_offset: i64,
    /// The interval's records in the job's `wal` directory.
    pub file: StateFile,
}

struct Slot {
    transactional_id: String,
    /// Shared with the thread that commits its transaction.
    producer: std::sync::Arc<ThreadedProducer<Deliveries>>,
}

/// A transaction of this run waiting for its checkpoint, or committing.
struct Pending {
    entry: KafkaLogEntry,
    slot: usize,
    /// Its commit, once the checkpoint completed: a thread of its own
    /// waits for the brokers while the next interval's records go into
    /// another slot's transaction.
    commit: Option<tokio::task::JoinHandle<Result<()>>>,
}

pub struct Transactional {
    spec: KafkaSinkSpec,
    key: Option<usize>,
    schema: SchemaRef,
    log: Location,
    /// Where this subtask records its transactional ids ([`IDS_DIR`]).
    ids: Location,
    /// The restored snapshot's copies of its log entries.
    restored_log: Option<Location>,
    job: String,
    subtask: u32,
    run_id: String,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// The slot whose transaction takes this interval's records.
    current: Option<usize>,
    /// The log entry of the open transaction, written as records come.
    entry: Option<StateFileWriter>,
    /// Transactions begun by this run: names their log entries.
    intervals: u64,
    /// Prepared transactions, oldest first; those committing first of all.
    /// A committing one stays until its commit is confirmed, so that the
    /// checkpoints taken meanwhile still name it: a crash before the
    /// brokers finished it must settle it on restore.
    pending: Vec<Pending>,
    /// Log entries of transactions committed and no longer pending, to be
    /// deleted ([`Transactional::delete_committed_logs`]). Deleting one
    /// while a checkpoint could still name it would make that checkpoint
    /// (a savepoint copies the files it names) refer to a missing file.
    committed_logs: Vec<String>,
}

/// The directory, beside the log's, where subtasks record their
/// transactional ids before they use them.
pub(crate) const IDS_DIR: &str = "kafka-transactional-ids";

fn ids_record(subtask: u32) -> String {
    format!("subtask-{subtask:03}")
}

/// `weir-<job>-<subtask>-<slot>@<topic>`: stable across the job's runs, so a
/// new run fences the old one's producers; the topic keeps two jobs that
/// share a name (in two namespaces, or two tests at once) from fencing
/// each other when they write to different topics, and `job`, scoped by
/// the state's identity (`<job>:<identity>`), when two states of one job
/// id write to one topic.
fn transactional_id(job: &str, topic: &str, subtask: u32, slot: usize) -> String {
    format!("weir-{job}-{subtask}-{slot}@{topic}")
}

impl Transactional {
    #[allow(clippy::too_many_arguments)]
    /// `log` and `ids` are the sink's log and transactional-ids directories.
    pub async fn open(spec: &KafkaSinkSpec, schema: &Schema, job: &str, subtask: u32, run_id: &str, (log, ids): (Location, Location), restore: SinkRestore<'_>) -> Result<Self> {
        let key = key_index(spec, schema)?;
        let mut sink = Transactional {
            spec: spec.clone(),
            key,
            schema: std::sync::Arc::new(schema.clone()),
            ids,
            restored_log: restore.snapshot_log.clone(),
            log,
            job: job.to_string(),
            subtask,
            run_id: run_id.to_string(),
            slots: Vec::new(),
            free: Vec::new(),
            current: None,
            entry: None,
            intervals: 0,
            pending: Vec::new(),
            committed_logs: Vec::new(),
        };
        let earlier = EarlierRuns::find(spec, job, subtask, restore.parallelism, &restore.mine, &sink.ids).await?;
        // Fenced before `add_slots` rewrites the record: a crash in between
        // must not forget an id whose transaction may still be open.
        earlier.fence(spec, job, subtask, false)?;
        sink.add_slots(earlier.own_slots).await?;
        // Fenced: the records of subtasks the job no longer has can go.
        for k in earlier.recorded.keys().filter(|k| **k != subtask) {
            sink.ids.delete(&ids_record(*k)).await?;
        }
        check_topic(&sink.slots[0].producer, spec, &spec.topic).await?;
        ensure_progress_topic(spec, Some(&sink.slots[0].producer)).await?;

        let entries: Vec<&KafkaLogEntry> = restore.mine.iter().flat_map(|s| &s.kafka).collect();
        if !entries.is_empty() {
            let committed = sink.committed_markers(&entries).await?;
            for entry in entries {
                if !committed.contains(&entry.id) {
                    match sink.write_again(entry).await {
                        Err(Error::LostLogEntry { location, .. }) => match sink.delivered_without_marker(entry).await? {
                            Some(why) => tracing::warn!(
                                entry = %entry.id,
                                log = %location,
                                "kafka sink: the transaction of a restored checkpoint is taken as committed: its log file is gone, which happens only once its records are committed, and its progress marker cannot be read because {why}"
                            ),
                            None => return Err(Error::LostLogEntry { location, checkpoint: entry.checkpoint }),
                        },
                        r => r?,
                    }
                } else {
                    tracing::debug!(entry = %entry.id, "kafka sink: the transaction of a restored checkpoint had committed");
                }
                sink.log.delete(&entry.file.name).await?;
            }
        }
        if let Some(keep) = restore.keep {
            discard_unreferenced(&sink.log, Some(run_id), keep).await?;
        }
        Ok(sink)
    }

    /// Fences, before any subtask of the worker settles its restored
    /// transactions, the producers earlier runs of each of `subtasks` may
    /// have left a transaction open on. A settling subtask reads the
    /// progress topic read_committed, which an unfenced transaction of a
    /// sibling holds back for the whole transaction timeout; the worker
    /// opens its sink subtasks one after another, so the sibling would
    /// fence it only after that.
    pub async fn fence_earlier_runs(spec: &KafkaSinkSpec, job: &str, subtasks: &[(u32, Vec<SinkState>)], parallelism: u32, ids: &Location) -> Result<()> {
        ensure_progress_topic(spec, None).await?;
        for (subtask, mine) in subtasks {
            EarlierRuns::find(spec, job, *subtask, parallelism, mine, ids).await?.fence(spec, job, *subtask, true)?;
        }
        Ok(())
    }

    /// Adds `n` producers to the pool, each with a transactional id of its
    /// own, initialized at once: a new id costs the transaction coordinator
    /// a round of its own, and a job's start (or restore) waits for all.
    async fn add_slots(&mut self, n: usize) -> Result<()> {
        let first = self.slots.len();
        let new: Vec<String> = (first..first + n).map(|slot| transactional_id(&self.job, &self.spec.topic, self.subtask, slot)).collect();
        // Recorded before they are used: a later run fences them even if
        // no checkpoint names them.
        let ids: Vec<&String> = self.slots.iter().map(|s| &s.transactional_id).chain(&new).collect();
        self.ids.put_durable(&ids_record(self.subtask), ids.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n").into_bytes()).await?;
        let producers = new.iter().map(|id| producer(&self.spec, &format!("weir-{}-{}", self.job, self.subtask), Some(id))).collect::<Result<Vec<_>>>()?;
        init_all(&producers.iter().zip(&new).map(|(p, id)| (p, id.as_str())).collect::<Vec<_>>())?;
        for (slot, (id, p)) in (first..).zip(new.into_iter().zip(producers)) {
            self.slots.push(Slot { transactional_id: id, producer: std::sync::Arc::new(p) });
            self.free.push(slot);
        }
        Ok(())
    }

    fn context(&self) -> String {
        format!("kafka sink topic {} subtask {}", self.spec.topic, self.subtask)
    }

    /// The slot of the open transaction, beginning one if needed.
    async fn transaction(&mut self) -> Result<usize> {
        if let Some(s) = self.current {
            return Ok(s);
        }
        if self.free.is_empty() {
            self.add_slots(1).await?;
        }
        let s = self.free.remove(0);
        self.slots[s].producer.begin_transaction().map_err(|e| kafka::error(self.context(), e))?;
        self.current = Some(s);
        Ok(s)
    }

    /// The log entry of the open transaction, started with it.
    async fn entry(&mut self) -> Result<&mut StateFileWriter> {
        if self.entry.is_none() {
            self.entry = Some(self.start_entry().await?);
        }
        Ok(self.entry.as_mut().expect("started above"))
    }

    async fn start_entry(&mut self) -> Result<StateFileWriter> {
        self.intervals += 1;
        // Named by the run (the log clean-up keeps a running run's files)
        // and by the transaction, since the checkpoint that will end it is
        // not known yet.
        let name = format!("{}-{:03}-t{:012}.arrow", self.run_id, self.subtask, self.intervals);
        StateFileWriter::start(&self.log, &name, &self.schema).await
    }

    pub async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let s = self.transaction().await?;
        send_batch(&self.slots[s].producer, &self.spec.topic, self.key, batch).await?;
        self.entry().await?.append(batch).await
    }

    /// Marks, flushes and logs the open transaction; it becomes pending on
    /// `checkpoint_id`.
    pub async fn pre_commit(&mut self, checkpoint_id: u64) -> Result<SinkState> {
        if let Some(s) = self.current.take() {
            let id = format!("weir:{}:{}:{}:{checkpoint_id}", self.job, self.run_id, self.subtask);
            let producer = &self.slots[s].producer;
            let marker_offset = mark(producer, &self.spec.progress_topic, &id, &self.context())?;
            // The marker is on the broker, its log entry not yet complete:
            // the restore must abort this transaction, not look for a log.
            crate::fault::crash_point("after-marker", checkpoint_id);
            let entry = match self.entry.take() {
                Some(entry) => entry,
                None => self.start_entry().await?,
            };
            let file = entry.finish().await?;
            let entry = KafkaLogEntry { checkpoint: checkpoint_id, id, transactional_id: self.slots[s].transactional_id.clone(), marker_offset, file };
            self.pending.push(Pending { entry, slot: s, commit: None });
        }
        Ok(SinkState {
            kafka: self.pending.iter().map(|p| p.entry.clone()).collect(),
            transactional_ids: self.slots.iter().map(|s| s.transactional_id.clone()).collect(),
            ..SinkState::default()
        })
    }

    /// Commits the transactions pending on checkpoints up to `checkpoint_id`
    /// and waits until they are committed.
    pub async fn commit(&mut self, checkpoint_id: u64) -> Result<()> {
        self.start_commit(checkpoint_id);
        while self.commits_in_flight() {
            self.next_committed().await?;
        }
        self.delete_committed_logs().await
    }

    /// Starts committing the transactions pending on checkpoints up to
    /// `checkpoint_id`, each on a thread of its own, and returns at once:
    /// [`Transactional::next_committed`] reports them, oldest first.
    pub fn start_commit(&mut self, checkpoint_id: u64) {
        let context = self.context();
        for pending in self.pending.iter_mut().filter(|p| p.entry.checkpoint <= checkpoint_id && p.commit.is_none()) {
            crate::fault::crash_point("before-sink-commit", pending.entry.checkpoint);
            let (producer, entry, context) = (self.slots[pending.slot].producer.clone(), pending.entry.clone(), context.clone());
            // The task only commits: the log entry is deleted once the
            // subtask has taken the transaction out of `pending`
            // (next_committed), never while a snapshot may still name it.
            pending.commit = Some(tokio::spawn(async move {
                crate::fault::slow_sink_commit(entry.checkpoint).await;
                tokio::task::spawn_blocking(move || producer.commit_transaction(REQUEST_TIMEOUT))
                    .await
                    .map_err(|e| Error::Job(format!("{context}: the commit of checkpoint {} failed: {e}", entry.checkpoint)))?
                    .map_err(|e| commit_error(&context, &entry, e))
            }));
        }
    }

    /// Whether a commit started by [`Transactional::start_commit`] is not confirmed yet.
    pub fn commits_in_flight(&self) -> bool {
        self.pending.first().is_some_and(|p| p.commit.is_some())
    }

    /// Waits for the oldest commit in flight (forever when there is none)
    /// and frees its producer; returns its checkpoint. Its log entry is
    /// left for [`Transactional::delete_committed_logs`], since this is
    /// awaited among other events and must be cancel-safe: it changes
    /// nothing until the commit it waits for has ended, and then nothing
    /// that awaits.
    pub async fn next_committed(&mut self) -> Result<u64> {
        let Some(commit) = self.pending.first_mut().and_then(|p| p.commit.as_mut()) else {
            return std::future::pending().await;
        };
        let result = commit.await;
        let Pending { entry, slot, .. } = self.pending.remove(0);
        result.map_err(|e| Error::Job(format!("{}: the commit of checkpoint {} failed: {e}", self.context(), entry.checkpoint)))??;
        self.free.push(slot);
        self.free.sort_unstable();
        self.committed_logs.push(entry.file.name);
        Ok(entry.checkpoint)
    }

    /// Deletes the log entries of the transactions `next_committed` reported.
    pub async fn delete_committed_logs(&mut self) -> Result<()> {
        while let Some(name) = self.committed_logs.last() {
            self.log.delete(name).await?;
            self.committed_logs.pop();
        }
        Ok(())
    }

    /// The ids of `entries` whose marker, hence whose transaction, committed.
    async fn committed_markers(&self, entries: &[&KafkaLogEntry]) -> Result<HashSet<String>> {
        let topic = &self.spec.progress_topic;
        let context = format!("kafka sink: settling the transactions of the restored checkpoint (progress topic {topic})");
        // A committed message after every marker: reading up to it sees
        // every marker's fate, since the old transactions are settled.
        let probe = &self.slots[0].producer;
        probe.begin_transaction().map_err(|e| kafka::error(&context, e))?;
        let probe_id = format!("probe:{}:{}:{}", self.job, self.run_id, self.subtask);
        let probe_offset = mark(probe, topic, &probe_id, &context)?;
        tokio::task::block_in_place(|| probe.commit_transaction(REQUEST_TIMEOUT)).map_err(|e| kafka::error(&context, e))?;

        // Never past the probe: markers written to another progress topic
        // (the pipeline changed its target) have offsets of that topic, and
        // a read starting at the end of this one would wait for messages
        // nobody writes.
        // An offset librdkafka did not know (-1) reads from the start.
        let from = match entries.iter().map(|e| e.marker_offset).min().unwrap_or(0).min(probe_offset) {
            o if o < 0 => Offset::Beginning,
            o => Offset::Offset(o),
        };
        let mut config = kafka::client_config(&self.spec.bootstrap_servers, &format!("weir-{}-{}-settle", self.job, self.subtask), super::user_settings(&self.spec), Scope::Connection)?;
        config.set("isolation.level", "read_committed").set("enable.auto.commit", "false").set("group.id", "weir-sink").set("auto.offset.reset", "earliest");
        let consumer: BaseConsumer<kafka::Quiet> = config.create_with_context(kafka::Quiet).map_err(|e| kafka::error(&context, e))?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, 0, from).map_err(|e| kafka::error(&context, e))?;
        consumer.assign(&tpl).map_err(|e| kafka::error(&context, e))?;
        let wanted: HashSet<&str> = entries.iter().map(|e| e.id.as_str()).collect();
        let mut committed = HashSet::new();
        // Other jobs' open transactions in the progress topic hold the
        // read back until they end (one checkpoint interval, at most their
        // transaction timeout).
        let started = Instant::now();
        let deadline = started + self.spec.transaction_timeout.get() + REQUEST_TIMEOUT;
        let (mut read_to, mut next_report) = (None, started + HELD_REPORT_EVERY);
        loop {
            if Instant::now() > next_report {
                // A wait of up to the transaction timeout (minutes) must not
                // look like a hang: say what it waits for.
                next_report += HELD_REPORT_EVERY;
                tracing::warn!(
                    subtask = self.subtask,
                    progress_topic = %topic,
                    probe_offset,
                    read_to = read_to.map_or_else(|| "nothing yet".to_string(), |o: i64| o.to_string()),
                    waited_s = started.elapsed().as_secs(),
                    gives_up_after_s = (deadline - started).as_secs(),
                    "kafka sink: a restore waits for the progress topic to become readable up to its probe; an open transaction holds partition 0 back \
                     until its producer ends it or transaction_timeout aborts it"
                );
            }
            if Instant::now() > deadline {
                return Err(Error::Kafka {
                    context,
                    message: format!(
                        "the probe at offset {probe_offset} of partition 0 did not become readable within transaction_timeout: a transaction holds the \
                         partition back that no producer ends, as a broker that lost its commit marker leaves (an unreplicated broker killed, an unclean \
                         leader election); `kafka-transactions.sh find-hanging` names it"
                    ),
                    fatal: false,
                });
            }
            let next = tokio::task::block_in_place(|| consumer.poll(Duration::from_millis(200)).map(|r| r.map(|m| (m.offset(), m.key().map(<[u8]>::to_vec)))));
            match next {
                None | Some(Err(KafkaError::PartitionEOF(_))) => continue,
                Some(Err(e)) => return Err(kafka::error(&context, e)),
                Some(Ok((offset, key))) => {
                    read_to = Some(offset);
                    if let Some(key) = key.as_deref().and_then(|k| std::str::from_utf8(k).ok()) {
                        if wanted.contains(key) {
                            committed.insert(key.to_string());
                        }
                    }
                    if offset >= probe_offset {
                        return Ok(committed);
                    }
                }
            }
        }
    }

    /// Why a restored entry whose marker was not found and whose log file is
    /// gone was nevertheless delivered, if the marker cannot be read: the
    /// entry was written to another topic than the sink's now (the pipeline
    /// changed its target, and with it, as a rule, the progress topic), or
    /// the progress topic's retention has deleted the marker (an old
    /// savepoint). A log file is deleted only after its transaction
    /// committed, so then the entry is settled. `None` when the marker should
    /// be readable: then the log file was lost, and so are its records.
    async fn delivered_without_marker(&self, entry: &KafkaLogEntry) -> Result<Option<String>> {
        let written_to = entry.transactional_id.rsplit_once('@').map(|(_, t)| t);
        if let Some(old) = written_to.filter(|t| *t != self.spec.topic) {
            return Ok(Some(format!("it was written to topic {old}, and the sink now writes to {}", self.spec.topic)));
        }
        let topic = self.spec.progress_topic.clone();
        let context = format!("kafka sink: reading where progress topic {topic} starts");
        let config = kafka::client_config(&self.spec.bootstrap_servers, &format!("weir-{}-{}-settle", self.job, self.subtask), super::user_settings(&self.spec), Scope::Connection)?;
        let consumer: BaseConsumer<kafka::Quiet> = config.create_with_context(kafka::Quiet).map_err(|e| kafka::error(&context, e))?;
        let (low, _) = tokio::task::block_in_place(|| consumer.fetch_watermarks(&topic, 0, REQUEST_TIMEOUT)).map_err(|e| kafka::error(&context, e))?;
        Ok((low > entry.marker_offset).then(|| format!("retention has deleted it from progress topic {topic} (offset {} of partition 0; the topic now starts at {low})", entry.marker_offset)))
    }

    /// Writes a restored entry whose transaction never committed, with its
    /// marker, in one transaction.
    async fn write_again(&mut self, entry: &KafkaLogEntry) -> Result<()> {
        let (_, batches) = crate::sink::read_log_entry(&self.log, self.restored_log.as_ref(), &entry.file, entry.checkpoint).await?;
        let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
        tracing::info!(entry = %entry.id, rows, "kafka sink: writing again the records of a completed checkpoint whose transaction never committed");
        let s = self.transaction().await?;
        for batch in &batches {
            send_batch(&self.slots[s].producer, &self.spec.topic, self.key, batch).await?;
        }
        let producer = &self.slots[s].producer;
        mark(producer, &self.spec.progress_topic, &entry.id, &self.context())?;
        tokio::task::block_in_place(|| producer.commit_transaction(REQUEST_TIMEOUT)).map_err(|e| commit_error(&self.context(), entry, e))?;
        self.current = None;
        self.free.push(s);
        self.free.sort_unstable();
        Ok(())
    }
}

/// The transactional ids earlier runs of one subtask may have left a
/// transaction open on.
struct EarlierRuns {
    /// Named by the restored states this subtask takes over, and recorded
    /// in storage ([`IDS_DIR`]).
    ids: BTreeSet<String>,
    /// The recorded ids, by subtask: its own, and for subtask 0 those of
    /// subtasks at or above the parallelism.
    recorded: std::collections::BTreeMap<u32, Vec<String>>,
    /// How many slots of its own the subtask starts with: a few more than
    /// any earlier run used, since the pool may have grown after the
    /// restored checkpoint.
    own_slots: usize,
}

impl EarlierRuns {
    async fn find(spec: &KafkaSinkSpec, job: &str, subtask: u32, parallelism: u32, mine: &[SinkState], ids_dir: &Location) -> Result<EarlierRuns> {
        let mut ids: BTreeSet<String> = mine.iter().flat_map(|s| s.transactional_ids.iter().cloned()).collect();
        let mut recorded = std::collections::BTreeMap::new();
        for name in ids_dir.list_objects("").await? {
            let Some(k) = name.strip_prefix("subtask-").and_then(|n| n.parse::<u32>().ok()) else { continue };
            if k == subtask || (subtask == 0 && k >= parallelism) {
                if let Some(bytes) = ids_dir.get(&name).await? {
                    recorded.insert(k, String::from_utf8_lossy(&bytes).lines().filter(|l| !l.is_empty()).map(String::from).collect::<Vec<_>>());
                }
            }
        }
        ids.extend(recorded.values().flatten().cloned());
        let own_slots = ids.iter().filter(|id| id.starts_with(&format!("weir-{job}-{subtask}-")) && id.ends_with(&format!("@{}", spec.topic))).count().max(INITIAL_SLOTS) + 1;
        Ok(EarlierRuns { ids, recorded, own_slots })
    }

    /// Initializes every id (with `own`, also the subtask's own slots,
    /// which its sink otherwise initializes as it makes them).
    fn fence(&self, spec: &KafkaSinkSpec, job: &str, subtask: u32, own: bool) -> Result<()> {
        let own_ids: BTreeSet<String> = (0..self.own_slots).map(|slot| transactional_id(job, &spec.topic, subtask, slot)).collect();
        let fenced: BTreeSet<&String> = if own { self.ids.iter().chain(&own_ids).collect() } else { self.ids.difference(&own_ids).collect() };
        let producers = fenced.iter().map(|id| producer(spec, &format!("weir-{job}-{subtask}-fence"), Some(id))).collect::<Result<Vec<_>>>()?;
        init_all(&producers.iter().zip(&fenced).map(|(p, id)| (p, id.as_str())).collect::<Vec<_>>())
    }
}

/// Initializes transactional producers, all at once (a thread each): fences
/// older producers of their ids. The first error is returned.
fn init_all(producers: &[(&ThreadedProducer<Deliveries>, &str)]) -> Result<()> {
    match producers {
        [] => Ok(()),
        [(p, id)] => init(p, id),
        many => tokio::task::block_in_place(|| {
            std::thread::scope(|scope| {
                let threads: Vec<_> = many.iter().map(|(p, id)| scope.spawn(move || init_blocking(p, id))).collect();
                threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err(Error::Job("kafka sink: a thread initializing a transactional id panicked".into())))).collect::<Result<Vec<()>>>()
            })
        })
        .map(|_| ()),
    }
}

/// Initializes a transactional producer: fences older producers of its id.
fn init(producer: &ThreadedProducer<Deliveries>, id: &str) -> Result<()> {
    tokio::task::block_in_place(|| init_blocking(producer, id))
}

fn init_blocking(producer: &ThreadedProducer<Deliveries>, id: &str) -> Result<()> {
    // The cluster's metadata first: librdkafka replaces its bootstrap
    // connection by the broker's own once it knows the broker's id, and a
    // coordinator query sent on the bootstrap connection is then lost and
    // asked again only by a 500 ms timer.
    let _ = producer.client().fetch_metadata(None, REQUEST_TIMEOUT);
    producer.init_transactions(REQUEST_TIMEOUT).map_err(|e| {
        let mut err = kafka::error(format!("kafka sink: initializing transactional id {id}"), e);
        if let Error::Kafka { message, .. } = &mut err {
            message.push_str(" (the brokers need transactions: transaction.state.log.replication.factor and min.isr at most the number of brokers)");
        }
        err
    })
}

/// Sends the progress marker `id` into the open transaction, flushes
/// everything, and returns the marker's offset.
fn mark(producer: &ThreadedProducer<Deliveries>, topic: &str, id: &str, context: &str) -> Result<i64> {
    let value = format!("{{\"marker\":{}}}", serde_json::Value::String(id.to_string()));
    producer
        .send(BaseRecord::<str, str>::to(topic).partition(0).key(id).payload(&value))
        .map_err(|(e, _)| kafka::error(format!("{context}: progress marker"), e))?;
    flush(producer, context)?;
    producer.context().marker_offset(id).ok_or_else(|| Error::Kafka {
        context: context.into(),
        message: format!("the progress marker {id} was flushed but its offset was not reported"),
        fatal: false,
    })
}

fn commit_error(context: &str, entry: &KafkaLogEntry, e: KafkaError) -> Error {
    let fenced = matches!(e.rdkafka_error_code(), Some(RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch));
    let mut err = kafka::error(format!("{context}: committing the transaction of checkpoint {}", entry.checkpoint), e);
    if let Error::Kafka { message, fatal, .. } = &mut err {
        // A restore settles the entry; a newer run fenced this producer
        // only after taking over the job, and settles it itself.
        *fatal = false;
        if fenced {
            message.push_str(" (a newer run of the job took over its transactional ids)");
        }
    }
    err
}

/// Creates the progress topic (one partition) unless `producer`'s metadata
/// shows it: an admin client's start and request cost a tenth of a second
/// on every (re)start of a job, and the topic exists after the first.
/// A topic it creates, it waits for until `producer` sees it with a leader,
/// so that the first progress marker does not wait for librdkafka's next
/// metadata refresh.
async fn ensure_progress_topic(spec: &KafkaSinkSpec, producer: Option<&ThreadedProducer<Deliveries>>) -> Result<()> {
    // All topics: a request naming the topic would let a broker with
    // auto.create.topics.enable create it with its default partitions,
    // and the progress topic must have one.
    let known = |p: &ThreadedProducer<Deliveries>| {
        let metadata = tokio::task::block_in_place(|| p.client().fetch_metadata(None, REQUEST_TIMEOUT));
        metadata.is_ok_and(|m| m.topics().iter().any(|t| t.name() == spec.progress_topic && t.error().is_none() && t.partitions().iter().any(|p| p.leader() >= 0)))
    };
    if producer.is_some_and(known) {
        return Ok(());
    }
    let context = format!("kafka sink: creating the progress topic {}", spec.progress_topic);
    let config = kafka::client_config(&spec.bootstrap_servers, "weir-admin", super::user_settings(spec), Scope::Connection)?;
    let admin: AdminClient<kafka::Quiet> = config.create_with_context(kafka::Quiet).map_err(|e| kafka::error(&context, e))?;
    let topic = NewTopic::new(&spec.progress_topic, 1, TopicReplication::Fixed(-1));
    let results = admin
        .create_topics([&topic], &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)))
        .await
        .map_err(|e| kafka::error(&context, e))?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => return Err(kafka::error(&context, KafkaError::AdminOp(code))),
        }
    }
    if let Some(p) = producer {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        while !known(p) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

async fn discard_unreferenced(log: &Location, run_id: Option<&str>, keep: &HashSet<String>) -> Result<()> {
    crate::sink::discard_unreferenced_log_files(log, run_id, keep, "kafka").await
}

/// Once a job has finished or been stopped: [`discard_unreferenced`], the
/// run's own entries too if it is over.
pub async fn discard_after_end(log: &Location, run_id: &str, end: crate::sink::RunEnd, keep: &HashSet<String>) -> Result<()> {
    discard_unreferenced(log, (end == crate::sink::RunEnd::MayResume).then_some(run_id), keep).await
}
