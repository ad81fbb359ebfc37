//! Frames on a data connection: length-delimited, a kind byte, then the
//! payload. Record batches use the Arrow IPC stream format (the schema once,
//! in the first batch frame); barriers are JSON; end-of-stream is empty.

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
const KIND_HELLO: u8 = 3;

/// Frames up to 256 MiB; a bigger length is a protocol error, not an allocation.
pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(256 << 20).new_codec()
}

/// The first frame on a data connection: which channel it carries.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Hello {
    pub run_id: String,
    /// The downstream stage.
    pub stage: usize,
    pub from: u32,
    pub to: u32,
}

pub fn encode_hello(h: &Hello) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u8(KIND_HELLO);
    b.extend_from_slice(&serde_json::to_vec(h).unwrap_or_default());
    b.freeze()
}

pub fn decode_hello(peer: &str, frame: &[u8]) -> Result<Hello> {
    match frame.split_first() {
        Some((&KIND_HELLO, body)) => serde_json::from_slice(body).map_err(|e| Error::Protocol { peer: peer.into(), message: format!("bad hello: {e}") }),
        _ => Err(Error::Protocol { peer: peer.into(), message: "expected a hello frame".into() }),
    }
}

/// Encodes messages of one connection (keeps the IPC stream state).
pub struct FrameEncoder {
    ipc: StreamWriter<Vec<u8>>,
}

impl FrameEncoder {
    pub fn new(schema: &SchemaRef) -> Result<Self> {
        Ok(FrameEncoder { ipc: StreamWriter::try_new(Vec::new(), schema).map_err(Error::arrow("encoding schema"))? })
    }

    pub fn encode(&mut self, msg: &Message) -> Result<Bytes> {
        let mut out = BytesMut::new();
        match msg {
            Message::Batch(b) => {
                self.ipc.write(b).map_err(Error::arrow("encoding a record batch"))?;
                let bytes = std::mem::take(self.ipc.get_mut());
                out.put_u8(KIND_BATCH);
                out.extend_from_slice(&bytes);
            }
            Message::Barrier(b) => {
                out.put_u8(KIND_BARRIER);
                out.extend_from_slice(&serde_json::to_vec(b).unwrap_or_default());
            }
            Message::End => out.put_u8(KIND_END),
        }
        Ok(out.freeze())
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
            k => Err(bad(format!("unknown frame kind {k}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::Int64Array;
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    #[test]
    fn batches_and_barriers_survive_the_wire_in_order() {
        let schema: SchemaRef = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1, 2, 3]))]).unwrap();
        let mut enc = FrameEncoder::new(&schema).unwrap();
        let mut dec = FrameDecoder::new("test");
        let barrier = Barrier { checkpoint_id: 4, savepoint: false, is_final: false, dir: "checkpoints/chk-4".into() };
        for msg in [Message::Batch(b.clone()), Message::Barrier(barrier.clone()), Message::Batch(b.clone()), Message::End] {
            let frame = enc.encode(&msg).unwrap();
            match (msg, dec.decode(frame).unwrap()) {
                (Message::Batch(x), Message::Batch(y)) => assert_eq!(x, y),
                (Message::Barrier(x), Message::Barrier(y)) => assert_eq!(x, y),
                (Message::End, Message::End) => {}
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
}
