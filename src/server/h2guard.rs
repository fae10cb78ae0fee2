//! What the gRPC server's HTTP/2 stack (h2 0.4.20, the newest) gets wrong about two common
//! clients, mended on the bytes a client sends before h2 reads them. The guard reads the
//! client's frames as they pass, changes a few bytes in place, and never adds, removes or
//! reorders a byte; it holds back at most the first bytes of one frame header (8), until the
//! rest of that header arrives.
//!
//! - **Calls in flight at a GOAWAY.** A graceful GOAWAY (connection age) goes in two steps:
//!   GOAWAY(2^31-1) and a PING, then, when the client answers the PING, GOAWAY(last stream
//!   h2 took). h2 ignores the HEADERS, DATA and RST_STREAM of streams a client opened after
//!   that last one, but not their WINDOW_UPDATE, which it takes for a frame on a stream never
//!   opened: a connection error (PROTOCOL_ERROR) that kills every call still in flight.
//!   grpc-core (C++, Python, Ruby, PHP clients) sends exactly that: it answers the PING first,
//!   then a call it had queued, with a WINDOW_UPDATE for it. After the client's answer to
//!   h2's shutdown PING, the guard turns each WINDOW_UPDATE of a stream above the last one
//!   opened before it into a frame of an unknown type, which HTTP/2 says to ignore (RFC 9113
//!   §4.1): h2 ignores it as it ignores the stream's other frames; the client, told by the
//!   GOAWAY that the call was not taken, sends it again on a new connection.
//! - **The Unix socket's authority.** grpc-core sends a Unix socket's path, percent-encoded,
//!   as `:authority` (`tmp%2Fratelimitd.sock`); h2 refuses it as malformed and resets every
//!   stream. On a Unix socket, where the authority names nothing, the guard turns each byte of
//!   a literal `:authority` that a URI authority cannot hold into `_`, keeping its length, so
//!   that the client's and the server's HPACK tables stay alike. (grpc-core sends the value
//!   as a plain string; a Huffman-coded one is left as it is.)
//!
//! It also reads the frames the server writes, changing none, to count the streams and
//! connections h2 ends with an error before the service answered (a header block over
//! `--grpc-max-header-bytes`, a stream past the connection's 1024, a malformed request):
//! Envoy lets each such call through, and the service itself never sees it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::logs::{self, Throttle};
use crate::metrics::ResetLabels;

/// The client connection preface's length (RFC 9113 §3.4).
const PREFACE: u8 = 24;
/// A frame header's length.
const HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const PING: u8 = 0x6;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
/// What a WINDOW_UPDATE to be ignored becomes: no frame type registered (the IANA registry
/// stops far below), so every HTTP/2 endpoint ignores it.
const IGNORED: u8 = 0xfa;
const ACK: u8 = 0x1;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The payload of h2's shutdown PING (h2 0.4's `Ping::SHUTDOWN`, which it does not export);
/// `tests/bounds.rs` fails if h2 changes it.
const SHUTDOWN_PING: [u8; 8] = [0x0b, 0x7b, 0xa2, 0xf0, 0x8b, 0x9b, 0xfe, 0x54];

/// A client connection whose frames are read through the guard.
pub(crate) struct H2Guard<IO> {
    io: IO,
    walk: Walk,
    /// The server's frames, as written.
    sent: Sent,
    /// Bytes already read through the guard that a caller's buffer had no room for (at most a
    /// frame header): passed on first.
    ready: [u8; HEADER],
    ready_at: usize,
    ready_len: usize,
}

impl<IO> H2Guard<IO> {
    /// `io` guarded; `unix`: it came over the Unix socket (its authority is mended); the
    /// streams and connections the server ends with an error are counted in `resets`.
    pub(crate) fn new(io: IO, unix: bool, resets: Resets) -> Self {
        H2Guard {
            io,
            walk: Walk::new(unix),
            sent: Sent::new(resets),
            ready: [0; HEADER],
            ready_at: 0,
            ready_len: 0,
        }
    }
}

