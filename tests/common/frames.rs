//! A raw HTTP/2 client: frames written by hand, to send what a client library would not
//! (resets at chosen moments, a zero flow-control window, oversized header blocks).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/2 frame.
pub(crate) fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A HEADERS block of literal fields (no indexing, no Huffman): all HPACK needs here.
pub(crate) fn headers(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

pub(crate) const CALL: [(&str, &str); 6] = [
    (":method", "POST"),
    (":scheme", "http"),
    (
        ":path",
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    ),
    (":authority", "ratelimitd"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
];

/// A gRPC message frame (uncompressed) holding `message`.
pub(crate) fn grpc_message(message: &[u8]) -> Vec<u8> {
    let mut m = vec![0];
    m.extend_from_slice(&(message.len() as u32).to_be_bytes());
    m.extend_from_slice(message);
    m
}

/// Writes `bytes`, giving up after a second (the server may stop reading from us).
pub(crate) async fn send(socket: &mut TcpStream, bytes: &[u8]) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(1), socket.write_all(bytes)).await,
        Ok(Ok(()))
    )
}

/// One frame from `socket`, answering the server's SETTINGS and PINGs on the way as any HTTP/2
/// client does: (type, flags, stream, payload), or `None` once the server has closed.
pub(crate) async fn next_frame(socket: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    loop {
        let (kind, flags, stream, payload) = read_frame(socket).await?;
        match (kind, flags & 1) {
            (4, 0) => {
                let _ = send(socket, &frame(4, 1, 0, &[])).await;
            }
            (6, 0) => {
                let _ = send(socket, &frame(6, 1, 0, &payload)).await;
            }
            (4 | 6, _) => {}
            _ => return Some((kind, flags, stream, payload)),
        }
    }
}

/// One frame: its type, flags, stream and payload.
pub(crate) async fn read_frame(socket: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    socket.read_exact(&mut head).await.ok()?;
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let mut payload = vec![0; len];
    socket.read_exact(&mut payload).await.ok()?;
    let stream = u32::from_be_bytes([head[5] & 0x7f, head[6], head[7], head[8]]);
    Some((head[3], head[4], stream, payload))
}

/// An HTTP/2 connection to the gRPC port, greeted.
pub(crate) async fn h2_connection(port: u16) -> TcpStream {
    let mut socket = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(4, 0, 0, &[]));
    assert!(send(&mut socket, &hello).await);
    socket
}

/// An HPACK string of plain bytes (no Huffman), its length as a 7-bit-prefix integer.
pub(crate) fn hpack_string(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut n = s.len();
    if n < 127 {
        out.push(n as u8);
    } else {
        out.push(127);
        n -= 127;
        while n >= 128 {
            out.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        out.push(n as u8);
    }
    out.extend_from_slice(s);
    out
}

/// `block` sent as one HEADERS and as many CONTINUATION frames as HTTP/2's default frame
/// size needs, on `stream`.
pub(crate) fn header_frames(stream: u32, block: &[u8]) -> Vec<u8> {
    let chunks: Vec<&[u8]> = block.chunks(16 << 10).collect();
    let mut out = Vec::new();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = if i + 1 == chunks.len() { 4 } else { 0 }; // END_HEADERS
        let kind = if i == 0 { 1 } else { 9 };
        out.extend(frame(kind, last, stream, chunk));
    }
    out
}
