//! Memory layer: page-aligned regions (anonymous, huge-page or memfd-shared) and
//! `GradBuffer`, one flat region cut into named, aligned slots with typed views.
//!
//! A framework writes gradients straight into a slot and hands the slot to a collective,
//! so nothing is copied between the framework's tensor and the wire except where an
//! algorithm must. Memory the framework allocated itself can be made shared in place
//! ([`Registration`]), so that it too needs no copy between ranks of a host.
//!
//! Files: `region` (regions and their memfds), `registry` (shared regions by address),
//! `registration` (a caller's memory made shared in place), `grad_buffer`, `limits`.

mod grad_buffer;
mod limits;
mod region;
mod registration;
mod registry;

pub use grad_buffer::{GradBuffer, Slot, SLOT_ALIGN};
pub use limits::{host_memory, last_level_cache, memlock_below, memlock_text, page_size};
pub use region::{Region, RegionKind};
pub use registration::Registration;
pub use registry::{shared_cover, shared_region_of, SharedCover, SharedRegion};

#[cfg(test)]
mod tests {
    use super::region::memfd;
    use super::registry::shared_cover_at;
    use super::*;
    use crate::dtype::DType;
    use memmap2::MmapOptions;
    use std::fs::File;
    use std::os::fd::{AsRawFd, FromRawFd};

    #[test]
    fn slots_are_aligned_and_disjoint() {
        let mut g = GradBuffer::new(RegionKind::Anonymous, &[("w", 3, DType::F32), ("b", 5, DType::F64), ("h", 7, DType::F16)]).unwrap();
        for (_, s) in g.slots() {
            assert_eq!(s.offset % SLOT_ALIGN, 0);
        }
        g.view_mut::<f32>("w").unwrap().copy_from_slice(&[1.0, 2.0, 3.0]);
        g.view_mut::<f64>("b").unwrap().fill(7.5);
        assert_eq!(g.view::<f32>("w").unwrap(), &[1.0, 2.0, 3.0]);
        assert!(g.view::<f64>("w").is_err(), "dtype mismatch must be refused");
        assert!(g.view::<f32>("nope").is_err());
    }

    #[test]
    fn shared_region_is_visible_through_proc() {
        let mut r = Region::shared("t", 8192).unwrap();
        r.as_mut_slice()[100] = 42;
        let peer = Region::open_shared(std::process::id(), r.shared_fd().unwrap(), 8192).unwrap();
        assert_eq!(peer.as_slice()[100], 42);
    }