/// The payload length a frame header (its first 3 bytes) gives.
fn payload_len(head: &[u8]) -> usize {
    usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2])
}

/// Where errors the server ends streams and connections with are counted
/// (`ratelimit_grpc_resets_total`), and logged at most once per interval.
#[derive(Clone)]
pub(crate) struct Resets(pub(crate) Family<ResetLabels, Counter>);

impl Resets {
    fn count(&self, frame: u8, code: u32) {
        let frame = if frame == GOAWAY {
            "goaway"
        } else {
            "rst_stream"
        };
        let code = error_name(code);
        self.0.get_or_create(&ResetLabels { frame, code }).inc();
        static LOG: Throttle = Throttle::new(logs::EVERY);
        if let Some(held_back) = LOG.pass() {
            tracing::warn!(
                frame,
                code,
                held_back,
                "the gRPC port ended a call with an error before the service answered it: Envoy lets such a request through (a header block over --grpc-max-header-bytes ends so, with protocol_error)"
            );
        }
    }
}

/// An HTTP/2 error code's name (RFC 9113 §7), as a label.
fn error_name(code: u32) -> &'static str {
    match code {
        0x1 => "protocol_error",
        0x2 => "internal_error",
        0x3 => "flow_control_error",
        0x4 => "settings_timeout",
        0x5 => "stream_closed",
        0x6 => "frame_size_error",
        0x7 => "refused_stream",
        0x8 => "cancel",
        0x9 => "compression_error",
        0xa => "connect_error",
        0xb => "enhance_your_calm",
        0xc => "inadequate_security",
        0xd => "http_1_1_required",
        _ => "other",
    }
}

/// Where the writer stands in the server's bytes (frames only: a server's preface is its
/// SETTINGS frame). Reads the error code of each RST_STREAM and GOAWAY.
struct Sent {
    head: [u8; HEADER],
    head_len: usize,
    /// The current frame's type.
    kind: u8,
    /// Bytes of its payload still to pass.
    left: usize,
    /// The first 8 bytes of a RST_STREAM's or GOAWAY's payload, as they come.
    payload: [u8; 8],
    have: usize,
    resets: Resets,
}

impl Sent {
    fn new(resets: Resets) -> Self {
        Sent {
            head: [0; HEADER],
            head_len: 0,
            kind: 0,
            left: 0,
            payload: [0; 8],
            have: 0,
            resets,
        }
    }

    /// Takes in bytes the server wrote.
    fn wrote(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left == 0 && self.head_len < HEADER {
                let n = (HEADER - self.head_len).min(bytes.len());
                self.head[self.head_len..self.head_len + n].copy_from_slice(&bytes[..n]);
                self.head_len += n;
                bytes = &bytes[n..];
                if self.head_len == HEADER {
                    let h = self.head;
                    self.left = payload_len(&h);
                    self.kind = h[3];
                    self.have = 0;
                    self.head_len = 0;
                    if self.left == 0 {
                        self.done();
                    }
                }
                continue;
            }
            let n = self.left.min(bytes.len());
            if matches!(self.kind, RST_STREAM | GOAWAY) && self.have < 8 {
                let k = n.min(8 - self.have);
                self.payload[self.have..self.have + k].copy_from_slice(&bytes[..k]);
                self.have += k;
            }
            self.left -= n;
            bytes = &bytes[n..];
            if self.left == 0 {
                self.done();
            }
        }
    }

    fn done(&mut self) {
        let p = self.payload;
        let code = match (self.kind, self.have) {
            (RST_STREAM, 4..) => u32::from_be_bytes([p[0], p[1], p[2], p[3]]),
            (GOAWAY, 8) => u32::from_be_bytes([p[4], p[5], p[6], p[7]]),
            _ => 0,
        };
        if code != 0 {
            self.resets.count(self.kind, code);
        }
        self.kind = 0;
        self.have = 0;
    }
}

