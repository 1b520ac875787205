//! Which RDMA device, port and GID a rank uses, and why.
//!
//! [`scan`] reads every device's ports and GID table; [`choose`] is a pure function of that
//! scan, the bootstrap address and the `GRADWIRE_IB_*` overrides, so the rules are unit
//! tested without hardware. The rule: the RoCE v2 IPv4-mapped GID on the bootstrap
//! address's subnet (that is the path the bootstrap traffic already proved routable), else
//! any RoCE v2 IPv4-mapped GID, else GID 0 (InfiniBand), on the first ACTIVE port.

use super::sys as ffi;
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

/// What a user sees when libibverbs finds nothing.
pub const NO_DEVICE_HINT: &str = "no RDMA device found. libibverbs lists a device only when its kernel driver is loaded AND its \
userspace provider loads: check `ls /sys/class/infiniband` (kernel side; soft-RoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe \
netdev eth0`), /etc/libibverbs.d/*.driver and the provider library (Debian: package ibverbs-providers, e.g. \
/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so); IBV_SHOW_WARNINGS=1 prints why a provider did not load";

/// The RDMA devices the kernel has (`/sys/class/infiniband`), whether or not libibverbs
/// can use them.
pub fn kernel_devices() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/class/infiniband") else { return vec![] };
    dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()
}

/// The kind of a GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidKind {
    Ib,
    RoceV1,
    RoceV2,
}

impl GidKind {
    fn from_raw(t: u32) -> Self {
        match t {
            ffi::IBV_GID_TYPE_ROCE_V2 => GidKind::RoceV2,
            ffi::IBV_GID_TYPE_ROCE_V1 => GidKind::RoceV1,
            _ => GidKind::Ib,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            GidKind::Ib => "IB",
            GidKind::RoceV1 => "RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
        }
    }
}

/// One valid entry of a port's GID table.
#[derive(Clone, Debug)]
pub struct Gid {
    pub index: u32,
    pub raw: [u8; 16],
    pub kind: GidKind,
}

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        let r = &self.raw;
        (r[..10].iter().all(|&b| b == 0) && r[10] == 0xff && r[11] == 0xff).then(|| Ipv4Addr::new(r[12], r[13], r[14], r[15]))
    }
}

impl std::fmt::Display for Gid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ipv4() {
            Some(v4) => write!(f, "::ffff:{v4}"),
            None => write!(f, "{}", std::net::Ipv6Addr::from(self.raw)),
        }
    }
}

/// One port of a device.
#[derive(Clone, Debug)]
pub struct Port {
    pub num: u8,
    pub active: bool,
    pub state: String,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub ethernet: bool,
    pub lid: u16,
    pub gids: Vec<Gid>,
}

/// One device as libibverbs reports it.
#[derive(Clone, Debug)]
pub struct Device {
    pub name: String,
    pub ports: Vec<Port>,
}

/// `GRADWIRE_IB_DEV`, `GRADWIRE_IB_PORT`, `GRADWIRE_GID_INDEX`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub dev: Option<String>,
    pub port: Option<u8>,
    pub gid_index: Option<u32>,
}

/// The device, port and GID this process uses, with the reason.
#[derive(Clone, Debug)]
pub struct Choice {
    pub dev: String,
    pub port: u8,
    pub gid: Gid,
    pub mtu: u32,
    pub ethernet: bool,
    pub lid: u16,
    pub reason: String,
}

/// The IPv4 network (address, prefix length) of the local interface that holds `ip`.
pub fn subnet_of(ip: IpAddr) -> Option<(Ipv4Addr, u32)> {
    let IpAddr::V4(ip) = ip else { return None };
    let i = crate::bootstrap::interfaces::ipv4_interfaces().into_iter().find(|i| i.addr == ip)?;
    let mask = u32::from(i.mask);
    Some((Ipv4Addr::from(u32::from(ip) & mask), mask.count_ones()))
}

fn in_subnet(a: Ipv4Addr, (net, bits): (Ipv4Addr, u32)) -> bool {
    let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
    u32::from(a) & mask == u32::from(net)
}

