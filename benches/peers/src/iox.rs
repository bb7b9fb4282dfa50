//! iceoryx2's side: publish-subscribe services of `[f32]` slices in shared memory, with an
//! event service beside each one where the receiver sleeps.
//!
//! iceoryx2 hands a subscriber read-only samples that go back to their publisher, so a
//! received sample cannot be sent on: pingpong's child copies each one into a sample of
//! its own, and "same" copies one source buffer into a new sample every round.
//!
//! Three ways to wait for a sample:
//! - `poll`: spin on `receive()`; the publisher only sends.
//! - `block`: the publisher sends, then `notify()`s; the receiver tries `receive()` and, when
//!   empty, waits on its `Listener` (`timed_wait_one`), then tries again.
//! - `hybrid`: as `block`, but the receiver first spins on `receive()` for up to 50 µs.
//!
//! A publisher that finds a subscriber's buffer full waits (`RetryUntilDelivered`) only once
//! the subscriber has connected to it; before that, what does not fit is dropped. So a
//! producer first sends one sample to say that it exists, and starts only when the consumer,
//! having received it (and so connected), says go.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use iceoryx2::port::listener::Listener;
use iceoryx2::port::notifier::Notifier;
use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::prelude::*;
use iceoryx2::sample::Sample;
use iceoryx2::service::port_factory::event::PortFactory as EventService;
use iceoryx2::service::port_factory::publish_subscribe::PortFactory as PubSubService;

use crate::peer::{self, Peer};
use crate::place;
use crate::work::{
    batch_figures, latency_figures, stream_expected, stream_figures, sum_f32, Ctx, Figures, Job, Patience,
    Res,
};

type S = ipc::Service;
type Pub = Publisher<S, [f32], ()>;
type Sub = Subscriber<S, [f32], ()>;
type Smp = Sample<S, [f32], ()>;

/// How long `hybrid` spins before it sleeps.
pub const HYBRID_SPIN: Duration = Duration::from_micros(50);

/// How a receiver waits for a sample (see the module's notes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Poll,
    Block,
    Hybrid,
}

impl Wait {
    pub const ALL: [Wait; 3] = [Wait::Poll, Wait::Block, Wait::Hybrid];

    pub fn name(self) -> &'static str {
        match self {
            Wait::Poll => "poll",
            Wait::Block => "block",
            Wait::Hybrid => "hybrid",
        }
    }

    fn parse(s: &str) -> Res<Wait> {
        Wait::ALL.into_iter().find(|w| w.name() == s).ok_or_else(|| format!("bad wait {s:?}"))
    }
}

/// Where this program's iceoryx2 files go: a root directory and a file-name prefix of its
/// own (by pid), so that they are told apart from any other iceoryx2 user's and can be
/// checked and removed at the end.
#[derive(Clone, Debug)]
pub struct Files {
    pub root: String,
    pub prefix: String,
}

impl Files {
    pub fn for_this_process() -> Files {
        let pid = std::process::id();
        Files { root: format!("/tmp/iceoryx2-peers-{pid}/"), prefix: format!("iox2peers{pid}_") }
    }

    fn config(&self) -> Res<Config> {
        let mut c = Config::default();
        c.global.set_root_path(&Path::new(self.root.as_bytes()).ctx("iceoryx2 root path")?);
        c.global.prefix = FileName::new(self.prefix.as_bytes()).ctx("iceoryx2 prefix")?;
        Ok(c)
    }

    fn node(&self) -> Res<Node<S>> {
        // Errors come back as values; iceoryx2's own log would only repeat them (and warns
        // on every notification a full listener socket turns away, which `hybrid` causes
        // by design: the receiver often has its sample before the wake-up arrives).
        set_log_level(LogLevel::Error);
        NodeBuilder::new()
            .config(&self.config()?)
            // The benchmark handles no signals; leave the default dispositions alone.
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<S>()
            .ctx("iceoryx2 node")
    }
}

/// A service name no other run uses: this process's pid and a counter.
fn unique_base() -> String {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    format!("peers/{}/{}", std::process::id(), RUNS.fetch_add(1, Ordering::Relaxed))
}

/// One direction of a run: a pub-sub service with one publisher and one subscriber that
/// never loses a sample (no safe overflow: a full subscriber buffer holds the publisher
/// back), and an event service beside it unless the receiver polls.
struct Lane {
    pubsub: PubSubService<S, [f32], ()>,
    event: Option<EventService<S>>,
}