/// Where the reader stands in the client's bytes.
struct Walk {
    /// Preface bytes still to pass.
    preface: u8,
    /// The start of a frame header, held back until the rest arrives.
    held: [u8; HEADER],
    held_len: usize,
    /// Bytes of the current frame's payload still to pass.
    left: usize,
    /// What the current payload is read for.
    payload: Payload,
    /// The highest stream a HEADERS frame opened.
    opened: u32,
    /// After the client answered the shutdown PING: the last stream h2 took.
    last: Option<u32>,
    /// Mend `:authority` (Unix socket) with this reader of header blocks.
    hpack: Option<Hpack>,
}

/// What a payload's bytes are read for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Payload {
    /// Nothing.
    Pass,
    /// A PING's answer: its payload, gathered.
    PingAck { have: usize, bytes: [u8; 8] },
    /// A header block (HEADERS, CONTINUATION), after `skip` bytes of padding length and
    /// priority, and up to `pad` bytes of padding at the end (known once `padded` is read).
    Block {
        skip: usize,
        padded: bool,
        pad: usize,
    },
}

impl Walk {
    fn new(unix: bool) -> Self {
        Walk {
            preface: PREFACE,
            held: [0; HEADER],
            held_len: 0,
            left: 0,
            payload: Payload::Pass,
            opened: 0,
            last: None,
            hpack: unix.then(Hpack::default),
        }
    }

    /// Reads `bytes` (the held-back header start first, then what was just read), mending
    /// them in place: how many of them may be passed on; the rest, the start of a frame
    /// header, is held back.
    fn scan(&mut self, bytes: &mut [u8]) -> usize {
        let mut at = 0;
        while at < bytes.len() {
            if self.preface > 0 {
                let n = usize::from(self.preface).min(bytes.len() - at);
                self.preface -= n as u8;
                at += n;
            } else if self.left > 0 {
                let n = self.left.min(bytes.len() - at);
                self.payload_bytes(&mut bytes[at..at + n]);
                self.left -= n;
                at += n;
                if self.left == 0 {
                    self.payload_done();
                }
            } else if bytes.len() - at < HEADER {
                let rest = bytes.len() - at;
                self.held[..rest].copy_from_slice(&bytes[at..]);
                self.held_len = rest;
                return at;
            } else {
                self.frame_header(&mut bytes[at..at + HEADER]);
                at += HEADER;
                if self.left == 0 {
                    self.payload_done();
                }
            }
        }
        at
    }

    fn frame_header(&mut self, head: &mut [u8]) {
        let len = payload_len(head);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
        self.left = len;
        self.payload = Payload::Pass;
        match kind {
            HEADERS => {
                self.opened = self.opened.max(stream);
                if let Some(hpack) = &mut self.hpack {
                    hpack.state = Hp::Field;
                    self.payload = Payload::Block {
                        skip: usize::from(flags & PADDED != 0)
                            + 5 * usize::from(flags & PRIORITY != 0),
                        padded: flags & PADDED != 0,
                        pad: 0,
                    };
                }
            }
            // The block goes on where the last frame left it.
            CONTINUATION if self.hpack.is_some() => {
                self.payload = Payload::Block {
                    skip: 0,
                    padded: false,
                    pad: 0,
                };
            }
            PING if flags & ACK != 0 && len == 8 => {
                self.payload = Payload::PingAck {
                    have: 0,
                    bytes: [0; 8],
                };
            }
            WINDOW_UPDATE if self.last.is_some_and(|last| stream > last) => {
                head[3] = IGNORED;
            }
            _ => {}
        }
    }

    fn payload_bytes(&mut self, bytes: &mut [u8]) {
        // The payload still to come from the first of `bytes` on (padding included).
        let to_come = self.left;
        let total = bytes.len();
        match &mut self.payload {
            Payload::Pass => {}
            Payload::PingAck { have, bytes: ping } => {
                ping[*have..*have + bytes.len()].copy_from_slice(bytes);
                *have += bytes.len();
            }
            Payload::Block { skip, padded, pad } => {
                let Some(hpack) = &mut self.hpack else {
                    return;
                };
                let mut bytes = bytes;
                while !bytes.is_empty() {
                    if *skip > 0 {
                        if *padded {
                            *pad = usize::from(bytes[0]);
                            *padded = false;
                        }
                        let n = (*skip).min(bytes.len());
                        *skip -= n;
                        bytes = &mut bytes[n..];
                        continue;
                    }
                    // The payload still to come from the first of `bytes` on, of which the
                    // last `pad` bytes are padding.
                    let from_here = to_come - (total - bytes.len());
                    let block = bytes.len().min(from_here.saturating_sub(*pad));
                    let (body, _padding) = bytes.split_at_mut(block);
                    hpack.read(body);
                    break;
                }
            }
        }
    }

