//! Hosts for the chaos soak: one network namespace per host, each with a TUN device `fc0` on 10.77.0.0/24 and no
//! other route, so nothing can reach an address outside the soak. A switch in this process moves IPv4 packets
//! between the TUN devices and plays netem on every host's link, in both directions: each packet waits the link's
//! delay ± jitter (uniform, as `tc netem delay D J`) and is dropped with the link's loss probability, once for the
//! sender's link and once for the receiver's (as netem on both ends of a veth pair). The switch exists because
//! kernels without `sch_netem` (such as the 2-core reference VM) cannot run `tc qdisc ... netem`; TUN works anywhere.
//! [`Net`] deletes every namespace it made when dropped, also on errors and panics.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rand::{Rng, SeedableRng};

/// netem-like settings of one host's link (applied in each direction).
#[derive(Debug, Clone, Copy)]
pub(super) struct Link {
    /// Mean one-way delay.
    pub delay: Duration,
    /// Uniform jitter around the delay.
    pub jitter: Duration,
    /// Probability of dropping a packet, 0..=1.
    pub loss: f64,
}

impl Link {
    fn delay_sample(&self, rng: &mut impl Rng) -> Duration {
        let j = self.jitter.as_secs_f64();
        let d = self.delay.as_secs_f64() + rng.random_range(-j..=j);
        Duration::from_secs_f64(d.max(0.0))
    }
}

/// One emulated host: its namespace and address.
#[derive(Debug, Clone)]
pub(super) struct Host {
    /// Network namespace name (`ip netns exec NAME ...`).
    pub ns: String,
    /// Address of its `fc0` device.
    pub ip: Ipv4Addr,
}

/// A packet waiting for its delivery time.
struct Pending {
    due: Instant,
    seq: u64,
    to: usize,
    bytes: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(o.due, o.seq))
    }
}

/// A host's link now: its settings, and whether it is cut off or its loss is raised.
#[derive(Debug, Clone, Copy)]
struct LinkState {
    link: Link,
    down: bool,
    flapping: bool,
}

impl LinkState {
    fn now(&self, flap_loss: f64) -> Link {
        let loss = if self.down {
            1.0
        } else if self.flapping {
            flap_loss.max(self.link.loss)
        } else {
            self.link.loss
        };
        Link { loss, ..self.link }
    }
}

/// State shared by the switch's threads.
struct Switch {
    tuns: Vec<File>,
    ips: Vec<Ipv4Addr>,
    links: Mutex<Vec<LinkState>>,
    flap_loss: f64,
    queue: Mutex<(BinaryHeap<Reverse<Pending>>, u64)>,
    wake: Condvar,
    stop: AtomicBool,
}

/// The soak's hosts and the switch between them. Host 0 is the head's.
pub(super) struct Net {
    /// The hosts, head first.
    pub hosts: Vec<Host>,
    switch: Option<Arc<Switch>>,
    threads: Vec<JoinHandle<()>>,
    made: Vec<String>,
}

/// Runs `cmd`, failing with its stderr.
pub(super) fn sh(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    sh(Command::new("ip").args(args))
}

/// Moves the calling thread into the network namespace `ns` (threads it starts later are there too).
pub(super) fn enter_netns(ns: &str) -> Result<()> {
    let f = File::open(format!("/run/netns/{ns}"))
        .with_context(|| format!("opening network namespace {ns}"))?;
    // SAFETY: setns on a valid namespace fd; it changes only the calling thread's network namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "entering network namespace {ns}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Opens a TUN device named `fc0` inside `ns` (from a short-lived thread, so this thread's namespace is unchanged).
fn open_tun(ns: &str) -> Result<File> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter_netns(&ns)?;
        let tun = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .context("opening /dev/net/tun (is the tun driver available?)")?;
        // SAFETY: a zeroed ifreq is valid; the name fits with its terminating zero.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(b"fc0\0") {
            *d = *s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
        // SAFETY: TUNSETIFF with a valid ifreq on the fd just opened.
        if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF as _, &req) } != 0 {
            bail!(
                "creating a TUN device in {ns}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(tun)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the TUN thread panicked"))?
}

