//! Pod IPs: one loopback address per pod. Linux routes all of 127.0.0.0/8 to
//! `lo`, so 127.0.x.y works without any setup. 127.0.0.0/24 is left to the
//! host (127.0.0.1 is the API server and the node's own address).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

/// Addresses 127.0.1.1 ..= 127.0.254.254 (y never 0 or 255). Allocation goes
/// round-robin, so a freed address is not handed out again at once (a client
/// of a deleted pod must not reach its successor by accident).
#[derive(Debug, Default)]
pub struct IpAlloc {
    used: BTreeSet<u32>,
    next: u32,
}

const PER_BLOCK: u32 = 254; // y = 1..=254
const BLOCKS: u32 = 254; // x = 1..=254
const SIZE: u32 = PER_BLOCK * BLOCKS;

fn addr(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, (1 + i / PER_BLOCK) as u8, (1 + i % PER_BLOCK) as u8)
}

fn index(ip: Ipv4Addr) -> Option<u32> {
    let [a, b, x, y] = ip.octets();
    (a == 127 && b == 0 && (1..=254).contains(&x) && (1..=254).contains(&y))
        .then(|| (x as u32 - 1) * PER_BLOCK + (y as u32 - 1))
}

impl IpAlloc {
    pub fn allocate(&mut self) -> Option<Ipv4Addr> {
        for k in 0..SIZE {
            let i = (self.next + k) % SIZE;
            if self.used.insert(i) {
                self.next = (i + 1) % SIZE;
                return Some(addr(i));
            }
        }
        None
    }

    /// Mark an address as taken (a pod that already has one). False when it
    /// is outside the pool or already taken.
    pub fn reserve(&mut self, ip: Ipv4Addr) -> bool {
        index(ip).is_some_and(|i| self.used.insert(i))
    }

    pub fn release(&mut self, ip: Ipv4Addr) {
        if let Some(i) = index(ip) {
            self.used.remove(&i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_loopback_addresses_outside_127_0_0() {
        let mut a = IpAlloc::default();
        let first = a.allocate().unwrap();
        assert_eq!(first, Ipv4Addr::new(127, 0, 1, 1));
        let mut seen = std::collections::HashSet::new();
        seen.insert(first);
        for _ in 0..600 {
            let ip = a.allocate().unwrap();
            assert!(ip.is_loopback());
            let [_, _, x, y] = ip.octets();
            assert!(x >= 1 && (1..=254).contains(&y), "{ip}");
            assert!(seen.insert(ip), "{ip} twice");
        }
        // 254 per block: the 255th is in the next block.
        assert!(seen.contains(&Ipv4Addr::new(127, 0, 2, 1)));
    }

    #[test]
    fn released_addresses_are_not_reused_at_once() {
        let mut a = IpAlloc::default();
        let x = a.allocate().unwrap();
        a.release(x);
        let y = a.allocate().unwrap();
        assert_ne!(x, y);
    }

    #[test]
    fn reserve_and_exhaustion() {
        let mut a = IpAlloc::default();
        assert!(a.reserve(Ipv4Addr::new(127, 0, 1, 1)));
        assert!(!a.reserve(Ipv4Addr::new(127, 0, 1, 1)));
        assert!(!a.reserve(Ipv4Addr::new(127, 0, 0, 1)));
        assert!(!a.reserve(Ipv4Addr::new(10, 0, 1, 1)));
        assert_eq!(a.allocate().unwrap(), Ipv4Addr::new(127, 0, 1, 2));
        let mut n = 2;
        while a.allocate().is_some() {
            n += 1;
        }
        assert_eq!(n, SIZE);
        a.release(Ipv4Addr::new(127, 0, 9, 9));
        assert_eq!(a.allocate().unwrap(), Ipv4Addr::new(127, 0, 9, 9));
    }
}
