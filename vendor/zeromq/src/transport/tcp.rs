use std::sync::Arc;

#[cfg(feature = "tokio-runtime")]
use tokio::net::{TcpListener, TcpStream};

#[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
use async_std::net::{TcpListener, TcpStream};

use super::make_framed;
use super::AcceptStopHandle;
use crate::async_rt;
use crate::codec::FramedIo;
use crate::endpoint::{Endpoint, Host, Port};
use crate::task_handle::TaskHandle;
use crate::ZmqResult;

use futures::{select, FutureExt};

#[cfg(feature = "tokio-runtime")]
const TCP_SOCKET_BUFFER_SIZE: usize = 4 * 1024 * 1024;

pub(crate) async fn connect(
    host: &Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
) -> ZmqResult<(FramedIo, Endpoint)> {
    let raw_socket = TcpStream::connect((host.to_string().as_str(), port)).await?;
    // For some reason set_nodelay doesn't work on windows. See
    // https://github.com/zeromq/zmq.rs/issues/148 for details
    #[cfg(not(windows))]
    raw_socket.set_nodelay(true)?;
    tune_socket_buffers(&raw_socket);
    let peer_addr = raw_socket.peer_addr()?;

    Ok((
        make_framed(raw_socket, options),
        Endpoint::from_tcp_addr(peer_addr),
    ))
}

pub(crate) async fn begin_accept<T>(
    host: Host,
    port: Port,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((host.to_string().as_str(), port)).await?;
    let resolved_addr = listener.local_addr()?;
    debug_assert_ne!(resolved_addr.port(), 0);
    let endpoint = Endpoint::Tcp(host, resolved_addr.port());
    begin_accept_bound(listener, endpoint, options, cback).await
}

pub(crate) async fn begin_accept_listener<T>(
    listener: std::net::TcpListener,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let resolved_addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;

    #[cfg(feature = "tokio-runtime")]
    let listener = TcpListener::from_std(listener)?;
    #[cfg(any(feature = "async-std-runtime", feature = "async-dispatcher-runtime"))]
    let listener = TcpListener::from(listener);

    begin_accept_bound(
        listener,
        Endpoint::from_tcp_addr(resolved_addr),
        options,
        cback,
    )
    .await
}

async fn begin_accept_bound<T>(
    listener: TcpListener,
    endpoint: Endpoint,
    options: Arc<crate::SocketOptions>,
    cback: impl Fn(ZmqResult<(FramedIo, Endpoint)>) -> T + Send + 'static,
) -> ZmqResult<(Endpoint, AcceptStopHandle)>
where
    T: std::future::Future<Output = ()> + Send + 'static,
{
    let (stop_channel, stop_callback) = futures::channel::oneshot::channel::<()>();
    // kvlane patch: accepted connections open at once, capped; at the cap
    // a connection its owner did not protect is evicted for the new one,
    // the one the eviction policy names (default: the oldest), so
    // connections that never prove themselves cannot hold every slot. When
    // the policy names none yet (every open one is still owed work by this
    // side), the new connection waits, and no other is accepted, until a
    // slot frees or one may go: accepting faster than connections are
    // served would evict them unread. Only when every open connection is
    // protected is the new one refused (closed right after accept).
    let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut slots: std::collections::VecDeque<Arc<crate::codec::SlotState>> =
        std::collections::VecDeque::new();
    // Evicted connections whose read half has not ended yet: they still
    // hold a socket, so at most `max` of them at once.
    let mut evicted: Vec<Arc<crate::codec::SlotState>> = Vec::new();
    let task_handle = async_rt::task::spawn(async move {
        let mut stop_callback = stop_callback.fuse();
        let max = options.max_connections.unwrap_or(usize::MAX);
        loop {
            let incoming = select! {
                incoming = listener.accept().fuse() => incoming,
                _ = stop_callback => break,
            };
            let admitted = match incoming {
                Ok(accepted) => {
                    let room = select! {
                        room = make_room(max, &live, &mut slots, &mut evicted, &options).fuse() => room,
                        _ = stop_callback => break,
                    };
                    match room {
                        // Dropping the stream closes it.
                        Room::Full => Err(std::io::Error::other("max_connections reached")),
                        Room::Free => Ok(accepted),
                    }
                }
                Err(e) => Err(e),
            };
            let incoming = admitted.map(|(raw_socket, remote_addr)| {
                live.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                let state = Arc::new(crate::codec::SlotState::default());
                slots.push_back(Arc::clone(&state));
                let slot = crate::codec::ConnectionSlot {
                    live: Arc::clone(&live),
                    state,
                };
                (raw_socket, remote_addr, slot)
            });
            let maybe_accepted: Result<_, _> = incoming
                .and_then(|(raw_socket, remote_addr, slot)| {
                    raw_socket.set_nodelay(true).map(|_| {
                        tune_socket_buffers(&raw_socket);
                        (raw_socket, remote_addr, slot)
                    })
                })
                .map(|(raw_socket, remote_addr, slot)| {
                    let mut io = make_framed(raw_socket, Arc::clone(&options));
                    io.read_half.slot = Some(slot);
                    (io, Endpoint::from_tcp_addr(remote_addr))
                })
                .map_err(|err| err.into());
            async_rt::task::spawn(cback(maybe_accepted));
        }
        Ok(())
    });
    Ok((
        endpoint,
        AcceptStopHandle(TaskHandle::new(stop_channel, task_handle)),
    ))
}