impl Net {
    /// Makes `count` hosts (namespaces `PREFIX-0`, `PREFIX-1`, ...; host 0 at 10.77.0.1, host i at 10.77.0.(10+i))
    /// with `link` on every link, and starts the switch; a flapping link loses `flap_loss` of its packets. Needs
    /// root (CAP_NET_ADMIN) and the tun driver.
    pub(super) fn create(
        prefix: &str,
        count: usize,
        link: Link,
        flap_loss: f64,
        seed: u64,
    ) -> Result<Net> {
        let mut net = Net {
            hosts: Vec::new(),
            switch: None,
            threads: Vec::new(),
            made: Vec::new(),
        };
        let mut tuns = Vec::new();
        for i in 0..count {
            let host = Host {
                ns: format!("{prefix}-{i}"),
                ip: Ipv4Addr::new(10, 77, 0, if i == 0 { 1 } else { 10 + i as u8 }),
            };
            ip(&["netns", "add", &host.ns]).context(
                "creating a network namespace (ferl-bench chaos needs root or CAP_NET_ADMIN)",
            )?;
            net.made.push(host.ns.clone());
            tuns.push(open_tun(&host.ns)?);
            let cidr = format!("{}/24", host.ip);
            ip(&["-n", &host.ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &host.ns, "addr", "add", &cidr, "dev", "fc0"])?;
            ip(&["-n", &host.ns, "link", "set", "fc0", "up"])?;
            net.hosts.push(host);
        }
        let switch = Arc::new(Switch {
            ips: net.hosts.iter().map(|h| h.ip).collect(),
            tuns,
            links: Mutex::new(vec![
                LinkState {
                    link,
                    down: false,
                    flapping: false,
                };
                count
            ]),
            flap_loss,
            queue: Mutex::new((BinaryHeap::new(), 0)),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        for from in 0..count {
            let s = switch.clone();
            let rng = rand::rngs::StdRng::seed_from_u64(seed ^ ((from as u64 + 1) << 32));
            net.threads
                .push(std::thread::spawn(move || s.read_loop(from, rng)));
        }
        let s = switch.clone();
        net.threads
            .push(std::thread::spawn(move || s.deliver_loop()));
        net.switch = Some(switch);
        Ok(net)
    }

    /// A handle that changes the links while the switch runs.
    pub(super) fn links(&self) -> Links {
        Links(self.switch.clone().expect("the switch runs"))
    }
}

/// Changes links of a running [`Net`].
#[derive(Clone)]
pub(super) struct Links(Arc<Switch>);

impl Links {
    /// Cuts host `host` off (every packet to or from it is lost, as for a powered-off machine), or reconnects it.
    pub(super) fn set_down(&self, host: usize, down: bool) {
        self.0.links.lock().expect("links lock")[host].down = down;
    }

    /// Raises host `host`'s loss to the flap loss, or lowers it back.
    pub(super) fn set_flapping(&self, host: usize, flapping: bool) {
        self.0.links.lock().expect("links lock")[host].flapping = flapping;
    }
}

impl Switch {
    /// Reads packets sent by host `from` and queues them for their destination.
    fn read_loop(&self, from: usize, mut rng: rand::rngs::StdRng) {
        let mut buf = vec![0u8; 65536];
        let fd = self.tuns[from].as_raw_fd();
        while !self.stop.load(Ordering::Relaxed) {
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut poll, 1, 100) } <= 0 {
                continue;
            }
            let Ok(n) = (&self.tuns[from]).read(&mut buf) else {
                continue;
            };
            self.route(from, &buf[..n], &mut rng);
        }
    }

    /// Applies both links' loss and delay to one IPv4 packet and queues it; anything else is dropped.
    fn route(&self, from: usize, packet: &[u8], rng: &mut impl Rng) {
        if packet.len() < 20 || packet[0] >> 4 != 4 {
            return;
        }
        let dst = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
        let Some(to) = self.ips.iter().position(|ip| *ip == dst) else {
            return;
        };
        let (a, b) = {
            let links = self.links.lock().expect("links lock");
            (
                links[from].now(self.flap_loss),
                links[to].now(self.flap_loss),
            )
        };
        if rng.random::<f64>() < a.loss || rng.random::<f64>() < b.loss {
            return;
        }
        let due = Instant::now() + a.delay_sample(rng) + b.delay_sample(rng);
        let mut q = self.queue.lock().expect("queue lock");
        q.1 += 1;
        let seq = q.1;
        q.0.push(Reverse(Pending {
            due,
            seq,
            to,
            bytes: packet.to_vec(),
        }));
        self.wake.notify_one();
    }

    /// Writes each queued packet to its destination's TUN device when its time comes.
    fn deliver_loop(&self) {
        let mut q = self.queue.lock().expect("queue lock");
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let wait = match q.0.peek() {
                Some(Reverse(p)) if p.due <= now => {
                    let Reverse(p) = q.0.pop().expect("peeked");
                    drop(q);
                    let _ = (&self.tuns[p.to]).write(&p.bytes);
                    q = self.queue.lock().expect("queue lock");
                    continue;
                }
                Some(Reverse(p)) => p.due - now,
                None => Duration::from_millis(100),
            };
            q = self.wake.wait_timeout(q, wait).expect("queue lock").0;
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if let Some(s) = &self.switch {
            s.stop.store(true, Ordering::Relaxed);
            s.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for ns in self.made.drain(..).rev() {
            if let Err(e) = ip(&["netns", "del", &ns]) {
                eprintln!("chaos: cleaning up: {e:#}");
            }
        }
    }
}