impl Lane {
    /// Creates (the parent) or opens (the child) the services named `name`, with the same
    /// settings on both sides (an open checks them).
    fn new(node: &Node<S>, name: &str, buffer: usize, wait: Wait, create: bool) -> Res<Lane> {
        let b = node
            .service_builder(&ServiceName::new(name).ctx("service name")?)
            .publish_subscribe::<[f32]>()
            .max_publishers(1)
            .max_subscribers(1)
            .max_nodes(2)
            .history_size(0)
            .subscriber_max_buffer_size(buffer)
            .enable_safe_overflow(false);
        let pubsub = if create { b.create().ctx("pub-sub create")? } else { b.open().ctx("pub-sub open")? };
        let event = match wait {
            Wait::Poll => None,
            Wait::Block | Wait::Hybrid => {
                let name = format!("{name}/wake");
                let e = node
                    .service_builder(&ServiceName::new(&name).ctx("service name")?)
                    .event()
                    .max_notifiers(1)
                    .max_listeners(1)
                    .max_nodes(2);
                Some(if create { e.create().ctx("event create")? } else { e.open().ctx("event open")? })
            }
        };
        Ok(Lane { pubsub, event })
    }
}

/// The sending end of a lane. (Fields drop in order: the ports before their services.)
struct Tx {
    publisher: Pub,
    notifier: Option<Notifier<S>>,
    _lane: Lane,
}

impl Tx {
    /// A publisher for slices of up to `max_len` f32 that waits while the subscriber's
    /// buffer is full (`RetryUntilDelivered`): nothing is dropped.
    fn new(lane: Lane, max_len: usize) -> Res<Tx> {
        let publisher = lane
            .pubsub
            .publisher_builder()
            .initial_max_slice_len(max_len)
            .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
            .create()
            .ctx("publisher")?;
        let notifier = match &lane.event {
            None => None,
            Some(e) => Some(e.notifier_builder().create().ctx("notifier")?),
        };
        Ok(Tx { publisher, notifier, _lane: lane })
    }

    /// Loans a sample of `n` f32, writes every element with `f`, sends it.
    fn send_with(&self, n: usize, f: impl FnMut(usize) -> f32) -> Res<()> {
        let s = self.publisher.loan_slice_uninit(n).ctx("loan")?.write_from_fn(f);
        s.send().ctx("send")?;
        Ok(())
    }

    /// Loans a sample as long as `src` and copies `src` into it, sends it.
    fn send_copy(&self, src: &[f32]) -> Res<()> {
        let s = self.publisher.loan_slice_uninit(src.len()).ctx("loan")?.write_from_slice(src);
        s.send().ctx("send")?;
        Ok(())
    }

    /// Says to the consumer that this publisher exists, and waits for its go: from then on
    /// a full buffer holds this publisher back instead of losing samples.
    fn hello(&self) -> Res<()> {
        self.send_with(1, |_| 0.0)?;
        self.wake()?;
        peer::wait_for_go()
    }

    /// Wakes the receiver, where it may sleep.
    fn wake(&self) -> Res<()> {
        if let Some(n) = &self.notifier {
            n.notify().ctx("notify")?;
        }
        Ok(())
    }
}

/// The receiving end of a lane.
struct Rx {
    subscriber: Sub,
    listener: Option<Listener<S>>,
    wait: Wait,
    _lane: Lane,
}

impl Rx {
    fn new(lane: Lane, buffer: usize, wait: Wait) -> Res<Rx> {
        let subscriber = lane.pubsub.subscriber_builder().buffer_size(buffer).create().ctx("subscriber")?;
        let listener = match &lane.event {
            None => None,
            Some(e) => Some(e.listener_builder().create().ctx("listener")?),
        };
        Ok(Rx { subscriber, listener, wait, _lane: lane })
    }

    fn try_recv(&self) -> Res<Option<Smp>> {
        self.subscriber.receive().ctx("receive")
    }