    /// A shared region is the owner's alone (0600) and its size is sealed: nobody can shrink
    /// it under the ranks that map it (an ftruncate used to kill every rank with SIGBUS),
    /// and a peer refuses to map a file that is not sealed so.
    #[test]
    fn shared_regions_are_private_to_their_user_and_cannot_shrink() {
        use std::os::unix::fs::PermissionsExt;
        let r = Region::shared("t", 8192).unwrap();
        let path = format!("/proc/{}/fd/{}", std::process::id(), r.shared_fd().unwrap());
        let tamper = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert_eq!(tamper.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        let shrink = tamper.set_len(0).unwrap_err();
        assert_eq!(shrink.raw_os_error(), Some(libc::EPERM), "{shrink}");
        assert!(tamper.set_len(1 << 20).is_err(), "growing must be refused too");
        assert_eq!(tamper.metadata().unwrap().len(), 8192);
        // A plain memfd (no seals) offered as a peer region.
        // SAFETY: a valid name and flags.
        let fd = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: the fd was just made and is owned by nobody else.
        let plain = unsafe { File::from_raw_fd(fd) };
        plain.set_len(8192).unwrap();
        let e = Region::open_shared(std::process::id(), fd, 8192).expect_err("an unsealed file must be refused").to_string();
        assert!(e.contains("not a size-sealed gradwire memfd"), "{e}");
    }

    #[test]
    fn shared_regions_are_found_by_address_until_dropped() {
        let r = Region::shared("t", 3 * page_size()).unwrap();
        let all = r.as_slice();
        let (found, off) = shared_region_of(&all[100..5000]).expect("inside a shared region");
        assert_eq!((off, found.len, Some(found.fd)), (100, r.len(), r.shared_fd()));
        assert_eq!(shared_region_of(all).map(|(_, off)| off), Some(0));
        let anon = Region::anonymous(4096).unwrap();
        assert!(shared_region_of(anon.as_slice()).is_none(), "private memory is not shared");
        assert!(shared_cover_at(all.as_ptr() as usize + page_size(), all.len()).is_none(), "a buffer running a page past the region's end");
        let (id, ptr) = (found.id, all.as_ptr());
        drop(r);
        let again = Region::shared("t", page_size()).unwrap();
        if let Some((r2, _)) = shared_region_of(again.as_slice()) {
            assert_ne!(r2.id, id, "a new region gets a new id even at the old address ({ptr:p})");
        }
    }

    /// A buffer that starts and ends inside pages, its data not zero (a `Vec`, as a
    /// framework's tensor would be).
    fn unaligned_buffer(pages: usize) -> (Vec<u8>, std::ops::Range<usize>) {
        let p = page_size();
        let mut v: Vec<u8> = (0..(pages + 2) * p).map(|i| (i * 7 % 251) as u8).collect();
        let skip = p - (v.as_ptr() as usize % p) + 100;
        let range = skip..skip + pages * p - 300;
        v[range.start - 1] = 1;
        (v, range)
    }

    #[test]
    fn registration_shares_the_whole_pages_in_place_and_gives_them_back() {
        let (mut v, range) = unaligned_buffer(5);
        let before = v.clone();
        let buf = &mut v[range.clone()];
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: the Vec's memory, which nothing else touches during the test.
        let reg = unsafe { Registration::new(ptr, len) }.unwrap();
        assert_eq!(v, before, "registering keeps every byte, in the buffer and around it");
        let cover = shared_cover(&v[range.clone()]).expect("a registered buffer is covered");
        let (start, n) = reg.shared_range();
        assert_eq!((cover.head, cover.tail, cover.offset), (start - (v.as_ptr() as usize + range.start), v.as_ptr() as usize + range.end - start - n, 0));
        assert!(cover.head < page_size() && cover.tail < page_size() && n == 3 * page_size(), "{cover:?}, {n}");
        assert!(shared_region_of(&v[range.clone()]).is_none(), "the ends are not in the region");
        // A peer maps the memfd and sees and changes what the buffer holds.
        let mut peer = Region::open_shared(std::process::id(), cover.region.fd, cover.region.len).unwrap();
        let at = start - v.as_ptr() as usize;
        assert_eq!(&peer.as_slice()[..64], &v[at..at + 64]);
        peer.as_mut_slice()[10] ^= 0xff;
        assert_eq!(v[at + 10], before[at + 10] ^ 0xff, "the buffer is the shared pages");
        drop(reg);
        assert!(shared_cover(&v[range.clone()]).is_none(), "deregistered");
        assert_eq!(v[at + 10], before[at + 10] ^ 0xff, "deregistering keeps the contents");
        peer.as_mut_slice()[11] ^= 0xff;
        assert_eq!(v[at + 11], before[at + 11], "the pages are private again");
    }

    #[test]
    fn registration_refuses_small_and_overlapping_buffers() {
        let (mut v, range) = unaligned_buffer(5);
        let p = page_size();
        let buf = v[range.clone()].as_mut_ptr();
        // SAFETY (all): the Vec's memory, which nothing else touches during the test.
        // SAFETY: as above.
        let small = unsafe { Registration::new(buf, p) }.unwrap_err().to_string();
        assert!(small.contains("no whole page"), "{small}");
        // SAFETY: as above.
        let reg = unsafe { Registration::new(buf, range.len()) }.unwrap();
        // SAFETY: as above.
        let twice = unsafe { Registration::new(buf.add(p), range.len() - p) }.unwrap_err().to_string();
        assert!(twice.contains("overlap"), "{twice}");
        drop(reg);
        // SAFETY: as above.
        drop(unsafe { Registration::new(buf, range.len()) }.expect("free again after deregistering"));
    }

    #[test]
    fn a_registered_buffer_freed_without_deregistering_is_private_from_then_on() {
        let n = 8 * page_size();
        let region = Region::anonymous(n).unwrap();
        // SAFETY: our own mapping, which nothing else touches.
        let reg = unsafe { Registration::new(region.as_ptr(), n) }.unwrap();
        let (start, len) = reg.shared_range();
        assert!(shared_cover_at(start, len).is_some());
        drop(region);
        // Someone else's memory comes to lie there: another memfd's, so that we can see
        // whether that mapping stays.
        let other = memfd("someone-else", n).unwrap();
        // SAFETY: MAP_FIXED_NOREPLACE replaces nothing (start..start+n was just unmapped).
        let at = unsafe {
            libc::mmap(start as *mut libc::c_void, n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE, other.as_raw_fd(), 0)
        };
        assert_eq!(at as usize, start, "the range was taken meanwhile");
        // SAFETY (all writes and reads below): start..start+n is that mapping.
        // SAFETY: as above.
        unsafe { *(start as *mut u8) = 0xab };
        drop(reg);
        // SAFETY: a second mapping of our own memfd.
        let mut view = unsafe { MmapOptions::new().len(n).map_mut(&other) }.unwrap();
        view[1] = 0xcd;
        // SAFETY: as above.
        assert_eq!(unsafe { (*(start as *const u8), *((start + 1) as *const u8)) }, (0xab, 0xcd), "deregistering replaced someone else's mapping");
        assert!(shared_cover_at(start, len).is_none(), "the mapping is not ours: not shared any more");
        // SAFETY: our mapping at start.
        unsafe { libc::munmap(start as *mut libc::c_void, n) };
    }

    #[test]
    fn only_private_anonymous_memory_is_registered() {
        let n = 4 * page_size();
        let file = memfd("a-file", n).unwrap();
        // SAFETY (all): mappings of our own memfd, which nothing else touches.
        // SAFETY: as above.
        let mut shared = unsafe { MmapOptions::new().len(n).map_mut(&file) }.unwrap();
        // SAFETY: as above.
        let mut private = unsafe { MmapOptions::new().len(n).map_copy(&file) }.unwrap();
        for map in [&mut shared, &mut private] {
            // SAFETY: as above.
            let e = unsafe { Registration::new(map.as_mut_ptr(), n) }.unwrap_err().to_string();
            assert!(e.contains("only private anonymous memory") && e.contains("memfd:a-file"), "{e}");
        }
        let alloc = Region::shared("t", n).unwrap();
        // SAFETY: as above.
        let e = unsafe { Registration::new(alloc.as_ptr(), n) }.unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn huge_falls_back() {
        let r = Region::huge(4096).unwrap();
        assert!(r.len() >= 4096);
    }
}