    fn payload_done(&mut self) {
        if let Payload::PingAck { have: 8, bytes } = self.payload
            && bytes == SHUTDOWN_PING
        {
            // h2 sends its last GOAWAY on this answer, naming the last stream it took: the
            // last one opened before it.
            self.last = Some(self.opened);
        }
        self.payload = Payload::Pass;
    }
}

/// A reader of HPACK header blocks (RFC 7541) that mends literal `:authority` values in
/// place. It keeps no table: a field named by a dynamic-table index is one it mended (or
/// let pass) when the field was first sent.
#[derive(Default, Debug)]
struct Hpack {
    state: Hp,
}

/// Where the reader stands in a header block.
#[derive(Default, Debug, Clone, Copy)]
enum Hp {
    /// At a field's first byte.
    #[default]
    Field,
    /// In an integer's continuation bytes; `then` says what it was.
    Int { value: u64, shift: u32, then: Then },
    /// At a string's first byte (its length); `authority`: the field is `:authority`.
    StrLen { name: bool, authority: bool },
    /// In a string's bytes.
    Str {
        left: u64,
        name: bool,
        huffman: bool,
        authority: bool,
        /// Of a name: how much of `:authority` it matched so far (`None`: not it).
        matched: Option<usize>,
    },
    /// Lost (a malformed block, which h2 refuses): nothing more is read until the next.
    Lost,
}

/// What an integer was.
#[derive(Debug, Clone, Copy)]
enum Then {
    /// An index, or a table size: the field is whole.
    Done,
    /// A literal's name index: its value (and its name, if 0) follows.
    NameIndex,
    /// A string's length.
    Len {
        name: bool,
        huffman: bool,
        authority: bool,
    },
}

/// `:authority`'s index in HPACK's static table.
const AUTHORITY_INDEX: u64 = 1;
const AUTHORITY: &[u8] = b":authority";