    /// The next sample, waiting the lane's way.
    fn recv(&self) -> Res<Smp> {
        if let Some(s) = self.try_recv()? {
            return Ok(s);
        }
        let mut patience = Patience::start();
        if self.wait == Wait::Hybrid {
            let t0 = Instant::now();
            let mut looks = 0u32;
            loop {
                if let Some(s) = self.try_recv()? {
                    return Ok(s);
                }
                looks += 1;
                // The clock costs more than a look: read it once per 16.
                if looks.is_multiple_of(16) && t0.elapsed() >= HYBRID_SPIN {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        match &self.listener {
            None => loop {
                if let Some(s) = self.try_recv()? {
                    return Ok(s);
                }
                patience.spin("iceoryx2 receive")?;
                std::hint::spin_loop();
            },
            Some(listener) => loop {
                // A wake-up may be stale (its sample taken by an earlier look): look again
                // after each one. The timeout only serves `PATIENCE`.
                listener.timed_wait_one(Duration::from_secs(1)).ctx("timed_wait_one")?;
                if let Some(s) = self.try_recv()? {
                    return Ok(s);
                }
                patience.check("iceoryx2 wait")?;
            },
        }
    }
}

/// Runs `job` with this process where it is and the child on `child_cpu`, waiting `wait`'s
/// way on both sides.
pub fn run(job: &Job, wait: Wait, child_cpu: Option<usize>, files: &Files) -> Res<Figures> {
    let node = files.node()?;
    let base = unique_base();
    let n = job.elements();
    let start = || -> Res<Peer> {
        let mut args = vec![
            "iox".into(),
            wait.name().into(),
            place::cpu_arg(child_cpu),
            files.root.clone(),
            files.prefix.clone(),
            base.clone(),
        ];
        args.extend(job.to_args());
        Peer::start(&args)
    };
    match *job {
        Job::PingPong { same, rounds, warmup, .. } => {
            let tx = Tx::new(Lane::new(&node, &format!("{base}/to-child"), 2, wait, true)?, n)?;
            let rx = Rx::new(Lane::new(&node, &format!("{base}/to-parent"), 2, wait, true)?, 2, wait)?;
            let peer = start()?;
            // The child's first sample says that its subscriber exists: what is sent before
            // reaches no one.
            drop(rx.recv()?);
            let ones = vec![1.0f32; n];
            let one = || -> Res<Duration> {
                let t0 = Instant::now();
                if same {
                    tx.send_copy(&ones)?;
                } else {
                    tx.send_with(n, |_| 1.0)?;
                }
                tx.wake()?;
                let back = rx.recv()?;
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
            let rx = Rx::new(Lane::new(&node, &format!("{base}/data"), 4, wait, true)?, 4, wait)?;
            let mut peer = start()?;
            drop(rx.recv()?);
            peer.go()?;
            let first = rx.recv()?;
            let t0 = Instant::now();
            let mut total = sum_f32(first.payload());
            drop(first);
            for i in 1..count {
                let s = rx.recv().map_err(|e| format!("{e} (item {i} of {count})"))?;
                total += sum_f32(s.payload());
            }
            let dt = t0.elapsed().as_secs_f64();
            peer.finish()?;
            if total != stream_expected(n, count) {
                return Err(format!("stream: sum {total}, expected {}", stream_expected(n, count)));
            }
            Ok(stream_figures(size, count - 1, dt))
        }
        Job::Batch { k, count, .. } => {
            // Room for four messages of k samples, as tensorshare's queue holds four lists.
            let rx = Rx::new(Lane::new(&node, &format!("{base}/data"), 4 * k, wait, true)?, 4 * k, wait)?;
            let mut peer = start()?;
            drop(rx.recv()?);
            peer.go()?;
            for _ in 0..k {
                drop(rx.recv()?);
            }
            let t0 = Instant::now();
            let mut got = 0;
            for i in 1..count {
                for _ in 0..k {
                    drop(rx.recv().map_err(|e| format!("{e} (message {i} of {count})"))?);
                    got += 1;
                }
            }
            let dt = t0.elapsed().as_secs_f64();
            peer.finish()?;
            Ok(batch_figures(got, dt))
        }
    }
}

/// The child's side; `args` are the words after "iox" (see `run`).
pub fn peer_main(args: &[String]) -> Res<()> {
    let [wait, cpu, root, prefix, base, rest @ ..] = args else {
        return Err(format!("iceoryx2 peer: bad arguments {args:?}"));
    };
    let wait = Wait::parse(wait)?;
    place::pin_child(place::parse_cpu(cpu)?)?;
    let (job, _) = Job::from_args(rest)?;
    let files = Files { root: root.clone(), prefix: prefix.clone() };
    let node = files.node()?;
    let n = job.elements();
    match job {
        Job::PingPong { rounds, warmup, .. } => {
            let rx = Rx::new(Lane::new(&node, &format!("{base}/to-child"), 2, wait, false)?, 2, wait)?;
            let tx = Tx::new(Lane::new(&node, &format!("{base}/to-parent"), 2, wait, false)?, n)?;
            // What the parent sends before our subscriber connects stays in its buffer (one
            // sample at a time fits): no go is needed here.
            tx.send_with(1, |_| 0.0)?;
            tx.wake()?;
            for _ in 0..rounds + warmup {
                let s = rx.recv()?;
                tx.send_copy(s.payload())?;
                tx.wake()?;
                drop(s);
            }
        }
        Job::Stream { count, .. } => {
            let tx = Tx::new(Lane::new(&node, &format!("{base}/data"), 4, wait, false)?, n)?;
            tx.hello()?;
            for i in 0..count {
                tx.send_with(n, |_| i as f32)?;
                tx.wake()?;
            }
        }
        Job::Batch { k, count, .. } => {
            let tx = Tx::new(Lane::new(&node, &format!("{base}/data"), 4 * k, wait, false)?, n)?;
            tx.hello()?;
            for i in 0..count {
                for _ in 0..k {
                    tx.send_with(n, |_| i as f32)?;
                }
                // One wake-up per message, as a user sending a list would.
                tx.wake()?;
            }
        }
    }
    peer::wait_for_parent()
}
