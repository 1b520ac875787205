//! The cost model: how long each allreduce algorithm gradwire runs takes, from three numbers
//! per kind of link (Hockney's α-β model with a reduction term, as in Thakur, Rabenseifner
//! and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005):
//!
//! - α, seconds per step (a message's latency plus the software's cost per message);
//! - β, seconds per byte a rank's link carries in one direction (links are full duplex: a
//!   step that sends and receives S bytes costs α + Sβ);
//! - γ, seconds per byte reduced where the reduction waits for the data (recursive doubling
//!   reduces after each whole-buffer exchange; the ring and halving-doubling reduce as the
//!   bytes arrive, which the model counts as hidden behind β);
//! - σ, seconds a step waits for each rank more than one that shares a core with the
//!   others (the peer it waits on must first be scheduled): zero where every rank has a
//!   core of its own, as in a real job; fitted where the measured ranks time-shared a host
//!   (the namespace runs: up to 8 ranks on 2 cores).
//!
//! A job is N nodes of G ranks: the links between nodes are one [`Link`], the ranks of a
//! node share memory (another [`Link`], fitted from the one-host collectives). The
//! parameters come from measured runs ([`fit`]); `gradwire model` prints the predictions
//! and the choice, and the automatic choice over links asks [`choose_over_links`].

pub mod fit;

use std::fmt;

/// The α, β and γ of one kind of link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds per step.
    pub alpha: f64,
    /// Seconds per byte sent (1 / bandwidth).
    pub beta: f64,
    /// Seconds per byte reduced where the reduction is not hidden behind the transfer.
    pub gamma: f64,
    /// Seconds per step per rank beyond one on a core (σ).
    pub sigma: f64,
}

impl Link {
    /// A link of `gbit` Gbit/s with `alpha` seconds per step and `gamma` seconds per byte,
    /// between ranks that each have a core of their own.
    pub fn of_rate(gbit: f64, alpha: f64, gamma: f64) -> Link {
        Link { alpha, beta: 8.0 / (gbit * 1e9), gamma, sigma: 0.0 }
    }
}

/// An allreduce algorithm the model predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// The pipelined ring: 2(p−1) steps, 2(p−1)/p·S bytes each way.
    Ring,
    /// Recursive doubling: log2 p whole-buffer exchanges, each reduced after it arrives.
    RecursiveDoubling,
    /// Recursive halving then doubling (Rabenseifner): 2·log2 p steps, the ring's bytes.
    HalvingDoubling,
    /// The hierarchical allreduce, sharded: reduce-scatter in the node, a cross-node
    /// allreduce of each shard (the better of ring and recursive doubling), allgather in
    /// the node.
    Sharded,
    /// The hierarchical allreduce through one leader per node: reduce in the node, a
    /// cross-node allreduce of the whole buffer among the leaders, broadcast in the node.
    Leader,
}

impl Algorithm {
    /// The algorithms over links between single ranks.
    pub const OVER_LINKS: [Algorithm; 3] = [Algorithm::Ring, Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling];

    /// Its name as `GRADWIRE_ALGO` and the hierarchical calls spell it.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::HalvingDoubling => "hd",
            Algorithm::Sharded => "sharded",
            Algorithm::Leader => "leader",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How many of each term an algorithm's time has: steps (× α), bytes sent (× β) and bytes
/// reduced in the open (× γ). Linear in the parameters, so a fit is least squares.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Terms {
    /// Steps, each costing α.
    pub steps: f64,
    /// Bytes a rank sends (and receives at once), each costing β.
    pub bytes: f64,
    /// Bytes reduced while nothing else moves, each costing γ.
    pub reduced: f64,
    /// Steps times the ranks beyond one per core, each costing σ.
    pub shared: f64,
}

impl Terms {
    /// The time these terms take on `link`.
    pub fn time(self, link: &Link) -> f64 {
        self.steps * link.alpha + self.bytes * link.beta + self.reduced * link.gamma + self.shared * link.sigma
    }

    /// These terms where `ranks_per_core` ranks time-share each core (1 or fewer: none do).
    pub fn sharing(self, ranks_per_core: f64) -> Terms {
        Terms { shared: self.steps * (ranks_per_core - 1.0).max(0.0), ..self }
    }

    fn plus(self, o: Terms) -> Terms {
        Terms { steps: self.steps + o.steps, bytes: self.bytes + o.bytes, reduced: self.reduced + o.reduced, shared: self.shared + o.shared }
    }
}

/// The largest power of two not above `p` (p ≥ 1).
fn power_of_two_below(p: usize) -> usize {
    1 << (usize::BITS - 1 - p.leading_zeros())
}