impl Hpack {
    fn read(&mut self, bytes: &mut [u8]) {
        let mut at = 0;
        while at < bytes.len() {
            let b = bytes[at];
            self.state = match self.state {
                Hp::Lost => return,
                Hp::Field => {
                    at += 1;
                    if b & 0x80 != 0 {
                        self.int(b, 0x7f, Then::Done)
                    } else if b & 0xc0 == 0x40 {
                        self.int(b, 0x3f, Then::NameIndex)
                    } else if b & 0xe0 == 0x20 {
                        self.int(b, 0x1f, Then::Done)
                    } else {
                        self.int(b, 0x0f, Then::NameIndex)
                    }
                }
                Hp::Int { value, shift, then } => {
                    at += 1;
                    if shift > 56 {
                        Hp::Lost
                    } else {
                        let value = value + (u64::from(b & 0x7f) << shift);
                        if b & 0x80 != 0 {
                            Hp::Int {
                                value,
                                shift: shift + 7,
                                then,
                            }
                        } else {
                            self.after(value, then)
                        }
                    }
                }
                Hp::StrLen { name, authority } => {
                    at += 1;
                    self.int(
                        b,
                        0x7f,
                        Then::Len {
                            name,
                            huffman: b & 0x80 != 0,
                            authority,
                        },
                    )
                }
                Hp::Str {
                    left,
                    name,
                    huffman,
                    authority,
                    matched,
                } => {
                    let n = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len() - at);
                    let part = &mut bytes[at..at + n];
                    at += n;
                    let left = left - n as u64;
                    let matched = matched.and_then(|m| {
                        (!huffman && AUTHORITY.get(m..m + part.len()) == Some(&*part))
                            .then_some(m + part.len())
                    });
                    if authority && !huffman {
                        for c in part.iter_mut() {
                            if !c.is_ascii_alphanumeric() && !b"-._~".contains(c) {
                                *c = b'_';
                            }
                        }
                    }
                    if left > 0 {
                        Hp::Str {
                            left,
                            name,
                            huffman,
                            authority,
                            matched,
                        }
                    } else if name {
                        Hp::StrLen {
                            name: false,
                            authority: matched == Some(AUTHORITY.len()),
                        }
                    } else {
                        Hp::Field
                    }
                }
            };
        }
    }

    /// An integer whose first byte is `b`, with `mask` its prefix.
    fn int(&self, b: u8, mask: u8, then: Then) -> Hp {
        if b & mask == mask {
            Hp::Int {
                value: u64::from(mask),
                shift: 0,
                then,
            }
        } else {
            self.after(u64::from(b & mask), then)
        }
    }

    fn after(&self, value: u64, then: Then) -> Hp {
        match then {
            Then::Done => Hp::Field,
            Then::NameIndex if value == 0 => Hp::StrLen {
                name: true,
                authority: false,
            },
            Then::NameIndex => Hp::StrLen {
                name: false,
                authority: value == AUTHORITY_INDEX,
            },
            Then::Len { name, .. } if value == 0 && name => Hp::StrLen {
                name: false,
                authority: false,
            },
            Then::Len { .. } if value == 0 => Hp::Field,
            Then::Len {
                name,
                huffman,
                authority,
            } => Hp::Str {
                left: value,
                name,
                huffman,
                authority,
                matched: name.then_some(0),
            },
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for H2Guard<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready_at < this.ready_len {
                let n = (this.ready_len - this.ready_at).min(buf.remaining());
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                return Poll::Ready(Ok(()));
            }
            let held = this.walk.held_len;
            if held == 0 {
                // The usual case: read straight into the caller's buffer.
                let before = buf.filled().len();
                std::task::ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
                let end = buf.filled().len();
                if end == before {
                    return Poll::Ready(Ok(())); // end of stream
                }
                let passed = this.walk.scan(&mut buf.filled_mut()[before..]);
                buf.set_filled(before + passed);
                if passed > 0 {
                    return Poll::Ready(Ok(()));
                }
                continue; // only the start of a header came: read on
            }
            if buf.remaining() <= held {
                // Too small a buffer to put the held bytes before new ones: h2's reads ask
                // for as little as one byte when its buffer is nearly full, which a loaded
                // machine's large reads make common. The header is completed here, read
                // through the guard, and passed on over as many reads as it takes.
                let mut head = this.walk.held;
                let mut fresh = ReadBuf::new(&mut head[held..]);
                std::task::ready!(Pin::new(&mut this.io).poll_read(cx, &mut fresh))?;
                let read = fresh.filled().len();
                this.walk.held_len = 0;
                let passed = if read == 0 {
                    held // end of stream: the held bytes, as they are
                } else {
                    // A header still short is held back again, by the walk.
                    this.walk.scan(&mut head[..held + read])
                };
                this.ready[..passed].copy_from_slice(&head[..passed]);
                (this.ready_at, this.ready_len) = (0, passed);
                continue;
            }
            let room = buf.initialize_unfilled_to(buf.remaining().min(held + 16 * 1024));
            let mut fresh = ReadBuf::new(&mut room[held..]);
            std::task::ready!(Pin::new(&mut this.io).poll_read(cx, &mut fresh))?;
            let read = fresh.filled().len();
            room[..held].copy_from_slice(&this.walk.held[..held]);
            this.walk.held_len = 0;
            if read == 0 {
                buf.advance(held); // end of stream: the held bytes, as they are
                return Poll::Ready(Ok(()));
            }
            let passed = this.walk.scan(&mut room[..held + read]);
            buf.advance(passed);
            if passed > 0 {
                return Poll::Ready(Ok(()));
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for H2Guard<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write(cx, buf))?;
        this.sent.wrote(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let n = std::task::ready!(Pin::new(&mut this.io).poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for b in bufs {
            if left == 0 {
                break;
            }
            let k = left.min(b.len());
            this.sent.wrote(&b[..k]);
            left -= k;
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for H2Guard<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: super::conn::InLane> super::conn::InLane for H2Guard<IO> {
    fn lane(&self) -> usize {
        self.io.lane()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = len.to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    }

    /// `input` read through a fresh walk in reads of the sizes `cuts` gives in turn, as
    /// `poll_read` does: held bytes go first into the next read.
    fn through(unix: bool, input: &[u8], cut: usize) -> Vec<u8> {
        let mut walk = Walk::new(unix);
        let mut out = Vec::new();
        for chunk in input.chunks(cut) {
            let mut bytes = walk.held[..walk.held_len].to_vec();
            walk.held_len = 0;
            bytes.extend(chunk);
            let passed = walk.scan(&mut bytes);
            out.extend(&bytes[..passed]);
        }
        out.extend(&walk.held[..walk.held_len]);
        out
    }

    const PREFACE_BYTES: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    /// A literal field, new name, no indexing, plain strings.
    fn literal(name: &str, value: &str) -> Vec<u8> {
        let mut b = vec![0, name.len() as u8];
        b.extend(name.as_bytes());
        b.push(value.len() as u8);
        b.extend(value.as_bytes());
        b
    }

    /// The server's RST_STREAM and GOAWAY frames with an error are counted, by frame and
    /// code, however its writes cut them; those with NO_ERROR and other frames are not.
    #[test]
    fn the_errors_the_server_ends_streams_with_are_counted_however_writes_cut_them() {
        let mut out = frame(4, 0, 0, &[0, 5, 0, 0, 0x40, 0]); // SETTINGS
        out.extend(frame(1, 5, 1, &[0x48, 3, b'4', b'3', b'1'])); // a 431
        out.extend(frame(3, 0, 1, &[0, 0, 0, 1])); // RST_STREAM PROTOCOL_ERROR
        out.extend(frame(3, 0, 3, &[0, 0, 0, 0])); // RST_STREAM NO_ERROR
        out.extend(frame(0, 1, 5, &[0, 0, 0, 0, 3, 0, 0, 0, 7])); // DATA that looks like one
        out.extend(frame(3, 0, 7, &[0, 0, 0, 7])); // REFUSED_STREAM
        out.extend(frame(7, 0, 0, &[0, 0, 0, 7, 0, 0, 0, 0])); // GOAWAY NO_ERROR
        out.extend(frame(7, 0, 0, &[0, 0, 0, 9, 0, 0, 0, 0xb, b'x'])); // ENHANCE_YOUR_CALM
        let count = |f: &Family<ResetLabels, Counter>, frame, code| {
            f.get_or_create(&ResetLabels { frame, code }).get()
        };
        for cut in 1..=out.len() {
            let family = Family::default();
            let mut sent = Sent::new(Resets(family.clone()));
            for chunk in out.chunks(cut) {
                sent.wrote(chunk);
            }
            assert_eq!(
                count(&family, "rst_stream", "protocol_error"),
                1,
                "cut {cut}"
            );
            assert_eq!(
                count(&family, "rst_stream", "refused_stream"),
                1,
                "cut {cut}"
            );
            assert_eq!(
                count(&family, "goaway", "enhance_your_calm"),
                1,
                "cut {cut}"
            );
            assert_eq!(count(&family, "rst_stream", "cancel"), 0, "cut {cut}");
            assert_eq!(count(&family, "goaway", "other"), 0, "cut {cut}");
        }
    }

    #[test]
    fn window_updates_above_the_last_stream_are_ignored_only_after_the_shutdown_ping() {
        let mut input = PREFACE_BYTES.to_vec();
        input.extend(frame(1, 4, 1, &literal(":path", "/a")));
        let early = input.len();
        input.extend(frame(8, 0, 3, &[0, 0, 1, 0])); // before the answer: left alone
        input.extend(frame(
            6,
            1,
            0,
            &[0x3b, 0x7c, 0xdb, 0x7a, 0x0b, 0x87, 0x16, 0xb4],
        )); // a user PING's
        input.extend(frame(6, 1, 0, &SHUTDOWN_PING));
        input.extend(frame(1, 4, 3, &literal(":path", "/a")));
        let late = input.len();
        input.extend(frame(8, 0, 3, &[0, 0, 1, 0]));
        let own = input.len();
        input.extend(frame(8, 0, 1, &[0, 0, 1, 0])); // stream 1 was taken: left alone
        input.extend(frame(8, 0, 0, &[0, 0, 1, 0])); // the connection's
        for cut in 1..=input.len() {
            let out = through(false, &input, cut);
            assert_eq!(out.len(), input.len(), "cut {cut}");
            let mut expected = input.clone();
            expected[late + 3] = IGNORED;
            assert_eq!(out, expected, "cut {cut}");
            assert_eq!(out[early + 3], WINDOW_UPDATE);
            assert_eq!(out[own + 3], WINDOW_UPDATE);
        }
    }

    /// The guard keeps its place however small the reader's buffer: h2 reads into what is
    /// left of its buffer, as little as a byte when it is nearly full.
    #[tokio::test]
    async fn tiny_reads_keep_the_guard_in_place() {
        use tokio::io::AsyncReadExt;
        let mut input = PREFACE_BYTES.to_vec();
        input.extend(frame(1, 4, 1, &literal(":path", "/a")));
        input.extend(frame(6, 1, 0, &SHUTDOWN_PING));
        input.extend(frame(1, 4, 3, &literal(":path", "/a")));
        let late = input.len();
        input.extend(frame(8, 0, 3, &[0, 0, 1, 0]));
        input.extend(frame(0, 1, 3, b"data"));
        let mut expected = input.clone();
        expected[late + 3] = IGNORED;
        for size in 1..=HEADER + 3 {
            // Reads alternate between a tiny buffer and a roomy one.
            let mut guard = H2Guard::new(
                std::io::Cursor::new(input.clone()),
                false,
                Resets(Family::default()),
            );
            let mut out: Vec<u8> = Vec::new();
            for i in 0.. {
                let mut buf = vec![0; if i % 2 == 0 { size } else { 64 }];
                let n = guard.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                out.extend(&buf[..n]);
            }
            assert_eq!(out, expected, "reads of {size}");
        }
    }

    #[test]
    fn a_unix_sockets_authority_is_mended_in_place_wherever_the_reads_cut() {
        let sent = "tmp%2Fr%3Al.sock";
        let mended = "tmp_2Fr_3Al.sock";
        // New name, static name index (with incremental indexing), padded with priority, and
        // a block split over CONTINUATION inside a value; a Huffman-coded value, other
        // fields and the padding are left alone.
        let frames = |authority: &str| {
            let mut block = literal(":authority", authority);
            block.extend([0x41, authority.len() as u8]);
            block.extend(authority.as_bytes());
            block.extend([0x82, 0x3f, 0xe1, 0x1f]); // indexed; a table size update of 4096
            block.extend([0x01, 0x83, 0xaa, 0xbb, 0xcc]); // Huffman-coded
            block.extend(literal("x-a", "%%"));
            let mut padded = vec![3, 0, 0, 0, 0, 16]; // pad length, priority
            padded.extend(&block[..34]);
            padded.extend([b'%'; 3]); // padding
            let mut input = PREFACE_BYTES.to_vec();
            input.extend(frame(1, 0x8 | 0x20, 1, &padded));
            input.extend(frame(9, 4, 1, &block[34..]));
            input
        };
        let (input, expected) = (frames(sent), frames(mended));
        for cut in 1..=input.len() {
            assert_eq!(through(true, &input, cut), expected, "cut {cut}");
            assert_eq!(
                through(false, &input, cut),
                input,
                "TCP: untouched, cut {cut}"
            );
        }
    }
}