/// kvlane patch. Whether a new connection may take a slot.
enum Room {
    /// A slot is free (or was freed by evicting one).
    Free,
    /// Every open connection is protected: the new one is refused.
    Full,
}

/// kvlane patch. Makes room for one new accepted connection under
/// `max_connections`: evicts the unprotected connection the policy names;
/// while it names none, or `max` evicted connections have not ended yet,
/// waits (re-checking every millisecond) for a slot to free or the policy
/// to name one.
async fn make_room(
    max: usize,
    live: &std::sync::atomic::AtomicUsize,
    slots: &mut std::collections::VecDeque<Arc<crate::codec::SlotState>>,
    evicted: &mut Vec<Arc<crate::codec::SlotState>>,
    options: &crate::SocketOptions,
) -> Room {
    loop {
        slots.retain(|s| !s.is_released());
        evicted.retain(|s| !s.is_released());
        if live.load(std::sync::atomic::Ordering::Acquire) < max {
            return Room::Free;
        }
        let open: Vec<usize> = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_protected())
            .map(|(i, _)| i)
            .collect();
        if open.is_empty() && evicted.is_empty() {
            return Room::Full;
        }
        if evicted.len() < max {
            let choice = match &options.eviction_policy {
                Some(policy) => {
                    let views: Vec<crate::AcceptedSlot> =
                        open.iter().map(|&i| slots[i].view()).collect();
                    policy(&views, std::time::Instant::now())
                }
                None => (!open.is_empty()).then_some(0),
            };
            if let Some(victim) = choice
                .and_then(|c| open.get(c).copied())
                .and_then(|i| slots.remove(i))
            {
                log::debug!("max_connections reached: evicting an unprotected connection");
                victim.evict();
                evicted.push(victim);
                return Room::Free;
            }
        }
        async_rt::task::sleep(std::time::Duration::from_millis(1)).await;
    }
}

#[cfg(feature = "tokio-runtime")]
fn tune_socket_buffers(raw_socket: &TcpStream) {
    let socket = socket2::SockRef::from(raw_socket);
    if let Err(error) = socket.set_recv_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP receive buffer size: {error}");
    }
    if let Err(error) = socket.set_send_buffer_size(TCP_SOCKET_BUFFER_SIZE) {
        log::debug!("failed to set TCP send buffer size: {error}");
    }
}

#[cfg(not(feature = "tokio-runtime"))]
fn tune_socket_buffers(_raw_socket: &TcpStream) {}
