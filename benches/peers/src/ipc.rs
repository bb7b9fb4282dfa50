//! ipc-channel's side: typed channels over Unix sockets, buffers as `IpcSharedMemory` (a
//! memfd per buffer, its descriptor passed with the message and mapped by the receiver).
//!
//! The child reaches the parent through an `IpcOneShotServer` whose name travels on the
//! command line, and sends back the channel ends the run uses.

use std::time::{Duration, Instant};

use ipc_channel::ipc::{self, IpcOneShotServer, IpcReceiver, IpcSender, IpcSharedMemory};

use crate::peer::{self, Peer};
use crate::place;
use crate::work::{
    batch_figures, f32_bytes, fill_f32_bytes, latency_figures, stream_expected, stream_figures,
    sum_f32_bytes, Ctx, Figures, Job, Res,
};

type Buf = IpcSharedMemory;
/// Pingpong's two channels, as the child hands them over: to the child, and back.
type Pair = (IpcSender<Buf>, IpcReceiver<Buf>);

/// ipc-channel's receiver makes room for this many descriptors in one message; a message
/// with more arrives cut short. A batch larger than this goes as several messages.
pub const MAX_REGIONS_PER_MESSAGE: usize = 64;

/// Runs `job` with this process where it is and the child on `child_cpu`.
pub fn run(job: &Job, child_cpu: Option<usize>) -> Res<Figures> {
    let n = job.elements();
    match *job {
        Job::PingPong { same, rounds, warmup, .. } => {
            let (server, name) = IpcOneShotServer::<Pair>::new().ctx("IpcOneShotServer")?;
            let peer = start(job, child_cpu, &name)?;
            let (_, (to, from)) = server.accept().ctx("accept")?;
            // "fresh": a new region made from the bytes of n ones (`from_bytes` is how the API
            // fills a region: it copies them in). "same": clones of one region.
            let ones = f32_bytes(n, 1.0);
            let one_buf = IpcSharedMemory::from_bytes(&ones);
            let one = || -> Res<Duration> {
                let t0 = Instant::now();
                let b = if same { one_buf.clone() } else { IpcSharedMemory::from_bytes(&ones) };
                to.send(b).ctx("send")?;
                let back = from.recv().ctx("recv")?;
                let rtt = t0.elapsed();
                drop(back);
                Ok(rtt / 2)
            };
            for _ in 0..warmup {
                one()?;
            }
            let lat = (0..rounds).map(|_| one()).collect::<Res<Vec<_>>>()?;
            peer.finish()?;
            Ok(latency_figures(lat))
        }
        Job::Stream { size, count } => {
            let (server, name) = IpcOneShotServer::<IpcReceiver<Buf>>::new().ctx("IpcOneShotServer")?;
            let peer = start(job, child_cpu, &name)?;
            let (_, rx) = server.accept().ctx("accept")?;
            let first = rx.recv().ctx("recv")?;
            let t0 = Instant::now();
            let mut total = sum_f32_bytes(&first);
            drop(first);
            for _ in 1..count {
                let b = rx.recv().ctx("recv")?;
                total += sum_f32_bytes(&b);
            }
            let dt = t0.elapsed().as_secs_f64();
            peer.finish()?;
            if total != stream_expected(n, count) {
                return Err(format!("stream: sum {total}, expected {}", stream_expected(n, count)));
            }
            Ok(stream_figures(size, count - 1, dt))
        }
        Job::Batch { k, count, .. } => {
            let (server, name) = IpcOneShotServer::<IpcReceiver<Vec<Buf>>>::new().ctx("IpcOneShotServer")?;
            let peer = start(job, child_cpu, &name)?;
            let (_, rx) = server.accept().ctx("accept")?;
            // One batch: its messages until k regions have come.
            let recv_batch = || -> Res<usize> {
                let mut got = 0;
                while got < k {
                    got += rx.recv().ctx("recv")?.len();
                }
                Ok(got)
            };
            recv_batch()?;
            let t0 = Instant::now();
            let mut got = 0;
            for _ in 1..count {
                got += recv_batch()?;
            }
            let dt = t0.elapsed().as_secs_f64();
            peer.finish()?;
            Ok(batch_figures(got, dt))
        }
    }
}

fn start(job: &Job, child_cpu: Option<usize>, server: &str) -> Res<Peer> {
    let mut args = vec!["ipc".to_string(), place::cpu_arg(child_cpu), server.to_string()];
    args.extend(job.to_args());
    Peer::start(&args)
}

/// The child's side; `args` are the words after "ipc" (see `start`).
pub fn peer_main(args: &[String]) -> Res<()> {
    let [cpu, server, rest @ ..] = args else {
        return Err(format!("ipc peer: bad arguments {args:?}"));
    };
    place::pin_child(place::parse_cpu(cpu)?)?;
    let (job, _) = Job::from_args(rest)?;
    let n = job.elements();
    match job {
        Job::PingPong { rounds, warmup, .. } => {
            let (to_tx, to_rx) = ipc::channel::<Buf>().ctx("channel")?;
            let (from_tx, from_rx) = ipc::channel::<Buf>().ctx("channel")?;
            IpcSender::<Pair>::connect(server.clone()).ctx("connect")?.send((to_tx, from_rx)).ctx("send")?;
            for _ in 0..rounds + warmup {
                let b = to_rx.recv().ctx("recv")?;
                from_tx.send(b).ctx("send")?;
            }
        }
        Job::Stream { count, .. } => {
            let (tx, rx) = ipc::channel::<Buf>().ctx("channel")?;
            IpcSender::<IpcReceiver<Buf>>::connect(server.clone()).ctx("connect")?.send(rx).ctx("send")?;
            // Each item is a new region filled with its index: the bytes are written once
            // into a scratch buffer and copied in by `from_bytes`, the API's way to fill one.
            let mut scratch = vec![0u8; n * 4];
            for i in 0..count {
                fill_f32_bytes(&mut scratch, i as f32);
                tx.send(IpcSharedMemory::from_bytes(&scratch)).ctx("send")?;
            }
        }
        Job::Batch { k, count, .. } => {
            let (tx, rx) = ipc::channel::<Vec<Buf>>().ctx("channel")?;
            IpcSender::<IpcReceiver<Vec<Buf>>>::connect(server.clone())
                .ctx("connect")?
                .send(rx)
                .ctx("send")?;
            let mut scratch = vec![0u8; n * 4];
            for i in 0..count {
                fill_f32_bytes(&mut scratch, i as f32);
                let mut batch: Vec<Buf> = (0..k).map(|_| IpcSharedMemory::from_bytes(&scratch)).collect();
                // Split only where one message cannot carry the whole batch.
                while batch.len() > MAX_REGIONS_PER_MESSAGE {
                    let rest = batch.split_off(MAX_REGIONS_PER_MESSAGE);
                    tx.send(batch).ctx("send")?;
                    batch = rest;
                }
                tx.send(batch).ctx("send")?;
            }
        }
    }
    peer::wait_for_parent()
}