fn list_gids(p: &Port) -> String {
    let v: Vec<String> = p.gids.iter().map(|g| format!("{} {} ({})", g.index, g, g.kind.name())).collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// The GID this port would use without `GRADWIRE_GID_INDEX`, and why.
fn preferred_gid(p: &Port, subnet: Option<(Ipv4Addr, u32)>) -> Option<(Gid, String)> {
    let v4: Vec<&Gid> = p.gids.iter().filter(|g| g.kind == GidKind::RoceV2 && g.ipv4().is_some()).collect();
    if let Some(net) = subnet {
        if let Some(g) = v4.iter().find(|g| g.ipv4().is_some_and(|a| in_subnet(a, net))) {
            return Some(((*g).clone(), format!("the RoCE v2 IPv4-mapped GID on the bootstrap subnet {}/{}", net.0, net.1)));
        }
    }
    if let Some(g) = v4.first() {
        let why = match subnet {
            Some(net) => format!("the first RoCE v2 IPv4-mapped GID (none is on the bootstrap subnet {}/{})", net.0, net.1),
            None => "the first RoCE v2 IPv4-mapped GID".to_string(),
        };
        return Some(((*g).clone(), why));
    }
    if !p.ethernet {
        return p.gids.iter().find(|g| g.index == 0).map(|g| (g.clone(), "GID 0 (InfiniBand link layer)".to_string()));
    }
    p.gids.iter().find(|g| g.kind == GidKind::RoceV2).or(p.gids.first()).map(|g| (g.clone(), format!("the only usable {} GID", g.kind.name())))
}

/// Picks device, port and GID (see the module text for the rule).
pub fn choose(devices: &[Device], local: Option<IpAddr>, o: &Overrides) -> Result<Choice> {
    if devices.is_empty() {
        return Err(Error::Unsupported(NO_DEVICE_HINT.into()));
    }
    let names = || devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ");
    let devs: Vec<&Device> = match &o.dev {
        Some(want) => {
            let d = devices
                .iter()
                .find(|d| &d.name == want)
                .ok_or_else(|| Error::Config(format!("GRADWIRE_IB_DEV={want}: no such RDMA device (present: {})", names())))?;
            vec![d]
        }
        None => devices.iter().collect(),
    };
    let subnet = local.and_then(subnet_of);
    let mut down = Vec::new();
    // Candidates in order: (device, port, preferred gid, reason); subnet matches first.
    let mut best: Option<(&Device, &Port, Gid, String, bool)> = None;
    for d in &devs {
        let ports: Vec<&Port> = match o.port {
            Some(n) => {
                let p = d.ports.iter().find(|p| p.num == n).ok_or_else(|| {
                    Error::Config(format!(
                        "GRADWIRE_IB_PORT={n}: {} has ports {}",
                        d.name,
                        d.ports.iter().map(|p| p.num.to_string()).collect::<Vec<_>>().join(", ")
                    ))
                })?;
                vec![p]
            }
            None => d.ports.iter().collect(),
        };
        for p in ports {
            if !p.active {
                down.push(format!("{} port {} is {}", d.name, p.num, p.state));
                continue;
            }
            let Some((g, why)) = preferred_gid(p, subnet) else {
                down.push(format!("{} port {} has no usable GID", d.name, p.num));
                continue;
            };
            let on_subnet = why.contains("on the bootstrap subnet");
            if best.as_ref().is_none_or(|b| on_subnet && !b.4) {
                best = Some((d, p, g, why, on_subnet));
            }
        }
    }
    let Some((d, p, auto_gid, why, _)) = best else {
        return Err(Error::Unsupported(format!(
            "no usable RDMA port: {}. A RoCE port is ACTIVE only when its netdev is up (`ip link set <dev> up`); choose another with GRADWIRE_IB_DEV / GRADWIRE_IB_PORT",
            down.join("; ")
        )));
    };
    let mut reason = format!(
        "{} port {}: {}{}",
        d.name,
        p.num,
        if o.dev.is_some() || o.port.is_some() { "set by GRADWIRE_IB_DEV/GRADWIRE_IB_PORT; " } else { "first ACTIVE port; " },
        format_args!("GID {} {} is {why}", auto_gid.index, auto_gid)
    );
    let gid = match o.gid_index {
        None => auto_gid,
        Some(i) => {
            let g = p.gids.iter().find(|g| g.index == i).cloned().ok_or_else(|| {
                Error::Config(format!("GRADWIRE_GID_INDEX={i}: GID {i} of {} port {} is empty or out of range (valid: {})", d.name, p.num, list_gids(p)))
            })?;
            if g.index != auto_gid.index {
                reason = format!(
                    "{} port {}: GID {} {} ({}) forced by GRADWIRE_GID_INDEX; the automatic choice would be GID {} {} ({why})",
                    d.name,
                    p.num,
                    g.index,
                    g,
                    g.kind.name(),
                    auto_gid.index,
                    auto_gid
                );
            }
            g
        }
    };
    Ok(Choice { dev: d.name.clone(), port: p.num, gid, mtu: p.mtu, ethernet: p.ethernet, lid: p.lid, reason })
}

fn port_state_name(v: &ffi::Verbs, state: u32) -> String {
    // SAFETY: ibv_port_state_str returns a static string for any value.
    let s = unsafe { (v.ibv_port_state_str)(state) };
    if s.is_null() {
        format!("state {state}")
    } else {
        // SAFETY: non-null static C string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

/// Reads every device's ports and GID tables.
pub fn scan() -> Result<Vec<Device>> {
    let mut out = Vec::new();
    for name in super::Context::names()? {
        let ctx = super::Context::open(&name)?;
        out.push(Device { name, ports: ctx.ports()? });
    }
    Ok(out)
}

impl super::Context {
    /// Ports and valid GIDs of this device.
    pub(crate) fn ports(&self) -> Result<Vec<Port>> {
        // SAFETY: all-zero is a valid value of this plain-integer struct.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: open context, attr is a valid out-parameter.
        let rc = unsafe { (self.v.ibv_query_device)(self.raw, &mut attr) };
        if rc != 0 {
            return Err(Error::io(format!("ibv_query_device({})", self.name), std::io::Error::from_raw_os_error(rc)));
        }
        let attrs = (1..=attr.phys_port_cnt).map(|n| self.query_port(n)).collect::<Result<Vec<_>>>()?;
        // The table holds at most the sum of the ports' GID table lengths.
        let total: usize = attrs.iter().map(|a| a.gid_tbl_len.max(0) as usize).sum();
        let mut entries = vec![ffi::ibv_gid_entry::default(); total.max(1)];
        // SAFETY: buffer of entries.len() entries of the stated size.
        let n = unsafe { (self.v._ibv_query_gid_table)(self.raw, entries.as_mut_ptr(), entries.len(), 0, std::mem::size_of::<ffi::ibv_gid_entry>()) };
        if n < 0 {
            return Err(Error::io(format!("ibv_query_gid_table({})", self.name), std::io::Error::from_raw_os_error((-n) as i32)));
        }
        entries.truncate(n as usize);
        let mut ports = Vec::new();
        for (num, pa) in (1..=attr.phys_port_cnt).zip(attrs) {
            let gids = entries
                .iter()
                .filter(|e| e.port_num == num as u32)
                .map(|e| Gid { index: e.gid_index, raw: e.gid.raw, kind: GidKind::from_raw(e.gid_type) })
                .collect();
            ports.push(Port {
                num,
                active: pa.state == ffi::IBV_PORT_ACTIVE,
                state: port_state_name(self.v, pa.state),
                mtu: 128u32 << pa.active_mtu.min(5),
                ethernet: pa.link_layer == ffi::IBV_LINK_LAYER_ETHERNET,
                lid: pa.lid,
                gids,
            });
        }
        Ok(ports)
    }

    pub(crate) fn query_port(&self, num: u8) -> Result<ffi::ibv_port_attr> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: open context; the exported symbol writes at most the compat layout, a
        // prefix of ibv_port_attr.
        let rc = unsafe { (self.v.ibv_query_port)(self.raw, num, &mut pa) };
        if rc != 0 {
            return Err(Error::io(format!("ibv_query_port({} port {num})", self.name), std::io::Error::from_raw_os_error(rc)));
        }
        Ok(pa)
    }
}

/// The report `gradwire info` prints: devices, ports, GID tables and the choice.
pub fn explain(local: Option<IpAddr>, o: &Overrides) -> String {
    let v = match ffi::verbs() {
        Ok(v) => v,
        Err(why) => return format!("  verbs            unavailable: {why}\n"),
    };
    let mut s = format!("  verbs            {} loaded\n", v.file);
    let devices = match scan() {
        Ok(d) => d,
        Err(e) => return s + &format!("  verbs            unavailable: {e}\n"),
    };
    if devices.is_empty() {
        return s + &format!("  verbs            unavailable: {NO_DEVICE_HINT}\n");
    }
    for d in &devices {
        for p in &d.ports {
            let _ = writeln!(
                s,
                "  {} port {}   {} ({}), MTU {}, {}",
                d.name,
                p.num,
                p.state,
                if p.ethernet { "Ethernet" } else { "InfiniBand" },
                p.mtu,
                format_args!("lid {}", p.lid)
            );
            for g in &p.gids {
                let _ = writeln!(s, "      gid[{}] {:<40} {}", g.index, g.to_string(), g.kind.name());
            }
        }
    }
    match choose(&devices, local, o) {
        Ok(c) => {
            let _ = writeln!(s, "  verbs choice     {} port {} GID {} {}: {}", c.dev, c.port, c.gid.index, c.gid, c.reason);
        }
        Err(e) => {
            let _ = writeln!(s, "  verbs choice     none: {e}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(index: u32, s: &str, kind: GidKind) -> Gid {
        let a: std::net::Ipv6Addr = s.parse().unwrap();
        Gid { index, raw: a.octets(), kind }
    }

    fn rxe(active: bool) -> Device {
        Device {
            name: "rxe0".into(),
            ports: vec![Port {
                num: 1,
                active,
                state: if active { "PORT_ACTIVE".into() } else { "PORT_DOWN".into() },
                mtu: 1024,
                ethernet: true,
                lid: 0,
                gids: vec![
                    gid(0, "fe80::5054:ff:fe12:3456", GidKind::RoceV2),
                    gid(1, "::ffff:10.0.2.15", GidKind::RoceV2),
                    gid(2, "::ffff:192.168.7.1", GidKind::RoceV2),
                ],
            }],
        }
    }

    #[test]
    fn prefers_the_ipv4_mapped_gid() {
        let c = choose(&[rxe(true)], None, &Overrides::default()).unwrap();
        assert_eq!(c.gid.index, 1);
        assert!(c.reason.contains("IPv4-mapped"), "{}", c.reason);
    }

    #[test]
    fn forced_gid_is_explained_and_checked() {
        let o = Overrides { gid_index: Some(0), ..Default::default() };
        let c = choose(&[rxe(true)], None, &o).unwrap();
        assert_eq!(c.gid.index, 0);
        assert!(c.reason.contains("forced by GRADWIRE_GID_INDEX") && c.reason.contains("would be GID 1"), "{}", c.reason);
        let o = Overrides { gid_index: Some(7), ..Default::default() };
        let e = choose(&[rxe(true)], None, &o).unwrap_err().to_string();
        assert!(e.contains("GRADWIRE_GID_INDEX=7") && e.contains("empty"), "{e}");
    }

    #[test]
    fn down_port_and_missing_device_say_what_to_do() {
        let e = choose(&[rxe(false)], None, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("rxe0 port 1 is PORT_DOWN") && e.contains("ip link set"), "{e}");
        let e = choose(&[], None, &Overrides::default()).unwrap_err().to_string();
        assert!(e.contains("no RDMA device") && e.contains("libibverbs.d"), "{e}");
        let e = choose(&[rxe(true)], None, &Overrides { dev: Some("mlx5_0".into()), ..Default::default() }).unwrap_err().to_string();
        assert!(e.contains("mlx5_0") && e.contains("rxe0"), "{e}");
    }

    #[test]
    fn subnet_match_wins() {
        assert!(in_subnet(Ipv4Addr::new(192, 168, 7, 9), (Ipv4Addr::new(192, 168, 7, 0), 24)));
        assert!(!in_subnet(Ipv4Addr::new(10, 0, 2, 15), (Ipv4Addr::new(192, 168, 7, 0), 24)));
        let p = &rxe(true).ports[0];
        let (g, why) = preferred_gid(p, Some((Ipv4Addr::new(192, 168, 7, 0), 24))).unwrap();
        assert_eq!(g.index, 2, "{why}");
        assert!(why.contains("bootstrap subnet"));
    }
}
