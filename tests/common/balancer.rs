//! A stand-in for a Kubernetes Service between Envoy and ratelimitd's replicas: a TCP balancer
//! on a free loopback port that sends each new connection, round robin, to one of the replicas
//! listed, and closes it at once when that replica refuses it (as a connection to a pod that
//! has exited is reset). A replica is listed by the test once its health says SERVING and is
//! taken off some time after it was sent SIGTERM, as an endpoint's removal reaches kube-proxy or
//! Envoy's EDS late. Connections already made stay where they are.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use super::redis::free_port;

#[derive(Default)]
struct Listed {
    ports: Vec<u16>,
    next: usize,
    /// Connections the balancer could not make (the replica it chose refused).
    refused: u64,
}

/// The balancer; its task and every connection it forwards end with it.
pub(crate) struct Balancer {
    pub port: u16,
    listed: Arc<Mutex<Listed>>,
    tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Balancer {
    pub(crate) async fn start() -> Balancer {
        let (listener, port) = loop {
            let port = free_port();
            if let Ok(l) = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await {
                break (l, port);
            }
        };
        let listed = Arc::new(Mutex::new(Listed::default()));
        let tasks: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (listed, tasks) = (listed.clone(), tasks.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    let chosen = {
                        let mut l = listed.lock().unwrap();
                        if l.ports.is_empty() {
                            None
                        } else {
                            let i = l.next % l.ports.len();
                            l.next = l.next.wrapping_add(1);
                            Some(l.ports[i])
                        }
                    };
                    let listed = listed.clone();
                    let forward = tokio::spawn(async move {
                        let Some(port) = chosen else { return };
                        match TcpStream::connect(("127.0.0.1", port)).await {
                            Ok(mut replica) => {
                                let _ = replica.set_nodelay(true);
                                let _ = client.set_nodelay(true);
                                let mut client = client;
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut replica).await;
                            }
                            Err(_) => {
                                // The client's connection is closed before a byte.
                                listed.lock().unwrap().refused += 1;
                                drop(client);
                            }
                        }
                    });
                    let mut t = tasks.lock().unwrap();
                    t.retain(|t| !t.is_finished());
                    t.push(forward);
                }
            })
        };
        tasks.lock().unwrap().push(accept);
        Balancer {
            port,
            listed,
            tasks,
        }
    }

    /// Lists the replica on gRPC `port`: new connections may go to it from now on.
    pub(crate) fn add(&self, port: u16) {
        self.listed.lock().unwrap().ports.push(port);
    }

    /// Takes the replica on `port` off the list after `lag` (the time the endpoint's removal
    /// takes to arrive); connections made before stay.
    pub(crate) fn remove_after(&self, port: u16, lag: Duration) {
        let listed = self.listed.clone();
        let remove = tokio::spawn(async move {
            tokio::time::sleep(lag).await;
            listed.lock().unwrap().ports.retain(|p| *p != port);
        });
        self.tasks.lock().unwrap().push(remove);
    }

    /// Sends the next new connection to the replica on `port` (listed), the round robin going
    /// on from there: the worst case of a random pick, made certain.
    pub(crate) fn next_to(&self, port: u16) {
        let mut l = self.listed.lock().unwrap();
        if let Some(i) = l.ports.iter().position(|p| *p == port) {
            l.next = i;
        }
    }

    /// Connections sent to a replica that refused them.
    pub(crate) fn refused(&self) -> u64 {
        self.listed.lock().unwrap().refused
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap().iter() {
            t.abort();
        }
    }
}
