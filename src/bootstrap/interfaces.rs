//! This host's IPv4 interfaces (getifaddrs), read in one place: the verbs GID choice keys
//! on the bootstrap address's subnet, a unique id advertises an address of this host.

use std::net::Ipv4Addr;

/// One IPv4 address of a local interface.
#[derive(Clone, Copy, Debug)]
pub struct Ipv4Interface {
    /// The interface's address.
    pub addr: Ipv4Addr,
    /// Its netmask (the subnet is `addr & mask`).
    pub mask: Ipv4Addr,
    /// Whether the interface is administratively up (`IFF_UP`).
    pub up: bool,
    /// Whether it is a loopback interface (`IFF_LOOPBACK`).
    pub loopback: bool,
}

/// Every IPv4 address of this host's interfaces, in the kernel's order (empty if
/// getifaddrs fails).
pub fn ipv4_interfaces() -> Vec<Ipv4Interface> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list freed below; entries are read while it is alive.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: cur is a live node of the list.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        // SAFETY: the family is checked before either address is read as a sockaddr_in.
        unsafe {
            if (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET {
                continue;
            }
            let v4 = |p: *mut libc::sockaddr| Ipv4Addr::from(u32::from_be((*(p as *const libc::sockaddr_in)).sin_addr.s_addr));
            out.push(Ipv4Interface {
                addr: v4(ifa.ifa_addr),
                mask: v4(ifa.ifa_netmask),
                up: ifa.ifa_flags & libc::IFF_UP as u32 != 0,
                loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0,
            });
        }
    }
    // SAFETY: head came from getifaddrs and is not used after this.
    unsafe { libc::freeifaddrs(head) };
    out
}
