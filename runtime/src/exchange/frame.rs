//! Frames on a data connection: length-delimited, a kind byte, then the
//! payload. Record batches use the Arrow IPC stream format (the schema once,
//! in the first batch frame); barriers are JSON; end-of-stream is empty.
//!
//! A frame is at most [`MAX_FRAME`] bytes. A batch whose encoding is bigger
//! is sent as several frames of row slices (each a record batch of its own,
//! so the receiver needs to know nothing about it); only a single record
//! bigger than the limit cannot be sent, and that is a fatal error.

use arrow::array::RecordBatch;
use arrow::buffer::Buffer;
use arrow::datatypes::SchemaRef;
use arrow::ipc::reader::StreamDecoder;
use arrow::ipc::writer::StreamWriter;
use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use super::{Barrier, Message};
use crate::error::{Error, Result};

const KIND_BATCH: u8 = 0;
const KIND_BARRIER: u8 = 1;
const KIND_END: u8 = 2;
const KIND_WATERMARK: u8 = 4;
const KIND_IDLE: u8 = 5;

/// The largest frame, kind byte included: 256 MiB. A reader refuses a bigger
/// length as a protocol error instead of allocating it.
pub const MAX_FRAME: usize = 256 << 20;

pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME).new_codec()
}

/// A data connection's hello (sent in the handshake, see
/// `worker::handshake`): which channel it carries.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub run_id: String,
    /// The downstream stage.
    pub stage: usize,
    /// Which of the stage's inputs (a union's or a join's); absent from a
    /// worker of before graphs, whose stages had one input.
    #[serde(default)]
    pub input: usize,
    pub from: u32,
    pub to: u32,
}

pub fn encode_hello(h: &Hello) -> Vec<u8> {
    serde_json::to_vec(h).unwrap_or_default()
}

pub fn decode_hello(peer: &str, body: &[u8]) -> Result<Hello> {
    serde_json::from_slice(body).map_err(|e| Error::Protocol { peer: peer.into(), message: format!("bad hello: {e}") })
}

/// Encodes messages of one connection (keeps the IPC stream state).
pub struct FrameEncoder {
    ipc: StreamWriter<Vec<u8>>,
    /// The IPC stream's schema message, sent at the start of the first batch frame.
    header: Vec<u8>,
    limit: usize,
}

impl FrameEncoder {
    pub fn new(schema: &SchemaRef) -> Result<Self> {
        Self::with_limit(schema, MAX_FRAME)
    }

    /// An encoder whose frames are at most `limit` bytes (tests use small ones).
    pub fn with_limit(schema: &SchemaRef, limit: usize) -> Result<Self> {
        let mut ipc = StreamWriter::try_new(Vec::new(), schema).map_err(Error::arrow("encoding schema"))?;
        let header = std::mem::take(ipc.get_mut());
        Ok(FrameEncoder { ipc, header, limit })
    }

    /// The frames of one message: one, except for a batch too big for one frame.
    pub fn encode(&mut self, msg: &Message) -> Result<Vec<Bytes>> {
        let mut frames = Vec::with_capacity(1);
        match msg {
            Message::Batch(b) => self.encode_batch(b, &mut frames)?,
            Message::Barrier(b) => {
                let mut out = BytesMut::new();
                out.put_u8(KIND_BARRIER);
                out.extend_from_slice(&serde_json::to_vec(b).unwrap_or_default());
                frames.push(out.freeze());
            }
            Message::End => frames.push(Bytes::from_static(&[KIND_END])),
            Message::Watermark(w) => {
                let mut out = BytesMut::with_capacity(9);
                out.put_u8(KIND_WATERMARK);
                out.put_i64(*w);
                frames.push(out.freeze());
            }
            Message::Idle => frames.push(Bytes::from_static(&[KIND_IDLE])),
        }
        Ok(frames)
    }

    /// Encodes `batch`, or, when its encoding is over the limit, slices of it
    /// small enough. Encoding a batch and dropping the bytes leaves the IPC
    /// writer as it was (it keeps state only for dictionaries, which pipeline
    /// schemas do not have), so a too-big batch is simply encoded again in parts.
    fn encode_batch(&mut self, batch: &RecordBatch, frames: &mut Vec<Bytes>) -> Result<()> {
        self.ipc.write(batch).map_err(Error::arrow("encoding a record batch"))?;
        let body = std::mem::take(self.ipc.get_mut());
        let size = 1 + self.header.len() + body.len();
        if size <= self.limit {
            let mut out = BytesMut::with_capacity(size);
            out.put_u8(KIND_BATCH);
            out.extend_from_slice(&std::mem::take(&mut self.header));
            out.extend_from_slice(&body);
            frames.push(out.freeze());
            return Ok(());
        }
        let rows = batch.num_rows();
        if rows <= 1 {
            return Err(Error::RecordTooLarge { context: "sending a record to the next stage".into(), bytes: size, limit: self.limit });
        }
        // Aim at half the limit so that most slices fit at the first try
        // even when the records differ in size.
        let slices = (size / (self.limit / 2).max(1) + 1).clamp(2, rows);
        let per_slice = rows.div_ceil(slices);
        let mut offset = 0;
        while offset < rows {
            let len = per_slice.min(rows - offset);
            self.encode_batch(&batch.slice(offset, len), frames)?;
            offset += len;
        }
        Ok(())
    }
}

pub struct FrameDecoder {
    ipc: StreamDecoder,
    peer: String,
}

impl FrameDecoder {
    pub fn new(peer: &str) -> Self {
        FrameDecoder { ipc: StreamDecoder::new(), peer: peer.into() }
    }