/// The terms of an allreduce of `bytes` over `p` ranks joined by one kind of link, for the
/// algorithms that run over links between single ranks ([`Algorithm::OVER_LINKS`]).
/// gradwire folds a world that is not a power of two onto the largest power of two below
/// it: the extra ranks hand their buffer over first and get the result back last (two
/// whole-buffer steps and one reduction more).
pub fn flat_terms(algo: Algorithm, bytes: f64, p: usize) -> Terms {
    if p <= 1 {
        return Terms::default();
    }
    let q = power_of_two_below(p);
    let log_q = q.trailing_zeros() as f64;
    let fold = if q == p { Terms::default() } else { Terms { steps: 2.0, bytes: 2.0 * bytes, reduced: bytes, ..Terms::default() } };
    let pf = p as f64;
    match algo {
        Algorithm::Ring => Terms { steps: 2.0 * (pf - 1.0), bytes: 2.0 * (pf - 1.0) / pf * bytes, ..Terms::default() },
        Algorithm::RecursiveDoubling => Terms { steps: log_q, bytes: log_q * bytes, reduced: log_q * bytes, ..Terms::default() }.plus(fold),
        Algorithm::HalvingDoubling => {
            let qf = q as f64;
            Terms { steps: 2.0 * log_q, bytes: 2.0 * (qf - 1.0) / qf * bytes, ..Terms::default() }.plus(fold)
        }
        Algorithm::Sharded | Algorithm::Leader => panic!("{algo} is hierarchical: see hierarchical_time"),
    }
}

/// The predicted time of an allreduce of `bytes` over `p` ranks on `link`.
pub fn flat_time(algo: Algorithm, bytes: f64, p: usize, link: &Link) -> f64 {
    flat_terms(algo, bytes, p).time(link)
}

/// The faster of ring and recursive doubling for `bytes` over `p` ranks on `link`, the
/// choice gradwire's automatic algorithm makes over links (halving-doubling is chosen
/// by name only), with its time.
pub fn choose_over_links(bytes: f64, p: usize, link: &Link) -> (Algorithm, f64) {
    choose_over_links_sharing(bytes, p, 1.0, link)
}

