//! The socket source: JSON lines from a TCP server, read by subtask 0.
//!
//! A socket keeps nothing for a reader that comes back: what the server sent
//! before a failure is gone, and the next run reads what it sends from then
//! on. So the source has no split positions to checkpoint, and a job using it
//! is at-most-once (`SourceSpec::replayable`). The stream is read without
//! blocking, like the Kafka source, so a barrier never waits for a line.
//!
//! Deliberately not here: reconnecting. A broken connection fails the run,
//! and the new run connects again, which keeps one rule for every failure.

use std::io::{ErrorKind, Read};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use weir_api::{BadLines, SocketSourceSpec};

use super::file::SkipLog;
use super::json::LineDecoder;
use super::{Poll, SourcePositions};
use crate::error::{Error, Result};

/// How long a connection attempt may take before the run fails.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);
/// How long to wait when the server has sent nothing new.
const IDLE: Duration = Duration::from_millis(5);
/// A line longer than this is refused rather than buffered without bound.
const MAX_LINE: usize = 16 << 20;

pub struct SocketReader {
    address: String,
    /// `None` for subtasks other than 0, and after the server closed.
    stream: Option<TcpStream>,
    /// Bytes read and not yet decoded (the start of an unfinished line).
    pending: Vec<u8>,
    decoder: LineDecoder,
    schema: SchemaRef,
    batch_size: usize,
    bad_lines: BadLines,
    /// Lines received, for error messages.
    line: u64,
    unreported_skipped: u64,
    skip_log: SkipLog,
}

impl SocketReader {
    pub fn new(spec: &SocketSourceSpec, schema: SchemaRef, subtask: u32) -> Result<Self> {
        let stream = if subtask == 0 { Some(connect(&spec.address)?) } else { None };
        if stream.is_some() {
            tracing::info!(address = %spec.address, "socket source connected; what the server sent before is not read (at-most-once)");
        }
        Ok(SocketReader {
            address: spec.address.clone(),
            stream,
            pending: Vec::new(),
            decoder: LineDecoder::new(&schema)?,
            schema,
            batch_size: spec.batch_size as usize,
            bad_lines: spec.bad_lines,
            line: 0,
            unreported_skipped: 0,
            skip_log: SkipLog::new(),
        })
    }

    pub fn poll(&mut self) -> Result<Poll> {
        loop {
            // Whole lines already received come first.
            while self.decoder.rows() < self.batch_size {
                let Some(end) = self.pending.iter().position(|b| *b == b'\n') else { break };
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                self.decode(&line)?;
            }
            if self.decoder.rows() >= self.batch_size {
                return Ok(Poll::Batch(self.decoder.finish(&self.schema)?));
            }
            let Some(stream) = &mut self.stream else {
                return self.flush_or(Poll::Finished);
            };
            let mut buf = [0u8; 64 * 1024];
            match stream.read(&mut buf) {
                Ok(0) => {
                    tracing::info!(address = %self.address, "the server closed the connection; the socket source has ended");
                    self.stream = None;
                    // A last line without its newline is still a line.
                    if !self.pending.is_empty() {
                        let line = std::mem::take(&mut self.pending);
                        self.decode(&line)?;
                    }
                }
                Ok(n) => {
                    self.pending.extend_from_slice(&buf[..n]);
                    if self.pending.len() > MAX_LINE && !self.pending.contains(&b'\n') {
                        return Err(self.bad(format!("a line longer than {MAX_LINE} bytes")));
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return self.flush_or(Poll::Wait(IDLE)),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::Network { peer: self.address.clone(), message: format!("socket source: {e}") }),
            }
        }
    }

    /// Emits the lines decoded so far, or `otherwise` when there are none:
    /// a quiet server must not hold back lines it already sent.
    fn flush_or(&mut self, otherwise: Poll) -> Result<Poll> {
        if self.decoder.rows() > 0 {
            return Ok(Poll::Batch(self.decoder.finish(&self.schema)?));
        }
        Ok(otherwise)
    }

    fn decode(&mut self, line: &[u8]) -> Result<()> {
        self.line += 1;
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(());
        }
        let Err(bad) = self.decoder.push_line(line) else { return Ok(()) };
        let message = format!("column {}: {}", bad.column, bad.message);
        match self.bad_lines {
            BadLines::Fail => Err(self.bad(format!(
                "line {} of the connection, {message} (the source's `bad_lines: skip` would leave such lines out and count them)",
                self.line
            ))),
            BadLines::Skip => {
                self.unreported_skipped += 1;
                self.skip_log.skipped(&self.address, self.line, &message);
                Ok(())
            }
        }
    }

