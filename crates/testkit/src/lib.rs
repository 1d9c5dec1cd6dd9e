//! What pdmesh's tests share: services started in process ([`service`]), the committed
//! fixtures ([`fixture`], and llama.cpp's answers for the default model in
//! [`reference`]), grammars run over bytes ([`grammar`]), a waker for the test's
//! own thread ([`wake_here`]), the benchmarks' arguments and medians ([`bench`]), and
//! addresses that refuse. Tests never pick a port by binding one and letting it go: a
//! test running beside them could take it in between. A listener a test needs is bound on
//! port 0 and handed to the service as it is; an address where nothing may answer is
//! [`Refusing`], a socket that holds its port and never listens.

#![forbid(unsafe_code)]

pub mod bench;
pub mod grammar;
pub mod reference;
pub mod service;

use std::net::SocketAddr;

/// A loopback port that refuses every connection for as long as this lives: the socket is
/// bound, so no other process can take the port, and never listens, so the kernel
/// answers each connection attempt with a reset (ECONNREFUSED).
#[derive(Debug)]
pub struct Refusing {
    addr: SocketAddr,
    _socket: tokio::net::TcpSocket,
}

impl Refusing {
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
        socket
            .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind a loopback port");
        let addr = socket.local_addr().expect("the bound address");
        Self {
            addr,
            _socket: socket,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Default for Refusing {
    fn default() -> Self {
        Self::new()
    }
}

/// The committed fixture `name` (`tests/fixtures/`: llama.cpp's own answers for the
/// default model, made by scripts/reference/gen_reference.py, and the inputs tests in
/// several crates and languages share), parsed.
pub fn fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures"))
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A waker that unparks the calling thread: for a test or benchmark that drives an engine
/// with a host tier from its own thread and parks while the tier's answers are on their
/// way.
pub fn wake_here() -> std::task::Waker {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusing_port_refuses_and_cannot_be_taken() {
        let r = Refusing::new();
        let err = std::net::TcpStream::connect(r.addr()).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
        assert!(
            std::net::TcpListener::bind(r.addr()).is_err(),
            "the port is held"
        );
        drop(r);
    }
}
