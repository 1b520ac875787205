//! `gradwire info`: what this host offers and which defaults gradwire will use, and why.

use gradwire::config::{Config, SETTINGS};

fn meminfo(key: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find(|l| l.starts_with(key)).map(|l| l[key.len()..].trim_start_matches(':').trim().to_string())
}

fn memlock() -> String {
    let note = if gradwire::mem::memlock_below(64 << 20) {
        " (small: RDMA registration of large buffers will fail; raise with `ulimit -l unlimited` or LimitMEMLOCK=infinity)"
    } else {
        ""
    };
    format!("{}{note}", gradwire::mem::memlock_text())
}

/// The local address that reaches the rendezvous host (what a rank's GID choice keys on).
fn bootstrap_ip() -> Option<std::net::IpAddr> {
    let host = ["GRADWIRE_MASTER_ADDR", "MASTER_ADDR"].iter().find_map(|k| std::env::var(k).ok())?;
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect((host.as_str(), 9)).ok()?;
    s.local_addr().ok().map(|a| a.ip())
}

/// The README's settings table.
pub fn settings_markdown() -> String {
    let mut s = String::from("| variable | default | meaning |\n|---|---|---|\n");
    for st in SETTINGS {
        s += &format!("| `{}` | `{}` | {} |\n", st.env, st.default, st.help);
    }
    s
}

pub fn run(settings_only: bool) -> i32 {
    if settings_only {
        print!("{}", settings_markdown());
        return 0;
    }
    println!("gradwire {}", env!("CARGO_PKG_VERSION"));
    println!("host identity      {}", gradwire::bootstrap::host_id());
    println!(
        "cpus               {} for this job's ranks on this host (online CPUs, capped by the control group's cpuset and CPU quota; ranks spin only when they do not outnumber them)",
        gradwire::sys::cpus::host_cpus()
    );
    let shm_ok = gradwire::Region::shared("gradwire-info", 4096).is_ok();
    println!("transports");
    println!("  shm              {}", if shm_ok { "available (memfd shared through /proc/<pid>/fd)" } else { "UNAVAILABLE: memfd_create failed" });
    println!("  tcp              available");
    match gradwire::transport::verbs_report(bootstrap_ip()) {
        Ok(report) => print!("{report}"),
        Err(e) => println!("  verbs            INVALID override: {e}"),
    }
    #[cfg(feature = "cuda")]
    match gradwire::gpu::unavailable() {
        None => {
            println!("  nccl (GPU)       available: {} CUDA device(s)", cudarc_devices());
            for line in gradwire::gpu::describe() {
                println!("                   {line}");
            }
        }
        Some(why) => println!("  nccl (GPU)       unavailable: {why}"),
    }
    #[cfg(not(feature = "cuda"))]
    println!("  nccl (GPU)       not built (cargo feature `cuda` is off)");
    println!(
        "huge pages         total {}, free {}, size {}",
        meminfo("HugePages_Total").unwrap_or_else(|| "?".into()),
        meminfo("HugePages_Free").unwrap_or_else(|| "?".into()),
        meminfo("Hugepagesize").unwrap_or_else(|| "?".into())
    );
    println!("RLIMIT_MEMLOCK     {}", memlock());
    match Config::from_env() {
        Ok(c) => {
            println!("effective settings");
            println!("  timeout          {} ms", c.timeout.as_millis());
            println!(
                "  transport        {:?}: {}",
                c.transport,
                match c.transport {
                    gradwire::TransportChoice::Auto => "shm between ranks of one host; between hosts verbs when an RDMA port is up, else tcp",
                    gradwire::TransportChoice::Shm => "shm only (all ranks must share a host)",
                    gradwire::TransportChoice::Tcp => "tcp everywhere (even inside a host)",
                    gradwire::TransportChoice::Verbs => "verbs everywhere (even inside a host)",
                }
            );
            println!(
                "  allreduce        {:?}: {}",
                c.algo,
                match c.algo {
                    gradwire::Algo::Auto => match &c.network {
                        Some(n) => format!(
                            "one-host shared-buffer reduction when all ranks share a host; else ring or recursive doubling by the cost model (network {:.3} Gbit/s, {:.1} us per step)",
                            8.0 / n.beta / 1e9,
                            n.alpha * 1e6
                        ),
                        None => format!("one-host shared-buffer reduction when all ranks share a host; else recursive doubling below {} B, ring above", c.small_bytes),
                    },
                    a => format!("forced to {a:?}"),
                }
            );
            println!("  verbs ring       {} B per peer and direction (registered)", c.ib_ring_bytes);
            println!("  shm ring         {} B per peer, staging {} B per rank", c.shm_ring_bytes, c.shm_stage_bytes);
            println!(
                "  shm stores       {}",
                match c.shm_stores {
                    gradwire::config::StagedStores::Auto =>
                        "auto: plain or streaming per size class, whichever times faster (GRADWIRE_LOG=debug shows each choice)",
                    gradwire::config::StagedStores::Plain => "plain (forced)",
                    gradwire::config::StagedStores::Streaming => "streaming, non-temporal (forced)",
                }
            );
            println!(
                "  shm large calls  {}",
                if c.shm_cma {
                    "zero-copy for gradwire_alloc buffers; private ones through cross-memory attach where the kernel allows it, else staged"
                } else {
                    "zero-copy for gradwire_alloc buffers; private ones staged (GRADWIRE_SHM_CMA=0)"
                }
            );
            println!("  waiting          spin {} us, then yield, then sleep", c.spin.as_micros());
            println!("  huge pages       {}", if c.hugepages { "requested (falls back to normal pages with a logged reason)" } else { "off" });
        }
        Err(e) => {
            println!("effective settings: INVALID: {e}");
            return 1;
        }
    }
    println!("settings (GRADWIRE_*)");
    for st in SETTINGS {
        let cur = std::env::var(st.env).ok();
        println!("  {:<26} {}", st.env, cur.map(|v| format!("= {v}")).unwrap_or_else(|| format!("(default {})", st.default)));
    }
    0
}

#[cfg(feature = "cuda")]
fn cudarc_devices() -> i32 {
    cudarc::driver::CudaContext::device_count().unwrap_or(0)
}