    fn bad(&self, message: String) -> Error {
        Error::SourceLine { source_name: format!("socket source {}", self.address), message }
    }

    pub fn take_skipped(&mut self) -> u64 {
        std::mem::take(&mut self.unreported_skipped)
    }

    /// Nothing to keep: a socket cannot be read again from a position.
    pub fn positions(&self) -> SourcePositions {
        SourcePositions::default()
    }
}

fn connect(address: &str) -> Result<TcpStream> {
    let network = |message: String| Error::Network { peer: address.to_string(), message: format!("socket source: {message}") };
    let addrs: Vec<_> = address.to_socket_addrs().map_err(|e| network(format!("cannot resolve: {e}")))?.collect();
    let mut last = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, CONNECT_WITHIN) {
            Ok(s) => {
                s.set_nonblocking(true).map_err(|e| network(e.to_string()))?;
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(network(match last {
        Some(e) => format!("cannot connect: {e}"),
        None => "the name resolves to no address".into(),
    }))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;

    use super::*;

    fn spec(address: String, bad_lines: BadLines) -> SocketSourceSpec {
        let schema = weir_api::pipeline::source::Schema(vec![("id".into(), weir_api::pipeline::FieldType::Int64)]);
        SocketSourceSpec { address, schema, batch_size: 2, bad_lines }
    }

    fn read_all(reader: &mut SocketReader) -> Result<Vec<i64>> {
        let mut ids = Vec::new();
        loop {
            match reader.poll()? {
                Poll::Batch(b) => {
                    let col = b.column(0).as_any().downcast_ref::<arrow::array::Int64Array>().unwrap();
                    ids.extend(col.iter().map(|v| v.unwrap()));
                }
                Poll::Wait(d) => std::thread::sleep(d),
                Poll::Finished => return Ok(ids),
            }
        }
    }

    fn serve(payload: &'static [u8]) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            // In two pieces, the first ending inside a line.
            let (a, b) = payload.split_at(payload.len() / 2);
            s.write_all(a).unwrap();
            std::thread::sleep(Duration::from_millis(30));
            s.write_all(b).unwrap();
        });
        addr
    }

    #[test]
    fn lines_split_across_reads_arrive_whole_and_the_source_ends_when_the_server_closes() {
        let addr = serve(b"{\"id\":1}\n{\"id\":2}\n\n{\"id\":3}\n{\"id\":4}");
        let schema = crate::plan::source_schema(&weir_api::SourceSpec::Socket(spec(addr.clone(), BadLines::Fail)));
        let mut r = SocketReader::new(&spec(addr, BadLines::Fail), schema, 0).unwrap();
        assert_eq!(read_all(&mut r).unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(r.positions(), SourcePositions::default());
    }

    #[test]
    fn a_bad_line_fails_naming_the_address_and_line_or_is_skipped_and_counted() {
        let payload: &'static [u8] = b"{\"id\":1}\n{\"id\":\"x\"}\n{\"id\":3}\n";
        let addr = serve(payload);
        let schema = crate::plan::source_schema(&weir_api::SourceSpec::Socket(spec(addr.clone(), BadLines::Fail)));
        let mut r = SocketReader::new(&spec(addr.clone(), BadLines::Fail), schema.clone(), 0).unwrap();
        let err = read_all(&mut r).unwrap_err();
        assert!(err.is_fatal());
        let err = err.to_string();
        assert!(err.contains(&format!("socket source {addr}")) && err.contains("line 2") && err.contains("`id`"), "{err}");

        let addr = serve(payload);
        let mut r = SocketReader::new(&spec(addr, BadLines::Skip), schema, 0).unwrap();
        assert_eq!(read_all(&mut r).unwrap(), vec![1, 3]);
        assert_eq!(r.take_skipped(), 1);
    }

    #[test]
    fn a_server_that_is_not_there_is_a_network_error_naming_the_address() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let schema = crate::plan::source_schema(&weir_api::SourceSpec::Socket(spec(addr.clone(), BadLines::Fail)));
        let err = SocketReader::new(&spec(addr.clone(), BadLines::Fail), schema.clone(), 0).err().unwrap();
        assert!(!err.is_fatal(), "a restart may find the server: {err}");
        assert!(err.to_string().contains(&addr), "{err}");
        // Only subtask 0 connects.
        let mut other = SocketReader::new(&spec(addr, BadLines::Fail), schema, 1).unwrap();
        assert!(matches!(other.poll().unwrap(), Poll::Finished));
    }
}