    pub fn decode(&mut self, frame: Bytes) -> Result<Message> {
        let bad = |message: String| Error::Protocol { peer: self.peer.clone(), message };
        let Some(&kind) = frame.first() else { return Err(bad("empty frame".into())) };
        let body = frame.slice(1..);
        match kind {
            KIND_BATCH => {
                let mut buf = Buffer::from(body);
                let mut batch: Option<RecordBatch> = None;
                while !buf.is_empty() {
                    // Arrow's IPC reader validates what it reads, but a frame
                    // from the network must never take the process down.
                    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.ipc.decode(&mut buf)))
                        .map_err(|_| bad("undecodable record batch".into()))?;
                    if let Some(b) = decoded.map_err(|e| bad(format!("bad record batch: {e}")))? {
                        batch = Some(b);
                    }
                }
                batch.map(Message::Batch).ok_or_else(|| bad("a batch frame without a record batch".into()))
            }
            KIND_BARRIER => serde_json::from_slice::<Barrier>(&body).map(Message::Barrier).map_err(|e| bad(format!("bad barrier: {e}"))),
            KIND_END => Ok(Message::End),
            KIND_WATERMARK => match <[u8; 8]>::try_from(&body[..]) {
                Ok(b) => Ok(Message::Watermark(i64::from_be_bytes(b))),
                Err(_) => Err(bad(format!("a watermark frame of {} bytes instead of 8", body.len()))),
            },
            KIND_IDLE => Ok(Message::Idle),
            k => Err(bad(format!("unknown frame kind {k}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn batches_and_barriers_survive_the_wire_in_order() {
        let schema: SchemaRef = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1, 2, 3]))]).unwrap();
        let mut enc = FrameEncoder::new(&schema).unwrap();
        let mut dec = FrameDecoder::new("test");
        let barrier = Barrier { checkpoint_id: 4, savepoint: false, is_final: false, dir: "checkpoints/chk-4".into(), stop: false };
        for msg in [Message::Batch(b.clone()), Message::Barrier(barrier.clone()), Message::Watermark(-42), Message::Idle, Message::Batch(b.clone()), Message::End] {
            let frames = enc.encode(&msg).unwrap();
            assert_eq!(frames.len(), 1);
            match (msg, dec.decode(frames.into_iter().next().unwrap()).unwrap()) {
                (Message::Batch(x), Message::Batch(y)) => assert_eq!(x, y),
                (Message::Barrier(x), Message::Barrier(y)) => assert_eq!(x, y),
                (Message::End, Message::End) | (Message::Idle, Message::Idle) => {}
                (Message::Watermark(x), Message::Watermark(y)) => assert_eq!(x, y),
                (a, b) => panic!("{a:?} became {b:?}"),
            }
        }
    }

    #[test]
    fn garbage_is_a_protocol_error_not_a_panic() {
        let mut dec = FrameDecoder::new("peer");
        for frame in [vec![], vec![9], vec![0, 1, 2, 3], vec![1, b'{']] {
            assert!(dec.decode(Bytes::from(frame)).is_err());
        }
    }

    fn strings(values: Vec<String>) -> RecordBatch {
        let schema: SchemaRef = Arc::new(Schema::new(vec![Field::new("n", DataType::Int64, false), Field::new("s", DataType::Utf8, false)]));
        let n = values.len() as i64;
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(0..n)), Arc::new(StringArray::from(values))]).unwrap()
    }

    #[test]
    fn a_batch_bigger_than_the_frame_limit_is_split_into_frames_that_fit() {
        let limit = 16 << 10;
        let b = strings((0..5_000).map(|i| format!("record number {i} with some padding")).collect());
        let mut enc = FrameEncoder::with_limit(&b.schema(), limit).unwrap();
        let frames = enc.encode(&Message::Batch(b.clone())).unwrap();
        assert!(frames.len() > 1, "one frame for {} bytes", b.get_array_memory_size());
        assert!(frames.iter().all(|f| f.len() <= limit), "{:?}", frames.iter().map(|f| f.len()).collect::<Vec<_>>());
        // The receiver sees ordinary batches that together are the original, in order.
        let mut dec = FrameDecoder::new("test");
        let parts: Vec<RecordBatch> = frames
            .into_iter()
            .map(|f| match dec.decode(f).unwrap() {
                Message::Batch(b) => b,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(arrow::compute::concat_batches(&b.schema(), &parts).unwrap(), b);
        // The stream goes on after the split batch.
        let small = strings(vec!["x".into()]);
        let frames = enc.encode(&Message::Batch(small.clone())).unwrap();
        assert_eq!(frames.len(), 1);
        assert!(matches!(dec.decode(frames[0].clone()).unwrap(), Message::Batch(b) if b == small));
    }

    #[test]
    fn a_single_record_bigger_than_the_frame_limit_is_a_fatal_error_naming_the_limit() {
        let limit = 4 << 10;
        let b = strings(vec!["small".into(), "x".repeat(10_000), "small".into()]);
        let mut enc = FrameEncoder::with_limit(&b.schema(), limit).unwrap();
        let err = enc.encode(&Message::Batch(b)).unwrap_err();
        assert!(err.is_fatal(), "{err}");
        assert!(err.to_string().contains(&format!("frame limit of {limit} bytes")), "{err}");
    }

    #[test]
    fn a_hello_without_an_input_is_for_input_0_and_one_with_names_it() {
        let old = br#"{"run_id":"r","stage":2,"from":1,"to":0}"#;
        assert_eq!(decode_hello("p", old).unwrap(), Hello { run_id: "r".into(), stage: 2, input: 0, from: 1, to: 0 });
        let h = Hello { run_id: "r".into(), stage: 3, input: 1, from: 0, to: 1 };
        assert_eq!(decode_hello("p", &encode_hello(&h)).unwrap(), h);
    }
}