/// [`choose_over_links`] where `ranks_per_core` ranks time-share each core (σ counts).
pub fn choose_over_links_sharing(bytes: f64, p: usize, ranks_per_core: f64, link: &Link) -> (Algorithm, f64) {
    [Algorithm::RecursiveDoubling, Algorithm::Ring]
        .into_iter()
        .map(|a| (a, flat_terms(a, bytes, p).sharing(ranks_per_core).time(link)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
        .expect("two candidates")
}

/// A job's shape and links: `nodes` nodes of `per_node` ranks.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    /// Nodes.
    pub nodes: usize,
    /// Ranks per node.
    pub per_node: usize,
    /// Between nodes.
    pub network: Link,
    /// Inside a node (shared memory, or NCCL inside a GPU node).
    pub node: Link,
}

/// The predicted time of an allreduce of `bytes` over every rank of `job`, by the
/// hierarchical algorithms or a flat one over the network (every rank its own node's
/// only link user when `per_node` = 1).
pub fn job_time(algo: Algorithm, bytes: f64, job: &Job) -> f64 {
    let (n, g) = (job.nodes, job.per_node);
    let gf = g as f64;
    // Inside a node: a reduce-scatter or an allgather is half of a ring allreduce.
    let half_ring = |b: f64| Terms { steps: gf - 1.0, bytes: (gf - 1.0) / gf * b, ..Terms::default() };
    let cross = |b: f64| choose_over_links(b, n, &job.network).1;
    match algo {
        Algorithm::Sharded if g > 1 => 2.0 * half_ring(bytes).time(&job.node) + cross(bytes / gf),
        Algorithm::Leader if g > 1 => {
            // A binomial reduce and broadcast in the node, each log2 G whole-buffer steps.
            let tree = (gf.log2().ceil()) * (job.node.alpha + bytes * job.node.beta);
            2.0 * tree + (gf.log2().ceil()) * bytes * job.node.gamma + cross(bytes)
        }
        Algorithm::Sharded | Algorithm::Leader => cross(bytes),
        flat => flat_time(flat, bytes, n * g, &job.network),
    }
}

/// The communication a DASO rank waits for per batch in its cycling phase (§1 of
/// docs/algorithms.md), averaged over the batches, beside plain data parallelism's
/// allreduce of the gradients every batch.
#[derive(Clone, Copy, Debug)]
pub struct DasoStep {
    /// Batches between global sends (gs).
    pub global_skip: usize,
    /// Batches between node-local gradient averages (ls).
    pub local_skip: usize,
    /// Batches between a send and the merge of its sum (W): the cross-node allreduce runs
    /// behind that many batches of computation.
    pub batches_to_wait: usize,
    /// One batch's computation (forward, backward, optimizer step), seconds.
    pub compute: f64,
}

impl DasoStep {
    /// Seconds of communication per batch a DASO rank waits for, for a model of `bytes`
    /// (float32 parameters and gradients) on `job`: the node-local gradient average on
    /// the batches it runs, the node broadcast after each merge, and whatever of the
    /// cross-node allreduce (one local index's ranks, the whole model) the batches to wait
    /// do not hide.
    pub fn wait_per_batch(&self, bytes: f64, job: &Job) -> f64 {
        let local = flat_time(Algorithm::Ring, bytes, job.per_node, &job.node);
        let broadcast = if job.per_node > 1 { (job.per_node as f64).log2().ceil() * (job.node.alpha + bytes * job.node.beta) } else { 0.0 };
        let cross = choose_over_links(bytes, job.nodes, &job.network).1;
        let hidden = self.batches_to_wait as f64 * self.compute;
        let gs = self.global_skip.max(1) as f64;
        // Between two sends: the send batch, the batches up to its merge, then every ls-th.
        let averaged = ((1 + self.batches_to_wait) as f64 + (gs - 1.0 - self.batches_to_wait as f64).max(0.0) / self.local_skip.max(1) as f64).min(gs);
        (averaged * local + broadcast + (cross - hidden).max(0.0)) / gs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_follow_the_textbook_forms() {
        // p = 8, a power of two.
        let s = 1e6;
        assert_eq!(flat_terms(Algorithm::Ring, s, 8), Terms { steps: 14.0, bytes: 2.0 * 7.0 / 8.0 * s, reduced: 0.0, shared: 0.0 });
        assert_eq!(flat_terms(Algorithm::RecursiveDoubling, s, 8), Terms { steps: 3.0, bytes: 3.0 * s, reduced: 3.0 * s, shared: 0.0 });
        assert_eq!(flat_terms(Algorithm::HalvingDoubling, s, 8), Terms { steps: 6.0, bytes: 2.0 * 7.0 / 8.0 * s, reduced: 0.0, shared: 0.0 });
        // p = 6 folds onto 4: two whole-buffer steps and a reduction more.
        assert_eq!(flat_terms(Algorithm::RecursiveDoubling, s, 6), Terms { steps: 4.0, bytes: 4.0 * s, reduced: 3.0 * s, shared: 0.0 });
        assert_eq!(flat_terms(Algorithm::Ring, s, 1), Terms::default());
        // 8 ranks on 2 cores: every step waits for 3 ranks more per core.
        assert_eq!(flat_terms(Algorithm::Ring, s, 8).sharing(4.0).shared, 14.0 * 3.0);
        assert_eq!(flat_terms(Algorithm::Ring, s, 8).sharing(0.5).shared, 0.0);
    }

    #[test]
    fn the_choice_moves_to_the_ring_as_buffers_grow() {
        let link = Link::of_rate(10.0, 20e-6, 0.2e-9);
        assert_eq!(choose_over_links(4096.0, 8, &link).0, Algorithm::RecursiveDoubling);
        assert_eq!(choose_over_links(64e6, 8, &link).0, Algorithm::Ring);
        // The crossover grows with the latency.
        let slow = Link { alpha: 2e-3, ..link };
        assert_eq!(choose_over_links(1e6, 8, &slow).0, Algorithm::RecursiveDoubling);
    }

    #[test]
    fn sharding_divides_the_network_bytes_by_the_ranks_of_a_node() {
        let network = Link::of_rate(25.0, 10e-6, 0.0);
        let node = Link::of_rate(1000.0, 2e-6, 0.0);
        let job = Job { nodes: 16, per_node: 8, network, node };
        let s = 400e6;
        let sharded = job_time(Algorithm::Sharded, s, &job);
        let flat = job_time(Algorithm::Ring, s, &job);
        assert!(sharded < flat / 4.0, "sharded {sharded} flat {flat}");
        // The rest is the node's reduce-scatter and allgather, each (G-1)/G of the buffer.
        let cross = choose_over_links(s / 8.0, 16, &network).1;
        let in_node = 2.0 * (7.0 * node.alpha + 7.0 / 8.0 * s * node.beta);
        assert!((sharded - cross - in_node).abs() < 1e-9, "{sharded} = {cross} + {in_node}");
    }

    #[test]
    fn daso_hides_its_global_allreduce_behind_the_batches_it_waits() {
        let job = Job { nodes: 64, per_node: 4, network: Link::of_rate(25.0, 10e-6, 0.0), node: Link::of_rate(1000.0, 2e-6, 0.0) };
        let bytes = 400e6;
        let slow = DasoStep { global_skip: 4, local_skip: 1, batches_to_wait: 1, compute: 1e-3 };
        let fast = DasoStep { compute: 10.0, ..slow };
        assert!(fast.wait_per_batch(bytes, &job) < slow.wait_per_batch(bytes, &job));
        let ddp = job_time(Algorithm::Sharded, bytes, &job);
        assert!(fast.wait_per_batch(bytes, &job) < ddp, "with compute to hide behind, DASO waits less than DDP");
    }
}
